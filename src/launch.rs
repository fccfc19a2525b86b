//! Starting an engine process for a learner: the one spawning path of every launcher (the
//! CLI's `client --launch`, Python's `launch()`), whatever language the engine executable
//! is written in.
//!
//! A launched engine must not outlive its learner: a learner killed while it waits for the
//! engine to publish would otherwise leave the engine serving no one, and its region, for
//! good. So the child asks the kernel for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`,
//! kept across `exec`; a shmbridge engine closes and removes its region on SIGTERM, any
//! other program ends by default), then checks that its parent is still the launcher (if
//! the launcher died before the request, the child was re-parented already and does not
//! start).
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the
//! process: a launcher calling from a short-lived thread (a thread pool, a Python thread)
//! would kill its engine when that thread ends. So every spawn runs on one thread that
//! lives as long as the process.

use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::os;

type Spawn = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The spawning thread of this process and the pid that started it.
static SPAWNER: Mutex<Option<(u32, mpsc::Sender<Spawn>)>> = Mutex::new(None);

/// Hands `spawn` to this process's spawning thread, started at its first launch. A child
/// forked after that inherited the sender but not the thread (fork copies only the
/// calling thread), so a process whose pid is not the one that started it starts its own.
fn send_to_spawner(spawn: Spawn) -> std::result::Result<(), mpsc::SendError<Spawn>> {
    let pid = os::current_pid();
    let mut slot = SPAWNER.lock().unwrap_or_else(|p| p.into_inner());
    if !matches!(&*slot, Some((owner, _)) if *owner == pid) {
        let (tx, rx) = mpsc::channel::<Spawn>();
        // Never joined: it must outlive every engine it starts (see the module docs).
        let started = std::thread::Builder::new()
            .name("shmbridge-launch".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            });
        if started.is_err() {
            return Err(mpsc::SendError(spawn));
        }
        *slot = Some((pid, tx));
    }
    let (_, tx) = slot.as_ref().expect("set above");
    tx.send(spawn)
}

/// Starts `command` (program, arguments, environment and stdio already set) as an engine
/// of this process: it gets SIGTERM when this process dies, and does not start if this
/// process died first. `new_session`: in a session of its own, so a terminal's Ctrl-C
/// reaches the learner only (the engine stops when its client closes or dies).
pub fn spawn_engine(mut command: Command, new_session: bool) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    let launcher = os::current_pid();
    // SAFETY: the hook runs in the child between fork and exec and makes only system
    // calls (close_range or fcntl, setsid, prctl, getppid), which are async-signal-safe;
    // it takes no lock and allocates nothing (its errors are raw OS error codes).
    unsafe {
        command.pre_exec(move || {
            // Only stdio reaches the engine: not a descriptor another thread of this
            // process held at the fork without close-on-exec yet (a driver's exported
            // memory fd in the instant before the library sets the flag).
            os::cloexec_above_stdio()?;
            if new_session {
                os::new_session()?;
            }
            os::die_with_parent(launcher)
        });
    }
    let program = command.get_program().to_string_lossy().into_owned();
    let (reply, result) = mpsc::channel();
    let sent = send_to_spawner((command, reply));
    let spawned = match sent {
        Ok(()) => result
            .recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("the spawning thread is gone"))),
        Err(_) => Err(std::io::Error::other("the spawning thread is gone")),
    };
    spawned.map_err(|e| Error::io(format!("starting the engine '{program}'"), e))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;

    /// The engine outlives the thread that launched it (a child started straight from
    /// that thread would get SIGTERM when it ended): `cat` still echoes afterwards.
    #[test]
    fn an_engine_outlives_the_thread_that_launched_it() {
        let child = std::thread::spawn(|| {
            let mut cat = Command::new("cat");
            cat.stdin(Stdio::piped()).stdout(Stdio::piped());
            spawn_engine(cat, false).unwrap()
        })
        .join()
        .unwrap();
        let mut child = child;
        let mut input = child.stdin.take().unwrap();
        let mut output = BufReader::new(child.stdout.take().unwrap());
        input.write_all(b"alive\n").unwrap();
        let mut line = String::new();
        output.read_line(&mut line).unwrap();
        assert_eq!(line, "alive\n");
        drop(input);
        assert!(child.wait().unwrap().success());
    }

    /// A descriptor this process holds without close-on-exec (as a driver's exported
    /// memory fd is in the instant before the library sets the flag, when another thread
    /// spawns) does not reach the engine: it inherits stdio only.
    #[test]
    fn an_engine_inherits_no_descriptor_but_stdio() {
        const NAME: &str = "shmbridge-not-for-the-engine";
        let held = rustix::fs::memfd_create(NAME, rustix::fs::MemfdFlags::empty()).unwrap();
        let mut ls = Command::new("ls");
        ls.args(["-l", "/proc/self/fd"]).stdout(Stdio::piped());
        let out = spawn_engine(ls, false).unwrap().wait_with_output().unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{listing}");
        assert!(listing.contains(" 1 -> "), "stdout is listed: {listing}");
        assert!(
            !listing.contains(NAME),
            "the engine inherited it: {listing}"
        );
        drop(held);
    }

    #[test]
    fn a_program_that_does_not_exist_is_an_io_error() {
        let e = spawn_engine(Command::new("/nonexistent/engine"), true).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/engine"), "{e}");
    }
}
