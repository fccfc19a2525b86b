//! A named shared-memory region: create (engine), open (client, tools), unlink, the
//! liveness of the parties serving it, and the sweep of regions whose engine is dead.
//!
//! # Liveness
//!
//! Every judgment of whether a peer lives goes through this module, and none rests on a
//! pid alone: a pid means another process (or none) in another PID namespace (a client in
//! a container), and pids are reused. Each party holds a lock on the region file that the
//! kernel drops when the party ends, however it ends:
//!
//! - the engine, an exclusive `flock` on the whole file, from before it writes the header
//!   until it exits (every version of the library takes it, so every sweep sees it). A
//!   region whose `flock` can be taken has no engine: [`Region::engine_gone`];
//! - an attached client (this version on), an OFD write lock on one byte of the file,
//!   [`client_lock_byte`] of the pid and start time it recorded in the client slot, so the
//!   engine reads where to look from the slot: [`Region::client_alive`]. A client of an
//!   earlier version holds none; for it, a pid and start time naming a live process here
//!   still count as alive.
//!
//! A name is removed only under the engine's lock (its owner, or whoever took the lock of
//! a dead engine), and only if it still names the very object judged (same device and
//! inode): a new engine may have taken the name meanwhile.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::control::{Control, ControlMapping, Stats};
use crate::error::{Error, PidNamespace, Result};
use crate::layout::{
    self, Header, HeaderBuilder, CONTROL_SIZE, DESC_SIZE, MAX_SHARDS, MAX_TENSORS,
    SHARD_ENTRY_SIZE, STATS_BLOCK_SIZE,
};
use crate::os;
use crate::sync::Backoff;

/// Every region name starts with this, so `ls` and `gc` can find them.
pub const PREFIX: &str = "shmbridge-";
/// The environment variable that names the region namespace of a process: with
/// `SHMBRIDGE_NAMESPACE=ns`, the names it makes are `shmbridge-ns-…`, and its sweep, `ls`
/// and `gc` look only at those (docs/protocol.md 1.1). Unset or empty: the default
/// namespace, `shmbridge-…`, whose sweep looks at every `shmbridge-*` name.
pub const NAMESPACE_ENV: &str = "SHMBRIDGE_NAMESPACE";
/// The longest namespace: a region name still fits a socket address (1.6, 95 bytes).
const MAX_NAMESPACE: usize = 40;
// The fd socket's path and the bytes of the ownership proofs (1.6) live in the control
// layer, where the device backends that use them see them too.
pub use crate::control::{
    client_lock_byte, socket_path, CLIENT_PROOF_BYTE, ENGINE_PROOF_BYTE, SOCKET_SUFFIX,
};
/// The most header bytes a snapshot copies: control block, a full tensor table and a
/// full shard table (1.4).
const MAX_HEADER: usize = CONTROL_SIZE + MAX_TENSORS * DESC_SIZE + MAX_SHARDS * SHARD_ENTRY_SIZE;
/// A region younger than this, not yet claimed by its engine, is left alone by the sweep:
/// its engine may be between `shm_open` and `flock`.
const CREATE_GRACE: Duration = Duration::from_secs(5);

/// The region namespace of this process ([`NAMESPACE_ENV`]), `None` for the default one.
pub fn namespace() -> Result<Option<String>> {
    namespace_from(std::env::var_os(NAMESPACE_ENV))
}

/// A namespace is 1..=40 characters from `[A-Za-z0-9_]`: no `-`, so no namespace's prefix
/// (`shmbridge-ns-`) is the start of another's. Empty is the default namespace.
fn namespace_from(value: Option<std::ffi::OsString>) -> Result<Option<String>> {
    const WHY: &str = "SHMBRIDGE_NAMESPACE: use 1..40 characters from [A-Za-z0-9_]";
    let Some(ns) = value else {
        return Ok(None);
    };
    let ns = ns.into_string().map_err(|ns| Error::InvalidName {
        name: ns.to_string_lossy().into_owned(),
        reason: WHY,
    })?;
    if ns.is_empty() {
        return Ok(None);
    }
    if ns.len() > MAX_NAMESPACE || !ns.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(Error::InvalidName {
            name: ns,
            reason: WHY,
        });
    }
    Ok(Some(ns))
}

/// What every name of this process's namespace starts with: `shmbridge-ns-`, or
/// [`PREFIX`] in the default namespace (which therefore holds every `shmbridge-*` name).
pub fn namespace_prefix() -> Result<String> {
    Ok(prefix_of(namespace()?.as_deref()))
}

fn prefix_of(namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("{PREFIX}{ns}-"),
        None => PREFIX.to_string(),
    }
}

/// Turns a user-given name into a region name: a name that starts with [`PREFIX`] is
/// whole already (an engine printed it; it reaches the region from any namespace); any
/// other gets this process's [`namespace_prefix`]. Checks the characters (the name
/// becomes a file in /dev/shm).
pub fn canonical_name(name: &str) -> Result<String> {
    canonical_name_in(name, &namespace_prefix()?)
}

fn canonical_name_in(name: &str, prefix: &str) -> Result<String> {
    let name = name.strip_prefix('/').unwrap_or(name);
    let (full, prefix_len) = if name.starts_with(PREFIX) {
        (name.to_string(), PREFIX.len())
    } else {
        (format!("{prefix}{name}"), prefix.len())
    };
    let ok = full.len() <= 200
        && full.len() > prefix_len
        && full
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if !ok {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "use 1..190 characters from [A-Za-z0-9._-]",
        });
    }
    if full.ends_with(SOCKET_SUFFIX) {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "names ending in .fd are the fd sockets' (`<region>.fd`)",
        });
    }
    Ok(full)
}

