// CartPole-v1 as a shmbridge engine in C#, through bindings/csharp (P/Invoke over the C
// ABI). The same environment as the Rust reference engine and examples/c: seeded resets
// (env e's stream is PCG32 seeded from seed + e, as rand_pcg seeds it), same-step
// autoreset, reset_mask, final_obs, Reset commands with env ids and seeds,
// set_pole_length; its frames agree with the Rust engine's bit for bit on the same seeds
// (tests/python/test_csharp_engine.py checks 10,000 steps).
//
// StateBuffer is the shared memory itself: the agents write observations in place, and
// Publish() only bumps the frame counter. Follows the engine CLI convention
// (docs/protocol.md §9): prints the region name once frame 0 is published, serves until
// the client closes.
//
//   mcs -target:library -unsafe -langversion:7.2 -out:Shmbridge.dll bindings/csharp/Shmbridge.cs
//   mcs -unsafe -langversion:7.2 -r:Shmbridge.dll -out:CartPoleEngine.exe examples/csharp/CartPoleEngine.cs
//   mono CartPoleEngine.exe [--num-envs N] [--seed S] [--name NAME] [--self-check]
// Shmbridge.dll beside the .exe; libshmbridge.so where the loader finds it (installed in
// /usr/local/lib, or LD_LIBRARY_PATH=<prefix>/lib): docs/c-api.md, "C#".
using System;
using System.Collections.Generic;
using System.Globalization;
using System.IO;
using Shmbridge;

struct Pcg32
{
    ulong state, increment;

    static uint Rotr(uint x, int r) => (x >> r) | (x << ((32 - r) & 31));

    public uint Next()
    {
        ulong old = state;
        state = old * 6364136223846793005UL + increment;
        return Rotr((uint)(((old >> 18) ^ old) >> 27), (int)(old >> 59));
    }

    // rand_core 0.10's seed_from_u64: four outputs of a fixed PCG32 make the 16-byte
    // seed (state, increment | 1); then rand_pcg's from_state_incr.
    public static Pcg32 SeedFromU64(ulong s)
    {
        var words = new uint[4];
        for (int i = 0; i < 4; i++)
        {
            s = s * 0x5851F42D4C957F2DUL + 0xA17654E46FBE17F3UL;
            words[i] = Rotr((uint)(((s >> 18) ^ s) >> 27), (int)(s >> 59));
        }
        var g = new Pcg32 { state = words[0] | ((ulong)words[1] << 32), increment = (words[2] | ((ulong)words[3] << 32)) | 1 };
        g.state += g.increment;
        g.state = g.state * 6364136223846793005UL + g.increment;
        return g;
    }

    // random_range(low..high) for f64, as rand 0.10 draws it.
    public double Uniform(double low, double high)
    {
        ulong lo = Next(), hi = Next();
        double value1_2 = BitConverter.Int64BitsToDouble((long)((((hi << 32) | lo) >> 12) | 0x3FF0000000000000UL));
        double scale = high - low;
        return (value1_2 - 1.0) * scale + low;
    }
}

sealed class CartPole : ICommandHandler
{
    const double Gravity = 9.8, MassCart = 1.0, MassPole = 0.1, TotalMass = MassCart + MassPole;
    const double ForceMag = 10.0, Tau = 0.02, XThreshold = 2.4;
    const double ThetaThreshold = 12.0 * 2.0 * Math.PI / 360.0;
    const uint MaxSteps = 500;

    readonly uint numEnvs;
    readonly double[] state;   // [numEnvs * 4], kept in double, written as float
    readonly uint[] steps;
    readonly Pcg32[] rngs;
    double length = 0.5;

    // The shared tensors, taken once from the engine.
    readonly Tensor<float> obs, rewards, finalObs;
    readonly Tensor<long> actions;
    readonly Tensor<byte> terminated, truncated, resetMask;

    /// <summary>The Rust cartpole's tensors and schema metadata, in its order: the
    /// standard six and final_obs.</summary>
    public static EngineSpec Spec(string kind, uint numEnvs) => new EngineSpec(kind, numEnvs)
        .Standard(4, 1, DType.I64)
        .Tensor("final_obs", DType.F32, new ulong[] { numEnvs, 4 }, Direction.EngineToClient)
        .Metadata("env_id", "CartPole-v1")
        .Metadata("autoreset_mode", "same-step")
        .Metadata("observation_low", "-4.8,-inf,-0.41887902047863906,-inf")
        .Metadata("observation_high", "4.8,inf,0.41887902047863906,inf")
        .Metadata("action_space", "discrete:2")
        .Metadata("max_episode_steps", "500")
        .Metadata("final_obs", "final_obs");

