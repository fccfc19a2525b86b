//! Hostile files in /dev/shm (world-writable: any local user can plant one with a
//! region's name): a FIFO, a symbolic link, a directory, another user's file. Attaching,
//! `ls`, `inspect`, `gc`, the sweep an engine runs at start and Python's `Engine()` skip
//! or refuse each with a typed error; none blocks, follows the link, or removes a file it
//! cannot identify.

mod common;

use common::shm_path;
use std::os::unix::fs::{symlink, MetadataExt};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use shmbridge::{region, AttachOptions, Client, Error};

/// A hang guard, not a timing check: before the fix, opening a FIFO blocked forever.
const HANG: Duration = Duration::from_secs(60);

/// Runs `f` on a thread; fails the test if it has not returned within `HANG`.
fn no_hang<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HANG)
        .unwrap_or_else(|_| panic!("{what} blocked on a hostile file"))
}

/// Removes the planted file (or directory, or link) at drop.
struct Planted(String);

impl Drop for Planted {
    fn drop(&mut self) {
        let p = shm_path(&self.0);
        let _ = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir(&p));
    }
}

/// Plants a `kind` (fifo, link, dir) named after `test` (the tests run in parallel).
fn plant(kind: &str, test: &str) -> Planted {
    let name = common::ns_name(&format!("hostile-{test}-{kind}-{}", std::process::id()));
    let p = shm_path(&name);
    match kind {
        "fifo" => rustix::fs::mknodat(
            rustix::fs::CWD,
            &p,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o666),
            0,
        )
        .unwrap(),
        "link" => symlink(std::env::temp_dir().join(format!("{name}-target")), &p).unwrap(),
        "dir" => std::fs::create_dir(&p).unwrap(),
        _ => unreachable!(),
    }
    Planted(name)
}

fn attach(name: &str) -> Error {
    let name = name.to_string();
    let options = AttachOptions::default().timeout(Duration::from_secs(1));
    match no_hang("attach", move || Client::attach(&name, options)) {
        Ok(_) => panic!("attached to a planted file"),
        Err(e) => e,
    }
}

#[test]
fn a_fifo_a_symlink_and_a_directory_are_refused_without_blocking() {
    for (kind, what) in [
        ("fifo", "a FIFO"),
        ("link", "a symbolic link"),
        ("dir", "a directory"),
    ] {
        let planted = plant(kind, "refused");
        match attach(&planted.0) {
            Error::NotARegionFile { name, what: w } => {
                assert_eq!((name.as_str(), w), (planted.0.as_str(), what))
            }
            e => panic!("{kind}: {e}"),
        }
    }
}

#[test]
fn a_symlink_is_not_followed_by_the_sweep() {
    // The link points at a regular file of ours, old enough for the sweep to judge it
    // an abandoned region if it followed the link.
    let planted = plant("link", "sweep");
    let target = std::env::temp_dir().join(format!("{}-target", planted.0));
    std::fs::write(&target, [0u8; 16]).unwrap();
    common::make_old(&target);
    let removed = no_hang("sweep", region::sweep).unwrap();
    assert!(!removed.contains(&planted.0), "{removed:?}");
    assert!(shm_path(&planted.0).symlink_metadata().is_ok());
    assert!(target.exists());
    std::fs::remove_file(&target).unwrap();
}