/// A fresh random name in this process's namespace: 128 bits, so two engines never
/// collide.
pub fn random_name() -> Result<String> {
    Ok(format!("{}{}", namespace_prefix()?, os::random_hex128()?))
}

/// A mapped region. Dropping it unmaps; the engine's handle also unlinks the name.
pub struct Region {
    name: String,
    /// Kept open: for the engine it carries the liveness `flock`. `None` for a second
    /// mapping (`map_again`), which must not keep the engine's lock alive.
    file: Option<File>,
    map: MmapRaw,
    /// (device, inode) of the object we mapped, to unlink only that one.
    identity: (u64, u64),
    owner: bool,
    /// The process that made this mapping: a child forked from it inherits the value
    /// and must not act for it (close, unlink) when it drops its copy.
    pid: u32,
    /// Where `os` keeps this mapping for forked children (`os::hold_mapping`).
    fork_slot: Option<usize>,
    /// The file's size once `check_size` found it shorter than the mapping, else
    /// `NOT_SHRUNK`. The bytes past the end are gone for good: every later check and
    /// step gives the same `RegionTooSmall` without touching the mapping.
    shrunk_to: AtomicU64,
    /// The engine's own descriptor of the region holding [`ENGINE_PROOF_BYTE`] (the
    /// creator's mapping and its second mappings; `None` for everyone else). It is what
    /// the fd socket hands the attached client as proof, and what a second mapping,
    /// which has no `file`, checks the size with.
    proof: Option<Arc<os::HeldFd>>,
    /// The last client [`Region::client_alive`] found alive by its lock while this PID
    /// namespace did not show its process (another namespace's): its pid names nothing
    /// here, which errors about it say.
    client_elsewhere: std::sync::Mutex<Option<(u32, u64)>>,
    /// The attached client's proof (1.8): a descriptor of its own holding the lock on
    /// [`CLIENT_PROOF_BYTE`], taken before it claims the slot of a region with Vulkan
    /// tensors and kept until it closes ([`Region::release_client_proof`]), so that
    /// nobody else can take that byte and pass for it on the fd socket meanwhile.
    held_proof: Option<os::HeldFd>,
}

const NOT_SHRUNK: u64 = u64::MAX;

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("name", &self.name)
            .field("len", &self.len())
            .field("owner", &self.owner)
            .finish()
    }
}

impl Region {
    /// Creates, sizes, pre-faults and initialises a region, then publishes its magic.
    /// Nothing is left behind if any step fails.
    pub fn create(name: &str, builder: &HeaderBuilder) -> Result<Region> {
        let region = Region::create_unpublished(name, builder)?;
        region.publish()?;
        Ok(region)
    }

