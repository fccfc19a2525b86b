// The C# Client, driven against a CartPole engine: tests/python/test_csharp_engine.py
// runs it and replays the same actions and commands with a Python client on a second
// engine of the same seed; every line printed here must be the one Python computes.
//
//   LD_LIBRARY_PATH=target/debug mono ClientCheck.exe NAME STEPS
//   LD_LIBRARY_PATH=target/debug mono ClientCheck.exe --exceptions
//
// Prints: the zero-copy check (the obs span's address inside this process's mapping of
// /dev/shm/NAME), then one line per frame (frame number, then obs, rewards, terminated
// and truncated as hex bytes), a reset with seeds, set_pole_length's reply, a refused
// call's message, and more frames at the new length.
using System;
using System.Collections.Generic;
using System.Globalization;
using System.IO;
using System.Text;
using Shmbridge;

static class ClientCheck
{
    static string Hex<T>(Tensor<T> t) where T : struct
    {
        var bytes = System.Runtime.InteropServices.MemoryMarshal.AsBytes(t.Span);
        var sb = new StringBuilder(bytes.Length * 2);
        foreach (byte b in bytes) sb.Append(b.ToString("x2", CultureInfo.InvariantCulture));
        return sb.ToString();
    }

    static unsafe bool InsideMapping(IntPtr address, long bytes, string name)
    {
        foreach (string line in File.ReadAllLines("/proc/self/maps"))
        {
            if (!line.EndsWith("/dev/shm/" + name)) continue;
            string[] range = line.Split(' ')[0].Split('-');
            ulong start = ulong.Parse(range[0], NumberStyles.HexNumber);
            ulong end = ulong.Parse(range[1], NumberStyles.HexNumber);
            ulong a = (ulong)address.ToInt64();
            if (start <= a && a + (ulong)bytes <= end) return true;
        }
        return false;
    }

    /// <summary>Each status's exception: the class Native.Check throws, and whether a
    /// `catch (Shmbridge.TimeoutException)` catches it.</summary>
    static int Exceptions()
    {
        foreach (Status status in Enum.GetValues(typeof(Status)))
        {
            if (status == Status.Ok) continue;
            try
            {
                Native.Check(status);
                Console.WriteLine($"{status} nothing thrown");
            }
            catch (ShmbridgeException e)
            {
                Console.WriteLine($"{status} {e.GetType().Name} timeout={e is Shmbridge.TimeoutException}");
            }
        }
        return 0;
    }

    static int Main(string[] argv)
    {
        if (argv.Length == 1 && argv[0] == "--exceptions") return Exceptions();
        if (argv.Length != 2)
        {
            Console.Error.WriteLine("usage: ClientCheck.exe NAME STEPS");
            return 2;
        }
        string name = argv[0];
        int steps = int.Parse(argv[1], CultureInfo.InvariantCulture);
        try
        {
            using (var client = new Client(name))
            {
                var obs = client.Tensor<float>("obs");
                var actions = client.Tensor<long>("actions");
                var rewards = client.Tensor<float>("rewards");
                var terminated = client.Tensor<byte>("terminated");
                var truncated = client.Tensor<byte>("truncated");
                int n = (int)client.NumEnvs;
                bool inside = InsideMapping(obs.Address, obs.Length * 4L, name);
                Console.WriteLine($"zero-copy {(inside ? "same memory" : "DIFFERENT")}");

                for (int k = 0; k < 2 * steps; k++)
                {
                    if (k == steps)
                    {
                        ulong at = client.Reset(new uint[] { 1, 3 }, new ulong[] { 42 });
                        Console.WriteLine($"reset {at} {Hex(obs)}");
                        var reply = client.Call("set_pole_length",
                            new Dictionary<string, string> { ["length"] = "0.75" });
                        Console.WriteLine($"set_pole_length previous={reply.Args["previous"]} payload={reply.Payload.Length}");
                        try
                        {
                            client.Call("no_such_method", null, new byte[] { 1, 2, 3 });
                            Console.WriteLine("no_such_method answered");
                        }
                        catch (RemoteException e)
                        {
                            Console.WriteLine($"refused {e.Status}: {e.Message}");
                        }
                    }
                    var a = actions.Span;
                    for (int i = 0; i < n; i++) a[i] = (k * 7 + i * 3) % 5 < 2 ? 1 : 0;
                    ulong frame = client.Step();
                    Console.WriteLine($"frame {frame} {Hex(obs)} {Hex(rewards)} {Hex(terminated)} {Hex(truncated)}");
                }
            }
            Console.WriteLine("closed");
            return 0;
        }
        catch (ShmbridgeException e)
        {
            Console.Error.WriteLine($"ClientCheck: {e.Status}: {e.Message}");
            return 1;
        }
    }
}
