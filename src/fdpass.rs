//! The platform layer of fd passing (protocol 1.6, `docs/protocol.md` §3.6): the Unix
//! socket an engine with Vulkan tensors (or, 1.9, CUDA memory shared by fd) listens on,
//! and the three messages of an exchange (1.8): the engine's hello (12 bytes, with the engine's proof fd), sent as soon
//! as it accepts, so that a client checks who answers before it shows anything of its
//! own; the client's request (12 bytes, with its proof fd); the engine's reply (12 bytes,
//! with the tensors' fds). All passed with `SCM_RIGHTS`.
//!
//! The socket is a file beside the region in /dev/shm (`control::socket_path`): it reaches
//! every process that shares /dev/shm, whatever its network namespace (an abstract
//! socket lives in one network namespace: a learner in another container never saw it,
//! and anyone in the learner's could bind the name). Who is at the other end is decided
//! by what each side proves, not by who bound a name: the peer's uid (`SO_PEERCRED`),
//! and the lock an fd it hands over holds on the region (`region::Region::proves`);
//! those rules are the callers' (`device::server`). This module moves the bytes and fds,
//! and bounds every wait: `connect` has a deadline, every send and receive a timeout.
//! The socket calls of the exchange (`socket`, `bind`, `listen`, `accept`, `connect`,
//! `sendmsg`/`recvmsg` with `SCM_RIGHTS`, the timeouts) are made here, through rustix: this
//! is the socket half of the platform layer, beside `os`, which has the rest (the peer's
//! credentials, the socket file's mode, `poll`, the files' checks).

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    self, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::error::{Error, Peer, Result};
use crate::os::{self, peer_credentials};
// Part of this module's interface (the callers' checks and tests use them).
pub use crate::os::{euid, fd_size, PeerCred};

/// The engine's hello's first bytes (1.8).
pub const HELLO_MAGIC: [u8; 4] = *b"SBFE";
/// A client's request's first bytes.
pub const REQUEST_MAGIC: [u8; 4] = *b"SBFQ";
/// The reply's first bytes.
pub const REPLY_MAGIC: [u8; 4] = *b"SBFD";
/// Version of every message (1: protocol 1.3's reply, with no request and no proof; 2:
/// 1.6's request then reply, the engine's proof in the reply; 3: 1.8's hello first, with
/// the engine's proof, then request and reply).
pub const MESSAGE_VERSION: u8 = 3;
/// Size of every message: magic, version, status (0 in a request), fd count (u16 LE, the
/// tensors' fds: the number the reply will carry in a hello, the number it carries in a
/// reply; 0 in a request), 4 reserved zero bytes.
pub const MESSAGE_SIZE: usize = 12;
/// At most this many tensor fds in one reply (64 tensors, each memory and semaphore).
pub const MAX_FDS: usize = 128;
/// How long the engine waits for a connected peer's request: a peer that connects and
/// says nothing holds one of the server's [`MAX_PEERS`] places no longer than this (and
/// holds up no other peer meanwhile).
pub const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections the engine's server waits on at once; the oldest is dropped to make room
/// for a new one, so a flood of silent connections never keeps a client out.
pub const MAX_PEERS: usize = 128;
/// Pending connections the listening socket queues (the server takes them at once).
const BACKLOG: i32 = 64;

/// What the engine answers a request with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReplyStatus {
    /// The engine's proof and the fds follow, in the documented order.
    Ok = 0,
    /// The peer runs as another user than the engine.
    WrongUser = 1,
    /// The peer did not prove it is the region's attached client (its descriptor does not
    /// hold the client's proof byte, or no client is attached).
    NotTheClient = 2,
    /// The engine is closing (or its region was truncated under it).
    Closing = 3,
    /// The request was not a request of this version, with one fd, or did not come in
    /// time.
    BadRequest = 4,
}

impl ReplyStatus {
    pub fn from_code(c: u8) -> Option<ReplyStatus> {
        match c {
            0 => Some(ReplyStatus::Ok),
            1 => Some(ReplyStatus::WrongUser),
            2 => Some(ReplyStatus::NotTheClient),
            3 => Some(ReplyStatus::Closing),
            4 => Some(ReplyStatus::BadRequest),
            _ => None,
        }
    }

