//! The two hooks a device backend gives the transport: the engine's and the client's.
//!
//! [`Engine`](crate::Engine) and [`Client`](crate::Client) each hold one backend, picked
//! by [`engine_backend`](super::engine_backend) / [`client_backend`](super::client_backend)
//! from the layout, and call it at fixed points of the protocol. Host memory needs
//! nothing at any of them ([`super::host`]); a device whose work is asynchronous (CUDA)
//! orders it there with events, and exports or imports its memory.

use std::any::Any;
use std::marker::PhantomData;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use super::Device;
use crate::control::{Claim, Control, ControlMapping};
use crate::error::Result;
use crate::layout::{Layout, TensorInfo};

/// The engine's side of a backend.
pub trait EngineBackend: Any + Send + Sync + std::fmt::Debug {
    /// Whether the hooks of the step path (`before_publish`, `before_actions`) do
    /// anything: the engine asks once and skips the calls when they do not (host
    /// memory), so a host step pays no call for them.
    fn needs_hooks(&self) -> bool {
        true
    }

    /// Before a frame or a command's reply is published (`READY`, `frame_seq`, the reply
    /// push): makes the device work that wrote it complete before the peer reads it.
    fn before_publish(&self) -> Result<()>;

    /// After an action was posted, before the engine reads the client→engine tensors:
    /// orders the engine's reads after the client's device writes.
    fn before_actions(&mut self, control: Control<'_>) -> Result<()>;

    /// Before answering a command (a reset may write tensors the client's queued work
    /// still reads).
    fn before_command(&mut self, control: Control<'_>) -> Result<()>;

    /// The client closed or died: drop what was opened of it.
    fn forget_client(&mut self);

    /// Device address (in this process) of a tensor in the backend's memory.
    fn device_ptr(&self, t: &TensorInfo) -> Result<u64>;

    /// The stream the device work that writes a frame (or a command's reset) goes on,
    /// so that the engine's publication follows it (CUDA: the engine's `CUstream`);
    /// `None` for a backend without one.
    fn stream(&self) -> Option<StreamRef<'_>> {
        None
    }

    /// Once the region exists (before frame 0): start serving what the client fetches
    /// outside the region (Vulkan: the fd socket). Host and CUDA: nothing.
    fn start(&mut self, _region: &dyn ControlMapping) -> Result<()> {
        Ok(())
    }

    /// Host address (in this process) of tensor `index` when the backend's memory of
    /// it is mapped on the CPU (Vulkan host-visible memory); `None` otherwise.
    fn host_ptr(&self, _index: usize, _t: &TensorInfo) -> Option<NonNull<u8>> {
        None
    }

    /// At close, after `engine_state = CLOSED` is stored: finishes the device's queued
    /// work and frees exported memory once the client acknowledged releasing it (or
    /// died, or never imported it).
    fn release(self: Box<Self>, control: Control<'_>) -> DeviceRelease;

    /// Instead of [`EngineBackend::release`] when the region was truncated under the
    /// engine: the control block cannot be read, so nothing may wait on a client's
    /// acknowledgement. The default leaks the backend whole (exported CUDA memory a
    /// client may still map is freed with the process, never under the client); a
    /// backend that needs no acknowledgement lets go of everything.
    fn release_truncated(self: Box<Self>) {
        std::mem::forget(self);
    }

    fn as_any(&self) -> &dyn Any;
}

/// The client's side of a backend.
pub trait ClientBackend: Any + Send + Sync + std::fmt::Debug {
    /// Whether the hooks of the step path (`before_post`, `after_frame`) do anything:
    /// the client asks once and skips the calls when they do not (host memory).
    fn needs_hooks(&self) -> bool {
        true
    }

    /// While the client claims the slot (before it is `ATTACHED`): publishes in the
    /// control block what the engine needs of this client's device session, and keeps
    /// how the session will acknowledge releasing the engine's memory (CUDA: the
    /// client's event handle, and the session tag of 1.5, for a `layout` of that
    /// version). `PeerClosed` if the engine closed meanwhile. Nothing for a backend that
    /// publishes nothing.
    fn publish_session(
        &mut self,
        _control: Control<'_>,
        _claim: &Claim,
        _layout: &Layout,
    ) -> Result<()> {
        Ok(())
    }

    /// After the slot is claimed (and the event published): imports the engine's memory.
    /// `region`: the client's mapping (a backend that asks the engine for fds proves with
    /// it that it is the attached client, and checks the engine's proof against it).
    fn open(&mut self, layout: &Layout, region: &dyn ControlMapping) -> Result<()>;

    /// At the points where the client checks its region (before each sleep of a wait,
    /// before a command): an error when an import can no longer be used (memory the
    /// engine exported that shrank under the mapping); it sticks. Nothing for host
    /// memory.
    fn check_imports(&self) -> Result<()> {
        Ok(())
    }

    /// Why tensor `index` has no host view when [`ClientBackend::host_ptr`] gave none
    /// and the reason is not the placement (an import found unusable); `None` otherwise.
    fn import_error(&self, _index: usize, _t: &TensorInfo) -> Option<crate::error::Error> {
        None
    }

    /// Before an action or a request is posted: orders the client's device writes (on
    /// `stream`, the default stream if `None`) before the engine's reads. A backend that
    /// waits on the host here for device work the engine may never let finish (a stream
    /// waiting on the engine's semaphore) waits at most `timeout` (`Timeout`, which a
    /// step reports as `NotPosted`: nothing was sent), and runs `check` (the engine's
    /// liveness, an interrupt) between polls.
    fn before_post(
        &self,
        stream: Option<StreamRef<'_>>,
        timeout: Duration,
        check: &dyn Fn() -> Result<()>,
    ) -> Result<()>;

    /// Which importer serves this client and why, where there is a choice (Vulkan
    /// tensors: CUDA or a Vulkan device of the client's own); `None` otherwise.
    fn importer_reason(&self) -> Option<&str> {
        None
    }

    /// A frame arrived (`frame`: at attach, the frame current then; after each step,
    /// the new one): an import whose frames are ordered by an exported semaphore
    /// accounts for its signal. Nothing for host memory and IPC imports.
    fn after_frame(&self, _frame: u64) -> Result<()> {
        Ok(())
    }

    /// Device address (in this process) of tensor `index` of the layout.
    fn device_ptr(&self, index: usize, t: &TensorInfo) -> Result<u64>;

    /// Host address (in this process) of tensor `index` when the import maps it on the
    /// CPU (a Vulkan tensor imported into a Vulkan device of the client's own); `None`
    /// otherwise.
    fn host_ptr(&self, _index: usize, _t: &TensorInfo) -> Option<NonNull<u8>> {
        None
    }

    /// DLPack `(device_type, device_id)` of this client's view of tensor `index`: the
    /// table's placement unless the import decides (a Vulkan tensor is `kDLCPU` when
    /// mapped on the CPU, `kDLCUDA` when imported into CUDA).
    fn dlpack_device(&self, _index: usize, t: &TensorInfo) -> (i32, i32) {
        t.device.dlpack()
    }

    /// Where tensor `index` lives in this process: `None` in the region (host memory),
    /// else its device address, this process's device and a lease on its import.
    /// `Closed` once the backend released its imports.
    fn place(&self, index: usize, t: &TensorInfo) -> Result<Option<DevicePlace>>;

    /// After a frame or a command's reply arrived: makes `stream` wait, on the device,
    /// for the engine's last publication, so work queued on it afterwards sees the new
    /// device tensors. Nothing for host memory or once released.
    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()>;

    /// Copies `nbytes` of device memory from `src` into the client→engine tensor at
    /// `dst` on `stream`, after the engine's last publication (it may still be reading
    /// the previous contents). `before_post` on the same stream then orders the copy
    /// before the engine's reads.
    ///
    /// # Safety
    /// `src` is `nbytes` of memory of this backend's device, valid for work ordered on
    /// `stream`; `dst` is the address ([`ClientBackend::place`]) of a tensor of at least
    /// `nbytes` bytes.
    unsafe fn copy_into(
        &self,
        dst: u64,
        src: u64,
        nbytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<()>;

    /// At close, before `client_state = CLOSED` is stored: closes the imports and
    /// acknowledges it in `region`'s control block (or, while views still hold them,
    /// leaves that to the last view). What must outlive the CLOSED store (the client's
    /// own event) is dropped with the backend.
    fn release(&mut self, region: &dyn ControlMapping);

    fn as_any(&self) -> &dyn Any;
}

/// Where a device tensor's bytes are in the client's process.
#[derive(Debug, Clone)]
pub struct DevicePlace {
    /// Device address of the first byte.
    pub ptr: u64,
    /// The device, as this process numbers it.
    pub device: Device,
    /// Keeps the import open: a view that must stay valid after the client closes (a
    /// DLPack capsule) holds a clone.
    pub lease: Arc<dyn DeviceLease>,
}

/// A hold on a client's imports of the engine's device memory. While any clone lives the
/// imports stay open; the client's close acknowledgement waits for the last one.
pub trait DeviceLease: Send + Sync + std::fmt::Debug {
    /// Makes `stream` wait, on the device, for the engine's last published frame.
    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()>;
}

/// A device that imports memory and timeline semaphores another backend's engine
/// exported as fds (`OPAQUE_FD`): what the Vulkan client imports into when it hands out
/// device pointers (CUDA implements it). Picked by
/// [`fd_importer`](super::fd_importer), so no backend's folder names another's.
pub trait FdImporter: Send + Sync {
    /// The device's API, for messages ("CUDA").
    fn name(&self) -> &'static str;
    /// What it is, for the client's `importer_reason` ("CUDA importer on device 0
    /// (kDLCUDA)").
    fn describe(&self) -> String;
    /// The device its imports live on ([`DevicePlace::device`]).
    fn device(&self) -> Result<Device>;
    /// The DLPack `(device_type, device_id)` of its imports.
    fn dlpack_device(&self) -> (i32, i32);
    /// Imports `size` bytes (the exporter's allocation size) from `fd`, as a dedicated
    /// allocation if it was one, mapped whole. `fd` is the importer's from the call on.
    fn import_memory(&self, fd: OwnedFd, size: u64, dedicated: bool) -> Result<Box<dyn FdMemory>>;
    /// Imports `fd`, a timeline semaphore's export.
    fn import_timeline(&self, fd: OwnedFd) -> Result<Box<dyn FdTimeline>>;
    /// Waits on the host until `stream` (the device's default stream if `None`) ran all
    /// the work queued on it.
    fn synchronize(&self, stream: Option<StreamRef<'_>>) -> Result<()>;
    /// Whether `stream` (the default stream if `None`) ran all its queued work, without
    /// waiting: the poll of a bounded drain (`sync::poll_until`).
    fn is_idle(&self, stream: Option<StreamRef<'_>>) -> Result<bool>;
}

/// Memory an [`FdImporter`] imported; released on drop (after the device's queued work).
pub trait FdMemory: Send + Sync + std::fmt::Debug {
    /// The device address of `offset..offset + len`, if inside the import.
    fn span(&self, offset: u64, len: u64) -> Option<u64>;
    /// Synchronous device-to-host copy of `out.len()` bytes from `offset`.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()>;
}

/// A timeline semaphore an [`FdImporter`] imported; destroyed on drop.
pub trait FdTimeline: Send + Sync + std::fmt::Debug {
    /// Makes `stream` wait, on the device, until the semaphore's value reaches `value`.
    fn wait(&self, stream: StreamRef<'_>, value: u64) -> Result<()>;
}

/// A device stream, by its raw handle (CUDA: a `CUstream`, or 1/2 for the legacy and
/// per-thread default streams), borrowed for `'a`.
#[derive(Debug, Clone, Copy)]
pub struct StreamRef<'a> {
    raw: u64,
    _stream: PhantomData<&'a ()>,
}

impl StreamRef<'_> {
    /// # Safety
    /// `raw` must be 1, 2, or a live stream of the device the backend serves, which
    /// stays alive for the returned value's lifetime.
    pub unsafe fn from_raw(raw: u64) -> Self {
        StreamRef {
            raw,
            _stream: PhantomData,
        }
    }

    pub fn raw(self) -> u64 {
        self.raw
    }
}

/// What an engine did with its exported device memory when it closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRelease {
    /// No exported memory a client could still hold open: host memory, Vulkan memory
    /// (an importer holds its own reference to it), or not closed yet.
    NothingHeld,
    /// Freed: the client acknowledged closing its handles, died, or never opened them.
    Freed,
    /// Deliberately not freed: a live client still had the memory open (`client_cuda_state
    /// = OPEN`) when the bounded wait ran out. Freeing memory a peer has mapped is
    /// undefined behaviour in the driver; the driver reclaims it when this process exits.
    Leaked,
}
