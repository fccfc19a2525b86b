//! The fault matrix: each side killed with SIGKILL, SIGTERM, and SIGSTOP then SIGKILL, at
//! each phase (before attach, in attach, in step, in reset, in call). The survivor must
//! end its call with the typed error of that death, never hang; nothing may be left in
//! /dev/shm under the region's name; an engine whose client died serves a new client.
//!
//! Phases are reached deterministically: the victim is a peer process (this test binary
//! run again as `fault_peer`) that says on stdout when it is inside the phase and then
//! blocks on its stdin, or a state the survivor sees in the region (a client that has
//! claimed the slot is inside `attach`; an engine that received action n has a client
//! inside `step`). No test sleeps to get there.
//!
//! Detection times (from the fatal signal to the survivor's error) are printed, with the
//! time the victim took to exit, against a bound that is reported, never asserted. Run
//! `cargo test --test faults -- --nocapture --test-threads=1` to see the table.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::peer::{self, block, say, Fault, Isolation, PeerProc, FAULTS, HANG};
use common::{shm_exists, BIN};
use rustix::process::Signal;
use shmbridge::error::ErrorKind;
use shmbridge::observer::Observer;
use shmbridge::region::{self, Region};
use shmbridge::{
    AttachOptions, Client, CommandError, CommandHandler, DType, Engine, EngineSpec, Error, Reply,
    ResetRequest, Tensors,
};

/// What a survivor's detection is compared with in the printed table: one 10 ms sleep
/// slice plus the spin budget, with room for a loaded machine and for the victim's own
/// exit (the kernel tears a process down before it counts as dead).
const BOUND: Duration = Duration::from_millis(100);
/// The survivors' call timeout: far past any detection, so a `Timeout` means a miss.
const LONG: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    BeforeAttach,
    Attach,
    Step,
    Reset,
    Call,
}

const PHASES: [Phase; 5] = [
    Phase::BeforeAttach,
    Phase::Attach,
    Phase::Step,
    Phase::Reset,
    Phase::Call,
];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::BeforeAttach => "before-attach",
            Phase::Attach => "attach",
            Phase::Step => "step",
            Phase::Reset => "reset",
            Phase::Call => "call",
        }
    }

    fn parse(text: &str) -> Phase {
        *PHASES
            .iter()
            .find(|p| p.name() == text)
            .unwrap_or_else(|| panic!("unknown phase {text}"))
    }
}

// ---- The peer: this test binary run again, as an engine or a client ----

/// A handler that holds every command it gets (`reset`, `call`) in `hold`, given the
/// command's name, then answers it.
struct Holding<F: FnMut(&str)>(F);

impl<F: FnMut(&str)> CommandHandler for Holding<F> {
    fn reset(&mut self, _io: &mut Tensors<'_>, _req: &ResetRequest) -> Result<(), CommandError> {
        (self.0)("reset");
        Ok(())
    }
    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        _method: &str,
        _args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        (self.0)("call");
        Ok(Reply::default())
    }
}

fn spec() -> EngineSpec {
    EngineSpec::standard("faults", 4, 4, 1, DType::F32)
}

fn peer_engine(phase: Phase) -> ! {
    let mut engine = Engine::create(spec()).expect("create");
    if phase == Phase::Attach {
        // Frame 0 never comes: a client stays inside attach.
        say(&format!("created {}", engine.name()));
        block();
    }
    engine.publish().expect("frame 0");
    say(&format!("served {}", engine.name()));
    match phase {
        Phase::BeforeAttach | Phase::Attach => block(),
        Phase::Step => {
            engine.wait_actions(LONG).expect("an action");
            say("in-step");
            block()
        }
        Phase::Reset | Phase::Call => {
            // Says which command it is in and blocks there.
            let mut handler = Holding(|what: &str| {
                say(&format!("in-{what}"));
                block()
            });
            let got = engine.wait_actions_with(LONG, &mut handler);
            panic!("the handler blocks: {got:?}")
        }
    }
}

