//! The region's fd socket (`docs/protocol.md` §3.6), both ends: the engine's fd server,
//! a small thread that accepts connections on the region's socket, says hello to each
//! with the engine's proof, and answers the attached client's request with the fds; and
//! the client's [`receive`], which checks who answers before it shows its own proof.
//! Backend-neutral: it serves Vulkan tensors' fds (1.3) and the fd of CUDA memory shared
//! by file descriptor (1.9) alike.
//!
//! A thread rather than the step loop: a client connects while it attaches, which may
//! be before frame 0 or while the engine is busy in a long step or asleep in
//! `wait_actions`; its attach must not depend on where the engine's loop is. The thread
//! sleeps in `poll` on the socket and the connections it waits on, waking between
//! attaches once a second to look after the engine's proof ([`KEEP_PROOF_EVERY`]);
//! `stop` wakes it (`shutdown`) and joins it. No peer holds up another: it waits on up
//! to [`fdpass::MAX_PEERS`] connections at once, each for at most
//! [`fdpass::PEER_TIMEOUT`], answers the requests already there and then drops the
//! oldest to make room for a new one, and never blocks on a peer: not on its socket,
//! and not on the close of a descriptor it sent (`fdpass::Untrusted`).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::control::{
    ClientState, ControlMapping, EngineState, CLIENT_PROOF_BYTE, ENGINE_PROOF_BYTE,
};
use crate::error::{Error, Peer, Result};
use crate::fdpass::{self, Accepted, Conn, Listener, PeerCred, ReplyStatus};
use crate::layout::vulkan::SharedFd;
use crate::layout::Layout;
use crate::os;

#[derive(Debug)]
pub struct FdServer {
    listener: Arc<Listener>,
    thread: Option<JoinHandle<()>>,
    /// The process that started it: a child forked from it has a copy of this value but
    /// not the thread, and must neither shut the socket it shares with its parent nor
    /// join a thread that does not exist in it.
    pid: u32,
}

impl FdServer {
    /// Serves `fds` (in protocol order) on `listener` to the region's attached client.
    /// Every peer of this process's user (`SO_PEERCRED` uid) is greeted with the
    /// engine's own proof, so that a client checks who answers before it shows its
    /// proof; the peer gets `fds` if the descriptor it then sends holds the client's
    /// proof byte ([`CLIENT_PROOF_BYTE`], which the attached client holds from before it
    /// claims the slot until it closes, and nobody else can hold meanwhile) while a
    /// client is attached. Nothing the control block says about who the client is
    /// counts. The thread reads the control words and checks the proofs through a second
    /// mapping of its own (which keeps the engine's proof), valid for as long as it
    /// runs, whatever becomes of the engine's.
    pub fn start(
        listener: Listener,
        region: &dyn ControlMapping,
        fds: Vec<SharedFd>,
    ) -> Result<FdServer> {
        let listener = Arc::new(listener);
        let region = region.map_again()?;
        let l = listener.clone();
        let thread = std::thread::Builder::new()
            .name("shmbridge-fds".into())
            .spawn(move || serve(&l, &*region, &fds))
            .map_err(|e| Error::io("starting the fd server thread", e))?;
        Ok(FdServer {
            listener,
            thread: Some(thread),
            pid: os::current_pid(),
        })
    }

    /// Binds the region's socket (1.6: `<name>.fd` beside it in /dev/shm) and serves
    /// `fds` on it ([`FdServer::start`]). Called once the region's name is this engine's
    /// and before it is published, so a client that sees the region finds the socket.
    pub fn bind_and_start(region: &dyn ControlMapping, fds: Vec<SharedFd>) -> Result<FdServer> {
        let listener = Listener::bind(&crate::control::socket_path(region.name())?)?;
        FdServer::start(listener, region, fds)
    }

