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

use crate::error::{Error, PidNamespace, Result};
use crate::layout::{CudaSharing, Layout};

/// The API's name, for messages (the device importer's [`FdImporter::name`]).
///
/// [`FdImporter::name`]: crate::device::backend::FdImporter::name
pub const NAME: &str = "CUDA";

#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod fd_import;
#[cfg(feature = "cuda")]
pub mod ipc;
#[cfg(feature = "cuda")]
pub mod kernel;
pub mod share;

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

/// How this client takes the engine's CUDA memory, chosen at attach (before the driver
/// is probed or the slot claimed) from what the tensor table offers and where the engine
/// lives (`engine`: whether this PID namespace shows its process, `os::pid_namespace`).
/// `Ok(None)` without CUDA tensors.
///
/// - IPC handles (1.2) in this PID namespace: [`CudaSharing::Ipc`], the simpler path.
/// - IPC handles of an engine in another PID namespace (another container): refused,
///   `CudaUnavailable` naming the tensor and why (`cuIpcOpenMemHandle` does not cross PID
///   namespaces), before anything is claimed, instead of a driver error after.
/// - Memory shared by fd (1.9): [`CudaSharing::Fd`], wherever the engine lives (the fd
///   comes over the region's socket, which crosses PID namespaces).
/// - Both in one table: `InvalidHeader` (an engine shares its CUDA memory one way).
pub fn choose_sharing(layout: &Layout, engine: PidNamespace) -> Result<Option<CudaSharing>> {
    let mut cuda = layout.tensors.iter().filter_map(|t| t.cuda.map(|c| (t, c)));
    let Some((first, c)) = cuda.next() else {
        return Ok(None);
    };
    if let Some((t, _)) = cuda.find(|(_, o)| o.sharing != c.sharing) {
        return Err(Error::InvalidHeader {
            field: "flags",
            reason: format!(
                "CUDA tensors '{}' and '{}' are shared in two ways (IPC handle, fd): an \
                 engine shares its CUDA memory one way",
                first.name, t.name
            ),
        });
    }
    match (c.sharing, engine) {
        (CudaSharing::Ipc, PidNamespace::This) | (CudaSharing::Fd, _) => Ok(Some(c.sharing)),
        (CudaSharing::Ipc, PidNamespace::Other) => Err(Error::CudaUnavailable {
            reason: format!(
                "tensor '{}' lives on CUDA, shared by a CUDA IPC handle, and the engine (pid \
                 {} in its own PID namespace) is not in this process's PID namespace (another \
                 container): CUDA IPC handles do not cross PID namespaces. Start the engine \
                 with cuda_sharing \"fd\" (its CUDA memory then comes over the region's fd \
                 socket), run both in one PID namespace (docker --pid=container:<engine>, or \
                 a pod with shareProcessNamespace), or read the tensors from host memory",
                first.name, layout.engine_pid
            ),
        }),
    }
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
    use crate::layout::{DType, Direction, HeaderBuilder, TensorSpec};

    /// A validated layout of a CUDA engine that shares by IPC handle, or by fd.
    fn layout(fd: bool) -> Layout {
        let specs = [
            TensorSpec::new("obs", DType::F32, &[4, 3], Direction::EngineToClient)
                .on(crate::device::Device::cuda(0)),
            TensorSpec::new("reward", DType::F32, &[4], Direction::EngineToClient),
        ];
        let mut b = HeaderBuilder::new("gpu", 4, &specs, 0).unwrap();
        match fd {
            true => b.set_cuda_fd_export([2; 16], b.cuda_alloc.unwrap().1),
            false => b.set_cuda_export([1; 64], [2; 16], [3; 64]),
        }
        let mut bytes = b.bytes();
        bytes.resize(b.header.region_size as usize, 0);
        bytes[..8].copy_from_slice(&crate::layout::MAGIC.to_le_bytes());
        crate::layout::validate("r", &bytes, b.header.region_size).unwrap()
    }

    #[test]
    fn the_sharing_is_chosen_by_the_table_and_the_engines_pid_namespace() {
        use PidNamespace::{Other, This};
        let (ipc, fd) = (layout(false), layout(true));
        assert_eq!(choose_sharing(&ipc, This).unwrap(), Some(CudaSharing::Ipc));
        assert_eq!(choose_sharing(&fd, This).unwrap(), Some(CudaSharing::Fd));
        assert_eq!(choose_sharing(&fd, Other).unwrap(), Some(CudaSharing::Fd));
        match choose_sharing(&ipc, Other) {
            Err(Error::CudaUnavailable { reason }) => {
                assert!(reason.contains("'obs'"), "{reason}");
                assert!(reason.contains("PID namespace"), "{reason}");
            }
            other => panic!("IPC handles across PID namespaces: {other:?}"),
        }
        let mut host = ipc.clone();
        host.tensors.retain(|t| t.cuda.is_none());
        assert_eq!(choose_sharing(&host, Other).unwrap(), None);
        let mut mixed = ipc.clone();
        mixed.tensors.push(fd.tensors[0].clone());
        assert!(matches!(
            choose_sharing(&mixed, This),
            Err(Error::InvalidHeader { field: "flags", .. })
        ));
    }

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