fn peer_client(phase: Phase, name: &str) -> ! {
    if phase == Phase::BeforeAttach {
        say("ready");
        block();
    }
    // Its pid as it sees it: what it records in the slot (in namespaces of its own, not
    // the pid the test sees).
    say(&format!("attaching {}", std::process::id()));
    let mut client = Client::attach(name, AttachOptions::default().timeout(LONG)).expect("attach");
    say("attached");
    let got = match phase {
        Phase::Step => client.step(LONG).map(|_| ()),
        Phase::Reset => client.reset(None, &[7], LONG).map(|_| ()),
        Phase::Call => client.call_method("hold", &[], &[], LONG).map(|_| ()),
        Phase::BeforeAttach | Phase::Attach => Ok(()),
    };
    say(&format!("returned {got:?}"));
    block()
}

/// An observer (1.7) in `phase`: `attach` (waiting for frame 0), `idle` (attached), or
/// `reading` (copying and reading the stats in a loop without pause, as a viewer polls).
fn peer_observer(phase: &str, name: &str) -> ! {
    say("attaching");
    let observer = Observer::attach(name, LONG).expect("observe");
    say("attached");
    if phase == "idle" {
        block();
    }
    let picks = [observer.pick("obs", 0..4).expect("pick")];
    let mut out = observer.buffers(&picks).expect("buffers");
    say("reading");
    loop {
        let _ = observer.try_read(&picks, &mut out);
        let _ = observer.try_stats();
    }
}

/// Not a test: a peer process of the fault matrix, started by the matrix with its role
/// (`engine PHASE` or `client PHASE NAME`).
#[test]
#[ignore = "a peer process the fault matrix starts itself"]
fn fault_peer() {
    let Some(role) = peer::role() else {
        return;
    };
    let words: Vec<&str> = role.split_whitespace().collect();
    match words[..] {
        ["engine", phase] => peer_engine(Phase::parse(phase)),
        ["client", phase, name] => peer_client(Phase::parse(phase), name),
        ["observer", phase, name] => peer_observer(phase, name),
        _ => panic!("bad role {role:?}"),
    }
}

// ---- The survivor's side ----

/// One case of the matrix, as printed.
struct Row {
    case: String,
    /// The survivor's error (or what it got instead).
    got: String,
    detect: Option<Duration>,
    exit: Option<Duration>,
    /// What was wrong; `None`: the case passed.
    problem: Option<String>,
}

impl Row {
    fn new(
        case: String,
        got: &Result<(), Error>,
        detect: Option<Duration>,
        exit: Option<Duration>,
        problem: Option<String>,
    ) -> Row {
        let got = match got {
            Ok(()) => "Ok".into(),
            Err(e) => format!("{:?}", e.kind()),
        };
        Row {
            case,
            got,
            detect,
            exit,
            problem,
        }
    }
}

/// Every phase with every fault, through `case`.
fn matrix(case: impl Fn(Phase, Fault) -> Row) -> Vec<Row> {
    common::own_namespace();
    PHASES
        .iter()
        .flat_map(|&p| FAULTS.iter().map(move |&f| (p, f)))
        .map(|(p, f)| case(p, f))
        .collect()
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
}

/// Prints the table and the detection summary; fails listing every case that failed.
fn report(title: &str, rows: &[Row]) {
    eprintln!("\n== fault matrix: {title} (bound {BOUND:?}, reported, not asserted)");
    eprintln!(
        "{:<60} {:<22} {:>10} {:>10}  verdict",
        "case", "survivor got", "detected", "exited"
    );
    for r in rows {
        let verdict = match (&r.problem, r.detect) {
            (Some(p), _) => format!("FAIL: {p}"),
            (None, Some(d)) if d > BOUND => "ok (over bound)".into(),
            (None, _) => "ok".into(),
        };
        eprintln!(
            "{:<60} {:<22} {:>10} {:>10}  {verdict}",
            r.case,
            r.got,
            ms(r.detect),
            ms(r.exit)
        );
    }
    let mut times: Vec<Duration> = rows.iter().filter_map(|r| r.detect).collect();
    times.sort();
    if let (Some(max), Some(median)) = (times.last(), times.get(times.len() / 2)) {
        eprintln!(
            "detection over {} cases: median {}, max {}",
            times.len(),
            ms(Some(*median)),
            ms(Some(*max))
        );
    }
    let failed: Vec<String> = rows
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.case, r.problem.as_ref()?)))
        .collect();
    assert!(failed.is_empty(), "failed cases:\n{}", failed.join("\n"));
}