    /// Stops accepting and joins the thread. In a child forked from the process that
    /// started it: nothing (the socket and the thread are its parent's).
    pub fn stop(&mut self) {
        if self.pid != os::current_pid() {
            // What the child copied is left as it is (the child's exit frees it).
            std::mem::forget(self.thread.take());
            return;
        }
        self.listener.shutdown();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `expected` fds of region `name`'s engine, from the engine and nobody else
/// (protocol 1.8, §3.6): connects to the region's fd socket and checks who answers
/// before it shows anything of its own: the server runs as this user (`SO_PEERCRED`), is
/// the engine's process where this PID namespace shows the engine, and proves it owns
/// the region (the descriptor its hello carries holds the engine's proof byte). Anything
/// else is a `Protocol` error naming who answered, and this client's proof never left
/// it. Then it sends its proof (`region`'s, a descriptor holding the client's proof
/// byte: the engine sends fds only to its attached client) and takes the fds. An
/// exchange the server refused as unread (it made room for newer peers) is tried again
/// while `timeout` allows ([`fdpass::exchange`]); every descriptor received from a
/// process not found to be the engine is closed off this thread
/// (`os::close_untrusted`).
pub fn receive(
    name: &str,
    layout: &Layout,
    region: &dyn ControlMapping,
    expected: usize,
    timeout: Duration,
) -> Result<Vec<std::os::fd::OwnedFd>> {
    let path = crate::control::socket_path(name)?;
    let proof = region.client_proof()?;
    let euid = fdpass::euid();
    let (pid, start) = (layout.engine_pid, layout.engine_start_time);
    let mut check = |exchange: &fdpass::Exchange| -> Result<()> {
        let not_the_engine = |why: String| Error::Protocol {
            peer: Peer::Engine,
            detail: format!(
                "the process answering on the fd socket '{path}' ({}) is not the engine of \
                 region '{name}': {why}; this client did not show it its proof, and took no fd \
                 from it",
                exchange.server
            ),
        };
        if exchange.server.uid != euid {
            return Err(not_the_engine(format!(
                "it runs as uid {}, this process as uid {euid}",
                exchange.server.uid
            )));
        }
        if os::process_seen(pid, start).is_some() && exchange.server.pid != Some(pid) {
            return Err(not_the_engine(format!("the engine is pid {pid}")));
        }
        if let Err(why) = region.proves(exchange.proof.as_fd(), ENGINE_PROOF_BYTE)? {
            return Err(not_the_engine(format!(
                "its proof of owning the region fails: {why}"
            )));
        }
        Ok(())
    };
    let answer = fdpass::exchange(name, &path, expected, timeout, proof.as_fd(), &mut check)?;
    // The engine's proof, found to be the region's file: its close cannot block (tmpfs),
    // and it is closed here, now.
    drop(answer.proof.into_owned());
    Ok(answer.fds)
}

/// What the engine says first to a new peer: `Ok` (it gets the engine's proof) unless
/// it runs as another user or the engine is closing. Nothing of the control block is read
/// once the region is found truncated.
fn greet(conn: &Conn, region: &dyn ControlMapping, me: u32) -> ReplyStatus {
    if region.check_size().is_err() || region.control().engine_state() == EngineState::Closed {
        return ReplyStatus::Closing;
    }
    if conn.peer.uid != me {
        return ReplyStatus::WrongUser;
    }
    ReplyStatus::Ok
}

/// Whether the peer that sent `proof` is the region's attached client: a client is
/// attached (`ATTACHED`, the engine not closing) and `proof` is the open file description
/// that holds [`CLIENT_PROOF_BYTE`] ([`ControlMapping::proves`]). The kernel lets one
/// description hold that lock at a time, and the attached client takes it before it
/// claims the slot and keeps it until it closes: a process that writes itself into the
/// slot, or takes locks derived from what the slot says, proves nothing.
fn judge(proof: BorrowedFd<'_>, region: &dyn ControlMapping) -> ReplyStatus {
    // The peer may have taken its time: look again before reading the control block.
    if region.check_size().is_err() {
        return ReplyStatus::Closing;
    }
    let control = region.control();
    if control.engine_state() == EngineState::Closed {
        return ReplyStatus::Closing;
    }
    if control.client_state() != ClientState::Attached {
        return ReplyStatus::NotTheClient;
    }
    match region.proves(proof, CLIENT_PROOF_BYTE) {
        Ok(Ok(())) => ReplyStatus::Ok,
        _ => ReplyStatus::NotTheClient,
    }
}

/// A greeted peer the server waits on for its request.
struct Waiting {
    conn: Conn,
    deadline: Instant,
}

/// How often at least the server makes its proof description hold the engine's proof
/// byte and nothing else ([`Proof::keep`]), whether or not a peer connects.
const KEEP_PROOF_EVERY: Duration = Duration::from_secs(1);

/// The engine's proof: the open file description every greeted peer receives, and so
/// may change the locks of (release the engine's byte, or lock the client's proof byte
/// through it, for as long as the engine lives). Before each hello and each judgement,
/// and at least every [`KEEP_PROOF_EVERY`], it is made to hold the engine's byte and
/// nothing else again; a byte it cannot take back (someone else took it meanwhile) is
/// said loudly, once.
struct Proof<'a> {
    fd: BorrowedFd<'a>,
    region: &'a str,
    lost: bool,
}

impl Proof<'_> {
    fn keep(&mut self) {
        let held = os::hold_only_byte(self.fd, ENGINE_PROOF_BYTE);
        match (&held, self.lost) {
            (Ok(true), true) => {
                self.lost = false;
                eprintln!(
                    "shmbridge: the engine of region '{}' holds its proof of ownership again",
                    self.region
                );
            }
            (Ok(false), false) | (Err(_), false) => {
                self.lost = true;
                eprintln!(
                    "shmbridge: ERROR: the engine of region '{}' lost its proof of ownership (a \
                     process of this user released it through the descriptor the fd socket hands \
                     out, {}): no client can attach until it is back",
                    self.region,
                    match held {
                        Ok(_) => "and another descriptor holds it now".to_string(),
                        Err(e) => format!("and taking it back failed: {e}"),
                    }
                );
            }
            _ => {}
        }
    }
}