    public CartPole(Engine engine, ulong seed)
    {
        numEnvs = engine.NumEnvs;
        state = new double[numEnvs * 4];
        steps = new uint[numEnvs];
        rngs = new Pcg32[numEnvs];
        obs = engine.Tensor<float>("obs");
        actions = engine.Tensor<long>("actions");
        rewards = engine.Tensor<float>("rewards");
        terminated = engine.Tensor<byte>("terminated");
        truncated = engine.Tensor<byte>("truncated");
        resetMask = engine.Tensor<byte>("reset_mask");
        finalObs = engine.Tensor<float>("final_obs");
        for (uint i = 0; i < numEnvs; i++)
        {
            rngs[i] = Pcg32.SeedFromU64(seed + i);
            ResetOne(i);
        }
        WriteObs(obs.Span);
        WriteObs(finalObs.Span);
    }

    void ResetOne(uint i)
    {
        for (int k = 0; k < 4; k++) state[4 * i + k] = rngs[i].Uniform(-0.05, 0.05);
        steps[i] = 0;
    }

    void WriteState(Span<float> buffer, uint i)
    {
        for (int k = 0; k < 4; k++) buffer[(int)(4 * i) + k] = (float)state[4 * i + k];
    }

    void WriteObs(Span<float> buffer)
    {
        for (uint i = 0; i < numEnvs; i++) WriteState(buffer, i);
    }

    void Dynamics(uint i, bool pushRight)
    {
        int b = (int)(4 * i);
        double x = state[b], xDot = state[b + 1], theta = state[b + 2], thetaDot = state[b + 3];
        double poleMassLength = MassPole * length;
        double force = pushRight ? ForceMag : -ForceMag;
        double sin = Math.Sin(theta), cos = Math.Cos(theta);
        double temp = (force + poleMassLength * thetaDot * thetaDot * sin) / TotalMass;
        double thetaAcc = (Gravity * sin - cos * temp) / (length * (4.0 / 3.0 - MassPole * cos * cos / TotalMass));
        double xAcc = temp - poleMassLength * thetaAcc * cos / TotalMass;
        state[b] = x + Tau * xDot;
        state[b + 1] = xDot + Tau * xAcc;
        state[b + 2] = theta + Tau * thetaDot;
        state[b + 3] = thetaDot + Tau * thetaAcc;
    }

    bool IsTerminal(uint i)
    {
        double x = state[4 * i], theta = state[4 * i + 2];
        return x < -XThreshold || x > XThreshold || theta < -ThetaThreshold || theta > ThetaThreshold;
    }

    /// One step of every env: reads the actions and the reset mask in place, writes the
    /// frame in place.
    public void Step()
    {
        Span<float> StateBuffer = obs.Span;          // the shared memory: no copy
        ReadOnlySpan<long> ActionBuffer = actions.Span;
        Span<float> reward = rewards.Span, final = finalObs.Span;
        Span<byte> term = terminated.Span, trunc = truncated.Span;
        ReadOnlySpan<byte> mask = resetMask.Span;
        for (uint i = 0; i < numEnvs; i++)
        {
            if (mask[(int)i] != 0)
            {
                ResetOne(i);
                reward[(int)i] = 0.0f;
                term[(int)i] = 0;
                trunc[(int)i] = 0;
            }
            else
            {
                Dynamics(i, ActionBuffer[(int)i] != 0);
                steps[i] += 1;
                bool done = IsTerminal(i), timeUp = steps[i] >= MaxSteps;
                reward[(int)i] = 1.0f;
                term[(int)i] = (byte)(done ? 1 : 0);
                trunc[(int)i] = (byte)(timeUp ? 1 : 0);
                if (done || timeUp)
                {
                    WriteState(final, i);   // the episode's last observation, before the autoreset
                    ResetOne(i);
                    continue;
                }
            }
            WriteState(final, i);
        }
        WriteObs(StateBuffer);
    }

    public void Reset(ReadOnlySpan<uint> envIds, ReadOnlySpan<ulong> seeds)
    {
        for (int k = 0; k < envIds.Length; k++)
        {
            if (!seeds.IsEmpty) rngs[envIds[k]] = Pcg32.SeedFromU64(seeds[k]);
            ResetOne(envIds[k]);
        }
        WriteObs(obs.Span);
        WriteObs(finalObs.Span);
    }