/// The problem with a survivor's outcome, if any: it must be `expected`, and nothing may
/// be left in /dev/shm under `name`.
fn judge(got: &Result<(), Error>, expected: ErrorKind, name: &str) -> Option<String> {
    match got {
        Err(e) if e.kind() == expected => {}
        Err(e) => return Some(format!("expected {expected:?}, got {e}")),
        Ok(()) => return Some(format!("expected {expected:?}, the call succeeded")),
    }
    shm_exists(name).then(|| format!("{name} left in /dev/shm"))
}

// ---- Engine killed: the client survives ----

/// Runs `call` on a client in a thread; returns its result and when it returned.
fn in_thread<T: Send + 'static>(
    call: impl FnOnce() -> T + Send + 'static,
) -> mpsc::Receiver<(T, Instant)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let out = call();
        let _ = tx.send((out, Instant::now()));
    });
    rx
}

fn wait_for<T>(rx: &mpsc::Receiver<(T, Instant)>, what: &str) -> (T, Instant) {
    rx.recv_timeout(HANG)
        .unwrap_or_else(|_| panic!("{what}: the survivor hung"))
}

/// Polls a region until the client slot is held by `pid` (the client is then inside
/// attach: it claimed the slot and waits for frame 0). Not a sleep: a state to reach.
fn until_client_claimed(control: shmbridge::control::Control<'_>, pid: u32) {
    let deadline = Instant::now() + HANG;
    loop {
        if control.client_state() == shmbridge::control::ClientState::Attached
            && control.client_identity().0 == pid
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the client never claimed the slot"
        );
        std::thread::yield_now();
    }
}

fn engine_case(iso: Isolation, phase: Phase, fault: Fault) -> Row {
    let case = format!("engine {} in {}{}", fault.name(), phase.name(), iso.name());
    let mut engine = PeerProc::start_in(iso, "fault_peer", &format!("engine {}", phase.name()));
    let name = if phase == Phase::Attach {
        engine.expect("created")
    } else {
        engine.expect("served")
    };
    let options = AttachOptions::default().timeout(LONG);
    // `killed`: when the fatal signal went out, for a survivor already waiting.
    let (got, detect, killed) = match phase {
        Phase::BeforeAttach => {
            // Dead (and reaped) before the client starts: attach finds a dead engine.
            engine.fault(fault);
            let _ = engine.child.wait();
            let start = Instant::now();
            let got = Client::attach(&name, options).map(|_| ());
            (got, start.elapsed(), None)
        }
        Phase::Attach => {
            let probe = Region::open_read_only(&name).expect("probe");
            let n = name.clone();
            let rx = in_thread(move || Client::attach(&n, options).map(|_| ()));
            until_client_claimed(probe.control(), std::process::id());
            drop(probe);
            let killed = engine.fault(fault);
            let (got, at) = wait_for(&rx, &case);
            (got, at.saturating_duration_since(killed), Some(killed))
        }
        Phase::Step | Phase::Reset | Phase::Call => {
            let mut client = Client::attach(&name, options).expect("attach");
            let rx = in_thread(move || match phase {
                Phase::Step => client.step(LONG).map(|_| ()),
                Phase::Reset => client.reset(None, &[7], LONG).map(|_| ()),
                _ => client.call_method("hold", &[], &[], LONG).map(|_| ()),
            });
            engine.expect(&format!("in-{}", phase.name()));
            let killed = engine.fault(fault);
            let (got, at) = wait_for(&rx, &case);
            (got, at.saturating_duration_since(killed), Some(killed))
        }
    };
    let exit = killed.and_then(|k| engine.exit_after(k));
    Row::new(
        case,
        &got,
        Some(detect),
        exit,
        judge(&got, ErrorKind::EngineDied, &name),
    )
}

