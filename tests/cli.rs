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

/// The registry of reference engines is the one lookup: every entry is listed by the
/// CLI's `engine --help`, found by the catalog (`host_spec`, `by_name`) under its own
/// name, served by `shmbridge engine --env NAME` (the CLI and the runner, which Python's
/// `launch()` and `make_vec` start), and named by the error for an unknown env. An entry
/// that one of them misses, or a lookup that keeps a name list of its own, fails here.
#[test]
fn every_reference_engine_is_reachable_by_name() {
    use shmbridge::device::Device;
    use shmbridge::envs::{self, EnvOptions, REFERENCE_ENGINES};
    use shmbridge::{AttachOptions, Client};
    common::own_namespace();
    let help = std::process::Command::new(common::BIN)
        .args(["engine", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    let unknown = envs::find("no-such-env").unwrap_err().to_string();
    let cli_unknown = std::process::Command::new(common::BIN)
        .args(["engine", "--env", "no-such-env", "--num-envs", "2"])
        .output()
        .unwrap();
    assert!(!cli_unknown.status.success());
    let cli_unknown = String::from_utf8_lossy(&cli_unknown.stderr).to_string();
    assert!(cli_unknown.contains(&unknown), "{cli_unknown}");
    // Host memory throughout: this test is about names, not devices.
    let options = EnvOptions {
        image_device: Some(Device::Host),
        ..Default::default()
    };
    assert!(REFERENCE_ENGINES.len() >= 3);
    for entry in REFERENCE_ENGINES {
        let name = entry.name;
        assert!(
            help.contains(&format!("{name} ({}", entry.description)),
            "engine --help does not list {name}:\n{help}"
        );
        assert!(unknown.contains(name), "{unknown}");
        let spec = envs::host_spec(name, 2, &options).unwrap();
        assert_eq!(spec.kind, name);
        let built = envs::by_name(name, 2, &options).unwrap().spec();
        assert_eq!(built.kind, name);
        let engine =
            EngineProc::start(&["--env", name, "--num-envs", "2", "--image-device", "host"]);
        let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
        assert_eq!(client.layout().engine_kind, name);
        let tensors: Vec<&str> = client
            .layout()
            .tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        let expected: Vec<&str> = spec.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(tensors, expected, "{name}");
        assert_eq!(client.step(std::time::Duration::from_secs(60)).unwrap(), 1);
        client.close();
        let (status, err) = engine.finish();
        assert!(status.success(), "{name}: {status} {err}");
    }
}

/// A sharded engine serves host memory only, whichever env puts a tensor elsewhere:
/// `pixels` by default (its frames in Vulkan memory) and any env's image with
/// `--image-device vulkan`; refused before a region exists.
#[test]
fn sharding_refuses_an_env_whose_spec_leaves_host_memory() {
    common::own_namespace();
    let name = common::ns_name("sharded");
    for args in [
        &["--env", "pixels"][..],
        &[
            "--env",
            "null",
            "--image",
            "4x4x3",
            "--image-device",
            "vulkan",
        ][..],
        &["--env", "cartpole", "--device", "auto"][..],
    ] {
        let out = common::in_namespace(std::process::Command::new(common::BIN))
            .args([
                "engine",
                "--num-envs",
                "4",
                "--shard",
                "0/2",
                "--name",
                &name,
            ])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} served");
        assert!(
            err.contains("sharded engines serve host memory only"),
            "{args:?}: {err}"
        );
        assert!(!shm_exists(&name), "{args:?}");
    }
}

/// `--cuda-sharing` takes auto, ipc or fd, and nothing else (before a region exists); on
/// the host it changes nothing: a host engine serves with any of them.
#[test]
fn cuda_sharing_is_auto_ipc_or_fd() {
    common::own_namespace();
    let out = common::in_namespace(std::process::Command::new(common::BIN))
        .args(["engine", "--env", "null", "--num-envs", "2"])
        .args(["--cuda-sharing", "shm"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("expected auto, ipc or fd"), "{err}");
    for sharing in ["auto", "ipc", "fd"] {
        let engine = common::EngineProc::start(&[
            "--env",
            "null",
            "--num-envs",
            "2",
            "--cuda-sharing",
            sharing,
        ]);
        let mut c = shmbridge::Client::attach(&engine.name, Default::default()).unwrap();
        c.step(std::time::Duration::from_secs(30)).unwrap();
        drop(c);
        let (status, err) = engine.finish();
        assert!(status.success(), "{sharing}: {status}: {err}");
    }
}

/// Every shard builds its env from its own flags: a shard whose tensors differ from the
/// region's (here `--obs-dim`) is refused with the reason before it serves, and the
/// region's shard 0 is left to its own end.
#[test]
fn a_shard_with_other_tensors_than_the_regions_is_refused() {
    common::own_namespace();
    let name = common::ns_name("mismatched");
    let shard = |k: &str, obs_dim: &str| {
        let mut c = common::in_namespace(std::process::Command::new(common::BIN));
        c.args([
            "engine",
            "--env",
            "null",
            "--num-envs",
            "4",
            "--name",
            &name,
        ])
        .args(["--shard", k, "--obs-dim", obs_dim]);
        c
    };
    let mut first = shard("0/2", "4")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let second = shard("1/2", "8").output().unwrap();
    let _ = first.kill();
    let _ = first.wait();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{err}");
    assert!(
        err.contains("does not serve the region's tensors") && err.contains("'obs'"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A MuJoCo model whose arena overflows at rest (ten boxes in one place: their contacts
/// need more than `<size memory="8K"/>`; the model compiles, its first `mj_forward`
/// overflows) ends the engine inside MuJoCo (`mju_error` exits the process, no destructor
/// runs), but before any region exists: nothing is left in /dev/shm.
#[cfg(feature = "mujoco")]
#[test]
fn a_mujoco_model_that_overflows_at_rest_leaves_no_region() {
    common::own_namespace();
    let name = common::ns_name("overflow");
    let model = std::env::temp_dir().join(format!("shmbridge-overflow-{}.xml", std::process::id()));
    std::fs::write(
        &model,
        format!(
            r#"<mujoco><size memory="8K"/><worldbody><geom type="plane" size="5 5 0.1"/>{}
               <body><joint name="j" type="hinge"/><geom size="0.1" pos="0 0 -0.5"/></body>
               </worldbody><actuator><motor joint="j"/></actuator></mujoco>"#,
            r#"<body pos="0 0 0.05"><freejoint/><geom type="box" size="0.1 0.1 0.1"/></body>"#
                .repeat(10)
        ),
    )
    .unwrap();
    let out = common::in_namespace(std::process::Command::new(common::BIN))
        .args([
            "engine",
            "--env",
            "mujoco/raw",
            "--num-envs",
            "1",
            "--name",
            &name,
        ])
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    std::fs::remove_file(&model).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served: {err}");
    assert!(err.contains("stack overflow"), "{err}");
    let left = shm_exists(&name);
    if left {
        let _ = std::fs::remove_file(common::shm_path(&name));
    }
    assert!(!left, "the region was left behind");
}
