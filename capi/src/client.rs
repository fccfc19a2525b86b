//! `shmb_client`: a learner (or a tester) attached to an engine (the core's `Client`).

use std::ffi::{c_char, c_void, CString};

use shmbridge_core::client::{AttachOptions, Client};
use shmbridge_core::device::StreamRef;

use crate::registry::{Kind, Registry};
use crate::side::{self, Named};
use crate::status::{guard, shmb_status, CResult, Fail};
use crate::types::{
    c_string, kv_arg, need, policy, put, shmb_tensor_info, slice_arg, str_arg, timeout,
};

/// A client attached to an engine (opaque; a handle, never dereferenced).
#[allow(non_camel_case_types)]
pub struct shmb_client {
    _opaque: [u8; 0],
}

struct ClientHandle {
    named: Named<Client>,
    /// The last `shmb_client_call`'s reply: its arguments (as C strings) and payload.
    reply_args: Vec<(CString, CString)>,
    reply_payload: Vec<u8>,
}

static CLIENTS: Registry<ClientHandle> = Registry::new("client", Kind::Client);

fn with<R>(
    client: *mut shmb_client,
    f: impl FnOnce(&mut ClientHandle) -> CResult<R>,
) -> CResult<R> {
    CLIENTS.with(client as usize, f)
}

/// Writes `value` to `out` when `out` is not NULL (optional results).
///
/// # Safety
/// `out` is NULL or writable.
pub(crate) unsafe fn maybe<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-null; writable per the caller's contract.
        unsafe { out.write(value) };
    }
}

/// Attaches to the engine serving region `name` (as the engine printed it), waiting up to
/// `timeout_ms` for it to publish frame 0. `spin_us`: how the client waits for frames
/// (spin that many microseconds, then sleep; 0: never spin; `SHMB_SPIN_DEFAULT`: 100 µs, up to 2 ms while the last waits took longer).
/// After this, the engine→client tensors hold the reset observations.
///
/// Ownership: `name` is copied; `*out` is a new client owned by the caller, closed with
/// `shmb_client_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_attach(
    name: *const c_char,
    timeout_ms: u64,
    spin_us: i64,
    out: *mut *mut shmb_client,
) -> shmb_status {
    guard(|| {
        need(out, "out")?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let name = unsafe { str_arg(name, "name")? };
        let options = AttachOptions::default()
            .timeout(timeout(timeout_ms))
            .policy(policy(spin_us));
        let client = Client::attach(name, options)?;
        let handle = CLIENTS.insert(ClientHandle {
            named: Named::new(client),
            reply_args: Vec::new(),
            reply_payload: Vec::new(),
        })?;
        // SAFETY: checked non-null above; writable per the caller's contract.
        unsafe { put(out, handle as *mut shmb_client, "out") }
    })
}

/// The region's name. Ownership: owned by the client, valid until `shmb_client_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_name(
    client: *mut shmb_client,
    name: *mut *const c_char,
) -> shmb_status {
    // SAFETY: `name` is NULL or writable per the caller's contract.
    guard(|| unsafe { put(name, with(client, |h| side::name(&mut h.named))?, "name") })
}

/// Number of environments the engine serves.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_num_envs(
    client: *mut shmb_client,
    num_envs: *mut u32,
) -> shmb_status {
    // SAFETY: `num_envs` is NULL or writable per the caller's contract.
    guard(|| unsafe {
        put(
            num_envs,
            with(client, |h| side::num_envs(&mut h.named))?,
            "num_envs",
        )
    })
}

/// Number of tensors in the engine's table.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_tensor_count(
    client: *mut shmb_client,
    count: *mut usize,
) -> shmb_status {
    // SAFETY: `count` is NULL or writable per the caller's contract.
    guard(|| unsafe {
        put(
            count,
            with(client, |h| side::tensor_count(&mut h.named))?,
            "count",
        )
    })
}

/// The table entry of tensor `index`, as the client validated it.
///
/// Ownership: `info->name` is owned by the client, valid until `shmb_client_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_tensor_info(
    client: *mut shmb_client,
    index: usize,
    info: *mut shmb_tensor_info,
) -> shmb_status {
    // SAFETY: `info` is NULL or writable per the caller's contract.
    guard(|| unsafe {
        put(
            info,
            with(client, |h| side::tensor_info(&mut h.named, index))?,
            "info",
        )
    })
}

