//! Access control: a region belongs to the user who created it (mode 0600, and the
//! library opens only regions of its own effective uid, root included). A client of
//! another user gets `PermissionDenied`; `shmbridge ls` lists the region as unreadable;
//! `gc` leaves it alone, even once its engine is dead. Both ways round: root's region
//! seen by `nobody`, and `nobody`'s region seen by root.
//!
//! Needs root (to run processes as `nobody` with `setpriv`); elsewhere it prints why it
//! skips. Its `gc` runs in this test's region namespace (tests/common).

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::peer::PeerProc;
use common::{shm_path, BIN};
use rustix::process::Signal;
use shmbridge::{AttachOptions, Client, DType, Engine, EngineSpec, Error};

/// `shmbridge ARGS` as `nobody`.
fn as_nobody(args: &[&str]) -> Command {
    let mut c = Command::new("setpriv");
    c.args(["--reuid=nobody", "--regid=nogroup", "--clear-groups", BIN])
        .args(args);
    c
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `ls` output (run by `ls`) lists `name` as unreadable for lack of permission.
fn listed_unreadable(ls: Output, name: &str) {
    let (stdout, stderr) = text(&ls);
    assert!(ls.status.success(), "ls: {stderr}");
    let line = stdout
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("ls does not list {name}:\n{stdout}"));
    assert!(
        line.contains("unreadable") && line.contains("permission denied"),
        "{line}"
    );
}

#[test]
fn another_users_client_is_refused_and_ls_and_gc_leave_the_region_alone() {
    if !common::is_root() {
        eprintln!("SKIPPED: running processes as nobody (setpriv) needs root");
        return;
    }

    // Root's engine, seen by nobody.
    let mut engine =
        Engine::create(EngineSpec::standard("access", 2, 3, 1, DType::F32)).expect("create");
    engine.publish().expect("frame 0");
    let name = engine.name().to_string();
    let client = as_nobody(&["client", &name, "--steps", "1"])
        .output()
        .expect("client as nobody");
    let (_, stderr) = text(&client);
    assert_eq!(client.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("permission denied on region"), "{stderr}");
    listed_unreadable(as_nobody(&["ls"]).output().expect("ls"), &name);
    let gc = as_nobody(&["gc"]).output().expect("gc");
    assert!(
        gc.status.success() && shm_path(&name).exists(),
        "{:?}",
        text(&gc)
    );
    // And the engine still serves its own user.
    let served = std::thread::scope(|s| {
        let c = s.spawn(|| -> Result<(), Error> {
            let mut c = Client::attach(&name, AttachOptions::default())?;
            c.step(Duration::from_secs(30))?;
            c.close();
            Ok(())
        });
        engine
            .wait_actions(Duration::from_secs(30))
            .expect("action");
        engine.publish().expect("frame");
        c.join().expect("client thread")
    });
    served.expect("root's client");
    drop(engine);
    assert!(!shm_path(&name).exists());

    // Nobody's engine, seen by root: root could open the file, the library refuses to.
    let mut engine = PeerProc::spawn(
        {
            let mut c = as_nobody(&[]);
            c.args(["engine", "--env", "null", "--num-envs", "2"]);
            c
        },
        "",
        &[],
    );
    let name = engine.line();
    let theirs = std::fs::metadata(shm_path(&name)).expect("region file");
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&theirs), 65534);
    let refused = |what: &str| match Client::attach(&name, AttachOptions::default()) {
        Err(Error::PermissionDenied { name: n }) => assert_eq!(n, name),
        other => panic!("{what}: root attached to nobody's region: {other:?}"),
    };
    refused("live");
    listed_unreadable(Command::new(BIN).arg("ls").output().expect("ls"), &name);
    // Dead, its region is still nobody's: refused (not reported dead and removed), and
    // root's gc leaves it.
    common::signal(engine.pid(), Signal::KILL);
    let _ = engine.wait_end();
    refused("dead");
    let gc = Command::new(BIN).arg("gc").output().expect("gc");
    assert!(gc.status.success(), "{:?}", text(&gc));
    assert!(
        shm_path(&name).exists(),
        "root's gc removed nobody's region"
    );
    std::fs::remove_file(shm_path(&name)).expect("remove nobody's region");
}
