//! The CUDA halves of [`Engine`](crate::Engine) and [`Client`](crate::Client) (protocol
//! 1.2, `docs/protocol.md` §3.5): what each side allocates, exports, opens, records and
//! waits on. No `unsafe` here: every driver call goes through [`super::driver`].
//!
//! The allocation is shared one of two ways ([`CudaSharing`], chosen by the engine:
//! [`super::share::decide`]): by CUDA IPC handle, the frames ordered on the GPU by IPC
//! events (one PID namespace); or by file descriptor (1.9, §3.5.1: `cuMemCreate`, the fd
//! served over the region's socket by [`FdServer`]), the frames ordered on the host (the
//! engine synchronises its stream before each publication; the client waits for its
//! stream before each post, polling within the step's timeout: [`order_before_post`]),
//! since IPC events do not cross PID namespaces either.
//!
//! Written against the driver layer and checked on CPU only for its refusals
//! (`CudaUnavailable`); the GPU behaviour is exercised by `tests/cuda.rs` on a GPU machine.

use std::any::Any;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::driver::{
    self, DeviceAllocation, Driver, FdMemory, ImportedMemory, IpcEvent, PrimaryContext, Stream,
};
use super::share::{self, CudaSharingRequest};
use crate::control::{Claim, Control, ControlMapping, ReleaseAck};
use crate::device::backend::{
    ClientBackend, DeviceLease, DevicePlace, DeviceRelease, EngineBackend, StreamRef,
};
use crate::device::server::FdServer;
use crate::error::{Error, Peer, Result};
use crate::layout::location::Device;
use crate::layout::vulkan::SharedFd;
use crate::layout::{
    ClientEventHandle, CudaSharing, Direction, HeaderBuilder, Layout, Location, TensorInfo,
    VERSION_MINOR_CUDA_SESSIONS,
};

/// How long an engine that closes waits for its client's close acknowledgement before
/// it leaks the exported memory instead of freeing it.
pub const RELEASE_WAIT: Duration = Duration::from_millis(500);

/// The engine's exported allocation, as it is shared.
#[derive(Debug)]
enum Exported {
    /// `cuMemAlloc`, shared by IPC handle.
    Ipc(DeviceAllocation),
    /// `cuMemCreate`, shared by fd (1.9).
    Fd(FdMemory),
}

impl Exported {
    fn ptr(&self) -> u64 {
        match self {
            Exported::Ipc(a) => a.ptr(),
            Exported::Fd(m) => m.ptr(),
        }
    }

    fn size(&self) -> usize {
        match self {
            Exported::Ipc(a) => a.size(),
            Exported::Fd(m) => m.size(),
        }
    }

    fn leak(self) {
        match self {
            Exported::Ipc(a) => a.leak(),
            Exported::Fd(m) => m.leak(),
        }
    }
}

/// The engine's CUDA state: the one exported allocation, its stream and event, and the
/// current client's event (opened once per client); shared by fd, the fd and its
/// server instead of the events.
#[derive(Debug)]
pub struct EngineCuda {
    // Field order is drop order: the fd server (no more sends), the client's event and
    // ours, the stream, then the memory; the context last (each holds an `Arc` of it).
    server: Option<FdServer>,
    /// Shared by fd: the allocation's fd, served to the attached client.
    fd: Option<SharedFd>,
    client_event: Option<(ClientEventHandle, IpcEvent)>,
    event: Option<IpcEvent>,
    stream: Option<Stream>,
    alloc: Option<Exported>,
    /// Whether a client→engine tensor lives on the device (then a client must publish
    /// an event, and the engine waits on it before reading actions).
    reads_device_actions: bool,
    ctx: Arc<PrimaryContext>,
}

