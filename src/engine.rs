//! The engine's side: create a region, publish frame 0, then loop
//! `wait_actions()` → step → `publish()`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::command::{self, BuiltinsOnly, CommandHandler};
use crate::control::{ClientState, Control, EngineState};
use crate::device::{self, CudaSharingRequest, Device, DeviceRelease, EngineBackend};
use crate::error::{Error, Peer, Result};
use crate::layout::TensorKey;
use crate::layout::{DType, Direction, HeaderBuilder, Layout, ShardInfo, TensorSpec};
use crate::os;
use crate::region::{self, Region};
use crate::shard::{self, ShardSlot};
use crate::sync::{self, WaitPolicy};
use crate::tensor::{Element, Tensors};
use crate::wire::{self, Envelope};

/// What an engine serves.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// What the engine is ("cartpole", "null", your simulator's name).
    pub kind: String,
    pub num_envs: u32,
    pub tensors: Vec<TensorSpec>,
    /// Region name; a random one if `None`.
    pub name: Option<String>,
    /// How it waits for actions. The default adapts on a sharded region
    /// ([`WaitPolicy::adapted_to_shards`]).
    pub policy: WaitPolicy,
    /// Bytes of each command ring (power of two ≥ 64); 0: no command channel.
    pub ring_capacity: u64,
    /// Key/values the engine reports in its schema: observation and action bounds, the
    /// autoreset mode, anything a client needs to build its spaces.
    pub metadata: Vec<(String, String)>,
    /// Engine processes serving the region (1.4): the creator serves shard 0 and the
    /// others [`Engine::join`] it. 1: an ordinary region.
    pub shards: u32,
    /// How CUDA tensors are shared: by IPC handle, by file descriptor (across PID
    /// namespaces, 1.9), or `Auto` ([`crate::device::cuda::share::decide`]).
    pub cuda_sharing: CudaSharingRequest,
}

impl EngineSpec {
    /// No tensors yet; add them with [`EngineSpec::tensor`].
    pub fn new(kind: &str, num_envs: u32) -> Self {
        EngineSpec {
            kind: kind.to_string(),
            num_envs,
            tensors: Vec::new(),
            name: None,
            policy: WaitPolicy::default(),
            ring_capacity: crate::layout::DEFAULT_RING_CAPACITY,
            metadata: Vec::new(),
            shards: 1,
            cuda_sharing: CudaSharingRequest::Auto,
        }
    }

    /// The standard set: `obs [N, obs_dim] f32`, `actions [N, act_dim] act_dtype`,
    /// `rewards [N] f32`, `terminated [N] bool`, `truncated [N] bool`, `reset_mask [N] bool`.
    pub fn standard(
        kind: &str,
        num_envs: u32,
        obs_dim: u64,
        act_dim: u64,
        act_dtype: DType,
    ) -> Self {
        let n = num_envs as u64;
        EngineSpec::new(kind, num_envs)
            .tensor("obs", DType::F32, &[n, obs_dim], Direction::EngineToClient)
            .tensor(
                "actions",
                act_dtype,
                &[n, act_dim],
                Direction::ClientToEngine,
            )
            .tensor("rewards", DType::F32, &[n], Direction::EngineToClient)
            .tensor("terminated", DType::Bool, &[n], Direction::EngineToClient)
            .tensor("truncated", DType::Bool, &[n], Direction::EngineToClient)
            .tensor("reset_mask", DType::Bool, &[n], Direction::ClientToEngine)
    }

    pub fn tensor(mut self, name: &str, dtype: DType, shape: &[u64], direction: Direction) -> Self {
        self.tensors
            .push(TensorSpec::new(name, dtype, shape, direction));
        self
    }

    /// A tensor on `device` (`Device::cuda(ordinal)`: in the engine's one exported CUDA
    /// allocation, protocol 1.2; every CUDA tensor of an engine must be on the same
    /// device). Creating the engine needs the `cuda` feature and a usable driver, else
    /// `CudaUnavailable`.
    pub fn tensor_on(
        mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        direction: Direction,
        device: Device,
    ) -> Self {
        self.tensors
            .push(TensorSpec::new(name, dtype, shape, direction).on(device));
        self
    }

    /// Moves the already declared tensor `name` to `device` (no-op if there is none).
    pub fn place(mut self, name: &str, device: Device) -> Self {
        for t in self.tensors.iter_mut().filter(|t| t.name == name) {
            t.device = device;
        }
        self
    }

    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }

    pub fn policy(mut self, policy: WaitPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn ring_capacity(mut self, bytes: u64) -> Self {
        self.ring_capacity = bytes;
        self
    }

    pub fn metadata(mut self, key: &str, value: &str) -> Self {
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }

    /// How CUDA tensors are shared ([`EngineSpec::cuda_sharing`]).
    pub fn cuda_sharing(mut self, sharing: CudaSharingRequest) -> Self {
        self.cuda_sharing = sharing;
        self
    }

    /// Splits the env axis over `count` engine processes (1.4): this engine creates the
    /// region and serves shard 0; processes 1..count join it with [`Engine::join`].
    pub fn shards(mut self, count: u32) -> Self {
        self.shards = count;
        self
    }
}

