//! The one error type of the crate. Every variant says what went wrong and, where there
//! is one, what to do about it; the Python layer maps them one to one onto exceptions.

use std::time::Duration;

/// Which side of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Engine,
    Client,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Peer::Engine => "engine",
            Peer::Client => "client",
        })
    }
}

/// Which PID namespace a pid named in an error belongs to: this process's, or another
/// one (a learner or simulator in another container, where each side has its own pids):
/// there the number names nothing, or another process, here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PidNamespace {
    /// This process's namespace (or not known to be another).
    #[default]
    This,
    /// Another one: the process was alive but not visible here.
    Other,
}

/// A pid as an error message names it.
struct PidIn(u32, PidNamespace);

impl std::fmt::Display for PidIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.1 {
            PidNamespace::This => write!(f, "pid {}", self.0),
            PidNamespace::Other => write!(f, "pid {} in another PID namespace", self.0),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("region '{name}' does not exist: check the name the engine printed, or whether the engine is still running")]
    NotFound { name: String },

    #[error("region '{name}' already exists: pick another name, or run `shmbridge gc` if its engine is dead")]
    NameInUse { name: String },

    #[error("permission denied on region '{name}': it belongs to another user (regions are created mode 0600)")]
    PermissionDenied { name: String },

    #[error("invalid region name '{name}': {reason}")]
    InvalidName { name: String, reason: &'static str },

    #[error("'{name}' in /dev/shm is {what}, not a region file: shmbridge does not open it (remove it if nothing else uses it)")]
    NotARegionFile { name: String, what: &'static str },

    #[error("region '{name}' is not a shmbridge region (magic {found:#018x}): check the name")]
    BadMagic { name: String, found: u64 },

    #[error("protocol version mismatch: this library speaks {ours_major}.{ours_minor}, the region was written by {theirs_major}.{theirs_minor}; use the same shmbridge major version on both sides")]
    VersionMismatch {
        ours_major: u16,
        ours_minor: u16,
        theirs_major: u16,
        theirs_minor: u16,
    },

    #[error("header layout hash mismatch (ours {ours:#018x}, region {theirs:#018x}): both sides claim the same version but disagree on the layout; rebuild both from the same release")]
    LayoutMismatch { ours: u64, theirs: u64 },

    #[error("region too small: need at least {needed} bytes, it has {actual}; the file is truncated or not a shmbridge region")]
    RegionTooSmall { needed: u64, actual: u64 },

    #[error("invalid header field `{field}`: {reason}")]
    InvalidHeader { field: &'static str, reason: String },

    #[error("tensor '{tensor}' lies outside the region (offset {offset} + {len} bytes > region size {region_size})")]
    TensorOutOfBounds {
        tensor: String,
        offset: u64,
        len: u64,
        region_size: u64,
    },

    #[error("invalid tensor '{tensor}': {reason}")]
    InvalidTensor { tensor: String, reason: String },

    #[error("invalid engine spec: {0}")]
    InvalidSpec(String),

    #[error("no tensor named '{name}' (tensors: {available})")]
    NoSuchTensor { name: String, available: String },

    #[error("tensor '{tensor}' has dtype {actual}, not {requested}")]
    DTypeMismatch {
        tensor: String,
        requested: &'static str,
        actual: &'static str,
    },

    #[error("tensor '{tensor}' is written by the {writer}; the {requester} can only read it")]
    WrongDirection {
        tensor: String,
        writer: Peer,
        requester: Peer,
    },

    #[error("tensor '{tensor}' was already borrowed mutably from this frame")]
    AlreadyBorrowed { tensor: String },

    #[error("another client ({}) is attached to region '{name}'; one client per engine", PidIn(*pid, *pid_ns))]
    AlreadyAttached {
        name: String,
        pid: u32,
        pid_ns: PidNamespace,
    },

    #[error("the {peer} ({}) died; {hint}", PidIn(*pid, *pid_ns))]
    PeerDied {
        peer: Peer,
        /// As the peer recorded it, in its own PID namespace (`pid_ns`).
        pid: u32,
        pid_ns: PidNamespace,
        hint: &'static str,
    },

    #[error("the {peer} closed the region")]
    PeerClosed { peer: Peer },

    /// 1.4: one engine process of a sharded region died (its lock on the region was
    /// released, however it ended).
    #[error("engine shard {shard} ({}, envs {env_start}..{env_end}) died; the other shards are stopped with the region: start the engine again", PidIn(*pid, *pid_ns))]
    ShardDied {
        shard: u32,
        pid: u32,
        pid_ns: PidNamespace,
        env_start: u32,
        env_end: u32,
    },

    /// 1.4: one engine process of a sharded region closed it.
    #[error("engine shard {shard} (envs {env_start}..{env_end}) closed the region")]
    ShardClosed {
        shard: u32,
        env_start: u32,
        env_end: u32,
    },

    /// 1.4: a process tried to serve a shard another live process serves.
    #[error("shard {shard} of region '{name}' is already served by a live process: one process per shard")]
    ShardTaken { name: String, shard: u32 },

    #[error("timed out after {} waiting for {what}", Rounded(*waited))]
    Timeout {
        waited: Duration,
        what: &'static str,
    },

    #[error("the {peer} broke the protocol: {detail}")]
    Protocol { peer: Peer, detail: String },

    #[error("record of {len} bytes does not fit the {capacity}-byte ring (a command ring, or a stream's lane); send less per call, or create it with larger rings (lanes)")]
    RecordTooLarge { len: u64, capacity: u64 },

    #[error("malformed command: {0}")]
    BadMessage(String),

    #[error("the engine has no command channel (protocol {major}.{minor}: 1.0 engines have none, and 1.1 engines created with ring capacity 0 neither)")]
    NoCommandChannel { major: u16, minor: u16 },

    #[error("the engine answered '{method}' with error {code}: {message}")]
    Remote {
        method: String,
        code: u16,
        message: String,
    },

    #[error("out of order: {0}")]
    OutOfOrder(&'static str),

    /// An asynchronous batch's `send` named env `env_id`, which the client cannot step now
    /// (kind `OutOfOrder`): `reason` says why.
    #[error("out of order: env {env_id}: {reason}")]
    NotInBatch { env_id: u32, reason: &'static str },

    #[error("this {0} is closed")]
    Closed(Peer),

    /// The caller's interrupt hook stopped a wait (see `Client::set_interrupt`).
    #[error("the wait was interrupted")]
    Interrupted,

    /// A CUDA path was asked for where CUDA cannot be used: a build without the `cuda`
    /// feature, no loadable driver (`libcuda.so`), no device, or a driver call that failed
    /// while probing. `reason` says which.
    #[error("CUDA is unavailable: {reason}")]
    CudaUnavailable { reason: String },

    /// A CUDA driver call failed after the driver was found usable.
    #[error("CUDA call {call} failed: {detail}")]
    Cuda { call: &'static str, detail: String },

    /// A Vulkan path was asked for where Vulkan cannot be used: a build without the
    /// `vulkan` feature, no loader (`libvulkan.so.1`) or driver (ICD), no device that can
    /// export or import memory, or no device with the engine's device UUID. `reason`
    /// says which.
    #[error("Vulkan is unavailable: {reason}")]
    VulkanUnavailable { reason: String },

    /// A Vulkan call failed after a device was found usable.
    #[error("Vulkan call {call} failed: {detail}")]
    Vulkan { call: &'static str, detail: String },

    /// A host view (slice, address) of a tensor whose bytes are not in the region.
    #[error("tensor '{tensor}' lives on {location}, not in host memory: use its device view")]
    NotOnHost {
        tensor: String,
        location: &'static str,
    },

    /// The engine has not taken earlier requests out of the command ring for the whole
    /// call timeout: it is busy (a long step, a handler that blocks) or does not serve
    /// commands. Nothing was sent; the session can keep stepping.
    #[error("the engine's command ring is full: {queued} of its {capacity} bytes hold requests it has not read yet (it is busy, or does not serve commands while it steps); nothing was sent, the session can keep stepping: call again later")]
    CommandBacklog { queued: u64, capacity: u64 },

    /// A step gave up before posting its action: the device work the action waits on
    /// (a CUDA consumer stream of a Vulkan engine with a timeline semaphore, or the
    /// stream of a client of CUDA memory shared by fd) did not drain within the timeout. Unlike [`Error::Timeout`] nothing is in flight: the
    /// action was not sent, the frame did not change, and the step may simply be
    /// repeated (not followed by `wait_frame`).
    #[error("the action was not sent: timed out after {} waiting for {what}; nothing is in flight, step again", Rounded(*waited))]
    NotPosted {
        waited: Duration,
        what: &'static str,
    },

    /// An engine-side call on a client's tensor views: the engine's device backend
    /// ([`Tensors::engine_backend`](crate::Tensors::engine_backend)) asked of them.
    /// Whatever the device (host, CUDA, Vulkan): the views are the wrong ones for the
    /// call. (A client's views do give device addresses, as the client does.)
    #[error("{0}")]
    NoDeviceSide(String),

    /// The filesystem of shm objects (`/dev/shm`, a tmpfs) has no room for the region.
    #[error("no room in /dev/shm for region '{name}': it needs {needed} bytes ({}), /dev/shm has {free} bytes free of {total} ({} of {}); free some (`shmbridge gc` removes regions of dead engines), serve fewer or smaller tensors, or give /dev/shm more room (Docker: `docker run --shm-size=2g`, Compose: `shm_size`; Kubernetes: an emptyDir with medium Memory mounted on /dev/shm)", Mib(*needed), Mib(*free), Mib(*total))]
    NoSpace {
        name: String,
        needed: u64,
        free: u64,
        total: u64,
    },

    /// A stream's lane stayed full for the whole deadline of a reserve: its consumers
    /// did not release enough records. Nothing was written; reserve again later.
    #[error("stream lane {lane} is full: the record needs {needed} bytes, {free} are free after waiting {}; nothing was written: the consumers are slower than the producers (reserve again, or create the stream with larger lanes)", Rounded(*waited))]
    Full {
        lane: u32,
        needed: u64,
        free: u64,
        waited: Duration,
    },

    /// A stream's bytes break its rules (a record's length, kind, counts or a cursor):
    /// the stream is unusable from here on; nothing was read out of bounds.
    #[error("stream lane {lane} is corrupt: {detail}; the stream cannot be used any more")]
    BadRecord { lane: u32, detail: String },

    /// A producer attached with a schema other than the stream's.
    #[error("stream '{stream}' has schema '{theirs}', not '{ours}'")]
    SchemaMismatch {
        stream: String,
        theirs: String,
        ours: String,
    },

    /// Every lane of a stream has a live producer.
    #[error("stream '{stream}' has no free lane: its {lanes} lanes all have a live producer; create it with more lanes")]
    NoFreeLane { stream: String, lanes: u32 },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        Error::Io {
            context: context.into(),
            source: source.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, without the details: one kind per [`Error`] variant, and per peer
/// where the variant names one (an engine that died is not a client that died). For
/// bindings that map errors onto their own types (the Python exception classes, a C
/// ABI's error codes): `kind as usize` indexes [`ErrorKind::ALL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    NotFound,
    NameInUse,
    PermissionDenied,
    InvalidName,
    NotARegionFile,
    BadMagic,
    VersionMismatch,
    LayoutMismatch,
    RegionTooSmall,
    InvalidHeader,
    TensorOutOfBounds,
    InvalidTensor,
    InvalidSpec,
    NoSuchTensor,
    DTypeMismatch,
    WrongDirection,
    AlreadyBorrowed,
    AlreadyAttached,
    EngineDied,
    ClientDied,
    EngineClosed,
    ClientClosed,
    Timeout,
    Protocol,
    RecordTooLarge,
    BadMessage,
    NoCommandChannel,
    Remote,
    OutOfOrder,
    Interrupted,
    Closed,
    CudaUnavailable,
    Cuda,
    VulkanUnavailable,
    Vulkan,
    NotOnHost,
    NoSpace,
    CommandBacklog,
    NotPosted,
    NoDeviceSide,
    Io,
    Full,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 42] = [
        ErrorKind::NotFound,
        ErrorKind::NameInUse,
        ErrorKind::PermissionDenied,
        ErrorKind::InvalidName,
        ErrorKind::NotARegionFile,
        ErrorKind::BadMagic,
        ErrorKind::VersionMismatch,
        ErrorKind::LayoutMismatch,
        ErrorKind::RegionTooSmall,
        ErrorKind::InvalidHeader,
        ErrorKind::TensorOutOfBounds,
        ErrorKind::InvalidTensor,
        ErrorKind::InvalidSpec,
        ErrorKind::NoSuchTensor,
        ErrorKind::DTypeMismatch,
        ErrorKind::WrongDirection,
        ErrorKind::AlreadyBorrowed,
        ErrorKind::AlreadyAttached,
        ErrorKind::EngineDied,
        ErrorKind::ClientDied,
        ErrorKind::EngineClosed,
        ErrorKind::ClientClosed,
        ErrorKind::Timeout,
        ErrorKind::Protocol,
        ErrorKind::RecordTooLarge,
        ErrorKind::BadMessage,
        ErrorKind::NoCommandChannel,
        ErrorKind::Remote,
        ErrorKind::OutOfOrder,
        ErrorKind::Interrupted,
        ErrorKind::Closed,
        ErrorKind::CudaUnavailable,
        ErrorKind::Cuda,
        ErrorKind::VulkanUnavailable,
        ErrorKind::Vulkan,
        ErrorKind::NotOnHost,
        ErrorKind::NoSpace,
        ErrorKind::CommandBacklog,
        ErrorKind::NotPosted,
        ErrorKind::NoDeviceSide,
        ErrorKind::Io,
        ErrorKind::Full,
    ];
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::NameInUse { .. } => ErrorKind::NameInUse,
            Error::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            Error::InvalidName { .. } => ErrorKind::InvalidName,
            Error::NotARegionFile { .. } => ErrorKind::NotARegionFile,
            Error::BadMagic { .. } => ErrorKind::BadMagic,
            Error::VersionMismatch { .. } => ErrorKind::VersionMismatch,
            Error::LayoutMismatch { .. } => ErrorKind::LayoutMismatch,
            Error::RegionTooSmall { .. } => ErrorKind::RegionTooSmall,
            Error::InvalidHeader { .. } => ErrorKind::InvalidHeader,
            Error::TensorOutOfBounds { .. } => ErrorKind::TensorOutOfBounds,
            Error::InvalidTensor { .. } => ErrorKind::InvalidTensor,
            Error::InvalidSpec(_) => ErrorKind::InvalidSpec,
            Error::NoSuchTensor { .. } => ErrorKind::NoSuchTensor,
            Error::DTypeMismatch { .. } => ErrorKind::DTypeMismatch,
            Error::WrongDirection { .. } => ErrorKind::WrongDirection,
            Error::AlreadyBorrowed { .. } => ErrorKind::AlreadyBorrowed,
            Error::AlreadyAttached { .. } => ErrorKind::AlreadyAttached,
            Error::PeerDied {
                peer: Peer::Engine, ..
            } => ErrorKind::EngineDied,
            Error::PeerDied {
                peer: Peer::Client, ..
            } => ErrorKind::ClientDied,
            Error::PeerClosed { peer: Peer::Engine } => ErrorKind::EngineClosed,
            Error::ShardDied { .. } => ErrorKind::EngineDied,
            Error::ShardClosed { .. } => ErrorKind::EngineClosed,
            Error::ShardTaken { .. } => ErrorKind::AlreadyAttached,
            Error::PeerClosed { peer: Peer::Client } => ErrorKind::ClientClosed,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Protocol { .. } => ErrorKind::Protocol,
            Error::RecordTooLarge { .. } => ErrorKind::RecordTooLarge,
            Error::BadMessage(_) => ErrorKind::BadMessage,
            Error::NoCommandChannel { .. } => ErrorKind::NoCommandChannel,
            Error::Remote { .. } => ErrorKind::Remote,
            Error::OutOfOrder(_) | Error::NotInBatch { .. } => ErrorKind::OutOfOrder,
            Error::Interrupted => ErrorKind::Interrupted,
            Error::Closed(_) => ErrorKind::Closed,
            Error::CudaUnavailable { .. } => ErrorKind::CudaUnavailable,
            Error::Cuda { .. } => ErrorKind::Cuda,
            Error::VulkanUnavailable { .. } => ErrorKind::VulkanUnavailable,
            Error::Vulkan { .. } => ErrorKind::Vulkan,
            Error::NotOnHost { .. } => ErrorKind::NotOnHost,
            Error::NoSpace { .. } => ErrorKind::NoSpace,
            Error::CommandBacklog { .. } => ErrorKind::CommandBacklog,
            Error::NotPosted { .. } => ErrorKind::NotPosted,
            Error::NoDeviceSide(_) => ErrorKind::NoDeviceSide,
            Error::Io { .. } => ErrorKind::Io,
            Error::Full { .. } => ErrorKind::Full,
            Error::BadRecord { .. } => ErrorKind::Protocol,
            Error::SchemaMismatch { .. } => ErrorKind::LayoutMismatch,
            Error::NoFreeLane { .. } => ErrorKind::AlreadyAttached,
        }
    }
}

/// A byte count for messages, in MiB with one decimal (`21.7 MiB`).
struct Mib(u64);

impl std::fmt::Display for Mib {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.1} MiB", self.0 as f64 / (1u64 << 20) as f64)
    }
}

/// A duration for messages: whole milliseconds (`200ms`), or seconds to the millisecond
/// (`1.5s`), rather than `Debug`'s nanoseconds (`999.999439ms`).
struct Rounded(Duration);

impl std::fmt::Display for Rounded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = (self.0.as_secs_f64() * 1e3).round();
        if self.0 == Duration::MAX {
            f.write_str("forever")
        } else if self.0 < Duration::from_micros(500) {
            write!(f, "{}µs", self.0.as_micros())
        } else if ms < 1000.0 {
            write!(f, "{ms}ms")
        } else {
            let s = format!("{:.3}", ms / 1e3);
            write!(f, "{}s", s.trim_end_matches('0').trim_end_matches('.'))
        }
    }
}

