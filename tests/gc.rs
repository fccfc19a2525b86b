//! `gc` removes only what it can prove is a region of a dead engine (a regular file of
//! the caller's, the engine's lock free, a header this library wrote) and says why it
//! left each other name; `ls` marks dead engines. Runs in a private /dev/shm (root only).

mod common;

use std::io::Write;
use std::process::Command;

use shmbridge::layout::{HeaderBuilder, LAYOUT_HASH, MAGIC};
use shmbridge::{DType, Direction, TensorSpec};

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
    let out = Command::new(common::BIN).args(args).output().unwrap();
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
    if !common::private_shm(
        "gc_removes_only_regions_of_dead_engines_and_says_why_it_left_the_rest",
        "64m",
    ) {
        return;
    }
    // First: its start sweeps /dev/shm.
    let live = common::EngineProc::start(&["--env", "null", "--num-envs", "1"]);
    let garbage: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 1)
        .collect();
    plant("shmbridge-dead", &region(true), true);
    plant("shmbridge-died-while-creating", &region(false), true);
    plant("shmbridge-being-created", &region(false), false);
    plant("shmbridge-someones-file", &garbage, true);
    plant("shmbridge-empty", &[], true);
    plant("shmbridge-zeros", &[0; 4096], true);
    let mut not_ours = region(true);
    not_ours[24..32].copy_from_slice(&(LAYOUT_HASH ^ 1).to_le_bytes());
    not_ours[..8].copy_from_slice(&0u64.to_le_bytes());
    plant("shmbridge-other-layout", &not_ours, true);
    rustix::fs::mknodat(
        rustix::fs::CWD,
        "/dev/shm/shmbridge-fifo",
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();

    let ls = run(&["ls"]);
    assert!(line(&ls, "shmbridge-dead").contains(" dead "), "{ls}");
    assert!(line(&ls, &live.name).contains(" ready "), "{ls}");

    let gc = run(&["gc"]);
    let expect = [
        ("shmbridge-dead", "removed", "its engine is dead"),
        (
            "shmbridge-died-while-creating",
            "removed",
            "its engine is dead",
        ),
        ("shmbridge-being-created", "left", "being created"),
        ("shmbridge-someones-file", "left", "not a shmbridge region"),
        ("shmbridge-empty", "left", "too short"),
        ("shmbridge-zeros", "left", "not a shmbridge region"),
        ("shmbridge-other-layout", "left", "not a shmbridge region"),
        ("shmbridge-fifo", "left", "a FIFO, not a region file"),
        (live.name.as_str(), "left", "its engine is alive"),
    ];
    for (name, what, why) in expect {
        let l = line(&gc, name);
        assert!(l.starts_with(what) && l.contains(why), "{name}: {l}\n{gc}");
        assert_eq!(common::shm_exists(name), what == "left", "{name}");
    }
    assert!(gc.contains("2 stale region(s) removed, 7 left"), "{gc}");
    drop(live);
}

/// Root's `gc` leaves another user's region even when its engine is dead.
#[test]
fn gc_leaves_another_users_dead_region() {
    if !common::private_shm("gc_leaves_another_users_dead_region", "64m") {
        return;
    }
    plant("shmbridge-nobodys", &region(true), true);
    rustix::fs::chown(
        "/dev/shm/shmbridge-nobodys",
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    let gc = run(&["gc"]);
    let l = line(&gc, "shmbridge-nobodys");
    assert!(
        l.starts_with("left") && l.contains("belongs to another user"),
        "{gc}"
    );
    assert!(common::shm_exists("shmbridge-nobodys"));
}

/// A name planted in /dev/shm with a newline and terminal escape sequences (anyone can
/// create one) must not forge lines in `ls` or root's `gc` output, nor reach the terminal
/// as control characters: both print it escaped. Before the fix they printed it raw.
#[test]
fn ls_and_gc_print_planted_names_escaped() {
    if !common::private_shm("ls_and_gc_print_planted_names_escaped", "64m") {
        return;
    }
    let forged = "shmbridge-x\nremoved  shmbridge-victim                         its engine is dead\x1b[2K\x1b]0;pwned\x07\u{202e}";
    plant(forged, b"not a region", true);
    plant("shmbridge-dead", &region(true), true);
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
            out.contains(r"shmbridge-x\nremoved") && out.contains(r"\u{1b}[2K"),
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
    if !common::private_shm("gc_removes_fd_sockets_whose_region_is_gone", "64m") {
        return;
    }
    let bound =
        |name: &str| shmbridge::fdpass::Listener::bind(&format!("/dev/shm/{name}")).unwrap();
    drop(bound("shmbridge-gone.fd"));
    let _listening = bound("shmbridge-someone-listens.fd");
    drop(bound("shmbridge-nobodys.fd"));
    rustix::fs::chown(
        "/dev/shm/shmbridge-nobodys.fd",
        Some(rustix::process::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    plant("shmbridge-dead", &region(true), true);
    drop(bound("shmbridge-dead.fd"));
    let gc = run(&["gc"]);
    let l = line(&gc, "shmbridge-gone.fd");
    assert!(
        l.starts_with("removed") && l.contains("region is gone"),
        "{gc}"
    );
    let l = line(&gc, "shmbridge-someone-listens.fd");
    assert!(l.starts_with("left") && l.contains("listens"), "{gc}");
    let l = line(&gc, "shmbridge-nobodys.fd");
    assert!(l.starts_with("left") && l.contains("another user"), "{gc}");
    // The dead region goes with its socket (removed with it, not listed on its own).
    assert!(line(&gc, "shmbridge-dead").starts_with("removed"), "{gc}");
    assert!(!gc.contains("shmbridge-dead.fd"), "{gc}");
    assert!(
        gc.contains("1 stale region(s) removed (and 1 fd socket(s) whose region was gone), 2 left"),
        "{gc}"
    );
    for (name, left) in [
        ("shmbridge-gone.fd", false),
        ("shmbridge-someone-listens.fd", true),
        ("shmbridge-nobodys.fd", true),
        ("shmbridge-dead", false),
        ("shmbridge-dead.fd", false),
    ] {
        assert_eq!(common::shm_exists(name), left, "{name}");
    }
    // `ls` lists regions only.
    assert!(!run(&["ls"]).contains(".fd"));
}