/// How a shard process joins a sharded region ([`Engine::join`]).
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// How long to wait for the region to appear and be published.
    pub timeout: Duration,
    /// How it waits; the default adapts to the machine
    /// ([`WaitPolicy::adapted_to_shards`]).
    pub policy: WaitPolicy,
    /// Key/values for the schema (only shard 0's are served; the others' are kept).
    pub metadata: Vec<(String, String)>,
}

impl Default for JoinOptions {
    fn default() -> Self {
        JoinOptions {
            timeout: Duration::from_secs(10),
            policy: WaitPolicy::default(),
            metadata: Vec::new(),
        }
    }
}

/// An engine serving one region. Dropping it closes the region and removes its name.
pub struct Engine {
    region: Region,
    /// The region's whole layout (what the schema describes).
    layout: Layout,
    /// What this engine serves: the whole layout, or its shard's slice of every tensor.
    slice: Layout,
    /// This engine's shard (the control block's words when the region is unsharded).
    shard: ShardInfo,
    metadata: Vec<(String, String)>,
    /// Reused for every reply.
    tx: flatbuffers::FlatBufferBuilder<'static>,
    /// Reused for every request.
    rx: Vec<u8>,
    /// Replies dropped because the client left the reply ring full.
    dropped_replies: std::cell::Cell<u64>,
    /// The end (close or death) of the last client was reported by a wait: later waits
    /// wait for a new client instead of reporting it again at once (a loop serving one
    /// client after another would otherwise spin). Cleared once a client is attached.
    client_end_reported: std::cell::Cell<bool>,
    policy: WaitPolicy,
    /// How long the waits for actions took lately: the spin budget under the default
    /// policy.
    action_waits: sync::SpinGauge,
    /// Last action number received.
    action: u64,
    /// Last frame number published.
    frame: u64,
    ready: bool,
    closed: bool,
    /// Where the tensors live: the hooks of their device (no-ops for host memory).
    device: Box<dyn EngineBackend>,
    /// Whether `device` orders device work at the protocol's hook points (false for host
    /// memory, whose hooks do nothing): the step path skips the calls entirely.
    device_hooks: bool,
    /// Whether a Vulkan tensor has a timeline semaphore: then every frame is published
    /// with the value signalled for it (`publish_signaled`), and a plain `publish` is
    /// refused. Known at creation, so the step path checks one bool, not the table.
    semaphore: bool,
    /// What became of exported device memory at close.
    release: DeviceRelease,
    /// 1.7: byte offset of this engine's block in the stats area, whose write sequence
    /// brackets what a command's handler writes, for observers (a step needs no word:
    /// `step_writes_begin`); `None` when the region has none (a shard joining a region an
    /// earlier version created).
    stats: Option<u64>,
}

