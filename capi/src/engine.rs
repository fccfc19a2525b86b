//! `shmb_engine`: a simulator serving a region (the core's `Engine`).

use std::ffi::{c_char, c_void};

use shmbridge_core::engine::Engine;

use crate::commands::{shmb_handlers, CHandlers};
use crate::registry::{Kind, Registry};
use crate::side::{self, Named};
use crate::spec::{self, shmb_spec};
use crate::status::{guard, shmb_status, CResult};
use crate::types::{need, put, shmb_tensor_info, timeout};

/// An engine serving one region (opaque; a handle, never dereferenced).
#[allow(non_camel_case_types)]
pub struct shmb_engine {
    _opaque: [u8; 0],
}

static ENGINES: Registry<Named<Engine>> = Registry::new("engine", Kind::Engine);

pub(crate) fn with<R>(
    engine: *mut shmb_engine,
    f: impl FnOnce(&mut Named<Engine>) -> CResult<R>,
) -> CResult<R> {
    ENGINES.with(engine as usize, f)
}

/// Creates the region for `spec` (sweeping regions of dead engines first). Tensors start
/// zeroed: write the reset observations through `shmb_engine_tensor`, then
/// `shmb_engine_publish` frame 0; clients can attach from then on.
///
/// Ownership: `spec` stays the caller's (free it with `shmb_spec_free`); `*out` is a new
/// engine owned by the caller, closed with `shmb_engine_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_create(
    spec: *mut shmb_spec,
    out: *mut *mut shmb_engine,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        let engine = Engine::create(spec::cloned(spec)?)?;
        let handle = ENGINES.insert(Named::new(engine))?;
        // SAFETY: checked non-null above; the caller gives a writable pointer.
        unsafe { put(out, handle as *mut shmb_engine, "out") }
    })
}

/// The region name clients attach with (print it for a launching learner).
///
/// Ownership: `*name` is owned by the engine, valid until `shmb_engine_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_name(
    engine: *mut shmb_engine,
    name: *mut *const c_char,
) -> shmb_status {
    // SAFETY: `name` is NULL or writable per the caller's contract.
    guard(|| unsafe { put(name, with(engine, side::name)?, "name") })
}

/// Number of environments (the spec's `num_envs`).
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_num_envs(
    engine: *mut shmb_engine,
    num_envs: *mut u32,
) -> shmb_status {
    // SAFETY: `num_envs` is NULL or writable per the caller's contract.
    guard(|| unsafe { put(num_envs, with(engine, side::num_envs)?, "num_envs") })
}

/// Number of tensors in the engine's table.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_tensor_count(
    engine: *mut shmb_engine,
    count: *mut usize,
) -> shmb_status {
    // SAFETY: `count` is NULL or writable per the caller's contract.
    guard(|| unsafe { put(count, with(engine, side::tensor_count)?, "count") })
}

/// The table entry of tensor `index` (table order: the spec's order).
///
/// Ownership: `info->name` is owned by the engine, valid until `shmb_engine_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_tensor_info(
    engine: *mut shmb_engine,
    index: usize,
    info: *mut shmb_tensor_info,
) -> shmb_status {
    // SAFETY: `info` is NULL or writable per the caller's contract.
    guard(|| unsafe { put(info, with(engine, |h| side::tensor_info(h, index))?, "info") })
}

/// The host address and byte length of a tensor, by `name`, or by `index` when `name`
/// is NULL. The engine writes the engine→client tensors there (frame 0 before the first
/// publish, then each frame between `shmb_engine_wait_actions` and `shmb_engine_publish`)
/// and reads the client→engine ones after `shmb_engine_wait_actions`. A tensor on CUDA:
/// `SHMB_NOT_ON_HOST` (use `shmb_engine_device_ptr`); in Vulkan memory the engine
/// exported: `SHMB_NOT_ON_HOST` too (its renderer writes it).
///
/// Ownership: the memory is the shared region itself (no copy), owned by the engine;
/// the pointer is valid until `shmb_engine_close`. Keep it: it does not change.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_tensor(
    engine: *mut shmb_engine,
    name: *const c_char,
    index: usize,
    data: *mut *mut c_void,
    nbytes: *mut usize,
) -> shmb_status {
    guard(|| {
        need(data, "data")?;
        need(nbytes, "nbytes")?;
        // SAFETY: `name` is NULL or a NUL-terminated string per the caller's contract.
        let found = with(engine, |h| unsafe { side::tensor(h, name, index) })?;
        // SAFETY: both checked non-null; writable per the caller's contract.
        unsafe { side::put_pair(data, nbytes, found) }
    })
}

