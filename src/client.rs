//! The client's side: attach to a region by name, read frames, write actions, `step()`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::batch::ReadySet;
use crate::command::{self, Reply};
use crate::control::{ClientState, EngineState};
use crate::device::{self, ClientBackend, StreamRef};
use crate::error::{Error, Peer, PidNamespace, Result};
use crate::layout::TensorKey;
use crate::layout::{Layout, ShardInfo};
use crate::os;
use crate::region::{self, Region};
use crate::shard::{self, ShardSlot};
use crate::sync::{self, WaitPolicy};
use crate::tensor::{Element, Tensors};
use crate::wire::{Body, Envelope, Kind, Method};

/// Consulted by a client's waits on their slow path (every sleep slice, about 10 ms):
/// an error stops the wait and is returned. The Python package checks for signals here,
/// so Ctrl-C interrupts a command waiting for its reply.
pub type Interrupt = std::sync::Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// One request of [`Client::call_shards`]: everything of an envelope but its id.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: Method,
    pub body: Body,
    pub args: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl Request {
    pub fn new(method: Method, body: Body) -> Self {
        Request {
            method,
            body,
            args: Vec::new(),
            payload: Vec::new(),
        }
    }

    /// An engine-defined method with its arguments.
    pub fn method(method: &str, args: &[(&str, &str)], payload: &[u8]) -> Self {
        Request {
            method: Method::Custom(method.to_string()),
            body: Body::None,
            args: args
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            payload: payload.to_vec(),
        }
    }
}

/// How to attach.
#[derive(Clone)]
pub struct AttachOptions {
    /// How long to wait for the engine to publish its header and frame 0.
    pub timeout: Duration,
    /// How it waits for frames and replies. The default adapts on a sharded region
    /// ([`WaitPolicy::adapted_to_shards`]).
    pub policy: WaitPolicy,
    /// How to import Vulkan tensors (1.3): `Auto` (CUDA when a CUDA device has the
    /// engine's Vulkan device UUID, else a Vulkan device of the client's own).
    pub importer: device::VulkanImporter,
    /// Consulted by every wait of the attach (for the header, for frame 0) on its slow
    /// path, about every millisecond, and by the client's waits afterwards (see
    /// [`Client::set_interrupt`]): its error ends the attach. `None`: only the timeout.
    pub interrupt: Option<Interrupt>,
}

impl std::fmt::Debug for AttachOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttachOptions")
            .field("timeout", &self.timeout)
            .field("policy", &self.policy)
            .field("importer", &self.importer)
            .field("interrupt", &self.interrupt.is_some())
            .finish()
    }
}

impl Default for AttachOptions {
    fn default() -> Self {
        AttachOptions {
            timeout: Duration::from_secs(10),
            policy: WaitPolicy::default(),
            importer: device::VulkanImporter::Auto,
            interrupt: None,
        }
    }
}

impl AttachOptions {
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    pub fn policy(mut self, policy: WaitPolicy) -> Self {
        self.policy = policy;
        self
    }
    pub fn importer(mut self, importer: device::VulkanImporter) -> Self {
        self.importer = importer;
        self
    }
    /// See [`AttachOptions::interrupt`].
    pub fn interrupt(mut self, interrupt: Option<Interrupt>) -> Self {
        self.interrupt = interrupt;
        self
    }
}

/// A client attached to an engine. Dropping it closes it.
pub struct Client {
    region: Region,
    layout: Layout,
    policy: WaitPolicy,
    /// How long the waits for frames took lately: the spin budget under the default
    /// policy.
    frame_waits: sync::SpinGauge,
    /// Last action number posted.
    action: u64,
    /// Last frame number received.
    frame: u64,
    closed: bool,
    /// Correlation id of the next command.
    next_id: u64,
    /// Buffer for incoming replies.
    rx: Vec<u8>,
    /// Reused for every request, so a warm call allocates no builder.
    tx: flatbuffers::FlatBufferBuilder<'static>,
    /// See [`Client::set_interrupt`].
    interrupt: Option<Interrupt>,
    /// CUDA tensors (1.2): context, events and imports; `None` for host-only layouts.
    /// Where the tensors live: the hooks of their device (no-ops for host memory).
    device: Box<dyn ClientBackend>,
    /// Whether `device` orders device work before a post (false for host memory, whose
    /// hook does nothing): the step path skips the call entirely.
    device_hooks: bool,
    /// The engine (shard 0 of a sharded region) is this process: a thread of it serves.
    engine_in_this_process: bool,
    /// See [`Client::set_command_stream`].
    command_stream: u64,
    /// Where the engine's and each shard's pid is a pid, for the errors that name them.
    engine_pid_ns: PidNamespace,
    shard_pid_ns: Vec<PidNamespace>,
    /// Asynchronous batches (1.10), from `async_reset` on; `None` for a lock-step client.
    batches: Option<Box<Batches>>,
}

