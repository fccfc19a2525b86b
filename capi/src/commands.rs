//! Commands an engine answers through C callbacks: `Reset` and engine-defined methods.
//! The dispatch, the built-ins and the reset plan are the core's; this file only turns
//! a request into C arguments and the callback's reply back into the core's types.

use std::ffi::{c_char, c_void, CString};

use shmbridge_core::command::{CommandError, CommandHandler, Reply, ResetRequest};
use shmbridge_core::tensor::Tensors;
use shmbridge_core::wire::code;

use crate::status::{guard, shmb_status, CResult, Fail};
use crate::types::{c_string, kv_arg, shmb_kv, slice_arg, str_arg};

/// Error codes a handler answers with (`shmb_reply_set_error`); the client sees them in
/// its `SHMB_REMOTE` error.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_reply_code {
    SHMB_REPLY_UNKNOWN_METHOD = 1,
    SHMB_REPLY_BAD_REQUEST = 2,
    SHMB_REPLY_ENGINE_ERROR = 3,
    SHMB_REPLY_UNSUPPORTED = 4,
}

/// Resets environments. `env_ids`: the `num_env_ids` envs to reset, in order (every env
/// when the client listed none; duplicates kept), all already checked `< num_envs`.
/// `seeds`: NULL (keep each env's random stream), or one seed per listed env, already
/// expanded as the protocol says (one seed `s` from the client: env k of the list gets
/// `s + k`). Write the reset observations into the engine→client tensors before
/// returning. Return 0 on success; otherwise call `shmb_reply_set_error` (else the client
/// sees a generic engine error) and return non-zero.
///
/// Ownership: every pointer is borrowed for the call only; `reply` too.
#[allow(non_camel_case_types)]
pub type shmb_reset_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        env_ids: *const u32,
        num_env_ids: usize,
        seeds: *const u64,
        reply: *mut shmb_reply,
    ) -> i32,
>;

/// Answers an engine-defined method: `method` with `num_args` key/value `args` and a
/// `payload` of `payload_len` bytes (NULL when empty). Fill the reply with
/// `shmb_reply_add_arg` and `shmb_reply_set_payload` and return 0, or
/// `shmb_reply_set_error` and return non-zero. An unknown method:
/// `SHMB_REPLY_UNKNOWN_METHOD`.
///
/// Ownership: every pointer is borrowed for the call only; `reply` too.
#[allow(non_camel_case_types)]
pub type shmb_call_fn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        method: *const c_char,
        args: *const shmb_kv,
        num_args: usize,
        payload: *const u8,
        payload_len: usize,
        reply: *mut shmb_reply,
    ) -> i32,
>;

/// An engine's command callbacks, passed to `shmb_engine_wait_actions` and
/// `shmb_engine_poll_commands`. A NULL callback refuses its commands
/// (`SHMB_REPLY_UNSUPPORTED` / `SHMB_REPLY_UNKNOWN_METHOD`). They run on the thread that
/// waits, between steps, with the engine's handle in use: they must not call
/// `shmb_engine_*` functions on that engine (`SHMB_BUSY`); use the tensor pointers taken
/// before. They must return (no longjmp, no C++ exception through them).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct shmb_handlers {
    /// Passed to every callback.
    pub user: *mut c_void,
    pub reset: shmb_reset_fn,
    pub call: shmb_call_fn,
}

/// A reply being filled by a callback (opaque; valid during the callback only).
#[allow(non_camel_case_types)]
pub struct shmb_reply {
    reply: Reply,
    error: Option<CommandError>,
}

/// Adds a key/value to the reply of an engine-defined method. Copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_reply_add_arg(
    reply: *mut shmb_reply,
    key: *const c_char,
    value: *const c_char,
) -> shmb_status {
    guard(|| {
        let kv = shmb_kv { key, value };
        // SAFETY: one pair of caller strings.
        let pairs = unsafe { kv_arg(&kv, 1, "arg")? };
        // SAFETY: `reply` is NULL or the live reply of the running callback.
        let r = unsafe { reply_mut(reply)? };
        r.reply.args.extend(pairs);
        Ok(())
    })
}

/// Sets the reply's payload: `len` bytes at `data` (NULL when `len` is 0). Copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_reply_set_payload(
    reply: *mut shmb_reply,
    data: *const u8,
    len: usize,
) -> shmb_status {
    guard(|| {
        // SAFETY: the caller passes `len` bytes at `data`.
        let bytes = unsafe { slice_arg(data, len, "data")? };
        // SAFETY: `reply` is NULL or the live reply of the running callback.
        let r = unsafe { reply_mut(reply)? };
        r.reply.payload = bytes.to_vec();
        Ok(())
    })
}

