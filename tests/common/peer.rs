//! Peer processes for tests that kill or corrupt the other side: the test binary runs
//! itself again as one of its (ignored) entry tests, with a role in an environment
//! variable. The peer says where it is on stdout (`PEER ...` lines) and blocks on its
//! stdin when it has to stay where it is; the test reads those lines, signals the peer,
//! and sees how it ended.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};

/// The environment variable holding a peer's role (unset: the entry test does nothing).
pub const PEER_ROLE: &str = "SHMBRIDGE_TEST_PEER";
/// Marks the peer's protocol lines on stdout (the test harness prints other lines).
const SAYS: &str = "PEER ";
/// A hang guard, not a timing check: a wait past this is reported as a hang.
pub const HANG: Duration = Duration::from_secs(60);

/// The role this process was started with as a peer, if it was.
pub fn role() -> Option<String> {
    std::env::var(PEER_ROLE).ok()
}

/// Tells the test where this peer is.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{SAYS}{line}");
    let _ = out.flush();
}

/// Blocks until the test closes our stdin or dies; then this peer has nothing to do.
pub fn block() -> ! {
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(3)
}

/// How a peer is made to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Kill,
    Term,
    /// SIGSTOP, then (once it is stopped) SIGKILL.
    StopKill,
}

pub const FAULTS: [Fault; 3] = [Fault::Kill, Fault::Term, Fault::StopKill];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "SIGKILL",
            Fault::Term => "SIGTERM",
            Fault::StopKill => "SIGSTOP+KILL",
        }
    }
}

/// Where a peer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// In this process's namespaces.
    Shared,
    /// In PID, network and mount namespaces of its own (a container's), sharing only
    /// /dev/shm with the test: see [`isolated`].
    Namespaces,
}

impl Isolation {
    pub fn name(self) -> &'static str {
        match self {
            Isolation::Shared => "",
            Isolation::Namespaces => ", other namespaces",
        }
    }
}

/// The command that runs `program` in new PID, network and mount namespaces, as a
/// container runs it: `unshare --pid --fork --net --mount-proc`, the new mount namespace
/// a copy of this one (so /dev/shm is the same tmpfs) with /proc of the new PID
/// namespace. `sh` is the namespace's first process and runs `program` as its child:
/// the first process of a PID namespace ignores every signal it has no handler for
/// (SIGTERM, SIGINT), as a container's entrypoint does without `--init`. When the
/// `unshare` process ends (dropped, killed), the namespace's processes are killed.
pub fn isolated(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("unshare");
    c.args([
        "--pid",
        "--fork",
        "--net",
        "--mount-proc",
        "--kill-child",
        "--",
        "sh",
        "-c",
        "\"$@\"; exit $?",
        "sh",
    ])
    .arg(program);
    c
}

/// Why namespaces of their own cannot be made here (not root, no `unshare`), or `None`.
pub fn namespaces_unavailable() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("PID, network and mount namespaces need root (unshare)".into());
    }
    match Command::new("unshare")
        .args(["--pid", "--fork", "--net", "--mount-proc", "true"])
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "unshare --pid --fork --net --mount-proc failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("unshare (util-linux) cannot run: {e}")),
    }
}

/// The pid, in this PID namespace, of the descendant of `root` that runs `exe` (the
/// program an [`isolated`] command started inside its namespaces). Waits for it;
/// `None` when `root` ended first: a short-lived program can run its whole life
/// between two looks, and then there is nothing left to find.
pub fn descendant_running(root: u32, exe: &std::path::Path) -> Option<u32> {
    let exe = std::fs::canonicalize(exe).unwrap_or_else(|_| exe.to_path_buf());
    let deadline = Instant::now() + HANG;
    loop {
        // Read before the search: if `root` had ended already, the search cannot miss
        // a descendant that was still there.
        let root_ended = process_state(root).is_none_or(|s| s == 'Z' || s == 'X');
        let mut todo = vec![root];
        while let Some(pid) = todo.pop() {
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                if std::fs::read_link(format!("/proc/{c}/exe")).is_ok_and(|e| e == exe) {
                    return Some(c);
                }
                todo.push(c);
            }
        }
        if root_ended {
            return None;
        }
        assert!(
            Instant::now() < deadline,
            "no process of {} under pid {root}",
            exe.display()
        );
        std::thread::yield_now();
    }
}

/// The state letter of process `pid` (`R`, `S`, `T`, `Z`, ...), `None` if it is gone.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .next()?
        .chars()
        .next()
}

/// Waits until process `pid` (not a child of ours) is stopped (`T` in /proc/PID/stat).
fn until_stopped(pid: u32) {
    let deadline = Instant::now() + HANG;
    while process_state(pid) != Some('T') {
        assert!(Instant::now() < deadline, "process {pid} never stopped");
        std::thread::yield_now();
    }
}

/// A peer process; killed and reaped on drop.
pub struct PeerProc {
    pub child: Child,
    /// The peer's pid here when `child` is the `unshare` that runs it in namespaces of
    /// its own ([`PeerProc::start_in`]).
    inner: Option<u32>,
    /// Kept open: the peer blocks reading it.
    _stdin: ChildStdin,
    pub lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
    /// Sends once the peer's stderr reached its end (every writer closed it).
    stderr_end: mpsc::Receiver<()>,
    /// When the peer became a zombie (its exit, as its parent sees it).
    exited: Option<mpsc::Receiver<Instant>>,
}

impl PeerProc {
    /// This test binary, running its ignored test `entry` with `role`.
    pub fn start(entry: &str, role: &str) -> PeerProc {
        PeerProc::start_in(Isolation::Shared, entry, role)
    }