    /// [`Region::create`] up to its publication: the name is this engine's (its lock
    /// held, its proof byte too), the header written with `magic` still 0, so no client
    /// trusts it yet. What must exist before a client can attach (the fd socket) is made
    /// now; then [`Region::publish`]. Dropping it removes the name.
    pub fn create_unpublished(name: &str, builder: &HeaderBuilder) -> Result<Region> {
        let file = create_name(name)?;
        // From here on, a failure must remove the name again.
        let guard = UnlinkOnDrop(name);
        // A sweep may hold the lock for a moment while it looks at the new file: wait.
        os::lock_exclusive(&file)?;
        let len = builder.header.region_size;
        os::reserve(&file, len).map_err(|e| match e {
            rustix::io::Errno::NOSPC | rustix::io::Errno::FBIG => {
                let (free, total) = os::shm_space().unwrap_or((0, 0));
                Error::NoSpace {
                    name: name.to_string(),
                    needed: len,
                    free,
                    total,
                }
            }
            e => Error::io(format!("reserving {len} bytes for '{name}'"), e),
        })?;
        let map = MmapOptions::new()
            .len(len as usize)
            .populate()
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mmap '{name}'"), e))?;
        let (_, dev, ino) = os::file_identity(&file)?;
        // The proof of ownership: a descriptor of its own (not a dup: locks belong to
        // the open file description) holding the engine's byte, before anyone can trust
        // the region. Someone of this user who opened the new file first and took the
        // byte makes the name unusable: refused, and removed by the guard.
        let proof = os::reopen(&file)?;
        if !os::try_lock_byte(&proof, ENGINE_PROOF_BYTE)? {
            return Err(Error::NameInUse {
                name: name.to_string(),
            });
        }
        let region = Region {
            name: name.to_string(),
            file: Some(file),
            map,
            identity: (dev, ino),
            owner: true,
            pid: os::current_pid(),
            fork_slot: None,
            shrunk_to: AtomicU64::new(NOT_SHRUNK),
            proof: Some(Arc::new(os::HeldFd::new(proof))),
            client_elsewhere: Default::default(),
            held_proof: None,
        }
        .held_in_parent_only(None, true);
        let bytes = builder.bytes();
        // SAFETY: the mapping is `len` bytes and `bytes.len() == header_size <= len`
        // (HeaderBuilder guarantees it). Nobody else can have mapped the object yet
        // past its magic check, since the magic is still zero.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.ptr(), bytes.len());
        }
        // From here on the region's drop removes the name (it is the owner).
        std::mem::forget(guard);
        Ok(region)
    }

    /// Publishes a region made by [`Region::create_unpublished`]: the engine's pid and
    /// start time, then `magic` (Release: everything written before happens-before any
    /// Acquire load that sees it).
    pub fn publish(&self) -> Result<()> {
        let pid = os::current_pid();
        let start = os::process_start_time(pid)
            .ok_or_else(|| Error::io("reading /proc/self/stat", std::io::ErrorKind::NotFound))?;
        self.control().publish_engine(pid, start);
        Ok(())
    }

    /// Opens an existing region and waits (up to `timeout`) until its engine has published
    /// the header. Returns the region and a validated snapshot of its layout.
    /// `interrupted` is consulted at each poll once the wait sleeps (about every
    /// millisecond): its error ends the wait.
    pub fn open(
        name: &str,
        timeout: Duration,
        mut interrupted: impl FnMut() -> Result<()>,
    ) -> Result<(Region, layout::Layout)> {
        // No deadline when it lies past what an Instant holds (a timeout of "forever").
        let deadline = Instant::now().checked_add(timeout);
        let expired = || deadline.is_some_and(|d| Instant::now() >= d);
        let mut backoff = Backoff::default();
        // The engine sizes the object right after creating it, before writing anything:
        // wait for the size, then map once and wait for the magic.
        let region = loop {
            match Region::map_existing(name, true) {
                Ok(r) => break r,
                Err(e @ Error::RegionTooSmall { .. }) if expired() => return Err(e),
                Err(Error::RegionTooSmall { .. }) => {
                    if backoff.sleeps() {
                        interrupted()?;
                    }
                    backoff.snooze()
                }
                Err(e) => return Err(e),
            }
        };
        while !region.control().is_published() {
            if expired() {
                return Err(Error::Timeout {
                    waited: timeout,
                    what: "the engine to publish the region header",
                });
            }
            if backoff.sleeps() {
                interrupted()?;
            }
            backoff.snooze();
        }
        let snapshot = region.snapshot();
        let layout = layout::validate(name, &snapshot, region.len() as u64)?;
        Ok((region, layout))
    }

    /// Opens region `name` for an observer (1.7): read-only, never a lock, never a
    /// mapping (an observer reads every byte with `pread`: a file that shrinks gives a
    /// short read, never a SIGBUS). The header is read, waiting up to `timeout` for the
    /// engine to publish it, and validated against the file's size. `NotFound` at once
    /// when nothing has the name.
    pub fn open_observer(name: &str, timeout: Duration) -> Result<(File, layout::Layout)> {
        let deadline = Instant::now().checked_add(timeout);
        let expired = || deadline.is_some_and(|d| Instant::now() >= d);
        let file = os::shm_open(name, false)?;
        let mut backoff = Backoff::default();
        let (bytes, size) = loop {
            let (bytes, size) = read_header_from(name, &file)?;
            let published = layout::read_header(&bytes).is_ok_and(|h| h.magic != 0);
            if published {
                break (bytes, size);
            }
            if expired() {
                return Err(match size < CONTROL_SIZE as u64 {
                    true => Error::RegionTooSmall {
                        needed: CONTROL_SIZE as u64,
                        actual: size,
                    },
                    false => Error::Timeout {
                        waited: timeout,
                        what: "the engine to publish the region header",
                    },
                });
            }
            backoff.snooze();
        };
        let layout = layout::validate(name, &bytes, size)?;
        Ok((file, layout))
    }

    /// The stats block at byte `offset` of the region (1.7), checked to lie inside the
    /// mapping and 8-aligned.
    pub fn stats_block(&self, offset: u64) -> Result<Stats<'_>> {
        let inside = offset % 8 == 0
            && offset
                .checked_add(STATS_BLOCK_SIZE as u64)
                .is_some_and(|end| end <= self.len() as u64);
        if !inside {
            return Err(Error::InvalidHeader {
                field: "stats_offset",
                reason: format!(
                    "a block at {offset} lies outside the {}-byte mapping",
                    self.len()
                ),
            });
        }
        // SAFETY: `offset..offset + STATS_BLOCK_SIZE` is inside the mapping (checked
        // above), whose base is page-aligned, so the block is 8-aligned; it stays mapped
        // while `self` is borrowed, which the view's lifetime cannot outlive. Both sides
        // access its words only atomically.
        let base = unsafe { self.ptr().add(offset as usize) };
        Ok(unsafe { Stats::new(NonNull::new(base).expect("inside a mapping")) })
    }

    /// Maps a region read-only; nothing is validated beyond the size. A mapping of a file
    /// that shrinks under it faults (SIGBUS) past the new end: tools that only look at
    /// the header read it with [`read_header_bytes`] instead.
    pub fn open_read_only(name: &str) -> Result<Region> {
        Region::map_existing(name, false)
    }

    /// Maps an existing object whole, if it is at least a control block long.
    fn map_existing(name: &str, writable: bool) -> Result<Region> {
        let file = os::shm_open(name, writable)?;
        let (size, _, _) = os::file_identity(&file)?;
        if size < CONTROL_SIZE as u64 {
            return Err(Error::RegionTooSmall {
                needed: CONTROL_SIZE as u64,
                actual: size,
            });
        }
        Region::map_file(name, file, size, writable)
    }

    /// Maps `len` bytes of the open object `file` (named `name`), never as its owner.
    fn map_file(name: &str, file: File, len: u64, writable: bool) -> Result<Region> {
        let (_, dev, ino) = os::file_identity(&file)?;
        let mut opts = MmapOptions::new();
        opts.len(len as usize);
        let map = if writable {
            opts.map_raw(&file)
        } else {
            opts.map_raw_read_only(&file)
        }
        .map_err(|e| Error::io(format!("mmap '{name}'"), e))?;
        Ok(Region {
            name: name.to_string(),
            file: Some(file),
            map,
            identity: (dev, ino),
            owner: false,
            pid: os::current_pid(),
            fork_slot: None,
            shrunk_to: AtomicU64::new(NOT_SHRUNK),
            proof: None,
            client_elsewhere: Default::default(),
            held_proof: None,
        }
        .held_in_parent_only(None, writable))
    }

    /// Registers this region's descriptor and mapping (made through `through`, or its
    /// own descriptor) with `os`, which releases them in children forked from this
    /// process: a child must not keep its parent's liveness lock.
    fn held_in_parent_only(mut self, through: Option<&File>, writable: bool) -> Region {
        if let Some(file) = &self.file {
            os::hold_in_parent_only(file);
        }
        if let Some(file) = through.or(self.file.as_ref()) {
            self.fork_slot = os::hold_mapping(file, self.ptr(), self.len(), writable);
        }
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The open descriptor of this mapping (not of a second one, `map_again`): what the
    /// liveness locks are taken on and queried through.
    pub(crate) fn file(&self) -> Result<&File> {
        self.file.as_ref().ok_or_else(|| {
            Error::io(
                format!("lock '{}'", self.name),
                std::io::Error::other("this mapping has no descriptor"),
            )
        })
    }

    /// Maps the same object a second time, read-write, through the open descriptor (not
    /// the name, which another engine may have taken meanwhile). The new mapping is never
    /// the owner: dropping it unmaps, nothing else. Views that must outlive the client or
    /// engine (DLPack capsules) hold one.
    pub fn map_again(&self) -> Result<Region> {
        let file = self.file.as_ref().ok_or_else(|| {
            Error::io(
                format!("map '{}' again", self.name),
                std::io::Error::other("this mapping has no descriptor"),
            )
        })?;
        let mut opts = MmapOptions::new();
        opts.len(self.len());
        let map = opts
            .map_raw(file)
            .map_err(|e| Error::io(format!("mmap '{}' again", self.name), e))?;
        Ok(Region {
            name: self.name.clone(),
            file: None,
            map,
            identity: self.identity,
            owner: false,
            pid: os::current_pid(),
            fork_slot: None,
            shrunk_to: AtomicU64::new(NOT_SHRUNK),
            proof: self.proof.clone(),
            client_elsewhere: Default::default(),
            held_proof: None,
        }
        .held_in_parent_only(Some(file), true))
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    #[inline]
    pub fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// A copy of the header bytes (control block and the largest possible table, or the
    /// whole region if smaller). Live fields may change while it is taken; a snapshot is
    /// validated before use and never written back.
    pub fn snapshot(&self) -> Vec<u8> {
        let n = self.len().min(MAX_HEADER);
        let mut out = vec![0u8; n];
        // SAFETY: `n <= len` of a live mapping. Concurrent writes by the peer only touch
        // live fields (plain integers), so the copy reads initialised bytes; a torn value
        // there is harmless because validation never relies on live fields.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(), out.as_mut_ptr(), n) };
        out
    }

    pub fn header(&self) -> Header {
        layout::read_header(&self.snapshot()).expect("a region is at least CONTROL_SIZE bytes")
    }

    /// The typed view of the live control block.
    #[inline]
    pub fn control(&self) -> Control<'_> {
        let base = NonNull::new(self.ptr()).expect("a mapping is never at address 0");
        // SAFETY: the mapping is page-aligned and at least CONTROL_SIZE long (checked by
        // every constructor) and stays mapped while `self` is borrowed, which the view's
        // lifetime cannot outlive. Both processes access its live fields only atomically.
        unsafe { Control::new(base) }
    }

    /// Removes the name from /dev/shm if it still refers to the object we mapped (a new
    /// engine may have taken the name since). Callers hold the engine's lock (the engine
    /// itself, or [`Region::engine_gone`] for a dead one), so no sweep acts on this
    /// object meanwhile: see [`unlink_if_same`].
    pub fn unlink_if_same(&self) {
        let _ = unlink_if_same(&self.name, self.identity);
    }

    /// `(device, inode)` of the object mapped.
    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// Whether this region's engine is gone: its `flock` is free (it exited, however it
    /// exited, or it never took it). If so, the name is removed, under that lock, if it
    /// still names this object, and the lock is let go. `false` while the engine lives,
    /// and for a second mapping (no descriptor to ask with). A sweep holding the lock
    /// for a moment reads as alive: the caller asks again at its next check.
    pub fn engine_gone(&self) -> Result<bool> {
        let Some(file) = &self.file else {
            return Ok(false);
        };
        if !os::try_lock_exclusive(file)? {
            return Ok(false);
        }
        self.unlink_if_same();
        os::unlock(file);
        Ok(true)
    }

    /// Whether the client recorded in the slot as `(pid, start_time)` lives. Seen here
    /// ([`os::process_seen`]), its state decides: running, or doomed (killed or exiting,
    /// though maybe still holding its lock). Not seen here (another PID namespace's
    /// client), its lock on this region decides ([`client_lock_byte`]), which it holds
    /// until it is gone.
    pub fn client_alive(&self, pid: u32, start_time: u64) -> bool {
        match os::process_seen(pid, start_time) {
            Some(running) => running,
            None => {
                let alive = self.own_fd().is_some_and(|f| {
                    // An error asking is no evidence of death.
                    os::byte_locked(f, client_lock_byte(pid, start_time)).unwrap_or(true)
                });
                if alive {
                    *self
                        .client_elsewhere
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some((pid, start_time));
                }
                alive
            }
        }
    }

    /// Which PID namespace the client recorded as `(pid, start_time)` lives in, as far
    /// as [`Region::client_alive`] saw it: another one if it was found alive while this
    /// namespace did not show it (a learner in another container), else this one.
    pub fn client_pid_namespace(&self, pid: u32, start_time: u64) -> PidNamespace {
        let elsewhere = *self
            .client_elsewhere
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if elsewhere == Some((pid, start_time)) {
            PidNamespace::Other
        } else {
            PidNamespace::This
        }
    }

    /// Takes the client lock of `(pid, start_time)` (the attaching client, before it
    /// claims the slot). `false` if another descriptor holds it: a child forked from an
    /// earlier client of this same process that kept the region open. The client then
    /// goes on without (its pid still vouches for it, as for an earlier version's).
    pub(crate) fn hold_client_lock(&self, pid: u32, start_time: u64) -> Result<bool> {
        let Some(f) = &self.file else {
            return Ok(false);
        };
        os::try_lock_byte(f, client_lock_byte(pid, start_time))
    }

    /// Takes the client's proof (1.8): a new descriptor of this region holding the lock
    /// on [`CLIENT_PROOF_BYTE`], kept until [`Region::release_client_proof`] (or the
    /// mapping goes). Before the slot is claimed: whoever holds the attached slot holds
    /// that byte, so nobody can take it after the claim and pass for this client.
    /// `false` when another open file description holds it: the attached client, or a
    /// process that took it without attaching (another client attaching at this moment,
    /// or a process of this user getting in the way).
    pub(crate) fn hold_client_proof(&mut self) -> Result<bool> {
        if self.held_proof.is_some() {
            return Ok(true);
        }
        let proof = os::reopen(self.file()?)?;
        if !os::try_lock_byte(&proof, CLIENT_PROOF_BYTE)? {
            return Ok(false);
        }
        self.held_proof = Some(os::HeldFd::new(proof));
        Ok(true)
    }

    /// Lets the client's proof go (the client closes): the next client may take it.
    pub(crate) fn release_client_proof(&mut self) {
        self.held_proof = None;
    }

    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// `RegionTooSmall` if the file is now shorter than this mapping: someone with the
    /// owner's rights truncated it, and touching the bytes past its end would SIGBUS.
    /// Callers check before each blocking wait (the slow path, never per step). What
    /// remains for a same-uid peer: a truncation between this check and an access of
    /// the mapping (the next frame read, the next counter load) still faults; a tmpfs
    /// file cannot be sealed against shrinking (only memfds can). Once found, the
    /// answer sticks (see [`Region::known_shrunk`]).
    pub fn check_size(&self) -> Result<()> {
        self.known_shrunk()?;
        let size = match (&self.file, &self.proof) {
            (Some(file), _) => os::file_identity(file)?.0,
            (None, Some(proof)) => os::file_identity(proof.as_fd())?.0,
            (None, None) => return Ok(()),
        };
        if size < self.len() as u64 {
            self.shrunk_to.store(size, Ordering::Relaxed);
            return Err(self.too_small(size));
        }
        Ok(())
    }

    /// `RegionTooSmall` if an earlier [`Region::check_size`] found the file truncated:
    /// one load, no system call, so the per-step paths can afford it and a second step
    /// after the error neither faults nor reports something else.
    pub fn known_shrunk(&self) -> Result<()> {
        match self.shrunk_to.load(Ordering::Relaxed) {
            NOT_SHRUNK => Ok(()),
            size => Err(self.too_small(size)),
        }
    }

    fn too_small(&self, actual: u64) -> Error {
        Error::RegionTooSmall {
            needed: self.len() as u64,
            actual,
        }
    }

    /// The engine's proof of ownership ([`ENGINE_PROOF_BYTE`]): what its fd socket hands
    /// the attached client. `None` but in the creator's own mappings.
    pub fn engine_proof(&self) -> Option<BorrowedFd<'_>> {
        self.proof.as_deref().map(AsFd::as_fd)
    }

    /// The client's proof for one exchange on the fd socket (1.8): a `dup` of the
    /// descriptor holding [`CLIENT_PROOF_BYTE`] (`Region::hold_client_proof`). Drop it
    /// once the exchange is over. `Err` when this mapping holds none.
    pub fn client_proof(&self) -> Result<os::HeldFd> {
        let held = self.held_proof.as_ref().ok_or_else(|| {
            Error::io(
                format!("the client's proof of region '{}'", self.name),
                std::io::Error::other("this mapping holds none (it is not an attached client's)"),
            )
        })?;
        let dup = held
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::io("dup of the client's proof", e))?;
        Ok(os::HeldFd::new(dup))
    }

    /// This mapping's own descriptor of the region: its file, or for a second mapping of
    /// the creator's, the engine's proof descriptor. What locks are queried through.
    fn own_fd(&self) -> Option<BorrowedFd<'_>> {
        match (&self.file, &self.proof) {
            (Some(file), _) => Some(file.as_fd()),
            (None, Some(proof)) => Some(proof.as_fd()),
            (None, None) => None,
        }
    }

    /// Whether `fd`, handed over by a peer, proves that its sender holds the lock on
    /// `byte` of this very region: `fd` is this region's file (same device and inode),
    /// someone holds `byte` (seen from this mapping's own descriptor, before and after),
    /// and that holder is `fd`'s open file description (a lock never conflicts with its
    /// own holder). Only the process that took the lock has that description, unless it
    /// handed it on. `Ok(Err(why not))` when it does not prove it.
    pub fn proves(&self, fd: BorrowedFd<'_>, byte: u64) -> Result<std::result::Result<(), String>> {
        let Some(own) = self.own_fd() else {
            return Err(Error::io(
                format!("checking a proof for '{}'", self.name),
                std::io::Error::other("this mapping has no descriptor"),
            ));
        };
        let (_, dev, ino) = os::file_identity(fd)?;
        if (dev, ino) != self.identity {
            return Ok(Err(format!(
                "it handed over another file than region '{}'",
                self.name
            )));
        }
        if !os::byte_locked(own, byte)? {
            return Ok(Err(
                "nobody holds the lock it would prove (its owner is gone)".into(),
            ));
        }
        if os::byte_locked(fd, byte)? {
            return Ok(Err("the lock is another process's".into()));
        }
        // Held before and after the look from `fd`, which saw no conflict: `fd` holds it
        // (unless the holder died and someone took the lock in between, who then owns
        // it).
        if !os::byte_locked(own, byte)? {
            return Ok(Err(
                "nobody holds the lock it would prove (its owner is gone)".into(),
            ));
        }
        Ok(Ok(()))
    }
}