    public byte[] Call(string method, IReadOnlyDictionary<string, string> args, ReadOnlySpan<byte> payload,
                       IDictionary<string, string> replyArgs)
    {
        if (method != "set_pole_length")
            throw new CommandException(ReplyCode.UnknownMethod, $"unknown method '{method}' (this engine has: set_pole_length)");
        if (!args.TryGetValue("length", out string text))
            throw new CommandException(ReplyCode.BadRequest, "missing argument 'length'");
        if (!double.TryParse(text, NumberStyles.Float, CultureInfo.InvariantCulture, out double value)
            || double.IsNaN(value) || double.IsInfinity(value) || value <= 0.0 || value > 100.0)
            throw new CommandException(ReplyCode.BadRequest, "length must be a number in (0, 100] metres");
        replyArgs["previous"] = length.ToString("R", CultureInfo.InvariantCulture);
        length = value;
        return null;
    }
}

static class Program
{
    static int Main(string[] argv)
    {
        uint numEnvs = 256;
        ulong seed = 0;
        string name = null;
        bool selfCheck = false;
        for (int i = 0; i < argv.Length; i++)
        {
            if (argv[i] == "--num-envs" && i + 1 < argv.Length) numEnvs = uint.Parse(argv[++i], CultureInfo.InvariantCulture);
            else if (argv[i] == "--seed" && i + 1 < argv.Length) seed = ulong.Parse(argv[++i], CultureInfo.InvariantCulture);
            else if (argv[i] == "--name" && i + 1 < argv.Length) name = argv[++i];
            else if (argv[i] == "--self-check") selfCheck = true;
            else
            {
                Console.Error.WriteLine("usage: CartPoleEngine.exe [--num-envs N] [--seed S] [--name NAME] [--self-check]");
                return 2;
            }
        }
        try
        {
            using (var spec = CartPole.Spec("cartpole-cs", numEnvs).Name(name))
            using (var engine = new Engine(spec))
            {
                var env = new CartPole(engine, seed);
                if (selfCheck && !SelfCheck(engine)) return 1;
                engine.Publish();                     // frame 0: the reset observations
                Console.Out.WriteLine(engine.Name);
                Console.Out.Flush();
                ulong served = 0;
                while (engine.WaitActions(Native.Forever, env))
                {
                    env.Step();
                    engine.Publish();
                    served++;
                }
                Console.Error.WriteLine($"CartPoleEngine: client closed after {served} steps");
                return 0;
            }
        }
        catch (ShmbridgeException e)
        {
            Console.Error.WriteLine($"CartPoleEngine: {e.Status}: {e.Message}");
            return 1;
        }
    }

    /// Zero copy, checked by address: the span's first element is the pointer the C ABI
    /// gives, and it lies inside this process's mapping of the region's /dev/shm file.
    /// Also: every Status of the binding is the C library's constant of that value.
    static unsafe bool SelfCheck(Engine engine)
    {
        bool ok = true;
        Span<float> StateBuffer = engine.Tensor<float>("obs").Span;
        IntPtr span;
        fixed (float* p = &StateBuffer.GetPinnableReference()) span = (IntPtr)p;
        IntPtr c = engine.Address("obs");
        ulong start = 0, end = 0;
        foreach (string line in File.ReadAllLines("/proc/self/maps"))
        {
            if (!line.EndsWith("/dev/shm/" + engine.Name)) continue;
            string[] range = line.Split(' ')[0].Split('-');
            start = ulong.Parse(range[0], NumberStyles.HexNumber);
            end = ulong.Parse(range[1], NumberStyles.HexNumber);
        }
        ulong a = (ulong)span.ToInt64();
        bool inside = start <= a && a + (ulong)StateBuffer.Length * 4 <= end;
        Console.Error.WriteLine($"zero-copy: span 0x{a:x}, shmb_engine_tensor 0x{(ulong)c.ToInt64():x}, " +
                                $"mapping of /dev/shm/{engine.Name} 0x{start:x}-0x{end:x}: {(span == c && inside ? "same memory" : "DIFFERENT")}");
        ok &= span == c && inside;
        foreach (Status s in Enum.GetValues(typeof(Status)))
        {
            string expected = System.Text.RegularExpressions.Regex.Replace(s.ToString(), "(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_").ToUpperInvariant();
            string actual = Native.FromUtf8(Native.shmb_status_name((int)s));
            if (expected != actual)
            {
                Console.Error.WriteLine($"status {(int)s}: binding says {expected}, library says {actual}");
                ok = false;
            }
        }
        int count = Enum.GetValues(typeof(Status)).Length;
        Console.Error.WriteLine($"status codes: {count} checked against the library");
        return ok;
    }
}
