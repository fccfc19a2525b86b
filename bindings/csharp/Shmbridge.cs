// shmbridge for C#: a thin layer over the C ABI (include/shmbridge.h, libshmbridge.so)
// through P/Invoke. Handles are SafeHandles (closed exactly once, never while a call is
// using them), every status code becomes an exception, tensors are Span<T> over the
// shared memory itself (no copies), and Engine, Client and EngineSpec are IDisposable.
//
// Builds with Debian's Mono into the library assembly Shmbridge.dll, which programs
// reference (Span<T> is in Mono 6.8's mscorlib, so nothing beyond mono-mcs and
// mono-runtime is needed):
//   mcs -target:library -unsafe -langversion:7.2 -out:Shmbridge.dll bindings/csharp/Shmbridge.cs
//   mcs -r:Shmbridge.dll ... YourEngine.cs
// [DllImport("shmbridge")] finds libshmbridge.so by the loader's search: installed in
// /usr/local/lib (ldconfig), or LD_LIBRARY_PATH=<prefix>/lib. Walk-through: docs/c-api.md.
using System;
using System.Collections.Generic;
using System.Runtime.InteropServices;
using System.Text;

namespace Shmbridge
{
    /// <summary>What a call of the C ABI returned (shmb_status); every value but Ok becomes
    /// an exception.</summary>
    public enum Status
    {
        Ok = 0, NotFound = 1, NameInUse = 2, PermissionDenied = 3, InvalidName = 4,
        NotARegionFile = 5, BadMagic = 6, VersionMismatch = 7, LayoutMismatch = 8,
        RegionTooSmall = 9, InvalidHeader = 10, TensorOutOfBounds = 11, InvalidTensor = 12,
        InvalidSpec = 13, NoSuchTensor = 14, DtypeMismatch = 15, WrongDirection = 16,
        AlreadyBorrowed = 17, AlreadyAttached = 18, EngineDied = 19, ClientDied = 20,
        EngineClosed = 21, ClientClosed = 22, Timeout = 23, Protocol = 24, RecordTooLarge = 25,
        BadMessage = 26, NoCommandChannel = 27, Remote = 28, OutOfOrder = 29, Interrupted = 30,
        Closed = 31, CudaUnavailable = 32, Cuda = 33, VulkanUnavailable = 34, Vulkan = 35,
        NotOnHost = 36, Io = 37, NoSpace = 38, CommandBacklog = 39, NotPosted = 40,
        NoDeviceSide = 41, Full = 42,
        InvalidArgument = 1000, InvalidHandle = 1001, Busy = 1002, BufferTooSmall = 1003,
        Panic = 1004,
    }

    public enum DType { F16 = 0, BF16 = 1, F32 = 2, F64 = 3, I8 = 4, I16 = 5, I32 = 6, I64 = 7, U8 = 8, U16 = 9, U32 = 10, U64 = 11, Bool = 12 }

    public enum Direction { EngineToClient = 0, ClientToEngine = 1 }

    public enum Location { Host = 0, Cuda = 1, Vulkan = 2 }

    /// <summary>How a command handler refuses (the client sees it in its RemoteException).</summary>
    public enum ReplyCode { UnknownMethod = 1, BadRequest = 2, EngineError = 3, Unsupported = 4 }

    /// <summary>Every error of the library: the status code and its message, which says
    /// what went wrong and what to do.</summary>
    public class ShmbridgeException : Exception
    {
        public Status Status { get; }
        public ShmbridgeException(Status status, string message) : base(message) { Status = status; }
    }

    /// <summary>The other side closed (EngineClosed / ClientClosed).</summary>
    public class PeerClosedException : ShmbridgeException
    {
        public PeerClosedException(Status s, string m) : base(s, m) { }
    }

    /// <summary>The other side's process died (EngineDied / ClientDied).</summary>
    public class PeerDiedException : ShmbridgeException
    {
        public PeerDiedException(Status s, string m) : base(s, m) { }
    }

    public class TimeoutException : ShmbridgeException
    {
        public TimeoutException(Status s, string m) : base(s, m) { }
    }

