//! The devices of this process that import memory another backend's engine exported as
//! fds (the Vulkan client's device importer: CUDA), handed to a backend through the seam
//! ([`FdImporter`]), so no backend folder names another.

use super::backend::FdImporter;
use super::cuda;
use crate::error::Result;

/// The devices of this process that can import memory another backend's engine
/// exported as fds (the Vulkan client's device importer: CUDA), as their UUIDs by
/// ordinal, or why there are none (a build without the `cuda` feature, no driver).
pub fn fd_import_devices() -> std::result::Result<Vec<[u8; 16]>, String> {
    #[cfg(feature = "cuda")]
    {
        cuda::fd_import::devices()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(match cuda::unavailable_without_feature() {
            crate::error::Error::CudaUnavailable { reason } => reason,
            e => e.to_string(),
        })
    }
}

/// The API of the devices of [`fd_import_devices`] ([`FdImporter::name`] of the one
/// [`fd_importer`] opens), for messages written before one is open ("CUDA").
pub fn fd_importer_name() -> &'static str {
    cuda::NAME
}

/// The [`FdImporter`] on device `ordinal` of [`fd_import_devices`].
pub fn fd_importer(ordinal: i32) -> Result<std::sync::Arc<dyn FdImporter>> {
    #[cfg(feature = "cuda")]
    {
        cuda::fd_import::importer(ordinal)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(cuda::unavailable_without_feature())
    }
}