/// What an asynchronous client keeps ([`Client::async_reset`]).
#[derive(Debug)]
struct Batches {
    ready: ReadySet,
    /// Shards a batch holds (`batch_size` ÷ the shard size).
    per_batch: usize,
    /// The last `recv`'s shards and their envs, in that order.
    shards: Vec<u32>,
    env_ids: Vec<u32>,
    /// Scratch of `recv`'s wait: the stepping shards whose frames arrived, as (order
    /// number of their post, shard, frame owed).
    arrived: Vec<(u64, usize, u64)>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("region", &self.region.name())
            .field("action", &self.action)
            .field("frame", &self.frame)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Opens the region, validates its header, claims the client slot and waits for
    /// frame 0. After this, the engine→client tensors hold the reset observations.
    pub fn attach(name: &str, options: AttachOptions) -> Result<Client> {
        let start = Instant::now();
        let name = region::canonical_name(name)?;
        let interrupted = || match &options.interrupt {
            Some(interrupt) => interrupt(),
            None => Ok(()),
        };
        let (mut region, layout) = Region::open(&name, options.timeout, interrupted)?;
        // `engine_gone` removed the name it left.
        let engine_dead = || Error::PeerDied {
            peer: Peer::Engine,
            pid: layout.engine_pid,
            pid_ns: PidNamespace::This,
            hint: "the region it left was removed; start the engine again",
        };
        // CUDA tensors: probe the driver, find the device, create the client event, all
        // before touching the region (a failure here leaves no trace in it).
        let mut device = device::client_backend(&layout, &name, options.importer, options.timeout)?;
        if region.engine_gone()? {
            return Err(engine_dead());
        }
        // Alive (it holds its lock): not shown here, it lives in another PID namespace.
        let engine_pid_ns = os::pid_namespace(layout.engine_pid, layout.engine_start_time);
        let engine_in_this_process =
            engine_pid_ns == PidNamespace::This && layout.engine_pid == os::current_pid();
        let me = os::current_pid();
        let my_start = os::process_start_time(me)
            .ok_or_else(|| Error::io("reading /proc/self/stat", std::io::ErrorKind::NotFound))?;
        // Claim the slot (CLAIMING, then pid and start time), publish the event handle
        // of a device backend, then ATTACHED with Release: an engine that sees ATTACHED
        // also sees who it is.
        // The lock that tells the engine this client lives (whatever PID namespace it is
        // in), held until this client's descriptor closes.
        region.hold_client_lock(me, my_start)?;
        // Vulkan tensors, CUDA memory shared by fd: the proof the engine's fd socket asks
        // for (1.8), taken before
        // the claim and held until this client closes, so whoever holds the attached slot
        // holds it.
        if crate::device::fd_count(&layout) > 0 && !region.hold_client_proof()? {
            return Err(proof_taken(&region, &name));
        }
        let control = region.control();
        let claim = control
            .claim_client(&name, me, my_start, |pid, start| {
                region.client_alive(pid, start)
            })
            .map_err(|e| match e {
                Error::AlreadyAttached { name, pid, .. } => Error::AlreadyAttached {
                    name,
                    pid,
                    pid_ns: region.client_pid_namespace(pid, control.client_identity().1),
                },
                e => e,
            })?;
        device.publish_session(control, &claim, &layout)?;
        // Every shard's words inside the mapping, checked once here: the step path then
        // makes its slots without the checks (`ShardSlot::checked_before`).
        for s in &layout.shards {
            ShardSlot::new(&region, s)?;
        }
        control.attach_client();
        let policy = options.policy.adapted_to_shards(layout.shards.len());
        let mut client = Client {
            region,
            layout,
            policy,
            frame_waits: sync::SpinGauge::default(),
            action: 0,
            frame: 0,
            closed: false,
            // Ids start from this process's pid, so replies meant for an earlier client
            // of the same engine can never match.
            next_id: (u64::from(me) << 32) | 1,
            rx: Vec::new(),
            tx: flatbuffers::FlatBufferBuilder::new(),
            interrupt: options.interrupt.clone(),
            device_hooks: device.needs_hooks(),
            engine_in_this_process,
            device,
            command_stream: 1,
            engine_pid_ns,
            shard_pid_ns: Vec::new(),
            batches: None,
        };
        // Open the engine's event and memory once (a failure drops `client`, which
        // closes whatever was opened and acknowledges).
        client.device.open(&client.layout, &client.region)?;
        // Wait for frame 0 (engine READY), checking that the engine lives.
        let mut backoff = crate::sync::Backoff::default();
        loop {
            match client.engine_state() {
                EngineState::Ready if client.all_shards_ready()? => break,
                EngineState::Closed => return Err(Error::PeerClosed { peer: Peer::Engine }),
                _ => {}
            }
            client.check_engine()?;
            if start.elapsed() >= options.timeout {
                return Err(Error::Timeout {
                    waited: options.timeout,
                    what: "the engine to publish frame 0",
                });
            }
            backoff.snooze();
        }
        let (mut action, mut frame) = client.counters();
        // The counters are another process's words: one past any number of steps a run
        // can take would overflow this client's own count (and its `u64::MAX` marker below
        // must stay out of their reach).
        let words = client.layout.shards.iter().flat_map(|s| {
            let slot = client.slot(s);
            [slot.action_seq().load(Ordering::Acquire), slot.frame()]
        });
        if let Some(v) = [action, frame]
            .into_iter()
            .chain(words)
            .find(|&v| v > MAX_COUNTER)
        {
            return Err(counter_out_of_range(v));
        }
        let mut mixed = false;
        if client.layout.shard_actions {
            // 1.10: an asynchronous client may have left the shards at different frames,
            // each its own last action answered (or not: refused below). A lock-step
            // client cannot step them (`not_answered` says so); `async_reset` can.
            let posted =
                |s: &ShardInfo| action.max(client.slot(s).action_seq().load(Ordering::Acquire));
            let shards = &client.layout.shards;
            if let Some(s) = shards.iter().find(|s| posted(s) != client.slot(s).frame()) {
                (action, frame) = (posted(s), client.slot(s).frame());
            } else {
                mixed = shards.iter().any(|s| client.slot(s).frame() != frame);
                action = frame;
            }
        }
        if action != frame {
            return Err(Error::Protocol {
                peer: Peer::Client,
                detail: format!(
                    "a previous client left action {action} unanswered (frame {frame}); restart the engine"
                ),
            });
        }
        // `u64::MAX` marks shards at different frames: never a count of this client's
        // (the counters are at most `MAX_COUNTER`, and it adds one per step).
        client.action = if mixed { u64::MAX } else { frame };
        client.frame = frame;
        // Every shard is alive now (each published frame 0): where each lives.
        if client.layout.is_sharded() {
            client.shard_pid_ns = client
                .layout
                .shards
                .iter()
                .map(|s| {
                    ShardSlot::new(&client.region, s)
                        .map(|slot| {
                            let (pid, start) = slot.identity();
                            os::pid_namespace(pid, start)
                        })
                        .unwrap_or_default()
                })
                .collect();
        }
        if client.device_hooks {
            client.device.after_frame(frame)?;
        }
        // Discard replies left in the ring for an earlier client (we are its consumer).
        for s in client.layout.shards.iter().filter(|s| s.rings.is_some()) {
            ShardSlot::new(&client.region, s)?.discard_replies();
        }
        Ok(client)
    }

    /// A second mapping of the same region, for views that must outlive this client
    /// (the Python package's DLPack capsules own one). Tensor offsets from the layout
    /// apply to it unchanged.
    pub fn map_again(&self) -> Result<Region> {
        self.region.map_again()
    }

    pub fn name(&self) -> &str {
        self.region.name()
    }

    /// Sets (or clears) a hook every wait of this client consults on its slow path: a
    /// wait that has spun and yielded without result calls it at each sleep slice
    /// (about every 10 ms), and stops with its error. A call interrupted so abandons its
    /// reply (a late one is dropped by id); an interrupted step may be finished with
    /// [`Client::wait_frame`]. The fast path never calls it.
    pub fn set_interrupt(&mut self, interrupt: Option<Interrupt>) {
        self.interrupt = interrupt;
    }

