//! The platform layer of fd passing (protocol 1.3, `docs/protocol.md` §3.6): the
//! per-region Unix-domain socket an engine with Vulkan tensors listens on, and the one
//! message it answers a connection with: a 12-byte reply carrying the fds (`SCM_RIGHTS`).
//!
//! The socket lives in Linux's abstract namespace, at `"\0" + region name + ".fd"`: it
//! has no file to remove, and goes away with the engine's listening fd however the
//! engine exits. An abstract socket has no permission bits, so the engine checks each
//! peer's uid (`SO_PEERCRED`) before it sends anything. All calls go through rustix.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{
    self, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::error::{Error, Result};

/// The reply's first bytes.
pub const REPLY_MAGIC: [u8; 4] = *b"SBFD";
/// Version of the reply format.
pub const REPLY_VERSION: u8 = 1;
/// Size of the reply: magic, version, status, fd count (u16 LE), 4 reserved zero bytes.
pub const REPLY_SIZE: usize = 12;
/// At most this many fds in one reply (64 tensors, each memory and semaphore).
pub const MAX_FDS: usize = 128;

/// What the engine answers a connection with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReplyStatus {
    /// The fds follow, in the documented order.
    Ok = 0,
    /// The peer runs as another user than the engine.
    WrongUser = 1,
    /// The peer is not the process attached as the region's client.
    NotTheClient = 2,
    /// The engine is closing.
    Closing = 3,
}

impl ReplyStatus {
    pub fn from_code(c: u8) -> Option<ReplyStatus> {
        match c {
            0 => Some(ReplyStatus::Ok),
            1 => Some(ReplyStatus::WrongUser),
            2 => Some(ReplyStatus::NotTheClient),
            3 => Some(ReplyStatus::Closing),
            _ => None,
        }
    }
}

/// The abstract socket name of a region (without the leading NUL).
pub fn socket_name(region: &str) -> String {
    format!("{region}.fd")
}

fn address(region: &str) -> Result<SocketAddrUnix> {
    SocketAddrUnix::new_abstract_name(socket_name(region).as_bytes()).map_err(|_| {
        Error::InvalidName {
            name: region.to_string(),
            reason: "too long for a socket name: engines with Vulkan tensors take names of at most 100 characters",
        }
    })
}

/// A new Unix-domain stream socket, close-on-exec.
fn unix_stream() -> Result<OwnedFd> {
    net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Error::io("socket(AF_UNIX)", e))
}

/// This process's effective uid.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The engine's listening socket.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
}

/// A connected peer, with who it is (`SO_PEERCRED`: the credentials it had when it
/// connected).
#[derive(Debug)]
pub struct PeerConn {
    fd: OwnedFd,
    pub pid: u32,
    pub uid: u32,
}

impl Listener {
    /// Binds and listens on the region's abstract socket. `NameInUse` if a socket of that
    /// name exists (another engine of the same region name).
    pub fn bind(region: &str) -> Result<Listener> {
        let addr = address(region)?;
        let fd = unix_stream()?;
        match net::bind(&fd, &addr) {
            Ok(()) => {}
            Err(Errno::ADDRINUSE) => {
                return Err(Error::NameInUse {
                    name: region.to_string(),
                })
            }
            Err(e) => return Err(Error::io(format!("bind('@{}')", socket_name(region)), e)),
        }
        net::listen(&fd, 16).map_err(|e| Error::io("listen", e))?;
        Ok(Listener { fd })
    }

    /// Waits for the next connection. `Ok(None)` once [`Listener::shutdown`] was called.
    pub fn accept(&self) -> Result<Option<PeerConn>> {
        loop {
            match net::accept_with(&self.fd, SocketFlags::CLOEXEC) {
                Ok(fd) => {
                    let cred = match net::sockopt::socket_peercred(&fd) {
                        Ok(c) => c,
                        // The peer left already: nothing to answer.
                        Err(_) => continue,
                    };
                    return Ok(Some(PeerConn {
                        fd,
                        pid: cred.pid.as_raw_nonzero().get() as u32,
                        uid: cred.uid.as_raw(),
                    }));
                }
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
                // `shutdown` makes a blocked accept return EINVAL on Linux.
                Err(Errno::INVAL) => return Ok(None),
                Err(e) => return Err(Error::io("accept", e)),
            }
        }
    }