#[test]
fn engine_dies_in_every_phase_client_gets_engine_died() {
    let rows = matrix(|p, f| engine_case(Isolation::Shared, p, f));
    report("engine killed (a Rust engine), the client survives", &rows);
}

/// The same with the engine in PID, network and mount namespaces of its own (a
/// container sharing only /dev/shm with the client's).
#[test]
fn engine_in_other_namespaces_dies_in_every_phase_client_gets_engine_died() {
    if let Some(why) = peer::namespaces_unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let rows = matrix(|p, f| engine_case(Isolation::Namespaces, p, f));
    report(
        "engine killed in namespaces of its own (a Rust engine), the client survives",
        &rows,
    );
}

// ---- Client killed: the engine survives ----

/// After its client died the engine serves a new one: attach, one step, close. The
/// engine waits once the new client holds the slot: a wait before that reports the
/// dead client again.
fn serves_a_new_client(engine: &mut Engine) -> Option<String> {
    let name = engine.name().to_string();
    let rx = in_thread(move || -> Result<(), Error> {
        let mut c = Client::attach(&name, AttachOptions::default().timeout(LONG))?;
        c.step(LONG)?;
        c.close();
        Ok(())
    });
    until_client_claimed(engine.control(), std::process::id());
    let served = (|| -> Result<Option<String>, Error> {
        engine.wait_actions(LONG)?;
        engine.publish()?;
        Ok(match engine.wait_actions(LONG) {
            Err(Error::PeerClosed { .. }) => None,
            other => Some(format!(
                "after the new client closed the engine got {other:?}"
            )),
        })
    })();
    let (client, _) = wait_for(&rx, "a new client");
    match (served, client) {
        (Ok(None), Ok(())) => None,
        (Ok(Some(p)), _) => Some(p),
        (e, c) => Some(format!("no new client served: engine {e:?}, client {c:?}")),
    }
}

/// The problem with a surviving engine's outcome, if any: it must be `expected`, then
/// the engine must serve a new client, and once it is dropped nothing may be left in
/// /dev/shm under its name.
fn judge_engine(
    got: &Result<(), Error>,
    expected: ErrorKind,
    mut engine: Engine,
) -> Option<String> {
    let name = engine.name().to_string();
    let problem = match got {
        Err(e) if e.kind() == expected => serves_a_new_client(&mut engine),
        Err(e) => Some(format!("expected {expected:?}, got {e}")),
        Ok(()) => Some(format!("expected {expected:?}, the wait succeeded")),
    };
    drop(engine);
    problem.or_else(|| shm_exists(&name).then(|| format!("{name} left in /dev/shm")))
}

fn client_case(iso: Isolation, phase: Phase, fault: Fault) -> Row {
    let case = format!("client {} in {}{}", fault.name(), phase.name(), iso.name());
    let mut engine = Engine::create(spec()).expect("create");
    let name = engine.name().to_string();
    if phase != Phase::Attach {
        engine.publish().expect("frame 0");
    }
    let role = format!("client {} {name}", phase.name());
    let mut client = PeerProc::start_in(iso, "fault_peer", &role);
    // The pid the client records in the slot (its own namespace's).
    let mut recorded_pid = 0;
    if phase != Phase::BeforeAttach {
        recorded_pid = client.expect("attaching").parse().expect("a pid");
    }
    // `killed`: when the fatal signal went out; the engine's error ends the detection.
    let (got, killed, returned) = match phase {
        Phase::BeforeAttach => {
            client.expect("ready");
            client.fault(fault);
            let _ = client.child.wait();
            // No client came: the engine keeps waiting (a timeout, not a death).
            let got = engine.wait_actions(Duration::from_millis(100)).map(|_| ());
            (got, None, Instant::now())
        }
        Phase::Attach | Phase::Step => {
            if phase == Phase::Attach {
                until_client_claimed(engine.control(), recorded_pid);
            } else {
                client.expect("attached");
                // The client posted action 1 and waits for its frame.
                engine.wait_actions(LONG).expect("action 1");
            }
            let killed = client.fault(fault);
            let got = engine
                .publish()
                .and_then(|_| engine.wait_actions(LONG))
                .map(|_| ());
            (got, Some(killed), Instant::now())
        }
        Phase::Reset | Phase::Call => {
            client.expect("attached");
            // The engine's handler tells the killer it is inside the command, and waits
            // until the client was killed.
            let (inside_tx, inside) = mpsc::channel();
            let (go, go_rx) = mpsc::channel();
            let mut handler = Holding(|_: &str| {
                let _ = inside_tx.send(());
                let _ = go_rx.recv_timeout(HANG);
            });
            let killer = std::thread::spawn(move || {
                inside
                    .recv_timeout(HANG)
                    .expect("the handler was not reached");
                let killed = client.fault(fault);
                let _ = go.send(());
                (client, killed)
            });
            let got = engine.wait_actions_with(LONG, &mut handler).map(|_| ());
            let returned = Instant::now();
            let (c, killed) = killer.join().expect("killer");
            client = c;
            (got, Some(killed), returned)
        }
    };
    let detect = killed.map(|k| returned.saturating_duration_since(k));
    let exit = killed.and_then(|k| client.exit_after(k));
    let expected = if phase == Phase::BeforeAttach {
        ErrorKind::Timeout
    } else {
        ErrorKind::ClientDied
    };
    Row::new(
        case,
        &got,
        detect,
        exit,
        judge_engine(&got, expected, engine),
    )
}

