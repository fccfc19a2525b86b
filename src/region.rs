//! A named shared-memory region: create (engine), open (client, tools), unlink, and the
//! sweep of regions whose engine is dead.
//!
//! The engine holds an exclusive `flock` on its region for as long as it lives. The kernel
//! releases it when the engine exits in any way, so a sweep that can take the lock knows
//! the engine is gone, with no pid-reuse race.

use std::fs::File;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::control::Control;
use crate::error::{Error, Result};
use crate::layout::{self, Header, HeaderBuilder, CONTROL_SIZE, DESC_SIZE, MAX_TENSORS};
use crate::os;
use crate::sync::Backoff;

/// Every region name starts with this, so `ls` and `gc` can find them.
pub const PREFIX: &str = "shmbridge-";
/// The most header bytes a snapshot copies: control block + a full tensor table.
const MAX_HEADER: usize = CONTROL_SIZE + MAX_TENSORS * DESC_SIZE;
/// A region younger than this, not yet claimed by its engine, is left alone by the sweep:
/// its engine may be between `shm_open` and `flock`.
const CREATE_GRACE: Duration = Duration::from_secs(5);

/// Turns a user-given name into a region name: adds [`PREFIX`] if missing and checks the
/// characters (the name becomes a file in /dev/shm).
pub fn canonical_name(name: &str) -> Result<String> {
    let name = name.strip_prefix('/').unwrap_or(name);
    let full = if name.starts_with(PREFIX) {
        name.to_string()
    } else {
        format!("{PREFIX}{name}")
    };
    let ok = full.len() <= 200
        && full.len() > PREFIX.len()
        && full
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if !ok {
        return Err(Error::InvalidName {
            name: name.to_string(),
            reason: "use 1..190 characters from [A-Za-z0-9._-]",
        });
    }
    Ok(full)
}

/// A fresh random name: 128 bits, so two engines never collide.
pub fn random_name() -> Result<String> {
    Ok(format!("{PREFIX}{}", os::random_hex128()?))
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
}

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
        let file = os::shm_create(name)?;
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
        let region = Region {
            name: name.to_string(),
            file: Some(file),
            map,
            identity: (dev, ino),
            owner: true,
        };
        let bytes = builder.bytes();
        // SAFETY: the mapping is `len` bytes and `bytes.len() == header_size <= len`
        // (HeaderBuilder guarantees it). Nobody else can have mapped the object yet
        // past its magic check, since the magic is still zero.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.ptr(), bytes.len());
        }
        let pid = os::current_pid();
        let start = os::process_start_time(pid)
            .ok_or_else(|| Error::io("reading /proc/self/stat", std::io::ErrorKind::NotFound))?;
        // Publish: everything above happens-before any Acquire load that sees the magic.
        region.control().publish_engine(pid, start);
        std::mem::forget(guard);
        Ok(region)
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
                Err(e @ Error::RegionTooSmall { .. }) if expired() => {
                    return Err(e)
                }
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

    /// Maps a region read-only; nothing is validated beyond the size. A mapping of a file
    /// that shrinks under it faults (SIGBUS) past the new end: tools that only look at
    /// the header read it with [`read_header_bytes`] instead.
    pub fn open_read_only(name: &str) -> Result<Region> {
        Region::map_existing(name, false)
    }

    /// Maps an existing object whole, if it is at least a control block long.
    fn map_existing(name: &str, writable: bool) -> Result<Region> {
        let file = os::shm_open(name, writable)?;
        let (size, dev, ino) = os::file_identity(&file)?;
        if size < CONTROL_SIZE as u64 {
            return Err(Error::RegionTooSmall {
                needed: CONTROL_SIZE as u64,
                actual: size,
            });
        }
        let mut opts = MmapOptions::new();
        opts.len(size as usize);
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
        })
    }

    pub fn name(&self) -> &str {
        &self.name
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
        })
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
    /// engine may have taken the name since).
    pub fn unlink_if_same(&self) {
        if let Ok(f) = os::shm_open(&self.name, false) {
            if let Ok((_, dev, ino)) = os::file_identity(&f) {
                if (dev, ino) == self.identity {
                    let _ = os::shm_unlink(&self.name);
                }
            }
        }
    }

    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// `RegionTooSmall` if the file is now shorter than this mapping: someone with the
    /// owner's rights truncated it, and touching the bytes past its end would SIGBUS.
    /// Callers check before each blocking wait (the slow path, never per step). What
    /// remains for a same-uid peer: a truncation between this check and an access of
    /// the mapping (the next frame read, the next counter load) still faults; a tmpfs
    /// file cannot be sealed against shrinking (only memfds can).
    pub fn check_size(&self) -> Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let (size, _, _) = os::file_identity(file)?;
        if size < self.len() as u64 {
            return Err(Error::RegionTooSmall {
                needed: self.len() as u64,
                actual: size,
            });
        }
        Ok(())
    }
}

