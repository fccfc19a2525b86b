//! The OS layer: POSIX shm, mapping, flock, futex and process liveness. Every system
//! call the crate makes goes through here (via rustix), so the rest stays portable in
//! shape and free of OS details.

use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::fs::{FlockOperation, Mode};
use rustix::io::Errno;
use rustix::shm::OFlags;
use rustix::thread::futex;

use crate::error::{Error, Result};

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
    if st.st_uid != rustix::process::geteuid().as_raw() {
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

/// (size, device, inode) of an open file.
pub fn file_identity(file: &File) -> Result<(u64, u64, u64)> {
    let st = rustix::fs::fstat(file).map_err(|e| Error::io("fstat", e))?;
    Ok((st.st_size as u64, st.st_dev, st.st_ino))
}

/// Sizes a new shm object to `len` bytes and reserves them: `posix_fallocate` charges
/// every page to the tmpfs now, so a region that does not fit is `Err(ENOSPC)` here. After
/// a bare `ftruncate` the file would be sparse, and the first write past the free space
/// (`MAP_POPULATE` does not reserve either) would kill the process with SIGBUS.
pub fn reserve(file: &File, len: u64) -> std::result::Result<(), Errno> {
    loop {
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len) {
            // A signal arrived while the kernel was allocating: what it allocated stays,
            // so asking again finishes the job.
            Err(Errno::INTR) => continue,
            // A filesystem without fallocate (not tmpfs): size it the old way.
            Err(Errno::OPNOTSUPP) => return rustix::fs::ftruncate(file, len),
            other => return other,
        }
    }
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

// Byte locks: open file description (OFD) record locks on one byte of a file. Like a
// `flock` they belong to the open file description, so the kernel drops them when the
// last descriptor of it closes, however the holder ends, and closing another descriptor
// of the same file does not (classic POSIX record locks, rustix's `fcntl_lock`, are
// dropped then); unlike a `flock`, each party can hold its own byte of one file. They and
// `flock`s do not see each other (Linux). A forked child shares the description, hence
// the lock, until it closes its copy.

/// `fcntl(fd, cmd, {l_type, SEEK_SET, byte, 1})`; returns the struct as the kernel left it.
fn byte_lock(file: &File, cmd: libc::c_int, l_type: libc::c_int, byte: u64) -> Result<libc::flock, Errno> {
    use std::os::fd::AsRawFd;
    let start = libc::off_t::try_from(byte).map_err(|_| Errno::INVAL)?;
    let mut lock = libc::flock {
        l_type: l_type as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: start,
        l_len: 1,
        // Must be 0 for OFD locks.
        l_pid: 0,
    };
    // SAFETY: `file` is an open descriptor for the duration of the call, `cmd` is one of
    // F_OFD_SETLK/F_OFD_GETLK, which read and (GETLK) write a `struct flock` through the
    // pointer, and `lock` is a valid, initialised one that outlives the call.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut lock as *mut libc::flock) };
    if r == -1 {
        return Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO));
    }
    Ok(lock)
}

/// Takes the write lock on `byte` of `file` without waiting; `Ok(false)` if another open
/// file description holds it.
pub fn try_lock_byte(file: &File, byte: u64) -> Result<bool> {
    match byte_lock(file, libc::F_OFD_SETLK, libc::F_WRLCK, byte) {
        Ok(_) => Ok(true),
        Err(Errno::AGAIN) | Err(Errno::ACCESS) => Ok(false),
        Err(e) => Err(Error::io("fcntl(F_OFD_SETLK)", e)),
    }
}

/// Whether another open file description holds a lock on `byte` of `file` (asked of the
/// kernel without taking anything: `F_OFD_GETLK`).
pub fn byte_locked_by_other(file: &File, byte: u64) -> Result<bool> {
    let lock = byte_lock(file, libc::F_OFD_GETLK, libc::F_WRLCK, byte)
        .map_err(|e| Error::io("fcntl(F_OFD_GETLK)", e))?;
    Ok(i32::from(lock.l_type) != libc::F_UNLCK)
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

pub fn current_pid() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// Process start time in clock ticks after boot, with the state letter, from
/// `/proc/PID/stat`. `None` if there is no such process.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold anything: parse after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 is the state; starttime is field 22, i.e. 19 fields further on.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

pub fn process_start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, t)| t)
}

/// Whether the process `pid` that started at `start_time` still runs. A zombie counts as
/// dead (it has exited, nobody reaped it yet); a live process with another start time is
/// a reused pid, so the one we knew is dead too.
pub fn process_alive(pid: u32, start_time: u64) -> bool {
    if pid == 0 {
        return false;
    }
    match proc_stat(pid) {
        Some((state, start)) => start == start_time && state != 'Z' && state != 'X',
        None => false,
    }
}

/// 128 random bits as 32 lowercase hex digits.
pub fn random_hex128() -> Result<String> {
    let mut buf = [0u8; 16];
    rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| Error::io("getrandom", e))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
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
    fn random_names_differ() {
        let a = random_hex128().unwrap();
        let b = random_hex128().unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
    }
}
