//! The CLI engine's SIGTERM handler closes the region it serves, never whatever the name
//! means now: once its name was removed and taken by another engine, SIGTERM to the old
//! engine leaves the new one serving.

mod common;

use std::time::Duration;

use shmbridge::{AttachOptions, Client};

/// Before the fix the handler re-opened its region by name: it closed the new engine's
/// region and removed its name.
#[test]
fn sigterm_closes_the_engines_own_region_not_the_names_new_owner() {
    let name = common::ns_name("reused");
    let args = ["--env", "null", "--num-envs", "2", "--name", &name];
    let old = common::EngineProc::start(&args);
    // Someone removes the old engine's name, and a new engine takes it.
    std::fs::remove_file(common::shm_path(&name)).unwrap();
    let new = common::EngineProc::start(&args);
    common::signal(old.pid(), rustix::process::Signal::TERM);
    let (status, err) = old.finish();
    assert_eq!(status.code(), Some(128 + 15), "{err}");
    assert!(
        common::shm_exists(&name),
        "the new engine's name was removed"
    );
    let mut client = Client::attach(&name, AttachOptions::default()).unwrap();
    assert_eq!(client.layout().engine_pid, new.pid());
    client.step(Duration::from_secs(30)).unwrap();
    client.close();
    let (status, err) = new.finish();
    assert!(status.success(), "{err}");
    assert!(!common::shm_exists(&name));
}
