//! Status codes, the thread-local last-error message, and the guard every exported
//! function runs its body in (errors become codes, panics are caught).

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use shmbridge_core::error::{Error, ErrorKind};

/// What a call did. `SHMB_OK` (0) is success; the codes from 1 to 999 mirror the core's
/// error kinds one to one; 1000 and up are errors of the C boundary itself. Every failed
/// call also sets the thread-local message `shmb_last_error_message()` returns. Values are
/// stable: new kinds get new numbers, none is reused.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_status {
    SHMB_OK = 0,
    SHMB_NOT_FOUND = 1,
    SHMB_NAME_IN_USE = 2,
    SHMB_PERMISSION_DENIED = 3,
    SHMB_INVALID_NAME = 4,
    SHMB_NOT_A_REGION_FILE = 5,
    SHMB_BAD_MAGIC = 6,
    SHMB_VERSION_MISMATCH = 7,
    SHMB_LAYOUT_MISMATCH = 8,
    SHMB_REGION_TOO_SMALL = 9,
    SHMB_INVALID_HEADER = 10,
    SHMB_TENSOR_OUT_OF_BOUNDS = 11,
    SHMB_INVALID_TENSOR = 12,
    SHMB_INVALID_SPEC = 13,
    SHMB_NO_SUCH_TENSOR = 14,
    SHMB_DTYPE_MISMATCH = 15,
    SHMB_WRONG_DIRECTION = 16,
    SHMB_ALREADY_BORROWED = 17,
    SHMB_ALREADY_ATTACHED = 18,
    /// The engine process died (a client's call).
    SHMB_ENGINE_DIED = 19,
    /// The client process died (an engine's call).
    SHMB_CLIENT_DIED = 20,
    /// The engine closed the region (a client's call).
    SHMB_ENGINE_CLOSED = 21,
    /// The client closed (an engine's call): the usual end of an engine's serve loop.
    SHMB_CLIENT_CLOSED = 22,
    SHMB_TIMEOUT = 23,
    SHMB_PROTOCOL = 24,
    SHMB_RECORD_TOO_LARGE = 25,
    SHMB_BAD_MESSAGE = 26,
    SHMB_NO_COMMAND_CHANNEL = 27,
    /// The engine answered a command with an error; the message is the engine's.
    SHMB_REMOTE = 28,
    SHMB_OUT_OF_ORDER = 29,
    SHMB_INTERRUPTED = 30,
    /// This engine or client is closed.
    SHMB_CLOSED = 31,
    SHMB_CUDA_UNAVAILABLE = 32,
    SHMB_CUDA = 33,
    SHMB_VULKAN_UNAVAILABLE = 34,
    SHMB_VULKAN = 35,
    SHMB_NOT_ON_HOST = 36,
    SHMB_IO = 37,
    /// The region does not fit the free space of /dev/shm (the message names both sizes and
    /// Docker's `--shm-size`); nothing was left behind.
    SHMB_NO_SPACE = 38,
    /// The command request ring stayed full for the whole call timeout: the engine is not
    /// reading commands. The session can go on stepping.
    SHMB_COMMAND_BACKLOG = 39,
    /// A step ran out of time before its action was sent (the CUDA stream it waits on
    /// did not drain: a consumer stream of a Vulkan engine's tensors, or of CUDA memory
    /// shared by file descriptor): nothing is in flight, the frame is
    /// unchanged; step again (not `shmb_client_wait_frame`). `SHMB_TIMEOUT` is the other
    /// case: the action was sent and its frame is still to come.
    SHMB_NOT_POSTED = 40,
    /// A device-side call on views that have none (the engine's backend asked of a
    /// client's views): the wrong views for the call, whatever the device.
    SHMB_NO_DEVICE_SIDE = 41,
    /// A stream's lane stayed full for the whole deadline of a reserve: nothing was
    /// written; reserve again later.
    SHMB_FULL = 42,
    /// A null pointer where one is required, a size or count that does not fit, a string
    /// that is not UTF-8, an unknown enum value.
    SHMB_INVALID_ARGUMENT = 1000,
    /// A handle this library never handed out (or of another kind).
    SHMB_INVALID_HANDLE = 1001,
    /// Another thread is inside a call on the same handle (calls on one handle do not
    /// overlap; see docs/c-api.md, threading).
    SHMB_BUSY = 1002,
    /// A caller's buffer is too small; the size needed is returned.
    SHMB_BUFFER_TOO_SMALL = 1003,
    /// A bug in shmbridge: a panic was caught at the boundary. The handle it happened on
    /// may be unusable; close it.
    SHMB_PANIC = 1004,
}

