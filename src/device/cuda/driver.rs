//! The CUDA driver layer: every cudarc driver call of the crate but the kernels', and
//! their `unsafe`.
//!
//! Nothing here calls the driver before [`Driver::get`] succeeded: cudarc (with
//! `dynamic-loading`) panics on the first `sys::cu*` call when `libcuda.so` or the called
//! symbol is missing, so the probe first checks that the library loads and that every
//! symbol this module uses is in it, then runs `cuInit`. Every public entry point takes
//! a `&Driver` (or an object built from one), so the types enforce "probe first".
//!
//! What is here, by side:
//! - both: [`PrimaryContext`] (the device's primary context, the one PyTorch uses),
//!   [`Stream`], [`IpcEvent`] (`INTERPROCESS | DISABLE_TIMING`, created or opened);
//! - engine: [`DeviceAllocation`] (`cuMemAlloc`, never a stream-ordered pool, so
//!   `cuIpcGetMemHandle` works on its base), exported by [`DeviceAllocation::ipc_handle`];
//! - client: [`import_memory`] (`cuIpcOpenMemHandle`, once per process, context and
//!   handle: cached; closed exactly once, when the last user drops it);
//! - memory shared by file descriptor: [`FdMemory`] (`cuMemCreate` with POSIX fd handles,
//!   exported with [`FdMemory::export_fd`], imported by a client with
//!   [`FdMemory::import`]), which crosses PID namespaces where CUDA IPC does not;
//! - client of Vulkan tensors: [`ExternalMemory`] (`cuImportExternalMemory` of an
//!   `OPAQUE_FD` and its mapped buffer) and [`ExternalSemaphore`] (waited on a stream).
//!
//! Kernels (NVRTC, modules and launches) are in [`super::kernel`], on top of this.
//!
//! Handles cannot be opened in the process that exported them (the driver refuses); the
//! cross-process tests live in `tests/cuda.rs` and run only where a GPU is present.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys::{self, CUresult};

use super::CudaInfo;
use crate::device::backend::StreamRef;
use crate::error::{Error, Result};

/// Every driver symbol this module calls (cudarc loads each by exactly this name).
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetUuid_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuDeviceGetAttribute",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemGetAddressRange_v2",
    "cuMemGetInfo_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuImportExternalMemory",
    "cuExternalMemoryGetMappedBuffer",
    "cuDestroyExternalMemory",
    "cuImportExternalSemaphore",
    "cuWaitExternalSemaphoresAsync",
    "cuDestroyExternalSemaphore",
];

/// Proof that the driver was probed and is usable in this process.
#[derive(Debug)]
pub struct Driver {
    info: CudaInfo,
    /// The entry points of [`VMM_SYMBOLS`] this driver lacks (an old driver still serves
    /// CUDA IPC; only memory shared by fd needs them).
    vmm_absent: Vec<&'static str>,
}

/// The driver symbols of memory shared by file descriptor ([`FdMemory`]): checked
/// apart from [`DRIVER_SYMBOLS`], so that a driver without them still serves CUDA IPC.
const VMM_SYMBOLS: &[&str] = &[
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

impl Driver {
    /// The probed driver, or `CudaUnavailable` with the reason. Probes once per process.
    pub fn get() -> Result<&'static Driver> {
        let probed = DRIVER.get_or_init(|| {
            // A last guard: the probe is written not to reach a panicking cudarc path,
            // but if a driver misbehaves anyway we report it instead of unwinding out.
            std::panic::catch_unwind(probe_uncached)
                .unwrap_or_else(|_| Err("the CUDA driver panicked while being probed".into()))
        });
        match probed {
            Ok(d) => Ok(d),
            Err(reason) => Err(Error::CudaUnavailable {
                reason: reason.clone(),
            }),
        }
    }

    pub fn info(&self) -> &CudaInfo {
        &self.info
    }
}

/// The names in `names` that `lookup` does not find.
pub(super) fn missing(names: &[&'static str], lookup: impl Fn(&str) -> bool) -> Vec<&'static str> {
    names.iter().copied().filter(|n| !lookup(n)).collect()
}

fn probe_uncached() -> std::result::Result<Driver, String> {
    // SAFETY: only dlopen()s the candidate library names and drops the handles.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda.so) cannot be loaded: no NVIDIA \
                    driver on this machine, or it is not on the loader path"
                .into(),
        );
    }
    // SAFETY: `is_culib_present` just loaded one of the names `culib` tries, in the same
    // order, so `culib` finds a library and does not panic.
    let lib = unsafe { sys::culib() };
    let absent = missing(DRIVER_SYMBOLS, |n| {
        // SAFETY: a dlsym lookup only; the pointer is never called or dereferenced.
        unsafe { lib.get::<*const c_void>(n.as_bytes()) }.is_ok()
    });
    if !absent.is_empty() {
        return Err(format!(
            "the CUDA driver is too old: it lacks {}",
            absent.join(", ")
        ));
    }
    let vmm_absent = missing(VMM_SYMBOLS, |n| {
        // SAFETY: a dlsym lookup only; the pointer is never called or dereferenced.
        unsafe { lib.get::<*const c_void>(n.as_bytes()) }.is_ok()
    });
    // SAFETY (this and the two calls below): the symbols are present (checked above), so
    // cudarc's loader does not panic; the out-pointers are valid locals.
    let r = unsafe { sys::cuInit(0) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuInit failed with {r:?}: the driver is installed but unusable here (no \
             device visible, /dev/nvidia* not accessible, or a driver/library mismatch)"
        ));
    }
    let mut version = 0;
    // SAFETY: see above.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(format!("cuDriverGetVersion failed with {r:?}"));
    }
    let mut count = 0;
    // SAFETY: see above.
    let r = unsafe { sys::cuDeviceGetCount(&mut count) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetCount failed with {r:?}"));
    }
    if count < 1 {
        return Err("the CUDA driver sees no device (check CUDA_VISIBLE_DEVICES)".into());
    }
    Ok(Driver {
        info: CudaInfo {
            driver_version: version,
            device_count: count,
        },
        vmm_absent,
    })
}