    /// In words, for logs.
    pub fn describe(self) -> &'static str {
        match self {
            ReplyStatus::Ok => "served",
            ReplyStatus::WrongUser => "another user",
            ReplyStatus::NotTheClient => "not the attached client",
            ReplyStatus::Closing => "the engine is closing",
            ReplyStatus::BadRequest => "request unreadable or late",
        }
    }
}

/// A new Unix-domain stream socket, close-on-exec.
fn unix_stream(flags: SocketFlags) -> Result<OwnedFd> {
    net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | flags,
        None,
    )
    .map_err(|e| Error::io("socket(AF_UNIX)", e))
}

fn address(path: &str) -> Result<SocketAddrUnix> {
    SocketAddrUnix::new(path).map_err(|e| Error::io(format!("socket address '{path}'"), e))
}

/// Send and receive timeouts of a connected socket.
fn set_timeouts(fd: BorrowedFd<'_>, timeout: Duration) -> Result<()> {
    // At least a millisecond: a zero timeout means none.
    let t = Some(timeout.max(Duration::from_millis(1)));
    net::sockopt::set_socket_timeout(fd, net::sockopt::Timeout::Recv, t)
        .map_err(|e| Error::io("setsockopt(SO_RCVTIMEO)", e))?;
    net::sockopt::set_socket_timeout(fd, net::sockopt::Timeout::Send, t)
        .map_err(|e| Error::io("setsockopt(SO_SNDTIMEO)", e))
}

/// The engine's listening socket. Children forked from the engine do not keep it
/// ([`os::HeldFd`]): a child that outlives its parent must not keep the socket alive.
#[derive(Debug)]
pub struct Listener {
    fd: os::HeldFd,
    path: String,
    stopped: AtomicBool,
    /// `accept` failures it waited out (no fd or memory left for a connection).
    transient: AtomicU64,
}

/// A connected peer and who it is.
#[derive(Debug)]
pub struct Conn {
    fd: OwnedFd,
    pub peer: PeerCred,
}