/// Publishes the frame: the engine→client tensors must hold it. The first call publishes
/// frame 0 (the reset observations); each later one answers the action
/// `shmb_engine_wait_actions` returned. `*frame` (may be NULL): the frame's number.
/// An engine whose Vulkan tensors have a timeline semaphore publishes with
/// `shmb_engine_publish_signaled` instead, which checks the value its renderer signalled:
/// here it gets `SHMB_INVALID_SPEC` and nothing is published.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_publish(
    engine: *mut shmb_engine,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        let f = with(engine, |h| Ok(h.side.publish()?))?;
        if !frame.is_null() {
            // SAFETY: non-null; writable per the caller's contract.
            unsafe { frame.write(f) };
        }
        Ok(())
    })
}

/// Waits up to `timeout_ms` (`SHMB_FOREVER`: no limit) for the client's next action;
/// `*action` (may be NULL) gets its number. Then read the client→engine tensors, step,
/// write the frame and `shmb_engine_publish` it. Commands arriving meanwhile are answered
/// on this thread: the built-ins by the library, `Reset` and engine-defined methods by
/// `handlers` (NULL: refused with an error reply).
///
/// `SHMB_CLIENT_CLOSED`: the client closed (the usual end of a serve loop);
/// `SHMB_CLIENT_DIED`: it died (noticed within ~10 ms); `SHMB_TIMEOUT`: no action in
/// time (call again: nothing was lost).
///
/// Ownership: `handlers` and its `user` pointer are borrowed for this call only.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_wait_actions(
    engine: *mut shmb_engine,
    timeout_ms: u64,
    handlers: *const shmb_handlers,
    action: *mut u64,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes NULL or a valid table for the call.
        let table = unsafe { handlers.as_ref() };
        let seq = with(engine, |h| {
            let num_envs = h.side.layout().num_envs;
            Ok(match table {
                Some(t) => h
                    .side
                    .wait_actions_with(timeout(timeout_ms), &mut CHandlers::new(t, num_envs))?,
                None => h.side.wait_actions(timeout(timeout_ms))?,
            })
        })?;
        if !action.is_null() {
            // SAFETY: non-null; writable per the caller's contract.
            unsafe { action.write(seq) };
        }
        Ok(())
    })
}

/// Answers the commands waiting now, without waiting for an action (an engine busy with
/// a long step, or before frame 0). `*answered` (may be NULL): how many.
///
/// Ownership: as `shmb_engine_wait_actions`.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_poll_commands(
    engine: *mut shmb_engine,
    handlers: *const shmb_handlers,
    answered: *mut usize,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes NULL or a valid table for the call.
        let table = unsafe { handlers.as_ref() };
        let n = with(engine, |h| {
            let num_envs = h.side.layout().num_envs;
            Ok(match table {
                Some(t) => h.side.poll_commands(&mut CHandlers::new(t, num_envs))?,
                None => h
                    .side
                    .poll_commands(&mut shmbridge_core::command::BuiltinsOnly)?,
            })
        })?;
        if !answered.is_null() {
            // SAFETY: non-null; writable per the caller's contract.
            unsafe { answered.write(n) };
        }
        Ok(())
    })
}

/// Whether a client is attached now (`*attached` 1 or 0).
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_client_attached(
    engine: *mut shmb_engine,
    attached: *mut u8,
) -> shmb_status {
    guard(|| {
        need(attached, "attached")?;
        let a = with(engine, |h| Ok(h.side.client_attached()))?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(attached, a as u8, "attached") }
    })
}

/// Waits until a live client is attached; `SHMB_OK` at once if one is. The way to serve
/// one client after another: after `shmb_engine_wait_actions` said `SHMB_CLIENT_CLOSED`
/// or `SHMB_CLIENT_DIED`, call this, then wait for actions again. It sleeps (an
/// attaching client wakes it), so a loop around it uses no CPU while no client comes.
/// `SHMB_TIMEOUT` after `timeout_ms` (`SHMB_FOREVER`: no limit).
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_wait_for_client(
    engine: *mut shmb_engine,
    timeout_ms: u64,
) -> shmb_status {
    guard(|| {
        with(engine, |h| {
            Ok(h.side.wait_for_client(timeout(timeout_ms))?)
        })
    })
}

