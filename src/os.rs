//! The OS layer: POSIX shm, mapping, flock and byte locks, futex, file and descriptor
//! checks, `poll`, process liveness. The library's own system calls are made here, through
//! rustix where it has them (libc for what it lacks: OFD byte locks, the fork handler's
//! calls, `SO_PEERCRED` into a plain `ucred`, `_exit`), so the rest stays free of OS
//! details. What is made elsewhere, and why:
//!
//! - `fdpass`: the Unix-socket calls of fd passing (`socket`, `bind`, `listen`, `accept`,
//!   `connect`, `sendmsg`/`recvmsg` with `SCM_RIGHTS`, the timeouts), through rustix: the
//!   socket half of this layer, a module of its own at the same layer for one protocol;
//! - the device drivers' APIs (the CUDA driver, loaded with `libloading`, and Vulkan,
//!   through `ash`): calls into the drivers, which make their own system calls; the fds
//!   they hand over are handled here (`set_cloexec`, `fd_size`, ...);
//! - what `std` and well-kept crates do portably: threads, `std::process::Command` (its
//!   `pre_exec` calls this module), reading files by path (`std::fs`), signal handling
//!   (`signal_hook`, in `envs::runner`);
//! - tests, which build their fixtures (`fork`, `unshare`, memfds) with rustix or libc.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicUsize};
use std::time::Duration;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{FlockOperation, Mode};
use rustix::io::Errno;
use rustix::shm::OFlags;
use rustix::thread::futex;

use crate::error::{Error, PidNamespace, Result};

/// Where POSIX shm names appear as files (Linux).
pub const SHM_DIR: &str = "/dev/shm";

fn map_open_err(name: &str, e: Errno) -> Error {
    match e {
        Errno::NOENT => Error::NotFound { name: name.into() },
        Errno::EXIST => Error::NameInUse { name: name.into() },
        Errno::ACCESS | Errno::PERM => Error::PermissionDenied { name: name.into() },
        Errno::NAMETOOLONG | Errno::INVAL => Error::InvalidName {
            name: name.into(),
            reason: "rejected by shm_open",
        },
        e => Error::io(format!("shm_open('{name}')"), e),
    }
}

/// Creates a new shm object: `O_CREAT|O_EXCL`, mode 0600.
pub fn shm_create(name: &str) -> Result<File> {
    let fd = rustix::shm::open(
        name,
        OFlags::CREATE | OFlags::EXCL | OFlags::RDWR,
        Mode::RUSR | Mode::WUSR,
    )
    .map_err(|e| map_open_err(name, e))?;
    Ok(File::from(fd))
}

/// Opens an existing shm object, refusing what a region cannot be: anything but a
/// regular file (a FIFO would block `open` forever, a symlink could point anywhere, so
/// neither is followed or waited on: `O_NOFOLLOW | O_NONBLOCK`), and a file another user
/// owns (`PermissionDenied`, even for root). `/dev/shm` is world-writable: any local user
/// can plant a file with a region's name.
pub fn shm_open(name: &str, writable: bool) -> Result<File> {
    use rustix::fs::{FileType, OFlags as F};
    let access = if writable { F::RDWR } else { F::RDONLY };
    let path = format!("{SHM_DIR}/{}", name.trim_start_matches('/'));
    let fd: OwnedFd = rustix::fs::open(
        path.as_str(),
        access | F::NOFOLLOW | F::NONBLOCK | F::CLOEXEC | F::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| match e {
        Errno::LOOP => not_a_region(name, "a symbolic link"),
        Errno::ISDIR => not_a_region(name, "a directory"),
        Errno::NXIO => not_a_region(name, "a FIFO or a socket"),
        e => map_open_err(name, e),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::io(format!("fstat('{name}')"), e))?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Fifo => return Err(not_a_region(name, "a FIFO")),
        FileType::Directory => return Err(not_a_region(name, "a directory")),
        FileType::Socket => return Err(not_a_region(name, "a socket")),
        FileType::CharacterDevice | FileType::BlockDevice => {
            return Err(not_a_region(name, "a device node"))
        }
        _ => return Err(not_a_region(name, "not a regular file")),
    }
    if st.st_uid != euid() {
        return Err(Error::PermissionDenied { name: name.into() });
    }
    Ok(File::from(fd))
}

fn not_a_region(name: &str, what: &'static str) -> Error {
    Error::NotARegionFile {
        name: name.into(),
        what,
    }
}

pub fn shm_unlink(name: &str) -> Result<()> {
    rustix::shm::unlink(name).map_err(|e| map_open_err(name, e))
}

/// (size, device, inode) of an open file. Safe on a descriptor from another process:
/// `statx` with `AT_STATX_DONT_SYNC` answers from what the kernel has cached, so a file
/// on a network or FUSE filesystem (whose server may be the peer, and never answer) is
/// not asked; `fstat` (which may ask) only where `statx` is missing (before Linux 4.11,
/// or a seccomp filter that refuses it). Device numbers as `fstat` gives them.
pub fn file_identity(file: impl AsFd) -> Result<(u64, u64, u64)> {
    use rustix::fs::{AtFlags, StatxFlags};
    let file = file.as_fd();
    match rustix::fs::statx(
        file,
        "",
        AtFlags::EMPTY_PATH | AtFlags::STATX_DONT_SYNC,
        StatxFlags::SIZE | StatxFlags::INO,
    ) {
        Ok(st) => Ok((
            st.stx_size,
            rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor),
            st.stx_ino,
        )),
        Err(Errno::NOSYS) | Err(Errno::PERM) => {
            let st = rustix::fs::fstat(file).map_err(|e| Error::io("fstat", e))?;
            Ok((st.st_size as u64, st.st_dev, st.st_ino))
        }
        Err(e) => Err(Error::io("statx", e)),
    }
}

/// What the closer of untrusted descriptors is asked to do.
enum Reap {
    Close(OwnedFd),
    /// Answer once everything sent before is closed.
    Flush(std::sync::mpsc::Sender<()>),
}

/// The closer of untrusted descriptors: its process (a forked child has no such thread)
/// and its queue; `None` if the thread could not be started.
static REAPER: std::sync::OnceLock<Option<(u32, std::sync::mpsc::Sender<Reap>)>> =
    std::sync::OnceLock::new();

/// Closes `fd`, which came from another process, without ever making the caller wait.
/// Closing may block for as long as the sender chooses: a TCP socket with unsent data
/// and `SO_LINGER` set waits out its linger time, the last close of a file on FUSE asks
/// the filesystem's server (`FLUSH`), which may be the sender and never answer. So the
/// close happens on a thread of its own (started on first use), and a socket gets
/// `SO_LINGER {on, 0}` first (its close then resets the connection at once: nothing
/// waits). What remains: a close that blocks for good (FUSE) holds up the closes queued
/// behind it, whose descriptors then stay open. In a child forked from the process that
/// started the thread, or if it could not be started, the close happens here.
pub fn close_untrusted(fd: OwnedFd) {
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Reap>();
        std::thread::Builder::new()
            .name("shmbridge-close".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        Reap::Close(fd) => close_now(fd),
                        Reap::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })
            .ok()
            .map(|_| (current_pid(), tx))
    });
    match reaper {
        Some((pid, tx)) if *pid == current_pid() => {
            if let Err(std::sync::mpsc::SendError(Reap::Close(fd))) = tx.send(Reap::Close(fd)) {
                close_now(fd);
            }
        }
        _ => close_now(fd),
    }
}

/// Closes an untrusted `fd` here: a socket with `SO_LINGER {on, 0}` first.
fn close_now(fd: OwnedFd) {
    if rustix::net::sockopt::socket_type(&fd).is_ok() {
        let _ = rustix::net::sockopt::set_socket_linger(&fd, Some(Duration::ZERO));
    }
    drop(fd);
}

/// Waits (at most `timeout`) until every descriptor handed to [`close_untrusted`] so far
/// is closed; whether they are. For tests that count this process's descriptors.
pub fn untrusted_closed(timeout: Duration) -> bool {
    match REAPER.get() {
        Some(Some((pid, tx))) if *pid == current_pid() => {
            let (done, wait) = std::sync::mpsc::channel();
            tx.send(Reap::Flush(done)).is_ok() && wait.recv_timeout(timeout).is_ok()
        }
        _ => true,
    }
}

