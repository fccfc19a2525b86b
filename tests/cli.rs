//! The CLI's `ls`, `inspect` and `gc`. Its own test binary: an engine created by another
//! test in parallel would sweep the dead region this test leaves for `gc`.

mod common;

use common::{shm_exists, EngineProc};

#[test]
fn cli_ls_inspect_and_gc() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "3"]);
    let out = |args: &[&str]| {
        let o = std::process::Command::new(common::BIN)
            .args(args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    let ls = out(&["ls"]);
    let line = ls
        .lines()
        .find(|l| l.starts_with(&engine.name))
        .expect("listed");
    assert!(
        line.contains(&engine.pid().to_string())
            && line.contains("ready")
            && line.contains("obs[3, 16]:f32"),
        "{line}"
    );
    let inspect = out(&["inspect", &engine.name]);
    // The protocol this build speaks, from the constants (an unsharded host region's
    // header bytes stay those of 1.3).
    let protocol = format!(
        "protocol      {}.{} (this shmbridge {})",
        shmbridge::layout::VERSION_MAJOR,
        shmbridge::layout::VERSION_MINOR,
        env!("CARGO_PKG_VERSION")
    );
    for needle in [
        "magic",
        "(ok)",
        "version       1.3 (the header's bytes; written by a protocol 1.7+ engine: observable)",
        protocol.as_str(),
        "num_envs      3",
        "reset_mask",
        "client->engine",
        "frame_seq     0",
    ] {
        assert!(
            inspect.contains(needle),
            "inspect lacks {needle:?}:\n{inspect}"
        );
    }
    // gc leaves a live engine's region alone...
    out(&["gc"]);
    assert!(shm_exists(&engine.name));
    // ...and removes it once the engine is dead (SIGKILL: no chance to clean up).
    let name = engine.name.clone();
    let pid = engine.pid();
    common::signal(pid, rustix::process::Signal::KILL);
    let _ = engine.finish();
    assert!(shm_exists(&name), "SIGKILL leaves the name behind");
    let gc = out(&["gc"]);
    assert!(gc.contains(&name), "{gc}");
    assert!(!shm_exists(&name));
}
