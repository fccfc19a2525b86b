//! `gc` removes only what it can prove is a region of a dead engine (a regular file of
//! the caller's, the engine's lock free, a header this library wrote) and says why it
//! left each other name; `ls` marks dead engines. Each test plants its names in its own
//! region namespace (tests/common: `ns_name`), which its `ls` and `gc` look at alone, and
//! removes what is left at its end.

mod common;

use std::io::Write;
use std::process::Command;

use shmbridge::layout::{HeaderBuilder, LAYOUT_HASH, MAGIC};
use shmbridge::{DType, Direction, TensorSpec};

/// The names a test planted in /dev/shm: removed when it ends (what `gc` leaves stays
/// otherwise), pass or fail.
#[derive(Default)]
struct Planted(Vec<String>);
impl Planted {
    fn add(&mut self, name: &str) -> String {
        self.0.push(name.to_string());
        name.to_string()
    }
}
impl Drop for Planted {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = std::fs::remove_file(common::shm_path(name));
        }
    }
}

fn plant(name: &str, bytes: &[u8], old: bool) {
    let path = format!("/dev/shm/{name}");
    std::fs::File::create_new(&path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
    if old {
        common::make_old(&path);
    }
}

/// A region's bytes as an engine writes them, before (`magic` 0) or after publishing.
fn region(published: bool) -> Vec<u8> {
    let b = HeaderBuilder::new(
        "gc",
        1,
        &[TensorSpec::new(
            "obs",
            DType::F32,
            &[1, 4],
            Direction::EngineToClient,
        )],
        0,
    )
    .unwrap();
    let mut bytes = b.bytes();
    bytes.resize(b.header.region_size as usize, 0);
    if published {
        bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
    }
    bytes
}

fn run(args: &[&str]) -> String {
    let out = common::in_namespace(Command::new(common::BIN))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The line of `output` about `name`.
fn line<'a>(output: &'a str, name: &str) -> &'a str {
    output
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == name))
        .unwrap_or_else(|| panic!("no line for {name}:\n{output}"))
}

/// Before the fix `gc` removed every old file with the prefix that was not locked: files
/// of other programs, empty or zero-filled ones, garbage with a nonzero first word.
#[test]
fn gc_removes_only_regions_of_dead_engines_and_says_why_it_left_the_rest() {
    common::own_namespace();
    let n = common::ns_name;
    let mut planted = Planted::default();
    for name in [
        "dead",
        "died-while-creating",
        "being-created",
        "someones-file",
        "empty",
        "zeros",
        "other-layout",
        "fifo",
    ] {
        planted.add(&n(name));
    }
    // First: its start sweeps this namespace.
    let live = common::EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let garbage: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 1)
        .collect();
    plant(&n("dead"), &region(true), true);
    plant(&n("died-while-creating"), &region(false), true);
    plant(&n("being-created"), &region(false), false);
    plant(&n("someones-file"), &garbage, true);
    plant(&n("empty"), &[], true);
    plant(&n("zeros"), &[0; 4096], true);
    let mut not_ours = region(true);
    not_ours[24..32].copy_from_slice(&(LAYOUT_HASH ^ 1).to_le_bytes());
    not_ours[..8].copy_from_slice(&0u64.to_le_bytes());
    plant(&n("other-layout"), &not_ours, true);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        common::shm_path(&n("fifo")).as_path(),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();

    let ls = run(&["ls"]);
    assert!(line(&ls, &n("dead")).contains(" dead "), "{ls}");
    assert!(line(&ls, &live.name).contains(" ready "), "{ls}");

    let gc = run(&["gc"]);
    let expect = [
        (n("dead"), "removed", "its engine is dead"),
        (n("died-while-creating"), "removed", "its engine is dead"),
        (n("being-created"), "left", "being created"),
        (n("someones-file"), "left", "not a shmbridge region"),
        (n("empty"), "left", "too short"),
        (n("zeros"), "left", "not a shmbridge region"),
        (n("other-layout"), "left", "not a shmbridge region"),
        (n("fifo"), "left", "a FIFO, not a region file"),
        (live.name.clone(), "left", "its engine is alive"),
    ];
    for (name, what, why) in expect {
        let l = line(&gc, &name);
        assert!(l.starts_with(what) && l.contains(why), "{name}: {l}\n{gc}");
        assert_eq!(common::shm_exists(&name), what == "left", "{name}");
    }
    assert!(gc.contains("2 stale region(s) removed, 7 left"), "{gc}");
    drop(live);
}