pub(super) fn check(call: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            call,
            detail: format!("{r:?}"),
        })
    }
}

// ---------------------------------------------------------------------------------------
// Contexts, streams, events

/// A retained primary context of one device (the context PyTorch's runtime uses, so
/// pointers opened here are valid in torch's tensors). Released on drop.
#[derive(Debug)]
pub struct PrimaryContext {
    ordinal: i32,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (the driver API is
// thread-safe); we only pass it to the driver.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; no interior state of ours is mutated through `&self`.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// Retains device `ordinal`'s primary context (made current by [`bind`](Self::bind)).
    pub fn retain(driver: &Driver, ordinal: i32) -> Result<Arc<PrimaryContext>> {
        let dev = device(driver, ordinal)?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(Arc::new(PrimaryContext { ordinal, dev, ctx }))
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes this context current on the calling thread (driver calls that take no
    /// context use the current one) until the returned guard drops, which restores the
    /// thread's previous context, none included: a caller's own current device is left
    /// as it was. The CUDA runtime takes a thread's current context as its current
    /// device, so a context left current on a thread that had none would move torch's
    /// `current_device()` (and its `"cuda"` tensors, and the device check of its
    /// `__dlpack__`) to the engine's GPU. Costs one `cuCtxGetCurrent` when already
    /// current.
    pub fn bind(&self) -> Result<Current> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut previous)
        })?;
        if previous == self.ctx {
            return Ok(Current {
                previous,
                changed: false,
            });
        }
        // SAFETY: `ctx` is a primary context we retained and have not released.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        Ok(Current {
            previous,
            changed: true,
        })
    }

    /// The device's UUID (stable across processes, unlike ordinals, which depend on
    /// `CUDA_VISIBLE_DEVICES`).
    pub fn uuid(&self) -> Result<[u8; 16]> {
        uuid_of(self.dev)
    }

    /// The device's compute capability `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        let attr = |a, what| {
            let mut v = 0;
            // SAFETY: valid out-pointer; `dev` is a device handle from cuDeviceGet; `a`
            // is a defined attribute.
            check(what, unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, self.dev)
            })
            .map(|()| v)
        };
        Ok((
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)",
            )?,
            attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)",
            )?,
        ))
    }

    /// (free, total) bytes of device memory, for leak checks.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        let _current = self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; our context is current.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }
}

/// The calling thread's context binding from [`PrimaryContext::bind`]; restores the
/// previous one on drop. Not `Send`: a binding belongs to its thread.
#[must_use = "the context is current only while the guard lives"]
pub struct Current {
    previous: sys::CUcontext,
    changed: bool,
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: `previous` was this thread's current context (or null) when the
            // guard was made; the driver accepts null (no current context).
            let _ = unsafe { sys::cuCtxSetCurrent(self.previous) };
        }
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `PrimaryContext::retain`, once.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// The UUID of device `ordinal` (as this process numbers devices), without retaining a
/// context: how a client finds the engine's device when `CUDA_VISIBLE_DEVICES` differs.
pub fn device_uuid(driver: &Driver, ordinal: i32) -> Result<[u8; 16]> {
    uuid_of(device(driver, ordinal)?)
}