/// Judges the request of `w`, which reads as readable, and answers it.
fn answer(
    w: Waiting,
    region: &dyn ControlMapping,
    proof: &mut Proof<'_>,
    tensor_fds: &[BorrowedFd<'_>],
    refusals: &mut Refusals<'_>,
) {
    let status = match w.conn.try_read_request() {
        Ok(theirs) => {
            proof.keep();
            let status = judge(theirs.as_fd(), region);
            if status == ReplyStatus::Ok {
                // The client's proof, found to be the region's file: its close cannot
                // block (tmpfs), and it is closed here, now.
                drop(theirs.into_owned());
            }
            // Anything else is closed off this thread (`fdpass::Untrusted`): its sender
            // chooses how long its close takes.
            status
        }
        Err(_) => ReplyStatus::BadRequest,
    };
    if status != ReplyStatus::Ok {
        refusals.note(status, &w.conn.peer);
    }
    // A peer that left before the reply is its own problem.
    let _ = w.conn.reply(status, tensor_fds);
}

/// Which of `conns` read as readable now (or hung up), without waiting.
fn readable_now(conns: &VecDeque<Waiting>) -> Option<Vec<bool>> {
    let fds: Vec<BorrowedFd<'_>> = conns.iter().map(|w| w.conn.as_fd()).collect();
    os::poll_readable(&fds, Some(Duration::ZERO)).ok()
}

fn serve(listener: &Listener, region: &dyn ControlMapping, fds: &[SharedFd]) {
    let me = os::euid();
    let mut refusals = Refusals::new(region.name());
    let mut waiting: VecDeque<Waiting> = VecDeque::new();
    // Not the creator's mapping: nothing to prove with (never the case for an engine's
    // server): nobody is served.
    let Some(proof) = region.engine_proof() else {
        return;
    };
    let mut proof = Proof {
        fd: proof,
        region: region.name(),
        lost: false,
    };
    let tensor_fds: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    let mut pause = Duration::from_millis(1);
    loop {
        proof.keep();
        // Peers past their time are answered and dropped (a late request is refused).
        let now = Instant::now();
        while waiting.front().is_some_and(|w| w.deadline <= now) {
            let w = waiting.pop_front().expect("looked at");
            let _ = w.conn.reply(ReplyStatus::BadRequest, &[]);
            refusals.note(ReplyStatus::BadRequest, &w.conn.peer);
        }
        // Deadlines are in arrival order: the first is the nearest.
        let timeout = waiting.front().map_or(KEEP_PROOF_EVERY, |w| {
            (w.deadline.saturating_duration_since(now) + Duration::from_millis(1))
                .min(KEEP_PROOF_EVERY)
        });
        let ready: Vec<bool> = {
            let mut fds: Vec<BorrowedFd<'_>> = Vec::with_capacity(waiting.len() + 1);
            fds.push(listener.as_fd());
            fds.extend(waiting.iter().map(|w| w.conn.as_fd()));
            match os::poll_readable(&fds, Some(timeout)) {
                Ok(ready) => ready,
                // EINTR, or no memory for the poll: look again.
                Err(_) => continue,
            }
        };
        // Requests first (in arrival order), then new peers.
        let mut kept = VecDeque::with_capacity(waiting.len());
        for (w, ready) in waiting.drain(..).zip(ready.iter().skip(1)) {
            if *ready {
                answer(w, region, &mut proof, &tensor_fds, &mut refusals);
            } else {
                kept.push_back(w);
            }
        }
        waiting = kept;
        if ready[0] {
            // Whatever is queued now, at most one place's worth per round.
            for _ in 0..fdpass::MAX_PEERS {
                let conn = match listener.try_accept() {
                    Accepted::Conn(c) => {
                        pause = Duration::from_millis(1);
                        c
                    }
                    Accepted::Nothing => break,
                    Accepted::Stopped => {
                        refusals.summarise();
                        return;
                    }
                    // Out of fds or memory: the connection stays queued; a pause (the
                    // peers already waiting are looked at again after it).
                    Accepted::Failed => {
                        std::thread::sleep(pause);
                        pause = (pause * 2).min(fdpass::ACCEPT_PAUSE_MAX);
                        break;
                    }
                };
                let status = greet(&conn, region, me);
                if status != ReplyStatus::Ok {
                    refusals.note(status, &conn.peer);
                    let _ = conn.hello(status, None, 0);
                    continue;
                }
                proof.keep();
                if conn
                    .hello(ReplyStatus::Ok, Some(proof.fd), tensor_fds.len())
                    .is_err()
                {
                    continue;
                }
                if waiting.len() >= fdpass::MAX_PEERS {
                    // Full: first the requests that came meanwhile are answered (a client
                    // that spoke is never the one made room with).
                    if let Some(ready) = readable_now(&waiting) {
                        let mut kept = VecDeque::with_capacity(waiting.len());
                        for (w, ready) in waiting.drain(..).zip(ready) {
                            if ready {
                                answer(w, region, &mut proof, &tensor_fds, &mut refusals);
                            } else {
                                kept.push_back(w);
                            }
                        }
                        waiting = kept;
                    }
                }
                if waiting.len() >= fdpass::MAX_PEERS {
                    // The oldest has had the longest to speak: it makes room.
                    if let Some(w) = waiting.pop_front() {
                        let _ = w.conn.reply(ReplyStatus::BadRequest, &[]);
                        refusals.note(ReplyStatus::BadRequest, &w.conn.peer);
                    }
                }
                waiting.push_back(Waiting {
                    conn,
                    deadline: Instant::now() + fdpass::PEER_TIMEOUT,
                });
            }
        }
        if listener.is_stopped() {
            break;
        }
    }
    refusals.summarise();
}

/// How often at most the server writes a summary of the refusals since the last line.
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// The engine's log of refused connections: the first of each kind in full, then counts,
/// summarised at most once a minute and when the server stops. Any local user of the
/// engine's may connect; none of them can fill the engine's log (the learner often
/// keeps it in a file) with a line per connection.
struct Refusals<'a> {
    region: &'a str,
    /// Refusals of each status since the last line, and whether one was ever printed.
    pending: [u64; 5],
    printed: [bool; 5],
    last_line: Instant,
}

