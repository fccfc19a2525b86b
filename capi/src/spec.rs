//! `shmb_spec`: what an engine serves, built call by call (the core's `EngineSpec`).

use std::ffi::c_char;

use shmbridge_core::device::CudaSharingRequest;
use shmbridge_core::layout::{DType, TensorSpec};
use shmbridge_core::EngineSpec;

use crate::registry::{Kind, Registry};
use crate::status::{guard, shmb_status, Fail};
use crate::types::{
    device_from, direction_from, dtype_from, kv_arg, policy, put, shmb_kv, slice_arg, str_arg,
    SHMB_MAX_NDIM,
};

/// An engine spec being built (opaque; a handle, never dereferenced).
#[allow(non_camel_case_types)]
pub struct shmb_spec {
    _opaque: [u8; 0],
}

pub(crate) static SPECS: Registry<EngineSpec> = Registry::new("spec", Kind::Spec);

pub(crate) fn id(p: *mut shmb_spec) -> usize {
    p as usize
}

/// Starts a spec for an engine of `kind` (your simulator's name, 1..31 bytes of UTF-8)
/// serving `num_envs` environments, with no tensors yet. Defaults: a random region name,
/// 512 KiB command rings, the default wait policy.
///
/// Ownership: `*out` is a new spec owned by the caller: free it with `shmb_spec_free`
/// (creating an engine from it does not). `kind` is copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_spec_new(
    kind: *const c_char,
    num_envs: u32,
    out: *mut *mut shmb_spec,
) -> shmb_status {
    guard(|| {
        crate::types::need(out, "out")?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let kind = unsafe { str_arg(kind, "kind")? };
        let handle = SPECS.insert(EngineSpec::new(kind, num_envs))?;
        // SAFETY: checked non-null above; the caller gives a writable pointer.
        unsafe { put(out, handle as *mut shmb_spec, "out") }
    })
}

/// Adds a tensor: `name` (1..31 bytes, unique), `dtype` (a `shmb_dtype`), `shape`
/// (`ndim` dimensions, 1..=SHMB_MAX_NDIM, each ≥ 1), `direction` (a `shmb_direction`),
/// `location` (`SHMB_LOCATION_HOST`, or `SHMB_LOCATION_CUDA` on CUDA device `device_ordinal`; every CUDA
/// tensor of an engine on one device; a tensor in Vulkan memory the engine exported:
/// `shmb_spec_add_vulkan_export`). Checked fully when the engine is created.
///
/// Ownership: everything is copied; the caller keeps its strings and arrays.
#[no_mangle]
pub unsafe extern "C" fn shmb_spec_add_tensor(
    spec: *mut shmb_spec,
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    direction: u32,
    location: u32,
    device_ordinal: i32,
) -> shmb_status {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (name, dtype, shape) = unsafe { tensor_args(name, dtype, shape, ndim)? };
        let t = TensorSpec::new(name, dtype, shape, direction_from(direction)?)
            .on(device_from(location, device_ordinal)?);
        push(spec, t)
    })
}

/// A tensor's name, dtype and shape from C, checked.
///
/// # Safety
/// `name` is NULL or NUL-terminated; `shape` is NULL or holds `ndim` u64s.
pub(crate) unsafe fn tensor_args<'a>(
    name: *const c_char,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
) -> Result<(&'a str, DType, &'a [u64]), Fail> {
    // SAFETY: the caller passes a NUL-terminated string or NULL.
    let name = unsafe { str_arg(name, "name")? };
    if ndim == 0 || ndim > SHMB_MAX_NDIM {
        return Err(Fail::invalid(format!(
            "tensor '{name}': ndim {ndim}, expected 1..={SHMB_MAX_NDIM}"
        )));
    }
    // SAFETY: the caller passes `ndim` u64s at `shape`.
    let shape = unsafe { slice_arg(shape, ndim, "shape")? };
    Ok((name, dtype_from(dtype)?, shape))
}

/// Adds tensor `t` to the spec of handle `spec`.
pub(crate) fn push(spec: *mut shmb_spec, t: TensorSpec) -> Result<(), Fail> {
    SPECS.with(id(spec), |s| {
        s.tensors.push(t);
        Ok(())
    })
}

