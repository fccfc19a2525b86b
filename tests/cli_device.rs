//! `shmbridge engine --device`: what the CLI does where CUDA is unavailable (this machine,
//! CI), and where it is usable. Its own test binary, like tests/cli.rs: engines created
//! here sweep dead regions, which would race cli.rs's `gc` test.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{shm_exists, EngineProc};
use shmbridge::{AttachOptions, Client, Location};

const T: Duration = Duration::from_secs(30);

fn engine_output(args: &[&str]) -> std::process::Output {
    Command::new(common::BIN)
        .arg("engine")
        .args(args)
        .output()
        .unwrap()
}

/// `--device cuda` where CUDA is unavailable: exit status 1, one stderr line saying that
/// CUDA is unavailable and why (the probe's reason, or the missing `cuda` feature), and no
/// region left in /dev/shm.
#[test]
fn device_cuda_without_cuda_fails_with_the_reason_and_creates_nothing() {
    let reason = match shmbridge::device::probe() {
        Ok(_) => {
            eprintln!("SKIPPED device_cuda_without_cuda_fails: CUDA is usable here");
            return;
        }
        Err(e) => e.to_string(),
    };
    for (env, device) in [("cartpole", "cuda"), ("null", "cuda:0")] {
        let name = format!("shmbridge-device-test-{env}-{}", std::process::id());
        let out = engine_output(&[
            "--env",
            env,
            "--num-envs",
            "4",
            "--device",
            device,
            "--name",
            &name,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{device}: {stderr}");
        assert!(out.stdout.is_empty(), "nothing served");
        let line = stderr
            .lines()
            .find(|l| l.contains("CUDA is unavailable"))
            .unwrap_or_else(|| panic!("no CUDA line in {stderr:?}"));
        assert!(line.starts_with("shmbridge: error: "), "{line}");
        assert!(line.contains(&reason), "{line} lacks the reason {reason:?}");
        assert!(!shm_exists(&name), "{name} was created");
    }
}

/// `--device auto` where CUDA is unavailable serves host tensors and logs the fallback
/// (`device auto -> cpu` and why); where CUDA is usable, device 0.
#[test]
fn device_auto_logs_its_choice_and_serves() {
    let cuda = shmbridge::device::probe().is_ok();
    let engine = EngineProc::start(&["--env", "cartpole", "--num-envs", "3", "--device", "auto"]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    let want = if cuda { Location::Cuda } else { Location::Host };
    for t in &client.layout().tensors {
        assert_eq!(t.location(), want, "{}", t.name);
    }
    if !cuda {
        assert_eq!(client.tensor::<f32>("obs").unwrap().len(), 12);
        client.tensor_mut::<i64>("actions").unwrap().fill(1);
        assert_eq!(client.step(T).unwrap(), 1);
        assert_eq!(client.tensor::<f32>("rewards").unwrap(), &[1.0; 3]);
    }
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{stderr}");
    let logged = if cuda {
        "shmbridge: device auto -> cuda:0 (CUDA usable"
    } else {
        "shmbridge: device auto -> cpu (falling back to host memory: CUDA is unavailable: "
    };
    assert!(stderr.contains(logged), "{stderr}");
}

/// `--device cpu` (the default) logs nothing about devices.
#[test]
fn device_cpu_is_silent() {
    let engine = EngineProc::start(&["--env", "null", "--num-envs", "2", "--device", "cpu"]);
    let client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    assert!(!client.layout().has_cuda());
    client.close();
    let (status, stderr) = engine.finish();
    assert!(status.success(), "{stderr}");
    assert!(!stderr.contains("device"), "{stderr}");
}

/// A device that is not one: a clap usage error (status 2) naming the accepted values,
/// before anything is created.
#[test]
fn device_gpu_is_a_usage_error() {
    for bad in ["gpu", "cuda:", "cuda:-1"] {
        let out = engine_output(&["--env", "null", "--device", bad]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '{bad}' for '--device <DEVICE>'")),
            "{stderr}"
        );
        assert!(
            stderr.contains("expected auto, cpu, host, cuda or cuda:N"),
            "{stderr}"
        );
        assert!(out.stdout.is_empty());
    }
}