/// The handle of device `ordinal` (`CudaUnavailable` if this process has no such device).
fn device(driver: &Driver, ordinal: i32) -> Result<sys::CUdevice> {
    if ordinal < 0 || ordinal >= driver.info.device_count {
        return Err(Error::CudaUnavailable {
            reason: format!(
                "no CUDA device {ordinal} (this process sees {})",
                driver.info.device_count
            ),
        });
    }
    let mut dev = 0;
    // SAFETY: the driver was probed (the `&Driver`), the ordinal is in range and the
    // out-pointer is a valid local.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// The UUID of a device handle from [`device`].
fn uuid_of(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let mut u = sys::CUuuid_st { bytes: [0; 16] };
    // SAFETY: valid out-pointer; `dev` came from cuDeviceGet.
    check("cuDeviceGetUuid_v2", unsafe {
        sys::cuDeviceGetUuid_v2(&mut u, dev)
    })?;
    Ok(u.bytes.map(|b| b as u8))
}

/// A CUDA stream: one we created (destroyed on drop), or a borrowed one (a consumer's
/// stream from DLPack, the legacy or per-thread default stream).
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    owned: bool,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a CUstream is a driver handle usable from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream in `ctx`.
    pub fn create(ctx: &Arc<PrimaryContext>) -> Result<Stream> {
        let _current = ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current. 1 = CU_STREAM_NON_BLOCKING.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, 1)
        })?;
        Ok(Stream {
            raw,
            owned: true,
            ctx: ctx.clone(),
        })
    }

    /// A stream someone else owns, by its handle value (DLPack: 1 = legacy default
    /// stream, 2 = per-thread default stream, else a `CUstream` pointer; see
    /// the DLPack stream rules in `docs/protocol.md` §3.5).
    ///
    /// # Safety
    /// `raw` must be 1, 2, or a live stream of `ctx` that outlives the returned value.
    pub unsafe fn borrowed(ctx: &Arc<PrimaryContext>, raw: u64) -> Stream {
        Stream {
            raw: raw as usize as sys::CUstream,
            owned: false,
            ctx: ctx.clone(),
        }
    }

    /// Runs `f` on the stream `stream` names, as a [`Stream`] of `ctx` (the context of
    /// the device `stream` belongs to) that lives only for the call: `f` gets a
    /// reference, so the value cannot outlive `stream`'s borrow.
    pub fn scoped<R>(
        ctx: &Arc<PrimaryContext>,
        stream: StreamRef<'_>,
        f: impl FnOnce(&Stream) -> R,
    ) -> R {
        // SAFETY: `StreamRef::from_raw`'s contract: `stream` is 1, 2 or a live stream of
        // the device, alive for its lifetime, which covers this call; the borrowed
        // `Stream` is dropped before this call returns (`f` only gets `&Stream`, and a
        // `Stream` is not `Clone`).
        let s = unsafe { Stream::borrowed(ctx, stream.raw()) };
        f(&s)
    }

    pub fn raw(&self) -> u64 {
        self.raw as usize as u64
    }

    /// The `CUstream` handle, for the kernel launches of [`super::kernel`].
    pub(super) fn handle(&self) -> sys::CUstream {
        self.raw
    }

    /// Makes this stream wait (on the GPU, not the host) for `event`'s last record.
    pub fn wait(&self, event: &IpcEvent) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: both handles are live (owned by `self`/`event`, or borrowed under the
        // contract of `borrowed`); flags 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw, 0)
        })
    }

    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: live stream handle.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Whether all the work queued on this stream is complete (`cuStreamQuery`), without
    /// waiting: the host-side poll of a bounded drain (`sync::poll_until`).
    pub fn is_idle(&self) -> Result<bool> {
        let _current = self.ctx.bind()?;
        // SAFETY: live stream handle.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuStreamQuery", r).map(|()| true),
        }
    }

    /// Device-to-device copy of `len` bytes, ordered on this stream.
    ///
    /// # Safety
    /// `dst..dst+len` and `src..src+len` must be device memory valid in this context
    /// until the copy completes, and not be written by anyone else meanwhile.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: a stream we created, destroyed once.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// `CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS` (cudarc's safe `event::create`
/// takes one enum value, so the raw call is used).
const IPC_EVENT_FLAGS: c_uint = 2 | 4;

/// An interprocess event: created here (and exported with [`IpcEvent::handle`]), or
/// opened from a peer's handle. Destroyed on drop either way (the driver's rule for
/// opened events too).
#[derive(Debug)]
pub struct IpcEvent {
    raw: sys::CUevent,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for IpcEvent {}
// SAFETY: as above.
unsafe impl Sync for IpcEvent {}

impl IpcEvent {
    pub fn create(ctx: &Arc<PrimaryContext>) -> Result<IpcEvent> {
        let _current = ctx.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; context current; flags are two defined bits.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, IPC_EVENT_FLAGS)
        })?;
        Ok(IpcEvent {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Opens a peer's event. Fails in the process that created it (driver rule).
    pub fn open(ctx: &Arc<PrimaryContext>, handle: &[u8; 64]) -> Result<IpcEvent> {
        let _current = ctx.bind()?;
        let h = sys::CUipcEventHandle_st {
            reserved: handle.map(|b| b as _),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the handle is passed by value (the driver validates
        // it and fails on garbage).
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut raw, h)
        })?;
        Ok(IpcEvent {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// The 64-byte handle a peer opens this event with.
    pub fn handle(&self) -> Result<[u8; 64]> {
        let _current = self.ctx.bind()?;
        let mut h = sys::CUipcEventHandle_st { reserved: [0; 64] };
        // SAFETY: valid out-pointer; an event created with INTERPROCESS.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut h, self.raw)
        })?;
        Ok(h.reserved.map(|b| b as u8))
    }

    /// Records the event after everything queued so far on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: live event and stream handles.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// The raw `CUevent` value, for a binding that calls `cuStreamWaitEvent` itself
    /// (valid while this value lives).
    pub fn raw(&self) -> u64 {
        self.raw as usize as u64
    }

    /// Gives the event up without destroying it (the engine's choice when it leaks its
    /// exported memory: a peer may still wait on the event).
    pub fn leak(self) {
        std::mem::forget(self);
    }

    /// Blocks the host until the event's last record completed.
    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: live event handle.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: an event created or opened by us, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.raw) };
        }
    }
}

// ---------------------------------------------------------------------------------------
// Engine: exported allocations