impl Listener {
    /// Binds and listens at `path`, mode 0600. The caller owns the region whose socket
    /// this is (it holds the region's lock, and its name): a socket left there by this
    /// user (an engine of this name that died, or whose region was removed) is stale and
    /// replaced. Anything else there (another user's file, not a socket) is `NameInUse`,
    /// and is left.
    pub fn bind(path: &str) -> Result<Listener> {
        let addr = address(path)?;
        // Non-blocking: the server polls it, and a connection that went before `accept`
        // took it must not block the thread.
        let fd = unix_stream(SocketFlags::NONBLOCK)?;
        let taken = |why: String| {
            Error::io(
                format!("binding the fd socket '{path}'"),
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, why),
            )
        };
        let mut replaced = false;
        loop {
            match net::bind(&fd, &addr) {
                Ok(()) => break,
                Err(Errno::ADDRINUSE) if !replaced => {
                    replaced = true;
                    if let Err(what) = os::remove_socket_file(path)? {
                        return Err(taken(format!("{what} is in the way")));
                    }
                }
                Err(Errno::ADDRINUSE) => {
                    return Err(taken("another socket was bound there meanwhile".into()))
                }
                Err(e) => return Err(Error::io(format!("bind('{path}')"), e)),
            }
        }
        // The file takes the umask's mode at bind; connecting needs write permission on
        // it, so other users are refused by the kernel from here on (and by the uid
        // check of every connection before: the mode is defence in depth).
        os::owner_only(path)?;
        net::listen(&fd, BACKLOG).map_err(|e| Error::io("listen", e))?;
        Ok(Listener {
            fd: os::HeldFd::new(fd),
            path: path.to_string(),
            stopped: AtomicBool::new(false),
            transient: AtomicU64::new(0),
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Waits for the next connection; `None` once [`Listener::shutdown`] was called. For
    /// a server of one peer at a time (tests); the engine's polls ([`Listener::try_accept`]).
    pub fn accept(&self) -> Option<Conn> {
        let mut pause = Duration::from_millis(1);
        loop {
            match self.try_accept() {
                Accepted::Conn(c) => return Some(c),
                Accepted::Stopped => return None,
                Accepted::Nothing => {
                    let _ = os::poll_readable(&[self.fd.as_fd()], None);
                }
                Accepted::Failed => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                }
            }
        }
    }

    /// The next queued connection, without waiting: `Nothing` when none is queued (or it
    /// left before it was taken). An `accept` that fails for want of fds or memory
    /// (EMFILE, ENFILE, ENOBUFS, ENOMEM) is `Failed` and leaves the connection queued:
    /// the caller tries again after a pause (1 ms, doubling to [`ACCEPT_PAUSE_MAX`]), so
    /// the socket never listens with nobody accepting. The connection is blocking, with
    /// [`PEER_TIMEOUT`] on each send and receive (a server that polls receives with
    /// [`Conn::try_read_request`]).
    pub fn try_accept(&self) -> Accepted {
        loop {
            if self.is_stopped() {
                return Accepted::Stopped;
            }
            match net::accept_with(&self.fd, SocketFlags::CLOEXEC) {
                Ok(fd) => {
                    // The peer left already, or its socket is unusable: nothing to answer.
                    let Ok(peer) = peer_credentials(fd.as_fd()) else {
                        return Accepted::Nothing;
                    };
                    if set_timeouts(fd.as_fd(), PEER_TIMEOUT).is_err() {
                        return Accepted::Nothing;
                    }
                    return Accepted::Conn(Conn { fd, peer });
                }
                Err(Errno::AGAIN) | Err(Errno::CONNABORTED) => return Accepted::Nothing,
                Err(Errno::INTR) => {}
                // `shutdown` makes accept return EINVAL on Linux.
                Err(Errno::INVAL) if self.is_stopped() => return Accepted::Stopped,
                Err(_) => {
                    self.transient.fetch_add(1, Ordering::Relaxed);
                    return Accepted::Failed;
                }
            }
        }
    }

    /// Whether [`Listener::shutdown`] was called.
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The listening socket, for a server that polls it with its connections.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `accept` failures waited out so far.
    pub fn transient_errors(&self) -> u64 {
        self.transient.load(Ordering::Relaxed)
    }

    /// Wakes a blocked [`accept`](Listener::accept) (which then returns `None`) or a
    /// `poll` of the socket (it reads as hung up), and refuses further connections. The
    /// socket file is removed with the region.
    pub fn shutdown(&self) {
        self.stopped.store(true, Ordering::Release);
        let _ = net::shutdown(&self.fd, net::Shutdown::Both);
    }
}

/// What [`Listener::try_accept`] found.
#[derive(Debug)]
pub enum Accepted {
    Conn(Conn),
    /// No connection is queued now.
    Nothing,
    /// [`Listener::shutdown`] was called.
    Stopped,
    /// `accept` failed for want of fds or memory: pause, then try again.
    Failed,
}

/// The longest pause between two tries of an `accept` that failed for want of fds or
/// memory.
pub const ACCEPT_PAUSE_MAX: Duration = Duration::from_millis(100);

/// A 12-byte message: `magic`, version, `status`, `count` (u16 LE), 4 zero bytes.
fn message(magic: [u8; 4], status: u8, count: u16) -> [u8; MESSAGE_SIZE] {
    let mut msg = [0u8; MESSAGE_SIZE];
    msg[..4].copy_from_slice(&magic);
    msg[4] = MESSAGE_VERSION;
    msg[5] = status;
    msg[6..8].copy_from_slice(&count.to_le_bytes());
    msg
}

/// Sends `msg` with `fds` in one `SCM_RIGHTS` message (the receiver gets its own copies).
/// With `wait` false the send never blocks (`MSG_DONTWAIT`): the engine's server answers
/// many peers from one thread, and a message of 12 bytes to a connection that has read
/// nothing is queued at once or not at all.
fn send(fd: BorrowedFd<'_>, msg: &[u8], fds: &[BorrowedFd<'_>], wait: bool) -> Result<()> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS + 1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::io(
            "sendmsg",
            std::io::Error::other("the fds do not fit the control buffer"),
        ));
    }
    let flags = match wait {
        true => SendFlags::NOSIGNAL,
        false => SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
    };
    loop {
        match net::sendmsg(fd, &[IoSlice::new(msg)], &mut control, flags) {
            Ok(n) if n == msg.len() => return Ok(()),
            Ok(n) => {
                return Err(Error::io(
                    "sendmsg",
                    std::io::Error::other(format!("{n} of {} bytes sent", msg.len())),
                ))
            }
            Err(Errno::INTR) => continue,
            Err(e) => return Err(Error::io("sendmsg", e)),
        }
    }
}