/// Where a mapping of this process that contains address `addr` comes from, as
/// `/proc/self/maps` says: `(file offset of addr, st_dev, st_ino)` of the file mapped
/// there; `None` when no file mapping contains it (or /proc is not mounted).
#[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
pub fn mapped_file_at(addr: usize) -> Option<(u64, u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    for line in maps.lines() {
        // start-end perms offset major:minor inode [path]
        let mut f = line.split_ascii_whitespace();
        let (range, _perms, offset, dev, inode) =
            (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
        let (start, end) = range.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        if !(start..end).contains(&addr) {
            continue;
        }
        let offset = u64::from_str_radix(offset, 16).ok()?;
        let (major, minor) = dev.split_once(':')?;
        let dev = rustix::fs::makedev(
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        );
        let inode: u64 = inode.parse().ok()?;
        return (inode != 0).then(|| (offset + (addr - start) as u64, dev, inode));
    }
    None
}

/// What `fstat` (and `fcntl(F_GETFL)`) say of an fd another party hands over as
/// exported device memory or a semaphore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdKind {
    /// A regular file: a memfd or an unlinked file (`named` false), or a file with a name
    /// in a filesystem (`named`: `st_nlink > 0`).
    File { named: bool },
    /// A file of no type (`S_IFMT` 0): an anonymous inode (eventfd, a DRM sync object) or
    /// a pseudo-filesystem's (a dma-buf).
    Anonymous,
    /// A character device: a terminal, one of the kernel's memory devices (major 1:
    /// `/dev/null`, `/dev/zero`, `/dev/mem`...), or another (a driver's device node).
    CharDevice { terminal: bool, memory: bool },
    /// A socket, a pipe or FIFO, a directory, a block device, a symbolic link, or an
    /// `O_PATH` descriptor (usable for nothing but its path): no exported object is one.
    Other(&'static str),
}

/// The kind of `fd` and its `st_size` (meaningful for regular files and a dma-buf; 0 for
/// most anonymous inodes and devices).
pub fn fd_kind(fd: BorrowedFd<'_>) -> Result<(FdKind, u64)> {
    use rustix::fs::FileType;
    use std::io::IsTerminal;
    let st = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat", e))?;
    let flags = rustix::fs::fcntl_getfl(fd).map_err(|e| Error::io("fcntl(F_GETFL)", e))?;
    let kind = if flags.contains(rustix::fs::OFlags::PATH) {
        FdKind::Other("an O_PATH descriptor")
    } else {
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => FdKind::File {
                named: st.st_nlink > 0,
            },
            FileType::CharacterDevice => FdKind::CharDevice {
                terminal: fd.is_terminal(),
                memory: rustix::fs::major(st.st_rdev) == 1,
            },
            FileType::Socket => FdKind::Other("a socket"),
            FileType::Fifo => FdKind::Other("a pipe or FIFO"),
            FileType::Directory => FdKind::Other("a directory"),
            FileType::BlockDevice => FdKind::Other("a block device"),
            FileType::Symlink => FdKind::Other("a symbolic link"),
            FileType::Unknown => FdKind::Anonymous,
        }
    };
    Ok((kind, st.st_size as u64))
}

/// Sizes a new shm object to `len` bytes and reserves them: `posix_fallocate` charges
/// every page to the tmpfs now, so a region that does not fit is refused here. After
/// a bare `ftruncate` the file would be sparse, and the first write past the free space
/// (`MAP_POPULATE` does not reserve either) would kill the process with SIGBUS. `NoSpace`
/// (with the space there is) when they do not fit; `name` is the object's, for errors.
pub fn reserve(file: &File, name: &str, len: u64) -> Result<()> {
    let reserved = loop {
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
            // A signal arrived while the kernel was allocating: what it allocated stays,
            // so asking again finishes the job.
            Err(Errno::INTR) => continue,
            // A filesystem without fallocate (not tmpfs): size it the old way.
            Err(Errno::OPNOTSUPP) => break rustix::fs::ftruncate(file, len),
            other => break other,
        }
    };
    reserved.map_err(|e| match e {
        Errno::NOSPC | Errno::FBIG => {
            let (free, total) = shm_space().unwrap_or((0, 0));
            Error::NoSpace {
                name: name.to_string(),
                needed: len,
                free,
                total,
            }
        }
        e => Error::io(format!("reserving {len} bytes for '{name}'"), e),
    })
}

/// `(free, total)` bytes of the filesystem holding shm objects (`/dev/shm`), for messages.
pub fn shm_space() -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(SHM_DIR).ok()?;
    Some((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// Takes an exclusive `flock` without blocking; `Ok(false)` if someone else holds it.
/// The engine holds one on its region for its whole life: the kernel drops it when the
/// engine dies, however it dies, so "lock free" means "engine gone".
pub fn try_lock_exclusive(file: &File) -> Result<bool> {
    match rustix::fs::flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(Errno::WOULDBLOCK) => Ok(false),
        Err(e) => Err(Error::io("flock", e)),
    }
}

/// Takes an exclusive `flock`, waiting if a sweep holds it for a moment.
pub fn lock_exclusive(file: &File) -> Result<()> {
    rustix::fs::flock(file, FlockOperation::LockExclusive).map_err(|e| Error::io("flock", e))
}

/// Takes a shared `flock` (a stream's consumers, each one), waiting if a sweep holds the
/// exclusive one for a moment.
pub fn lock_shared(file: &File) -> Result<()> {
    rustix::fs::flock(file, FlockOperation::LockShared).map_err(|e| Error::io("flock", e))
}

/// Drops a `flock` this descriptor holds.
pub fn unlock(file: &File) {
    let _ = rustix::fs::flock(file, FlockOperation::Unlock);
}

/// `(device, inode)` of what `name` in /dev/shm is now (a link itself, not its target);
/// `None` if the name does not exist.
pub fn name_identity(name: &str) -> Result<Option<(u64, u64)>> {
    let path = format!("{SHM_DIR}/{}", name.trim_start_matches('/'));
    match rustix::fs::statat(
        rustix::fs::CWD,
        path.as_str(),
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    ) {
        Ok(st) => Ok(Some((st.st_dev, st.st_ino))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(Error::io(format!("stat('{name}')"), e)),
    }
}

/// An open-file-description write lock on byte `index` of `file`, as `fcntl(F_OFD_*)`
/// takes it: owned by the open file description (not the process), released by the
/// kernel when nothing refers to it any more (no descriptor, no mapping made through
/// it), however the process ends, and independent of `flock` locks on the same file. A
/// shard of a sharded region (1.4) holds the one on its index for its whole life: its
/// liveness token, as the `flock` is the creator's; an attached client holds one at
/// `control::client_lock_byte` (at or above 2^61, far from any shard index).
fn ofd_lock(file: impl AsFd, index: u64, cmd: libc::c_int) -> std::io::Result<libc::flock> {
    ofd_lock_as(file, index, cmd, libc::F_WRLCK)
}

/// [`ofd_lock`] with the lock's type: `F_WRLCK`, `F_RDLCK` (shared: held by any number of
/// descriptions at once, never with a write lock) or `F_UNLCK`.
fn ofd_lock_as(
    file: impl AsFd,
    index: u64,
    cmd: libc::c_int,
    l_type: libc::c_int,
) -> std::io::Result<libc::flock> {
    use std::os::fd::AsRawFd;
    let file = file.as_fd();
    // SAFETY: `flock` is plain data; all-zero is a valid value of it.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = l_type as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = index as libc::off_t;
    lock.l_len = 1;
    // SAFETY: `file` is an open descriptor for the whole call; `lock` is a valid,
    // initialised `struct flock` the kernel reads (and for F_OFD_GETLK writes); l_pid is
    // 0 as OFD commands require.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut lock as *mut libc::flock) };
    if rc == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(lock)
}

/// Takes the write lock on byte `index` without blocking; `Ok(false)` when another open
/// file description holds a lock there.
pub fn try_lock_byte(file: impl AsFd, index: u64) -> Result<bool> {
    match ofd_lock(file, index, libc::F_OFD_SETLK) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => Ok(false),
        Err(e) => Err(Error::io("fcntl(F_OFD_SETLK)", e)),
    }
}

/// Takes a shared (read) lock on byte `index` without blocking: granted while no other
/// open file description holds the write lock there, and while held, nobody else can
/// take the write lock. `Ok(false)` when a write lock is held.
pub fn try_share_byte(file: impl AsFd, index: u64) -> Result<bool> {
    match ofd_lock_as(file, index, libc::F_OFD_SETLK, libc::F_RDLCK) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => Ok(false),
        Err(e) => Err(Error::io("fcntl(F_OFD_SETLK, F_RDLCK)", e)),
    }
}

/// Lets go of whatever lock `file`'s open file description holds on byte `index`.
pub fn unlock_byte(file: impl AsFd, index: u64) -> Result<()> {
    ofd_lock_as(file, index, libc::F_OFD_SETLK, libc::F_UNLCK)
        .map(|_| ())
        .map_err(|e| Error::io("fcntl(F_OFD_SETLK, F_UNLCK)", e))
}

/// Who holds byte `index`, as seen from `file`'s open file description (whose own locks
/// do not count): [`ByteHolder::Writer`] when another description holds the write lock,
/// [`ByteHolder::Readers`] when others hold only shared locks, else `Free`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteHolder {
    Free,
    Readers,
    Writer,
}