/// Device memory from `cuMemAlloc` (never a stream-ordered pool: IPC handles exist only
/// for the base of a `cuMemAlloc` allocation). Freed on drop, unless [`leak`]ed.
///
/// [`leak`]: DeviceAllocation::leak
#[derive(Debug)]
pub struct DeviceAllocation {
    ptr: sys::CUdeviceptr,
    size: usize,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a device pointer is a number the driver interprets; usable from any thread.
unsafe impl Send for DeviceAllocation {}
// SAFETY: `&self` methods only read the pointer or hand it to the driver.
unsafe impl Sync for DeviceAllocation {}

impl DeviceAllocation {
    /// `size` bytes (≥ 1), zeroed.
    pub fn new(ctx: &Arc<PrimaryContext>, size: usize) -> Result<DeviceAllocation> {
        if size == 0 {
            return Err(Error::InvalidSpec(
                "a device allocation needs ≥ 1 byte".into(),
            ));
        }
        let _current = ctx.bind()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; context current.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size)
        })?;
        let a = DeviceAllocation {
            ptr,
            size,
            ctx: ctx.clone(),
        };
        // SAFETY: `ptr..ptr+size` was just allocated in the current context.
        check("cuMemsetD8_v2", unsafe { sys::cuMemsetD8_v2(ptr, 0, size) })?;
        finish_legacy_stream()?;
        Ok(a)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The IPC handle of this allocation's base (a peer adds the tensor's offset).
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        let _current = self.ctx.bind()?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: valid out-pointer; `ptr` is the base of a live cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, self.ptr)
        })?;
        Ok(h.reserved.map(|b| b as u8))
    }

    /// Synchronous host→device copy into `offset..offset+bytes.len()`: complete on the
    /// device when this returns, so work queued afterwards on any stream sees it.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        check_span(offset, bytes.len(), self.size)?;
        let _current = self.ctx.bind()?;
        // SAFETY: the span lies inside the allocation (checked); `bytes` is valid host
        // memory of that length.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
            )
        })?;
        finish_legacy_stream()
    }

    /// Synchronous device→host copy of `offset..offset+out.len()`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_span(offset, out.len(), self.size)?;
        read_device(&self.ctx, self.ptr + offset as u64, out)
    }

    /// Gives the memory up without freeing it (the engine's choice when a client never
    /// acknowledged closing its handles: freeing could pull memory from under it; the
    /// driver reclaims it when this process exits).
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

/// Waits for the legacy default stream (`CU_STREAM_LEGACY`), in the current context.
/// `cuMemsetD8` and a `cuMemcpyHtoD` from pageable memory run on it and may return before
/// the device finished them (CUDA's "API synchronization behavior"), and the non-blocking
/// streams of [`Stream::create`] do not wait for it: without this, a kernel queued next
/// on such a stream could see the bytes from before the memset or the copy.
fn finish_legacy_stream() -> Result<()> {
    // SAFETY: CU_STREAM_LEGACY ((CUstream)0x1) is a valid stream handle wherever a context
    // is current (every caller bound one).
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(1usize as sys::CUstream)
    })
}

fn check_span(offset: usize, len: usize, size: usize) -> Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::InvalidSpec(format!(
            "span {offset}+{len} lies outside a {size}-byte device allocation"
        )));
    }
    Ok(())
}

fn read_device(ctx: &PrimaryContext, src: u64, out: &mut [u8]) -> Result<()> {
    let _current = ctx.bind()?;
    // SAFETY: callers check that `src..src+out.len()` is inside a live allocation of
    // this context; `out` is valid writable host memory of that length.
    check("cuMemcpyDtoH_v2", unsafe {
        sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, src, out.len())
    })
}