/// Root's `gc` leaves another user's region even when its engine is dead.
#[test]
fn gc_leaves_another_users_dead_region() {
    common::own_namespace();
    if !common::is_root() {
        eprintln!("SKIPPED: giving a file to another user needs root (chown)");
        return;
    }
    let mut planted = Planted::default();
    let nobodys = planted.add(&common::ns_name("nobodys"));
    plant(&nobodys, &region(true), true);
    rustix::fs::chown(
        common::shm_path(&nobodys).as_path(),
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    let gc = run(&["gc"]);
    let l = line(&gc, &nobodys);
    assert!(
        l.starts_with("left") && l.contains("belongs to another user"),
        "{gc}"
    );
    assert!(common::shm_exists(&nobodys));
}

/// A name planted in /dev/shm with a newline and terminal escape sequences (anyone can
/// create one) must not forge lines in `ls` or root's `gc` output, nor reach the terminal
/// as control characters: both print it escaped. Before the fix they printed it raw.
#[test]
fn ls_and_gc_print_planted_names_escaped() {
    common::own_namespace();
    let mut planted = Planted::default();
    let forged = planted.add(&format!(
        "{}x\nremoved  shmbridge-victim                         its engine is dead{}",
        common::prefix(),
        "\x1b[2K\x1b]0;pwned\x07\u{202e}"
    ));
    plant(&forged, b"not a region", true);
    plant(&planted.add(&common::ns_name("dead")), &region(true), true);
    for args in [&["ls"][..], &["gc"][..]] {
        let out = run(args);
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n') && !out.contains('\u{202e}'),
            "{args:?} printed control characters: {out:?}"
        );
        assert!(
            !out.lines()
                .any(|l| l.contains("shmbridge-victim") && !l.contains("\\n")),
            "{args:?} printed a forged line: {out}"
        );
        assert!(
            out.contains(&format!(r"{}x\nremoved", common::prefix())) && out.contains(r"\u{1b}[2K"),
            "{args:?}: the name, escaped: {out}"
        );
    }
    let lines = run(&["gc"]);
    assert!(
        lines.contains("0 stale region(s) removed, 1 left"),
        "{lines}"
    );
}

/// An fd socket file left in /dev/shm without its region (removed by something that did
/// not know of it) is removed by `gc` when nobody listens on it; one something listens
/// on, another user's, or a socket of a region that exists is left.
#[test]
fn gc_removes_fd_sockets_whose_region_is_gone() {
    common::own_namespace();
    if !common::is_root() {
        eprintln!("SKIPPED: giving a file to another user needs root (chown)");
        return;
    }
    let n = common::ns_name;
    let mut planted = Planted::default();
    for name in [
        "gone.fd",
        "someone-listens.fd",
        "nobodys.fd",
        "dead",
        "dead.fd",
    ] {
        planted.add(&format!("{}{name}", common::prefix()));
    }
    let bound =
        |name: &str| shmbridge::fdpass::Listener::bind(&format!("/dev/shm/{name}")).unwrap();
    let fd = |name: &str| format!("{}.fd", n(name));
    drop(bound(&fd("gone")));
    let _listening = bound(&fd("someone-listens"));
    drop(bound(&fd("nobodys")));
    rustix::fs::chown(
        common::shm_path(&fd("nobodys")).as_path(),
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    plant(&n("dead"), &region(true), true);
    drop(bound(&fd("dead")));
    let gc = run(&["gc"]);
    let l = line(&gc, &fd("gone"));
    assert!(
        l.starts_with("removed") && l.contains("region is gone"),
        "{gc}"
    );
    let l = line(&gc, &fd("someone-listens"));
    assert!(l.starts_with("left") && l.contains("listens"), "{gc}");
    let l = line(&gc, &fd("nobodys"));
    assert!(l.starts_with("left") && l.contains("another user"), "{gc}");
    // The dead region goes with its socket (removed with it, not listed on its own).
    assert!(line(&gc, &n("dead")).starts_with("removed"), "{gc}");
    assert!(!gc.contains(&fd("dead")), "{gc}");
    assert!(
        gc.contains("1 stale region(s) removed (and 1 fd socket(s) whose region was gone), 2 left"),
        "{gc}"
    );
    for (name, left) in [
        (fd("gone"), false),
        (fd("someone-listens"), true),
        (fd("nobodys"), true),
        (n("dead"), false),
        (fd("dead"), false),
    ] {
        assert_eq!(common::shm_exists(&name), left, "{name}");
    }
    // `ls` lists regions only.
    assert!(!run(&["ls"]).contains(".fd"));
}

/// An engine's start, `ls` and `gc` look only at the names of their own region namespace
/// (`SHMBRIDGE_NAMESPACE`): a dead region of another namespace is neither listed nor
/// removed, one of their own is. Before namespaces every start and `gc` removed every dead
/// `shmbridge-*` region, so tests removed each other's.
#[test]
fn a_sweep_touches_only_its_own_namespace() {
    common::own_namespace();
    let mut planted = Planted::default();
    let ns = common::namespace();
    // Another namespace: `<ours>o` (its prefix `shmbridge-<ours>o-` is not ours).
    let theirs = planted.add(&format!("shmbridge-{ns}o-dead"));
    let ours = planted.add(&common::ns_name("dead"));
    for name in [&theirs, &ours] {
        plant(name, &region(true), true);
    }
    let ls = run(&["ls"]);
    assert!(line(&ls, &ours).contains(" dead "), "{ls}");
    assert!(!ls.contains(&theirs), "{ls}");
    // An engine's start sweeps its own namespace...
    drop(common::EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "1",
    ]));
    assert!(!common::shm_exists(&ours), "the engine's start left {ours}");
    // ...and neither it nor `gc` the other's.
    plant(&ours, &region(true), true);
    let gc = run(&["gc"]);
    assert!(line(&gc, &ours).starts_with("removed"), "{gc}");
    assert!(!gc.contains(&theirs), "{gc}");
    assert!(common::shm_exists(&theirs), "{theirs} was removed");
    // In that namespace, `gc` removes it.
    let out = Command::new(common::BIN)
        .arg("gc")
        .env(shmbridge::region::NAMESPACE_ENV, format!("{ns}o"))
        .output()
        .unwrap();
    let gc = String::from_utf8_lossy(&out.stdout);
    assert!(line(&gc, &theirs).starts_with("removed"), "{gc}");
    assert!(!common::shm_exists(&theirs));
}
