//! Helpers shared by the integration tests: run the real `shmbridge` binary as an engine.
#![allow(dead_code)]

pub mod peer;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_shmbridge");

/// An engine child process; killed and reaped on drop if still running.
pub struct EngineProc {
    pub child: Child,
    pub name: String,
}

impl EngineProc {
    /// Starts `shmbridge engine ARGS...` and reads the region name it prints once frame 0
    /// is published; the engine's stderr in the panic message if it does not serve.
    pub fn start(args: &[&str]) -> EngineProc {
        let mut child = Command::new(BIN)
            .arg("engine")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn shmbridge engine");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read region name");
        let name = line.trim().to_string();
        if name.is_empty() {
            let out = child.wait_with_output().expect("wait engine");
            panic!(
                "engine {args:?} did not serve ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(name.starts_with("shmbridge-"), "engine printed {line:?}");
        EngineProc { child, name }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the engine to exit and returns its status and stderr.
    pub fn finish(mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().expect("wait engine");
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut err);
        }
        std::mem::forget(self);
        (status, err)
    }
}

impl Drop for EngineProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn shm_exists(name: &str) -> bool {
    Path::new("/dev/shm").join(name).exists()
}

pub fn signal(pid: u32, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(pid as i32).expect("pid");
    rustix::process::kill_process(pid, sig).expect("kill");
}