#[test]
fn client_dies_in_every_phase_engine_gets_client_died_and_serves_again() {
    let rows = matrix(|p, f| client_case(Isolation::Shared, p, f));
    report(
        "client killed (a Rust client), the engine survives and serves a new client",
        &rows,
    );
}

/// The same with the client in PID, network and mount namespaces of its own.
#[test]
fn client_in_other_namespaces_dies_in_every_phase_engine_gets_client_died() {
    if let Some(why) = peer::namespaces_unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let rows = matrix(|p, f| client_case(Isolation::Namespaces, p, f));
    report(
        "client killed in namespaces of its own (a Rust client), the engine survives and serves a new client",
        &rows,
    );
}

// ---- The CLI's processes: `shmbridge engine` (which closes on SIGTERM), `shmbridge client` ----

fn cli_engine_case(iso: Isolation, phase: Phase, fault: Fault) -> Row {
    let case = format!(
        "cli engine {} in {}{}",
        fault.name(),
        phase.name(),
        iso.name()
    );
    let args = ["engine", "--env", "null", "--num-envs", "4"];
    let mut engine = match iso {
        Isolation::Shared => PeerProc::spawn(Command::new(BIN), "", &args),
        Isolation::Namespaces => PeerProc::spawn_isolated(std::path::Path::new(BIN), "", &args),
    };
    // The CLI prints the bare name: read it as a raw line.
    let name = engine.line();
    // SIGTERM: the engine closes its region and removes it (the client sees it closed,
    // or finds no region); the others leave it to the client, which removes it.
    let expected = match (fault, phase) {
        (Fault::Term, Phase::BeforeAttach) => ErrorKind::NotFound,
        (Fault::Term, _) => ErrorKind::EngineClosed,
        _ => ErrorKind::EngineDied,
    };
    let options = AttachOptions::default().timeout(LONG);
    let (got, detect) = match phase {
        Phase::BeforeAttach => {
            engine.fault(fault);
            let _ = engine.child.wait();
            let start = Instant::now();
            (
                Client::attach(&name, options).map(|_| ()),
                Some(start.elapsed()),
            )
        }
        _ => {
            // In step: the engine is stopped, so the client's step waits for its frame
            // (asleep on the futex once it raised its waiter flag); then the fault.
            let mut client = Client::attach(&name, options).expect("attach");
            client.step(LONG).expect("a first step");
            common::signal(engine.pid(), Signal::STOP);
            let probe = Region::open_read_only(&name).expect("probe");
            let rx = in_thread(move || {
                // A closing engine answers steps until its signal thread has run (it
                // closes the region from there, asynchronously to the serving thread):
                // a step after that must see it closed. Bounded: a run of successes
                // that long is a failure of the case.
                let mut got = client.step(LONG).map(|_| ());
                for _ in 0..10_000 {
                    if got.is_err() {
                        break;
                    }
                    got = client.step(LONG).map(|_| ());
                }
                got
            });
            let deadline = Instant::now() + HANG;
            while probe.header().client_waiting == 0 {
                assert!(Instant::now() < deadline, "the client never went to sleep");
                std::thread::yield_now();
            }
            drop(probe);
            let killed = match fault {
                Fault::Term => {
                    let at = engine.fault(Fault::Term);
                    common::signal(engine.pid(), Signal::CONT);
                    at
                }
                // Already stopped: SIGSTOP+KILL is a kill now.
                _ => engine.fault(Fault::Kill),
            };
            let (got, at) = wait_for(&rx, &case);
            (got, Some(at.saturating_duration_since(killed)))
        }
    };
    let _ = engine.child.wait();
    Row::new(case, &got, detect, None, judge(&got, expected, &name))
}

