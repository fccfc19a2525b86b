// A C# engine that renders with Vulkan itself and hands its own render target to the
// learner: the CartPole of CartPoleEngine.cs, whose frames a renderer of its own draws on
// its own Vulkan device (examples/c/vulkan_frames.c, built as libvulkan_frames.so and
// called through P/Invoke, as an engine calls its renderer), into memory the renderer
// exported. EngineSpec.VulkanTensor (shmb_spec_add_vulkan_export) hands that memory to
// shmbridge as the tensor `frames` (u8 [N, H, W, 4]): the learner reads the frames where
// the renderer wrote them, with no copy. tests/python/test_vulkan_engines.py checks them
// byte for byte.
//
//   mcs -unsafe -langversion:7.2 -main:VulkanCartPoleProgram -out:VulkanCartPoleEngine.exe \
//       bindings/csharp/Shmbridge.cs examples/csharp/CartPoleEngine.cs examples/csharp/VulkanCartPoleEngine.cs
//   LD_LIBRARY_PATH=target/debug:DIR_OF_libvulkan_frames.so mono VulkanCartPoleEngine.exe \
//       [--num-envs N] [--seed S] [--size HxW] [--name NAME] [--self-check]
//
// --self-check also runs the binding's refusals before serving: a binary semaphore (a
// copy of the memory fd stands in for one: refused before anything imports it) and a
// semaphore value from an engine without a semaphore, each Status.InvalidSpec.
//
// Follows the engine CLI convention (docs/protocol.md §9). Without a Vulkan driver it
// exits with status 1 and "Vulkan is unavailable: ..." on stderr.
using System;
using System.Collections.Generic;
using System.Globalization;
using System.Runtime.InteropServices;
using Shmbridge;

/// <summary>The renderer's C interface (examples/c/vulkan_frames.h).</summary>
static class Renderer
{
    const string Lib = "vulkan_frames";

    [DllImport(Lib)] public static extern IntPtr vf_create(uint numEnvs, uint height, uint width);
    [DllImport(Lib)] static extern IntPtr vf_error();
    [DllImport(Lib)] public static extern int vf_export(IntPtr renderer, out int memoryFd, out VulkanExport exported);
    [DllImport(Lib)] public static extern int vf_draw(IntPtr renderer, IntPtr obs);
    [DllImport(Lib)] static extern IntPtr vf_device_name(IntPtr renderer);
    [DllImport(Lib)] public static extern void vf_destroy(IntPtr renderer);
    [DllImport("libc", SetLastError = true)] public static extern int close(int fd);

    public static string Error => Native.FromUtf8(vf_error());
    public static string DeviceName(IntPtr renderer) => Native.FromUtf8(vf_device_name(renderer));
}

/// <summary>CartPole whose frames are drawn after every step and every reset.</summary>
sealed class RenderedCartPole : ICommandHandler
{
    readonly CartPole env;
    readonly IntPtr renderer, obs;

    public RenderedCartPole(CartPole env, IntPtr renderer, IntPtr obs)
    {
        this.env = env;
        this.renderer = renderer;
        this.obs = obs;
    }

    /// <summary>Draws the frames of the observations in place; returns once the device has
    /// written them (no semaphore: the frame must be complete when it is published).</summary>
    public void Draw()
    {
        if (Renderer.vf_draw(renderer, obs) != 0) throw new InvalidOperationException(Renderer.Error);
    }

    public void Step()
    {
        env.Step();
        Draw();
    }

    public void Reset(ReadOnlySpan<uint> envIds, ReadOnlySpan<ulong> seeds)
    {
        env.Reset(envIds, seeds);
        Draw();
    }

    public byte[] Call(string method, IReadOnlyDictionary<string, string> args, ReadOnlySpan<byte> payload,
                       IDictionary<string, string> replyArgs) => env.Call(method, args, payload, replyArgs);
}