/// The header bytes of region `name` (control block and the largest possible table, or
/// the whole file if shorter) and the file's size, read with `pread`, never through a
/// mapping: a file that shrinks while it is read gives a short read here (validation
/// then says `RegionTooSmall`), where a mapping would kill the reader with SIGBUS.
pub fn read_header_bytes(name: &str) -> Result<(Vec<u8>, u64)> {
    read_header_from(name, &os::shm_open(name, false)?)
}

/// [`read_header_bytes`] of an open region file.
fn read_header_from(name: &str, file: &File) -> Result<(Vec<u8>, u64)> {
    use std::os::unix::fs::FileExt;
    let (size, _, _) = os::file_identity(file)?;
    let mut out = vec![0u8; (size as usize).min(MAX_HEADER)];
    let mut filled = 0;
    while filled < out.len() {
        match file.read_at(&mut out[filled..], filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(format!("reading '{name}'"), e)),
        }
    }
    out.truncate(filled);
    Ok((out, size))
}

impl Region {
    /// Whether this process made this mapping (false in a child forked after it was
    /// made, which must leave the region to its parent).
    pub fn made_here(&self) -> bool {
        self.pid == os::current_pid()
    }
}

/// What a device backend sees of the region: its control words, a second mapping, and
/// whether this process made it (each the inherent method of the same name).
impl ControlMapping for Region {
    fn control(&self) -> Control<'_> {
        Region::control(self)
    }

    fn made_here(&self) -> bool {
        Region::made_here(self)
    }

    fn map_again(&self) -> Result<Box<dyn ControlMapping>> {
        Ok(Box::new(Region::map_again(self)?))
    }

    fn name(&self) -> &str {
        Region::name(self)
    }

    fn check_size(&self) -> Result<()> {
        Region::check_size(self)
    }

    fn engine_proof(&self) -> Option<BorrowedFd<'_>> {
        Region::engine_proof(self)
    }

    fn client_proof(&self) -> Result<os::HeldFd> {
        Region::client_proof(self)
    }

    fn proves(&self, fd: BorrowedFd<'_>, byte: u64) -> Result<std::result::Result<(), String>> {
        Region::proves(self, fd, byte)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.owner && self.made_here() {
            self.unlink_if_same();
        }
        if let Some(slot) = self.fork_slot {
            os::release_mapping(slot);
        }
        if let Some(file) = &self.file {
            os::release_held(file);
        }
    }
}

