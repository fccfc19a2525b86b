//! A child forked from a process holding an engine and a client drops its copies of both:
//! nothing happens to the parent's session (before the fix, the child's drops closed the
//! region and removed its name).

mod common;

use std::time::Duration;

use shmbridge::{AttachOptions, Client, DType, Engine, EngineSpec};

#[test]
fn a_forked_child_dropping_engine_and_client_leaves_the_session() {
    let mut engine = Engine::create(EngineSpec::standard("fork", 2, 3, 1, DType::F32)).unwrap();
    engine.publish().unwrap();
    let name = engine.name().to_string();
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    // SAFETY: the child only drops the two values (system calls and frees; glibc's fork
    // keeps malloc usable in the child) and exits without running anything else.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        drop(client);
        drop(engine);
        // SAFETY: ends the child without unwinding into the test harness.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    assert!(common::shm_exists(&name));
    std::thread::scope(|s| {
        s.spawn(|| {
            let seq = engine.wait_actions(Duration::from_secs(30)).unwrap();
            engine.publish().unwrap();
            seq
        });
        assert_eq!(client.step(Duration::from_secs(30)).unwrap(), 1);
    });
    client.close();
    engine.close();
    assert!(!common::shm_exists(&name));
}