/// [`ByteHolder`] of byte `index` (`F_OFD_GETLK` for a write lock: the kernel answers
/// with a lock that conflicts, whose type tells which; a write lock and shared ones
/// never coexist on one byte).
pub fn byte_holder(file: impl AsFd, index: u64) -> Result<ByteHolder> {
    let lock =
        ofd_lock(file, index, libc::F_OFD_GETLK).map_err(|e| Error::io("fcntl(F_OFD_GETLK)", e))?;
    Ok(match lock.l_type as libc::c_int {
        libc::F_UNLCK => ByteHolder::Free,
        libc::F_RDLCK => ByteHolder::Readers,
        _ => ByteHolder::Writer,
    })
}

/// Makes `file`'s open file description hold the write lock on byte `index` and no
/// other lock: whoever else has that description (it was handed to a peer) may have
/// released the byte or locked others through it. `Ok(false)` when another description
/// holds `index` now (the byte was released through this one, and taken by someone
/// else).
// The engine's fd server (Vulkan) is its one user.
#[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
pub fn hold_only_byte(file: impl AsFd, index: u64) -> Result<bool> {
    use std::os::fd::AsRawFd;
    let file = file.as_fd();
    // Everything but `index`: [0, index) and [index + 1, end of any file).
    for (start, len) in [(0, index), (index + 1, 0)] {
        // SAFETY: `flock` is plain data; all-zero is a valid value of it.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = libc::F_UNLCK as libc::c_short;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        lock.l_start = start as libc::off_t;
        lock.l_len = len as libc::off_t;
        // SAFETY: `file` is an open descriptor for the whole call; `lock` is a valid,
        // initialised `struct flock` the kernel reads; l_pid is 0 as OFD commands require.
        let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut lock) };
        if rc == -1 {
            return Err(Error::io(
                "fcntl(F_OFD_SETLK, F_UNLCK)",
                std::io::Error::last_os_error(),
            ));
        }
    }
    try_lock_byte(file, index)
}

/// Whether an open file description other than `file`'s holds a lock on byte `index`
/// (`F_OFD_GETLK`: a query, nothing is taken).
pub fn byte_locked(file: impl AsFd, index: u64) -> Result<bool> {
    let lock =
        ofd_lock(file, index, libc::F_OFD_GETLK).map_err(|e| Error::io("fcntl(F_OFD_GETLK)", e))?;
    Ok(lock.l_type != libc::F_UNLCK as libc::c_short)
}

/// Sleeps on `word` while it equals `expected`, at most `timeout`. Returns on wake-up,
/// value change, timeout or signal; the caller re-checks its condition in every case.
/// Shared mapping: the futex is never `FUTEX_PRIVATE_FLAG`.
// A loom build waits on the modelled futex instead (`primitive`).
#[cfg_attr(loom, allow(dead_code))]
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    // EAGAIN (value changed), ETIMEDOUT and EINTR are all "go and look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

pub fn futex_wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

// Forked children. A region's liveness lock (the engine's flock, a client's byte lock)
// belongs to the open file description of its descriptor, and the kernel drops it only
// when nothing refers to that description any more: no descriptor, and no mapping made
// from it. A child forked without exec (multiprocessing, a DataLoader worker) inherits
// both, so it would keep its parent's lock, hence its parent "alive", after the parent
// died. So each process registers its region descriptors and mappings here, and in every
// child it forks (`pthread_atfork`, which Python's `os.fork` and `multiprocessing` run
// too), before the child runs any code of its own: each mapping is replaced, at the same
// address, by a mapping of the same object through a new description (opened via
// /proc/self/fd: the child still sees the live shared bytes), and each descriptor is
// pointed at /dev/null (its number stays valid, so the child's copies drop cleanly).

/// Fixed arrays of atomics: the child handler may take no lock. A region takes one to
/// four descriptors (its file; an engine's proof and, with Vulkan tensors, its fd
/// socket; a client's proof), so about 256 engines or clients fit. Past that the rest
/// are not released in children (their locks then outlive a dead parent while a forked
/// child lives), which is said once on stderr.
const FORK_SLOTS: usize = 1024;

/// Descriptors of region files open in this process (-1: free).
static HELD_FDS: [AtomicI32; FORK_SLOTS] = [const { AtomicI32::new(-1) }; FORK_SLOTS];

/// A mapping of a region made through a held descriptor.
struct HeldMapping {
    /// 0 free, 1 being filled or emptied, 2 in use.
    state: AtomicU32,
    /// The descriptor it was made through; -1 once that descriptor closed (the mapping
    /// then stays as it is in a child: its description's lock went with the descriptor
    /// owner's close, which is what matters).
    fd: AtomicI32,
    addr: AtomicUsize,
    len: AtomicUsize,
    writable: AtomicBool,
}

static HELD_MAPPINGS: [HeldMapping; FORK_SLOTS] = [const {
    HeldMapping {
        state: AtomicU32::new(0),
        fd: AtomicI32::new(-1),
        addr: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        writable: AtomicBool::new(false),
    }
}; FORK_SLOTS];

/// `/proc/self/fd/<fd>` NUL-terminated, written into `buf` without allocating.
fn proc_fd_path(fd: i32, buf: &mut [u8; 32]) -> *const libc::c_char {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let (mut n, mut k) = (fd.unsigned_abs(), 0);
    loop {
        digits[k] = b'0' + (n % 10) as u8;
        k += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for (i, d) in digits[..k].iter().rev().enumerate() {
        buf[PREFIX.len() + i] = *d;
    }
    buf[PREFIX.len() + k] = 0;
    buf.as_ptr().cast()
}

/// Runs in the child after `fork`, its only thread: re-maps every held mapping through a
/// new description, then points every held descriptor at /dev/null. Only system calls on
/// stack buffers: nothing here allocates or locks.
extern "C" fn after_fork_in_child() {
    use std::sync::atomic::Ordering::{Acquire, Relaxed};
    let mut path = [0u8; 32];
    for m in &HELD_MAPPINGS {
        let fd = m.fd.load(Relaxed);
        if m.state.load(Acquire) != 2 || fd < 0 {
            continue;
        }
        let (addr, len) = (m.addr.load(Relaxed), m.len.load(Relaxed));
        let (access, prot) = if m.writable.load(Relaxed) {
            (libc::O_RDWR, libc::PROT_READ | libc::PROT_WRITE)
        } else {
            (libc::O_RDONLY, libc::PROT_READ)
        };
        // SAFETY: `open` of a NUL-terminated path on the stack; `mmap` with MAP_FIXED
        // over exactly the range this process mapped from the same object (registered
        // while the mapping exists, removed before it is unmapped), with the same access,
        // so every pointer into it stays valid and sees the same shared bytes; `close` of
        // the descriptor opened here. All async-signal-safe, as a fork handler needs.
        unsafe {
            let new = libc::open(proc_fd_path(fd, &mut path), access | libc::O_CLOEXEC);
            if new < 0 {
                continue;
            }
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                new,
                0,
            );
            libc::close(new);
        }
    }
    // SAFETY: `open` of a constant path, `dup3` onto descriptor numbers this process
    // holds (registered while open, removed before they close), `close` of the one
    // opened here; all async-signal-safe.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 {
            return;
        }
        for slot in &HELD_FDS {
            let fd = slot.load(Relaxed);
            if fd >= 0 && fd != null {
                libc::dup3(null, fd, libc::O_CLOEXEC);
            }
        }
        libc::close(null);
    }
}

fn install_fork_handler() {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        // SAFETY: registers a function with C linkage and no arguments, for the child
        // side only; it is a static function, valid for the life of the process.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// Registers a region descriptor, to be released in forked children.
pub fn hold_in_parent_only(file: impl AsFd) {
    use std::sync::atomic::Ordering;
    install_fork_handler();
    let fd = file.as_fd().as_raw_fd();
    for slot in &HELD_FDS {
        if slot
            .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "shmbridge: more than {FORK_SLOTS} region descriptors open in this process: \
             the rest stay open in processes forked from it (their locks then outlive \
             this process while such a child lives)"
        );
    });
}

/// Unregisters a region descriptor before it closes; mappings made through it stay as
/// they are in later children.
pub fn release_held(file: impl AsFd) {
    use std::sync::atomic::Ordering;
    let fd = file.as_fd().as_raw_fd();
    for m in &HELD_MAPPINGS {
        let _ =
            m.fd.compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed);
    }
    for slot in &HELD_FDS {
        if slot
            .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
    }
}

/// A descriptor that children forked from this process do not keep: registered with
/// [`hold_in_parent_only`] while it is open, so a child's copy points at /dev/null. For
/// what carries a lock or a socket of this process's own (the engine's proof of
/// ownership, a client's proof, the fd socket): a forked child must neither hold a lock
/// its parent's death should drop, nor keep a listening socket alive.
#[derive(Debug)]
pub struct HeldFd(OwnedFd);

