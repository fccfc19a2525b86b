//! GPU tests. Each one first checks that CUDA is usable (`shmbridge::cuda::probe`: the
//! `cuda` feature, a loadable driver, a device) and otherwise prints why and returns:
//! they pass vacuously on CPU-only machines (CI) and run for real on a GPU machine.
//! Run there with `cargo test --features cuda --test cuda -- --nocapture --test-threads=1`.
//!
//! Cross-process checks re-run this test binary as a child (`SHMBRIDGE_CUDA_CHILD`), since
//! a CUDA IPC handle cannot be opened in the process that exported it.

#![cfg(feature = "cuda")]

use std::process::Command;
use std::sync::Arc;

use shmbridge::cuda::driver::{self, DeviceAllocation, Driver, IpcEvent, PrimaryContext, Stream};

/// The driver and device 0's primary context, or `None` (after printing why).
fn gpu(test: &str) -> Option<(&'static Driver, Arc<PrimaryContext>)> {
    match Driver::get() {
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
        Ok(d) => Some((d, PrimaryContext::retain(d, 0).expect("device 0"))),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

/// Runs `child` in a fresh process of this test binary with `env`, returns its stdout.
fn run_child(child: &str, env: &[(&str, String)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new(exe);
    c.args([child, "--exact", "--nocapture", "--test-threads=1"]);
    c.env("SHMBRIDGE_CUDA_CHILD", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "child {child} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn is_child() -> bool {
    std::env::var_os("SHMBRIDGE_CUDA_CHILD").is_some()
}

#[test]
fn probe_reports_devices_or_why_not() {
    match shmbridge::cuda::probe() {
        Ok(info) => assert!(info.device_count >= 1),
        Err(e) => eprintln!("SKIPPED probe_reports_devices_or_why_not: {e}"),
    }
}

#[test]
fn allocation_round_trip_and_export() {
    let Some((_, ctx)) = gpu("allocation_round_trip_and_export") else {
        return;
    };
    let a = DeviceAllocation::new(&ctx, 4096).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    a.write(0, &data).unwrap();
    let mut back = vec![0u8; 4096];
    a.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(a.read(4000, &mut back).is_err(), "span past the end");
    let h = a.ipc_handle().unwrap();
    assert!(h.iter().any(|&b| b != 0));
    // Opening our own export fails (driver rule), with an error, not a panic.
    assert!(driver::import_memory(&ctx, &h).is_err());
    let ev = IpcEvent::create(&ctx).unwrap();
    assert!(ev.handle().unwrap().iter().any(|&b| b != 0));
    let s = Stream::create(&ctx).unwrap();
    ev.record(&s).unwrap();
    ev.synchronize().unwrap();
}

/// Child side of `another_process_sees_the_bytes`: opens the handle, checks the bytes at
/// the offset after waiting on the parent's event, prints the opened base pointer.
#[test]
fn child_import_and_check() {
    if !is_child() {
        return;
    }
    let (_, ctx) = gpu("child").unwrap();
    let handle: [u8; 64] = unhex(&std::env::var("MEM").unwrap());
    let event: [u8; 64] = unhex(&std::env::var("EVENT").unwrap());
    let offset: u64 = std::env::var("OFFSET").unwrap().parse().unwrap();
    let ev = IpcEvent::open(&ctx, &event).unwrap();
    let s = Stream::create(&ctx).unwrap();
    s.wait(&ev).unwrap();
    s.synchronize().unwrap();
    let m = driver::import_memory(&ctx, &handle).unwrap();
    let again = driver::import_memory(&ctx, &handle).unwrap();
    assert!(Arc::ptr_eq(&m, &again), "one open per process and handle");
    assert_eq!(driver::import_counts(), (1, 0));
    let mut got = vec![0u8; 256];
    m.read(offset, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0xAB), "{got:?}");
    assert!(m.span(m.size() as u64, 1).is_err());
    drop((m, again));
    assert_eq!(driver::import_counts(), (1, 1), "closed exactly once");
    println!("CHILD-OK");
}

#[test]
fn another_process_sees_the_bytes() {
    if is_child() {
        return;
    }
    let Some((_, ctx)) = gpu("another_process_sees_the_bytes") else {
        return;
    };
    let a = DeviceAllocation::new(&ctx, 1 << 20).unwrap();
    let offset = 4096usize;
    a.write(offset, &[0xAB; 256]).unwrap();
    let ev = IpcEvent::create(&ctx).unwrap();
    let s = Stream::create(&ctx).unwrap();
    ev.record(&s).unwrap();
    let out = run_child(
        "child_import_and_check",
        &[
            ("MEM", hex(&a.ipc_handle().unwrap())),
            ("EVENT", hex(&ev.handle().unwrap())),
            ("OFFSET", offset.to_string()),
        ],
    );
    assert!(out.contains("CHILD-OK"), "{out}");
}

#[test]
fn kernels_compile_with_nvrtc_and_null_matches_the_cpu_pattern() {
    let Some((d, ctx)) = gpu("kernels_compile_with_nvrtc") else {
        return;
    };
    let modules = match shmbridge::cuda::kernels::load_all(d, &ctx) {
        Ok(m) => m,
        Err(e @ shmbridge::Error::CudaUnavailable { .. }) => {
            eprintln!("SKIPPED kernels: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let null = &modules.iter().find(|(f, _)| *f == "null.cu").unwrap().1;
    let n = 1000u64;
    let obs = DeviceAllocation::new(&ctx, n as usize * 4).unwrap();
    let s = Stream::create(&ctx).unwrap();
    use driver::Arg;
    // SAFETY: null_fill(float*, u64, u64); `obs` holds n floats.
    unsafe {
        null.launch(
            "null_fill",
            &s,
            n as u32,
            128,
            &[Arg::Ptr(obs.ptr()), Arg::U64(n), Arg::U64(7)],
        )
    }
    .unwrap();
    s.synchronize().unwrap();
    let mut bytes = vec![0u8; n as usize * 4];
    obs.read(0, &mut bytes).unwrap();
    for (i, c) in bytes.chunks_exact(4).enumerate() {
        let v = f32::from_le_bytes(c.try_into().unwrap());
        assert_eq!(
            v,
            shmbridge::envs::null::pattern(7, i as u64),
            "element {i}"
        );
    }
}