/// The status of each error kind. Exhaustive on purpose: a kind added to the core is a
/// compile error here until it has its own code.
pub(crate) fn status_of(kind: ErrorKind) -> shmb_status {
    use shmb_status::*;
    match kind {
        ErrorKind::NotFound => SHMB_NOT_FOUND,
        ErrorKind::NameInUse => SHMB_NAME_IN_USE,
        ErrorKind::PermissionDenied => SHMB_PERMISSION_DENIED,
        ErrorKind::InvalidName => SHMB_INVALID_NAME,
        ErrorKind::NotARegionFile => SHMB_NOT_A_REGION_FILE,
        ErrorKind::BadMagic => SHMB_BAD_MAGIC,
        ErrorKind::VersionMismatch => SHMB_VERSION_MISMATCH,
        ErrorKind::LayoutMismatch => SHMB_LAYOUT_MISMATCH,
        ErrorKind::RegionTooSmall => SHMB_REGION_TOO_SMALL,
        ErrorKind::InvalidHeader => SHMB_INVALID_HEADER,
        ErrorKind::TensorOutOfBounds => SHMB_TENSOR_OUT_OF_BOUNDS,
        ErrorKind::InvalidTensor => SHMB_INVALID_TENSOR,
        ErrorKind::InvalidSpec => SHMB_INVALID_SPEC,
        ErrorKind::NoSuchTensor => SHMB_NO_SUCH_TENSOR,
        ErrorKind::DTypeMismatch => SHMB_DTYPE_MISMATCH,
        ErrorKind::WrongDirection => SHMB_WRONG_DIRECTION,
        ErrorKind::AlreadyBorrowed => SHMB_ALREADY_BORROWED,
        ErrorKind::AlreadyAttached => SHMB_ALREADY_ATTACHED,
        ErrorKind::EngineDied => SHMB_ENGINE_DIED,
        ErrorKind::ClientDied => SHMB_CLIENT_DIED,
        ErrorKind::EngineClosed => SHMB_ENGINE_CLOSED,
        ErrorKind::ClientClosed => SHMB_CLIENT_CLOSED,
        ErrorKind::Timeout => SHMB_TIMEOUT,
        ErrorKind::Protocol => SHMB_PROTOCOL,
        ErrorKind::RecordTooLarge => SHMB_RECORD_TOO_LARGE,
        ErrorKind::BadMessage => SHMB_BAD_MESSAGE,
        ErrorKind::NoCommandChannel => SHMB_NO_COMMAND_CHANNEL,
        ErrorKind::Remote => SHMB_REMOTE,
        ErrorKind::OutOfOrder => SHMB_OUT_OF_ORDER,
        ErrorKind::Interrupted => SHMB_INTERRUPTED,
        ErrorKind::Closed => SHMB_CLOSED,
        ErrorKind::CudaUnavailable => SHMB_CUDA_UNAVAILABLE,
        ErrorKind::Cuda => SHMB_CUDA,
        ErrorKind::VulkanUnavailable => SHMB_VULKAN_UNAVAILABLE,
        ErrorKind::Vulkan => SHMB_VULKAN,
        ErrorKind::NotOnHost => SHMB_NOT_ON_HOST,
        ErrorKind::Io => SHMB_IO,
        ErrorKind::NoSpace => SHMB_NO_SPACE,
        ErrorKind::CommandBacklog => SHMB_COMMAND_BACKLOG,
        ErrorKind::NotPosted => SHMB_NOT_POSTED,
        ErrorKind::NoDeviceSide => SHMB_NO_DEVICE_SIDE,
        ErrorKind::Full => SHMB_FULL,
    }
}