/// Receives one message of [`MESSAGE_SIZE`] bytes and the fds riding with it (each owned
/// at once as [`Untrusted`], so that each is closed exactly once whatever is wrong, and
/// never by the caller's thread), within the socket's
/// receive timeout. `Err` when no complete message arrived, or more fds than fit. With
/// `wait` false it takes what is there (`MSG_DONTWAIT`): a message sent whole (as every
/// side of the exchange sends it) is there whole once the socket reads as readable; a
/// peer that sent part of one gets no second chance.
fn receive(
    fd: BorrowedFd<'_>,
    what: &'static str,
    wait: bool,
) -> Result<([u8; MESSAGE_SIZE], Vec<Untrusted>)> {
    let mut msg = [0u8; MESSAGE_SIZE];
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS + 1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match net::recvmsg(
            fd,
            &mut [IoSliceMut::new(&mut msg)],
            &mut control,
            match wait {
                true => RecvFlags::CMSG_CLOEXEC | RecvFlags::WAITALL,
                false => RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            },
        ) {
            Ok(r) => break r,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => {
                return Err(Error::Timeout {
                    waited: Duration::ZERO,
                    what,
                })
            }
            Err(e) => return Err(Error::io("recvmsg", e)),
        }
    };
    let mut fds: Vec<Untrusted> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received.map(Untrusted::new));
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(Error::BadMessage(format!(
            "{what}: more fds than a message holds"
        )));
    }
    if got.bytes != MESSAGE_SIZE {
        return Err(Error::BadMessage(format!(
            "{what}: {} bytes ({:02x?}), not {MESSAGE_SIZE}",
            got.bytes,
            &msg[..got.bytes.min(MESSAGE_SIZE)]
        )));
    }
    Ok((msg, fds))
}

impl Conn {
    /// The connected socket, for a server that polls it.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The engine's first message, sent as soon as it accepted: `Ok` with its proof, and
    /// the number of tensor fds its reply will carry to the attached client; any other
    /// status (wrong user, engine closing) with no fd, and nothing follows. Never blocks.
    pub fn hello(
        &self,
        status: ReplyStatus,
        proof: Option<BorrowedFd<'_>>,
        count: usize,
    ) -> Result<()> {
        let (fds, count) = match (status, proof) {
            (ReplyStatus::Ok, Some(p)) => (vec![p], count),
            _ => (Vec::new(), 0),
        };
        let count = u16::try_from(count)
            .ok()
            .filter(|&c| usize::from(c) <= MAX_FDS)
            .ok_or_else(|| Error::InvalidSpec(format!("{count} fds to pass; at most {MAX_FDS}")))?;
        send(
            self.fd.as_fd(),
            &message(HELLO_MAGIC, status as u8, count),
            &fds,
            false,
        )
    }

    /// The peer's request: the one fd it proves itself with. `BadMessage` for anything
    /// else (wrong magic or version, other than one fd), `Timeout` when nothing came
    /// within [`PEER_TIMEOUT`].
    pub fn read_request(&self) -> Result<Untrusted> {
        self.request_of(receive(
            self.fd.as_fd(),
            "a client's request on the fd socket",
            true,
        )?)
    }

    /// [`Conn::read_request`] of what is there now, for a server that polls: call it once
    /// the connection reads as readable (a request that came in part, or not at all, is
    /// `BadMessage` or `Timeout`).
    pub fn try_read_request(&self) -> Result<Untrusted> {
        self.request_of(receive(
            self.fd.as_fd(),
            "a client's request on the fd socket",
            false,
        )?)
    }

    fn request_of(
        &self,
        (msg, mut fds): ([u8; MESSAGE_SIZE], Vec<Untrusted>),
    ) -> Result<Untrusted> {
        if msg[..4] != REQUEST_MAGIC || msg[4] != MESSAGE_VERSION || fds.len() != 1 {
            return Err(Error::BadMessage(format!(
                "not a request of version {MESSAGE_VERSION} with one fd ({:02x?}, {} fds)",
                msg,
                fds.len()
            )));
        }
        Ok(fds.pop().expect("one fd"))
    }

    /// Sends the reply: `status`, and with `Ok` the tensors' fds, as one `SCM_RIGHTS`
    /// message (the receiver gets its own copies). Never blocks.
    pub fn reply(&self, status: ReplyStatus, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let fds = if status == ReplyStatus::Ok { fds } else { &[] };
        if fds.len() > MAX_FDS {
            return Err(Error::InvalidSpec(format!(
                "{} fds to pass; at most {MAX_FDS}",
                fds.len()
            )));
        }
        let msg = message(REPLY_MAGIC, status as u8, fds.len() as u16);
        send(self.fd.as_fd(), &msg, fds, false)
    }
}