/// `shm_create(name)`; a name left by a dead engine is removed first ([`remove_if_dead`]).
/// A sweep may hold that engine's lock for a moment, so a name in use is asked about a
/// few more times (about 16 ms in all) before it is `NameInUse`.
fn create_name(name: &str) -> Result<File> {
    let mut backoff = Backoff::default();
    for _ in 0..80 {
        match os::shm_create(name) {
            Err(e @ Error::NameInUse { .. }) => match remove_if_dead(name).verdict {
                Verdict::Removed | Verdict::Changed | Verdict::OrphanSocket => {}
                // A live engine, or a sweep looking at a dead one for a moment.
                Verdict::Alive => backoff.snooze(),
                Verdict::Left(_) => return Err(e),
            },
            other => return other,
        }
    }
    os::shm_create(name)
}

struct UnlinkOnDrop<'a>(&'a str);
impl Drop for UnlinkOnDrop<'_> {
    fn drop(&mut self) {
        let _ = os::shm_unlink(self.0);
    }
}

/// Removes `name` if it names the object `identity`. Whoever calls this holds that
/// object's engine lock (its owner, or the judge of a dead engine), so no other caller
/// acts on the object at the same time. The window left: between the `stat` and the
/// `unlink`, something that takes no lock (a user's `rm`, a sweep of an earlier version)
/// could remove the name and a new engine create it again; the new one would then lose
/// its name (not its mapping). Every path of this version unlinks under the lock.
fn unlink_if_same(name: &str, identity: (u64, u64)) -> Result<bool> {
    if os::name_identity(name)? != Some(identity) {
        return Ok(false);
    }
    // The region's fd socket first (1.6): whoever may remove the region owns its socket
    // path, and no new engine can bind there before the region's name is free again.
    if let Ok(path) = socket_path(name) {
        let _ = os::remove_socket_file(&path);
    }
    os::shm_unlink(name)?;
    Ok(true)
}

