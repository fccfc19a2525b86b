//! The C programs against the real library: `capi/tests/hostile.c` (hostile calls), the
//! C null client (`examples/c/null_client.c`) checking 100,000 steps of the Rust `null`
//! engine, the C asynchronous client (`examples/c/async_client.c`) checking every batch, and the C CartPole engine (`examples/c/cartpole_engine.c`) stepped next to
//! the Rust reference engine, frame by frame, bit for bit, and the trajectory stream's C
//! producers and consumer (`capi/tests/stream.c`), with a Rust consumer too. Each is compiled here with
//! `cc` against `include/shmbridge.h` and the `libshmbridge.so` cargo just built.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use shmbridge_core::envs::{self, cartpole::CartPole, null::NullEnv, ServeEnd, VecEnv};
use shmbridge_core::{AttachOptions, Client, DType, Engine};

/// `target/debug` (or `release`): where cargo put libshmbridge.so for this build.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Compiles `source` (relative to the repository) into `target/<profile>/c/<name>`.
fn compile(source: &str, name: &str) -> PathBuf {
    compile_with(source, name, &[])
}

/// [`compile`] with extra compiler flags.
fn compile_with(source: &str, name: &str, flags: &[&str]) -> PathBuf {
    let lib = target_dir();
    assert!(
        lib.join("libshmbridge.so").exists(),
        "{} has no libshmbridge.so: `cargo build -p shmbridge-capi` first (cargo test does \
         not build the C library the C programs link)",
        lib.display()
    );
    let out_dir = lib.join("c");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(name);
    let status = Command::new("cc")
        .args([
            "-std=c11",
            "-D_GNU_SOURCE",
            "-O2",
            "-ffp-contract=off",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .args(flags)
        .arg("-I")
        .arg(repo().join("include"))
        .arg(repo().join(source))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lshmbridge", "-lpthread", "-lm", "-o"])
        .arg(&out)
        .status()
        .expect("running cc");
    assert!(status.success(), "cc failed on {source}");
    out
}

#[test]
fn hostile_calls_return_codes_and_never_crash() {
    let exe = compile("capi/tests/hostile.c", "hostile");
    let out = Command::new(exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{text}", out.status);
    assert!(String::from_utf8_lossy(&out.stdout).contains("every hostile call"));
}

#[test]
fn c_client_checks_every_step_of_the_rust_null_engine() {
    const STEPS: u64 = 100_000;
    let exe = compile("examples/c/null_client.c", "null_client");
    let mut env = NullEnv::new(16, 16, 1, false).unwrap();
    let mut engine = Engine::create(env.spec()).unwrap();
    let name = engine.name().to_string();
    let server = std::thread::spawn(move || {
        envs::serve(&mut engine, &mut env, Duration::from_secs(60), |_| {})
    });
    let out = Command::new(exe)
        .args([name.as_str(), &STEPS.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let served = server.join().unwrap().unwrap();
    assert!(out.status.success(), "{}", out.status);
    assert_eq!(served, ServeEnd::ClientClosed { steps: STEPS });
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(&format!("{STEPS} steps checked")),
        "{report}"
    );
    eprintln!("C client: {}", report.trim());
}

/// Serves shard `engine` of the asynchronous client's region: `obs[e] = [steps of e, e,
/// its last action]` (`examples/c/async_client.c` checks it), each step after a delay of
/// its own (0 to 1 ms, by a small generator seeded by the shard: the shards answer in an
/// order nobody chose; a delay, not a synchronisation). Returns the steps served.
fn serve_async_shard(mut engine: Engine) -> u64 {
    use shmbridge_core::command::{CommandError, CommandHandler, ResetRequest};
    use shmbridge_core::Tensors;
    struct Resets;
    impl CommandHandler for Resets {
        fn reset(&mut self, _: &mut Tensors<'_>, _: &ResetRequest) -> Result<(), CommandError> {
            Ok(())
        }
    }
    let first = engine.shard().env_start as usize;
    let n = engine.num_envs();
    let mut state = u64::from(engine.shard().index) * 0x9E37_79B9 + 1;
    let write = |engine: &mut Engine, steps: u64| {
        let actions: Vec<f32> = engine.tensor::<f32>("actions").unwrap().to_vec();
        let obs = engine.tensor_mut::<f32>("obs").unwrap();
        for e in 0..n {
            obs[3 * e..3 * e + 3].copy_from_slice(&[steps as f32, (first + e) as f32, actions[e]]);
        }
    };
    write(&mut engine, 0);
    engine.publish().unwrap();
    let mut steps = 0;
    loop {
        match engine.wait_actions_with(Duration::from_secs(30), &mut Resets) {
            Ok(_) => {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                std::thread::sleep(Duration::from_micros(state % 1000));
                steps += 1;
                write(&mut engine, steps);
                engine.publish().unwrap();
            }
            Err(shmbridge_core::Error::PeerClosed { .. }) => return steps,
            Err(e) => panic!("shard at env {first}: {e}"),
        }
    }
}

/// A region of `n` envs in `k` shards, each a thread serving with [`serve_async_shard`]:
/// its name and the threads (each returns the steps it served).
fn start_async_shards(n: u32, k: u32) -> (String, Vec<std::thread::JoinHandle<u64>>) {
    let spec = shmbridge_core::EngineSpec::new("async-c", n)
        .tensor(
            "obs",
            DType::F32,
            &[n as u64, 3],
            shmbridge_core::Direction::EngineToClient,
        )
        .tensor(
            "actions",
            DType::F32,
            &[n as u64],
            shmbridge_core::Direction::ClientToEngine,
        )
        .shards(k);
    let creator = Engine::create(spec).unwrap();
    let name = creator.name().to_string();
    let mut shards = vec![std::thread::spawn(move || serve_async_shard(creator))];
    for s in 1..k {
        let name = name.clone();
        shards.push(std::thread::spawn(move || {
            let join = shmbridge_core::engine::JoinOptions::default();
            serve_async_shard(Engine::join(&name, s, join).unwrap())
        }));
    }
    (name, shards)
}

#[test]
fn c_client_checks_every_asynchronous_batch() {
    const ROUNDS: u64 = 2000;
    let exe = compile("examples/c/async_client.c", "async_client");
    let (name, shards) = start_async_shards(8, 4);
    let out = Command::new(exe)
        .args([name.as_str(), "4", &ROUNDS.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    let served: u64 = shards.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(out.status.success(), "{}", out.status);
    // Batches of 2 shards: every shard stepped once per batch it was in.
    assert_eq!(
        served,
        ROUNDS * 2,
        "each shard stepped once per action sent"
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(&format!("{ROUNDS} batches checked")),
        "{report}"
    );
}

/// The C engine's process, stopped (and its region removed) if the test fails.
struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts an engine executable that follows the CLI convention; returns it and the
/// region name it printed.
fn start(exe: &Path, args: &[&str]) -> (Child, String) {
    use std::io::BufRead;
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (Child(child), line.trim().to_string())
}

#[test]
fn c_cartpole_engine_agrees_with_the_rust_one_bit_for_bit() {
    const ENVS: u32 = 8;
    const SEED: u64 = 12345;
    let exe = compile("examples/c/cartpole_engine.c", "cartpole_engine");
    let (mut c_engine, c_name) = start(&exe, &["--num-envs", "8", "--seed", "12345"]);

    let mut env = CartPole::new(ENVS, SEED).unwrap();
    let mut engine = Engine::create(env.spec()).unwrap();
    let rust_name = engine.name().to_string();
    let server = std::thread::spawn(move || {
        envs::serve(&mut engine, &mut env, Duration::from_secs(60), |_| {})
    });

    let attach = |name: &str| Client::attach(name, AttachOptions::default()).unwrap();
    let (mut c, mut rust) = (attach(&c_name), attach(&rust_name));
    let t = Duration::from_secs(10);
    let tensors = ["obs", "rewards", "terminated", "truncated", "final_obs"];
    let same = |c: &mut Client, rust: &mut Client, step: u64| {
        for name in tensors {
            assert_eq!(
                bytes(c, name),
                bytes(rust, name),
                "step {step}: '{name}' differs"
            );
        }
    };
    same(&mut c, &mut rust, 0);
    let mut episodes = 0;
    for step in 1..=3000u64 {
        // A fixed pseudo-random policy (the same for both): short episodes, many
        // autoresets; resets by mask and by command mixed in.
        for client in [&mut c, &mut rust] {
            let actions = client.tensor_mut::<i64>("actions").unwrap();
            for (e, a) in actions.iter_mut().enumerate() {
                *a = ((step.wrapping_mul(2_654_435_761) + 40_503 * e as u64) >> 7 & 1) as i64;
            }
            let mask = client.tensor_mut::<u8>("reset_mask").unwrap();
            mask.fill(0);
            if step % 250 == 0 {
                mask[(step / 250) as usize % ENVS as usize] = 1;
            }
            client.step(t).unwrap();
        }
        episodes += rust
            .tensor::<u8>("terminated")
            .unwrap()
            .iter()
            .filter(|&&d| d != 0)
            .count();
        same(&mut c, &mut rust, step);
        match step {
            1000 => {
                for client in [&mut c, &mut rust] {
                    client.reset(None, &[77], t).unwrap();
                }
            }
            1500 => {
                for client in [&mut c, &mut rust] {
                    client.reset(Some(&[5, 1, 5]), &[3, 4, 9], t).unwrap();
                }
            }
            2000 => {
                for client in [&mut c, &mut rust] {
                    let reply = client
                        .call_method("set_pole_length", &[("length", "0.75")], &[], t)
                        .unwrap();
                    assert_eq!(
                        reply.args,
                        vec![("previous".to_string(), "0.5".to_string())]
                    );
                }
            }
            _ => continue,
        }
        same(&mut c, &mut rust, step);
    }
    assert!(episodes > 500, "the policy should end episodes: {episodes}");
    // Refusals come back as the engine's error replies, as from the Rust engine.
    let err = c.reset(Some(&[ENVS]), &[], t).unwrap_err();
    assert!(
        matches!(err, shmbridge_core::Error::Remote { code: 2, .. }),
        "{err}"
    );
    let err = c.call_method("fly", &[], &[], t).unwrap_err();
    assert!(
        matches!(err, shmbridge_core::Error::Remote { code: 1, .. }),
        "{err}"
    );
    let err = c
        .call_method("set_pole_length", &[("length", "-1")], &[], t)
        .unwrap_err();
    assert!(
        matches!(err, shmbridge_core::Error::Remote { code: 2, .. }),
        "{err}"
    );

    c.close();
    rust.close();
    let status = c_engine.0.wait().unwrap();
    assert!(status.success(), "the C engine exited with {status}");
    assert!(matches!(
        server.join().unwrap().unwrap(),
        ServeEnd::ClientClosed { steps: 3000 }
    ));
}

/// A tensor's bytes (f32 values by their bits, so -0.0 and NaN compare exactly).
fn bytes(client: &mut Client, name: &str) -> Vec<u8> {
    if client.layout().tensor(name).unwrap().1.dtype == DType::F32 {
        let v = client.tensor::<f32>(name).unwrap();
        v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
    } else {
        client.tensor::<u8>(name).unwrap().to_vec()
    }
}

/// C producer processes (forked by the program) write records in place through the
/// reservation's pointers; its C consumer pops each, checks its content, its producer's
/// order and that none is lost or doubled, and releases them out of order; then the
/// error paths (`capi/tests/stream.c`): bad schemas and sizes, NULLs, foreign handles,
/// a record too large, `SHMB_FULL` with nothing published, released records and
/// committed reservations used again, pops that time out, a closed consumer.
#[test]
fn c_stream_producers_and_consumer_check_every_record_and_every_error_path() {
    let exe = compile("capi/tests/stream.c", "stream");
    let out = Command::new(exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{text}", out.status);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("9000 records of 3 C producers checked"),
        "{report}"
    );
    assert!(report.contains("every stream expectation held"), "{report}");
}

/// Record `k` of C producer `id` as `capi/tests/stream.c` writes it: id, tokens, score,
/// meta.
fn c_stream_record(id: u32, k: u64) -> (u32, Vec<i32>, f64, Vec<u8>) {
    let tokens = 1 + ((k * 7 + u64::from(id) * 3) % 60) as usize;
    let meta = ((k + u64::from(id)) % 5) as usize;
    (
        id,
        (0..tokens)
            .map(|j| {
                id.wrapping_mul(1_000_003)
                    .wrapping_add((k as u32).wrapping_mul(131))
                    .wrapping_add(j as u32) as i32
            })
            .collect(),
        k as f64 + f64::from(id) / 8.0,
        (0..meta)
            .map(|j| (k as u8) ^ (j as u8) ^ (id as u8))
            .collect(),
    )
}

/// The same stream from two languages: C producer processes, a Rust consumer (the core's
/// `stream::Consumer`) that checks every record they wrote.
#[test]
fn c_stream_producers_feed_a_rust_consumer() {
    use shmbridge_core::stream::{Consumer, Schema, StreamSpec};
    const N: u64 = 2000;
    let exe = compile("capi/tests/stream.c", "stream-mixed");
    let name = format!("c-stream-mixed-{}", std::process::id());
    let schema =
        Schema::parse("id: uint32, tokens: int32[*], score: float64[1], meta: uint8[*]").unwrap();
    let spec = StreamSpec {
        schema,
        lanes: 2,
        lane_capacity: 8192,
        ranks: 1,
    };
    let consumer = Consumer::create(&name, &spec).unwrap();
    let mut producers: Vec<Child> = (0..2u32)
        .map(|id| {
            let child = Command::new(&exe)
                .args(["produce", name.as_str(), &id.to_string(), &N.to_string()])
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            Child(child)
        })
        .collect();
    let mut next = [0u64; 2];
    for _ in 0..2 * N {
        let rec = consumer
            .pop(Duration::from_secs(30))
            .unwrap()
            .expect("a record within 30 s");
        let id = rec.field::<u32>(0).unwrap()[0];
        assert!(id < 2, "a record of no producer: {id}");
        let k = next[id as usize];
        assert_eq!(rec.seq(), k, "producer {id}: lost or out of order");
        let got = (
            id,
            rec.field::<i32>(1).unwrap().to_vec(),
            rec.field::<f64>(2).unwrap()[0],
            rec.bytes(3).unwrap().to_vec(),
        );
        assert_eq!(got, c_stream_record(id, k), "producer {id} record {k}");
        next[id as usize] += 1;
        rec.release();
    }
    for p in &mut producers {
        let status = p.0.wait().unwrap();
        assert!(status.success(), "a C producer exited with {status}");
    }
    assert!(
        consumer.try_pop().unwrap().is_none(),
        "more records than written"
    );
    let stats = consumer.stats().unwrap();
    assert_eq!((stats.depth, stats.records_lost), (0, 0));
}

/// The C programs built with AddressSanitizer (and its leak checker) and
/// UndefinedBehaviorSanitizer, run through hostile calls, the stream program (its forked
/// producers, 9,000 checked records and its error paths), 20,000 checked steps of the C
/// client, and 2,000 steps with resets and methods of the C engine: any invalid access,
/// leak or undefined behaviour in them or in what the library does on their behalf
/// (its allocations are the process's, seen by the leak checker) fails the test.
#[test]
fn c_programs_are_clean_under_address_and_undefined_behaviour_sanitizers() {
    let flags = [
        "-g",
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
        "-fno-sanitize-recover=all",
    ];
    let sanitized = |cmd: &mut Command| {
        cmd.env(
            "ASAN_OPTIONS",
            "detect_leaks=1:abort_on_error=0:exitcode=99",
        )
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    };
    let check = |what: &str, out: std::process::Output| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{what}: {}\n{err}", out.status);
        for bad in ["AddressSanitizer", "LeakSanitizer", "runtime error"] {
            assert!(!err.contains(bad), "{what}: {bad} reported:\n{err}");
        }
        eprintln!("{what}: clean");
    };

    let hostile = compile_with("capi/tests/hostile.c", "hostile-asan", &flags);
    let mut cmd = Command::new(hostile);
    sanitized(&mut cmd);
    check("hostile.c", cmd.output().unwrap());

    let stream = compile_with("capi/tests/stream.c", "stream-asan", &flags);
    let mut cmd = Command::new(stream);
    sanitized(&mut cmd);
    check("stream.c", cmd.output().unwrap());

    let client = compile_with("examples/c/null_client.c", "null_client-asan", &flags);
    let mut env = NullEnv::new(16, 16, 1, false).unwrap();
    let mut engine = Engine::create(env.spec()).unwrap();
    let name = engine.name().to_string();
    let server = std::thread::spawn(move || {
        envs::serve(&mut engine, &mut env, Duration::from_secs(60), |_| {})
    });
    let mut cmd = Command::new(client);
    cmd.args([name.as_str(), "20000"]);
    sanitized(&mut cmd);
    check("null_client.c", cmd.output().unwrap());
    server.join().unwrap().unwrap();

    let client = compile_with("examples/c/async_client.c", "async_client-asan", &flags);
    let (name, shards) = start_async_shards(8, 4);
    let mut cmd = Command::new(client);
    cmd.args([name.as_str(), "4", "200"]);
    sanitized(&mut cmd);
    check("async_client.c", cmd.output().unwrap());
    for t in shards {
        t.join().unwrap();
    }

    let engine_exe = compile_with(
        "examples/c/cartpole_engine.c",
        "cartpole_engine-asan",
        &flags,
    );
    let mut cmd = Command::new(engine_exe);
    cmd.args(["--num-envs", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    sanitized(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let mut client = Client::attach(line.trim(), AttachOptions::default()).unwrap();
    let t = Duration::from_secs(10);
    for step in 0..2000u64 {
        client
            .tensor_mut::<i64>("actions")
            .unwrap()
            .fill((step % 3 == 0) as i64);
        client.step(t).unwrap();
        if step % 500 == 0 {
            client.reset(Some(&[1, 3]), &[step], t).unwrap();
            client
                .call_method("set_pole_length", &[("length", "0.5")], &[], t)
                .unwrap();
            assert!(client.call_method("nope", &[], b"payload", t).is_err());
        }
    }
    client.close();
    check("cartpole_engine.c", child.wait_with_output().unwrap());
}