    /// <summary>A step ran out of time before its action was sent (NotPosted): nothing is
    /// in flight and the frame is unchanged, so step again; a plain TimeoutException means
    /// the action was sent and its frame is still to come.</summary>
    public class NotPostedException : TimeoutException
    {
        public NotPostedException(Status s, string m) : base(s, m) { }
    }

    /// <summary>The engine answered a command with an error.</summary>
    public class RemoteException : ShmbridgeException
    {
        public RemoteException(Status s, string m) : base(s, m) { }
    }

    /// <summary>No such region, tensor or file (NotFound, NoSuchTensor).</summary>
    public class NotFoundException : ShmbridgeException
    {
        public NotFoundException(Status s, string m) : base(s, m) { }
    }

    /// <summary>A bad argument, spec, name or dtype: a bug in the caller.</summary>
    public class InvalidArgumentException : ShmbridgeException
    {
        public InvalidArgumentException(Status s, string m) : base(s, m) { }
    }

    /// <summary>The engine or client was closed (or disposed) before this call.</summary>
    public class ClosedException : ShmbridgeException
    {
        public ClosedException(Status s, string m) : base(s, m) { }
    }

    /// <summary>Thrown by a command handler to refuse a command with a code.</summary>
    public class CommandException : Exception
    {
        public ReplyCode Code { get; }
        public CommandException(ReplyCode code, string message) : base(message) { Code = code; }
    }

    /// <summary>An engine's answers to Reset and to its own methods.</summary>
    public interface ICommandHandler
    {
        /// <summary>Resets <paramref name="envIds"/> (checked, in order; every env when the
        /// client listed none). <paramref name="seeds"/>: one per listed env, or empty when
        /// the client gave none (keep each env's stream). Write the reset observations
        /// before returning.</summary>
        void Reset(ReadOnlySpan<uint> envIds, ReadOnlySpan<ulong> seeds);

        /// <summary>An engine-defined method: fill <paramref name="replyArgs"/> and return
        /// the reply payload (or null); throw CommandException to refuse.</summary>
        byte[] Call(string method, IReadOnlyDictionary<string, string> args, ReadOnlySpan<byte> payload,
                    IDictionary<string, string> replyArgs);
    }

    /// <summary>A tensor in the shared memory: its address and length, taken once.
    /// <see cref="Span"/> is the memory itself (no copy), valid until the engine or
    /// client it came from is disposed.</summary>
    public readonly struct Tensor<T> where T : struct
    {
        public readonly IntPtr Address;
        public readonly int Length;
        internal Tensor(IntPtr address, int length) { Address = address; Length = length; }
        public unsafe Span<T> Span => new Span<T>((void*)Address, Length);
    }

    /// <summary>The kind of a semaphore an engine's renderer exported (shmb_semaphore_kind).
    /// Binary semaphores are refused when the engine is created.</summary>
    public enum SemaphoreKind { Timeline = 0, Binary = 1 }

    /// <summary>What an engine's renderer exported for one tensor (shmb_vulkan_export):
    /// the values it passed to vkAllocateMemory, where the tensor lies in that memory,
    /// and its device's IDs (VkPhysicalDeviceIDProperties).</summary>
    [StructLayout(LayoutKind.Sequential)]
    public unsafe struct VulkanExport
    {
        /// <summary>VkMemoryAllocateInfo::allocationSize.</summary>
        public ulong AllocSize;
        /// <summary>The tensor's byte offset in the memory (a multiple of 64).</summary>
        public ulong Offset;
        public uint MemoryTypeIndex;
        /// <summary>1 for a dedicated allocation, else 0.</summary>
        public uint Dedicated;
        public fixed byte DeviceUuid[16];
        public fixed byte DriverUuid[16];
    }

    [StructLayout(LayoutKind.Sequential)]
    internal struct Kv
    {
        public IntPtr Key;
        public IntPtr Value;
    }

    [StructLayout(LayoutKind.Sequential)]
    internal unsafe struct TensorInfoNative
    {
        public IntPtr Name;
        public uint Dtype, Direction, Location, Ndim;
        public fixed ulong Shape[8];
        public ulong Nbytes;
        public int DeviceOrdinal;
    }

    [StructLayout(LayoutKind.Sequential)]
    internal struct HandlersNative
    {
        public IntPtr User;
        public IntPtr Reset;
        public IntPtr Call;
    }