impl Drop for DeviceAllocation {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: a live allocation of ours, freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

// ---------------------------------------------------------------------------------------
// Client: imported allocations

/// A peer's allocation opened with `cuIpcOpenMemHandle` in a primary context. One per
/// (device, handle) per process ([`import_memory`] caches them); the handle is closed
/// when the last `Arc` drops, exactly once.
#[derive(Debug)]
pub struct ImportedMemory {
    base: sys::CUdeviceptr,
    size: usize,
    key: (i32, [u8; 64]),
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a device pointer is a number the driver interprets; usable from any thread.
unsafe impl Send for ImportedMemory {}
// SAFETY: `&self` methods only read the pointer or hand it to the driver.
unsafe impl Sync for ImportedMemory {}

type ImportCache = HashMap<(i32, [u8; 64]), Weak<ImportedMemory>>;
static IMPORTS: Mutex<Option<ImportCache>> = Mutex::new(None);
static OPENS: AtomicU64 = AtomicU64::new(0);
static CLOSES: AtomicU64 = AtomicU64::new(0);

fn imports() -> std::sync::MutexGuard<'static, Option<ImportCache>> {
    // A panic elsewhere while holding the lock leaves a usable map; take it.
    IMPORTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `(handles opened, handles closed)` by this process so far (for leak tests).
pub fn import_counts() -> (u64, u64) {
    (OPENS.load(Ordering::SeqCst), CLOSES.load(Ordering::SeqCst))
}

/// Opens (or finds already open) the allocation behind `handle` in `ctx`. The size is
/// the driver's (`cuMemGetAddressRange`), so a peer cannot make us read past it.
pub fn import_memory(ctx: &Arc<PrimaryContext>, handle: &[u8; 64]) -> Result<Arc<ImportedMemory>> {
    let key = (ctx.ordinal, *handle);
    // Held across the open, and by `Drop` across the close: an open never races the
    // close of the same handle.
    let mut cache = imports();
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(m) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(m);
    }
    let _current = ctx.bind()?;
    let h = sys::CUipcMemHandle_st {
        reserved: handle.map(|b| b as _),
    };
    let mut base = 0;
    // SAFETY: valid out-pointer; context current; the handle is passed by value and the
    // driver validates it (garbage fails). 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
    check("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(&mut base, h, 1)
    })?;
    OPENS.fetch_add(1, Ordering::SeqCst);
    let (mut start, mut size) = (0, 0usize);
    // SAFETY: valid out-pointers; `base` was just mapped in this context.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) };
    // The usable bytes from `base` on: normally the whole range (`start == base`); if the
    // driver mapped a larger block around the exported allocation, what lies past `base`.
    let usable = base
        .checked_sub(start)
        .and_then(|into| (size as u64).checked_sub(into))
        .filter(|_| r == CUresult::CUDA_SUCCESS);
    let m = Arc::new(ImportedMemory {
        base,
        size: usable.unwrap_or(0) as usize,
        key,
        ctx: ctx.clone(),
    });
    if usable.is_none() {
        drop(cache); // `m`'s drop takes the lock to close the handle
        drop(m);
        return Err(Error::Cuda {
            call: "cuMemGetAddressRange_v2",
            detail: format!("{r:?} (opened base {base:#x}, range {start:#x} + {size} bytes)"),
        });
    }
    map.insert(key, Arc::downgrade(&m));
    Ok(m)
}

impl ImportedMemory {
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The bytes usable from [`base`](Self::base) on, as the driver reports the range.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device address of `offset..offset+len`, checked against the allocation.
    pub fn span(&self, offset: u64, len: u64) -> Result<u64> {
        if offset.checked_add(len).is_none_or(|e| e > self.size as u64) {
            return Err(Error::Cuda {
                call: "import",
                detail: format!(
                    "span {offset}+{len} lies outside the peer's {}-byte allocation",
                    self.size
                ),
            });
        }
        Ok(self.base + offset)
    }

    /// Synchronous device→host copy (tests, debugging).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let at = self.span(offset, out.len() as u64)?;
        read_device(&self.ctx, at, out)
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.bind() {
            // A consumer (torch) frees its view on the host while kernels reading it may
            // still be queued on any of its streams: wait for the context's work before
            // unmapping. Once per import, at teardown; outside the cache lock.
            // SAFETY: our context is current.
            let _ = unsafe { sys::cuCtxSynchronize() };
        }
        let mut cache = imports();
        if let Some(map) = cache.as_mut() {
            // Remove our entry unless a newer import already replaced it.
            if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
                map.remove(&self.key);
            }
        }
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed
            // exactly once (here; the Arc ensures a single owner drops it).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.base) };
            CLOSES.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Memory shared by file descriptor (the virtual memory management API): crosses PID
// namespaces, where CUDA IPC handles do not

/// The allocation properties of memory shareable as a POSIX fd on device `dev`.
fn fd_shareable_props(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and a null pointer; all zero is "no flags,
    // no compression, reserved 0", as the driver documents its defaults.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: dev,
    };
    p
}

impl PrimaryContext {
    /// `Ok(())` when this device can share memory by fd ([`FdMemory`]): the driver has
    /// the entry points and the device supports virtual memory management and POSIX fd
    /// handles; else `Err` with the reason (the caller falls back to CUDA IPC or
    /// refuses). Driver errors are `Error::Cuda`.
    pub fn fd_sharing(&self, driver: &Driver) -> Result<std::result::Result<(), String>> {
        if !driver.vmm_absent.is_empty() {
            return Ok(Err(format!(
                "the CUDA driver lacks {}",
                driver.vmm_absent.join(", ")
            )));
        }
        for (attr, what) in [
            (
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                "virtual memory management",
            ),
            (
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                "POSIX file descriptor handles",
            ),
        ] {
            let mut v = 0;
            // SAFETY: valid out-pointer; `dev` came from cuDeviceGet; a defined attribute.
            check("cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut v, attr, self.dev)
            })?;
            if v == 0 {
                return Ok(Err(format!(
                    "CUDA device {} does not support {what}",
                    self.ordinal
                )));
            }
        }
        Ok(Ok(()))
    }

    /// The granularity (bytes) of fd-shareable allocations on this device: their sizes
    /// are multiples of it.
    pub fn fd_granularity(&self) -> Result<usize> {
        let props = fd_shareable_props(self.dev);
        let mut g = 0usize;
        // SAFETY: valid out-pointer and properties; the symbol was checked by the
        // caller's `fd_sharing` (FdMemory's constructors check it again).
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &props,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if g == 0 {
            return Err(Error::Cuda {
                call: "cuMemGetAllocationGranularity",
                detail: "a granularity of 0 bytes".into(),
            });
        }
        Ok(g)
    }
}