impl EngineCuda {
    /// Allocates [`HeaderBuilder::cuda_alloc`] in one allocation, shared as `request`
    /// asks ([`share::decide`]): by IPC handle (`cuMemAlloc`, with the interprocess
    /// event), or by fd (`cuMemCreate`; the fd is served once the region exists,
    /// [`EngineBackend::start`]); creates the stream and writes the exports into
    /// `builder` (before the region, hence `magic`, exists). `InvalidSpec` without CUDA
    /// tensors; `CudaUnavailable` without a usable driver or device, or for `fd` where
    /// the device cannot share by fd. `name`: the region's (its socket's path must fit).
    pub fn create(
        builder: &mut HeaderBuilder,
        name: &str,
        request: CudaSharingRequest,
    ) -> Result<EngineCuda> {
        let Some((ordinal, size)) = builder.cuda_alloc else {
            return Err(Error::InvalidSpec("no CUDA tensor in the spec".into()));
        };
        let d = Driver::get()?;
        let ctx = PrimaryContext::retain(d, ordinal)?;
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidSpec(format!("CUDA allocation of {size} bytes")))?;
        // The device is asked only when fd sharing may be chosen.
        let fd_sharing = match request {
            CudaSharingRequest::Ipc => Err("not asked for".to_string()),
            _ => ctx.fd_sharing(d)?,
        };
        let sharing = share::decide(request, crate::os::in_initial_pid_namespace(), fd_sharing)?;
        let stream = Stream::create(&ctx)?;
        let (alloc, event, fd) = match sharing {
            CudaSharing::Ipc => {
                let alloc = DeviceAllocation::new(&ctx, size)?;
                let event = IpcEvent::create(&ctx)?;
                builder.set_cuda_export(alloc.ipc_handle()?, ctx.uuid()?, event.handle()?);
                (Exported::Ipc(alloc), Some(event), None)
            }
            CudaSharing::Fd => {
                // Refused before anything is allocated when the socket's path is too long.
                crate::control::socket_path(name)?;
                let memory = FdMemory::allocate(d, &ctx, size)?;
                let fd = SharedFd::new(memory.export_fd()?);
                builder.set_cuda_fd_export(ctx.uuid()?, memory.size() as u64);
                // What every client checks (a device granularity larger than clients
                // accept would make a region nobody can attach to).
                crate::layout::check_cuda_fd_export(&builder.tensors).map_err(|e| {
                    Error::CudaUnavailable {
                        reason: format!(
                            "the device's allocation granularity makes a {}-byte allocation, \
                             which clients refuse ({e}): use cuda_sharing 'ipc'",
                            memory.size()
                        ),
                    }
                })?;
                (Exported::Fd(memory), None, Some(fd))
            }
        };
        let reads_device_actions = builder
            .tensors
            .iter()
            .any(|t| t.location() == Location::Cuda && t.direction == Direction::ClientToEngine);
        Ok(EngineCuda {
            server: None,
            fd,
            client_event: None,
            event,
            stream: Some(stream),
            alloc: Some(alloc),
            reads_device_actions,
            ctx,
        })
    }

    /// How the allocation is shared.
    pub fn sharing(&self) -> CudaSharing {
        match self.fd {
            Some(_) => CudaSharing::Fd,
            None => CudaSharing::Ipc,
        }
    }

    pub fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// The engine's stream: launch the kernels that write a frame on it, so that
    /// [`Engine::publish`](crate::Engine::publish)'s event record follows them.
    pub fn stream(&self) -> Option<&Stream> {
        self.stream.as_ref()
    }

    /// Device address of a CUDA tensor in this process.
    pub fn ptr(&self, t: &TensorInfo) -> Result<u64> {
        let alloc = self.alloc.as_ref().ok_or(Error::Closed(Peer::Engine))?;
        if t.location() != Location::Cuda || t.offset.saturating_add(t.nbytes) > alloc.size() as u64
        {
            return Err(not_on_device(t));
        }
        Ok(alloc.ptr() + t.offset)
    }

    /// `cuEventRecord(engine_event, stream)`: called before every `frame_seq` store and
    /// before `READY`. Shared by fd (no event): `cuStreamSynchronize(stream)` instead,
    /// so the frame is complete on the device before the seq counter says so.
    pub fn record(&self) -> Result<()> {
        match (&self.event, &self.stream, &self.fd) {
            (Some(e), Some(s), _) => e.record(s),
            (None, Some(s), Some(_)) => s.synchronize(),
            _ => Err(Error::Closed(Peer::Engine)),
        }
    }

    /// Makes the engine stream wait on the client's last event record (before the
    /// engine reads client→engine device tensors). The event is opened once per client
    /// (pid, start time, handle) and cached. `client`: the header's seqlock-read view;
    /// `None` when no client is attached any more (nothing to wait for).
    pub fn wait_client(&mut self, client: Option<ClientEventHandle>) -> Result<()> {
        if self.fd.is_some() {
            // Shared by fd: the client's stream had finished before it posted.
            return Ok(());
        }
        let Some(key) = client else {
            self.forget_client();
            return Ok(());
        };
        if key.handle == [0; 64] {
            if self.reads_device_actions {
                return Err(Error::Protocol {
                    peer: Peer::Client,
                    detail: "attached to an engine with CUDA tensors without publishing a \
                             client event handle (protocol 1.2, §3.5)"
                        .into(),
                });
            }
            return Ok(());
        }
        if self.client_event.as_ref().is_none_or(|(k, _)| *k != key) {
            // Drop the previous client's event before opening the new one.
            self.client_event = None;
            let ev = IpcEvent::open(&self.ctx, &key.handle)?;
            self.client_event = Some((key, ev));
        }
        let (Some(s), Some((_, ev))) = (&self.stream, &self.client_event) else {
            return Err(Error::Closed(Peer::Engine));
        };
        s.wait(ev)
    }

    /// [`wait_client`](Self::wait_client) before answering a command: a client without
    /// an event handle (a host-only foreign client) is answered without waiting rather
    /// than refused.
    pub fn wait_client_for_command(&mut self, client: Option<ClientEventHandle>) -> Result<()> {
        if self.fd.is_some() {
            return Ok(());
        }
        match client {
            Some(key) if key.handle == [0; 64] => Ok(()),
            other => self.wait_client(other),
        }
    }

    /// Destroys the cached client event (the client closed, died or left): a later
    /// client, even the same process again with a handle of the same bytes, is opened
    /// afresh rather than waited on through a destroyed event.
    pub fn forget_client(&mut self) {
        self.client_event = None;
    }

    /// At close (after `engine_state = CLOSED` is stored): finishes the engine's queued
    /// work, then frees the allocation once `may_free()` says so (polled for at most
    /// `wait`), else leaks it with a log line. Freeing memory that a live peer still has
    /// mapped is undefined in the driver; leaking it costs device memory until this
    /// process exits, when the driver reclaims it.
    pub fn release_when(
        mut self,
        mut may_free: impl FnMut() -> bool,
        wait: Duration,
    ) -> DeviceRelease {
        // No more fds go out (a client that has not imported yet gets none).
        if let Some(mut server) = self.server.take() {
            server.stop();
        }
        self.fd = None;
        if let Some(s) = &self.stream {
            let _ = s.synchronize();
        }
        self.client_event = None;
        let start = Instant::now();
        let free = loop {
            if may_free() {
                break true;
            }
            if start.elapsed() >= wait {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        if free {
            self.event = None;
            self.stream = None;
            self.alloc = None;
            DeviceRelease::Freed
        } else {
            let size = self.alloc.as_ref().map_or(0, |a| a.size());
            eprintln!(
                "shmbridge: engine closed while its client still holds its CUDA memory open \
                 (client_cuda_state = OPEN after {wait:?}); leaking the {size}-byte device \
                 allocation until this process exits rather than freeing it under the client"
            );
            if let Some(a) = self.alloc.take() {
                a.leak();
            }
            if let Some(e) = self.event.take() {
                e.leak();
            }
            self.stream = None;
            DeviceRelease::Leaked
        }
    }
}

/// What a client's post of memory shared by fd waits for, when it gives up (`Timeout`,
/// which a step reports as `NotPosted`).
const FD_POST_DRAIN: &str = "the stream that wrote the actions, which must finish before \
     they are posted (CUDA memory shared by file descriptor has no interprocess event)";

/// How a client orders its device writes before a post, by how the engine shares its
/// memory. CUDA IPC: `record` (the client event's record, which the engine's stream waits
/// on). Shared by fd (no event: the engine reads the actions as soon as it sees the
/// post): the host waits until `is_idle` (`cuStreamQuery` of the stream) says the
/// writes are done, polled by [`crate::sync::poll_until`] as the Vulkan importer's drain
/// is, never `cuStreamSynchronize`, which cannot be bounded: at most `timeout` (then
/// `Timeout`, which the step reports as `NotPosted`: nothing posted), `check` (the
/// engine's liveness, an interrupt) between polls, a query's error ends it.
fn order_before_post(
    sharing: CudaSharing,
    timeout: Duration,
    check: &dyn Fn() -> Result<()>,
    is_idle: impl FnMut() -> Result<bool>,
    record: impl FnOnce() -> Result<()>,
) -> Result<()> {
    match sharing {
        CudaSharing::Ipc => record(),
        CudaSharing::Fd => crate::sync::poll_until(timeout, FD_POST_DRAIN, is_idle, check),
    }
}

fn not_on_device(t: &TensorInfo) -> Error {
    Error::Cuda {
        call: "device pointer",
        detail: format!(
            "tensor '{}' lives in {} memory, not in the CUDA allocation",
            t.name,
            t.location().name()
        ),
    }
}

/// What the client's views of CUDA tensors keep alive: the opened allocation(s), the
/// engine's event (a consumer stream waits on it) and the primary context. Shared
/// (`Arc`) by the [`ClientCuda`] and every view handed out (the Python package's DLPack
/// capsules), so the handles stay open while any view lives, even after the client
/// closed, and are closed exactly once, by whoever drops the last reference.
///
/// The close acknowledgement (`client_cuda_state = RELEASED`) follows the last close: a
/// client that closes while views live leaves `OPEN` (the engine does not free under the
/// views) and hands the lease a mapping of the region ([`CudaLease::acknowledge_into`]),
/// into which the lease's drop stores `RELEASED` once every handle is closed.
#[derive(Debug)]
pub struct CudaLease {
    /// `Some` until the drop, which destroys it before acknowledging; `None` for memory
    /// shared by fd (ordered on the host: nothing to wait on).
    engine_event: Option<IpcEvent>,
    memory: Mutex<Vec<Arc<ImportedMemory>>>,
    /// Memory shared by fd (1.9): the import, unmapped and released at the drop, before
    /// the acknowledgement.
    fd_memory: Mutex<Option<FdMemory>>,
    /// Where to acknowledge at drop (set when the client closed); `None` while the
    /// client is open (it acknowledges itself) or when no mapping could be made.
    ack: Mutex<Option<Box<dyn ControlMapping>>>,
    /// How: the session of the client that opened the handles (1.5: its tag, so a late
    /// acknowledgement cannot mark a later client's session released).
    release_ack: ReleaseAck,
    ctx: Arc<PrimaryContext>,
}

impl CudaLease {
    pub fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// The engine's event, opened once.
    pub fn engine_event(&self) -> Result<&IpcEvent> {
        self.engine_event
            .as_ref()
            .ok_or(Error::Closed(Peer::Client))
    }

    /// Makes the stream `raw` wait, on the GPU, for the engine's last published frame
    /// (its event's last record). `raw`: a `CUstream` of this context, or 0/1/2 (the
    /// legacy and per-thread default streams).
    ///
    /// # Safety
    /// `raw` must be 0, 1, 2 or a live stream of this context.
    pub unsafe fn wait_on(&self, raw: u64) -> Result<()> {
        if self.host_ordered() {
            // The engine synchronised its stream before it published the frame.
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let stream = unsafe { Stream::borrowed(&self.ctx, raw) };
        stream.wait(self.engine_event()?)
    }

    /// Whether the engine's frames are ordered on the host (memory shared by fd): then no
    /// stream waits on anything of the engine's.
    pub fn host_ordered(&self) -> bool {
        self.engine_event.is_none()
            && self
                .fd_memory
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
    }

    /// Stores `RELEASED` into `region` when the last reference drops (after every handle
    /// is closed), if this lease was the last holder of each.
    pub fn acknowledge_into(&self, region: Box<dyn ControlMapping>) {
        *self.ack.lock().unwrap_or_else(|p| p.into_inner()) = Some(region);
    }
}

impl Drop for CudaLease {
    fn drop(&mut self) {
        // Everything this lease opened is closed before the acknowledgement: the engine
        // may free its memory and destroy its event as soon as it sees RELEASED.
        self.engine_event = None;
        // An fd import is this lease's alone: unmapped and released here (after the
        // context's queued work).
        drop(
            self.fd_memory
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        let memory = std::mem::take(&mut *self.memory.lock().unwrap_or_else(|p| p.into_inner()));
        let mut all = true;
        for m in memory {
            // `into_inner` drops (closes) the import when this was its last holder; a
            // later client of the same allocation in this process may still hold it.
            all &= Arc::into_inner(m).is_some();
        }
        let ack = self.ack.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(region) = ack {
            // Not from a forked child: the imports it drops are its parent's.
            if all && region.made_here() {
                // SeqCst: the closes above happen-before an engine's load that sees it.
                region.control().acknowledge(self.release_ack);
            }
        }
    }
}

/// The client's CUDA state: its context (the device's primary one), its own event, and
/// the [`CudaLease`] on the engine's event and allocation(s), each opened once.
#[derive(Debug)]
pub struct ClientCuda {
    // Drop order: the client's event, then the lease, then the context.
    event: Option<IpcEvent>,
    handle: [u8; 64],
    lease: Option<Arc<CudaLease>>,
    /// How this client's session acknowledges its release (set once the event is
    /// published, before [`open`](Self::open)).
    release_ack: ReleaseAck,
    /// Device address of each tensor of the layout (by index); `None` for host ones.
    ptrs: Vec<Option<u64>>,
    /// How the engine shares its memory; shared by fd, the region's name (its socket)
    /// and how long the exchange may take.
    sharing: CudaSharing,
    name: String,
    timeout: Duration,
    /// The legacy default stream of `ctx` (what `step()` records on).
    default_stream: Stream,
    ctx: Arc<PrimaryContext>,
}

impl ClientCuda {
    /// Before claiming the slot: probes the driver, finds the engine's device (UUID,
    /// then ordinal), retains its primary context and, for IPC handles, creates the
    /// client's event (memory shared by fd is ordered on the host: no event; its fd comes
    /// over region `name`'s socket within `timeout`, at [`open`](Self::open)). Nothing in
    /// the region is touched, so a failure leaves no trace there.
    pub fn prepare(
        layout: &Layout,
        sharing: CudaSharing,
        name: &str,
        timeout: Duration,
    ) -> Result<ClientCuda> {
        let mut cuda = layout.tensors.iter().filter_map(|t| match t.device {
            Device::Cuda(c) => Some((t, c)),
            Device::Host | Device::Vulkan(_) => None,
        });
        let Some((first, placement)) = cuda.next() else {
            return Err(Error::InvalidSpec("no CUDA tensor in the layout".into()));
        };
        let d = Driver::get().map_err(|e| match e {
            Error::CudaUnavailable { reason } => Error::CudaUnavailable {
                reason: format!("tensor '{}' lives on CUDA: {reason}", first.name),
            },
            e => e,
        })?;
        for (t, c) in cuda {
            if c != placement {
                return Err(Error::InvalidTensor {
                    tensor: t.name.clone(),
                    reason: format!(
                        "on CUDA device {} but '{}' is on {}: this client serves one \
                         device per engine",
                        c.ordinal, first.name, placement.ordinal
                    ),
                });
            }
        }
        let visible = (0..d.info().device_count)
            .map(|o| driver::device_uuid(d, o))
            .collect::<Result<Vec<_>>>()?;
        let ordinal =
            super::pick_device(placement.uuid, placement.ordinal, &visible).ok_or_else(|| {
                Error::CudaUnavailable {
                    reason: format!(
                        "tensor '{}' lives on the engine's CUDA device {} (uuid {}), which this \
                 process does not see ({} device(s))",
                        first.name,
                        placement.ordinal,
                        placement
                            .uuid
                            .iter()
                            .map(|b| format!("{b:02x}"))
                            .collect::<String>(),
                        visible.len()
                    ),
                }
            })?;
        let ctx = PrimaryContext::retain(d, ordinal)?;
        let (event, handle) = match sharing {
            CudaSharing::Ipc => {
                let event = IpcEvent::create(&ctx)?;
                let handle = event.handle()?;
                (Some(event), handle)
            }
            CudaSharing::Fd => {
                ctx.fd_sharing(d)?.map_err(|why| Error::CudaUnavailable {
                    reason: format!(
                        "tensor '{}' lives on CUDA, shared by file descriptor, which this \
                         process cannot import: {why}",
                        first.name
                    ),
                })?;
                (None, [0; 64])
            }
        };
        // SAFETY: 1 is CU_STREAM_LEGACY, which `borrowed` accepts.
        let default_stream = unsafe { Stream::borrowed(&ctx, 1) };
        Ok(ClientCuda {
            event,
            handle,
            lease: None,
            release_ack: ReleaseAck::Untagged,
            ptrs: vec![None; layout.tensors.len()],
            sharing,
            name: name.to_string(),
            timeout,
            default_stream,
            ctx,
        })
    }

    /// The client event's handle, to be written into `client_event_handle` while
    /// claiming the slot.
    pub fn handle(&self) -> [u8; 64] {
        self.handle
    }

    /// After `client_cuda_state = OPEN` is stored and the slot is claimed: shared by fd,
    /// receives the allocation's fd from the engine (`region` holds this client's proof)
    /// and imports it ([`FdMemory::import`]: the driver checks it is such an allocation
    /// of at least `export_size` bytes); else opens the engine's event and the memory of
    /// every CUDA tensor (each handle once: the driver layer caches). Every span is
    /// checked against the mapped size.
    pub fn open_shared(&mut self, layout: &Layout, region: &dyn ControlMapping) -> Result<()> {
        if self.sharing == CudaSharing::Ipc {
            return self.open(layout);
        }
        let fd = share::receive(&self.name, layout, region, self.timeout)?;
        let size = layout
            .tensors
            .iter()
            .find_map(|t| t.cuda.map(|c| c.alloc_size))
            .ok_or_else(|| Error::InvalidSpec("no CUDA tensor in the layout".into()))?;
        let memory = FdMemory::import(Driver::get()?, &self.ctx, fd.as_fd(), size)?;
        // The import holds the memory; the fd is not needed any more.
        drop(fd);
        for (i, t) in layout.tensors.iter().enumerate() {
            if t.cuda.is_none() {
                continue;
            }
            self.ptrs[i] =
                Some(
                    memory
                        .span(t.offset, t.nbytes)
                        .ok_or_else(|| Error::InvalidTensor {
                            tensor: t.name.clone(),
                            reason: format!(
                        "bytes {}..+{} lie outside the {}-byte allocation the driver mapped",
                        t.offset,
                        t.nbytes,
                        memory.size()
                    ),
                        })?,
                );
        }
        self.lease = Some(Arc::new(CudaLease {
            engine_event: None,
            memory: Mutex::new(Vec::new()),
            fd_memory: Mutex::new(Some(memory)),
            ack: Mutex::new(None),
            release_ack: self.release_ack,
            ctx: self.ctx.clone(),
        }));
        Ok(())
    }

    /// After `client_cuda_state = OPEN` is stored: opens the engine's event and the
    /// memory of every CUDA tensor (each handle once: the driver layer caches), checking
    /// every span against the size the driver reports. CUDA IPC only.
    pub fn open(&mut self, layout: &Layout) -> Result<()> {
        let engine_event = layout
            .engine_event_handle
            .ok_or_else(|| Error::InvalidHeader {
                field: "engine_event_handle",
                reason: "missing for a layout with CUDA tensors".into(),
            })?;
        let engine_event = IpcEvent::open(&self.ctx, &engine_event)?;
        let mut memory: Vec<Arc<ImportedMemory>> = Vec::new();
        for (i, t) in layout.tensors.iter().enumerate() {
            let Some(c) = t.cuda else { continue };
            // Cached per (device, handle): a second tensor of the same allocation gets
            // the same mapping, never a second open.
            let m = driver::import_memory(&self.ctx, &c.ipc_mem_handle)?;
            if (m.size() as u64) < c.alloc_size {
                return Err(Error::InvalidTensor {
                    tensor: t.name.clone(),
                    reason: format!(
                        "the engine declares a {}-byte allocation, the driver maps {} bytes",
                        c.alloc_size,
                        m.size()
                    ),
                });
            }
            self.ptrs[i] = Some(m.span(t.offset, t.nbytes)?);
            if !memory.iter().any(|o| Arc::ptr_eq(o, &m)) {
                memory.push(m);
            }
        }
        self.lease = Some(Arc::new(CudaLease {
            engine_event: Some(engine_event),
            memory: Mutex::new(memory),
            fd_memory: Mutex::new(None),
            ack: Mutex::new(None),
            release_ack: self.release_ack,
            ctx: self.ctx.clone(),
        }));
        Ok(())
    }

    /// The lease on the opened handles: a view that must stay valid clones it. `None`
    /// before [`open`](Self::open).
    pub fn lease(&self) -> Option<&Arc<CudaLease>> {
        self.lease.as_ref()
    }

    /// This process's ordinal of the engine's device.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal()
    }

    pub fn context(&self) -> &Arc<PrimaryContext> {
        &self.ctx
    }

    /// Device address (base + offset, in this process) of tensor `index`.
    pub fn ptr(&self, index: usize, t: &TensorInfo) -> Result<u64> {
        self.ptrs
            .get(index)
            .copied()
            .flatten()
            .ok_or_else(|| not_on_device(t))
    }

    /// The engine's event, opened once: a consumer stream waits on it
    /// (`cuStreamWaitEvent`) before reading a frame's device tensors.
    pub fn engine_event(&self) -> Option<&IpcEvent> {
        self.lease.as_ref().and_then(|l| l.engine_event().ok())
    }

    /// Makes `stream` wait (on the GPU) for the engine's last published frame; nothing
    /// for memory shared by fd (the engine synchronised before publishing).
    pub fn wait_frame_on(&self, stream: &Stream) -> Result<()> {
        if self.sharing == CudaSharing::Fd {
            return Ok(());
        }
        let ev = self.engine_event().ok_or(Error::Closed(Peer::Client))?;
        stream.wait(ev)
    }

    /// Before every `action_seq` store and request, on `stream` (the legacy default
    /// stream if `None`): [`order_before_post`]. CUDA IPC: `cuEventRecord(client_event,
    /// stream)`. Memory shared by fd: the host waits for that stream's queued work
    /// (`cuStreamQuery`, polled: at most `timeout`, `check` between polls), since the
    /// engine reads the actions once it sees the post.
    pub fn record(
        &self,
        stream: Option<&Stream>,
        timeout: Duration,
        check: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        let stream = stream.unwrap_or(&self.default_stream);
        order_before_post(
            self.sharing,
            timeout,
            check,
            || stream.is_idle(),
            || {
                let ev = self.event.as_ref().ok_or(Error::Closed(Peer::Client))?;
                ev.record(stream)
            },
        )
    }

    /// Closes the client's side, each handle exactly once: waits for the client's own
    /// queued writes (a last record of its event on the default stream) and drops its
    /// reference to the lease. Returns whether the handles are
    /// closed now (no view holds the lease), i.e. whether `client_cuda_state = RELEASED`
    /// may be stored. If views still hold it, `ack()` is asked for a mapping of the
    /// region, into which the lease acknowledges when the last view drops.
    ///
    /// The client's own event is kept, not destroyed: the engine may still wait on it
    /// until it sees `client_state = CLOSED`, so it goes when this value is dropped,
    /// after that store.
    pub fn release_with(&mut self, ack: impl FnOnce() -> Option<Box<dyn ControlMapping>>) -> bool {
        if let Some(ev) = &self.event {
            if ev.record(&self.default_stream).is_ok() {
                let _ = ev.synchronize();
            }
        }
        self.ptrs.clear();
        let Some(lease) = self.lease.take() else {
            return true;
        };
        match Arc::try_unwrap(lease) {
            Ok(lease) => {
                let closed = lease
                    .memory
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .all(|m| Arc::strong_count(m) == 1);
                drop(lease);
                closed
            }
            Err(shared) => {
                if let Some(region) = ack() {
                    shared.acknowledge_into(region);
                }
                // If the last view dropped meanwhile, this drop closes and acknowledges.
                drop(shared);
                false
            }
        }
    }
}

impl EngineBackend for EngineCuda {
    fn before_publish(&self) -> Result<()> {
        self.record()
    }

    fn before_actions(&mut self, control: Control<'_>) -> Result<()> {
        self.wait_client(control.read_client_event())
    }

    fn before_command(&mut self, control: Control<'_>) -> Result<()> {
        self.wait_client_for_command(control.read_client_event())
    }

    fn forget_client(&mut self) {
        EngineCuda::forget_client(self)
    }

    fn device_ptr(&self, t: &TensorInfo) -> Result<u64> {
        self.ptr(t)
    }

    fn stream(&self) -> Option<StreamRef<'_>> {
        self.stream.as_ref().map(StreamRef::from)
    }

    /// Shared by fd: binds the region's socket and serves the allocation's fd to the
    /// attached client ([`FdServer`], as for Vulkan tensors). IPC: nothing.
    fn start(&mut self, region: &dyn ControlMapping) -> Result<()> {
        if let (Some(fd), None) = (&self.fd, &self.server) {
            self.server = Some(FdServer::bind_and_start(region, vec![fd.clone()])?);
        }
        Ok(())
    }

    /// A truncated region: the fd server stops (nobody may connect to a closed engine);
    /// the rest is leaked whole, as for IPC (the control block cannot say whether a
    /// client still maps the memory).
    fn release_truncated(mut self: Box<Self>) {
        if let Some(mut server) = self.server.take() {
            server.stop();
        }
        std::mem::forget(self);
    }

    fn release(self: Box<Self>, control: Control<'_>) -> DeviceRelease {
        // The SeqCst store of CLOSED (before this call) and the SeqCst load of
        // `client_cuda_state` here pair with the client's SeqCst store of OPEN and load
        // of `engine_state` at attach: either it sees CLOSED and opens nothing, or we
        // see OPEN.
        self.release_when(|| control.device_memory_may_be_freed(), RELEASE_WAIT)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ClientBackend for ClientCuda {
    fn publish_session(
        &mut self,
        control: Control<'_>,
        claim: &Claim,
        layout: &Layout,
    ) -> Result<()> {
        // A 1.5 engine reads the session tag; an earlier one the bare state.
        let tagged = layout.version.1 >= VERSION_MINOR_CUDA_SESSIONS;
        self.release_ack = control.publish_client_event(&self.handle, claim, tagged)?;
        Ok(())
    }

    fn open(&mut self, layout: &Layout, region: &dyn ControlMapping) -> Result<()> {
        self.open_shared(layout, region)
    }

    /// CUDA IPC: records the client's event (nothing to wait for on the host). Memory
    /// shared by fd: waits on the host for the stream's work, bounded by `timeout`
    /// ([`ClientCuda::record`]).
    fn before_post(
        &self,
        stream: Option<StreamRef<'_>>,
        timeout: Duration,
        check: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        match stream {
            None => self.record(None, timeout, check),
            Some(s) => Stream::scoped(&self.ctx, s, |s| self.record(Some(s), timeout, check)),
        }
    }

    fn device_ptr(&self, index: usize, t: &TensorInfo) -> Result<u64> {
        self.ptr(index, t)
    }

    fn place(&self, index: usize, t: &TensorInfo) -> Result<Option<DevicePlace>> {
        if t.cuda.is_none() {
            return Ok(None);
        }
        let lease = self.lease().ok_or(Error::Closed(Peer::Client))?;
        Ok(Some(DevicePlace {
            ptr: self.ptr(index, t)?,
            device: Device::cuda(self.ordinal()),
            lease: Arc::clone(lease) as Arc<dyn DeviceLease>,
        }))
    }

    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()> {
        if self.lease.is_none() {
            return Ok(()); // released: nothing of the engine's is read any more
        }
        Stream::scoped(&self.ctx, stream, |s| self.wait_frame_on(s))
    }

    unsafe fn copy_into(
        &self,
        dst: u64,
        src: u64,
        nbytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        Stream::scoped(&self.ctx, stream, |s| {
            // The engine may still be reading the previous contents (a frame is published
            // once its kernels are queued, not done); on another stream than the last
            // step's, the copy must wait for them.
            self.wait_frame_on(s)?;
            // SAFETY: the caller's contract: `src` is `nbytes` of this device's memory
            // valid for work on `stream`, `dst` a tensor of at least `nbytes` in the
            // engine's allocation (span checked at open), which the engine reads only
            // after waiting on the client event `before_post` records after this copy.
            unsafe { s.copy_dtod(dst, src, nbytes) }
        })
    }

    fn release(&mut self, region: &dyn ControlMapping) {
        let released = self.release_with(|| match region.map_again() {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!(
                    "shmbridge: views still hold the engine's CUDA memory and the region \
                     could not be mapped for their close acknowledgement ({e}); \
                     client_cuda_state stays OPEN (the engine will not free it)"
                );
                None
            }
        });
        if released {
            region.control().acknowledge(self.release_ack);
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl DeviceLease for CudaLease {
    fn order_after_frame(&self, stream: StreamRef<'_>) -> Result<()> {
        // SAFETY: `StreamRef`'s contract: 1, 2 or a live stream of this context's device.
        unsafe { self.wait_on(stream.raw()) }
    }
}

impl<'a> From<&'a Stream> for StreamRef<'a> {
    fn from(s: &'a Stream) -> StreamRef<'a> {
        // SAFETY: `s` is a live stream (or a borrowed default one) for `'a`.
        unsafe { StreamRef::from_raw(s.raw()) }
    }
}

impl dyn EngineBackend {
    /// The CUDA side of an engine with CUDA tensors (its context, and the stream a
    /// frame's kernels go on); `None` for any other backend.
    pub fn as_cuda(&self) -> Option<&EngineCuda> {
        self.as_any().downcast_ref()
    }
}

impl dyn ClientBackend {
    /// The CUDA side of a client of CUDA tensors (context, the engine's event, the
    /// lease on the imports); `None` for any other backend.
    pub fn as_cuda(&self) -> Option<&ClientCuda> {
        self.as_any().downcast_ref()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::PidNamespace;
    use std::cell::Cell;

    /// Queries of a stream that stays busy: `false` every time, but a panic past
    /// `LIMIT` (an unbounded wait, such as `cuStreamSynchronize` was, would poll on).
    const LIMIT: u32 = 100_000;

    fn busy(polls: &Cell<u32>) -> impl FnMut() -> Result<bool> + '_ {
        move || {
            polls.set(polls.get() + 1);
            assert!(polls.get() <= LIMIT, "polled past the post's bound");
            Ok(false)
        }
    }

    fn no_record() -> Result<()> {
        panic!("an fd-shared post recorded an event")
    }

    /// Memory shared by fd: a stream that never finishes ends the post's wait with
    /// `Timeout` once the timeout passed (0 here: after one query), which the step turns
    /// into `NotPosted`; a dead engine ends it at the first sleep, whatever the timeout;
    /// a query's error ends it; a stream that finishes at the third query is waited for.
    #[test]
    fn a_post_of_memory_shared_by_fd_waits_for_the_stream_within_its_bound() {
        let fine = || Ok(());
        let polls = Cell::new(0);
        let r = order_before_post(
            CudaSharing::Fd,
            Duration::ZERO,
            &fine,
            busy(&polls),
            no_record,
        );
        match r {
            Err(Error::Timeout { waited, what }) => {
                assert_eq!((waited, what), (Duration::ZERO, FD_POST_DRAIN));
            }
            other => panic!("a busy stream past the timeout: {other:?}"),
        }
        assert_eq!(polls.get(), 1);

        let died = || {
            Err(Error::PeerDied {
                peer: Peer::Engine,
                pid: 7,
                pid_ns: PidNamespace::This,
                hint: "",
            })
        };
        polls.set(0);
        let r = order_before_post(
            CudaSharing::Fd,
            Duration::MAX,
            &died,
            busy(&polls),
            no_record,
        );
        assert!(matches!(r, Err(Error::PeerDied { pid: 7, .. })), "{r:?}");
        assert!(polls.get() < LIMIT);

        let failing = || {
            Err(Error::Cuda {
                call: "cuStreamQuery",
                detail: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            })
        };
        let r = order_before_post(CudaSharing::Fd, Duration::MAX, &fine, failing, no_record);
        assert!(
            matches!(
                r,
                Err(Error::Cuda {
                    call: "cuStreamQuery",
                    ..
                })
            ),
            "{r:?}"
        );

        polls.set(0);
        let third = || {
            polls.set(polls.get() + 1);
            Ok(polls.get() == 3)
        };
        order_before_post(CudaSharing::Fd, Duration::MAX, &fine, third, no_record).unwrap();
        assert_eq!(polls.get(), 3);
    }

    /// CUDA IPC: the event is recorded once and the host waits for nothing.
    #[test]
    fn a_post_of_ipc_memory_records_the_event_and_queries_nothing() {
        let (polls, records) = (Cell::new(0), Cell::new(0));
        order_before_post(
            CudaSharing::Ipc,
            Duration::ZERO,
            &|| Ok(()),
            busy(&polls),
            || {
                records.set(records.get() + 1);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!((polls.get(), records.get()), (0, 1));
    }
}