/// What an engine answered: who it is (as the kernel says) and the fds it sent, its
/// proof first. Nothing here is trusted yet: the caller checks both.
#[derive(Debug)]
pub struct Answer {
    pub server: PeerCred,
    /// The server's proof of owning the region.
    pub proof: Untrusted,
    /// The tensors' fds, in protocol order.
    pub fds: Vec<OwnedFd>,
}

/// A descriptor received from a peer and not trusted (yet): dropped, it is closed by
/// [`os::close_untrusted`], so that nobody waits on what its sender made its close do.
#[derive(Debug)]
pub struct Untrusted(Option<OwnedFd>);

impl Untrusted {
    fn new(fd: OwnedFd) -> Untrusted {
        Untrusted(Some(fd))
    }

    /// The descriptor, once its sender is trusted (its close then is the caller's).
    pub fn into_owned(mut self) -> OwnedFd {
        self.0.take().expect("held until dropped or taken")
    }
}

impl AsFd for Untrusted {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0
            .as_ref()
            .expect("held until dropped or taken")
            .as_fd()
    }
}

impl Drop for Untrusted {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            os::close_untrusted(fd);
        }
    }
}

/// Waits (at most `timeout`) until every [`Untrusted`] dropped so far is closed; whether
/// it is. For tests that count this process's descriptors.
pub fn untrusted_closed(timeout: Duration) -> bool {
    os::untrusted_closed(timeout)
}

/// The client's side of an exchange once the server said hello: who the server is (as
/// the kernel says) and the proof it sent, neither trusted yet. The caller checks both
/// before it shows its own proof ([`Exchange::request`]); dropping it hangs up, having
/// sent nothing.
#[derive(Debug)]
pub struct Exchange {
    fd: OwnedFd,
    region: String,
    path: String,
    expected: usize,
    /// `None`: no time limit (a timeout too long to add to now).
    deadline: Option<Instant>,
    timeout: Duration,
    pub server: PeerCred,
    /// The server's proof of owning the region.
    pub proof: Untrusted,
}

/// Opens an exchange: connects to the socket at `path` (of region `region`, for
/// messages) and receives the server's hello, which must announce exactly `expected`
/// tensor fds, all within `timeout` (which bounds the whole exchange; `Duration::MAX`
/// for none). A refusal is a typed error (`PermissionDenied` for another user,
/// `PeerClosed` for a closing engine, `Protocol` otherwise); any fd received with a wrong
/// message is closed.
pub fn open_exchange(
    region: &str,
    path: &str,
    expected: usize,
    timeout: Duration,
) -> Result<Exchange> {
    open_until(
        region,
        path,
        expected,
        timeout,
        Instant::now().checked_add(timeout),
    )
}

/// Time left until `deadline` (`None`: no limit).
fn left(deadline: Option<Instant>) -> Duration {
    deadline.map_or(Duration::MAX, |d| {
        d.saturating_duration_since(Instant::now())
    })
}

/// [`open_exchange`] by `deadline` (for messages: of an exchange of `timeout`).
fn open_until(
    region: &str,
    path: &str,
    expected: usize,
    timeout: Duration,
    deadline: Option<Instant>,
) -> Result<Exchange> {
    let fd = connect(region, path, timeout, deadline)?;
    let server = peer_credentials(fd.as_fd())?;
    set_timeouts(fd.as_fd(), left(deadline))?;
    let (msg, mut fds) =
        receive_from_engine(fd.as_fd(), timeout, "the engine's hello on the fd socket")?;
    let count = check_message(region, path, &msg, HELLO_MAGIC)?;
    if count != expected || fds.len() != 1 {
        return Err(protocol(format!(
            "the hello announces {count} fds and carries {} proof(s); the tensor table calls for {expected} fds and one proof",
            fds.len()
        )));
    }
    let proof = fds.remove(0);
    Ok(Exchange {
        fd,
        region: region.to_string(),
        path: path.to_string(),
        expected,
        deadline,
        timeout,
        server,
        proof,
    })
}

impl Exchange {
    /// Sends the request carrying `proof` and receives the reply with exactly the
    /// expected tensor fds (typed refusals as [`open_exchange`]'s).
    pub fn request(&self, proof: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        tensor_fds(
            &self.region,
            &self.path,
            self.expected,
            self.reply_to(proof)?,
        )
    }