impl HeldFd {
    pub fn new(fd: impl Into<OwnedFd>) -> HeldFd {
        let fd = fd.into();
        hold_in_parent_only(&fd);
        HeldFd(fd)
    }
}

impl AsFd for HeldFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl Drop for HeldFd {
    fn drop(&mut self) {
        release_held(&self.0);
    }
}

/// A new open file description of the file `file` refers to, read-write and
/// close-on-exec (`open("/proc/self/fd/N")`, not `dup`: its OFD locks are its own). `Io`
/// if /proc is not mounted or the file changed meanwhile.
pub fn reopen(file: impl AsFd) -> Result<File> {
    use rustix::fs::OFlags as F;
    let file = file.as_fd();
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let fd = rustix::fs::open(
        path.as_str(),
        F::RDWR | F::CLOEXEC | F::NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| Error::io(format!("reopening {path}"), e))?;
    let (a, b) = (rustix::fs::fstat(file), rustix::fs::fstat(&fd));
    match (a, b) {
        (Ok(a), Ok(b)) if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) => Ok(File::from(fd)),
        _ => Err(Error::io(
            format!("reopening {path}"),
            std::io::Error::other("it is another file now"),
        )),
    }
}

/// What is at a path where a socket file belongs (not following a link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtPath {
    Nothing,
    /// A socket file: its owner, device and inode.
    Socket {
        uid: u32,
        dev: u64,
        ino: u64,
    },
    /// Something else, in words.
    Other(&'static str),
}

/// What is at `path` (`lstat`: a link is not followed).
pub fn socket_file(path: &str) -> Result<AtPath> {
    use rustix::fs::FileType;
    match rustix::fs::statat(rustix::fs::CWD, path, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(match FileType::from_raw_mode(st.st_mode) {
            FileType::Socket => AtPath::Socket {
                uid: st.st_uid,
                dev: st.st_dev,
                ino: st.st_ino,
            },
            FileType::Symlink => AtPath::Other("a symbolic link"),
            FileType::Directory => AtPath::Other("a directory"),
            FileType::Fifo => AtPath::Other("a FIFO"),
            _ => AtPath::Other("not a socket"),
        }),
        Err(Errno::NOENT) => Ok(AtPath::Nothing),
        Err(e) => Err(Error::io(format!("stat('{path}')"), e)),
    }
}

/// Whether something listens on the Unix socket file at `path`: a non-blocking
/// `connect` that is accepted or finds the queue full (`EAGAIN`) says yes; refused (a
/// socket file nobody listens on any more) or gone, no.
pub fn socket_listening(path: &str) -> Result<bool> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let addr = SocketAddrUnix::new(path).map_err(|e| Error::io(format!("'{path}'"), e))?;
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|e| Error::io("socket(AF_UNIX)", e))?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) | Err(Errno::AGAIN) => Ok(true),
        Err(Errno::CONNREFUSED) | Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(Error::io(format!("connect('{path}')"), e)),
    }
}

/// Removes the socket file at `path` if it is a socket owned by this process's user
/// (`true`); leaves anything else (another user's, not a socket) and says what it is.
/// Never follows a link.
pub fn remove_socket_file(path: &str) -> Result<std::result::Result<bool, String>> {
    match socket_file(path)? {
        AtPath::Nothing => Ok(Ok(false)),
        AtPath::Socket { uid, .. } if uid == euid() => {
            unlink(path)?;
            Ok(Ok(true))
        }
        AtPath::Socket { uid, .. } => Ok(Err(format!("a socket of uid {uid}"))),
        AtPath::Other(what) => Ok(Err(what.to_string())),
    }
}

/// Registers a mapping of `len` bytes at `addr` made through the held descriptor `file`,
/// to be re-made through a new description in forked children. Returns its slot, to
/// unregister before unmapping; `None` when every slot is taken.
pub fn hold_mapping(file: &File, addr: *mut u8, len: usize, writable: bool) -> Option<usize> {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::Ordering;
    install_fork_handler();
    for (i, m) in HELD_MAPPINGS.iter().enumerate() {
        if m.state
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            m.fd.store(file.as_raw_fd(), Ordering::Relaxed);
            m.addr.store(addr as usize, Ordering::Relaxed);
            m.len.store(len, Ordering::Relaxed);
            m.writable.store(writable, Ordering::Relaxed);
            m.state.store(2, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Unregisters the mapping in `slot` before it is unmapped.
pub fn release_mapping(slot: usize) {
    use std::sync::atomic::Ordering;
    if let Some(m) = HELD_MAPPINGS.get(slot) {
        m.state.store(1, Ordering::Release);
        m.fd.store(-1, Ordering::Relaxed);
        m.state.store(0, Ordering::Release);
    }
}

// ---- Files: names in /dev/shm, reads, mappings, descriptor flags ----

/// This process's effective uid.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The names in /dev/shm that start with `prefix`, sorted.
pub fn shm_names(prefix: &str) -> Result<Vec<String>> {
    let dir = std::fs::read_dir(SHM_DIR).map_err(|e| Error::io("reading /dev/shm", e))?;
    let mut names: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    Ok(names)
}

/// Removes the name `path` (never what a link points to); `Ok(false)` if nothing was
/// there.
pub fn unlink(path: &str) -> Result<bool> {
    match rustix::fs::unlink(path) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(Error::io(format!("unlink('{path}')"), e)),
    }
}

/// Reads into `out` from byte `offset` of `file` with `pread` (never through a mapping,
/// so a file that shrinks meanwhile cannot kill the reader with SIGBUS), until `out` is
/// full or the file ends: the number of bytes read, short at the end of the file.
pub fn read_at(file: impl AsFd, offset: u64, out: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < out.len() {
        match rustix::io::pread(
            &file,
            &mut out[filled..],
            offset.saturating_add(filled as u64),
        ) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(filled)
}

/// How [`map_shared`] maps a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapAccess {
    ReadOnly,
    ReadWrite,
    /// Read-write, every page faulted in now (`MAP_POPULATE`): a new region's.
    Prefaulted,
}

/// A shared mapping of the first `len` bytes of `file`, unmapped when it drops.
pub fn map_shared(file: &File, len: usize, access: MapAccess) -> std::io::Result<MmapRaw> {
    let mut opts = MmapOptions::new();
    opts.len(len);
    match access {
        MapAccess::ReadOnly => opts.map_raw_read_only(file),
        MapAccess::ReadWrite => opts.map_raw(file),
        MapAccess::Prefaulted => opts.populate().map_raw(file),
    }
}

/// Size of the file behind `fd` when the kernel knows it: `st_size` of a regular file
/// (a memfd), else `None` (an opaque driver fd: the driver's import is then the check).
pub fn fd_size(fd: BorrowedFd<'_>) -> Option<u64> {
    let st = rustix::fs::fstat(fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile {
        return u64::try_from(st.st_size).ok();
    }
    None
}

/// Whether the file behind `fd` is sealed against shrinking (`F_SEAL_SHRINK`, a memfd's
/// seal); `false` for a file that takes no seals.
#[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
pub fn sealed_against_shrink(fd: BorrowedFd<'_>) -> bool {
    rustix::fs::fcntl_get_seals(fd).is_ok_and(|seals| seals.contains(rustix::fs::SealFlags::SHRINK))
}

/// Sets `FD_CLOEXEC` on `fd`: drivers hand out exported memory fds without it, and a
/// program this process runs must not inherit them.
#[cfg_attr(not(any(feature = "cuda", feature = "vulkan")), allow(dead_code))]
pub fn set_cloexec(fd: impl AsFd) -> Result<()> {
    rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC)
        .map_err(|e| Error::io("fcntl(F_SETFD, FD_CLOEXEC)", e))
}

/// Takes ownership of `fd`, a descriptor a device driver just opened for this process (a
/// memory export: `cuMemExportToShareableHandle`, `vkGetMemoryFdKHR`), and sets
/// `FD_CLOEXEC` on it: drivers open them without it, and neither call takes a flag for
/// it. Between the driver's return and this `fcntl`, a fork and exec made by another
/// thread without closing descriptors would inherit it; the library's own spawns
/// ([`crate::launch::spawn_engine`]) close that window ([`cloexec_above_stdio`]).
/// (Duplicating it with `F_DUPFD_CLOEXEC` would not: the original stays open without the
/// flag until it is closed, a window one system call longer.)
///
/// # Safety
/// `fd` is an open descriptor that nothing else owns or closes: from the call on it is
/// the value's (closed here on an error).
#[cfg_attr(not(any(feature = "cuda", feature = "vulkan")), allow(dead_code))]
pub unsafe fn own_driver_fd(fd: std::os::fd::RawFd) -> Result<OwnedFd> {
    // SAFETY: the caller's contract.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    set_cloexec(&fd)?;
    Ok(fd)
}

/// A new descriptor of what `fd` refers to, close-on-exec.
#[cfg_attr(not(feature = "vulkan"), allow(dead_code))]
pub fn dup_cloexec(fd: impl AsFd) -> Result<OwnedFd> {
    rustix::io::fcntl_dupfd_cloexec(fd, 0).map_err(|e| Error::io("fcntl(F_DUPFD_CLOEXEC)", e))
}

/// Makes `fd` blocking (`blocking`) or non-blocking (`FIONBIO`).
pub fn set_blocking(fd: impl AsFd, blocking: bool) -> Result<()> {
    rustix::io::ioctl_fionbio(fd, !blocking).map_err(|e| Error::io("ioctl(FIONBIO)", e))
}

/// Gives the file at `path` mode 0600: only its owner may read or write it.
pub fn owner_only(path: &str) -> Result<()> {
    rustix::fs::chmod(path, Mode::RUSR | Mode::WUSR)
        .map_err(|e| Error::io(format!("chmod('{path}')"), e))
}

/// Which of `fds` are readable (or hung up), waiting up to `timeout` for one to be
/// (`None`: as long as it takes; a timeout too long to express also waits so). An
/// interrupted or failed `poll` is an `Err` the caller may simply retry.
pub fn poll_readable(
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> std::result::Result<Vec<bool>, Errno> {
    use rustix::event::{PollFd, PollFlags};
    let mut polled: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN))
        .collect();
    let ts = timeout.and_then(|t| rustix::time::Timespec::try_from(t).ok());
    rustix::event::poll(&mut polled, ts.as_ref())?;
    Ok(polled.iter().map(|p| !p.revents().is_empty()).collect())
}

// ---- Sockets ----

/// Who a connected peer is, as the kernel says (`SO_PEERCRED`: the credentials it had
/// when it connected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its pid in this process's PID namespace; `None` when it is not visible here (it
    /// lives in a PID namespace that is not this one's or a descendant's: the kernel
    /// says 0).
    pub pid: Option<u32>,
    pub uid: u32,
}