/// The header bytes of region `name` (control block and the largest possible table, or
/// the whole file if shorter) and the file's size, read with `pread`, never through a
/// mapping: a file that shrinks while it is read gives a short read here (validation
/// then says `RegionTooSmall`), where a mapping would kill the reader with SIGBUS.
pub fn read_header_bytes(name: &str) -> Result<(Vec<u8>, u64)> {
    use std::os::unix::fs::FileExt;
    let file = os::shm_open(name, false)?;
    let (size, _, _) = os::file_identity(&file)?;
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

impl Drop for Region {
    fn drop(&mut self) {
        if self.owner {
            self.unlink_if_same();
        }
    }
}

struct UnlinkOnDrop<'a>(&'a str);
impl Drop for UnlinkOnDrop<'_> {
    fn drop(&mut self) {
        let _ = os::shm_unlink(self.0);
    }
}

/// For an engine that is exiting without its `Engine` value (a signal handler): marks the
/// region closed, wakes a waiting client (it sees `PeerClosed`) and removes the name.
pub fn close_and_remove(name: &str) -> Result<()> {
    let region = Region::map_existing(name, true)?;
    region.control().close_engine();
    region.unlink_if_same();
    Ok(())
}

/// Names of all shmbridge regions in /dev/shm, sorted.
pub fn list_names() -> Result<Vec<String>> {
    let dir = std::fs::read_dir(os::SHM_DIR).map_err(|e| Error::io("reading /dev/shm", e))?;
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(PREFIX))
        .collect();
    names.sort();
    Ok(names)
}

/// Whether the engine of this region is gone: its lock is free and it had claimed it
/// (magic or pid written), or it never claimed it and the file is older than the grace.
fn engine_is_gone(name: &str) -> Result<bool> {
    let file = os::shm_open(name, false)?;
    if !os::try_lock_exclusive(&file)? {
        return Ok(false);
    }
    let (size, _, _) = os::file_identity(&file)?;
    let claimed = size >= CONTROL_SIZE as u64 && {
        let (bytes, _) = read_header_bytes(name)?;
        layout::read_header(&bytes).is_ok_and(|h| h.magic != 0 || h.engine_pid != 0)
    };
    if claimed {
        return Ok(true);
    }
    let age = file
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .unwrap_or_default();
    Ok(age > CREATE_GRACE)
}

/// Removes every region whose engine is gone. Returns the names removed. Regions of
/// other users (permission denied) and live ones are left alone.
pub fn sweep() -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for name in list_names()? {
        if let Ok(true) = engine_is_gone(&name) {
            if os::shm_unlink(&name).is_ok() {
                removed.push(name);
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_canonicalised_and_checked() {
        assert_eq!(canonical_name("abc").unwrap(), "shmbridge-abc");
        assert_eq!(canonical_name("/shmbridge-abc").unwrap(), "shmbridge-abc");
        assert!(canonical_name("a/b").is_err());
        assert!(canonical_name("").is_err());
        assert!(canonical_name("shmbridge-").is_err());
        assert!(canonical_name(&"x".repeat(300)).is_err());
        let r = random_name().unwrap();
        assert_eq!(canonical_name(&r).unwrap(), r);
    }
}