impl Region {
    /// For an engine exiting without its `Engine` value (a signal handler), on a mapping
    /// of its own region ([`Region::map_again`], made while serving): marks the region
    /// closed, wakes a waiting client (it sees `PeerClosed`) and removes the name if it
    /// still names this object. Never by name alone: the name may have been removed and
    /// taken by another engine since, whose region must not be touched. The engine
    /// process still holds its lock (§ liveness).
    pub fn close_and_remove(&self) {
        self.control().close_engine();
        self.unlink_if_same();
    }
}

/// Names of the shmbridge regions of this process's namespace ([`namespace_prefix`]) in
/// /dev/shm, sorted.
pub fn list_names() -> Result<Vec<String>> {
    Ok(shm_names()?
        .into_iter()
        .filter(|n| !n.ends_with(SOCKET_SUFFIX))
        .collect())
}

/// Every name of this process's namespace in /dev/shm (regions and fd sockets), sorted.
fn shm_names() -> Result<Vec<String>> {
    let prefix = namespace_prefix()?;
    let dir = std::fs::read_dir(os::SHM_DIR).map_err(|e| Error::io("reading /dev/shm", e))?;
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    names.sort();
    Ok(names)
}

/// What a sweep did with one name in /dev/shm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swept {
    pub name: String,
    pub verdict: Verdict,
}

