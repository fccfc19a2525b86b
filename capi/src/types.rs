//! The plain data types of the ABI and the checks of what C passes in.

use std::ffi::{c_char, CStr, CString};
use std::time::Duration;

use shmbridge_core::device::Device;
use shmbridge_core::layout::{DType, Direction, TensorInfo};
use shmbridge_core::WaitPolicy;

use crate::status::{CResult, Fail};

/// Element types (DLPack's, one lane).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_dtype {
    SHMB_F16 = 0,
    SHMB_BF16 = 1,
    SHMB_F32 = 2,
    SHMB_F64 = 3,
    SHMB_I8 = 4,
    SHMB_I16 = 5,
    SHMB_I32 = 6,
    SHMB_I64 = 7,
    SHMB_U8 = 8,
    SHMB_U16 = 9,
    SHMB_U32 = 10,
    SHMB_U64 = 11,
    /// One byte per element, 0 or 1.
    SHMB_BOOL = 12,
}

/// Who writes a tensor.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_direction {
    /// Observations, rewards, dones, images: the engine writes, the client reads.
    SHMB_ENGINE_TO_CLIENT = 0,
    /// Actions, reset masks: the client writes, the engine reads.
    SHMB_CLIENT_TO_ENGINE = 1,
}

/// Where a tensor's bytes live.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum shmb_location {
    /// In the shared-memory region: a host pointer on both sides.
    SHMB_LOCATION_HOST = 0,
    /// In CUDA device memory the engine exports (the `cuda` build feature): a device
    /// pointer on both sides.
    SHMB_LOCATION_CUDA = 1,
    /// In Vulkan memory the engine exports: memory its own renderer exported
    /// (`shmb_spec_add_vulkan_export`). A client's pointer is its own mapping of that
    /// memory (a host pointer where the memory is host-visible).
    SHMB_LOCATION_VULKAN = 2,
}

/// A key/value pair of UTF-8, NUL-terminated strings (metadata, method arguments).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct shmb_kv {
    pub key: *const c_char,
    pub value: *const c_char,
}

/// Most dimensions a tensor has.
pub const SHMB_MAX_NDIM: usize = 8;

/// A tensor's table entry. `name` is owned by the engine or client it came from and
/// valid until that handle is closed.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct shmb_tensor_info {
    pub name: *const c_char,
    /// A `shmb_dtype`.
    pub dtype: u32,
    /// A `shmb_direction`.
    pub direction: u32,
    /// A `shmb_location`.
    pub location: u32,
    /// Number of dimensions (1..=SHMB_MAX_NDIM); `shape[ndim..]` are 0.
    pub ndim: u32,
    pub shape: [u64; SHMB_MAX_NDIM],
    /// Size in bytes (C-contiguous).
    pub nbytes: u64,
    /// The CUDA device ordinal (engine's numbering) of a `SHMB_LOCATION_CUDA` tensor, else -1.
    pub device_ordinal: i32,
}

/// A wait with no deadline.
pub const SHMB_FOREVER: u64 = u64::MAX;

/// The spin budget that means "the library's default" (100 µs).
pub const SHMB_SPIN_DEFAULT: i64 = -1;

/// `shmb_spec_set_cuda_sharing`: by file descriptor in a container, else by IPC handle.
pub const SHMB_CUDA_SHARING_AUTO: u32 = 0;
/// `shmb_spec_set_cuda_sharing`: CUDA IPC handles (one PID namespace).
pub const SHMB_CUDA_SHARING_IPC: u32 = 1;
/// `shmb_spec_set_cuda_sharing`: file descriptors over the region's socket (any PID
/// namespace).
pub const SHMB_CUDA_SHARING_FD: u32 = 2;

pub(crate) fn dtype_from(code: u32) -> CResult<DType> {
    DType::ALL
        .get(code as usize)
        .copied()
        .ok_or_else(|| Fail::invalid(format!("dtype {code} is not a shmb_dtype (0..=12)")))
}

pub(crate) fn dtype_code(d: DType) -> u32 {
    DType::ALL.iter().position(|x| *x == d).unwrap_or(0) as u32
}

pub(crate) fn direction_from(code: u32) -> CResult<Direction> {
    u8::try_from(code)
        .ok()
        .and_then(Direction::from_u8)
        .ok_or_else(|| Fail::invalid(format!("direction {code} is not a shmb_direction (0 or 1)")))
}

pub(crate) fn device_from(location: u32, ordinal: i32) -> CResult<Device> {
    match location {
        0 => Ok(Device::Host),
        1 if ordinal >= 0 => Ok(Device::cuda(ordinal)),
        1 => Err(Fail::invalid(format!(
            "CUDA device ordinal {ordinal} is negative"
        ))),
        other => Err(Fail::invalid(format!(
            "location {other}: shmb_spec_add_tensor puts tensors on SHMB_LOCATION_HOST (0) or SHMB_LOCATION_CUDA (1); a tensor in Vulkan memory the engine exported is added with shmb_spec_add_vulkan_export"
        ))),
    }
}