/// The host address and byte length of a tensor, by `name`, or by `index` when `name`
/// is NULL. Read the engine→client tensors after a step (or reset); write the
/// client→engine ones (actions, reset mask) before `shmb_client_step`. A tensor on
/// CUDA: `SHMB_NOT_ON_HOST` (use `shmb_client_device_ptr`).
///
/// Ownership: the memory is the shared region itself (no copy), valid until
/// `shmb_client_close`. Keep the pointer: it does not change.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_tensor(
    client: *mut shmb_client,
    name: *const c_char,
    index: usize,
    data: *mut *mut c_void,
    nbytes: *mut usize,
) -> shmb_status {
    guard(|| {
        need(data, "data")?;
        need(nbytes, "nbytes")?;
        // SAFETY: `name` is NULL or a NUL-terminated string per the caller's contract.
        let found = with(client, |h| unsafe {
            side::tensor(&mut h.named, name, index)
        })?;
        // SAFETY: both checked non-null; writable per the caller's contract.
        unsafe { side::put_pair(data, nbytes, found) }
    })
}

/// Sends the actions written into the client→engine tensors and waits up to
/// `timeout_ms` for the engine's frame; `*frame` (may be NULL): its number. The
/// engine→client tensors then hold it, in place. `timeout_ms` bounds the whole step.
/// `SHMB_ENGINE_CLOSED`, `SHMB_ENGINE_DIED` (within ~10 ms of the engine's death),
/// `SHMB_TIMEOUT` (the action was sent and the step is still in flight:
/// `shmb_client_wait_frame` finishes it), `SHMB_NOT_POSTED` (the action was not sent:
/// a CUDA stream it waits on did not drain in time: a consumer stream of a Vulkan
/// engine's tensors, or of CUDA memory shared by file descriptor; nothing is in
/// flight, the frame is unchanged: call `shmb_client_step` again).
#[no_mangle]
pub unsafe extern "C" fn shmb_client_step(
    client: *mut shmb_client,
    timeout_ms: u64,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        let f = with(client, |h| Ok(h.named.side.step(timeout(timeout_ms))?))?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe { maybe(frame, f) };
        Ok(())
    })
}

/// Waits for the frame of the last action posted (after a step that timed out).
#[no_mangle]
pub unsafe extern "C" fn shmb_client_wait_frame(
    client: *mut shmb_client,
    timeout_ms: u64,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        let f = with(client, |h| {
            Ok(h.named.side.wait_frame(timeout(timeout_ms))?)
        })?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe { maybe(frame, f) };
        Ok(())
    })
}

/// Resets envs over the command channel: `env_ids` (`num_env_ids` of them; NULL and 0:
/// every env) with `seeds` (`num_seeds`: 0, 1 (env k of the list gets `seed + k`) or
/// one per env). When it returns the engine→client tensors hold the reset observations;
/// `*frame` (may be NULL): the frame number (unchanged: a reset consumes no action).
/// `SHMB_REMOTE` when the engine refuses (the message is its).
///
/// Ownership: the arrays are read during the call only.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_reset(
    client: *mut shmb_client,
    env_ids: *const u32,
    num_env_ids: usize,
    seeds: *const u64,
    num_seeds: usize,
    timeout_ms: u64,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        let ids = if env_ids.is_null() && num_env_ids == 0 {
            None
        } else {
            // SAFETY: the caller passes `num_env_ids` u32s at `env_ids`.
            Some(unsafe { slice_arg(env_ids, num_env_ids, "env_ids")? })
        };
        // SAFETY: the caller passes `num_seeds` u64s at `seeds`.
        let seeds = unsafe { slice_arg(seeds, num_seeds, "seeds")? };
        let f = with(client, |h| {
            Ok(h.named.side.reset(ids, seeds, timeout(timeout_ms))?)
        })?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe { maybe(frame, f) };
        Ok(())
    })
}

/// Starts asynchronous batches (docs/async.md) on a sharded region: resets every env
/// (`seeds`, `num_seeds` as for `shmb_client_reset`) and makes every shard ready;
/// `shmb_client_recv` then hands out `batch_size` envs (whole shards: a multiple of the
/// shard size) at a time. From here on `shmb_client_step` is `SHMB_OUT_OF_ORDER`.
/// `SHMB_INVALID_SPEC` for an unsharded region, device tensors or a `batch_size` that
/// is not a multiple of the shard size.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_async_reset(
    client: *mut shmb_client,
    batch_size: usize,
    seeds: *const u64,
    num_seeds: usize,
    timeout_ms: u64,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes `num_seeds` u64s at `seeds`.
        let seeds = unsafe { slice_arg(seeds, num_seeds, "seeds")? };
        with(client, |h| {
            Ok(h.named
                .side
                .async_reset(batch_size, seeds, timeout(timeout_ms))?)
        })
    })
}