impl std::fmt::Display for PeerCred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid} (uid {})", self.uid),
            None => write!(
                f,
                "a process in another PID namespace (uid {}; its pid is not visible here)",
                self.uid
            ),
        }
    }
}

/// The peer credentials of a connected Unix socket (`fdpass`'s peers). Read with `getsockopt` into
/// `struct ucred` here rather than with rustix's `socket_peercred`, whose `UCred` keeps
/// the pid as a non-zero integer: the kernel reports 0 for a peer in a PID namespace this
/// process cannot see (a learner in another container), and building a non-zero integer
/// from 0 is undefined behaviour.
pub fn peer_credentials(fd: BorrowedFd<'_>) -> Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket for the call; `cred` is a writable `struct ucred`
    // of `len` bytes, which the kernel fills (every bit pattern is a valid `ucred`).
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::io(
            "getsockopt(SO_PEERCRED)",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).ok().filter(|&p| p != 0),
        uid: cred.uid,
    })
}

// ---- Processes ----

/// Ends this process at once with `code` (`_exit`): no exit handlers, no destructors,
/// no flushing; for a signal's handler thread while another thread may be exiting.
/// (rustix has `_exit` only in its unstable `runtime` module.)
pub fn exit_now(code: i32) -> ! {
    // SAFETY: ends the process at once; the caller depends on nothing it skips.
    unsafe { libc::_exit(code) }
}

/// Sends SIGTERM to process `pid` (a launched engine: it closes and removes its region).
pub fn terminate(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// In a child between `fork` and `exec` (async-signal-safe: system calls only): asks the
/// kernel for SIGTERM when the parent dies (`PR_SET_PDEATHSIG`, kept across `exec`), then
/// checks the parent is still `parent` (the launcher's pid, read before the fork): if it
/// died before the request, the child was re-parented already and must not start.
pub fn die_with_parent(parent: u32) -> std::io::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))?;
    match rustix::process::getppid() {
        Some(p) if p.as_raw_nonzero().get() as u32 == parent => Ok(()),
        // ESRCH: the launcher is gone. No allocation here (a forked child).
        _ => Err(std::io::Error::from_raw_os_error(libc::ESRCH)),
    }
}

/// In a child between `fork` and `exec` (async-signal-safe: system calls only): marks
/// every descriptor above stdio close-on-exec, so the program started inherits stdio and
/// nothing else of this process. A descriptor another thread held at the moment of the
/// fork without close-on-exec yet (an exported CUDA or Vulkan memory fd, between the
/// driver's return and [`own_driver_fd`]'s `fcntl`; one a foreign library opened without
/// the flag) does not reach it. `close_range(3, ~0, CLOSE_RANGE_CLOEXEC)` (Linux 5.11);
/// on an older kernel, `F_SETFD` on every number below the soft `RLIMIT_NOFILE`.
pub fn cloexec_above_stdio() -> std::io::Result<()> {
    let (first, last): (libc::c_uint, libc::c_uint) = (3, libc::c_uint::MAX);
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC closes nothing: it sets the flag on the
    // open descriptors of the range and ignores numbers that are not open.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            last,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return Ok(());
    }
    // ENOSYS (before 5.9) or EINVAL (the flag, before 5.11): one number at a time.
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .map_or(1 << 20, |n| n.min(1 << 20)) as libc::c_int;
    cloexec_each(3..limit);
    Ok(())
}

/// `FD_CLOEXEC` on every open descriptor numbered in `fds` (system calls only).
fn cloexec_each(fds: std::ops::Range<libc::c_int>) {
    for fd in fds {
        // SAFETY: F_SETFD sets a flag on an open descriptor, or fails with EBADF on a
        // number that is not open; nothing is closed or read.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

/// In a child between `fork` and `exec`: a session of its own, so the terminal's Ctrl-C
/// reaches the launcher only (its engine stops when its client closes or dies).
pub fn new_session() -> std::io::Result<()> {
    rustix::process::setsid()?;
    Ok(())
}

/// How often [`core_free`] reads the kernel's count again; in between it answers from
/// its last reading.
#[cfg_attr(loom, allow(dead_code))]
const CORE_FREE_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// How soon [`core_free`] reads the count again after it found the machine busy: one
/// runnable thread too many at the moment of a reading (a kernel worker waking, say)
/// would otherwise send every long wait to the futex for the next 10 ms; on a machine
/// that stays busy this is one more read a millisecond.
#[cfg_attr(loom, allow(dead_code))]
const CORE_BUSY_RECHECK: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether every runnable thread of the machine has a core now: the kernel's count of
/// runnable threads (`/proc/loadavg`, the `R` of its `R/T` field, which counts the caller)
/// is at most the machine's online CPUs. A waiter spins only while this holds: on a busy
/// machine a spinning waiter takes the core the process it waits for needs. Both counts
/// are the whole machine's (`/proc/loadavg` is not per container): compared with the
/// CPUs a container's quota allows instead, a quiet container on a busy host would never
/// spin. Read at most every 10 ms, or 1 ms after a busy reading (a `pread` of a
/// descriptor kept open: a few microseconds); `true` when it cannot be read.
#[cfg_attr(loom, allow(dead_code))]
pub fn core_free() -> bool {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    static CORES: OnceLock<usize> = OnceLock::new();
    static CHECKED_AT: AtomicU64 = AtomicU64::new(0);
    static FREE: AtomicBool = AtomicBool::new(true);
    let epoch = *EPOCH.get_or_init(Instant::now);
    let now = epoch.elapsed().as_nanos() as u64 + 1;
    let last = CHECKED_AT.load(Ordering::Relaxed);
    let free = FREE.load(Ordering::Relaxed);
    let every = if free {
        CORE_FREE_EVERY
    } else {
        CORE_BUSY_RECHECK
    };
    if last != 0 && now.saturating_sub(last) < every.as_nanos() as u64 {
        return free;
    }
    CHECKED_AT.store(now, Ordering::Relaxed);
    let cores = *CORES.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|text| cpu_list_len(&text))
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    // One descriptor for the process's life and a read into the stack: open, read,
    // close and a String cost about 17 µs here, a `pread` of the open file 3 µs.
    static LOADAVG: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let free = LOADAVG
        .get_or_init(|| std::fs::File::open("/proc/loadavg").ok())
        .as_ref()
        .and_then(|file| {
            use std::os::unix::fs::FileExt;
            let mut text = [0u8; 128];
            let n = file.read_at(&mut text, 0).ok()?;
            runnable_threads(std::str::from_utf8(&text[..n]).ok()?)
        })
        .is_none_or(|running| running <= cores);
    FREE.store(free, Ordering::Relaxed);
    free
}

/// How many CPUs a kernel CPU list names (`0-15`, `0,2-5,7`).
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for part in list.trim().split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let a = part.parse::<usize>().ok()?;
                (a, a)
            }
        };
        n = n.checked_add(b.checked_sub(a)?.checked_add(1)?)?;
    }
    (n > 0).then_some(n)
}