/// Whether any Vulkan tensor of `layout` has a timeline semaphore.
fn has_semaphore(layout: &Layout) -> bool {
    layout
        .tensors
        .iter()
        .any(|t| t.vulkan.is_some_and(|v| v.semaphore.is_some()))
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("region", &self.region.name())
            .field("action", &self.action)
            .field("frame", &self.frame)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Sweeps dead regions, then creates a region for `spec`. Tensors start zeroed; write
    /// the reset observations and call [`Engine::publish`] to serve frame 0.
    pub fn create(spec: EngineSpec) -> Result<Engine> {
        let mut builder = HeaderBuilder::sharded(
            &spec.kind,
            spec.num_envs,
            &spec.tensors,
            spec.ring_capacity,
            spec.shards,
        )?;
        let name = match &spec.name {
            Some(n) => region::canonical_name(n)?,
            None => region::random_name()?,
        };
        // CUDA tensors: one allocation, exported (IPC handles and the engine's event
        // written into the builder) before the region, hence `magic`, exists. Vulkan
        // tensors: allocated or taken over, their table entries filled in; the fd socket
        // is bound by `start`, once the region's name is this engine's and before it is
        // published (so a client that sees the region can connect at once).
        let mut device = device::engine_backend(&mut builder, &name, spec.cuda_sharing)?;
        let _ = region::sweep();
        let region = Region::create_unpublished(&name, &builder)?;
        device.start(&region)?;
        region.publish()?;
        let pid = os::current_pid();
        let start = region.control().engine_start_time();
        let shards = builder.shards();
        let shard = shards[0];
        // Checked once here: `slot()` makes this shard's slot without the checks.
        let slot = ShardSlot::new(&region, &shard)?;
        // The creator serves shard 0: its lock on byte 0 (1.7: also an unsharded
        // engine's, which observers judge its liveness by without taking the flock).
        shard::lock_shard(&region, 0)?;
        if shards.len() > 1 {
            // Its identity, as a joining shard's.
            slot.set_identity(pid, start);
        }
        let stats = Some(builder.stats.block(0));
        region.stats_block(builder.stats.block(0))?;
        let layout = Layout {
            version: (builder.header.version_major, builder.header.version_minor),
            header_size: builder.header.header_size as u64,
            region_size: builder.header.region_size,
            num_envs: spec.num_envs,
            engine_pid: pid,
            engine_start_time: start,
            engine_kind: spec.kind.clone(),
            tensors: builder.tensors,
            rings: builder.rings,
            // None for memory shared by fd (ordered on the host), as validation says.
            engine_event_handle: builder
                .cuda_alloc
                .map(|_| builder.header.engine_event_handle)
                .filter(|h| *h != [0; 64]),
            shard_actions: builder.header.flags & crate::layout::FLAG_SHARD_ACTIONS != 0,
            shards,
            stats: Some(builder.stats),
        };
        let semaphore = has_semaphore(&layout);
        Ok(Engine {
            region,
            slice: layout.narrowed(&shard),
            shard,
            layout,
            metadata: spec.metadata,
            tx: flatbuffers::FlatBufferBuilder::new(),
            rx: Vec::new(),
            dropped_replies: std::cell::Cell::new(0),
            client_end_reported: std::cell::Cell::new(false),
            policy: spec.policy.adapted_to_shards(spec.shards as usize),
            action_waits: sync::SpinGauge::default(),
            action: 0,
            frame: 0,
            ready: false,
            closed: false,
            device_hooks: device.needs_hooks(),
            semaphore,
            device,
            release: DeviceRelease::NothingHeld,
            stats,
        })
    }

    /// Joins the sharded region `name` as shard `index` (1.4): opens and validates it as
    /// a client would (the same checks of untrusted bytes), takes the shard's liveness
    /// lock (`ShardTaken` if a live process holds it) and writes who serves it. The
    /// engine then serves its slice of the env axis: [`Engine::num_envs`] and every
    /// tensor view are the slice's, and it runs the same loop as any engine (write frame
    /// 0, [`publish`](Engine::publish), then `wait_actions` → step → `publish`).
    pub fn join(name: &str, index: u32, options: JoinOptions) -> Result<Engine> {
        let name = region::canonical_name(name)?;
        // No deadline when it lies past what an Instant holds.
        let deadline = Instant::now().checked_add(options.timeout);
        let left = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let mut backoff = sync::Backoff::default();
        // The creator may not have made the region yet: wait for the name, then for it
        // to be published (Region::open waits for that).
        let (region, layout) = loop {
            match Region::open(&name, left(), || Ok(())) {
                Err(Error::NotFound { .. }) if !left().is_zero() => backoff.snooze(),
                other => break other?,
            }
        };
        if !layout.is_sharded() {
            return Err(Error::InvalidSpec(format!(
                "region '{name}' is not sharded: its one engine serves it whole"
            )));
        }
        let Some(&shard) = layout.shards.get(index as usize) else {
            return Err(Error::InvalidSpec(format!(
                "shard {index} of region '{name}', which has {} shards",
                layout.shards.len()
            )));
        };
        shard::lock_shard(&region, index)?;
        let slot = ShardSlot::new(&region, &shard)?;
        if slot.state() != EngineState::Starting {
            return Err(Error::InvalidSpec(format!(
                "shard {index} of region '{name}' was served before (state {}): a shard joins a fresh region only",
                slot.state().name()
            )));
        }
        let pid = os::current_pid();
        let start = os::process_start_time(pid)
            .ok_or_else(|| Error::io("reading /proc/self/stat", std::io::ErrorKind::NotFound))?;
        slot.set_identity(pid, start);
        let policy = options.policy.adapted_to_shards(layout.shards.len());
        let stats = layout.stats.map(|a| a.block(index));
        if let Some(at) = stats {
            region.stats_block(at)?;
        }
        let semaphore = has_semaphore(&layout);
        Ok(Engine {
            region,
            slice: layout.narrowed(&shard),
            shard,
            layout,
            metadata: options.metadata,
            tx: flatbuffers::FlatBufferBuilder::new(),
            rx: Vec::new(),
            dropped_replies: std::cell::Cell::new(0),
            client_end_reported: std::cell::Cell::new(false),
            policy,
            action_waits: sync::SpinGauge::default(),
            action: 0,
            frame: 0,
            ready: false,
            closed: false,
            device_hooks: false,
            semaphore,
            device: Box::new(device::host::HostEngine),
            release: DeviceRelease::NothingHeld,
            stats,
        })
    }

    /// Which shard this engine serves, and its envs (shard 0, all envs, when unsharded).
    pub fn shard(&self) -> &ShardInfo {
        &self.shard
    }

    /// The layout of the whole region (every env), as the schema describes it.
    pub fn region_layout(&self) -> &Layout {
        &self.layout
    }

    /// The live words of this engine's shard.
    #[inline]
    fn slot(&self) -> ShardSlot<'_> {
        // SAFETY: `create` and `join` made this shard's slot with `ShardSlot::new` in
        // this region before the engine existed, and neither changes afterwards.
        unsafe { ShardSlot::checked_before(&self.region, &self.shard) }
    }

    /// A second mapping of the same region, for views that must outlive this engine
    /// (the Python package's DLPack capsules own one). Tensor offsets from the layout
    /// apply to it unchanged.
    pub fn map_again(&self) -> Result<Region> {
        self.region.map_again()
    }

    /// The region name clients attach with.
    pub fn name(&self) -> &str {
        self.region.name()
    }

    /// What this engine serves: the region's layout, or for a shard its slice (each
    /// tensor narrowed to the shard's envs).
    pub fn layout(&self) -> &Layout {
        &self.slice
    }

    /// Envs this engine steps (its shard's, for a shard).
    pub fn num_envs(&self) -> usize {
        self.slice.num_envs as usize
    }

    /// Views of the tensors: write engine→client ones, read client→engine ones, and the
    /// engine's device side (`Tensors::engine_backend`, `Tensors::device_ptr`).
    pub fn tensors(&mut self) -> Tensors<'_> {
        self.views()
    }

    /// [`Engine::tensors`] under the name it had in 0.1.0's documentation.
    #[deprecated(note = "renamed `Engine::tensors`")]
    pub fn io(&mut self) -> Tensors<'_> {
        self.tensors()
    }

    /// The engine's views. Callers hold `&mut self` (or, in `answer_all`, are only
    /// reached from a method that does): at most one `Tensors` of this engine exists.
    fn views(&self) -> Tensors<'_> {
        Tensors::new(&self.region, &self.slice, Peer::Engine).with_device(&*self.device)
    }

    /// A mutable view of one engine→client tensor.
    pub fn tensor_mut<T: Element>(&mut self, key: impl TensorKey) -> Result<&mut [T]> {
        self.tensors().write(key)
    }

    /// A view of any tensor (the actions the client sent, for example).
    pub fn tensor<T: Element>(&mut self, key: impl TensorKey) -> Result<&[T]> {
        self.tensors().read(key)
    }

    /// The device backend of this engine's tensors: the stream a frame's kernels go on
    /// ([`EngineBackend::stream`]; CUDA), the device addresses of its tensors.
    pub fn backend(&self) -> &dyn EngineBackend {
        &*self.device
    }

    /// Device address of a tensor in the engine's device memory (its exported CUDA
    /// allocation); `NotOnHost` for a host-only engine.
    pub fn device_ptr(&self, key: impl TensorKey) -> Result<u64> {
        let (_, t) = key.resolve(&self.slice)?;
        self.device.device_ptr(t)
    }

    /// The attached client's pid, start time and event handle
    /// ([`Control::read_client_event`]).
    pub fn client_event(&self) -> Option<crate::layout::ClientEventHandle> {
        self.control().read_client_event()
    }

    /// The typed view of the region's live control block.
    #[inline]
    pub fn control(&self) -> Control<'_> {
        self.region.control()
    }

    /// Records that env `env` (this engine's numbering: `0..num_envs()`) ended an episode
    /// of return `episode_return` after `length` steps, in the region's stats area
    /// (1.7), which observers read (`shmbridge view` plots it). Usually called while
    /// stepping, as envs finish; any time is right. Nothing happens in a region without a
    /// stats area.
    pub fn record_episode(&mut self, env: usize, episode_return: f64, length: u64) -> Result<()> {
        self.check_usable()?;
        self.tensors().episode_ended(env, episode_return, length)
    }

    /// Makes the device work that wrote a frame (or a reply) complete before the peer
    /// sees it published (CUDA: records the engine's event after the kernels).
    #[inline]
    fn record_frame(&self) -> Result<()> {
        if !self.device_hooks {
            return Ok(());
        }
        self.device.before_publish()
    }

    /// Whether a client is attached now.
    pub fn client_attached(&self) -> bool {
        self.control().client_state() == ClientState::Attached
    }

    /// `Closed` after `close()`; `RegionTooSmall` once a check found the region
    /// truncated (it sticks: nothing touches the mapping again). Every public call that
    /// touches the region starts here: a field and a load, no system call.
    #[inline]
    fn check_usable(&self) -> Result<()> {
        if self.closed {
            return Err(Error::Closed(Peer::Engine));
        }
        self.region.known_shrunk()
    }

    /// The client's state as an error, if it is gone, once per client: after a wait
    /// reported its end, waits go on (for a new client); a dead or closed sibling shard.
    /// `RegionTooSmall` if the region was truncated under the engine (checked before each
    /// sleep, as the client does).
    fn check_client(&self) -> Result<()> {
        self.region.check_size()?;
        self.check_client_end()?;
        // A shard also stops when another shard died or closed: the region can no longer
        // step (the client's next step fails naming that shard), so no shard waits for
        // actions that cannot come, and the creator, stopping, removes the region.
        if self.layout.is_sharded() {
            if let Err(sibling) =
                shard::check_shards(&self.region, &self.layout, Some(self.shard.index))
            {
                // A sibling that closed because the client closed after our look at it:
                // the client's end is what happened (the sibling stopped on it), so it
                // is what every shard reports, not the sibling's closure.
                self.check_client_end()?;
                return Err(sibling);
            }
        }
        Ok(())
    }

    /// `PeerClosed` / `PeerDied` once per client (see [`Engine::check_client`]).
    fn check_client_end(&self) -> Result<()> {
        let control = self.control();
        let checked = control
            .check_client(|pid, start| self.region.client_alive(pid, start))
            .map_err(|e| match e {
                // Name the client's pid in terms the reader can use.
                Error::PeerDied {
                    peer: Peer::Client,
                    pid,
                    hint,
                    ..
                } => {
                    let (_, start) = control.client_identity();
                    Error::PeerDied {
                        peer: Peer::Client,
                        pid,
                        pid_ns: self.region.client_pid_namespace(pid, start),
                        hint,
                    }
                }
                e => e,
            });
        match checked {
            Err(Error::PeerClosed { .. } | Error::PeerDied { .. })
                if self.client_end_reported.get() =>
            {
                Ok(())
            }
            Err(e @ (Error::PeerClosed { .. } | Error::PeerDied { .. })) => {
                self.client_end_reported.set(true);
                Err(e)
            }
            Err(e) => Err(e),
            Ok(()) => {
                if control.client_state() == ClientState::Attached {
                    self.client_end_reported.set(false);
                }
                Ok(())
            }
        }
    }

    /// Waits until a client is attached (a live one: a client that died attached frees
    /// the slot meanwhile); `Ok` at once if one is. Sleeps on the doorbell, which an
    /// attaching client rings (a client of an earlier version does not: then it is seen
    /// within a sleep slice, 10 ms). The way to serve one client after another: after
    /// `wait_actions` reported `PeerClosed` or `PeerDied`, call this, then wait for
    /// actions again. `Timeout` after `timeout` (`Duration::MAX`: none).
    pub fn wait_for_client(&mut self, timeout: Duration) -> Result<()> {
        self.check_usable()?;
        let control = self.control();
        let attached = |_| {
            let live = control.client_state() == ClientState::Attached
                && control
                    .check_client(|pid, start| self.region.client_alive(pid, start))
                    .is_ok();
            live.then_some(())
        };
        sync::wait_until(
            &control.doorbell(),
            attached,
            WaitPolicy::BLOCKING,
            timeout,
            "a client to attach",
            || self.region.check_size(),
        )?;
        self.client_end_reported.set(false);
        Ok(())
    }

    /// Publishes the frame for the action last received: observations and the other
    /// engine→client tensors must be written before this call. The first call, before
    /// any action, publishes frame 0 (the reset observations) and marks the engine ready.
    ///
    /// An engine whose Vulkan tensors have a timeline semaphore publishes with
    /// [`Engine::publish_signaled`] instead: here it gets `InvalidSpec` and nothing is
    /// published (a CUDA client's stream would wait for a value no one signalled).
    pub fn publish(&mut self) -> Result<u64> {
        if self.semaphore {
            return self.publish_signaled(None); // InvalidSpec, saying why
        }
        self.publish_checked()
    }

    /// [`Engine::publish`] once the semaphore value (if any) was checked.
    #[inline(always)] // the step path: one function with `publish`
    fn publish_checked(&mut self) -> Result<u64> {
        self.check_usable()?;
        if !self.ready {
            // Frame 0 on the device is complete once the event fires: record before READY.
            self.record_frame()?;
            self.ready = true;
            // Unsharded: the shard's state word is `engine_state`. The creator of a
            // sharded region also marks the region ready, for tools that list it.
            self.slot().set_ready();
            if self.region.is_owner() && self.layout.is_sharded() {
                self.control().set_engine_ready();
            }
            return Ok(0);
        }
        if self.action == self.frame {
            return Err(Error::OutOfOrder(
                "publish() with no action pending: each action gets exactly one frame; call wait_actions() first",
            ));
        }
        // The frame's kernels are on the engine stream: record after them, then post.
        self.record_frame()?;
        self.frame = self.action;
        sync::post(&self.slot().frame_seq(), self.frame);
        if self.layout.shard_actions {
            // 1.10: an asynchronous client sleeps on the frame bell for any shard's frame.
            sync::ring_if_waiting(&self.control().frame_seq());
        }
        Ok(self.frame)
    }

    /// The number the next [`Engine::publish`] gives its frame: 0 before frame 0, then
    /// the action last received (frame `n` answers action `n`). A renderer that signals a
    /// timeline semaphore for its Vulkan tensors (path b) signals this value.
    pub fn next_frame(&self) -> u64 {
        if self.ready {
            self.action
        } else {
            0
        }
    }

    /// [`Engine::publish`] for an engine whose renderer exported its Vulkan tensors'
    /// memory itself (path b), saying what it signalled: `Some(v)` when those tensors
    /// have a timeline semaphore ([`TensorSpec::with_semaphore`]) and the renderer's
    /// queue signals it with `v` once the frame is written, which must be the frame's
    /// number ([`Engine::next_frame`]; frame 0 is the semaphore's initial value 0);
    /// `None` for an engine without one, whose frames the seq counters alone order. As
    /// with `publish`, the device work that wrote the frame must be complete before the
    /// call, semaphore or not (`docs/protocol.md` §3.6). Anything else is `InvalidSpec`
    /// and nothing is published.
    ///
    /// [`TensorSpec::with_semaphore`]: crate::layout::TensorSpec::with_semaphore
    pub fn publish_signaled(&mut self, signaled: Option<u64>) -> Result<u64> {
        self.check_usable()?;
        let with_semaphore = self
            .layout
            .tensors
            .iter()
            .find(|t| t.vulkan.is_some_and(|v| v.semaphore.is_some()));
        let frame = self.next_frame();
        match (with_semaphore, signaled) {
            (Some(_), Some(v)) if v == frame => {}
            (Some(_), Some(v)) => {
                return Err(Error::InvalidSpec(format!(
                    "the renderer signalled its timeline semaphore with {v} for frame {frame}: \
                     signal each frame's number (next_frame), the value a client waits for"
                )))
            }
            (Some(t), None) => {
                return Err(Error::InvalidSpec(format!(
                    "tensor '{}' has a timeline semaphore: publish with publish_signaled and \
                     the value the renderer signalled for this frame (its number, {frame})",
                    t.name
                )))
            }
            (None, Some(v)) => {
                return Err(Error::InvalidSpec(format!(
                    "a semaphore value ({v}) for an engine whose tensors have no semaphore: \
                     publish without one"
                )))
            }
            (None, None) => {}
        }
        self.publish_checked()
    }

    /// The last action the client posted to this engine's shard (Acquire): the control
    /// block's `action_seq`, or (1.10) the shard's own word where that is larger.
    fn posted_action(&self) -> u64 {
        let a = self.control().action_seq().counter.load(Ordering::Acquire);
        if self.layout.shard_actions {
            a.max(self.slot().action_seq().load(Ordering::Acquire))
        } else {
            a
        }
    }

    /// Waits for the client's next action; returns its number. Then read the actions,
    /// apply `reset_mask`, step, write the frame and [`publish`](Engine::publish) it.
    /// Commands that arrive meanwhile get the built-in answers; `Reset` and
    /// engine-defined methods are refused (use [`wait_actions_with`](Engine::wait_actions_with)).
    ///
    /// Errors: `PeerClosed` when the client closed, `PeerDied` when it died (noticed
    /// within ~10 ms), `Timeout` after `timeout` with no action (`Duration::MAX`: none).
    pub fn wait_actions(&mut self, timeout: Duration) -> Result<u64> {
        self.wait_actions_with(timeout, &mut BuiltinsOnly)
    }

    /// As [`wait_actions`](Engine::wait_actions), answering commands with `handler`
    /// while it waits.
    pub fn wait_actions_with(
        &mut self,
        timeout: Duration,
        handler: &mut dyn CommandHandler,
    ) -> Result<u64> {
        self.check_usable()?;
        if !self.ready {
            return Err(Error::OutOfOrder(
                "publish() frame 0 before waiting for actions",
            ));
        }
        if self.action != self.frame {
            return Err(Error::OutOfOrder(
                "the frame for the last action was not published; call publish() first",
            ));
        }
        let target = self.frame + 1;
        // One timeout over every wait of this call (commands answered between them);
        // the clock is read only by a wait that is not answered at once.
        let mut track = sync::WaitTrack::learning(self.action_waits);
        let seen = loop {
            let control = self.control();
            let slot = self.slot();
            let action_seq = control.action_seq().counter;
            // 1.10: a shard's action is the larger of the region's and its own (a client
            // stepping only some shards posts to theirs). Without shard actions `own` is
            // the region's word again: the same line, read twice, and no branch per poll.
            let own = match self.layout.shard_actions {
                true => slot.action_seq(),
                false => action_seq,
            };
            let has_rings = self.shard.rings.is_some();
            let woke = sync::wait_until_from(
                &slot.doorbell(&self.region),
                |order| {
                    let a = action_seq.load(order).max(own.load(order));
                    if a >= target {
                        Some(Some(a))
                    } else if has_rings && slot.request_pending(order) {
                        Some(None)
                    } else {
                        None
                    }
                },
                self.policy,
                timeout,
                &mut track,
                "the client's next action",
                || self.check_client(),
            );
            let woke = match woke {
                Ok(w) => w,
                Err(e) => {
                    // The client closed or died: its CUDA event goes with it.
                    if matches!(e, Error::PeerClosed { .. } | Error::PeerDied { .. }) {
                        self.device.forget_client();
                    }
                    return Err(e);
                }
            };
            match woke {
                Some(a) => break a,
                None => {
                    self.poll_commands(handler)?;
                }
            }
        };
        self.action_waits = track.gauge();
        if seen != target {
            return Err(unexpected_action(seen, self.frame, target));
        }
        // CUDA: the client recorded its event after writing device actions and before
        // posting; the engine stream waits on it before any kernel reads them.
        if self.device_hooks {
            self.device.before_actions(self.region.control())?;
        }
        self.action = seen;
        // A client posts actions: the end of the next one is news again.
        self.client_end_reported.set(false);
        // The engine writes frame `seen` from here until `publish`: observers, who copy
        // while `action_seq` equals every `frame_seq`, must see the new action once
        // they have seen any of those writes (1.7, a fence: no instruction on x86).
        crate::control::step_writes_begin();
        Ok(seen)
    }

    /// Answers every command waiting in the client→engine ring; returns how many. Call it
    /// between steps (`wait_actions_with` does). Once the client has posted its next
    /// action it takes no more requests (the engine steps first; they are answered at the
    /// next wait). A request that does not decode gets an
    /// error reply with id 0; a corrupt ring is a `Protocol` error.
    pub fn poll_commands(&mut self, handler: &mut dyn CommandHandler) -> Result<usize> {
        self.check_usable()?;
        let Some(channel) = command::channel(&self.region, &self.shard)? else {
            return Ok(0);
        };
        let mut request = std::mem::take(&mut self.rx);
        let mut tx = std::mem::take(&mut self.tx);
        let mut answered = 0;
        let result = loop {
            // An action is pending: it steps first. A request posted after it is answered
            // once the engine stepped, when its reply is no longer superseded (see
            // `answer_one`); taken now, its reply would be dropped.
            if self.posted_action() > self.action {
                break Ok(answered);
            }
            match channel.c2e.try_pop(&mut request) {
                Ok(true) => {}
                Ok(false) => break Ok(answered),
                Err(e) => break Err(e),
            }
            // CUDA: a command (reset) may write device tensors the client's queued work
            // still reads; the client recorded its event before pushing this request (the
            // pop is Acquire), so the engine's stream waits on it before the answer.
            if let Err(e) = self.device.before_command(self.region.control()) {
                break Err(e);
            }
            if let Err(e) = self.answer_one(&channel, &request, &mut tx, handler) {
                break Err(e);
            }
            answered += 1;
        };
        self.rx = request;
        self.tx = tx;
        result
    }

    /// Answers one request (already popped into `request`) and pushes the reply.
    fn answer_one(
        &self,
        channel: &command::Channel<'_>,
        request: &[u8],
        tx: &mut flatbuffers::FlatBufferBuilder<'static>,
        handler: &mut dyn CommandHandler,
    ) -> Result<()> {
        let reply = match Envelope::decode(request) {
            Ok(req) => {
                // Only reached from `poll_commands`, which holds `&mut self`: no
                // other `Tensors` of this engine exists while this one does.
                let mut io = self.views();
                // A command's handler may write engine→client tensors (a reset does):
                // observers keep off until it returned.
                let stats = match self.stats {
                    Some(at) => Some(self.region.stats_block(at)?),
                    None => None,
                };
                let opened = stats.is_some_and(|s| s.begin_write());
                let reply = command::answer(
                    req,
                    &self.layout,
                    &self.metadata,
                    self.frame,
                    &mut io,
                    handler,
                );
                if let (true, Some(s)) = (opened, stats) {
                    s.end_write();
                }
                reply
            }
            Err(e) => Envelope::error_reply(
                Envelope::peek_id(request).unwrap_or(0),
                wire::Method::Custom("?".into()),
                wire::code::BAD_REQUEST,
                e.to_string(),
            ),
        };
        // CUDA: a command (reset) may have queued kernels writing device tensors; the
        // reply publishes them, so the event is recorded before it is pushed.
        self.record_frame()?;
        let mut bytes = reply.encode_into(tx);
        if bytes.len() as u64 > channel.e2c.max_record() {
            let too_big = Envelope::error_reply(
                reply.id,
                reply.method.clone(),
                wire::code::ENGINE_ERROR,
                format!(
                    "the reply ({} bytes) does not fit the {}-byte reply ring",
                    bytes.len(),
                    channel.e2c.capacity()
                ),
            );
            bytes = too_big.encode_into(tx);
        }
        // A client has one call in flight at a time and posts its next request, or its
        // next action, only once the call returned (answered, timed out, interrupted):
        // if either is already posted, nobody waits for this reply. Dropping it here, and
        // giving up on room for it as soon as either appears, means a backlog of stale
        // replies never fills the ring and never keeps the engine from stepping.
        let superseded =
            || self.slot().request_pending(Ordering::Acquire) || self.posted_action() > self.action;
        if superseded() {
            self.dropped_replies.set(self.dropped_replies.get() + 1);
            return Ok(());
        }
        let pushed = channel
            .e2c
            .push(bytes, self.policy, command::REPLY_TIMEOUT, || {
                self.check_client()?;
                if superseded() {
                    // Our own stop: not an interrupt from anyone else.
                    return Err(Error::Interrupted);
                }
                Ok(())
            });
        match pushed {
            Ok(()) => {}
            // Superseded while it waited for room, or no room for REPLY_TIMEOUT (the
            // client stopped reading): dropped rather than stop serving.
            Err(Error::Interrupted | Error::Timeout { .. }) => {
                self.dropped_replies.set(self.dropped_replies.get() + 1);
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Replies dropped because nobody waited for them: the client had posted a newer
    /// request or action (its call had returned), or did not read for
    /// [`command::REPLY_TIMEOUT`].
    pub fn dropped_replies(&self) -> u64 {
        self.dropped_replies.get()
    }

    /// The key/values this engine reports in its schema.
    pub fn metadata(&self) -> &[(String, String)] {
        &self.metadata
    }

    /// Number of the last frame published.
    pub fn frame(&self) -> u64 {
        self.frame
    }

    /// Marks the region closed, wakes a waiting client (it gets `PeerClosed`) and removes
    /// the name. Also done on drop. In a child forked from the engine's process, neither
    /// touches the region.
    pub fn close(mut self) {
        self.shut();
    }

    /// [`close`](Engine::close), reporting what happened to exported device memory a
    /// client could hold open (CUDA's): freed once the client acknowledged closing its
    /// handles (or died, or never opened them), else leaked after a bounded wait;
    /// [`DeviceRelease::NothingHeld`] for host and Vulkan memory.
    pub fn close_reporting(mut self) -> DeviceRelease {
        self.shut();
        self.release
    }

    fn shut(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        // A child forked from the engine's process drops its copy: the region and the
        // device backend are its parent's (Region's drop does not unlink there either).
        // The backend is left as it is, undropped: its drop would call the device driver
        // (whose threads and device files the child does not own) and stop the fd
        // socket the child shares with its parent.
        if !self.region.made_here() {
            std::mem::forget(std::mem::replace(
                &mut self.device,
                Box::new(device::host::HostEngine),
            ));
            return;
        }
        // Truncated under us (a same-user peer): the control block may be gone, and
        // touching it would SIGBUS. The name is still removed (Region's drop). The backend
        // lets go of what it can without reading the control block
        // (`EngineBackend::release_truncated`): the fd server stops, exported CUDA memory
        // a client may still map is leaked (freed with the process), never freed under it.
        if self.region.check_size().is_err() {
            let device = std::mem::replace(&mut self.device, Box::new(device::host::HostEngine));
            device.release_truncated();
            return;
        }
        if self.layout.is_sharded() {
            self.slot().close();
        }
        if self.region.is_owner() {
            self.region.control().close_engine();
        }
        // Exported memory: freed only when no live client holds it open (the backend
        // reads the client's acknowledgement after the CLOSED store above).
        let device = std::mem::replace(&mut self.device, Box::new(device::host::HostEngine));
        self.release = device.release(self.region.control());
    }
}

#[cold]
fn unexpected_action(seen: u64, frame: u64, target: u64) -> Error {
    Error::Protocol {
        peer: Peer::Client,
        detail: format!("posted action {seen} after frame {frame}; expected {target}"),
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shut();
    }
}