/// Adds the standard tensors `obs [num_envs, obs_dim] f32`, `actions [num_envs, act_dim]
/// act_dtype`, `rewards [num_envs] f32`, `terminated`/`truncated [num_envs] bool` and
/// `reset_mask [num_envs] bool`, in that order, in host memory: what Python's
/// `Client.step()`, `shmbridge.gym` and the reference engines use.
#[no_mangle]
pub extern "C" fn shmb_spec_add_standard(
    spec: *mut shmb_spec,
    obs_dim: u64,
    act_dim: u64,
    act_dtype: u32,
) -> shmb_status {
    guard(|| {
        let act_dtype = dtype_from(act_dtype)?;
        SPECS.with(id(spec), |s| {
            let standard = EngineSpec::standard(&s.kind, s.num_envs, obs_dim, act_dim, act_dtype);
            s.tensors.extend(standard.tensors);
            Ok(())
        })
    })
}

/// Adds a key/value the engine reports in its schema (observation bounds, action space,
/// anything a client needs). Copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_spec_add_metadata(
    spec: *mut shmb_spec,
    key: *const c_char,
    value: *const c_char,
) -> shmb_status {
    guard(|| {
        let kv = shmb_kv { key, value };
        // SAFETY: one pair of caller strings, as `kv_arg` needs.
        let mut pairs = unsafe { kv_arg(&kv, 1, "metadata")? };
        SPECS.with(id(spec), |s| {
            s.metadata.append(&mut pairs);
            Ok(())
        })
    })
}

/// Sets the region name (a missing `shmbridge-` prefix is added); NULL: a random one.
/// Copied.
#[no_mangle]
pub unsafe extern "C" fn shmb_spec_set_name(
    spec: *mut shmb_spec,
    name: *const c_char,
) -> shmb_status {
    guard(|| {
        let name = if name.is_null() {
            None
        } else {
            // SAFETY: non-null, NUL-terminated per the caller's contract.
            Some(unsafe { str_arg(name, "name")? }.to_string())
        };
        SPECS.with(id(spec), |s| {
            s.name = name;
            Ok(())
        })
    })
}

/// How the engine waits for actions: spin `spin_us` microseconds before sleeping on a
/// futex; 0: never spin (lowest CPU use); `SHMB_SPIN_DEFAULT` (-1): the default, 100 µs, up to 2 ms while the last waits took longer.
#[no_mangle]
pub extern "C" fn shmb_spec_set_spin(spec: *mut shmb_spec, spin_us: i64) -> shmb_status {
    guard(|| {
        SPECS.with(id(spec), |s| {
            s.policy = policy(spin_us);
            Ok(())
        })
    })
}

/// Bytes of each command ring (a power of two ≥ 64; default 512 KiB; 0: no command
/// channel, so clients cannot reset or call methods).
#[no_mangle]
pub extern "C" fn shmb_spec_set_ring_capacity(spec: *mut shmb_spec, bytes: u64) -> shmb_status {
    guard(|| {
        SPECS.with(id(spec), |s| {
            s.ring_capacity = bytes;
            Ok(())
        })
    })
}

/// How the engine shares its CUDA tensors: `SHMB_CUDA_SHARING_AUTO` (0, the default: by
/// file descriptor when the engine runs in a container, a PID namespace other than the
/// host's, and its GPU can; else by IPC handle), `SHMB_CUDA_SHARING_IPC` (1: CUDA IPC
/// handles, for a learner in the engine's PID namespace) or `SHMB_CUDA_SHARING_FD` (2:
/// file descriptors over the region's socket, for a learner in any container that shares
/// /dev/shm; `SHMB_CUDA_UNAVAILABLE` at engine creation where the GPU cannot). Any other
/// value: `SHMB_INVALID_SPEC`.
#[no_mangle]
pub extern "C" fn shmb_spec_set_cuda_sharing(spec: *mut shmb_spec, sharing: u32) -> shmb_status {
    guard(|| {
        let sharing = CudaSharingRequest::from_code(sharing)?;
        SPECS.with(id(spec), |s| {
            s.cuda_sharing = sharing;
            Ok(())
        })
    })
}

/// Frees a spec. The handle is invalid afterwards (a second free: `SHMB_CLOSED`).
#[no_mangle]
pub extern "C" fn shmb_spec_free(spec: *mut shmb_spec) -> shmb_status {
    guard(|| SPECS.remove(id(spec)).map(drop))
}

/// Runs `f` on a copy of the spec of handle `spec` (engine creation).
pub(crate) fn cloned(spec: *mut shmb_spec) -> Result<EngineSpec, Fail> {
    SPECS.with(id(spec), |s| Ok(s.clone()))
}