    /// Sends the request carrying `proof`; the reply as it came. A server that refused the
    /// request and hung up before it was sent (it made room for newer peers) leaves its
    /// reply queued: a send that finds the connection closed (`EPIPE`, `ECONNRESET`)
    /// reads it.
    fn reply_to(&self, proof: BorrowedFd<'_>) -> Result<([u8; MESSAGE_SIZE], Vec<Untrusted>)> {
        let left = left(self.deadline);
        if left.is_zero() {
            return Err(Error::Timeout {
                waited: self.timeout,
                what: "the engine's reply on the fd socket",
            });
        }
        set_timeouts(self.fd.as_fd(), left)?;
        match send(
            self.fd.as_fd(),
            &message(REQUEST_MAGIC, 0, 0),
            &[proof],
            true,
        ) {
            Ok(()) => {}
            Err(Error::Io { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EPIPE) | Some(libc::ECONNRESET)
                ) => {}
            Err(e) => return Err(e),
        }
        receive_from_engine(
            self.fd.as_fd(),
            self.timeout,
            "the engine's reply on the fd socket",
        )
    }
}

/// The tensors' fds of a reply (of the engine, checked before the request): exactly
/// `expected` with status 0, else its typed refusal.
fn tensor_fds(
    region: &str,
    path: &str,
    expected: usize,
    (msg, fds): ([u8; MESSAGE_SIZE], Vec<Untrusted>),
) -> Result<Vec<OwnedFd>> {
    let count = check_message(region, path, &msg, REPLY_MAGIC)?;
    if count != expected || fds.len() != count {
        return Err(protocol(format!(
            "the reply announces {count} fds and carries {}; the tensor table calls for {expected}",
            fds.len(),
        )));
    }
    Ok(fds.into_iter().map(Untrusted::into_owned).collect())
}

/// A whole exchange, from the engine and nobody else: opens it ([`open_exchange`]),
/// lets `check` look at who answered and what it proves (an `Err` ends it, before this
/// side showed anything), sends `proof`, and takes the reply, all within `timeout`
/// (`Duration::MAX` for none). A server that refused the request as unread (status 4:
/// it made room for newer peers, or had no fd left) is asked again, on a new
/// connection, while time is left (after a pause of 1 ms, doubling to 50 ms).
pub fn exchange(
    region: &str,
    path: &str,
    expected: usize,
    timeout: Duration,
    proof: BorrowedFd<'_>,
    check: &mut dyn FnMut(&Exchange) -> Result<()>,
) -> Result<Answer> {
    let deadline = Instant::now().checked_add(timeout);
    let mut pause = Duration::from_millis(1);
    loop {
        let exchange = open_until(region, path, expected, timeout, deadline)?;
        check(&exchange)?;
        let (msg, fds) = exchange.reply_to(proof)?;
        let unread = msg[..4] == REPLY_MAGIC
            && msg[4] == MESSAGE_VERSION
            && msg[5] == ReplyStatus::BadRequest as u8;
        let wait = pause.min(left(deadline));
        if unread && !wait.is_zero() {
            drop(fds);
            std::thread::sleep(wait);
            pause = (pause * 2).min(Duration::from_millis(50));
            continue;
        }
        return Ok(Answer {
            server: exchange.server,
            proof: exchange.proof,
            fds: tensor_fds(region, path, expected, (msg, fds))?,
        });
    }
}

fn protocol(detail: String) -> Error {
    Error::Protocol {
        peer: Peer::Engine,
        detail,
    }
}

/// [`receive`] on the client's side: a timeout says the whole exchange's, a malformed
/// message is the engine's `Protocol` error.
fn receive_from_engine(
    fd: BorrowedFd<'_>,
    timeout: Duration,
    what: &'static str,
) -> Result<([u8; MESSAGE_SIZE], Vec<Untrusted>)> {
    receive(fd, what, true).map_err(|e| match e {
        Error::Timeout { what, .. } => Error::Timeout {
            waited: timeout,
            what,
        },
        Error::BadMessage(m) => protocol(m),
        e => e,
    })
}

