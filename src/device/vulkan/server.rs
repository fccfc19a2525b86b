//! The engine's fd server: a small thread that accepts connections on the region's
//! socket and answers each with the fds, after checking who connected.
//!
//! A thread rather than the step loop: a client connects while it attaches, which may
//! be before frame 0 or while the engine is busy in a long step or asleep in
//! `wait_actions`; its attach must not depend on where the engine's loop is. The thread
//! blocks in `accept` and costs nothing between attaches; `stop` wakes it (`shutdown`)
//! and joins it.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::control::{ClientState, ControlMapping, EngineState};
use crate::error::Result;
use crate::fdpass::{self, Listener, ReplyStatus};
use crate::layout::vulkan::SharedFd;

#[derive(Debug)]
pub struct FdServer {
    listener: Arc<Listener>,
    thread: Option<JoinHandle<()>>,
}

impl FdServer {
    /// Serves `fds` (in protocol order) on `listener` to the region's attached client:
    /// the peer must run as this process's user (`SO_PEERCRED` uid) and be the process
    /// in the control block's client slot (its pid, `client_state = ATTACHED`). The
    /// thread reads those words through a second mapping of its own, valid for as long
    /// as it runs, whatever becomes of the engine's.
    pub fn start(
        listener: Listener,
        region: &dyn ControlMapping,
        fds: Vec<SharedFd>,
    ) -> Result<FdServer> {
        let listener = Arc::new(listener);
        let control = region.map_again()?;
        let l = listener.clone();
        let thread = std::thread::Builder::new()
            .name("shmbridge-fds".into())
            .spawn(move || serve(&l, &*control, &fds))
            .map_err(|e| crate::error::Error::io("starting the fd server thread", e))?;
        Ok(FdServer {
            listener,
            thread: Some(thread),
        })
    }

    /// Stops accepting and joins the thread.
    pub fn stop(&mut self) {
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

fn serve(listener: &Listener, region: &dyn ControlMapping, fds: &[SharedFd]) {
    let me = fdpass::euid();
    while let Ok(Some(conn)) = listener.accept() {
        let control = region.control();
        let status = if conn.uid != me {
            ReplyStatus::WrongUser
        } else if control.engine_state() == EngineState::Closed {
            ReplyStatus::Closing
        } else if control.client_state() != ClientState::Attached
            || control.client_identity().0 != conn.pid
        {
            ReplyStatus::NotTheClient
        } else {
            ReplyStatus::Ok
        };
        if status != ReplyStatus::Ok {
            eprintln!(
                "shmbridge: refused the Vulkan fds to pid {} (uid {}): {status:?}",
                conn.pid, conn.uid
            );
        }
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        // A peer that left before the reply is its own problem.
        let _ = conn.reply(status, &borrowed);
    }
}