/// Every status, for `shmb_status_name` and the tests.
pub(crate) const ALL: [shmb_status; 48] = {
    use shmb_status::*;
    [
        SHMB_OK,
        SHMB_NOT_FOUND,
        SHMB_NAME_IN_USE,
        SHMB_PERMISSION_DENIED,
        SHMB_INVALID_NAME,
        SHMB_NOT_A_REGION_FILE,
        SHMB_BAD_MAGIC,
        SHMB_VERSION_MISMATCH,
        SHMB_LAYOUT_MISMATCH,
        SHMB_REGION_TOO_SMALL,
        SHMB_INVALID_HEADER,
        SHMB_TENSOR_OUT_OF_BOUNDS,
        SHMB_INVALID_TENSOR,
        SHMB_INVALID_SPEC,
        SHMB_NO_SUCH_TENSOR,
        SHMB_DTYPE_MISMATCH,
        SHMB_WRONG_DIRECTION,
        SHMB_ALREADY_BORROWED,
        SHMB_ALREADY_ATTACHED,
        SHMB_ENGINE_DIED,
        SHMB_CLIENT_DIED,
        SHMB_ENGINE_CLOSED,
        SHMB_CLIENT_CLOSED,
        SHMB_TIMEOUT,
        SHMB_PROTOCOL,
        SHMB_RECORD_TOO_LARGE,
        SHMB_BAD_MESSAGE,
        SHMB_NO_COMMAND_CHANNEL,
        SHMB_REMOTE,
        SHMB_OUT_OF_ORDER,
        SHMB_INTERRUPTED,
        SHMB_CLOSED,
        SHMB_CUDA_UNAVAILABLE,
        SHMB_CUDA,
        SHMB_VULKAN_UNAVAILABLE,
        SHMB_VULKAN,
        SHMB_NOT_ON_HOST,
        SHMB_IO,
        SHMB_NO_SPACE,
        SHMB_COMMAND_BACKLOG,
        SHMB_NOT_POSTED,
        SHMB_NO_DEVICE_SIDE,
        SHMB_FULL,
        SHMB_INVALID_ARGUMENT,
        SHMB_INVALID_HANDLE,
        SHMB_BUSY,
        SHMB_BUFFER_TOO_SMALL,
        SHMB_PANIC,
    ]
};

impl shmb_status {
    /// The constant's name without the `SHMB_` prefix (`"CLIENT_CLOSED"`).
    pub(crate) fn name(self) -> &'static std::ffi::CStr {
        use shmb_status::*;
        match self {
            SHMB_OK => c"OK",
            SHMB_NOT_FOUND => c"NOT_FOUND",
            SHMB_NAME_IN_USE => c"NAME_IN_USE",
            SHMB_PERMISSION_DENIED => c"PERMISSION_DENIED",
            SHMB_INVALID_NAME => c"INVALID_NAME",
            SHMB_NOT_A_REGION_FILE => c"NOT_A_REGION_FILE",
            SHMB_BAD_MAGIC => c"BAD_MAGIC",
            SHMB_VERSION_MISMATCH => c"VERSION_MISMATCH",
            SHMB_LAYOUT_MISMATCH => c"LAYOUT_MISMATCH",
            SHMB_REGION_TOO_SMALL => c"REGION_TOO_SMALL",
            SHMB_INVALID_HEADER => c"INVALID_HEADER",
            SHMB_TENSOR_OUT_OF_BOUNDS => c"TENSOR_OUT_OF_BOUNDS",
            SHMB_INVALID_TENSOR => c"INVALID_TENSOR",
            SHMB_INVALID_SPEC => c"INVALID_SPEC",
            SHMB_NO_SUCH_TENSOR => c"NO_SUCH_TENSOR",
            SHMB_DTYPE_MISMATCH => c"DTYPE_MISMATCH",
            SHMB_WRONG_DIRECTION => c"WRONG_DIRECTION",
            SHMB_ALREADY_BORROWED => c"ALREADY_BORROWED",
            SHMB_ALREADY_ATTACHED => c"ALREADY_ATTACHED",
            SHMB_ENGINE_DIED => c"ENGINE_DIED",
            SHMB_CLIENT_DIED => c"CLIENT_DIED",
            SHMB_ENGINE_CLOSED => c"ENGINE_CLOSED",
            SHMB_CLIENT_CLOSED => c"CLIENT_CLOSED",
            SHMB_TIMEOUT => c"TIMEOUT",
            SHMB_PROTOCOL => c"PROTOCOL",
            SHMB_RECORD_TOO_LARGE => c"RECORD_TOO_LARGE",
            SHMB_BAD_MESSAGE => c"BAD_MESSAGE",
            SHMB_NO_COMMAND_CHANNEL => c"NO_COMMAND_CHANNEL",
            SHMB_REMOTE => c"REMOTE",
            SHMB_OUT_OF_ORDER => c"OUT_OF_ORDER",
            SHMB_INTERRUPTED => c"INTERRUPTED",
            SHMB_CLOSED => c"CLOSED",
            SHMB_CUDA_UNAVAILABLE => c"CUDA_UNAVAILABLE",
            SHMB_CUDA => c"CUDA",
            SHMB_VULKAN_UNAVAILABLE => c"VULKAN_UNAVAILABLE",
            SHMB_VULKAN => c"VULKAN",
            SHMB_NOT_ON_HOST => c"NOT_ON_HOST",
            SHMB_IO => c"IO",
            SHMB_NO_SPACE => c"NO_SPACE",
            SHMB_COMMAND_BACKLOG => c"COMMAND_BACKLOG",
            SHMB_NOT_POSTED => c"NOT_POSTED",
            SHMB_NO_DEVICE_SIDE => c"NO_DEVICE_SIDE",
            SHMB_FULL => c"FULL",
            SHMB_INVALID_ARGUMENT => c"INVALID_ARGUMENT",
            SHMB_INVALID_HANDLE => c"INVALID_HANDLE",
            SHMB_BUSY => c"BUSY",
            SHMB_BUFFER_TOO_SMALL => c"BUFFER_TOO_SMALL",
            SHMB_PANIC => c"PANIC",
        }
    }
}