/// Makes the reply an error: `code` (a `shmb_reply_code`) and a message saying what went
/// wrong and what to do (copied). The callback then returns non-zero.
#[no_mangle]
pub unsafe extern "C" fn shmb_reply_set_error(
    reply: *mut shmb_reply,
    code: u32,
    message: *const c_char,
) -> shmb_status {
    guard(|| {
        let code = u16::try_from(code)
            .ok()
            .filter(|c| (1..=4).contains(c))
            .ok_or_else(|| {
                Fail::invalid(format!(
                    "reply code {code} is not a shmb_reply_code (1..=4)"
                ))
            })?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let message = unsafe { str_arg(message, "message")? }.to_string();
        // SAFETY: `reply` is NULL or the live reply of the running callback.
        let r = unsafe { reply_mut(reply)? };
        r.error = Some(CommandError { code, message });
        Ok(())
    })
}

/// # Safety
/// `reply` is NULL or the reply a running callback was given.
unsafe fn reply_mut<'a>(reply: *mut shmb_reply) -> CResult<&'a mut shmb_reply> {
    // SAFETY: per the contract, non-null means a live `shmb_reply` owned by the caller's
    // caller (the adapter below), borrowed mutably only through this call.
    unsafe { reply.as_mut() }.ok_or_else(|| Fail::null("reply"))
}

/// The core's `CommandHandler`, answered by C callbacks.
pub(crate) struct CHandlers<'t> {
    table: &'t shmb_handlers,
    num_envs: u32,
}

impl<'t> CHandlers<'t> {
    pub(crate) fn new(table: &'t shmb_handlers, num_envs: u32) -> Self {
        CHandlers { table, num_envs }
    }
}

/// What a callback's return value and reply mean.
fn outcome(rc: i32, reply: shmb_reply, what: &str) -> Result<Reply, CommandError> {
    match (rc, reply.error) {
        (0, None) => Ok(reply.reply),
        (_, Some(e)) => Err(e),
        (rc, None) => Err(CommandError {
            code: code::ENGINE_ERROR,
            message: format!("the engine's {what} callback failed (returned {rc})"),
        }),
    }
}

impl CommandHandler for CHandlers<'_> {
    fn reset(&mut self, _io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        let Some(reset) = self.table.reset else {
            return Err(CommandError::unsupported(
                "this engine does not handle Reset",
            ));
        };
        let (ids, seeds) = req.plan(self.num_envs)?;
        let mut reply = shmb_reply {
            reply: Reply::default(),
            error: None,
        };
        // SAFETY: the callback's contract: it reads `ids.len()` ids and as many seeds (or
        // none when NULL), and the reply only during the call; all outlive the call.
        let rc = unsafe {
            reset(
                self.table.user,
                ids.as_ptr(),
                ids.len(),
                seeds.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                &mut reply,
            )
        };
        outcome(rc, reply, "reset").map(drop)
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        let Some(call) = self.table.call else {
            return Err(CommandError::unknown_method(method, &[]));
        };
        let strings = |s: &str| -> Result<CString, CommandError> {
            CString::new(s).map_err(|_| {
                CommandError::bad_request(format!(
                    "'{}' holds a NUL byte",
                    c_string(s).to_string_lossy()
                ))
            })
        };
        let method_c = strings(method)?;
        let owned: Vec<(CString, CString)> = args
            .iter()
            .map(|(k, v)| Ok((strings(k)?, strings(v)?)))
            .collect::<Result<_, CommandError>>()?;
        let kvs: Vec<shmb_kv> = owned
            .iter()
            .map(|(k, v)| shmb_kv {
                key: k.as_ptr(),
                value: v.as_ptr(),
            })
            .collect();
        let mut reply = shmb_reply {
            reply: Reply::default(),
            error: None,
        };
        // SAFETY: the callback's contract: every pointer is valid for the call (the
        // strings and arrays above outlive it), the payload NULL when empty.
        let rc = unsafe {
            call(
                self.table.user,
                method_c.as_ptr(),
                kvs.as_ptr(),
                kvs.len(),
                if payload.is_empty() {
                    std::ptr::null()
                } else {
                    payload.as_ptr()
                },
                payload.len(),
                &mut reply,
            )
        };
        outcome(rc, reply, method)
    }
}