/// The fd count of an engine's message `msg` of kind `magic` (hello or reply) with
/// status 0; a refusal is its typed error.
fn check_message(
    region: &str,
    path: &str,
    msg: &[u8; MESSAGE_SIZE],
    magic: [u8; 4],
) -> Result<usize> {
    if msg[..4] != magic || msg[4] != MESSAGE_VERSION {
        return Err(protocol(format!(
            "not a shmbridge fd {} of version {MESSAGE_VERSION} ({msg:02x?})",
            if magic == HELLO_MAGIC {
                "hello"
            } else {
                "reply"
            }
        )));
    }
    match ReplyStatus::from_code(msg[5]) {
        Some(ReplyStatus::Ok) => Ok(u16::from_le_bytes([msg[6], msg[7]]) as usize),
        Some(ReplyStatus::WrongUser) => Err(Error::PermissionDenied {
            name: region.to_string(),
        }),
        Some(ReplyStatus::Closing) => Err(Error::PeerClosed { peer: Peer::Engine }),
        Some(s @ (ReplyStatus::NotTheClient | ReplyStatus::BadRequest)) => Err(protocol(format!(
            "the fd socket '{path}' refused this process ({}): {}",
            s.describe(),
            match s {
                ReplyStatus::NotTheClient => "the descriptor it showed does not hold the proof of the region's attached client (another process of this user holds it, or no client is attached)",
                _ => "its server could not read the request in time (not one of this version, or the engine had no file descriptor left for it)",
            }
        ))),
        None => Err(protocol(format!("unknown status {}", msg[5]))),
    }
}

/// Both steps of an exchange without checking the server in between ([`exchange`] with
/// no check): what a client must not do (it shows its proof to whoever answers); for
/// tests and tools that play a peer.
pub fn request(
    region: &str,
    path: &str,
    proof: BorrowedFd<'_>,
    expected: usize,
    timeout: Duration,
) -> Result<Answer> {
    exchange(region, path, expected, timeout, proof, &mut |_| Ok(()))
}