/// A failed call: its status and the message for `shmb_last_error_message`.
#[derive(Debug)]
pub(crate) struct Fail {
    pub status: shmb_status,
    pub message: String,
}

impl Fail {
    pub(crate) fn new(status: shmb_status, message: impl Into<String>) -> Self {
        Fail {
            status,
            message: message.into(),
        }
    }
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Fail::new(shmb_status::SHMB_INVALID_ARGUMENT, message)
    }
    pub(crate) fn null(what: &str) -> Self {
        Fail::invalid(format!("`{what}` is NULL"))
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::new(status_of(e.kind()), e.to_string())
    }
}

pub(crate) type CResult<T = ()> = Result<T, Fail>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A message with a NUL byte (from the peer) is cut there rather than dropped.
    let bytes = message.as_bytes();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let text = CString::new(&bytes[..end]).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// The thread's last error message (empty before any failed call).
pub(crate) fn last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Runs an exported function's body: `Ok` is `SHMB_OK`; an error sets the thread's
/// message and returns its code; a panic is caught here (it must never unwind into C),
/// reported as `SHMB_PANIC`.
#[inline]
pub(crate) fn guard(body: impl FnOnce() -> CResult) -> shmb_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => shmb_status::SHMB_OK,
        Ok(Err(fail)) => {
            set_last_error(&fail.message);
            fail.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last_error(&format!(
                "internal error in shmbridge (a bug: please report it): {what}"
            ));
            shmb_status::SHMB_PANIC
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_code_and_codes_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for kind in ErrorKind::ALL {
            let s = status_of(kind);
            assert_ne!(s, shmb_status::SHMB_OK, "{kind:?}");
            assert!((s as i32) < 1000, "{kind:?} maps into the boundary's range");
            assert!(seen.insert(s as i32), "{kind:?} shares code {}", s as i32);
        }
        let all: std::collections::HashSet<i32> = ALL.iter().map(|s| *s as i32).collect();
        assert_eq!(all.len(), ALL.len(), "ALL lists a code twice");
        assert!(seen.is_subset(&all), "ALL misses a kind's code");
    }

    #[test]
    fn names_are_the_constants_without_the_prefix() {
        for s in ALL {
            let debug = format!("{s:?}");
            assert_eq!(
                debug.strip_prefix("SHMB_").unwrap(),
                s.name().to_str().unwrap()
            );
        }
    }

    #[test]
    fn a_panic_becomes_a_code_and_a_message() {
        let status = guard(|| panic!("boom"));
        assert_eq!(status, shmb_status::SHMB_PANIC);
        // SAFETY: `last_error` points at this thread's NUL-terminated message.
        let text = unsafe { std::ffi::CStr::from_ptr(last_error()) };
        assert!(text.to_str().unwrap().contains("boom"), "{text:?}");
    }

    #[test]
    fn an_error_keeps_its_kind_and_words() {
        let status = guard(|| {
            Err(Error::Timeout {
                waited: std::time::Duration::from_millis(5),
                what: "a test",
            }
            .into())
        });
        assert_eq!(status, shmb_status::SHMB_TIMEOUT);
        // SAFETY: as above.
        let text = unsafe { std::ffi::CStr::from_ptr(last_error()) };
        assert_eq!(
            text.to_str().unwrap(),
            "timed out after 5ms waiting for a test"
        );
    }

    #[test]
    fn nothing_posted_is_not_in_flight() {
        // A step that sent nothing must be told from one whose frame is still to come:
        // the caller steps again after the one, calls `shmb_client_wait_frame` after the
        // other.
        let waited = std::time::Duration::from_millis(5);
        let what = "a test stream";
        let not_posted = guard(|| Err(Error::NotPosted { waited, what }.into()));
        let in_flight = guard(|| Err(Error::Timeout { waited, what }.into()));
        assert_eq!(not_posted, shmb_status::SHMB_NOT_POSTED);
        assert_eq!(in_flight, shmb_status::SHMB_TIMEOUT);
        assert_ne!(not_posted, in_flight);
    }
}