    [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
    internal delegate int ResetFn(IntPtr user, IntPtr envIds, UIntPtr numEnvIds, IntPtr seeds, IntPtr reply);

    [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
    internal delegate int CallFn(IntPtr user, IntPtr method, IntPtr args, UIntPtr numArgs, IntPtr payload,
                                 UIntPtr payloadLen, IntPtr reply);

    public sealed class SpecHandle : SafeHandle
    {
        public SpecHandle() : base(IntPtr.Zero, true) { }
        public override bool IsInvalid => handle == IntPtr.Zero;
        protected override bool ReleaseHandle() => Native.shmb_spec_free(handle) == Status.Ok;
    }

    public sealed class EngineHandle : SafeHandle
    {
        public EngineHandle() : base(IntPtr.Zero, true) { }
        public override bool IsInvalid => handle == IntPtr.Zero;
        protected override bool ReleaseHandle() => Native.shmb_engine_close(handle) == Status.Ok;
    }

    public sealed class ClientHandle : SafeHandle
    {
        public ClientHandle() : base(IntPtr.Zero, true) { }
        public override bool IsInvalid => handle == IntPtr.Zero;
        protected override bool ReleaseHandle() => Native.shmb_client_close(handle) == Status.Ok;
    }

    /// <summary>The C ABI's functions (include/shmbridge.h). Strings go in as
    /// NUL-terminated UTF-8 byte arrays.</summary>
    public static class Native
    {
        const string Lib = "shmbridge";
        public const uint AbiVersion = 1;
        public const ulong Forever = ulong.MaxValue;

        [DllImport(Lib)] public static extern uint shmb_abi_version();
        [DllImport(Lib)] public static extern IntPtr shmb_version();
        [DllImport(Lib)] public static extern IntPtr shmb_last_error_message();
        [DllImport(Lib)] public static extern IntPtr shmb_status_name(int status);

        [DllImport(Lib)] internal static extern Status shmb_spec_new(byte[] kind, uint numEnvs, out SpecHandle spec);
        [DllImport(Lib)] internal static extern Status shmb_spec_add_tensor(SpecHandle spec, byte[] name, uint dtype, ulong[] shape, UIntPtr ndim, uint direction, uint location, int deviceOrdinal);
        [DllImport(Lib)] internal static extern Status shmb_spec_add_standard(SpecHandle spec, ulong obsDim, ulong actDim, uint actDtype);
        [DllImport(Lib)] internal static extern Status shmb_spec_add_metadata(SpecHandle spec, byte[] key, byte[] value);
        [DllImport(Lib)] internal static extern Status shmb_spec_set_name(SpecHandle spec, byte[] name);
        [DllImport(Lib)] internal static extern Status shmb_spec_set_spin(SpecHandle spec, long spinUs);
        [DllImport(Lib)] internal static extern Status shmb_spec_free(IntPtr spec);
        [DllImport(Lib)] internal static extern Status shmb_spec_add_vulkan_export(SpecHandle spec, byte[] name, uint dtype, ulong[] shape, UIntPtr ndim, int memoryFd, ref VulkanExport exported, int semaphoreFd, uint semaphoreKind);

        [DllImport(Lib)] internal static extern Status shmb_engine_create(SpecHandle spec, out EngineHandle engine);
        [DllImport(Lib)] internal static extern Status shmb_engine_name(EngineHandle engine, out IntPtr name);
        [DllImport(Lib)] internal static extern Status shmb_engine_num_envs(EngineHandle engine, out uint numEnvs);
        [DllImport(Lib)] internal static extern Status shmb_engine_tensor_count(EngineHandle engine, out UIntPtr count);
        [DllImport(Lib)] internal static extern Status shmb_engine_tensor_info(EngineHandle engine, UIntPtr index, out TensorInfoNative info);
        [DllImport(Lib)] internal static extern Status shmb_engine_tensor(EngineHandle engine, byte[] name, UIntPtr index, out IntPtr data, out UIntPtr nbytes);
        [DllImport(Lib)] internal static extern Status shmb_engine_publish(EngineHandle engine, out ulong frame);
        [DllImport(Lib)] internal static extern Status shmb_engine_publish_signaled(EngineHandle engine, ulong signaled, out ulong frame);
        [DllImport(Lib)] internal static extern Status shmb_engine_next_frame(EngineHandle engine, out ulong frame);
        [DllImport(Lib)] internal static extern Status shmb_engine_wait_actions(EngineHandle engine, ulong timeoutMs, ref HandlersNative handlers, out ulong action);
        [DllImport(Lib)] internal static extern Status shmb_engine_wait_for_client(EngineHandle engine, ulong timeoutMs);
        [DllImport(Lib)] internal static extern Status shmb_engine_close(IntPtr engine);

        [DllImport(Lib)] internal static extern Status shmb_reply_add_arg(IntPtr reply, byte[] key, byte[] value);
        [DllImport(Lib)] internal static extern Status shmb_reply_set_payload(IntPtr reply, byte[] data, UIntPtr len);
        [DllImport(Lib)] internal static extern Status shmb_reply_set_error(IntPtr reply, uint code, byte[] message);

        [DllImport(Lib)] internal static extern Status shmb_client_attach(byte[] name, ulong timeoutMs, long spinUs, out ClientHandle client);
        [DllImport(Lib)] internal static extern Status shmb_client_num_envs(ClientHandle client, out uint numEnvs);
        [DllImport(Lib)] internal static extern Status shmb_client_tensor_info(ClientHandle client, UIntPtr index, out TensorInfoNative info);
        [DllImport(Lib)] internal static extern Status shmb_client_tensor(ClientHandle client, byte[] name, UIntPtr index, out IntPtr data, out UIntPtr nbytes);
        [DllImport(Lib)] internal static extern Status shmb_client_step(ClientHandle client, ulong timeoutMs, out ulong frame);
        [DllImport(Lib)] internal static extern Status shmb_client_reset(ClientHandle client, uint[] envIds, UIntPtr numEnvIds, ulong[] seeds, UIntPtr numSeeds, ulong timeoutMs, out ulong frame);
        [DllImport(Lib)] internal static extern Status shmb_client_call(ClientHandle client, byte[] method, Kv[] args, UIntPtr numArgs, byte[] payload, UIntPtr payloadLen, ulong timeoutMs);
        [DllImport(Lib)] internal static extern Status shmb_client_reply_payload(ClientHandle client, out IntPtr data, out UIntPtr len);
        [DllImport(Lib)] internal static extern Status shmb_client_reply_arg_count(ClientHandle client, out UIntPtr count);
        [DllImport(Lib)] internal static extern Status shmb_client_reply_arg(ClientHandle client, UIntPtr index, out IntPtr key, out IntPtr value);
        [DllImport(Lib)] internal static extern Status shmb_client_close(IntPtr client);

        /// <summary>A NUL-terminated UTF-8 string owned by the library, as a string.</summary>
        public static unsafe string FromUtf8(IntPtr p)
        {
            if (p == IntPtr.Zero) return null;
            byte* b = (byte*)p;
            int n = 0;
            while (b[n] != 0) n++;
            return Encoding.UTF8.GetString(b, n);
        }

        internal static byte[] Utf8(string s)
        {
            if (s == null) return null;
            var bytes = new byte[Encoding.UTF8.GetByteCount(s) + 1];
            Encoding.UTF8.GetBytes(s, 0, s.Length, bytes, 0);
            return bytes;
        }

        /// <summary>A copy of <paramref name="bytes"/> in unmanaged memory, recorded in
        /// <paramref name="held"/> for the caller to free.</summary>
        internal static IntPtr Unmanaged(byte[] bytes, List<IntPtr> held)
        {
            IntPtr p = Marshal.AllocHGlobal(bytes.Length);
            held.Add(p);
            Marshal.Copy(bytes, 0, p, bytes.Length);
            return p;
        }

        /// <summary>Throws the exception of a failed status, with the thread's last error.</summary>
        public static void Check(Status status)
        {
            if (status == Status.Ok) return;
            string message = FromUtf8(shmb_last_error_message());
            switch (status)
            {
                case Status.EngineClosed: case Status.ClientClosed: throw new PeerClosedException(status, message);
                case Status.EngineDied: case Status.ClientDied: throw new PeerDiedException(status, message);
                case Status.Timeout: throw new TimeoutException(status, message);
                case Status.NotPosted: throw new NotPostedException(status, message);
                case Status.Remote: throw new RemoteException(status, message);
                case Status.NotFound: case Status.NoSuchTensor: throw new NotFoundException(status, message);
                case Status.Closed: throw new ClosedException(status, message);
                case Status.InvalidArgument: case Status.InvalidSpec: case Status.InvalidName:
                case Status.DtypeMismatch: case Status.InvalidHandle:
                    throw new InvalidArgumentException(status, message);
                default: throw new ShmbridgeException(status, message);
            }
        }

        /// <summary>The library's ABI must be the one this binding was written for.</summary>
        public static void CheckAbi()
        {
            uint abi = shmb_abi_version();
            if (abi != AbiVersion)
                throw new ShmbridgeException(Status.InvalidArgument,
                    $"libshmbridge has C ABI {abi}, this binding needs {AbiVersion}: use the same release of both");
        }
    }

    /// <summary>Element sizes and dtypes of the C# types a tensor can be viewed as.</summary>
    internal static class Elements
    {
        internal static void Check<T>(DType dtype, string name) where T : struct
        {
            var t = typeof(T);
            bool ok =
                (t == typeof(float) && dtype == DType.F32) || (t == typeof(double) && dtype == DType.F64) ||
                (t == typeof(sbyte) && dtype == DType.I8) || (t == typeof(short) && dtype == DType.I16) ||
                (t == typeof(int) && dtype == DType.I32) || (t == typeof(long) && dtype == DType.I64) ||
                (t == typeof(byte) && (dtype == DType.U8 || dtype == DType.Bool)) ||
                (t == typeof(ushort) && (dtype == DType.U16 || dtype == DType.F16 || dtype == DType.BF16)) ||
                (t == typeof(uint) && dtype == DType.U32) || (t == typeof(ulong) && dtype == DType.U64);
            if (!ok)
                throw new InvalidArgumentException(Status.DtypeMismatch,
                    $"tensor '{name}' has dtype {dtype}, which {t.Name} cannot view");
        }

        internal static Tensor<T> Make<T>(IntPtr data, UIntPtr nbytes) where T : struct
        {
            int size = Marshal.SizeOf(typeof(T));
            return new Tensor<T>(data, checked((int)((ulong)nbytes / (ulong)size)));
        }
    }

    /// <summary>What an engine serves: its kind, env count, tensors and metadata.</summary>
    public sealed class EngineSpec : IDisposable
    {
        internal readonly SpecHandle Handle;

        public EngineSpec(string kind, uint numEnvs)
        {
            Native.CheckAbi();
            Native.Check(Native.shmb_spec_new(Native.Utf8(kind), numEnvs, out Handle));
        }

        public EngineSpec Tensor(string name, DType dtype, ulong[] shape, Direction direction)
        {
            Native.Check(Native.shmb_spec_add_tensor(Handle, Native.Utf8(name), (uint)dtype, shape,
                (UIntPtr)(shape?.Length ?? 0), (uint)direction, (uint)Location.Host, 0));
            return this;
        }

        /// <summary>An engine→client tensor in memory the engine's own renderer exported
        /// (vkGetMemoryFdKHR, OPAQUE_FD): <paramref name="memoryFd"/> that fd,
        /// <paramref name="exported"/> where the tensor lies in it and on which device;
        /// <paramref name="semaphoreFd"/> a timeline semaphore the renderer signals with
        /// each frame's number (-1: none). The fds stay the caller's: the library keeps
        /// copies of its own, so close yours whenever you like (shmb_spec_add_vulkan_export).</summary>
        public EngineSpec VulkanTensor(string name, DType dtype, ulong[] shape, int memoryFd, VulkanExport exported,
                                       int semaphoreFd = -1, SemaphoreKind semaphoreKind = SemaphoreKind.Timeline)
        {
            // By reference: Mono passes an `in` struct of a DllImport by value.
            Native.Check(Native.shmb_spec_add_vulkan_export(Handle, Native.Utf8(name), (uint)dtype, shape,
                (UIntPtr)(shape?.Length ?? 0), memoryFd, ref exported, semaphoreFd, (uint)semaphoreKind));
            return this;
        }

        /// <summary>obs, actions, rewards, terminated, truncated, reset_mask (docs/protocol.md §7).</summary>
        public EngineSpec Standard(ulong obsDim, ulong actDim, DType actDtype)
        {
            Native.Check(Native.shmb_spec_add_standard(Handle, obsDim, actDim, (uint)actDtype));
            return this;
        }

        public EngineSpec Metadata(string key, string value)
        {
            Native.Check(Native.shmb_spec_add_metadata(Handle, Native.Utf8(key), Native.Utf8(value)));
            return this;
        }

        /// <summary>The region name (null: a random one).</summary>
        public EngineSpec Name(string name)
        {
            Native.Check(Native.shmb_spec_set_name(Handle, Native.Utf8(name)));
            return this;
        }

        /// <summary>Spin budget in microseconds before sleeping; 0: never spin; -1: default.</summary>
        public EngineSpec Spin(long microseconds)
        {
            Native.Check(Native.shmb_spec_set_spin(Handle, microseconds));
            return this;
        }

        public void Dispose() => Handle.Dispose();
    }

    /// <summary>A simulator serving a region. Dispose closes it: the client sees
    /// EngineClosed, the name leaves /dev/shm, and every tensor span is invalid.</summary>
    public sealed class Engine : IDisposable
    {
        readonly EngineHandle handle;
        public string Name { get; }
        public uint NumEnvs { get; }

        // The trampolines the library calls back, kept alive with the engine; they catch
        // every exception: none may unwind into native frames.
        readonly ResetFn resetFn;
        readonly CallFn callFn;
        ICommandHandler current;

        public Engine(EngineSpec spec)
        {
            Native.Check(Native.shmb_engine_create(spec.Handle, out handle));
            Native.Check(Native.shmb_engine_name(handle, out IntPtr name));
            Name = Native.FromUtf8(name);
            Native.Check(Native.shmb_engine_num_envs(handle, out uint n));
            NumEnvs = n;
            resetFn = OnReset;
            callFn = OnCall;
        }

        /// <summary>Tensor <paramref name="name"/> as T (checked against its dtype): the
        /// shared memory itself. Take it once; its Span is valid until Dispose.</summary>
        public Tensor<T> Tensor<T>(string name) where T : struct
        {
            int index = IndexOf(name);
            Native.Check(Native.shmb_engine_tensor_info(handle, (UIntPtr)index, out TensorInfoNative info));
            Elements.Check<T>((DType)info.Dtype, name);
            Native.Check(Native.shmb_engine_tensor(handle, null, (UIntPtr)index, out IntPtr data, out UIntPtr nbytes));
            return Elements.Make<T>(data, nbytes);
        }

        /// <summary>The address shmb_engine_tensor gives for <paramref name="name"/>.</summary>
        public IntPtr Address(string name)
        {
            Native.Check(Native.shmb_engine_tensor(handle, Native.Utf8(name), UIntPtr.Zero, out IntPtr data, out _));
            return data;
        }

        int IndexOf(string name)
        {
            Native.Check(Native.shmb_engine_tensor_count(handle, out UIntPtr count));
            for (int i = 0; i < (int)count; i++)
            {
                Native.Check(Native.shmb_engine_tensor_info(handle, (UIntPtr)i, out TensorInfoNative info));
                if (Native.FromUtf8(info.Name) == name) return i;
            }
            throw new NotFoundException(Status.NoSuchTensor, $"no tensor named '{name}'");
        }

        /// <summary>Publishes the frame the engine→client tensors hold (frame 0 first).</summary>
        public ulong Publish()
        {
            Native.Check(Native.shmb_engine_publish(handle, out ulong frame));
            return frame;
        }

        /// <summary>Publishes a frame the engine's renderer wrote into memory it exported
        /// with a timeline semaphore: <paramref name="signaled"/>, the value its queue
        /// signals once the frame is written, must be the frame's number
        /// (<see cref="NextFrame"/>). An engine whose tensors have no semaphore calls
        /// Publish. Either way the device work must be complete before the call.</summary>
        public ulong PublishSignaled(ulong signaled)
        {
            Native.Check(Native.shmb_engine_publish_signaled(handle, signaled, out ulong frame));
            return frame;
        }

        /// <summary>The number the next publish gives its frame (0 before frame 0, then the
        /// action last received): the value a renderer's timeline semaphore signals.</summary>
        public ulong NextFrame
        {
            get
            {
                Native.Check(Native.shmb_engine_next_frame(handle, out ulong frame));
                return frame;
            }
        }

        /// <summary>Waits up to <paramref name="timeoutMs"/> for the client's next action,
        /// answering commands meanwhile with <paramref name="handler"/> (null: built-ins
        /// only). True: an action arrived (read it, step, write, Publish); false: the
        /// client closed. Throws TimeoutException, PeerDiedException, ...</summary>
        public bool WaitActions(ulong timeoutMs = Native.Forever, ICommandHandler handler = null)
        {
            var table = new HandlersNative
            {
                User = IntPtr.Zero,
                Reset = handler == null ? IntPtr.Zero : Marshal.GetFunctionPointerForDelegate(resetFn),
                Call = handler == null ? IntPtr.Zero : Marshal.GetFunctionPointerForDelegate(callFn),
            };
            current = handler;
            Status status;
            try
            {
                status = Native.shmb_engine_wait_actions(handle, timeoutMs, ref table, out _);
            }
            finally
            {
                current = null;
            }
            if (status == Status.ClientClosed) return false;
            Native.Check(status);
            return true;
        }

        /// <summary>Waits (asleep) until a live client is attached: after WaitActions said
        /// the client closed (false) or died (ShmbridgeException), the way to serve the
        /// next one.</summary>
        public void WaitForClient(ulong timeoutMs = Native.Forever)
        {
            Native.Check(Native.shmb_engine_wait_for_client(handle, timeoutMs));
        }

        static int Refuse(IntPtr reply, ReplyCode code, string message)
        {
            Native.shmb_reply_set_error(reply, (uint)code, Native.Utf8(message));
            return 1;
        }

        unsafe int OnReset(IntPtr user, IntPtr envIds, UIntPtr numEnvIds, IntPtr seeds, IntPtr reply)
        {
            try
            {
                int n = checked((int)numEnvIds);
                current.Reset(new ReadOnlySpan<uint>((void*)envIds, n),
                              seeds == IntPtr.Zero ? ReadOnlySpan<ulong>.Empty : new ReadOnlySpan<ulong>((void*)seeds, n));
                return 0;
            }
            catch (CommandException e) { return Refuse(reply, e.Code, e.Message); }
            catch (Exception e) { return Refuse(reply, ReplyCode.EngineError, e.GetType().Name + ": " + e.Message); }
        }

        unsafe int OnCall(IntPtr user, IntPtr method, IntPtr args, UIntPtr numArgs, IntPtr payload, UIntPtr payloadLen, IntPtr reply)
        {
            try
            {
                var dict = new Dictionary<string, string>();
                var kvs = (Kv*)args;
                for (int i = 0; i < (int)numArgs; i++) dict[Native.FromUtf8(kvs[i].Key)] = Native.FromUtf8(kvs[i].Value);
                var replyArgs = new Dictionary<string, string>();
                var bytes = new ReadOnlySpan<byte>((void*)payload, checked((int)payloadLen));
                byte[] answer = current.Call(Native.FromUtf8(method), dict, bytes, replyArgs);
                foreach (var kv in replyArgs)
                    Native.Check(Native.shmb_reply_add_arg(reply, Native.Utf8(kv.Key), Native.Utf8(kv.Value)));
                if (answer != null)
                    Native.Check(Native.shmb_reply_set_payload(reply, answer, (UIntPtr)answer.Length));
                return 0;
            }
            catch (CommandException e) { return Refuse(reply, e.Code, e.Message); }
            catch (Exception e) { return Refuse(reply, ReplyCode.EngineError, e.GetType().Name + ": " + e.Message); }
        }

        public void Dispose() => handle.Dispose();
    }

    /// <summary>A learner (or a test) attached to an engine. Dispose closes it.</summary>
    public sealed class Client : IDisposable
    {
        readonly ClientHandle handle;
        public uint NumEnvs { get; }

        public Client(string name, ulong timeoutMs = 10000, long spinUs = -1)
        {
            Native.CheckAbi();
            Native.Check(Native.shmb_client_attach(Native.Utf8(name), timeoutMs, spinUs, out handle));
            Native.Check(Native.shmb_client_num_envs(handle, out uint n));
            NumEnvs = n;
        }

        public Tensor<T> Tensor<T>(string name) where T : struct
        {
            Native.Check(Native.shmb_client_tensor(handle, Native.Utf8(name), UIntPtr.Zero, out IntPtr data, out UIntPtr nbytes));
            for (int i = 0; ; i++)
            {
                Native.Check(Native.shmb_client_tensor_info(handle, (UIntPtr)i, out TensorInfoNative info));
                if (Native.FromUtf8(info.Name) != name) continue;
                Elements.Check<T>((DType)info.Dtype, name);
                return Elements.Make<T>(data, nbytes);
            }
        }

        /// <summary>Sends the actions written in place and waits for the next frame.</summary>
        public ulong Step(ulong timeoutMs = 10000)
        {
            Native.Check(Native.shmb_client_step(handle, timeoutMs, out ulong frame));
            return frame;
        }

        /// <summary>Resets <paramref name="envIds"/> (null: all) with <paramref name="seeds"/>.</summary>
        public ulong Reset(uint[] envIds = null, ulong[] seeds = null, ulong timeoutMs = 10000)
        {
            Native.Check(Native.shmb_client_reset(handle, envIds, (UIntPtr)(envIds?.Length ?? 0), seeds,
                (UIntPtr)(seeds?.Length ?? 0), timeoutMs, out ulong frame));
            return frame;
        }

        /// <summary>Calls the engine-defined <paramref name="method"/> with
        /// <paramref name="args"/> and <paramref name="payload"/> (either may be null) and
        /// waits for its reply. Throws RemoteException when the engine refuses (its message),
        /// TimeoutException, ...</summary>
        public Reply Call(string method, IReadOnlyDictionary<string, string> args = null, byte[] payload = null,
                          ulong timeoutMs = 10000)
        {
            // The C ABI copies the strings during the call: they live in unmanaged memory
            // only that long.
            var kvs = new Kv[args?.Count ?? 0];
            var held = new List<IntPtr>();
            try
            {
                int i = 0;
                if (args != null)
                    foreach (var kv in args)
                    {
                        if (kv.Value == null)
                            throw new InvalidArgumentException(Status.InvalidArgument, $"argument '{kv.Key}' is null");
                        kvs[i].Key = Native.Unmanaged(Native.Utf8(kv.Key), held);
                        kvs[i].Value = Native.Unmanaged(Native.Utf8(kv.Value), held);
                        i++;
                    }
                Native.Check(Native.shmb_client_call(handle, Native.Utf8(method), kvs, (UIntPtr)kvs.Length, payload,
                    (UIntPtr)(payload?.Length ?? 0), timeoutMs));
            }
            finally
            {
                foreach (IntPtr p in held) Marshal.FreeHGlobal(p);
            }
            // The reply lives in the client until its next call: copied out here.
            Native.Check(Native.shmb_client_reply_arg_count(handle, out UIntPtr count));
            var replyArgs = new Dictionary<string, string>();
            for (ulong k = 0; k < (ulong)count; k++)
            {
                Native.Check(Native.shmb_client_reply_arg(handle, (UIntPtr)k, out IntPtr key, out IntPtr value));
                replyArgs[Native.FromUtf8(key)] = Native.FromUtf8(value);
            }
            Native.Check(Native.shmb_client_reply_payload(handle, out IntPtr data, out UIntPtr len));
            var bytes = new byte[checked((int)(ulong)len)];
            if (bytes.Length > 0) Marshal.Copy(data, bytes, 0, bytes.Length);
            return new Reply(replyArgs, bytes);
        }

        public void Dispose() => handle.Dispose();
    }

    /// <summary>An engine's answer to <see cref="Client.Call"/>: its key/values and payload.</summary>
    public sealed class Reply
    {
        public IReadOnlyDictionary<string, string> Args { get; }
        public byte[] Payload { get; }
        internal Reply(IReadOnlyDictionary<string, string> args, byte[] payload) { Args = args; Payload = payload; }
    }
}
