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
//!
//! Naming and namespaces are in `name.rs`, the sweep in `sweep.rs`; both are re-exported
//! here.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use crate::control::{Control, ControlMapping, Stats};
use crate::error::{Error, PidNamespace, Result};
use crate::layout::{self, Header, HeaderBuilder, CONTROL_SIZE, STATS_BLOCK_SIZE};
use crate::os;
use crate::sync::Backoff;

// The fd socket's path and the bytes of the ownership proofs (1.6) live in the control
// layer, where the device backends that use them see them too.
pub use crate::control::{
    client_lock_byte, socket_path, CLIENT_PROOF_BYTE, ENGINE_PROOF_BYTE, SOCKET_SUFFIX,
};

mod name;
mod sweep;

pub use name::{canonical_name, namespace, namespace_prefix, random_name, NAMESPACE_ENV, PREFIX};
pub use sweep::{engine_alive, list_names, read_header_bytes, sweep, sweep_report, Swept, Verdict};
use sweep::{read_header_from, remove_if_dead, unlink_if_same, MAX_HEADER};

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
        os::reserve(&file, name, len)?;
        let map = os::map_shared(&file, len as usize, os::MapAccess::Prefaulted)
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
        let access = match writable {
            true => os::MapAccess::ReadWrite,
            false => os::MapAccess::ReadOnly,
        };
        let map = os::map_shared(&file, len as usize, access)
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
        let map = os::map_shared(file, self.len(), os::MapAccess::ReadWrite)
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