/// The table entry of `t` (names from `names`, owned by the handle).
pub(crate) fn info_of(t: &TensorInfo, name: &CStr) -> shmb_tensor_info {
    let mut shape = [0u64; SHMB_MAX_NDIM];
    for (o, s) in shape.iter_mut().zip(&t.shape) {
        *o = *s;
    }
    shmb_tensor_info {
        name: name.as_ptr(),
        dtype: dtype_code(t.dtype),
        direction: t.direction as u32,
        location: t.location().code() as u32,
        ndim: t.shape.len() as u32,
        shape,
        nbytes: t.nbytes,
        device_ordinal: match t.device {
            Device::Cuda(c) => c.ordinal,
            _ => -1,
        },
    }
}

/// A NUL-terminated UTF-8 string from C.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid during the call.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> CResult<&'a str> {
    if p.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| Fail::invalid(format!("`{what}` is not valid UTF-8")))
}

/// `len` elements at `p` (NULL allowed only when `len` is 0).
///
/// # Safety
/// `p` is NULL or points to `len` initialised `T`s valid during the call.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, len: usize, what: &str) -> CResult<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Fail::invalid(format!(
            "`{what}` is NULL but its count is {len}"
        )));
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Fail::invalid(format!(
            "count {len} of `{what}` is not a size"
        )));
    }
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Fail::invalid(format!("`{what}` is not aligned")));
    }
    // SAFETY: non-null, aligned, `len` elements per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// Key/value pairs from C.
///
/// # Safety
/// As [`slice_arg`], and each key and value as [`str_arg`].
pub(crate) unsafe fn kv_arg(
    p: *const shmb_kv,
    len: usize,
    what: &str,
) -> CResult<Vec<(String, String)>> {
    // SAFETY: forwarded contract.
    let pairs = unsafe { slice_arg(p, len, what)? };
    pairs
        .iter()
        .map(|kv| {
            // SAFETY: forwarded contract.
            let k = unsafe { str_arg(kv.key, "key")? };
            // SAFETY: forwarded contract.
            let v = unsafe { str_arg(kv.value, "value")? };
            Ok((k.to_string(), v.to_string()))
        })
        .collect()
}

/// Writes `value` through an out-pointer.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
#[inline]
pub(crate) unsafe fn put<T>(out: *mut T, value: T, what: &str) -> CResult {
    if out.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: non-null and writable per the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Checks an out-pointer before any work is done (so a NULL one changes nothing).
#[inline]
pub(crate) fn need<T>(out: *mut T, what: &str) -> CResult {
    if out.is_null() {
        return Err(Fail::null(what));
    }
    Ok(())
}

/// A timeout in milliseconds (`SHMB_FOREVER`: none).
pub(crate) fn timeout(ms: u64) -> Duration {
    if ms == SHMB_FOREVER {
        Duration::MAX
    } else {
        Duration::from_millis(ms)
    }
}

/// A spin budget in microseconds: negative, the default; 0, never spin (block at once).
pub(crate) fn policy(spin_us: i64) -> WaitPolicy {
    match spin_us {
        s if s < 0 => WaitPolicy::default(),
        0 => WaitPolicy::BLOCKING,
        s => WaitPolicy::spinning(Duration::from_micros(s as u64)),
    }
}

/// A string for C, cut at an inner NUL (names and keys from the wire may hold one).
pub(crate) fn c_string(s: &str) -> CString {
    let end = s.bytes().position(|b| b == 0).unwrap_or(s.len());
    CString::new(&s[..end]).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_values_are_the_core_types() {
        use shmb_dtype::*;
        let pairs = [
            (SHMB_F16, "f16"),
            (SHMB_BF16, "bf16"),
            (SHMB_F32, "f32"),
            (SHMB_F64, "f64"),
            (SHMB_I8, "i8"),
            (SHMB_I16, "i16"),
            (SHMB_I32, "i32"),
            (SHMB_I64, "i64"),
            (SHMB_U8, "u8"),
            (SHMB_U16, "u16"),
            (SHMB_U32, "u32"),
            (SHMB_U64, "u64"),
            (SHMB_BOOL, "bool"),
        ];
        assert_eq!(pairs.len(), DType::ALL.len());
        for (code, name) in pairs {
            let d = dtype_from(code as u32).unwrap();
            assert_eq!(d.name(), name);
            assert_eq!(dtype_code(d), code as u32);
        }
        assert!(dtype_from(13).is_err());
        assert_eq!(
            direction_from(shmb_direction::SHMB_ENGINE_TO_CLIENT as u32).unwrap(),
            Direction::EngineToClient
        );
        assert_eq!(
            direction_from(shmb_direction::SHMB_CLIENT_TO_ENGINE as u32).unwrap(),
            Direction::ClientToEngine
        );
        assert!(direction_from(2).is_err() && direction_from(256).is_err());
        assert_eq!(
            device_from(shmb_location::SHMB_LOCATION_HOST as u32, 0).unwrap(),
            Device::Host
        );
        assert_eq!(
            device_from(shmb_location::SHMB_LOCATION_CUDA as u32, 1)
                .unwrap()
                .location()
                .code(),
            shmb_location::SHMB_LOCATION_CUDA as u8
        );
        assert!(device_from(shmb_location::SHMB_LOCATION_CUDA as u32, -1).is_err());
        assert!(device_from(shmb_location::SHMB_LOCATION_VULKAN as u32, 0).is_err());
    }
}