/// Device address (in this process) of a tensor on CUDA, by name or index (`name`
/// NULL), for the engine's kernels. `SHMB_CUDA_UNAVAILABLE` in a build without the
/// `cuda` feature; an error for a host tensor.
///
/// Ownership: device memory owned by the engine, valid until `shmb_engine_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_device_ptr(
    engine: *mut shmb_engine,
    name: *const c_char,
    index: usize,
    ptr: *mut u64,
) -> shmb_status {
    guard(|| {
        need(ptr, "ptr")?;
        // SAFETY: `name` is NULL or a NUL-terminated string per the caller's contract.
        let p = with(engine, |h| unsafe { side::device_ptr(h, name, index) })?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(ptr, p, "ptr") }
    })
}

/// The engine's CUDA stream (a `CUstream`): launch the kernels that write a frame (or a
/// reset) on it; `shmb_engine_publish` records the engine's interprocess event after
/// them, and waits on the client's event before the engine reads device actions.
/// `SHMB_CUDA_UNAVAILABLE` without the `cuda` feature or without CUDA tensors.
///
/// Ownership: the stream is the engine's, valid until `shmb_engine_close`; do not
/// destroy it.
#[no_mangle]
pub unsafe extern "C" fn shmb_engine_cuda_stream(
    engine: *mut shmb_engine,
    stream: *mut u64,
) -> shmb_status {
    guard(|| {
        need(stream, "stream")?;
        let s = with(engine, |h| {
            Ok(shmbridge_core::device::cuda_stream(h.side.backend(), h.side.name())?.raw())
        })?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(stream, s, "stream") }
    })
}

/// Closes the engine: the region is marked closed (a waiting client gets
/// `SHMB_ENGINE_CLOSED`), its name removed from /dev/shm, its memory unmapped. Every
/// tensor pointer of this engine is invalid afterwards, and so is the handle (a later
/// call with it: `SHMB_CLOSED`).
#[no_mangle]
pub extern "C" fn shmb_engine_close(engine: *mut shmb_engine) -> shmb_status {
    guard(|| {
        let h = ENGINES.remove(engine as usize)?;
        h.side.close();
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{shmb_spec_add_standard, shmb_spec_free, shmb_spec_new};
    use crate::status::shmb_status::*;
    use crate::types::SHMB_FOREVER;
    use shmbridge_core::client::{AttachOptions, Client};
    use std::ffi::CStr;
    use std::time::Duration;

    /// A client in a thread that attaches to `name`, steps once and closes.
    fn one_client(name: String) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let mut c = Client::attach(&name, AttachOptions::default()).unwrap();
            c.step(Duration::from_secs(30)).unwrap();
            c.close();
        })
    }

    #[test]
    fn an_engine_serves_one_client_after_another_by_waiting_for_the_next() {
        let mut spec = std::ptr::null_mut();
        let mut engine = std::ptr::null_mut();
        let mut name = std::ptr::null();
        // SAFETY: valid out-pointers; the spec and engine are this test's handles.
        unsafe {
            assert_eq!(shmb_spec_new(c"wait-test".as_ptr(), 2, &mut spec), SHMB_OK);
            assert_eq!(shmb_spec_add_standard(spec, 3, 1, 2), SHMB_OK);
            assert_eq!(shmb_engine_create(spec, &mut engine), SHMB_OK);
            assert_eq!(shmb_engine_name(engine, &mut name), SHMB_OK);
            assert_eq!(shmb_engine_publish(engine, std::ptr::null_mut()), SHMB_OK);
        }
        // SAFETY: the engine's NUL-terminated name, valid while it lives.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .unwrap()
            .to_string();
        // SAFETY: a live engine handle.
        assert_eq!(
            unsafe { shmb_engine_wait_for_client(engine, 20) },
            SHMB_TIMEOUT
        );
        for _ in 0..2 {
            let client = one_client(name.clone());
            // SAFETY: a live engine handle; NULL handlers and action are allowed.
            unsafe {
                assert_eq!(shmb_engine_wait_for_client(engine, SHMB_FOREVER), SHMB_OK);
                let none = std::ptr::null();
                let no_seq = std::ptr::null_mut();
                assert_eq!(
                    shmb_engine_wait_actions(engine, 30_000, none, no_seq),
                    SHMB_OK
                );
                assert_eq!(shmb_engine_publish(engine, std::ptr::null_mut()), SHMB_OK);
                assert_eq!(
                    shmb_engine_wait_actions(engine, 30_000, none, no_seq),
                    SHMB_CLIENT_CLOSED
                );
            }
            client.join().unwrap();
        }
        assert_eq!(shmb_engine_close(engine), SHMB_OK);
        assert_eq!(shmb_spec_free(spec), SHMB_OK);
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    }
}