fn cli_client_case(iso: Isolation, fault: Fault) -> Row {
    let case = format!("cli client {} in step{}", fault.name(), iso.name());
    let mut engine = Engine::create(spec()).expect("create");
    engine.publish().expect("frame 0");
    let name = engine.name().to_string();
    let args = ["client", &name, "--steps", "1000000000"];
    let mut client = match iso {
        Isolation::Shared => PeerProc::spawn(Command::new(BIN), "", &args),
        Isolation::Namespaces => PeerProc::spawn_isolated(std::path::Path::new(BIN), "", &args),
    };
    // The client's step n is in flight once its action n arrived.
    for _ in 0..10 {
        engine.wait_actions(LONG).expect("an action");
        engine.publish().expect("a frame");
    }
    engine.wait_actions(LONG).expect("an action");
    let killed = client.fault(fault);
    let got = engine
        .publish()
        .and_then(|_| engine.wait_actions(LONG))
        .map(|_| ());
    let detect = Some(killed.elapsed());
    let exit = client.exit_after(killed);
    Row::new(
        case,
        &got,
        detect,
        exit,
        judge_engine(&got, ErrorKind::ClientDied, engine),
    )
}

fn cli_rows(iso: Isolation) -> Vec<Row> {
    common::own_namespace();
    let mut rows = Vec::new();
    for phase in [Phase::BeforeAttach, Phase::Step] {
        for fault in FAULTS {
            rows.push(cli_engine_case(iso, phase, fault));
        }
    }
    for fault in FAULTS {
        rows.push(cli_client_case(iso, fault));
    }
    rows
}

#[test]
fn cli_engine_and_client_die_or_close_and_the_survivor_says_which() {
    report(
        "the shmbridge CLI's engine and client",
        &cli_rows(Isolation::Shared),
    );
}

/// The same with the CLI process in PID, network and mount namespaces of its own.
#[test]
fn cli_engine_and_client_in_other_namespaces_die_or_close_and_the_survivor_says_which() {
    if let Some(why) = peer::namespaces_unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    report(
        "the shmbridge CLI's engine and client, each in namespaces of its own",
        &cli_rows(Isolation::Namespaces),
    );
}

// ---- A survivor on a busy CPU ----

/// A busy loop in a child process; killed and reaped on drop.
struct Hog(Child);

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Pins the calling thread to CPU 0 (and what it starts from then on).
fn pin_to_cpu0() {
    let mut cpu0 = rustix::thread::CpuSet::new();
    cpu0.set(0);
    rustix::thread::sched_setaffinity(None, &cpu0).expect("sched_setaffinity");
}

/// The engine shares its CPU with a busy process when its client dies in step. With the
/// default (spinning) policy it spins, then yields a few times before it looks at the
/// client: each yield may hand the CPU to the busy process for a whole scheduler slice,
/// which once delayed the first look by 16 slices. The time is reported, not asserted.
#[test]
fn an_engine_on_a_busy_cpu_notices_its_client_die() {
    let rows = FAULTS
        .iter()
        .map(|&fault| {
            // Its own thread: the pinning ends with it. The busy loop and the client,
            // started after the pinning, inherit it.
            std::thread::spawn(move || {
                pin_to_cpu0();
                let _hog = Hog(Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("spawn a busy loop"));
                let mut row = client_case(Isolation::Shared, Phase::Step, fault);
                row.case += ", busy cpu";
                row
            })
            .join()
            .expect("case thread")
        })
        .collect::<Vec<_>>();
    report(
        "client killed while the engine shares its CPU with a busy loop",
        &rows,
    );
}

