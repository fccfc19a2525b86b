//! The CUDA backend: device memory exported by the engine through CUDA IPC and imported by
//! the client, with one interprocess event per direction (protocol 1.2).
//!
//! This module is compiled in every build. Without the `cuda` feature every CUDA request
//! is answered with [`Error::CudaUnavailable`] ("built without the `cuda` feature"); with
//! it, [`crate::device::probe`] loads the driver dynamically (cudarc's `dynamic-loading`) and checks it
//! before any other driver call is made. cudarc panics on the first `sys::cu*` call when
//! `libcuda.so` (or one of its symbols) is missing, so nothing outside [`driver`] calls
//! cudarc, and [`driver`] calls nothing before a probe succeeded: its entry points take
//! a [`driver::Driver`] token that only a successful probe hands out.
//!
//! All CUDA FFI and its `unsafe` live in [`driver`].

use crate::error::Error;

#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod ipc;
#[cfg(feature = "cuda")]
pub mod kernel;

/// The ordinal (as this process numbers devices) of the engine's device: the one whose
/// UUID is `uuid` among `visible` (UUIDs by ordinal), else, when `uuid` is all zero
/// (unknown) or not visible, `ordinal` if this process has such a device. `None`: no
/// usable device.
pub fn pick_device(uuid: [u8; 16], ordinal: i32, visible: &[[u8; 16]]) -> Option<i32> {
    if uuid != [0; 16] {
        if let Some(i) = visible.iter().position(|u| *u == uuid) {
            return i32::try_from(i).ok();
        }
    }
    usize::try_from(ordinal)
        .ok()
        .filter(|&o| o < visible.len())
        .map(|_| ordinal)
}

/// The blocks `driver::Module::launch` makes for `threads` threads of `block` (≥ 1):
/// `ceil(threads / block)`, at least one. For one-thread-per-env kernels (`threads =
/// num_envs`, a u32) and `BLOCK` it is at most 2^24, within the 2^31 - 1 limit.
pub fn blocks(threads: u32, block: u32) -> u32 {
    threads.div_ceil(block.max(1)).max(1)
}

/// A kernel argument, passed by value (`kernel::Module::launch`, and the backend-neutral
/// `crate::device::compute::CudaKernels::launch`).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    U64(u64),
    I64(i64),
    U32(u32),
    F32(f32),
    F64(f64),
}

/// What a successful probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for 12.8.
    pub driver_version: i32,
    pub device_count: i32,
}

/// The error every CUDA path gives in a build without the `cuda` feature.
pub fn unavailable_without_feature() -> Error {
    Error::CudaUnavailable {
        reason: "this shmbridge was built without the `cuda` feature (rebuild with \
                 `--features cuda`; the Python wheel has it)"
            .into(),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn devices_are_matched_by_uuid_then_ordinal() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        assert_eq!(
            pick_device(b, 0, &[a, b]),
            Some(1),
            "uuid wins over ordinal"
        );
        assert_eq!(pick_device([0; 16], 1, &[a, b]), Some(1), "unknown uuid");
        assert_eq!(
            pick_device([9; 16], 0, &[a, b]),
            Some(0),
            "uuid not visible"
        );
        assert_eq!(pick_device([9; 16], 2, &[a, b]), None);
        assert_eq!(pick_device([0; 16], -1, &[a]), None);
        assert_eq!(pick_device(a, 0, &[]), None);
    }
}