/// Why a sweep removed a name, or left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A region of this library whose engine is gone: removed.
    Removed,
    /// Its engine holds the region's lock (or another sweep holds it for a moment).
    Alive,
    /// The name was removed, or taken by another object, while the sweep looked at it.
    Changed,
    /// Left: what could not be proven, in words.
    Left(String),
    /// An fd socket file (`<region>.fd`) of this user whose region is gone and on which
    /// nobody listens (its region was removed by something that did not know of it):
    /// removed.
    OrphanSocket,
}

impl Swept {
    pub fn removed(&self) -> bool {
        matches!(self.verdict, Verdict::Removed | Verdict::OrphanSocket)
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Removed => f.write_str("its engine is dead"),
            Verdict::Alive => f.write_str(
                "its engine is alive (it holds the region's lock; or another sweep does)",
            ),
            Verdict::Changed => f.write_str("removed or replaced meanwhile"),
            Verdict::Left(why) => f.write_str(why),
            Verdict::OrphanSocket => {
                f.write_str("an fd socket whose region is gone, nobody listens on it")
            }
        }
    }
}

/// Whether the engine of region `name` lives: it holds the region's `flock` (for `ls`; a
/// dead engine's lock, taken to ask, is let go at once).
pub fn engine_alive(name: &str) -> Result<bool> {
    let file = os::shm_open(name, false)?;
    Ok(!os::try_lock_exclusive(&file)?)
}

/// Whether the header bytes `bytes` of a file `age` old prove it is a region this library
/// wrote: its magic, or (an engine that died before publishing it) the rest of a header
/// of this layout, older than the creation grace. `Err(why not)` otherwise.
fn identify(bytes: &[u8], age: Duration) -> std::result::Result<(), String> {
    let h = layout::read_header(bytes)
        .map_err(|_| format!("too short for a region header ({} bytes)", bytes.len()))?;
    if h.magic == layout::MAGIC {
        return Ok(());
    }
    let ours_unpublished = h.magic == 0
        && matches!(
            h.layout_hash,
            layout::LAYOUT_HASH | layout::LAYOUT_HASH_CUDA_SESSIONS
        )
        && h.version_major == layout::VERSION_MAJOR;
    match (ours_unpublished, age > CREATE_GRACE) {
        (true, true) => Ok(()),
        (true, false) => Err("being created (not published yet)".into()),
        (false, _) => Err(format!(
            "not a shmbridge region (magic {:#018x}): remove it yourself if nothing uses it",
            h.magic
        )),
    }
}

/// Removes `name` if it can prove it is a region whose engine is gone: a regular file of
/// the caller's ([`os::shm_open`]), the engine's `flock` free (never a pid), and a header
/// this library wrote ([`identify`], read with `pread` from the same descriptor); the name
/// is removed only if it still names that very object, while the lock is held
/// ([`unlink_if_same`]). Anything it cannot prove is left, with the reason.
fn remove_if_dead(name: &str) -> Swept {
    let verdict = (|| -> Result<Verdict> {
        let file = os::shm_open(name, false)?;
        if !os::try_lock_exclusive(&file)? {
            return Ok(Verdict::Alive);
        }
        // From here until `file` drops, the engine is known dead and no other sweep or
        // client acts on this object.
        let (_, dev, ino) = os::file_identity(&file)?;
        let (bytes, _) = read_header_from(name, &file)?;
        let age = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .unwrap_or_default();
        if let Err(why) = identify(&bytes, age) {
            return Ok(Verdict::Left(why));
        }
        Ok(match unlink_if_same(name, (dev, ino))? {
            true => Verdict::Removed,
            false => Verdict::Changed,
        })
    })();
    let verdict = verdict.unwrap_or_else(|e| match e {
        Error::NotFound { .. } => Verdict::Changed,
        Error::PermissionDenied { .. } => Verdict::Left("belongs to another user".into()),
        Error::NotARegionFile { what, .. } => Verdict::Left(format!("{what}, not a region file")),
        e => Verdict::Left(e.to_string()),
    });
    Swept {
        name: name.to_string(),
        verdict,
    }
}