impl<'a> Refusals<'a> {
    fn new(region: &'a str) -> Self {
        Refusals {
            region,
            pending: [0; 5],
            printed: [false; 5],
            last_line: Instant::now(),
        }
    }

    fn note(&mut self, status: ReplyStatus, peer: &PeerCred) {
        let i = status as usize;
        if !self.printed[i] {
            self.printed[i] = true;
            eprintln!(
                "shmbridge: refused the fds of region '{}' to {peer}: {} (further refusals are counted, and summarised at most once a minute)",
                self.region,
                status.describe()
            );
            return;
        }
        self.pending[i] += 1;
        if self.last_line.elapsed() >= SUMMARY_EVERY {
            self.summarise();
        }
    }

    fn summarise(&mut self) {
        let total: u64 = self.pending.iter().sum();
        if total == 0 {
            return;
        }
        let kinds: Vec<String> = self
            .pending
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .filter_map(|(i, &n)| {
                let status = ReplyStatus::from_code(i as u8)?;
                Some(format!("{n} {}", status.describe()))
            })
            .collect();
        eprintln!(
            "shmbridge: refused the fds of region '{}' {total} more time(s): {}",
            self.region,
            kinds.join(", ")
        );
        self.pending = [0; 5];
        self.last_line = Instant::now();
    }
}