/// Connects to the socket at `path` by `deadline` (`None`: no limit; `timeout` for
/// messages). A listener whose queue is full answers a non-blocking `connect` with EAGAIN
/// at once (a Unix socket has no connect in progress): tried again after a pause (1 ms,
/// doubling to 50 ms) until the deadline.
fn connect(
    region: &str,
    path: &str,
    timeout: Duration,
    deadline: Option<Instant>,
) -> Result<OwnedFd> {
    let addr = address(path)?;
    let fd = unix_stream(SocketFlags::NONBLOCK)?;
    let mut pause = Duration::from_millis(1);
    loop {
        match net::connect(&fd, &addr) {
            Ok(()) => break,
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                let left = deadline.map_or(pause, |d| d.saturating_duration_since(Instant::now()));
                if left.is_zero() {
                    return Err(Error::Timeout {
                        waited: timeout,
                        what: "room in the engine's fd socket queue",
                    });
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(Errno::CONNREFUSED) | Err(Errno::NOENT) => {
                return Err(Error::Protocol {
                    peer: Peer::Engine,
                    detail: format!(
                        "no engine listens on the fd socket '{path}' for the tensors' fds"
                    ),
                })
            }
            // Mode 0600: the socket of another user's engine.
            Err(Errno::ACCESS) | Err(Errno::PERM) => {
                return Err(Error::PermissionDenied {
                    name: region.to_string(),
                })
            }
            Err(e) => return Err(Error::io(format!("connect('{path}')"), e)),
        }
    }
    // Blocking again: the exchange's waits are bounded by the socket's timeouts.
    os::set_blocking(&fd, true)?;
    Ok(fd)
}

/// Whether a socket file is at `path` now, for checks that nothing was left behind.
pub fn socket_file_exists(path: &str) -> bool {
    matches!(os::socket_file(path), Ok(os::AtPath::Socket { .. }))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A socket path of this test's own in /dev/shm (removed by the test).
    fn path(tag: &str) -> String {
        format!(
            "/dev/shm/shmbridge-fdpass-test-{tag}-{}.fd",
            std::process::id()
        )
    }

    #[test]
    fn fds_pass_in_order_and_refusals_are_typed() {
        let path = path("order");
        let listener = Listener::bind(&path).unwrap();
        assert!(socket_file_exists(&path));
        let mode = rustix::fs::stat(path.as_str()).unwrap().st_mode & 0o777;
        assert_eq!(mode, 0o600);
        let memfd = |size| {
            let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::fs::ftruncate(&fd, size).unwrap();
            fd
        };
        let (proof, a, b) = (memfd(1), memfd(4096), memfd(8192));
        let mine = memfd(3);
        std::thread::scope(|s| {
            s.spawn(|| {
                let c = listener.accept().unwrap();
                assert_eq!(c.peer.uid, euid());
                assert_eq!(c.peer.pid, Some(std::process::id()));
                c.hello(ReplyStatus::Ok, Some(proof.as_fd()), 2).unwrap();
                let got = c.read_request().unwrap();
                assert_eq!(fd_size(got.as_fd()), Some(3), "the client's proof");
                c.reply(ReplyStatus::Ok, &[a.as_fd(), b.as_fd()]).unwrap();
                // A refusal in the hello: nothing follows.
                let c = listener.accept().unwrap();
                c.hello(ReplyStatus::WrongUser, Some(proof.as_fd()), 2)
                    .unwrap();
                // A refusal in the reply.
                let c = listener.accept().unwrap();
                c.hello(ReplyStatus::Ok, Some(proof.as_fd()), 2).unwrap();
                c.read_request().unwrap();
                c.reply(ReplyStatus::NotTheClient, &[a.as_fd()]).unwrap();
                // A hello announcing another count than the table's.
                let c = listener.accept().unwrap();
                c.hello(ReplyStatus::Ok, Some(proof.as_fd()), 1).unwrap();
            });
            let t = Duration::from_secs(10);
            let answer = request("r", &path, mine.as_fd(), 2, t).unwrap();
            assert_eq!(answer.server.pid, Some(std::process::id()));
            assert_eq!(fd_size(answer.proof.as_fd()), Some(1));
            let sizes: Vec<_> = answer.fds.iter().map(|f| fd_size(f.as_fd())).collect();
            assert_eq!(sizes, [Some(4096), Some(8192)]);
            assert!(matches!(
                request("r", &path, mine.as_fd(), 2, t),
                Err(Error::PermissionDenied { .. })
            ));
            assert!(matches!(
                request("r", &path, mine.as_fd(), 2, t),
                Err(Error::Protocol { detail, .. }) if detail.contains("refused")
            ));
            assert!(matches!(
                open_exchange("r", &path, 2, t),
                Err(Error::Protocol { detail, .. }) if detail.contains("announces 1")
            ));
        });
        listener.shutdown();
        assert!(listener.accept().is_none());
        drop(listener);
        // The file is the region's to remove: still there, nobody listens.
        assert!(matches!(
            request("r", &path, mine.as_fd(), 2, Duration::from_secs(10)),
            Err(Error::Protocol { detail, .. }) if detail.contains("no engine listens")
        ));
        assert_eq!(os::remove_socket_file(&path).unwrap(), Ok(true));
        assert!(!socket_file_exists(&path));
    }

    /// A listener nobody accepts on, its queue full: `request` gives up at its deadline
    /// (before the fix `connect` blocked until a signal).
    #[test]
    fn a_full_queue_is_a_timeout_not_a_hang() {
        let path = path("full");
        let listener = Listener::bind(&path).unwrap();
        let addr = address(&path).unwrap();
        let mut queued = Vec::new();
        loop {
            let fd = unix_stream(SocketFlags::NONBLOCK).unwrap();
            match net::connect(&fd, &addr) {
                Ok(()) => queued.push(fd),
                Err(Errno::AGAIN) => break,
                Err(e) => panic!("connect: {e}"),
            }
        }
        let proof = rustix::fs::memfd_create("p", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(request(
                "r",
                &p,
                proof.as_fd(),
                1,
                Duration::from_millis(50),
            ));
        });
        let got = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("request hung on a full queue");
        assert!(
            matches!(got, Err(Error::Timeout { .. })),
            "{} queued, then {got:?}",
            queued.len()
        );
        drop(listener);
        os::remove_socket_file(&path).unwrap().unwrap();
    }

    /// What a stale socket of this user at the path (an engine that died) does to the next
    /// bind: replaced. Anything else there is left, and the bind refused.
    #[test]
    fn a_stale_socket_is_replaced_and_anything_else_refused() {
        let path = path("stale");
        drop(Listener::bind(&path).unwrap());
        let listener = Listener::bind(&path).expect("the stale socket is replaced");
        drop(listener);
        os::remove_socket_file(&path).unwrap().unwrap();
        std::fs::write(&path, b"not a socket").unwrap();
        let e = Listener::bind(&path).unwrap_err();
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
        std::fs::remove_file(&path).unwrap();
    }
}