static class VulkanCartPoleProgram
{
    static int Main(string[] argv)
    {
        uint numEnvs = 64, height = 84, width = 84;
        ulong seed = 0;
        string name = null;
        bool selfCheck = false;
        for (int i = 0; i < argv.Length; i++)
        {
            string[] size = argv[i] == "--size" && i + 1 < argv.Length ? argv[i + 1].Split('x') : null;
            if (argv[i] == "--num-envs" && i + 1 < argv.Length) numEnvs = uint.Parse(argv[++i], CultureInfo.InvariantCulture);
            else if (argv[i] == "--seed" && i + 1 < argv.Length) seed = ulong.Parse(argv[++i], CultureInfo.InvariantCulture);
            else if (size != null && size.Length == 2)
            {
                height = uint.Parse(size[0], CultureInfo.InvariantCulture);
                width = uint.Parse(size[1], CultureInfo.InvariantCulture);
                i++;
            }
            else if (argv[i] == "--name" && i + 1 < argv.Length) name = argv[++i];
            else if (argv[i] == "--self-check") selfCheck = true;
            else
            {
                Console.Error.WriteLine("usage: VulkanCartPoleEngine.exe [--num-envs N] [--seed S] [--size HxW] [--name NAME] [--self-check]");
                return 2;
            }
        }
        IntPtr renderer = Renderer.vf_create(numEnvs, height, width);
        if (renderer == IntPtr.Zero)
        {
            Console.Error.WriteLine($"VulkanCartPoleEngine: {Renderer.Error}");
            return 1;
        }
        try
        {
            if (Renderer.vf_export(renderer, out int memoryFd, out VulkanExport exported) != 0)
            {
                Console.Error.WriteLine($"VulkanCartPoleEngine: exporting the frames: {Renderer.Error}");
                return 1;
            }
            if (selfCheck && !RefusesBinarySemaphores(numEnvs, height, width, memoryFd, exported))
            {
                Renderer.close(memoryFd);
                return 1;
            }
            using (var spec = CartPole.Spec("cartpole-vulkan-cs", numEnvs)
                .Metadata("renderer", Renderer.DeviceName(renderer))
                .Name(name))
            {
                try
                {
                    spec.VulkanTensor("frames", DType.U8, new ulong[] { numEnvs, height, width, 4 }, memoryFd, exported);
                }
                finally
                {
                    Renderer.close(memoryFd);   // the library holds its own copy
                }
                using (var engine = new Engine(spec))
                {
                    var env = new RenderedCartPole(new CartPole(engine, seed), renderer, engine.Address("obs"));
                    env.Draw();
                    if (selfCheck && !RefusesASemaphoreValue(engine)) return 1;
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
                    Console.Error.WriteLine($"VulkanCartPoleEngine: client closed after {served} steps");
                    return 0;
                }
            }
        }
        catch (ShmbridgeException e)
        {
            Console.Error.WriteLine($"VulkanCartPoleEngine: {e.Status}: {e.Message}");
            return 1;
        }
        catch (InvalidOperationException e)
        {
            Console.Error.WriteLine($"VulkanCartPoleEngine: drawing: {e.Message}");
            return 1;
        }
        finally
        {
            // The engine is closed: a client that imported the memory holds its own
            // reference to it, so freeing the renderer's pulls nothing from under it.
            Renderer.vf_destroy(renderer);
        }
    }

    /// <summary>A binary semaphore is refused when the engine is created: Status.InvalidSpec.</summary>
    static bool RefusesBinarySemaphores(uint numEnvs, uint height, uint width, int memoryFd, VulkanExport exported)
    {
        var shape = new ulong[] { numEnvs, height, width, 4 };
        using (var spec = new EngineSpec("binary", numEnvs)
            .VulkanTensor("frames", DType.U8, shape, memoryFd, exported, memoryFd, SemaphoreKind.Binary))
        {
            try
            {
                new Engine(spec).Dispose();
            }
            catch (ShmbridgeException e) when (e.Status == Status.InvalidSpec && e.Message.Contains("binary semaphore"))
            {
                Console.Error.WriteLine($"self-check: binary semaphore refused: {e.Status}");
                return true;
            }
            Console.Error.WriteLine("self-check: an engine with a binary semaphore was created");
            return false;
        }
    }

    /// <summary>Before frame 0 the next frame is 0; a semaphore value from an engine whose
    /// tensors have no semaphore is refused, and nothing is published.</summary>
    static bool RefusesASemaphoreValue(Engine engine)
    {
        if (engine.NextFrame != 0)
        {
            Console.Error.WriteLine($"self-check: next frame {engine.NextFrame}, want 0");
            return false;
        }
        try
        {
            engine.PublishSignaled(0);
        }
        catch (ShmbridgeException e) when (e.Status == Status.InvalidSpec)
        {
            Console.Error.WriteLine($"self-check: semaphore value refused: {e.Status}: {e.Message}");
            return true;
        }
        Console.Error.WriteLine("self-check: a semaphore value was taken from an engine without a semaphore");
        return false;
    }
}