    /// Wakes a blocked [`accept`](Listener::accept) (which then returns `None`) and
    /// refuses further connections.
    pub fn shutdown(&self) {
        let _ = net::shutdown(&self.fd, net::Shutdown::Both);
    }
}

impl PeerConn {
    /// Sends the reply: `status`, and with `Ok` the fds, in order, as one `SCM_RIGHTS`
    /// message. The receiver gets its own copies; ours stay open.
    pub fn reply(&self, status: ReplyStatus, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let fds = if status == ReplyStatus::Ok { fds } else { &[] };
        if fds.len() > MAX_FDS {
            return Err(Error::InvalidSpec(format!(
                "{} fds to pass; at most {MAX_FDS}",
                fds.len()
            )));
        }
        let mut msg = [0u8; REPLY_SIZE];
        msg[..4].copy_from_slice(&REPLY_MAGIC);
        msg[4] = REPLY_VERSION;
        msg[5] = status as u8;
        msg[6..8].copy_from_slice(&(fds.len() as u16).to_le_bytes());
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(Error::io(
                "sendmsg",
                std::io::Error::other("the fds do not fit the control buffer"),
            ));
        }
        // The peer may have gone already; a short or failed send is its problem (it
        // sees an error), never the engine's.
        net::sendmsg(
            &self.fd,
            &[IoSlice::new(&msg)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(|e| Error::io("sendmsg", e))?;
        Ok(())
    }
}

/// The client's side: connects to the region's socket and receives exactly `expected`
/// fds. The reply must arrive within `timeout`. A refusal is a typed error
/// (`PermissionDenied` for another user, `Protocol` otherwise); any fd received beyond
/// what is expected is closed, and so is every fd when the reply is wrong.
pub fn receive(region: &str, expected: usize, timeout: Duration) -> Result<Vec<OwnedFd>> {
    let addr = address(region)?;
    let fd = unix_stream()?;
    match net::connect(&fd, &addr) {
        Ok(()) => {}
        Err(Errno::CONNREFUSED) | Err(Errno::NOENT) => {
            return Err(Error::Protocol {
                peer: crate::error::Peer::Engine,
                detail: format!(
                    "no engine listens on socket '@{}' for the Vulkan tensors' fds",
                    socket_name(region)
                ),
            })
        }
        Err(e) => return Err(Error::io(format!("connect('@{}')", socket_name(region)), e)),
    }
    let timeout = timeout.max(Duration::from_millis(1));
    net::sockopt::set_socket_timeout(&fd, net::sockopt::Timeout::Recv, Some(timeout))
        .map_err(|e| Error::io("setsockopt(SO_RCVTIMEO)", e))?;
    receive_reply(fd.as_fd(), region, expected)
}

fn receive_reply(fd: BorrowedFd<'_>, region: &str, expected: usize) -> Result<Vec<OwnedFd>> {
    let protocol = |detail: String| Error::Protocol {
        peer: crate::error::Peer::Engine,
        detail,
    };
    let mut msg = [0u8; REPLY_SIZE];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match net::recvmsg(
            fd,
            &mut [IoSliceMut::new(&mut msg)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
        ) {
            Ok(r) => break r,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => {
                return Err(Error::Timeout {
                    waited: Duration::ZERO,
                    what: "the engine's reply on the fd socket",
                })
            }
            Err(e) => return Err(Error::io("recvmsg", e)),
        }
    };
    // Take ownership of every fd that arrived first, so that each is closed exactly
    // once whatever is wrong with the reply.
    let mut fds: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(protocol(
            "the engine sent more fds than a reply holds".into(),
        ));
    }
    if got.bytes != REPLY_SIZE || msg[..4] != REPLY_MAGIC || msg[4] != REPLY_VERSION {
        return Err(protocol(format!(
            "not a shmbridge fd reply ({} bytes: {:02x?})",
            got.bytes,
            &msg[..got.bytes.min(REPLY_SIZE)]
        )));
    }
    let count = u16::from_le_bytes([msg[6], msg[7]]) as usize;
    match ReplyStatus::from_code(msg[5]) {
        Some(ReplyStatus::Ok) => {}
        Some(ReplyStatus::WrongUser) => {
            return Err(Error::PermissionDenied {
                name: region.to_string(),
            })
        }
        Some(ReplyStatus::NotTheClient) => {
            return Err(protocol(
                "the engine refused the fds: this process is not its attached client".into(),
            ))
        }
        Some(ReplyStatus::Closing) => {
            return Err(Error::PeerClosed {
                peer: crate::error::Peer::Engine,
            })
        }
        None => return Err(protocol(format!("unknown reply status {}", msg[5]))),
    }
    if count != fds.len() || count != expected {
        return Err(protocol(format!(
            "the reply announces {count} fds and carries {}; the tensor table calls for {expected}",
            fds.len()
        )));
    }
    Ok(fds)
}