    /// The validated tensor table and engine identity.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn num_envs(&self) -> usize {
        self.layout.num_envs as usize
    }

    /// Views of the tensors: read engine→client ones, write client→engine ones. An
    /// asynchronous client while shards outside its batch step: their engines write and
    /// read their rows now, so these views refuse whole tensors (`OutOfOrder`); use
    /// [`Client::batch_rows`] and [`Client::batch_rows_mut`].
    // Inlined: a lock-step loop takes these views once per step, and the batch check
    // (one load: `None` for a lock-step client) is all it adds to them.
    #[inline(always)]
    pub fn tensors(&mut self) -> Tensors<'_> {
        let stepping = self
            .batches
            .as_ref()
            .is_some_and(|b| b.ready.stepping_count() > 0);
        Tensors::new(&self.region, &self.layout, Peer::Client)
            .with_client_device(&*self.device)
            .with_peers_stepping(stepping)
    }

    /// A view of one tensor (`OutOfOrder` as for [`Client::tensors`]).
    pub fn tensor<T: Element>(&mut self, key: impl TensorKey) -> Result<&[T]> {
        self.tensors().read(key)
    }

    /// A mutable view of one client→engine tensor (`actions`, `reset_mask`);
    /// `OutOfOrder` as for [`Client::tensors`].
    pub fn tensor_mut<T: Element>(&mut self, key: impl TensorKey) -> Result<&mut [T]> {
        self.tensors().write(key)
    }

    /// An asynchronous client: the rows of tensor `key` of the envs the last
    /// [`Client::recv`] handed out, one slice per shard in the order of
    /// [`Client::batch_shards`] (together, the rows of its env ids in order). No engine
    /// touches them until their actions are sent. `OutOfOrder` before a `recv`, or once
    /// some of its shards were sent; `InvalidSpec` for a tensor without a row per env.
    pub fn batch_rows<T: Element>(&mut self, key: impl TensorKey) -> Result<Vec<&[T]>> {
        let rows = self.batch_row_parts::<T>(key, false)?;
        Ok(rows
            .into_iter()
            // SAFETY: each part is rows of held shards inside the tensor's host
            // mapping, aligned for `T` (`Tensors::rows`); every bit pattern is a valid `T`.
            // Held shards' engines neither write nor read those rows until `send`, which
            // needs `&mut self`, as does any mutable view of them; the borrow of `self`
            // keeps the mapping alive.
            .map(|(p, n)| unsafe { std::slice::from_raw_parts(p as *const T, n) })
            .collect())
    }

    /// [`Client::batch_rows`], mutable, of a client→engine tensor (write the actions of
    /// the batch here, then [`Client::send`] its env ids).
    pub fn batch_rows_mut<T: Element>(&mut self, key: impl TensorKey) -> Result<Vec<&mut [T]>> {
        let rows = self.batch_row_parts::<T>(key, true)?;
        Ok(rows
            .into_iter()
            // SAFETY: as in `batch_rows`; the shards of one batch are distinct, so these
            // rows do not overlap, and `&mut self` rules out any other view of them.
            .map(|(p, n)| unsafe { std::slice::from_raw_parts_mut(p, n) })
            .collect())
    }

    fn batch_row_parts<T: Element>(
        &mut self,
        key: impl TensorKey,
        write: bool,
    ) -> Result<Vec<(*mut T, usize)>> {
        self.check_usable()?;
        let b = self.batches.as_ref().ok_or(Error::OutOfOrder(
            "batch_rows() serves an asynchronous client: call async_reset() and recv()",
        ))?;
        if b.shards.is_empty() || b.shards.iter().any(|&k| !b.ready.is_held(k as usize)) {
            return Err(Error::OutOfOrder(
                "no batch is held: call recv() (the last one's shards were sent)",
            ));
        }
        let envs: Vec<_> = b
            .shards
            .iter()
            .map(|&k| self.layout.shards[k as usize].envs())
            .collect();
        Tensors::new(&self.region, &self.layout, Peer::Client)
            .with_client_device(&*self.device)
            .rows::<T>(key, &envs, write)
    }

    /// The device backend of this client's tensors: where each lives in this process
    /// ([`ClientBackend::place`]), and the ordering of a consumer's stream after the
    /// engine's last publication ([`ClientBackend::order_after_frame`]).
    pub fn backend(&self) -> &dyn ClientBackend {
        &*self.device
    }

    /// Device address, in this process, of a tensor in device memory: for CUDA, the
    /// opened base of the engine's allocation plus the tensor's offset, checked against
    /// the driver's size.
    pub fn device_ptr(&self, key: impl TensorKey) -> Result<u64> {
        let (i, t) = key.resolve(&self.layout)?;
        if self.closed {
            return Err(Error::Closed(Peer::Client));
        }
        self.device.device_ptr(i, t)
    }

    /// DLPack `(device_type, device_id)` of this client's view of a tensor: `(1, 0)`
    /// (kDLCPU) for host tensors and Vulkan tensors mapped on the CPU, `(2, ordinal)`
    /// (kDLCUDA) for CUDA tensors and Vulkan tensors imported into CUDA.
    pub fn dlpack_device(&self, key: impl TensorKey) -> Result<(i32, i32)> {
        let (i, t) = key.resolve(&self.layout)?;
        Ok(self.device.dlpack_device(i, t))
    }

    /// The device stream whose queued work the next commands (resets, engine methods)
    /// must follow: the client's event is recorded on it before each request, and the
    /// engine waits on that before answering. Default: the legacy default stream (1).
    /// Host layouts ignore it.
    ///
    /// # Safety
    /// `raw` must be 0, 1, 2 or a stream of the engine's device that stays alive while
    /// it is set (set it back to 1 before destroying it).
    pub unsafe fn set_command_stream(&mut self, raw: u64) {
        self.command_stream = raw;
    }

    /// [`step`](Client::step), recording the client's event on `stream` (where the
    /// client→engine device tensors were written) instead of the legacy default stream.
    pub fn step_on<'s>(
        &mut self,
        stream: impl Into<StreamRef<'s>>,
        timeout: Duration,
    ) -> Result<u64> {
        self.check_can_step()?;
        let left = self.drain_before_post(Some(stream.into()), timeout)?;
        self.post_and_wait(left)
    }

    /// [`step`](Client::step) (or [`step_on`](Client::step_on) `stream`) for a caller
    /// that must look at something else while the device work before the post drains
    /// (Python: Ctrl-C): the drain is tried in slices of at most `slice`, `between`
    /// runs after each slice that did not finish it (its error ends the step, nothing
    /// posted), until `deadline` (`None`: none), after which the step is `NotPosted`.
    /// Once drained the action is posted once and the frame awaited for at most the
    /// rest of that slice: a `Timeout` then means it is in flight, as for `step`.
    pub fn step_sliced(
        &mut self,
        stream: Option<StreamRef<'_>>,
        deadline: Option<Instant>,
        slice: Duration,
        mut between: impl FnMut() -> Result<()>,
    ) -> Result<u64> {
        // One clock read per step where there is a deadline, none without (the Python
        // step's path): more only while the drain is retried.
        let start = deadline.map(|_| Instant::now());
        let mut now = start;
        loop {
            let this = match (deadline, now) {
                (Some(d), Some(n)) => d.saturating_duration_since(n).min(slice),
                _ => slice,
            };
            let got = match stream {
                Some(s) => self.step_on(s, this),
                None => self.step(this),
            };
            match got {
                Err(Error::NotPosted { what, .. }) => {
                    if let (Some(d), Some(s)) = (deadline, start) {
                        let n = Instant::now();
                        if n >= d {
                            return Err(Error::NotPosted {
                                waited: n - s,
                                what,
                            });
                        }
                        now = Some(n);
                    }
                    between()?;
                }
                other => return other,
            }
        }
    }

    /// Runs the backend's `before_post` for a step, bounded by `timeout`: returns what is
    /// left of it for the frame (one deadline for the whole step). A drain that did not
    /// finish in time is `NotPosted`: nothing was sent.
    fn drain_before_post(
        &self,
        stream: Option<StreamRef<'_>>,
        timeout: Duration,
    ) -> Result<Duration> {
        let start = Instant::now();
        match self
            .device
            .before_post(stream, timeout, &|| self.check_engine())
        {
            Ok(()) => Ok(timeout.saturating_sub(start.elapsed())),
            Err(Error::Timeout { waited, what }) => Err(Error::NotPosted { waited, what }),
            Err(e) => Err(e),
        }
    }

    /// Number of the frame the tensors hold now. An asynchronous client's shards stand
    /// at frames of their own: this stays at the last lock-step number (attach's, or the
    /// last `step`'s) from `async_reset` on.
    pub fn frame(&self) -> u64 {
        self.frame
    }

    /// The live `(action_seq, frame_seq)` counters of the region. A sharded region: the
    /// frame every shard has published (the lowest of their `frame_seq`s).
    pub fn counters(&self) -> (u64, u64) {
        let (action, frame) = self.region.control().counters();
        if !self.layout.is_sharded() {
            return (action, frame);
        }
        let lowest = self
            .layout
            .shards
            .iter()
            .filter_map(|s| ShardSlot::new(&self.region, s).ok())
            .map(|slot| slot.frame())
            .min()
            .unwrap_or(0);
        (action, lowest)
    }

    /// The live words of `shard`, one of this client's layout's.
    #[inline]
    fn slot<'s>(&'s self, shard: &'s ShardInfo) -> ShardSlot<'s> {
        // SAFETY: `attach` checked every shard of `self.layout` with `ShardSlot::new`
        // against `self.region`, and neither changes afterwards.
        unsafe { ShardSlot::checked_before(&self.region, shard) }
    }

    /// Each shard's flag of sleeping on the doorbell (1.4): what a post to a sharded
    /// region looks at to know whether to wake them.
    #[inline(always)]
    fn shard_waiting_flags(&self) -> impl Iterator<Item = &crate::primitive::AtomicU32> + '_ {
        self.layout
            .shards
            .iter()
            .map(|s| self.slot(s).engine_waiting())
    }

    fn engine_state(&self) -> EngineState {
        self.region.control().engine_state()
    }

    /// Whether every shard has published frame 0 of its slice (an unsharded region's one
    /// shard is the engine: `engine_state` READY, checked by the caller).
    fn all_shards_ready(&self) -> Result<bool> {
        if !self.layout.is_sharded() {
            return Ok(true);
        }
        for s in &self.layout.shards {
            if ShardSlot::new(&self.region, s)?.state() != EngineState::Ready {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The shards of the region and their envs (one, all envs, when unsharded).
    pub fn shards(&self) -> &[ShardInfo] {
        &self.layout.shards
    }

    /// The pid serving each shard, as it wrote it when joining (the engine's pid for an
    /// unsharded region). For tools and tests: liveness is judged by the shard's lock.
    pub fn shard_pids(&self) -> Result<Vec<u32>> {
        self.layout
            .shards
            .iter()
            .map(|s| Ok(ShardSlot::new(&self.region, s)?.identity().0))
            .collect()
    }

    fn check_engine(&self) -> Result<()> {
        if let Some(interrupt) = &self.interrupt {
            interrupt()?;
        }
        // Before each sleep: a region truncated under us is an error, not a SIGBUS at
        // the next access (a truncation after this check still faults; see check_size),
        // and so is exported device memory that shrank under its import.
        self.region.check_size()?;
        self.device.check_imports()?;
        if self.layout.is_sharded() {
            // A shard that died or closed ends the region for everyone: the creator's
            // name goes too once the creator is gone (its lock free: `engine_gone`
            // removes the name under it), so nothing is left in /dev/shm.
            if let Err(e) = shard::check_shards(&self.region, &self.layout, None) {
                let _ = self.region.engine_gone();
                return Err(match e {
                    Error::ShardDied {
                        shard,
                        pid,
                        env_start,
                        env_end,
                        ..
                    } => Error::ShardDied {
                        shard,
                        pid,
                        pid_ns: self
                            .shard_pid_ns
                            .get(shard as usize)
                            .copied()
                            .unwrap_or_default(),
                        env_start,
                        env_end,
                    },
                    e => e,
                });
            }
        }
        if self.engine_state() == EngineState::Closed {
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        // Its lock, not its pid (which may be another PID namespace's): a dead engine
        // cannot unlink any more, so `engine_gone` removes the name for it if still ours.
        if self.region.engine_gone()? {
            return Err(Error::PeerDied {
                peer: Peer::Engine,
                pid: self.layout.engine_pid,
                pid_ns: self.engine_pid_ns,
                hint: "the simulator process exited; its region was removed; start it again",
            });
        }
        Ok(())
    }

    /// Sends the actions (and reset mask) written into the client→engine tensors and waits
    /// for the engine's frame. Returns the frame number; the tensors hold that frame.
    ///
    /// Errors: `PeerClosed`, `PeerDied` (noticed within ~10 ms of the engine's death),
    /// `Timeout`, `NotPosted`. After a `Timeout` the step is still in flight: call
    /// [`wait_frame`](Client::wait_frame) to finish it before the next step.
    /// `NotPosted` comes before anything is posted (a CUDA stream the host waits for did
    /// not drain in `timeout`: the consumer stream of a CUDA import of Vulkan memory with
    /// a semaphore, or the stream of a client of CUDA memory shared by fd; its `what`
    /// names it): nothing is in flight, the frame is unchanged; step again. `timeout`
    /// bounds the whole step, the drain and the frame together.
    pub fn step(&mut self, timeout: Duration) -> Result<u64> {
        self.check_can_step()?;
        // CUDA: the device actions were written on the default stream (or use `step_on`);
        // record the client event after them, before `action_seq` moves.
        if self.device_hooks {
            return self.step_after_drain(timeout);
        }
        self.post_and_wait(timeout)
    }

    /// `step` where the device orders its work before the post: kept out of the host
    /// step's code (whose prologue it would otherwise grow).
    #[cold]
    #[inline(never)]
    fn step_after_drain(&mut self, timeout: Duration) -> Result<u64> {
        let left = self.drain_before_post(None, timeout)?;
        self.post_and_wait(left)
    }

    /// `Closed` after `close()`; `RegionTooSmall` once a check found the region
    /// truncated (it sticks: nothing touches the mapping again). A field and a load.
    #[inline]
    fn check_usable(&self) -> Result<()> {
        if self.closed {
            return Err(Error::Closed(Peer::Client));
        }
        self.region.known_shrunk()
    }

    #[inline]
    /// Whether [`Client::step`] may post now: the errors it would return before posting
    /// (`OutOfOrder` for an asynchronous client, or with a step in flight; `PeerClosed`;
    /// `Closed`), without touching anything. A binding checks it before writing actions.
    pub fn check_can_step(&self) -> Result<()> {
        self.check_usable()?;
        if self.action != self.frame {
            return Err(self.not_answered());
        }
        if self.engine_state() == EngineState::Closed {
            return Err(Error::PeerClosed { peer: Peer::Engine });
        }
        Ok(())
    }

    /// Why a step cannot be posted while `action ≠ frame`: a step in flight, or an
    /// asynchronous client (whose `action` is `u64::MAX`).
    #[cold]
    fn not_answered(&self) -> Error {
        Error::OutOfOrder(match self.batches {
            Some(_) => {
                "this client steps asynchronous batches (async_reset): use recv() and send()"
            }
            None if self.action == u64::MAX => {
                "the shards stand at different frames (an asynchronous client left them so): \
                 use async_reset(), recv() and send()"
            }
            None => "the previous step's frame has not arrived; call wait_frame() first",
        })
    }

    /// [`Client::step`] for a caller that would rather keep its thread a little longer
    /// before it waits the usual way (the Python binding holds the GIL through this and
    /// releases it only for a longer wait): posts the action, then spins on the frame (of
    /// every shard) for at most `spin` in all, without yielding, sleeping or looking at
    /// the engine's liveness. No longer than the client's wait policy spins (a blocking
    /// client looks once), and one look only where the engine is this very process (an
    /// engine thread may need what the caller holds: a Python engine needs the GIL).
    /// `Ok(Some(frame))`: answered, as `step` would have returned; `Ok(None)`: the action
    /// is in flight, and [`Client::wait_frame`] finishes the step. Host steps only: a
    /// client whose device orders its work before the post (`steps_on_host` false) gets
    /// `OutOfOrder` and posts nothing.
    pub fn step_spinning(&mut self, spin: Duration) -> Result<Option<u64>> {
        self.check_can_step()?;
        if self.device_hooks {
            return Err(Error::OutOfOrder(
                "step_spinning is for host steps; this client's device orders its steps: use step",
            ));
        }
        self.post_action();
        let target = self.action;
        let spin = match self.engine_in_this_process {
            true => Duration::ZERO,
            false => spin.min(self.policy.spin),
        };
        let mut started = None;
        for s in &self.layout.shards {
            let slot = self.slot(s);
            match sync::spin_briefly(&slot.frame_seq(), target, spin, &mut started) {
                Some(seen) if seen == target => {}
                Some(seen) => return Err(unexpected_frame(&self.layout, s, seen, target)),
                None => return Ok(None),
            }
        }
        match started {
            None => self.frame_waits.record_at_once(),
            Some(t) => self.frame_waits.record(t.elapsed()),
        }
        self.frame = target;
        Ok(Some(target))
    }

    /// Whether steps are host steps alone (no device work ordered before the post or
    /// after the frame): what [`Client::step_spinning`] serves.
    pub fn steps_on_host(&self) -> bool {
        !self.device_hooks
    }

    #[inline(always)] // the step path: one function with `step`, as before it had two callers
    fn post_and_wait(&mut self, timeout: Duration) -> Result<u64> {
        self.post_action();
        self.await_frame(timeout)
    }

    /// The next action: `action_seq` (and the doorbell) moved on, the engine woken if
    /// it sleeps.
    #[inline(always)]
    fn post_action(&mut self) {
        self.action += 1;
        if self.layout.is_sharded() {
            // One action for every shard: each sleeps on the doorbell with its own flag.
            sync::post_all(
                &self.region.control().doorbell_with_action(),
                self.action,
                self.shard_waiting_flags(),
            );
        } else if self.layout.version.1 >= 1 {
            // 1.1 engines sleep on the doorbell, which wakes them for commands too.
            sync::post(&self.region.control().doorbell_with_action(), self.action);
        } else {
            sync::post(&self.region.control().action_seq(), self.action);
        }
    }

    /// Waits for the frame of the last action posted (after a `step` that timed out).
    pub fn wait_frame(&mut self, timeout: Duration) -> Result<u64> {
        self.check_usable()?;
        if self.batches.is_some() || self.action == u64::MAX {
            return Err(self.not_answered());
        }
        self.await_frame(timeout)
    }

    /// [`Client::wait_frame`] past its checks (`step` made them already).
    #[inline]
    fn await_frame(&mut self, timeout: Duration) -> Result<u64> {
        // Every shard's frame (an unsharded region's one shard is the control block's
        // `frame_seq`), each in turn: the total is the slowest shard's time, not the sum.
        // One timeout for them all; the clock is read only by a wait not answered at once.
        let target = self.action;
        let mut track = sync::WaitTrack::learning(self.frame_waits);
        for s in &self.layout.shards {
            let slot = self.slot(s);
            let seen = sync::wait_for_from(
                &slot.frame_seq(),
                target,
                self.policy,
                timeout,
                &mut track,
                "the engine's next frame",
                || self.check_engine(),
            )?;
            if seen != target {
                return Err(unexpected_frame(&self.layout, s, seen, target));
            }
        }
        self.frame_waits = track.gauge();
        self.frame = target;
        if self.device_hooks {
            self.device.after_frame(target)?;
        }
        Ok(target)
    }

    /// Sends a request over the command channel and waits for its reply (matched by
    /// correlation id; replies to earlier calls that timed out are dropped). An error
    /// reply is `Error::Remote`. A sharded region: shard 0 answers (see
    /// [`Client::call_on`]).
    pub fn call(
        &mut self,
        method: Method,
        body: Body,
        args: Vec<(String, String)>,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Envelope> {
        self.call_on(0, method, body, args, payload, timeout)
    }

    /// As [`Client::call`], answered by shard `shard` of a sharded region.
    pub fn call_on(
        &mut self,
        shard: u32,
        method: Method,
        body: Body,
        args: Vec<(String, String)>,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Envelope> {
        let request = Request {
            method,
            body,
            args,
            payload,
        };
        self.call_shards(vec![(shard, request)], timeout)?
            .pop()
            .expect("one reply per request")
    }

    /// Sends one request to each listed shard, rings the doorbell once (so the shards
    /// answer at the same time), then collects the replies in the order given. The
    /// outer error ends the whole call (nothing more can be read); an inner one is that
    /// shard's answer (`Remote` for an error reply).
    pub fn call_shards(
        &mut self,
        requests: Vec<(u32, Request)>,
        timeout: Duration,
    ) -> Result<Vec<Result<Envelope>>> {
        if self.closed {
            return Err(Error::Closed(Peer::Client));
        }
        // Commands are the slow path: a region truncated under us is an error here, not
        // a SIGBUS at the ring (a step checks before it sleeps; see `Region::check_size`).
        self.region.check_size()?;
        self.device.check_imports()?;
        let start = Instant::now();
        let mut sent = Vec::with_capacity(requests.len());
        for (shard, r) in requests {
            let info = *self.layout.shards.get(shard as usize).ok_or_else(|| {
                Error::InvalidSpec(format!(
                    "shard {shard}: the region has {} shards",
                    self.layout.shards.len()
                ))
            })?;
            let id = self.push_request(&info, r, timeout.saturating_sub(start.elapsed()))?;
            sent.push((info, id));
        }
        let bell = self.region.control().doorbell();
        if self.layout.is_sharded() {
            command::ring_doorbell(&bell, self.shard_waiting_flags());
        } else {
            command::ring_doorbell(&bell, [bell.engine_waiting]);
        }
        let mut replies = Vec::with_capacity(sent.len());
        for (info, (id, name)) in sent {
            let left = timeout.saturating_sub(start.elapsed());
            replies.push(self.pop_reply(&info, id, name, left)?);
        }
        Ok(replies)
    }

    /// Validates and pushes one request into `shard`'s ring; returns its id and method.
    fn push_request(
        &mut self,
        shard: &ShardInfo,
        r: Request,
        timeout: Duration,
    ) -> Result<(u64, String)> {
        let channel = command::channel(&self.region, shard)?.ok_or(Error::NoCommandChannel {
            major: self.layout.version.0,
            minor: self.layout.version.1,
        })?;
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let name = r.method.name().to_string();
        let request = Envelope {
            id,
            kind: Kind::Request,
            method: r.method,
            body: r.body,
            args: r.args,
            payload: r.payload,
            error: None,
        };
        // Refuse a malformed request here, with nothing sent.
        request.validate()?;
        // CUDA: a reset or an engine method may write device tensors that work queued on
        // the command stream still reads; the engine waits on this record (§3.5).
        // SAFETY: `command_stream` is 1 or a stream the caller vouched for in
        // `set_command_stream` (live while it is set).
        let stream = unsafe { StreamRef::from_raw(self.command_stream) };
        self.device
            .before_post(Some(stream), timeout, &|| self.check_engine())?;
        // Replies still in this shard's ring answer earlier calls that gave up (one call
        // is in flight at a time): none is this call's, and each takes room its reply
        // may need.
        let mut rx = std::mem::take(&mut self.rx);
        let drained = loop {
            match channel.e2c.try_pop(&mut rx) {
                Ok(true) => {}
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.rx = rx;
        drained?;
        // The builder is reused across calls; taken out while `self` is borrowed by the
        // liveness check.
        let mut tx = std::mem::take(&mut self.tx);
        let pushed = channel
            .c2e
            .push(request.encode_into(&mut tx), self.policy, timeout, || {
                self.check_engine()
            });
        self.tx = tx;
        match pushed {
            // No room for the whole timeout: the engine has not read earlier requests.
            Err(Error::Timeout { .. }) => {
                return Err(Error::CommandBacklog {
                    queued: channel.c2e.queued(),
                    capacity: channel.c2e.capacity(),
                })
            }
            other => other?,
        }
        Ok((id, name))
    }

    /// Pops `shard`'s replies until the one with `id` (earlier ones, whose calls gave
    /// up, are dropped). An error reply is `Err(Remote)` inside `Ok`.
    fn pop_reply(
        &mut self,
        shard: &ShardInfo,
        id: u64,
        name: String,
        timeout: Duration,
    ) -> Result<Result<Envelope>> {
        let channel = command::channel(&self.region, shard)?.ok_or(Error::NoCommandChannel {
            major: self.layout.version.0,
            minor: self.layout.version.1,
        })?;
        let start = Instant::now();
        let mut rx = std::mem::take(&mut self.rx);
        let result = loop {
            let left = timeout.saturating_sub(start.elapsed());
            if let Err(e) = channel
                .e2c
                .pop(&mut rx, self.policy, left, || self.check_engine())
            {
                break Err(e);
            }
            let reply = match Envelope::decode(&rx) {
                Ok(r) => r,
                Err(e) => break Err(e),
            };
            if reply.id != id {
                continue; // the answer to an earlier call that gave up waiting
            }
            if let Some((code, message)) = reply.error {
                break Ok(Err(Error::Remote {
                    method: name,
                    code,
                    message,
                }));
            }
            break Ok(Ok(reply));
        };
        self.rx = rx;
        result
    }

    /// Round trip of a `Ping` carrying `payload`; returns the echoed payload.
    pub fn ping(&mut self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        match self
            .call(
                Method::Ping,
                Body::Ping(payload.to_vec()),
                Vec::new(),
                Vec::new(),
                timeout,
            )?
            .body
        {
            Body::Pong(p) => Ok(p),
            other => Err(Error::BadMessage(format!("Ping answered with {other:?}"))),
        }
    }

    /// The engine's schema: tensors, num_envs, engine kind and metadata.
    pub fn schema(&mut self, timeout: Duration) -> Result<Body> {
        let reply = self.call(
            Method::GetSchema,
            Body::GetSchema,
            Vec::new(),
            Vec::new(),
            timeout,
        )?;
        match reply.body {
            b @ Body::Schema { .. } => Ok(b),
            other => Err(Error::BadMessage(format!(
                "GetSchema answered with {other:?}"
            ))),
        }
    }

    /// Resets `env_ids` (all if `None`) with `seeds` (none, one, or one per env). When it
    /// returns, the engine→client tensors hold the reset observations; returns the frame
    /// number (unchanged: a reset consumes no action). A sharded region: each shard that
    /// owns a listed env gets its envs (as its own ids) and their seeds, so env `e` is
    /// seeded as it would be unsharded (one seed `s`: `s + k` for the `k`-th listed env).
    pub fn reset(
        &mut self,
        env_ids: Option<&[u32]>,
        seeds: &[u64],
        timeout: Duration,
    ) -> Result<u64> {
        let plan = shard::route_reset(&self.layout, env_ids, seeds)?;
        let requests = plan
            .into_iter()
            .map(|(shard, env_ids, seeds)| {
                let body = Body::Reset {
                    env_ids,
                    seeds,
                    options: Vec::new(),
                };
                (shard, Request::new(Method::Reset, body))
            })
            .collect();
        let mut frame = self.frame;
        for reply in self.call_shards(requests, timeout)? {
            match reply?.body {
                Body::ResetDone { frame: f } => frame = f,
                other => return Err(Error::BadMessage(format!("Reset answered with {other:?}"))),
            }
        }
        Ok(frame)
    }

    /// Starts asynchronous batches (1.10, `docs/async.md`): resets every env (`seeds` as
    /// for [`Client::reset`]) and makes every shard ready, so that [`Client::recv`] hands
    /// out `batch_size` envs at a time: the envs of whichever shards answered first, read
    /// in place. A shard steps all its envs together, so `batch_size` is a multiple of the
    /// shard size (every shard of the region the same size), at most `num_envs`. From
    /// here on this client is asynchronous: `step` is `OutOfOrder`; calling this again
    /// resets every env and forgets the batches handed out.
    ///
    /// Errors: `InvalidSpec` for an unsharded region or one whose shards do not take
    /// their own actions (an engine before 1.10, or a shard process before 1.10 joined to
    /// a later creator: each shard is asked its protocol by a `Hello` first), for device
    /// tensors (host only, for now),
    /// or a `batch_size` that is not a multiple of the shard size; `OutOfOrder` with a
    /// lock-step step in flight; the errors of `reset`.
    pub fn async_reset(
        &mut self,
        batch_size: usize,
        seeds: &[u64],
        timeout: Duration,
    ) -> Result<()> {
        self.check_usable()?;
        if !self.layout.shard_actions {
            return Err(Error::InvalidSpec(
                "asynchronous batches need a sharded region (shards ≥ 2) whose shards take \
                 their own actions (protocol 1.10)"
                    .into(),
            ));
        }
        if self.device_hooks {
            return Err(Error::InvalidSpec(
                "asynchronous batches serve host tensors only".into(),
            ));
        }
        // A lock-step step in flight must finish first; shards an asynchronous client
        // left at different frames (`action` u64::MAX) are what this is for.
        if self.batches.is_none() && self.action != self.frame && self.action != u64::MAX {
            return Err(self.not_answered());
        }
        let size = self.layout.shards[0].env_count as usize;
        let even = self
            .layout
            .shards
            .iter()
            .all(|s| s.env_count as usize == size);
        if !even || batch_size == 0 || batch_size % size != 0 || batch_size > self.num_envs() {
            return Err(Error::InvalidSpec(format!(
                "batch_size {batch_size}: a batch is made of whole shards (a shard steps all its \
                 envs together), so it must be a multiple of the shard size ({}) up to num_envs \
                 ({}), with every shard the same size",
                size,
                self.num_envs()
            )));
        }
        let start = Instant::now();
        self.check_shard_protocols(timeout)?;
        self.reset(None, seeds, timeout.saturating_sub(start.elapsed()))?;
        // Every shard answered its reset from its wait for an action: none is stepping,
        // each has published the frame of its last action (counted on from here: bounded
        // as at attach).
        if let Some(v) = self
            .layout
            .shards
            .iter()
            .map(|s| self.slot(s).frame())
            .find(|&v| v > MAX_COUNTER)
        {
            return Err(counter_out_of_range(v));
        }
        let ready = ReadySet::new(
            self.layout
                .shards
                .iter()
                .map(|s| (s.envs(), self.slot(s).frame())),
        );
        self.batches = Some(Box::new(Batches {
            ready,
            per_batch: batch_size / size,
            shards: Vec::new(),
            env_ids: Vec::new(),
            arrived: Vec::with_capacity(self.layout.shards.len()),
        }));
        self.action = u64::MAX;
        Ok(())
    }

    /// Asks every shard which protocol its process speaks (a `Hello` each): the header's
    /// `flags` are its creator's, and a shard process before 1.10 that joined the region
    /// neither takes the actions posted to its own entry nor rings the frame bell, so
    /// `recv` would wait for it until its timeout (for ever without one). `InvalidSpec`
    /// naming the first such shard; nothing is reset then.
    fn check_shard_protocols(&mut self, timeout: Duration) -> Result<()> {
        use crate::layout::{VERSION_MAJOR, VERSION_MINOR, VERSION_MINOR_SHARD_ACTIONS};
        let hello = Body::Hello {
            protocol_major: VERSION_MAJOR,
            protocol_minor: VERSION_MINOR,
            pid: os::current_pid(),
            client_name: String::new(),
        };
        let requests = (0..self.layout.shards.len() as u32)
            .map(|k| (k, Request::new(Method::Hello, hello.clone())))
            .collect();
        let replies = self.call_shards(requests, timeout)?;
        for (s, reply) in self.layout.shards.iter().zip(replies) {
            let (major, minor) = match reply?.body {
                Body::Welcome {
                    protocol_major,
                    protocol_minor,
                    ..
                } => (protocol_major, protocol_minor),
                other => return Err(Error::BadMessage(format!("Hello answered with {other:?}"))),
            };
            if (major, minor) < (VERSION_MAJOR, VERSION_MINOR_SHARD_ACTIONS) {
                let envs = s.envs();
                return Err(Error::InvalidSpec(format!(
                    "shard {} (envs {}..{}) is served by a process of protocol {major}.{minor}, \
                     which does not take actions posted to its shard alone (1.{}): \
                     asynchronous batches would wait for it for ever; serve every shard with \
                     the same release",
                    s.index, envs.start, envs.end, VERSION_MINOR_SHARD_ACTIONS
                )));
            }
        }
        Ok(())
    }

    /// Waits until `batch_size` envs have frames (whole shards: the ones that were
    /// posted first among those that answered) and hands them out: returns their env
    /// ids, in the order of [`Client::batch_shards`]. Their observations, rewards and
    /// flags are read in place: rows `env_ids` of the engine→client tensors, one
    /// contiguous slice per shard. They stay valid until their actions are sent.
    ///
    /// Errors: `OutOfOrder` before `async_reset`, or when fewer shards step than a batch
    /// holds (send the actions of the envs received before); `Timeout` (nothing handed
    /// out: call again); `ShardDied`/`ShardClosed` and the other errors of `step`.
    pub fn recv(&mut self, timeout: Duration) -> Result<&[u32]> {
        self.check_usable()?;
        let mut b = self
            .batches
            .take()
            .ok_or(Error::OutOfOrder("call async_reset() before recv()"))?;
        let got = self.recv_into(&mut b, timeout);
        self.batches = Some(b);
        got?;
        Ok(&self.batches.as_ref().expect("put back").env_ids)
    }

    fn recv_into(&self, b: &mut Batches, timeout: Duration) -> Result<()> {
        if b.ready.stepping_count() < b.per_batch {
            return Err(Error::OutOfOrder(
                "fewer shards are stepping than a batch holds: send() the actions of the envs \
                 received before",
            ));
        }
        let Batches {
            ready,
            per_batch,
            arrived,
            ..
        } = b;
        let shards = &self.layout.shards;
        let mut track = sync::WaitTrack::default();
        // One futex for every shard's frame: the control block's `frame_seq`, which each
        // shard rings after publishing while this client's flag on it is up.
        sync::wait_until_from(
            &self.region.control().frame_seq(),
            |order| {
                arrived.clear();
                for (k, posted) in ready.stepping() {
                    if self.slot(&shards[k]).frame_seq().counter.load(order) >= posted {
                        arrived.push((ready.sent(k), k, posted));
                    }
                }
                (arrived.len() >= *per_batch).then_some(())
            },
            self.policy,
            timeout,
            &mut track,
            "the frames of a batch",
            || self.check_engine(),
        )?;
        // The posted earliest first, so that no ready shard waits behind younger ones
        // (by the order of the sends: frame numbers are per shard, not comparable).
        arrived.sort_unstable();
        arrived.truncate(*per_batch);
        for &(_, k, posted) in arrived.iter() {
            let seen = self.slot(&shards[k]).frame();
            if seen != posted {
                return Err(unexpected_frame(&self.layout, &shards[k], seen, posted));
            }
        }
        b.shards.clear();
        b.env_ids.clear();
        for &(_, k, _) in b.arrived.iter() {
            let envs = b.ready.hand_out(k)?;
            b.shards.push(k as u32);
            b.env_ids.extend(envs);
        }
        Ok(())
    }

    /// The envs a [`Client::recv`] hands out, once [`Client::async_reset`] was called.
    pub fn async_batch_size(&self) -> Option<usize> {
        let b = self.batches.as_ref()?;
        Some(b.per_batch * self.layout.shards[0].env_count as usize)
    }

    /// The shards of the last [`Client::recv`], in the order of its env ids (empty
    /// before one, and for a lock-step client).
    pub fn batch_shards(&self) -> &[u32] {
        self.batches.as_ref().map_or(&[], |b| &b.shards)
    }

    /// The errors [`Client::send`] would return for `env_ids` before posting, without
    /// posting: a binding checks them before it writes the actions' rows (the rows of a
    /// shard still stepping are the engine's to read).
    pub fn check_send(&mut self, env_ids: &[u32]) -> Result<()> {
        self.sendable()?.ready.check_send(env_ids).map(drop)
    }

    /// The batches of a usable asynchronous client, for a send: the errors `step` checks
    /// before posting (`Closed`, `OutOfOrder`, then `PeerClosed`), in the same order.
    fn sendable(&mut self) -> Result<&mut Batches> {
        self.check_usable()?;
        let closed = (self.engine_state() == EngineState::Closed).then(|| {
            // When a shard dies its siblings close in turn: the death is what to report.
            match self.check_engine() {
                Err(e @ Error::ShardDied { .. }) => e,
                _ => Error::PeerClosed { peer: Peer::Engine },
            }
        });
        let b = self
            .batches
            .as_deref_mut()
            .ok_or(Error::OutOfOrder("call async_reset() before send()"))?;
        match closed {
            Some(e) => Err(e),
            None => Ok(b),
        }
    }

    /// Posts the actions written into rows `env_ids` of the client→engine tensors: the
    /// envs of whole shards handed out by [`Client::recv`] and not sent yet, each once
    /// (any order; the envs of several `recv`s at once, or a `recv`'s shards over several
    /// sends). Those shards step; the others are not touched.
    ///
    /// Errors: `NotInBatch` (kind `OutOfOrder`), naming an env whose frame was not handed
    /// out or whose action was sent already, an env listed twice, or a shard listed in
    /// part; `OutOfOrder` before `async_reset`; `PeerClosed` once the engine closed (as
    /// `step`; `ShardDied` where a shard's death made it close): nothing is posted then.
    pub fn send(&mut self, env_ids: &[u32]) -> Result<()> {
        let b = self.sendable()?;
        let shards = b.ready.check_send(env_ids)?;
        if shards.is_empty() {
            return Ok(());
        }
        let mut posted = Vec::with_capacity(shards.len());
        for k in shards {
            posted.push((k, b.ready.post(k)?));
        }
        // Each shard's own action (Release: the actions written before it), then the one
        // doorbell, whose wake reaches every sleeping shard.
        for &(k, action) in &posted {
            crate::primitive::store(
                self.slot(&self.layout.shards[k]).action_seq(),
                action,
                Ordering::Release,
            );
        }
        sync::post_all(
            &self.region.control().doorbell(),
            0,
            posted
                .iter()
                .map(|&(k, _)| self.slot(&self.layout.shards[k]).engine_waiting()),
        );
        Ok(())
    }

    /// Calls an engine-defined method; returns its result arguments and payload. A
    /// sharded region: shard 0 answers ([`Client::call_method_on`],
    /// [`Client::call_method_all`]).
    pub fn call_method(
        &mut self,
        method: &str,
        args: &[(&str, &str)],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Reply> {
        self.call_method_on(0, method, args, payload, timeout)
    }

    /// Calls an engine-defined method on shard `shard`.
    pub fn call_method_on(
        &mut self,
        shard: u32,
        method: &str,
        args: &[(&str, &str)],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Reply> {
        let request = Request::method(method, args, payload);
        let reply = self
            .call_shards(vec![(shard, request)], timeout)?
            .pop()
            .expect("one reply per request")?;
        Ok(Reply {
            args: reply.args,
            payload: reply.payload,
        })
    }

    /// Calls an engine-defined method on every shard at once (one, unsharded); the
    /// replies in shard order. The first error reply is returned as the error.
    pub fn call_method_all(
        &mut self,
        method: &str,
        args: &[(&str, &str)],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Reply>> {
        let requests = (0..self.layout.shards.len() as u32)
            .map(|k| (k, Request::method(method, args, payload)))
            .collect();
        self.call_shards(requests, timeout)?
            .into_iter()
            .map(|r| {
                r.map(|e| Reply {
                    args: e.args,
                    payload: e.payload,
                })
            })
            .collect()
    }

    /// Marks the client closed and wakes a waiting engine (it gets `PeerClosed`). Also
    /// done on drop. In a child forked from the process that attached, neither touches
    /// the region: the session stays its parent's.
    pub fn close(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        // A child forked from the learner drops its copy: the session is its parent's, and
        // so are the imports of the device backend, left undropped (dropping them would
        // call the device driver, whose threads and device files are the parent's).
        if !self.region.made_here() {
            std::mem::forget(std::mem::replace(
                &mut self.device,
                Box::new(device::host::HostClient),
            ));
            return;
        }
        // Truncated under us (a same-user peer): the control block may be gone, and
        // touching it would SIGBUS; there is no session left to close.
        if self.region.check_size().is_err() {
            return;
        }
        // Close every import (once), then acknowledge with RELEASED, before CLOSED, so
        // an engine woken by CLOSED already sees the acknowledgement. The backend keeps
        // what must outlive the CLOSED store (the client's own CUDA event: an engine that
        // read ATTACHED may still wait on it) until it is dropped, after that store.
        let mut device = std::mem::replace(&mut self.device, Box::new(device::host::HostClient));
        device.release(&self.region);
        // Before CLOSED: a client that sees the slot free finds the proof free too.
        self.region.release_client_proof();
        self.region.control().close_client();
        drop(device);
    }
}

/// The largest action or frame counter a client accepts from the region: 2^63 steps are
/// beyond any run, and counting on from here overflows nothing (nor reaches `u64::MAX`,
/// the client's marker of shards at different frames).
const MAX_COUNTER: u64 = 1 << 63;

#[cold]
fn counter_out_of_range(v: u64) -> Error {
    Error::Protocol {
        peer: Peer::Engine,
        detail: format!("an action or frame counter reads {v}, past any run's (2^63)"),
    }
}

/// The error of an attach that could not take the client's proof byte (1.8): the live
/// client attached holds it (`AlreadyAttached`, as the claim would have said), or a
/// process that is not the attached client does.
#[cold]
fn proof_taken(region: &Region, name: &str) -> Error {
    let control = region.control();
    let (pid, start) = control.client_identity();
    if matches!(
        control.client_state(),
        ClientState::Attached | ClientState::Claiming
    ) && region.client_alive(pid, start)
    {
        return Error::AlreadyAttached {
            name: name.to_string(),
            pid,
            pid_ns: region.client_pid_namespace(pid, start),
        };
    }
    Error::io(
        format!("attaching to region '{name}'"),
        std::io::Error::other(format!(
            "another process of this user holds the client's proof lock of the region \
                 (byte {} of /dev/shm/{name}) without being its attached client: a client \
                 attaching at this very moment, or a process getting in the way (`fuser \
                 /dev/shm/{name}` lists who has the file open); neither this client nor the \
                 engine is at fault: attach again once it let go",
            crate::control::CLIENT_PROOF_BYTE
        )),
    )
}

#[cold]
fn unexpected_frame(layout: &Layout, shard: &ShardInfo, seen: u64, target: u64) -> Error {
    Error::Protocol {
        peer: Peer::Engine,
        detail: match layout.is_sharded() {
            true => format!(
                "shard {} published frame {seen} for action {target}",
                shard.index
            ),
            false => format!("published frame {seen} for action {target}"),
        },
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.shut();
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::control::ControlMapping;
    use crate::device::DevicePlace;
    use crate::layout::TensorInfo;
    use crate::{DType, Engine, EngineSpec};

    const T: Duration = Duration::from_secs(30);

    /// A device whose work before a post drains only at the `timeouts + 1`th try (a
    /// consumer stream still busy for the first ones), or, `slow`, only once the whole
    /// timeout it was given has passed.
    #[derive(Debug, Default)]
    struct Draining {
        timeouts: AtomicU32,
        slow: bool,
    }

    impl ClientBackend for Draining {
        fn open(&mut self, _: &Layout, _: &dyn ControlMapping) -> Result<()> {
            Ok(())
        }
        fn before_post(
            &self,
            _: Option<StreamRef<'_>>,
            timeout: Duration,
            _: &dyn Fn() -> Result<()>,
        ) -> Result<()> {
            if self.slow {
                std::thread::sleep(timeout);
                return Ok(());
            }
            let left = self.timeouts.load(Ordering::Relaxed);
            if left == 0 {
                return Ok(());
            }
            self.timeouts.store(left - 1, Ordering::Relaxed);
            Err(Error::Timeout {
                waited: timeout,
                what: "a busy test stream",
            })
        }
        fn device_ptr(&self, _: usize, t: &TensorInfo) -> Result<u64> {
            Err(Error::NotOnHost {
                tensor: t.name.clone(),
                location: "host",
            })
        }
        fn place(&self, _: usize, _: &TensorInfo) -> Result<Option<DevicePlace>> {
            Ok(None)
        }
        fn order_after_frame(&self, _: StreamRef<'_>) -> Result<()> {
            Ok(())
        }
        unsafe fn copy_into(&self, _: u64, _: u64, _: usize, _: StreamRef<'_>) -> Result<()> {
            Err(Error::OutOfOrder("no device copies in this test"))
        }
        fn release(&mut self, _: &dyn ControlMapping) {}
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    /// An engine at frame 0 and a client attached to it whose device is `device`.
    fn pair(device: Draining) -> (Engine, Client) {
        let spec = EngineSpec::standard("client-unit", 1, 1, 1, DType::F32);
        let mut engine = Engine::create(spec).unwrap();
        engine.publish().unwrap();
        let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
        client.device = Box::new(device);
        client.device_hooks = true;
        (engine, client)
    }

    /// Serves steps until the client closes: each frame's `obs` is the action's number.
    /// Returns how many actions it saw.
    fn serve(mut engine: Engine) -> std::thread::JoinHandle<u64> {
        std::thread::spawn(move || {
            let mut seen = 0;
            loop {
                match engine.wait_actions(T) {
                    Ok(n) => {
                        seen += 1;
                        engine.tensors().write::<f32>("obs").unwrap().fill(n as f32);
                        engine.publish().unwrap();
                    }
                    Err(Error::PeerClosed { peer: Peer::Client }) => return seen,
                    Err(e) => panic!("{e}"),
                }
            }
        })
    }

    #[test]
    fn a_drain_that_times_out_posts_nothing_and_says_so() {
        let (engine, mut client) = pair(Draining {
            timeouts: AtomicU32::new(1),
            slow: false,
        });
        let server = serve(engine);
        let e = client.step(T).unwrap_err();
        assert!(matches!(e, Error::NotPosted { .. }), "{e}");
        assert_eq!(client.counters().0, 0, "an action was posted");
        assert_eq!(client.frame(), 0);
        // Nothing in flight: the step itself may be repeated, and posts once.
        assert_eq!(client.step(T).unwrap(), 1);
        assert_eq!(client.tensor::<f32>("obs").unwrap(), &[1.0]);
        client.close();
        assert_eq!(server.join().unwrap(), 1);
    }

    #[test]
    fn a_sliced_step_retries_the_drain_and_posts_once() {
        let (engine, mut client) = pair(Draining {
            timeouts: AtomicU32::new(3),
            slow: false,
        });
        let server = serve(engine);
        let mut between = 0;
        let slice = Duration::from_millis(50);
        let frame = client
            .step_sliced(None, None, slice, || {
                between += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!(frame, 1);
        assert_eq!(between, 3);
        assert_eq!(
            client.tensor::<f32>("obs").unwrap(),
            &[1.0],
            "a stale frame"
        );
        // What `between` returns ends the step, with nothing posted.
        client.device = Box::new(Draining {
            timeouts: AtomicU32::new(1),
            slow: false,
        });
        let e = client
            .step_sliced(None, None, slice, || Err(Error::Interrupted))
            .unwrap_err();
        assert!(matches!(e, Error::Interrupted), "{e}");
        // A deadline already past: one try, then `NotPosted`.
        client.device = Box::new(Draining {
            timeouts: AtomicU32::new(u32::MAX),
            slow: false,
        });
        let e = client
            .step_sliced(None, Some(Instant::now()), slice, || {
                panic!("retried past the deadline")
            })
            .unwrap_err();
        assert!(matches!(e, Error::NotPosted { .. }), "{e}");
        assert_eq!(client.counters().0, 1);
        client.close();
        assert_eq!(server.join().unwrap(), 1, "actions posted");
    }

    #[test]
    fn the_drain_and_the_frame_share_one_timeout() {
        // The drain takes the whole timeout; the engine never answers. The frame wait
        // must not start a timeout of its own: with nothing left it looks at the engine
        // once or twice and times out, where a fresh second in 10 ms sleep slices would
        // look about 100 times.
        let (engine, mut client) = pair(Draining {
            timeouts: AtomicU32::new(0),
            slow: true,
        });
        let looks = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&looks);
        client.set_interrupt(Some(Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })));
        let e = client.step(Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert_eq!(client.counters().0, 1, "drained, so posted: in flight");
        let looks = looks.load(Ordering::Relaxed);
        assert!(
            looks < 10,
            "the frame wait had a timeout of its own: {looks} looks"
        );
        drop(engine);
    }

    #[test]
    fn a_spinning_step_returns_its_frame_or_leaves_it_in_flight() {
        let spec = EngineSpec::standard("client-spinning", 1, 1, 1, DType::F32);
        let mut engine = Engine::create(spec).unwrap();
        engine.publish().unwrap();
        let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
        assert!(client.steps_on_host());
        // Nobody serves yet: the spin ends without a frame, the action is posted and in
        // flight, and another step is refused until its frame was waited for.
        assert_eq!(
            client.step_spinning(Duration::from_micros(20)).unwrap(),
            None
        );
        assert_eq!(client.counters(), (1, 0));
        assert_eq!(client.frame(), 0);
        let e = client.step_spinning(Duration::ZERO).unwrap_err();
        assert!(matches!(e, Error::OutOfOrder(_)), "{e}");
        assert_eq!(client.counters(), (1, 0), "a refused step posted");
        let server = serve(engine);
        assert_eq!(client.wait_frame(T).unwrap(), 1);
        assert_eq!(client.tensor::<f32>("obs").unwrap(), &[1.0]);
        // Served: every step ends with its own frame, whether the spin saw it or the
        // wait after it did.
        for n in 2..=200u64 {
            let frame = match client.step_spinning(Duration::from_micros(50)).unwrap() {
                Some(frame) => frame,
                None => client.wait_frame(T).unwrap(),
            };
            assert_eq!(frame, n);
            assert_eq!(client.frame(), n);
            assert_eq!(client.tensor::<f32>("obs").unwrap(), &[n as f32]);
        }
        client.close();
        assert_eq!(server.join().unwrap(), 200);
    }

    #[test]
    fn a_spinning_step_that_sees_its_frame_at_once_returns_it() {
        let spec = EngineSpec::standard("client-spinning-at-once", 1, 1, 1, DType::F32);
        let mut engine = Engine::create(spec).unwrap();
        engine.publish().unwrap();
        let mut client = Client::attach(engine.name(), AttachOptions::default()).unwrap();
        for n in 1..=3u64 {
            // The engine answers action n before the client posts it (posted here as the
            // client would), so the spin's first look sees the frame whatever the load.
            sync::post(&client.region.control().doorbell_with_action(), n);
            assert_eq!(engine.wait_actions(T).unwrap(), n);
            engine.tensors().write::<f32>("obs").unwrap().fill(n as f32);
            engine.publish().unwrap();
            assert_eq!(client.step_spinning(Duration::ZERO).unwrap(), Some(n));
            assert_eq!(client.frame(), n);
            assert_eq!(client.counters(), (n, n));
            assert_eq!(client.tensor::<f32>("obs").unwrap(), &[n as f32]);
        }
    }

    #[test]
    fn a_spinning_step_is_refused_where_the_device_orders_the_steps() {
        let (engine, mut client) = pair(Draining::default());
        assert!(!client.steps_on_host());
        let e = client.step_spinning(Duration::from_micros(20)).unwrap_err();
        assert!(matches!(e, Error::OutOfOrder(_)), "{e}");
        assert_eq!(client.counters(), (0, 0), "an action was posted");
        drop(engine);
    }
}