/// Waits up to `timeout_ms` until `batch_size` envs have frames and hands them out:
/// writes their ids to `env_ids` (room for `capacity`; `*count`: how many, the batch
/// size). Their rows of the engine→client tensors hold the frames, in place, until their
/// actions are sent. `SHMB_BUFFER_TOO_SMALL` (nothing handed out; `*count`, when not NULL,
/// set to the batch size needed) when `capacity` is smaller than the batch; `SHMB_TIMEOUT` (nothing handed out); `SHMB_OUT_OF_ORDER` before
/// `shmb_client_async_reset`, or with fewer shards stepping than a batch holds;
/// `SHMB_ENGINE_DIED`/`SHMB_ENGINE_CLOSED` for a shard that died or closed.
///
/// Ownership: `env_ids` stays the caller's.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_recv(
    client: *mut shmb_client,
    timeout_ms: u64,
    env_ids: *mut u32,
    capacity: usize,
    count: *mut usize,
) -> shmb_status {
    guard(|| {
        if env_ids.is_null() {
            return Err(Fail::null("env_ids"));
        }
        with(client, |h| {
            let side = &mut h.named.side;
            if let Some(need) = side.async_batch_size() {
                if capacity < need {
                    // SAFETY: NULL or writable per the caller's contract.
                    unsafe { maybe(count, need) };
                    return Err(Fail::new(
                        shmb_status::SHMB_BUFFER_TOO_SMALL,
                        format!("room for {capacity} env ids; a batch has {need}"),
                    ));
                }
            }
            let ids = side.recv(timeout(timeout_ms))?;
            // SAFETY: non-null, room for `capacity` u32s per the caller's contract, and
            // `ids.len()` is the batch size, checked against `capacity` above.
            unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), env_ids, ids.len()) };
            // SAFETY: NULL or writable per the caller's contract.
            unsafe { maybe(count, ids.len()) };
            Ok(())
        })
    })
}

/// Posts the actions written into rows `env_ids` (`num_env_ids` of them) of the
/// client→engine tensors: the envs of whole shards handed out by `shmb_client_recv` and
/// not sent yet, each once, in any order. Those shards step. `SHMB_OUT_OF_ORDER` (nothing
/// posted) for an env not handed out, sent already, listed twice, or a shard listed in
/// part (the message names the env); `SHMB_ENGINE_CLOSED` (nothing posted) once the
/// engine closed, as for `shmb_client_step`.
///
/// Ownership: `env_ids` is read during the call only.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_send(
    client: *mut shmb_client,
    env_ids: *const u32,
    num_env_ids: usize,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes `num_env_ids` u32s at `env_ids`.
        let ids = unsafe { slice_arg(env_ids, num_env_ids, "env_ids")? };
        with(client, |h| Ok(h.named.side.send(ids)?))
    })
}

/// Calls the engine-defined method `method` with `num_args` key/value `args` and
/// `payload_len` bytes of `payload` (NULL when 0), waiting up to `timeout_ms`. The reply
/// is kept in the client: `shmb_client_reply_payload`, `shmb_client_reply_arg`.
/// `SHMB_REMOTE` when the engine answered with an error (its message is the last error).
///
/// Ownership: the arguments are copied; the reply is the client's, valid until its next
/// call or close.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_call(
    client: *mut shmb_client,
    method: *const c_char,
    args: *const crate::types::shmb_kv,
    num_args: usize,
    payload: *const u8,
    payload_len: usize,
    timeout_ms: u64,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let method = unsafe { str_arg(method, "method")? };
        // SAFETY: the caller passes `num_args` pairs of strings at `args`.
        let args = unsafe { kv_arg(args, num_args, "args")? };
        // SAFETY: the caller passes `payload_len` bytes at `payload`.
        let payload = unsafe { slice_arg(payload, payload_len, "payload")? };
        with(client, |h| {
            h.reply_args.clear();
            h.reply_payload.clear();
            let pairs: Vec<(&str, &str)> =
                args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let reply = h
                .named
                .side
                .call_method(method, &pairs, payload, timeout(timeout_ms))?;
            h.reply_args = reply
                .args
                .iter()
                .map(|(k, v)| (c_string(k), c_string(v)))
                .collect();
            h.reply_payload = reply.payload;
            Ok(())
        })
    })
}

/// The payload of the last reply (`len` 0 and `data` NULL when empty).
///
/// Ownership: owned by the client, valid until its next call or close.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_reply_payload(
    client: *mut shmb_client,
    data: *mut *const u8,
    len: *mut usize,
) -> shmb_status {
    guard(|| {
        need(data, "data")?;
        need(len, "len")?;
        let (p, n) = with(client, |h| {
            let p = if h.reply_payload.is_empty() {
                std::ptr::null()
            } else {
                h.reply_payload.as_ptr()
            };
            Ok((p, h.reply_payload.len()))
        })?;
        // SAFETY: both checked non-null; writable per the caller's contract.
        unsafe {
            put(data, p, "data")?;
            put(len, n, "len")
        }
    })
}