/// Whether a socket named `@<region>.fd` is bound now (from `/proc/net/unix`), for
/// checks that nothing was left behind.
pub fn socket_bound(region: &str) -> bool {
    let want = format!("@{}", socket_name(region));
    std::fs::read_to_string("/proc/net/unix")
        .map(|t| {
            t.lines()
                .any(|l| l.split_whitespace().last() == Some(want.as_str()))
        })
        .unwrap_or(false)
}

/// Size of the file behind `fd` when the kernel knows it: `st_size` of a regular file
/// (a memfd), else the end offset of a seekable one (a dma-buf). `None` when neither
/// tells (an opaque driver fd): the driver's import is then the check.
pub fn fd_size(fd: BorrowedFd<'_>) -> Option<u64> {
    let st = rustix::fs::fstat(fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile {
        return u64::try_from(st.st_size).ok();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fds_pass_in_order_and_refusals_are_typed() {
        let region = format!("shmbridge-fdpass-test-{}", std::process::id());
        let listener = Listener::bind(&region).unwrap();
        assert!(socket_bound(&region));
        // A second engine of the same name cannot take the socket.
        assert!(matches!(
            Listener::bind(&region),
            Err(Error::NameInUse { .. })
        ));
        let a = rustix::fs::memfd_create("a", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let b = rustix::fs::memfd_create("b", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&a, 4096).unwrap();
        rustix::fs::ftruncate(&b, 8192).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let c = listener.accept().unwrap().unwrap();
                assert_eq!(c.uid, euid());
                assert_eq!(c.pid, std::process::id());
                c.reply(ReplyStatus::Ok, &[a.as_fd(), b.as_fd()]).unwrap();
                let c = listener.accept().unwrap().unwrap();
                c.reply(ReplyStatus::WrongUser, &[a.as_fd()]).unwrap();
                let c = listener.accept().unwrap().unwrap();
                c.reply(ReplyStatus::Ok, &[a.as_fd()]).unwrap();
            });
            let fds = receive(&region, 2, Duration::from_secs(10)).unwrap();
            let sizes: Vec<_> = fds.iter().map(|f| fd_size(f.as_fd())).collect();
            assert_eq!(sizes, [Some(4096), Some(8192)]);
            assert!(matches!(
                receive(&region, 2, Duration::from_secs(10)),
                Err(Error::PermissionDenied { .. })
            ));
            assert!(matches!(
                receive(&region, 2, Duration::from_secs(10)),
                Err(Error::Protocol { .. })
            ));
        });
        listener.shutdown();
        assert!(listener.accept().unwrap().is_none());
        drop(listener);
        assert!(!socket_bound(&region));
    }
}
