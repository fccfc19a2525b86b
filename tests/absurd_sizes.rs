//! Absurd sizes at the CLI's entry points (num_envs, obs/act dims, images, seeds, spin
//! budgets, timeouts, names): each is a typed error with exit status 1 (2 where clap
//! refuses to parse it) or a clean run, never a panic, an abort or a signal. Before the
//! fix, `--env cartpole --num-envs 1000000000` aborted with a backtrace.
//!
//! Runs in a private 64 MB `/dev/shm` with the address space of each command capped at
//! 4 GiB (`ulimit -v`), so a size that would eat the machine fails, as it must, with a
//! typed error, on any machine.

mod common;

use std::process::{Command, Output};

use shmbridge::{AttachOptions, Client};

/// Runs `shmbridge ARGS` under the memory cap.
fn run(args: &[&str]) -> Output {
    Command::new("sh")
        .args(["-c", "ulimit -v 4194304 && exec \"$0\" \"$@\"", common::BIN])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn absurd_sizes_at_the_cli_are_typed_errors_never_panics() {
    if !common::private_shm(
        "absurd_sizes_at_the_cli_are_typed_errors_never_panics",
        "64m",
    ) {
        return;
    }
    const U32_MAX: &str = "4294967295";
    const U64_MAX: &str = "18446744073709551615";
    let engine = |rest: &[&str]| -> Vec<String> {
        ["engine", "--idle-timeout", "1"]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };
    // (arguments, expected exit status): 1 for a typed error, 2 for clap's refusal.
    let cases: Vec<(Vec<String>, i32)> = vec![
        (
            engine(&["--env", "cartpole", "--num-envs", "1000000000"]),
            1,
        ),
        (engine(&["--env", "cartpole", "--num-envs", U32_MAX]), 1),
        (
            engine(&["--env", "cartpole", "--num-envs", "4294967296"]),
            2,
        ),
        (engine(&["--env", "cartpole", "--num-envs", "0"]), 1),
        (engine(&["--env", "cartpole", "--num-envs", "-1"]), 2),
        (
            engine(&["--env", "null", "--num-envs", "1", "--obs-dim", U64_MAX]),
            1,
        ),
        (
            engine(&["--env", "null", "--num-envs", U32_MAX, "--obs-dim", U32_MAX]),
            1,
        ),
        (
            engine(&[
                "--env",
                "null",
                "--num-envs",
                "1000",
                "--act-dim",
                "1000000000000",
            ]),
            1,
        ),
        (
            engine(&["--env", "null", "--num-envs", "1", "--obs-dim", "0"]),
            1,
        ),
        (
            engine(&[
                "--env",
                "null",
                "--num-envs",
                "1",
                "--image",
                "4294967296x4294967296x4294967296",
            ]),
            1,
        ),
        (
            engine(&[
                "--env",
                "null",
                "--num-envs",
                "1000",
                "--image",
                "1000x1000x1000",
            ]),
            1,
        ),
        (
            engine(&["--env", "null", "--num-envs", "1", "--image", "0x84x3"]),
            2,
        ),
        (
            engine(&[
                "--env",
                "null",
                "--num-envs",
                "1",
                "--image",
                "99999999999999999999x1x1",
            ]),
            2,
        ),
        (engine(&["--env", "null", "--spin-us", "nan"]), 2),
        (engine(&["--env", "null", "--spin-us", "-1"]), 2),
        (engine(&["--env", "null", "--spin-us", "inf"]), 2),
        (
            engine(&["--env", "null", "--seed", "18446744073709551616"]),
            2,
        ),
        (
            engine(&["--env", "null", "--device", "cuda:99999999999999999999"]),
            2,
        ),
        (engine(&["--env", "null", "--name", &"x".repeat(5000)]), 1),
        (
            vec!["engine".into(), "--idle-timeout".into(), "nan".into()],
            2,
        ),
        (
            vec!["engine".into(), "--idle-timeout".into(), "-5".into()],
            2,
        ),
        (
            [
                "client",
                "--launch",
                "cartpole",
                "--num-envs",
                "1000000000",
                "--steps",
                "1",
            ]
            .map(String::from)
            .to_vec(),
            1,
        ),
        (
            [
                "client",
                "--launch",
                "null",
                "--num-envs",
                U32_MAX,
                "--steps",
                "1",
            ]
            .map(String::from)
            .to_vec(),
            1,
        ),
        (
            [
                "client",
                "shmbridge-absent",
                "--steps",
                U64_MAX,
                "--timeout",
                "1e300",
            ]
            .map(String::from)
            .to_vec(),
            1,
        ),
        (vec!["inspect".into(), "y".repeat(5000)], 1),
        (vec!["inspect".into(), "shmbridge-absent".into()], 1),
    ];
    for (args, status) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        common::assert_no_crash(&format!("{args:?}"), &out);
        assert_eq!(
            out.status.code(),
            Some(*status),
            "{args:?}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // In-process: a timeout past what an Instant holds (it panicked before the fix).
    let forever = AttachOptions::default().timeout(std::time::Duration::MAX);
    assert!(matches!(
        Client::attach("shmbridge-absent", forever),
        Err(shmbridge::Error::NotFound { .. })
    ));
    // Absurd but valid: spin budgets and timeouts past what a Duration holds serve and
    // step normally.
    let out = run(&[
        "client",
        "--launch",
        "null",
        "--num-envs",
        "2",
        "--steps",
        "3",
        "--spin-us",
        "1e300",
        "--timeout",
        "1e300",
    ]);
    common::assert_no_crash("[]", &out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let engine = common::EngineProc::start(&[
        "--env",
        "null",
        "--num-envs",
        "2",
        "--spin-us",
        "1e300",
        "--idle-timeout",
        "1e300",
    ]);
    let mut client = Client::attach(&engine.name, AttachOptions::default()).unwrap();
    client.step(std::time::Duration::from_secs(60)).unwrap();
    client.close();
    let (status, err) = engine.finish();
    assert!(status.success(), "{err}");
    assert!(std::fs::read_dir("/dev/shm").unwrap().next().is_none());
}