/// The runnable-thread count of a `/proc/loadavg` line (`0.50 0.40 0.30 3/412 12345`).
fn runnable_threads(loadavg: &str) -> Option<usize> {
    loadavg
        .split_ascii_whitespace()
        .nth(3)?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// Where this process's pid is kept once asked (0: not yet): the first word of a
/// private anonymous page marked `MADV_WIPEONFORK`, which the kernel hands to every
/// child made without `CLONE_VM` zeroed: `fork`, `_Fork` and a raw `clone` alike (the
/// last two run no fork handlers). Null: not made yet; [`NO_PID_PAGE`]: the kernel
/// lacks `MADV_WIPEONFORK` (before 4.14) and every call asks `getpid`. `getpid` is a
/// system call, and the per-record paths ask "is this still the process that made it"
/// every time.
static PID_PAGE: std::sync::atomic::AtomicPtr<AtomicU32> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// [`PID_PAGE`] when no page can be had.
const NO_PID_PAGE: *mut AtomicU32 = 1 as *mut AtomicU32;

fn pid_cell() -> Option<&'static AtomicU32> {
    use std::sync::atomic::Ordering::{AcqRel, Acquire};
    let mut cell = PID_PAGE.load(Acquire);
    if cell.is_null() {
        // SAFETY: `sysconf` reads a constant of the system.
        let len = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: a fresh private anonymous mapping of one page; nothing else refers to it.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let made = if page == libc::MAP_FAILED {
            NO_PID_PAGE
        // SAFETY: `page` is the mapping of `len` bytes just made.
        } else if unsafe { libc::madvise(page, len, libc::MADV_WIPEONFORK) } != 0 {
            // SAFETY: unmaps the page just made, which nothing refers to.
            unsafe { libc::munmap(page, len) };
            NO_PID_PAGE
        } else {
            page.cast::<AtomicU32>()
        };
        cell = match PID_PAGE.compare_exchange(std::ptr::null_mut(), made, AcqRel, Acquire) {
            Ok(_) => made,
            Err(first) => {
                if made != NO_PID_PAGE {
                    // SAFETY: another thread's page won; this one was never published.
                    unsafe { libc::munmap(made.cast(), len) };
                }
                first
            }
        };
    }
    // SAFETY: a published page is never unmapped; it is page-aligned, zero-filled at
    // first (a valid `AtomicU32`), and read and written only atomically.
    (cell != NO_PID_PAGE).then(|| unsafe { &*cell })
}

pub fn current_pid() -> u32 {
    use std::sync::atomic::Ordering::Relaxed;
    let getpid = || rustix::process::getpid().as_raw_nonzero().get() as u32;
    let Some(cell) = pid_cell() else {
        return getpid();
    };
    match cell.load(Relaxed) {
        0 => {
            let pid = getpid();
            cell.store(pid, Relaxed);
            pid
        }
        pid => pid,
    }
}

/// `PF_EXITING` in a task's flags (`/proc/PID/stat` field 9): the task has entered
/// `do_exit` and will never run user code again (include/linux/sched.h).
const PF_EXITING: u64 = 0x4;
/// SIGKILL in a pending-signal bitmap (`/proc/PID/stat` field 31; bit `signo - 1`). The
/// kernel queues it to every thread of a process the moment a fatal signal is sent to it
/// (SIGKILL, or SIGTERM with no handler): from then on the process never runs user code.
const SIGKILL_PENDING: u64 = 1 << 8;

/// What `/proc/PID/stat` says about a process: its state letter, kernel flags, start
/// time (clock ticks after boot) and its main thread's pending signals.
struct ProcStat {
    state: char,
    flags: u64,
    start: u64,
    pending: u64,
}

impl ProcStat {
    /// Parses the text of `/proc/PID/stat`.
    fn parse(text: &str) -> Option<ProcStat> {
        // The command name is in parentheses and may hold anything: parse after the last ')'.
        let rest = &text[text.rfind(')')? + 1..];
        let mut fields = rest.split_ascii_whitespace();
        // Field 3 is the state, field 9 the flags, field 22 the start time, field 31
        // the pending signals.
        let state = fields.next()?.chars().next()?;
        let flags = fields.nth(5)?.parse().ok()?;
        let start = fields.nth(12)?.parse().ok()?;
        let pending = fields.nth(8)?.parse().ok()?;
        Some(ProcStat {
            state,
            flags,
            start,
            pending,
        })
    }

    fn read(pid: u32) -> Option<ProcStat> {
        ProcStat::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    /// Dead, or doomed: a zombie (exited, not reaped yet), a process whose main thread
    /// has started to exit, or one a fatal signal was sent to. A killed process with much
    /// mapped (a learner with torch loaded) needs the CPU, then tens to hundreds of
    /// milliseconds, to finish exiting and become a zombie (over a second on a busy
    /// machine); it stopped running user code when the signal was sent, and counts as
    /// dead from then on, with one gap: between the moment its main thread takes SIGKILL
    /// off its pending set (in the kernel's `get_signal`) and the moment `do_exit` sets
    /// `PF_EXITING`, nothing in `/proc` tells it from a running process (the kernel's
    /// group-exit flag is not shown), and it reads alive. The gap is a few kernel
    /// instructions, longer only if the task is preempted there; the answer in it is
    /// "alive", the safe one for every caller (an engine keeps waiting and checks again
    /// before its next sleep, device memory is kept a little longer), never a death
    /// reported too early.
    fn dead_or_doomed(&self) -> bool {
        self.state == 'Z'
            || self.state == 'X'
            || self.flags & PF_EXITING != 0
            || self.pending & SIGKILL_PENDING != 0
    }
}

pub fn process_start_time(pid: u32) -> Option<u64> {
    ProcStat::read(pid).map(|s| s.start)
}

/// Whether the process `pid` that started at `start_time` still runs. A process that has
/// exited, has started to exit or was sent a fatal signal counts as dead; a live process
/// with another start time is a reused pid, so the one we knew is dead too.
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    process_seen(pid, start_time) == Some(true)
}

/// What this PID namespace says of the process `pid` that started at `start_time`:
/// `Some(true)` it runs, `Some(false)` it is doomed (a zombie, exiting, or sent a fatal
/// signal: it may still hold its locks, which the kernel drops only after tearing down
/// its memory, tens of milliseconds for a learner with torch loaded, but it runs no more
/// user code), `None` no such process here (gone, a reused pid, or another namespace's).
/// One read of `/proc/PID/stat`.
pub fn process_seen(pid: u32, start_time: u64) -> Option<bool> {
    if pid == 0 {
        return None;
    }
    ProcStat::read(pid)
        .filter(|s| s.start == start_time)
        .map(|s| !s.dead_or_doomed())
}

/// The PID namespace of a live process recorded as `(pid, start_time)`: this one if it
/// shows it, else another one (a peer in another container).
pub fn pid_namespace(pid: u32, start_time: u64) -> PidNamespace {
    match process_seen(pid, start_time) {
        Some(_) => PidNamespace::This,
        None => PidNamespace::Other,
    }
}

/// The inode number of the initial PID namespace (the host's): a constant of the kernel
/// (`PROC_PID_INIT_INO`, `include/linux/proc_ns.h`), the same on every boot.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const INITIAL_PID_NAMESPACE_INO: u64 = 0xEFFF_FFFC;

/// Whether this process runs in the initial PID namespace (the host's, not a
/// container's): `/proc/self/ns/pid` is that namespace's inode. `None` when it cannot be
/// read (no /proc).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn in_initial_pid_namespace() -> Option<bool> {
    let st = rustix::fs::stat("/proc/self/ns/pid").ok()?;
    Some(st.st_ino as u64 == INITIAL_PID_NAMESPACE_INO)
}