/// Number of key/values in the last reply.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_reply_arg_count(
    client: *mut shmb_client,
    count: *mut usize,
) -> shmb_status {
    guard(|| {
        need(count, "count")?;
        let n = with(client, |h| Ok(h.reply_args.len()))?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(count, n, "count") }
    })
}

/// Key/value `index` of the last reply.
///
/// Ownership: both strings are owned by the client, valid until its next call or close.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_reply_arg(
    client: *mut shmb_client,
    index: usize,
    key: *mut *const c_char,
    value: *mut *const c_char,
) -> shmb_status {
    guard(|| {
        need(key, "key")?;
        need(value, "value")?;
        let (k, v) = with(client, |h| {
            let n = h.reply_args.len();
            let (k, v) = h.reply_args.get(index).ok_or_else(|| {
                crate::status::Fail::invalid(format!("reply argument {index} of {n}"))
            })?;
            Ok((k.as_ptr(), v.as_ptr()))
        })?;
        // SAFETY: both checked non-null; writable per the caller's contract.
        unsafe {
            put(key, k, "key")?;
            put(value, v, "value")
        }
    })
}

/// Device address (in this process) of a tensor on CUDA, by name or index (`name`
/// NULL): the engine's memory, opened through CUDA IPC. `SHMB_CUDA_UNAVAILABLE` without
/// the `cuda` feature or a driver.
///
/// Ownership: valid until `shmb_client_close`.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_device_ptr(
    client: *mut shmb_client,
    name: *const c_char,
    index: usize,
    ptr: *mut u64,
) -> shmb_status {
    guard(|| {
        need(ptr, "ptr")?;
        // SAFETY: `name` is NULL or a NUL-terminated string per the caller's contract.
        let p = with(client, |h| unsafe {
            side::device_ptr(&mut h.named, name, index)
        })?;
        // SAFETY: checked non-null; writable per the caller's contract.
        unsafe { put(ptr, p, "ptr") }
    })
}

/// `shmb_client_step`, recording the client's event on CUDA stream `stream` (where the
/// device actions were written: a `CUstream`, or 1/2 for the legacy/per-thread default
/// streams) instead of the legacy default stream. Host-only engines ignore the stream.
///
/// Ownership: `stream` stays the caller's; it must live through the call.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_step_on(
    client: *mut shmb_client,
    stream: u64,
    timeout_ms: u64,
    frame: *mut u64,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller vouches that `stream` is 1, 2 or a live stream of the
        // engine's device for the duration of the call.
        let s = unsafe { StreamRef::from_raw(stream) };
        let f = with(client, |h| {
            Ok(h.named.side.step_on(s, timeout(timeout_ms))?)
        })?;
        // SAFETY: NULL or writable per the caller's contract.
        unsafe { maybe(frame, f) };
        Ok(())
    })
}

/// Makes CUDA stream `stream` wait, on the GPU (no host sync), for the engine's last
/// published frame: work queued on it afterwards reads the new device tensors. Nothing
/// for host-only engines.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_wait_frame_on(
    client: *mut shmb_client,
    stream: u64,
) -> shmb_status {
    guard(|| {
        // SAFETY: as in `shmb_client_step_on`.
        let s = unsafe { StreamRef::from_raw(stream) };
        with(client, |h| {
            Ok(h.named.side.backend().order_after_frame(s)?)
        })
    })
}

/// The CUDA stream whose queued work later commands (resets, methods) must follow: the
/// client's event is recorded on it before each request (default: 1, the legacy default
/// stream). The stream must outlive its use: set it back to 1 before destroying it.
#[no_mangle]
pub unsafe extern "C" fn shmb_client_set_command_stream(
    client: *mut shmb_client,
    stream: u64,
) -> shmb_status {
    guard(|| {
        with(client, |h| {
            // SAFETY: the caller's contract above: 1, 2 or a live stream while set.
            unsafe { h.named.side.set_command_stream(stream) };
            Ok(())
        })
    })
}

/// Closes the client: a waiting engine gets `SHMB_CLIENT_CLOSED` (a launched engine then
/// exits). Every tensor pointer and reply of this client is invalid afterwards, and so
/// is the handle (a later call: `SHMB_CLOSED`).
#[no_mangle]
pub extern "C" fn shmb_client_close(client: *mut shmb_client) -> shmb_status {
    guard(|| {
        let h = CLIENTS.remove(client as usize)?;
        h.named.side.close();
        Ok(())
    })
}