#[cfg(all(test, not(loom)))]
mod rounded_tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        let r = |d: Duration| Rounded(d).to_string();
        assert_eq!(r(Duration::from_nanos(999_999_439)), "1s");
        assert_eq!(r(Duration::from_millis(200)), "200ms");
        assert_eq!(r(Duration::from_millis(1500)), "1.5s");
        assert_eq!(r(Duration::from_millis(30_000)), "30s");
        assert_eq!(r(Duration::from_micros(250)), "250µs");
        assert_eq!(r(Duration::MAX), "forever");
    }
}

#[cfg(all(test, not(loom)))]
mod kind_tests {
    use super::*;

    #[test]
    fn every_kind_is_listed_once_at_its_own_index() {
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
        assert_eq!(ErrorKind::ALL.len(), ErrorKind::Full as usize + 1);
    }

    #[test]
    fn peers_get_their_own_kinds() {
        let died = |peer| Error::PeerDied {
            peer,
            pid: 1,
            pid_ns: PidNamespace::This,
            hint: "",
        };
        assert_eq!(died(Peer::Engine).kind(), ErrorKind::EngineDied);
        assert_eq!(died(Peer::Client).kind(), ErrorKind::ClientDied);
        assert_eq!(
            Error::PeerClosed { peer: Peer::Client }.kind(),
            ErrorKind::ClientClosed
        );
        assert_eq!(Error::Closed(Peer::Engine).kind(), ErrorKind::Closed);
    }
}
