//! The C ABI of shmbridge: `libshmbridge.so` and `libshmbridge.a`, declared by
//! `include/shmbridge.h` (generated from this crate by cbindgen: `cargo run -p
//! shmbridge-header`). A thin layer: every call goes to the same core functions the Rust
//! and Python faces use (`shmbridge::Engine`, `Client`, the command dispatch, the
//! trajectory streams' `stream::Consumer` and `Producer`); nothing of the protocol lives
//! here.
//!
//! Conventions of every exported function: it returns a `shmb_status` (`SHMB_OK` = 0)
//! and results through out-pointers, written only on success; a failure sets the
//! thread's `shmb_last_error_message()`; NULL, unknown or closed handles, NULL pointers
//! and bad sizes are errors, never crashes; a panic is caught at the boundary
//! (`SHMB_PANIC`). Handles are numbers, not pointers (`registry`). Ownership and
//! threading are written on each function and in `docs/c-api.md`.

// Every exported function takes C pointers under one contract, stated once in the
// header and docs/c-api.md (each pointer NULL or valid for the call), not per function.
#![allow(clippy::missing_safety_doc)]

mod client;
mod commands;
mod engine;
mod registry;
mod side;
mod spec;
mod status;
mod stream;
mod types;
mod vulkan;

use std::ffi::c_char;

pub use client::*;
pub use commands::*;
pub use engine::*;
pub use spec::*;
pub use status::shmb_status;
pub use stream::*;
pub use types::*;
pub use vulkan::*;

/// Version of this C ABI: bumped when a function's signature or meaning, a struct, or an
/// enum value changes incompatibly. Compare `SHMB_ABI_VERSION` (what the caller was
/// compiled against) with `shmb_abi_version()` (the library loaded at run time).
pub const SHMB_ABI_VERSION: u32 = 1;
/// Version of the shmbridge release the header comes from.
pub const SHMB_VERSION_MAJOR: u32 = 0;
pub const SHMB_VERSION_MINOR: u32 = 1;
pub const SHMB_VERSION_PATCH: u32 = 0;

/// The ABI version of the library loaded at run time (`SHMB_ABI_VERSION` of its
/// header). A caller compiled against another ABI version must not use it.
#[no_mangle]
pub extern "C" fn shmb_abi_version() -> u32 {
    SHMB_ABI_VERSION
}

/// The library's release and the wire protocol it speaks, `"<release> (protocol
/// <major>.<minor>)"`, e.g. `"0.1.0 (protocol 1.11)"`: built from the crate version and
/// the core's `VERSION_MAJOR`/`VERSION_MINOR`. Static storage: never freed.
#[no_mangle]
pub extern "C" fn shmb_version() -> *const c_char {
    static TEXT: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        types::c_string(&format!(
            "{} (protocol {}.{})",
            env!("CARGO_PKG_VERSION"),
            shmbridge_core::layout::VERSION_MAJOR,
            shmbridge_core::layout::VERSION_MINOR
        ))
    })
    .as_ptr()
}

/// The message of the last call that failed on this thread: what went wrong and what to
/// do, UTF-8, NUL-terminated; empty before any failure. Owned by the library, valid
/// until the next failing call on this thread; copy it to keep it.
#[no_mangle]
pub extern "C" fn shmb_last_error_message() -> *const c_char {
    status::last_error()
}

/// The name of a status without its `SHMB_` prefix (`"CLIENT_CLOSED"`); `"UNKNOWN"` for
/// a value that is none. Static storage: never freed.
#[no_mangle]
pub extern "C" fn shmb_status_name(status: i32) -> *const c_char {
    status::ALL
        .iter()
        .find(|s| **s as i32 == status)
        .map_or(c"UNKNOWN".as_ptr(), |s| s.name().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_macros_are_the_crate_version() {
        let version = |s: &str| s.parse::<u32>().unwrap();
        assert_eq!(SHMB_VERSION_MAJOR, version(env!("CARGO_PKG_VERSION_MAJOR")));
        assert_eq!(SHMB_VERSION_MINOR, version(env!("CARGO_PKG_VERSION_MINOR")));
        assert_eq!(SHMB_VERSION_PATCH, version(env!("CARGO_PKG_VERSION_PATCH")));
        assert_eq!(shmb_abi_version(), SHMB_ABI_VERSION);
        // SAFETY: static NUL-terminated strings.
        let text = unsafe { std::ffi::CStr::from_ptr(shmb_version()) }
            .to_str()
            .unwrap();
        let protocol = format!(
            "(protocol {}.{})",
            shmbridge_core::layout::VERSION_MAJOR,
            shmbridge_core::layout::VERSION_MINOR
        );
        assert_eq!(text, format!("{} {protocol}", env!("CARGO_PKG_VERSION")));
        // The header's comment of shmb_version gives the same example: every
        // "(protocol M.N)" in it is the protocol the library speaks.
        let header = include_str!("../../include/shmbridge.h");
        let doc = &header[..header.find("shmb_version(void)").expect("declared")];
        let doc = &doc[doc.rfind("/**").expect("documented")..];
        let examples: Vec<&str> = doc
            .match_indices("(protocol ")
            .map(|(at, _)| &doc[at..=at + doc[at..].find(')').expect("closed")])
            .collect();
        assert_eq!(examples, [protocol.as_str()], "{doc}");
        // SAFETY: as above.
        let unknown = unsafe { std::ffi::CStr::from_ptr(shmb_status_name(-7)) };
        assert_eq!(unknown.to_str().unwrap(), "UNKNOWN");
    }
}
