//! The sweep: finds the regions of this process's namespace whose engine is dead and
//! removes them (and fd sockets left without their region), saying why it left every
//! other name; and what it shares with the region: removing a name only if it still
//! names the object judged, and reading a header without mapping it.

use std::fs::File;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::layout::{self, CONTROL_SIZE, DESC_SIZE, MAX_SHARDS, MAX_TENSORS, SHARD_ENTRY_SIZE};
use crate::os;

use super::name::namespace_prefix;
use crate::control::{socket_path, SOCKET_SUFFIX};

/// A region younger than this, not yet claimed by its engine, is left alone by the sweep:
/// its engine may be between `shm_open` and `flock`.
const CREATE_GRACE: Duration = Duration::from_secs(5);
/// The most header bytes a snapshot copies: control block, a full tensor table and a
/// full shard table (1.4).
pub(super) const MAX_HEADER: usize =
    CONTROL_SIZE + MAX_TENSORS * DESC_SIZE + MAX_SHARDS * SHARD_ENTRY_SIZE;

/// The header bytes of region `name` (control block and the largest possible table, or
/// the whole file if shorter) and the file's size, read with `pread`, never through a
/// mapping: a file that shrinks while it is read gives a short read here (validation
/// then says `RegionTooSmall`), where a mapping would kill the reader with SIGBUS.
pub fn read_header_bytes(name: &str) -> Result<(Vec<u8>, u64)> {
    read_header_from(name, &os::shm_open(name, false)?)
}

/// [`read_header_bytes`] of an open region file.
pub(super) fn read_header_from(name: &str, file: &File) -> Result<(Vec<u8>, u64)> {
    let (size, _, _) = os::file_identity(file)?;
    let mut out = vec![0u8; (size as usize).min(MAX_HEADER)];
    let filled =
        os::read_at(file, 0, &mut out).map_err(|e| Error::io(format!("reading '{name}'"), e))?;
    out.truncate(filled);
    Ok((out, size))
}

/// Removes `name` if it names the object `identity`. Whoever calls this holds that
/// object's engine lock (its owner, or the judge of a dead engine), so no other caller
/// acts on the object at the same time. The window left: between the `stat` and the
/// `unlink`, something that takes no lock (a user's `rm`, a sweep of an earlier version)
/// could remove the name and a new engine create it again; the new one would then lose
/// its name (not its mapping). Every path of this version unlinks under the lock.
pub(super) fn unlink_if_same(name: &str, identity: (u64, u64)) -> Result<bool> {
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
    os::shm_names(&namespace_prefix()?)
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
    // A trajectory stream (1.11): its consumers hold a shared lock, so a free lock means
    // none is left.
    if layout::stream::is_stream(bytes) {
        return match (layout::stream::stream_published(bytes), age > CREATE_GRACE) {
            (true, _) | (false, true) => Ok(()),
            (false, false) => Err("a stream being created (not published yet)".into()),
        };
    }
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
pub(super) fn remove_if_dead(name: &str) -> Swept {
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
        let me = os::euid();
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
        Ok(match os::unlink(&path)? {
            true => Verdict::OrphanSocket,
            false => Verdict::Changed,
        })
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