    /// [`PeerProc::start`], in namespaces of its own if `isolation` says so.
    pub fn start_in(isolation: Isolation, entry: &str, role: &str) -> PeerProc {
        let exe = std::env::current_exe().expect("test binary");
        let args = [entry, "--exact", "--ignored", "--nocapture"];
        match isolation {
            Isolation::Shared => PeerProc::spawn(Command::new(exe), role, &args),
            Isolation::Namespaces => PeerProc::spawn_isolated(&exe, role, &args),
        }
    }

    /// `program` with `args` in namespaces of its own ([`isolated`]), `role` in its
    /// environment. Its signals and exit go to the program itself, found under the
    /// `unshare` process.
    pub fn spawn_isolated(program: &std::path::Path, role: &str, args: &[&str]) -> PeerProc {
        let mut peer = PeerProc::spawn(isolated(program), role, args);
        // `None`: the program ended already; what it printed is still in `lines`, and
        // its exit is the `unshare` process's.
        peer.inner = descendant_running(peer.child.id(), program);
        peer
    }

    /// Any program, with `args`, and `role` in its environment.
    pub fn spawn(command: Command, role: &str, args: &[&str]) -> PeerProc {
        let mut child = super::foreground(super::in_namespace(command))
            .args(args)
            .env(PEER_ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn peer");
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let mut err = child.stderr.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let (end_tx, stderr_end) = mpsc::channel();
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            *sink.lock().unwrap_or_else(|p| p.into_inner()) = text;
            let _ = end_tx.send(());
        });
        PeerProc {
            child,
            inner: None,
            _stdin: stdin,
            lines,
            stderr,
            stderr_end,
            exited: None,
        }
    }

    /// The peer's pid in this PID namespace (inside its own namespaces, it has another).
    pub fn pid(&self) -> u32 {
        self.inner.unwrap_or_else(|| self.child.id())
    }

    /// The next line the program printed (for programs that are not peers).
    pub fn line(&mut self) -> String {
        self.lines
            .recv_timeout(HANG)
            .unwrap_or_else(|_| panic!("process {} printed nothing", self.pid()))
    }

    /// Waits for the peer's next protocol line; it must start with `word`. Returns the
    /// rest of the line.
    pub fn expect(&mut self, word: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(HANG)
                .unwrap_or_else(|_| panic!("peer {} never said '{word}'", self.pid()));
            // The test harness may have printed on the same line before.
            if let Some(said) = line.find(SAYS).map(|at| &line[at + SAYS.len()..]) {
                let rest = said
                    .strip_prefix(word)
                    .unwrap_or_else(|| panic!("peer said '{said}', expected '{word}'"));
                return rest.trim().to_string();
            }
        }
    }

    /// Starts watching for the peer's exit (without reaping it): `waitid` for a child,
    /// a pidfd that turns readable when it exits for a peer in namespaces of its own.
    fn watch_exit(&mut self) {
        let pid = Pid::from_raw(self.pid() as i32).expect("pid");
        let (tx, rx) = mpsc::channel();
        if self.inner.is_some() {
            let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            {
                Ok(fd) => fd,
                // Gone (and reaped by its shell) already.
                Err(rustix::io::Errno::SRCH) => {
                    let _ = tx.send(Instant::now());
                    self.exited = Some(rx);
                    return;
                }
                Err(e) => panic!("pidfd_open: {e}"),
            };
            std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                let mut fds = [libc::pollfd {
                    fd: pidfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                }];
                // SAFETY: one valid pollfd, for the call; -1: no timeout.
                if unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) } == 1 {
                    let _ = tx.send(Instant::now());
                }
            });
        } else {
            std::thread::spawn(move || {
                let options = WaitIdOptions::EXITED | WaitIdOptions::NOWAIT;
                if rustix::process::waitid(WaitId::Pid(pid), options).is_ok() {
                    let _ = tx.send(Instant::now());
                }
            });
        }
        self.exited = Some(rx);
    }

    /// Applies `fault`; returns when the fatal signal was sent.
    pub fn fault(&mut self, fault: Fault) -> Instant {
        self.watch_exit();
        let pid = Pid::from_raw(self.pid() as i32).expect("pid");
        match fault {
            Fault::Kill => super::signal(self.pid(), Signal::KILL),
            Fault::Term => super::signal(self.pid(), Signal::TERM),
            Fault::StopKill => {
                super::signal(self.pid(), Signal::STOP);
                // Stopped for sure before it is killed.
                if self.inner.is_some() {
                    until_stopped(self.pid());
                } else {
                    let options = WaitIdOptions::STOPPED | WaitIdOptions::NOWAIT;
                    rustix::process::waitid(WaitId::Pid(pid), options).expect("waitid stopped");
                }
                super::signal(self.pid(), Signal::KILL);
            }
        }
        Instant::now()
    }

    /// How long after `since` the peer exited (waits for it).
    pub fn exit_after(&mut self, since: Instant) -> Option<Duration> {
        let at = self.exited.as_ref()?.recv_timeout(HANG).ok()?;
        Some(at.saturating_duration_since(since))
    }

    /// Whether the peer still runs (reaps it if it ended).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Waits (at most [`HANG`]) for the peer to end by itself; `None` if it did not.
    pub fn wait_end(&mut self) -> Option<ExitStatus> {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            return Some(status);
        }
        if self.exited.is_none() {
            self.watch_exit();
        }
        self.exited.as_ref()?.recv_timeout(HANG).ok()?;
        self.child.wait().ok()
    }

    /// Everything the peer wrote on stderr, once it ended: waits (at most [`HANG`]) for
    /// the end of its output.
    pub fn stderr_at_end(&self) -> String {
        let _ = self.stderr_end.recv_timeout(HANG);
        self.stderr()
    }

    /// What the peer wrote on stderr (complete once it has ended).
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