/// Looks at every name of this process's namespace in /dev/shm (every `shmbridge-*` name
/// in the default namespace, `shmbridge-ns-*` in namespace `ns`): removes each region it can prove
/// belongs to a dead engine, and says why it left every other one (a live engine, a file
/// it cannot identify, another user's, a FIFO or link, one being created).
pub fn sweep_report() -> Result<Vec<Swept>> {
    let names = shm_names()?;
    let mut report: Vec<Swept> = names
        .iter()
        .filter(|n| !n.ends_with(SOCKET_SUFFIX))
        .map(|n| remove_if_dead(n))
        .collect();
    // Then the fd sockets whose region is gone (removed above, or long before by
    // something that did not know of them). A socket of a live region is its engine's.
    report.extend(names.iter().filter_map(|n| remove_orphan_socket(n)));
    Ok(report)
}

/// Removes `name` (`<region>.fd`) if it is a socket file of this user whose region does
/// not exist and on which nobody listens; says why it left it otherwise. `None` when it
/// is no socket's name or its region exists (the region's engine owns the path). The
/// window left: an engine that takes the region's name and replaces this stale socket
/// between the last look and the `unlink` (the looks before compare the socket's inode
/// and the region's absence).
fn remove_orphan_socket(name: &str) -> Option<Swept> {
    let region = name.strip_suffix(SOCKET_SUFFIX)?;
    if !matches!(os::name_identity(region), Ok(None)) {
        return None;
    }
    let path = format!("{}/{name}", os::SHM_DIR);
    let found = match os::socket_file(&path) {
        // Gone already (removed with its region by this sweep): nothing to say.
        Ok(os::AtPath::Nothing) => return None,
        found => found,
    };
    let verdict = (|| -> Result<Verdict> {
        let me = rustix::process::geteuid().as_raw();
        let (uid, dev, ino) = match found? {
            os::AtPath::Socket { uid, dev, ino } => (uid, dev, ino),
            os::AtPath::Other(what) => {
                return Ok(Verdict::Left(format!("{what}, not a socket")))
            }
            os::AtPath::Nothing => return Ok(Verdict::Changed),
        };
        if uid != me {
            return Ok(Verdict::Left("belongs to another user".into()));
        }
        if os::socket_listening(&path)? {
            return Ok(Verdict::Left(
                "a socket something listens on, with no region".into(),
            ));
        }
        let same = matches!(os::socket_file(&path)?, os::AtPath::Socket { dev: d, ino: i, .. } if (d, i) == (dev, ino));
        if !same || os::name_identity(region)?.is_some() {
            return Ok(Verdict::Changed);
        }
        match rustix::fs::unlink(path.as_str()) {
            Ok(()) => Ok(Verdict::OrphanSocket),
            Err(rustix::io::Errno::NOENT) => Ok(Verdict::Changed),
            Err(e) => Err(Error::io(format!("unlink('{path}')"), e)),
        }
    })()
    .unwrap_or_else(|e| Verdict::Left(e.to_string()));
    Some(Swept {
        name: name.to_string(),
        verdict,
    })
}

/// [`sweep_report`], returning the names removed.
pub fn sweep() -> Result<Vec<String>> {
    Ok(sweep_report()?
        .into_iter()
        .filter(Swept::removed)
        .map(|s| s.name)
        .collect())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn names_are_canonicalised_and_checked() {
        // In the default namespace.
        let canonical_name = |n: &str| canonical_name_in(n, PREFIX);
        assert_eq!(canonical_name("abc").unwrap(), "shmbridge-abc");
        assert_eq!(canonical_name("/shmbridge-abc").unwrap(), "shmbridge-abc");
        assert!(canonical_name("a/b").is_err());
        assert!(canonical_name("").is_err());
        assert!(canonical_name("shmbridge-").is_err());
        assert!(canonical_name(&"x".repeat(300)).is_err());
        let r = random_name().unwrap();
        assert_eq!(canonical_name(&r).unwrap(), r);
    }

    #[test]
    fn a_namespace_prefixes_short_names_and_leaves_whole_ones() {
        let ns = |v: &str| namespace_from(Some(v.into()));
        assert_eq!(ns("").unwrap(), None);
        assert_eq!(namespace_from(None).unwrap(), None);
        assert_eq!(ns("run_7").unwrap().as_deref(), Some("run_7"));
        for bad in ["a-b", "a/b", "a.b", &"x".repeat(41)] {
            assert!(matches!(ns(bad), Err(Error::InvalidName { .. })), "{bad:?}");
        }
        let p = prefix_of(Some("run_7"));
        assert_eq!(p, "shmbridge-run_7-");
        assert_eq!(prefix_of(None), PREFIX);
        assert_eq!(canonical_name_in("abc", &p).unwrap(), "shmbridge-run_7-abc");
        // A whole name (an engine printed it) reaches its region from any namespace.
        assert_eq!(
            canonical_name_in("shmbridge-other-abc", &p).unwrap(),
            "shmbridge-other-abc"
        );
        assert!(canonical_name_in("", &p).is_err());
    }
}