/// 128 random bits as 32 lowercase hex digits.
pub fn random_hex128() -> Result<String> {
    let mut buf = [0u8; 16];
    rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| Error::io("getrandom", e))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_start_time_matters() {
        let pid = current_pid();
        let start = process_start_time(pid).expect("own /proc entry");
        assert!(process_alive(pid, start));
        assert!(!process_alive(pid, start + 1));
        assert!(!process_alive(0, start));
    }

    #[test]
    fn stat_fields_and_a_dying_process() {
        // A command name holding ") (" and spaces; flags 0x400140, nothing pending.
        let line = |state: &str, flags: u64, pending: u64| {
            format!(
                "4242 (a) (b c) {state} 1 4242 4242 0 -1 {flags} 10 0 0 0 3 1 0 0 20 0 5 0 \
                 987654 1000 100 18446744073709551615 1 1 0 0 0 {pending} 0 0 0 0 0 17 1 0 0"
            )
        };
        let s = ProcStat::parse(&line("S", 0x400140, 0)).expect("parses");
        assert_eq!((s.flags, s.start, s.pending), (0x400140, 987654, 0));
        let doomed = |state, flags, pending| {
            ProcStat::parse(&line(state, flags, pending))
                .expect("parses")
                .dead_or_doomed()
        };
        assert!(!doomed("S", 0x400140, 0));
        // A pending SIGTERM (bit 14) is not death: the process may handle it.
        assert!(!doomed("S", 0x400140, 1 << 14));
        // Sent SIGKILL, not yet scheduled; tearing its memory down; exited.
        assert!(doomed("S", 0x400140, 1 << 8));
        assert!(doomed("R", 0x400144, 0));
        assert!(doomed("D", 0x404044, 0));
        assert!(doomed("Z", 0x400144, 0));
        assert!(ProcStat::parse("4242 (truncated) S 1").is_none());
        // This process: running, not doomed; its start time is field 22.
        let me = ProcStat::read(current_pid()).expect("own stat");
        assert!(!me.dead_or_doomed());
        assert_eq!(Some(me.start), process_start_time(current_pid()));
    }

    #[test]
    fn a_stopped_process_is_alive_and_dead_once_killed() {
        // Stopped, it cannot exit: it lives until SIGKILL, and is dead once that made it
        // a zombie (and gone once reaped).
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let start = process_start_time(pid).expect("start time");
        let raw = rustix::process::Pid::from_raw(pid as i32).expect("pid");
        rustix::process::kill_process(raw, rustix::process::Signal::STOP).expect("stop");
        let stopped =
            rustix::process::WaitIdOptions::STOPPED | rustix::process::WaitIdOptions::NOWAIT;
        rustix::process::waitid(rustix::process::WaitId::Pid(raw), stopped).expect("waitid");
        assert!(process_alive(pid, start), "a stopped process lives");
        assert_eq!(process_seen(pid, start), Some(true));
        rustix::process::kill_process(raw, rustix::process::Signal::KILL).expect("kill");
        // Between the kill and its exit it reads doomed (SIGKILL pending, then
        // PF_EXITING), except in the gap `dead_or_doomed` describes, where it reads alive:
        // no answer is checked there. Once it is a zombie (waited for without reaping:
        // this test is its parent) it is dead, however often it is asked.
        let exited =
            rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT;
        rustix::process::waitid(rustix::process::WaitId::Pid(raw), exited).expect("waitid");
        assert!(!process_alive(pid, start), "a killed process is dead");
        assert_eq!(process_seen(pid, start), Some(false), "doomed until reaped");
        assert!(
            process_seen(pid, start + 1).is_none(),
            "another start time is another process"
        );
        let _ = child.wait();
        assert!(!process_alive(pid, start));
        assert_eq!(
            process_seen(pid, start),
            None,
            "a reaped pid is not visible"
        );
    }

    #[test]
    fn byte_locks_are_per_open_file_and_per_byte() {
        let path = std::env::temp_dir().join(format!("shmbridge-ofd-{}", current_pid()));
        let a = File::create(&path).unwrap();
        let b = File::options().read(true).write(true).open(&path).unwrap();
        assert!(!byte_locked(&b, 3).unwrap(), "nobody holds byte 3 yet");
        assert!(try_lock_byte(&a, 3).unwrap());
        assert!(byte_locked(&b, 3).unwrap(), "seen from another open file");
        assert!(
            !byte_locked(&a, 3).unwrap(),
            "a holder does not conflict with itself"
        );
        assert!(!byte_locked(&b, 4).unwrap(), "only byte 3 is taken");
        assert!(!try_lock_byte(&b, 3).unwrap(), "a second holder is refused");
        assert!(try_lock_byte(&b, 4).unwrap());
        drop(a);
        assert!(
            !byte_locked(&b, 3).unwrap(),
            "closing the holder's last fd releases it"
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn shared_byte_locks_exclude_a_writer_and_say_so() {
        let path = std::env::temp_dir().join(format!("shmbridge-ofd-rd-{}", current_pid()));
        let open = || {
            let mut o = File::options();
            o.read(true).write(true).create(true).truncate(false);
            o.open(&path).unwrap()
        };
        let (a, b, c) = (open(), open(), open());
        assert_eq!(byte_holder(&c, 5).unwrap(), ByteHolder::Free);
        assert!(try_share_byte(&a, 5).unwrap());
        assert!(try_share_byte(&b, 5).unwrap(), "shared by several");
        assert_eq!(byte_holder(&c, 5).unwrap(), ByteHolder::Readers);
        assert!(!try_lock_byte(&c, 5).unwrap(), "no writer while shared");
        unlock_byte(&a, 5).unwrap();
        assert!(!try_lock_byte(&c, 5).unwrap(), "still shared by b");
        unlock_byte(&b, 5).unwrap();
        assert_eq!(byte_holder(&a, 5).unwrap(), ByteHolder::Free);
        assert!(try_lock_byte(&c, 5).unwrap());
        assert_eq!(byte_holder(&a, 5).unwrap(), ByteHolder::Writer);
        assert!(!try_share_byte(&a, 5).unwrap(), "no reader while written");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(cpu_list_len("0-15\n"), Some(16));
        assert_eq!(cpu_list_len("0,2-5,7"), Some(6));
        assert_eq!(cpu_list_len("3"), Some(1));
        assert_eq!(cpu_list_len("5-3"), None);
        assert_eq!(cpu_list_len(""), None);
        let live = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
        assert!(cpu_list_len(&live).is_some_and(|n| n >= 1), "{live}");
    }

    #[test]
    fn runnable_threads_are_read_from_loadavg() {
        assert_eq!(runnable_threads("0.50 0.40 0.30 3/412 12345\n"), Some(3));
        assert_eq!(runnable_threads("garbage"), None);
        let live = std::fs::read_to_string("/proc/loadavg").unwrap();
        assert!(
            runnable_threads(&live).is_some_and(|n| n >= 1),
            "{live}: the reader runs"
        );
    }

    #[test]
    fn random_names_differ() {
        let a = random_hex128().unwrap();
        let b = random_hex128().unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }

    /// `SO_PEERCRED` of a peer this process cannot see: a child in a PID namespace of its
    /// own reads the credentials of its parent, which is outside it. The kernel says pid
    /// 0 (rustix's `UCred` would hold it as a non-zero integer: undefined behaviour);
    /// [`peer_credentials`] says `None`.
    #[test]
    fn a_peer_in_another_pid_namespace_has_no_pid() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("SKIPPED: a PID namespace of its own needs root");
            return;
        }
        use rustix::net::{AddressFamily, SocketFlags, SocketType};
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        // SAFETY: the child makes system calls only (unshare, fork, getsockopt through
        // `peer_credentials`, write, _exit) before it exits; nothing it runs takes a lock
        // another thread of the parent could hold, beyond the allocator, which glibc
        // keeps usable after fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = (|| {
                // SAFETY: a system call with no pointers.
                if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
                    return 2;
                }
                // SAFETY: as above; the grandchild is the first process of the namespace.
                let inner = unsafe { libc::fork() };
                if inner == 0 {
                    let cred = peer_credentials(b.as_fd());
                    let ok = matches!(cred, Ok(PeerCred { pid: None, uid: 0 }));
                    // SAFETY: ends the grandchild without unwinding.
                    unsafe { libc::_exit(if ok { 0 } else { 1 }) };
                }
                let mut status = 0;
                // SAFETY: waits for the grandchild forked above.
                unsafe { libc::waitpid(inner, &mut status, 0) };
                libc::WEXITSTATUS(status)
            })();
            // SAFETY: ends the child without unwinding into the test harness.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(libc::WEXITSTATUS(status), 0, "status {status:#x}");
        // Seen from here, the same socket names its peer (ourselves).
        assert_eq!(
            peer_credentials(a.as_fd()).unwrap().pid,
            Some(std::process::id())
        );
    }

    fn memfd(name: &str, flags: rustix::fs::MemfdFlags, bytes: &[u8]) -> File {
        let fd = rustix::fs::memfd_create(name, flags).expect("memfd");
        rustix::io::write(&fd, bytes).expect("write");
        File::from(fd)
    }

    #[test]
    fn read_at_reads_up_to_the_end_of_the_file() {
        let f = memfd("r", rustix::fs::MemfdFlags::CLOEXEC, b"0123456789");
        let mut buf = [0u8; 8];
        assert_eq!(read_at(&f, 4, &mut buf).unwrap(), 6, "short at the end");
        assert_eq!(&buf[..6], b"456789");
        assert_eq!(read_at(&f, 0, &mut buf).unwrap(), 8);
        assert_eq!(&buf, b"01234567");
        assert_eq!(read_at(&f, 10, &mut buf).unwrap(), 0);
    }

    #[test]
    fn shm_names_lists_a_prefix_sorted_and_unlink_says_what_it_removed() {
        let ns = std::env::var("SHMBRIDGE_NAMESPACE").unwrap_or_default();
        let prefix = format!("shmbridge-{ns}-os_names-");
        for n in ["b", "a"] {
            shm_create(&format!("{prefix}{n}")).unwrap();
        }
        let (a, b) = (format!("{prefix}a"), format!("{prefix}b"));
        assert_eq!(shm_names(&prefix).unwrap(), [a.clone(), b.clone()]);
        let path = format!("{SHM_DIR}/{a}");
        assert!(unlink(&path).unwrap(), "removed");
        assert!(!unlink(&path).unwrap(), "nothing there any more");
        assert_eq!(shm_names(&prefix).unwrap(), std::slice::from_ref(&b));
        assert!(unlink(&format!("{SHM_DIR}/{b}")).unwrap());
        assert!(shm_names(&prefix).unwrap().is_empty());
    }

    #[test]
    fn map_shared_maps_what_the_file_holds() {
        let f = memfd("m", rustix::fs::MemfdFlags::CLOEXEC, &[0u8; 4096]);
        let rw = map_shared(&f, 4096, MapAccess::Prefaulted).unwrap();
        let ro = map_shared(&f, 4096, MapAccess::ReadOnly).unwrap();
        let rw2 = map_shared(&f, 4096, MapAccess::ReadWrite).unwrap();
        assert_eq!((rw.len(), ro.len(), rw2.len()), (4096, 4096, 4096));
        // SAFETY: the mappings are 4096 bytes of this test's own memfd; nothing else
        // touches them.
        unsafe {
            rw.as_mut_ptr().add(7).write(42);
            rw2.as_mut_ptr().add(9).write(43);
            assert_eq!(ro.as_ptr().add(7).read(), 42, "one file behind both");
            assert_eq!(ro.as_ptr().add(9).read(), 43);
        }
        let mut byte = [0u8; 1];
        read_at(&f, 7, &mut byte).unwrap();
        assert_eq!(byte, [42], "shared, not private");
        let writable = |addr: *const u8| {
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let line = maps
                .lines()
                .find(|l| l.starts_with(&format!("{:x}-", addr as usize)))
                .expect("the mapping is listed")
                .to_string();
            line.split_whitespace().nth(1).unwrap().starts_with("rw")
        };
        assert!(writable(rw.as_ptr()));
        assert!(!writable(ro.as_ptr()), "read-only");
    }

    /// A driver's fd, taken over: close-on-exec from then on, and the same file.
    #[test]
    fn a_driver_fd_taken_over_is_close_on_exec() {
        use rustix::io::{fcntl_getfd, FdFlags};
        use std::os::fd::IntoRawFd;
        let f = memfd("driver", rustix::fs::MemfdFlags::empty(), b"abc");
        assert!(!fcntl_getfd(&f).unwrap().contains(FdFlags::CLOEXEC));
        let id = file_identity(&f).unwrap();
        // SAFETY: a descriptor of ours, handed over whole.
        let owned = unsafe { own_driver_fd(f.into_raw_fd()) }.unwrap();
        assert!(fcntl_getfd(&owned).unwrap().contains(FdFlags::CLOEXEC));
        assert_eq!(file_identity(&owned).unwrap(), id);
    }

    /// The fallback of `cloexec_above_stdio` on kernels without `CLOSE_RANGE_CLOEXEC`:
    /// each open number of the range gets the flag, a closed one is passed over. (The
    /// whole of it runs in a launched child: `launch::tests`.)
    #[test]
    fn the_one_by_one_fallback_sets_close_on_exec() {
        use rustix::io::{fcntl_getfd, FdFlags};
        let f = memfd("open", rustix::fs::MemfdFlags::empty(), b"");
        let closed = memfd("closed", rustix::fs::MemfdFlags::empty(), b"");
        let (open, gone) = (f.as_raw_fd(), closed.as_raw_fd());
        drop(closed);
        cloexec_each(open.min(gone)..open.max(gone) + 1);
        assert!(fcntl_getfd(&f).unwrap().contains(FdFlags::CLOEXEC));
    }

    #[test]
    fn descriptor_flags_seals_and_sizes() {
        use rustix::fs::{MemfdFlags, SealFlags};
        use rustix::io::{fcntl_getfd, FdFlags};
        let f = memfd("f", MemfdFlags::ALLOW_SEALING, b"abc");
        assert!(!fcntl_getfd(&f).unwrap().contains(FdFlags::CLOEXEC));
        set_cloexec(&f).unwrap();
        assert!(fcntl_getfd(&f).unwrap().contains(FdFlags::CLOEXEC));
        let copy = dup_cloexec(&f).unwrap();
        assert!(fcntl_getfd(&copy).unwrap().contains(FdFlags::CLOEXEC));
        assert_eq!(file_identity(&copy).unwrap(), file_identity(&f).unwrap());
        assert_eq!(fd_size(copy.as_fd()), Some(3));
        assert!(!sealed_against_shrink(f.as_fd()));
        rustix::fs::fcntl_add_seals(&f, SealFlags::SHRINK).unwrap();
        assert!(sealed_against_shrink(f.as_fd()));
        assert!(
            sealed_against_shrink(copy.as_fd()),
            "the seal is the file's"
        );
        let (a, _b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        assert_eq!(fd_size(a.as_fd()), None, "a socket has no size");
        assert!(!sealed_against_shrink(a.as_fd()), "nor seals");
    }

    #[test]
    fn poll_readable_and_blocking_mode() {
        use rustix::net::{AddressFamily, SocketFlags, SocketType};
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let (c, _d) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let fds = [a.as_fd(), c.as_fd()];
        assert_eq!(
            poll_readable(&fds, Some(Duration::ZERO)).unwrap(),
            [false, false]
        );
        rustix::io::write(&b, b"x").unwrap();
        assert_eq!(
            poll_readable(&fds, Some(Duration::ZERO)).unwrap(),
            [true, false]
        );
        // Readable now: a wait with no deadline returns.
        assert_eq!(poll_readable(&fds, None).unwrap(), [true, false]);
        drop(b);
        let mut buf = [0u8; 4];
        assert_eq!(rustix::io::read(&a, &mut buf).unwrap(), 1);
        assert_eq!(poll_readable(&fds, None).unwrap(), [true, false], "hung up");
        let nonblock = |fd: BorrowedFd<'_>| {
            rustix::fs::fcntl_getfl(fd)
                .unwrap()
                .contains(rustix::fs::OFlags::NONBLOCK)
        };
        assert!(!nonblock(c.as_fd()));
        set_blocking(&c, false).unwrap();
        assert!(nonblock(c.as_fd()));
        assert_eq!(rustix::io::read(&c, &mut buf), Err(Errno::AGAIN));
        set_blocking(&c, true).unwrap();
        assert!(!nonblock(c.as_fd()));
    }

    #[test]
    fn owner_only_leaves_the_owner_alone_with_the_file() {
        let ns = std::env::var("SHMBRIDGE_NAMESPACE").unwrap_or_default();
        let path = format!("{SHM_DIR}/shmbridge-{ns}-os_mode");
        let f = rustix::fs::open(
            path.as_str(),
            rustix::fs::OFlags::CREATE | rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .unwrap();
        rustix::fs::fchmod(&f, Mode::from_raw_mode(0o644)).unwrap();
        owner_only(&path).unwrap();
        let st = rustix::fs::fstat(&f).unwrap();
        assert_eq!(st.st_mode & 0o777, 0o600);
        assert_eq!(st.st_uid, euid(), "made by this user");
        assert!(unlink(&path).unwrap());
    }

    /// Makes a child with `spawn` (0 in the child, its pid in the parent) and checks
    /// that the child's `current_pid` is its own, not its parent's cached one.
    fn child_asks_its_own_pid(spawn: impl FnOnce() -> i32) {
        let parent = current_pid();
        assert_eq!(
            parent,
            rustix::process::getpid().as_raw_nonzero().get() as u32
        );
        let pid = spawn();
        assert!(pid >= 0);
        if pid == 0 {
            let own = rustix::process::getpid().as_raw_nonzero().get() as u32;
            exit_now(if current_pid() == own && own != parent {
                0
            } else {
                1
            });
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child saw its parent's pid"
        );
        assert_eq!(current_pid(), parent);
    }

    #[test]
    fn a_forked_child_asks_its_own_pid_not_its_parents_cached_one() {
        // SAFETY: the child makes system calls and atomic loads and stores only (its
        // pid is cached afresh without allocating), then `exit_now`.
        child_asks_its_own_pid(|| unsafe { libc::fork() });
    }

    #[test]
    fn a_child_of_a_raw_clone_asks_its_own_pid() {
        // A child made by the `clone` system call (as `_Fork`, or a runtime that forks
        // without the C library) runs no fork handlers.
        // SAFETY: `clone` without `CLONE_VM` (a fork, the child on a copy of this
        // stack); the child makes system calls and atomic loads and stores only, then
        // `exit_now`.
        child_asks_its_own_pid(|| unsafe {
            libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) as i32
        });
    }

    #[test]
    fn exit_now_ends_the_process_with_its_code() {
        // SAFETY: the child calls `exit_now` (a system call) and nothing else.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            exit_now(7);
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 7);
    }
}