/// Device memory made with `cuMemCreate` (requested handle type
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) by the engine, or imported from such an
/// allocation's fd by a client (`cuMemImportFromShareableHandle`), and mapped whole at an
/// address range reserved for it (`cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`
/// read-write for the context's device). Unlike a CUDA IPC handle, the fd works in any
/// process that receives it (over a Unix socket: `SCM_RIGHTS`), whatever its PID
/// namespace. Unmapped, the range freed and the handle released on drop (after the
/// context's queued work), unless [`leak`](FdMemory::leak)ed.
#[derive(Debug)]
pub struct FdMemory {
    handle: sys::CUmemGenericAllocationHandle,
    /// 0 until mapped.
    ptr: sys::CUdeviceptr,
    /// The reserved and mapped size (the allocation's).
    size: usize,
    /// Whether `ptr..ptr+size` is reserved, and whether it is mapped.
    reserved: bool,
    mapped: bool,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a generic allocation handle and a device address are numbers the driver
// interprets; usable from any thread.
unsafe impl Send for FdMemory {}
// SAFETY: `&self` methods only read them or hand them to the driver.
unsafe impl Sync for FdMemory {}

impl FdMemory {
    /// `size` bytes (≥ 1, rounded up to the device's granularity), zeroed, shareable as
    /// an fd. `CudaUnavailable` where the device cannot share memory by fd.
    pub fn allocate(driver: &Driver, ctx: &Arc<PrimaryContext>, size: usize) -> Result<FdMemory> {
        if size == 0 {
            return Err(Error::InvalidSpec(
                "a device allocation needs ≥ 1 byte".into(),
            ));
        }
        Self::supported(driver, ctx)?;
        let g = ctx.fd_granularity()?;
        let size = size
            .checked_next_multiple_of(g)
            .ok_or_else(|| Error::InvalidSpec(format!("a device allocation of {size} bytes")))?;
        let _current = ctx.bind()?;
        let props = fd_shareable_props(ctx.dev);
        let mut handle = 0;
        // SAFETY: valid out-pointer and properties; `size` is a multiple of the
        // granularity for these properties; the symbols are present (`supported`).
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &props, 0)
        })?;
        let mut m = FdMemory {
            handle,
            ptr: 0,
            size,
            reserved: false,
            mapped: false,
            ctx: ctx.clone(),
        };
        // On an error below, `m`'s drop undoes what was done.
        m.map()?;
        // SAFETY: `ptr..ptr+size` is mapped read-write for this context's device.
        check("cuMemsetD8_v2", unsafe {
            sys::cuMemsetD8_v2(m.ptr, 0, size)
        })?;
        finish_legacy_stream()?;
        Ok(m)
    }

    /// Imports the allocation behind `fd` (from [`FdMemory::export_fd`] in another
    /// process) and maps `size` bytes of it: the engine's `export_size`, a multiple of
    /// this device's granularity. An fd that is not such an allocation, or an allocation
    /// smaller than `size`, is an `Error::Cuda` from the driver (nothing mapped). The fd
    /// stays the caller's: the import holds the memory, not the fd.
    pub fn import(
        driver: &Driver,
        ctx: &Arc<PrimaryContext>,
        fd: std::os::fd::BorrowedFd<'_>,
        size: u64,
    ) -> Result<FdMemory> {
        use std::os::fd::AsRawFd;
        Self::supported(driver, ctx)?;
        let g = ctx.fd_granularity()?;
        let size = usize::try_from(size)
            .ok()
            .filter(|&s| s > 0 && s % g == 0)
            .ok_or_else(|| {
                Error::InvalidSpec(format!(
                    "a shared CUDA allocation of {size} bytes (not a positive multiple of the \
                 device's {g}-byte granularity)"
                ))
            })?;
        let _current = ctx.bind()?;
        let mut handle = 0;
        // SAFETY: valid out-pointer; for a POSIX fd handle the driver takes the fd's
        // number in the pointer argument (`(void *)(uintptr_t)fd`) and only reads it;
        // the fd is open (borrowed) across the call; the symbols are present.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        let mut m = FdMemory {
            handle,
            ptr: 0,
            size,
            reserved: false,
            mapped: false,
            ctx: ctx.clone(),
        };
        m.map()?;
        Ok(m)
    }

    fn supported(driver: &Driver, ctx: &PrimaryContext) -> Result<()> {
        ctx.fd_sharing(driver)?
            .map_err(|reason| Error::CudaUnavailable {
                reason: format!("CUDA memory cannot be shared by file descriptor here: {reason}"),
            })
    }

    /// Reserves an address range of `size` bytes, maps the allocation there and makes it
    /// readable and writable by the context's device. The context is current (callers).
    fn map(&mut self) -> Result<()> {
        let g = self.ctx.fd_granularity()?;
        // SAFETY: valid out-pointer; `size` is a multiple of the granularity; no fixed
        // address, no flags.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut self.ptr, self.size, g, 0, 0)
        })?;
        self.reserved = true;
        // SAFETY: the range was just reserved with this size; `handle` is a live
        // allocation handle (the driver refuses an allocation smaller than `size`).
        check("cuMemMap", unsafe {
            sys::cuMemMap(self.ptr, self.size, 0, self.handle, 0)
        })?;
        self.mapped = true;
        let access = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ctx.dev,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the whole mapped range; one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.ptr, self.size, &access, 1)
        })
    }

    /// A new fd of the allocation (`cuMemExportToShareableHandle`), close-on-exec, for
    /// the fd socket. Each call makes another fd; the receiver's import keeps the memory
    /// alive on its own. The driver opens it without close-on-exec and the call takes no
    /// flag for it: see [`crate::os::own_driver_fd`] for the instant before it is set.
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        let _current = self.ctx.bind()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX fd handle the driver writes an `int` through the pointer;
        // `handle` is a live allocation made with that handle type requested.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::Cuda {
                call: "cuMemExportToShareableHandle",
                detail: format!("returned fd {fd}"),
            });
        }
        // SAFETY: a new fd the driver just opened for us and nobody else owns. Drivers
        // hand out exported fds without close-on-exec: set at once (`own_driver_fd`).
        unsafe { crate::os::own_driver_fd(fd) }
    }

    /// Device address of the first byte, in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The mapped size (the allocation's, a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device address of `offset..offset+len`, checked against the mapping.
    pub fn span(&self, offset: u64, len: u64) -> Option<u64> {
        offset
            .checked_add(len)
            .filter(|&end| end <= self.size as u64)
            .map(|_| self.ptr + offset)
    }

    /// Synchronous host→device copy into `offset..offset+bytes.len()`.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        check_span(offset, bytes.len(), self.size)?;
        let _current = self.ctx.bind()?;
        // SAFETY: the span lies inside the mapping (checked); `bytes` is valid host
        // memory of that length.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(
                self.ptr + offset as u64,
                bytes.as_ptr() as *const c_void,
                bytes.len(),
            )
        })?;
        finish_legacy_stream()
    }

    /// Synchronous device→host copy of `offset..offset+out.len()`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_span(offset, out.len(), self.size)?;
        read_device(&self.ctx, self.ptr + offset as u64, out)
    }

    /// Gives the memory up without unmapping or releasing it (as
    /// [`DeviceAllocation::leak`]: the driver reclaims it when this process exits).
    pub fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for FdMemory {
    fn drop(&mut self) {
        let Ok(_current) = self.ctx.bind() else {
            return;
        };
        // SAFETY (the four calls): the context's queued work is finished before the
        // mapping goes; each undoes one step that succeeded, once, in reverse order.
        unsafe {
            let _ = sys::cuCtxSynchronize();
            if self.mapped {
                let _ = sys::cuMemUnmap(self.ptr, self.size);
            }
            if self.reserved {
                let _ = sys::cuMemAddressFree(self.ptr, self.size);
            }
            let _ = sys::cuMemRelease(self.handle);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Vulkan memory and semaphores imported into CUDA (protocol 1.3)

/// Memory another API exported as an `OPAQUE_FD` (a Vulkan allocation), imported with
/// `cuImportExternalMemory` and mapped whole as one device buffer. The mapping is freed
/// and the import destroyed on drop, after the context's queued work.
#[derive(Debug)]
pub struct ExternalMemory {
    handle: sys::CUexternalMemory,
    ptr: sys::CUdeviceptr,
    size: u64,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: driver handles and a device address, usable from any thread.
unsafe impl Send for ExternalMemory {}
// SAFETY: `&self` methods only read them.
unsafe impl Sync for ExternalMemory {}

impl ExternalMemory {
    /// Imports `size` bytes (the exporter's `allocationSize`) from `fd`, as a dedicated
    /// allocation if it was one, and maps all of it. The driver owns `fd` once the
    /// import succeeded; on an error it is closed here.
    pub fn import_opaque_fd(
        ctx: &Arc<PrimaryContext>,
        fd: std::os::fd::OwnedFd,
        size: u64,
        dedicated: bool,
    ) -> Result<ExternalMemory> {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let _current = ctx.bind()?;
        // SAFETY: a plain C struct; all-zero is its documented "no flags, reserved 0".
        let mut desc: sys::CUDA_EXTERNAL_MEMORY_HANDLE_DESC = unsafe { std::mem::zeroed() };
        desc.type_ = sys::CUexternalMemoryHandleType::CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
        desc.handle.fd = fd.as_raw_fd();
        desc.size = size;
        desc.flags = if dedicated {
            sys::CUDA_EXTERNAL_MEMORY_DEDICATED
        } else {
            0
        };
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer and descriptor; our context is current; the fd is
        // open (owned by `fd`) across the call.
        check("cuImportExternalMemory", unsafe {
            sys::cuImportExternalMemory(&mut handle, &desc)
        })?;
        // Imported: the driver owns the fd now (it closes it with the import).
        let _ = fd.into_raw_fd();
        let mut m = ExternalMemory {
            handle,
            ptr: 0,
            size,
            ctx: ctx.clone(),
        };
        // SAFETY: as above; all-zero is offset 0, flags 0.
        let mut buffer: sys::CUDA_EXTERNAL_MEMORY_BUFFER_DESC = unsafe { std::mem::zeroed() };
        buffer.size = size;
        // SAFETY: valid out-pointer and descriptor; `handle` is a live import of `size`
        // bytes. On an error `m`'s drop destroys the import (and frees no mapping).
        check("cuExternalMemoryGetMappedBuffer", unsafe {
            sys::cuExternalMemoryGetMappedBuffer(&mut m.ptr, m.handle, &buffer)
        })?;
        Ok(m)
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The context it was imported into.
    pub fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// The device address of `offset..offset+len`, checked against the import.
    pub fn span(&self, offset: u64, len: u64) -> Option<u64> {
        offset
            .checked_add(len)
            .filter(|&end| end <= self.size)
            .map(|_| self.ptr + offset)
    }

    /// Synchronous device→host copy (tests, debugging).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let at = self
            .span(offset, out.len() as u64)
            .ok_or_else(|| Error::Cuda {
                call: "external memory",
                detail: format!("span {offset}+{} outside {} bytes", out.len(), self.size),
            })?;
        read_device(&self.ctx, at, out)
    }
}

impl Drop for ExternalMemory {
    fn drop(&mut self) {
        let Ok(_current) = self.ctx.bind() else {
            return;
        };
        // SAFETY: our context is current. A consumer's kernels may still read the
        // mapping: wait for them before it goes (as for IPC imports).
        let _ = unsafe { sys::cuCtxSynchronize() };
        if self.ptr != 0 {
            // SAFETY: the mapping `cuExternalMemoryGetMappedBuffer` returned, freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
        // SAFETY: the import, destroyed once, after its mapping.
        let _ = unsafe { sys::cuDestroyExternalMemory(self.handle) };
    }
}

/// A timeline semaphore another API exported as an fd (Vulkan), imported with
/// `cuImportExternalSemaphore`; destroyed on drop.
#[derive(Debug)]
pub struct ExternalSemaphore {
    handle: sys::CUexternalSemaphore,
    ctx: Arc<PrimaryContext>,
}

// SAFETY: a driver handle, usable from any thread.
unsafe impl Send for ExternalSemaphore {}
// SAFETY: as above.
unsafe impl Sync for ExternalSemaphore {}

impl ExternalSemaphore {
    /// Imports `fd`, a timeline semaphore's `OPAQUE_FD` export
    /// (`TIMELINE_SEMAPHORE_FD`). The driver owns `fd` once the import succeeded.
    pub fn import_timeline(
        ctx: &Arc<PrimaryContext>,
        fd: std::os::fd::OwnedFd,
    ) -> Result<ExternalSemaphore> {
        use std::os::fd::{AsRawFd, IntoRawFd};
        let _current = ctx.bind()?;
        // SAFETY: a plain C struct; all-zero is "no flags, reserved 0".
        let mut desc: sys::CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC = unsafe { std::mem::zeroed() };
        desc.type_ = sys::CUexternalSemaphoreHandleType::CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD;
        desc.handle.fd = fd.as_raw_fd();
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer and descriptor; context current; the fd is open.
        check("cuImportExternalSemaphore", unsafe {
            sys::cuImportExternalSemaphore(&mut handle, &desc)
        })?;
        let _ = fd.into_raw_fd();
        Ok(ExternalSemaphore {
            handle,
            ctx: ctx.clone(),
        })
    }

    /// Makes `stream` wait, on the device, until the semaphore's value reaches `value`.
    pub fn wait(&self, stream: &Stream, value: u64) -> Result<()> {
        let _current = self.ctx.bind()?;
        // SAFETY: a plain C struct; all-zero is "no flags".
        let mut params: sys::CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS = unsafe { std::mem::zeroed() };
        params.params.fence.value = value;
        // SAFETY: one live semaphore and its parameters; the stream is live (owned, or
        // borrowed under `Stream::borrowed`'s contract); context current.
        check("cuWaitExternalSemaphoresAsync", unsafe {
            sys::cuWaitExternalSemaphoresAsync(&self.handle, &params, 1, stream.raw)
        })
    }
}

impl Drop for ExternalSemaphore {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.bind() {
            // SAFETY: our context is current. Every wait queued on the semaphore must
            // have completed before it is destroyed (the driver's rule): finish them.
            let _ = unsafe { sys::cuCtxSynchronize() };
            // SAFETY: the import, destroyed once.
            let _ = unsafe { sys::cuDestroyExternalSemaphore(self.handle) };
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn missing_lists_what_lookup_lacks() {
        assert_eq!(missing(&["a", "b", "c"], |n| n != "b"), vec!["b"]);
        assert!(missing(DRIVER_SYMBOLS, |_| true).is_empty());
    }

    #[test]
    fn driver_get_is_typed_and_cached() {
        let a = Driver::get().map(|d| d.info().clone());
        let b = Driver::get().map(|d| d.info().clone());
        match (a, b) {
            (Ok(x), Ok(y)) => assert_eq!(x, y),
            (
                Err(Error::CudaUnavailable { reason: r1 }),
                Err(Error::CudaUnavailable { reason: r2 }),
            ) => {
                assert_eq!(r1, r2);
                eprintln!("CUDA unavailable here: {r1}");
            }
            (a, b) => panic!("inconsistent probes: {a:?} / {b:?}"),
        }
    }

    #[test]
    fn spans_are_checked() {
        assert!(check_span(0, 10, 10).is_ok());
        assert!(check_span(1, 10, 10).is_err());
        assert!(check_span(usize::MAX, 2, 10).is_err());
    }
}
