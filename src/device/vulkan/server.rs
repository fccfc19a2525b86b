//! The engine's fd server: a small thread that accepts connections on the region's
//! socket and answers each with the fds, after checking who connected.
//!
//! A thread rather than the step loop: a client connects while it attaches, which may
//! be before frame 0 or while the engine is busy in a long step or asleep in
//! `wait_actions`; its attach must not depend on where the engine's loop is. The thread
//! blocks in `accept` and costs nothing between attaches; `stop` wakes it (`shutdown`)
//! and joins it. Every wait of the thread is bounded: a peer gets
//! [`fdpass::PEER_TIMEOUT`] to send its request and take the reply.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::control::{client_proof_byte, ClientState, ControlMapping, EngineState};
use crate::error::Result;
use crate::fdpass::{self, Conn, Listener, PeerCred, ReplyStatus};
use crate::layout::vulkan::SharedFd;
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
    /// Serves `fds` (in protocol order) on `listener` to the region's attached client:
    /// the peer must run as this process's user (`SO_PEERCRED` uid), prove it is the
    /// process in the control block's client slot (the descriptor it sends holds the
    /// lock of that client's proof byte, [`client_proof_byte`]) and, where that
    /// process is visible in this PID namespace, be it (its `SO_PEERCRED` pid). It then
    /// gets the engine's own proof, then `fds`. The thread reads the control words and
    /// checks the proofs through a second mapping of its own (which keeps the engine's
    /// proof), valid for as long as it runs, whatever becomes of the engine's.
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
            .map_err(|e| crate::error::Error::io("starting the fd server thread", e))?;
        Ok(FdServer {
            listener,
            thread: Some(thread),
            pid: os::current_pid(),
        })
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

/// Whether the peer of `conn` is the region's attached client, as [`FdServer::start`]
/// says. Nothing of the control block is read once the region is found truncated.
fn judge(conn: &Conn, region: &dyn ControlMapping, me: u32) -> ReplyStatus {
    if region.check_size().is_err() {
        return ReplyStatus::Closing;
    }
    if conn.peer.uid != me {
        return ReplyStatus::WrongUser;
    }
    let Ok(proof) = conn.read_request() else {
        return ReplyStatus::BadRequest;
    };
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
    let (pid, start) = control.client_identity();
    // A dead client's proof byte is free for anyone to take: only a live one's counts.
    if !region.client_alive(pid, start) {
        return ReplyStatus::NotTheClient;
    }
    // A client this PID namespace shows (the same namespace, or a descendant in which
    // the pid it recorded happens to name it) must be the very peer: the kernel's pid
    // cannot be handed on, a descriptor can.
    if os::process_seen(pid, start).is_some() && conn.peer.pid != Some(pid) {
        return ReplyStatus::NotTheClient;
    }
    match region.proves(proof.as_fd(), client_proof_byte(pid, start)) {
        Ok(Ok(())) => ReplyStatus::Ok,
        _ => ReplyStatus::NotTheClient,
    }
}

fn serve(listener: &Listener, region: &dyn ControlMapping, fds: &[SharedFd]) {
    let me = fdpass::euid();
    let mut refusals = Refusals::new(region.name());
    while let Some(conn) = listener.accept() {
        let status = judge(&conn, region, me);
        let mut out: Vec<BorrowedFd<'_>> = Vec::with_capacity(fds.len() + 1);
        if status == ReplyStatus::Ok {
            match region.engine_proof() {
                Some(proof) => out.push(proof),
                // Not the creator's mapping: nothing to prove with (never the case for an
                // engine's server).
                None => continue,
            }
            out.extend(fds.iter().map(|f| f.as_fd()));
        } else {
            refusals.note(status, &conn.peer);
        }
        // A peer that left before the reply is its own problem.
        let _ = conn.reply(status, &out);
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
                "shmbridge: refused the Vulkan fds of region '{}' to {peer}: {} (further refusals are counted, and summarised at most once a minute)",
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
            "shmbridge: refused the Vulkan fds of region '{}' {total} more time(s): {}",
            self.region,
            kinds.join(", ")
        );
        self.pending = [0; 5];
        self.last_line = Instant::now();
    }
}