#[test]
fn ls_inspect_gc_and_an_engine_start_do_not_block_on_a_fifo() {
    let fifo = plant("fifo", "cli");
    let run = |args: Vec<String>| {
        no_hang("the CLI", move || {
            Command::new(common::BIN).args(&args).output().unwrap()
        })
    };
    let ls = run(vec!["ls".into()]);
    let ls = String::from_utf8_lossy(&ls.stdout).to_string();
    assert!(
        ls.lines()
            .any(|l| l.starts_with(&fifo.0) && l.contains("a FIFO, not a region file")),
        "{ls}"
    );
    let inspect = run(vec!["inspect".into(), fifo.0.clone()]);
    assert!(!inspect.status.success());
    assert!(String::from_utf8_lossy(&inspect.stderr).contains("a FIFO"));
    let gc = run(vec!["gc".into()]);
    assert!(gc.status.success());
    assert!(shm_path(&fifo.0).exists(), "gc removed a FIFO");
    // An engine's start sweeps /dev/shm first.
    let engine = no_hang("an engine start", || {
        common::EngineProc::start(&["--env", "null", "--num-envs", "1"])
    });
    let name = engine.name.clone();
    Client::attach(&name, AttachOptions::default())
        .unwrap()
        .close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(shm_path(&fifo.0).exists());
}

/// Root only: a file another user planted with a region's name (mode 0666, old) is
/// neither opened nor removed.
#[test]
fn another_users_file_is_refused_and_left_alone() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("SKIPPED: needs root to plant a file owned by another user");
        return;
    }
    let name = common::ns_name(&format!("hostile-other-{}", std::process::id()));
    let p = shm_path(&name);
    std::fs::write(&p, [0u8; 64]).unwrap();
    let _planted = Planted(name.clone());
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let nobody = rustix::process::Uid::from_raw(65534);
    rustix::fs::chown(&p, Some(nobody), None).unwrap();
    common::make_old(&p);
    assert!(matches!(attach(&name), Error::PermissionDenied { name: n } if n == name));
    let removed = region::sweep().unwrap();
    assert!(!removed.contains(&name), "{removed:?}");
    assert_eq!(std::fs::metadata(&p).unwrap().uid(), 65534);
}

/// Root's `gc`, `ls` and `inspect` against a symbolic link that `nobody` planted, pointing
/// at a file of root's that looks like an abandoned region (old, magic written, no lock):
/// none follows the link (before the fix, root's `gc` took a lock on the target through
/// it and removed the name), each says what the name is, and both files stay as they were.
#[test]
fn roots_gc_does_not_follow_a_link_planted_by_nobody() {
    if !common::is_root() {
        eprintln!("SKIPPED: planting a link as nobody needs root (chown)");
        return;
    }
    let name = &common::ns_name("planted-by-nobody");
    let target = std::env::temp_dir().join(format!("shmbridge-link-target-{}", std::process::id()));
    let mut region = vec![0u8; shmbridge::layout::CONTROL_SIZE];
    region[..8].copy_from_slice(&shmbridge::layout::MAGIC.to_le_bytes());
    std::fs::write(&target, &region).unwrap();
    common::make_old(&target);
    let link = shm_path(name);
    symlink(&target, &link).unwrap();
    let nobody = rustix::process::Uid::from_raw(65534);
    rustix::fs::chownat(
        rustix::fs::CWD,
        &link,
        Some(nobody),
        None,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
    let run = |args: &[&str]| {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        no_hang("the CLI", move || {
            Command::new(common::BIN).args(&args).output().unwrap()
        })
    };
    let gc = run(&["gc"]);
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
    let ls = run(&["ls"]);
    let ls = String::from_utf8_lossy(&ls.stdout).to_string();
    assert!(
        ls.lines()
            .any(|l| l.starts_with(name) && l.contains("a symbolic link")),
        "{ls}"
    );
    let inspect = run(&["inspect", name]);
    assert!(!inspect.status.success());
    assert!(String::from_utf8_lossy(&inspect.stderr).contains("a symbolic link"));
    let meta = link.symlink_metadata().expect("gc removed the link");
    assert!(meta.file_type().is_symlink() && meta.uid() == 65534);
    assert_eq!(
        std::fs::read(&target).unwrap(),
        region,
        "the target was changed"
    );
    assert_eq!(target.metadata().unwrap().mtime(), 1);
    std::fs::remove_file(&target).unwrap();
    std::fs::remove_file(&link).unwrap();
}