// ---- Observer killed (1.7): nothing changes for the engine and its client ----

/// Whether process `pid` has a descriptor of region `name` open.
fn has_open(pid: u32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().ends_with(name)))
}

fn observer_case(phase: &str, fault: Fault) -> Row {
    let case = format!("observer {} in {phase}", fault.name());
    let mut engine = Engine::create(spec()).expect("create");
    let name = engine.name().to_string();
    let mut observer = PeerProc::start("fault_peer", &format!("observer {phase} {name}"));
    observer.expect("attaching");
    if phase == "attach" {
        // It opened the region and waits for frame 0: a state to reach, not a sleep.
        let deadline = Instant::now() + HANG;
        while !has_open(observer.pid(), &name) {
            assert!(
                Instant::now() < deadline,
                "the observer never opened the region"
            );
            std::thread::yield_now();
        }
    }
    let frame = |n: u64| (0..16).map(|i| (n * 100 + i) as f32).collect::<Vec<f32>>();
    engine
        .tensor_mut::<f32>("obs")
        .unwrap()
        .copy_from_slice(&frame(0));
    engine.publish().expect("frame 0");
    if phase != "attach" {
        observer.expect("attached");
    }
    if phase == "reading" {
        observer.expect("reading");
    }
    let n = name.clone();
    let learner = in_thread(move || -> Result<Vec<f32>, Error> {
        let mut c = Client::attach(&n, AttachOptions::default().timeout(LONG))?;
        let mut seen = Vec::new();
        for _ in 0..200 {
            c.step(LONG)?;
            seen.extend_from_slice(&c.tensor::<f32>("obs")?[..1]);
        }
        c.close();
        Ok(seen)
    });
    let mut killed = None;
    let served = (|| -> Result<Option<String>, Error> {
        for k in 1..=200u64 {
            if k == 50 {
                killed = Some(observer.fault(fault));
            }
            assert_eq!(engine.wait_actions(LONG)?, k);
            engine.tensor_mut::<f32>("obs")?.copy_from_slice(&frame(k));
            engine.publish()?;
        }
        let swept = region::sweep_report()?;
        if swept
            .iter()
            .any(|s| s.name == name && s.verdict != region::Verdict::Alive)
        {
            return Ok(Some("gc did not see the live engine".into()));
        }
        Ok(match engine.wait_actions(LONG) {
            Err(Error::PeerClosed { .. }) => None,
            other => Some(format!("after its client closed the engine got {other:?}")),
        })
    })();
    let (client, _) = wait_for(&learner, &case);
    let expected: Vec<f32> = (1..=200u64).map(|k| (k * 100) as f32).collect();
    let problem = match (served, client) {
        (Ok(None), Ok(seen)) if seen == expected => None,
        (Ok(None), Ok(seen)) => Some(format!("the client saw {:?}..", &seen[..4])),
        (Ok(Some(p)), _) => Some(p),
        (e, c) => Some(format!("engine {e:?}, client {c:?}")),
    };
    drop(engine);
    let problem = problem.or_else(|| shm_exists(&name).then(|| format!("{name} left in /dev/shm")));
    let exit = killed.and_then(|k| observer.exit_after(k));
    let got = match &problem {
        None => Ok(()),
        Some(_) => Err(Error::Interrupted),
    };
    Row::new(case, &got, None, exit, problem)
}

#[test]
fn an_observer_killed_anywhere_changes_nothing_for_engine_and_client() {
    let rows: Vec<Row> = ["attach", "idle", "reading"]
        .iter()
        .flat_map(|&p| FAULTS.iter().map(move |&f| observer_case(p, f)))
        .collect();
    report(
        "observer killed (1.7): engine and client go on as without it",
        &rows,
    );
}
