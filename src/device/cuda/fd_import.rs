//! CUDA as an [`FdImporter`]: memory and timeline semaphores another backend's engine
//! exported as fds (Vulkan, protocol 1.3) imported with `cuImportExternalMemory` and
//! `cuImportExternalSemaphore` ([`driver::ExternalMemory`], [`driver::ExternalSemaphore`]).
//! The Vulkan client reaches it through [`crate::device::fd_importer`] only.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::driver::{self, Driver, ExternalMemory, ExternalSemaphore, PrimaryContext, Stream};
use crate::device::backend::{FdImporter, FdMemory, FdTimeline, StreamRef};
use crate::error::Result;
use crate::layout::location::{CudaDevice, Device, DL_CUDA};

/// The UUIDs of this process's CUDA devices, by ordinal, or why there are none.
pub fn devices() -> std::result::Result<Vec<[u8; 16]>, String> {
    let d = Driver::get().map_err(|e| e.to_string())?;
    (0..d.info().device_count)
        .map(|o| driver::device_uuid(d, o))
        .collect::<Result<Vec<_>>>()
        .map_err(|e| e.to_string())
}

/// CUDA device `ordinal`'s primary context, importing fds.
pub fn importer(ordinal: i32) -> Result<Arc<dyn FdImporter>> {
    let ctx = PrimaryContext::retain(Driver::get()?, ordinal)?;
    Ok(Arc::new(CudaFdImporter(ctx)))
}

struct CudaFdImporter(Arc<PrimaryContext>);

impl CudaFdImporter {
    /// Runs `f` on `stream` of this device, or on the legacy default stream (DLPack's
    /// 1), as a [`Stream`] that lives only for the call.
    fn with_stream<R>(&self, stream: Option<StreamRef<'_>>, f: impl FnOnce(&Stream) -> R) -> R {
        match stream {
            Some(s) => Stream::scoped(&self.0, s, f),
            None => {
                // SAFETY: 1 is CU_STREAM_LEGACY, which `borrowed` accepts and which lives
                // as long as the context; the value is dropped within this call.
                let legacy = unsafe { Stream::borrowed(&self.0, 1) };
                f(&legacy)
            }
        }
    }
}

impl FdImporter for CudaFdImporter {
    fn name(&self) -> &'static str {
        super::NAME
    }

    fn describe(&self) -> String {
        format!("CUDA importer on device {} (kDLCUDA)", self.0.ordinal())
    }

    fn device(&self) -> Result<Device> {
        Ok(Device::Cuda(CudaDevice {
            ordinal: self.0.ordinal(),
            uuid: self.0.uuid()?,
        }))
    }

    fn dlpack_device(&self) -> (i32, i32) {
        (DL_CUDA, self.0.ordinal())
    }

    fn import_memory(&self, fd: OwnedFd, size: u64, dedicated: bool) -> Result<Box<dyn FdMemory>> {
        Ok(Box::new(ExternalMemory::import_opaque_fd(
            &self.0, fd, size, dedicated,
        )?))
    }

    fn import_timeline(&self, fd: OwnedFd) -> Result<Box<dyn FdTimeline>> {
        let semaphore = ExternalSemaphore::import_timeline(&self.0, fd)?;
        Ok(Box::new(Timeline {
            ctx: self.0.clone(),
            semaphore,
        }))
    }

    fn synchronize(&self, stream: Option<StreamRef<'_>>) -> Result<()> {
        self.with_stream(stream, Stream::synchronize)
    }

    fn is_idle(&self, stream: Option<StreamRef<'_>>) -> Result<bool> {
        self.with_stream(stream, Stream::is_idle)
    }
}

impl FdMemory for ExternalMemory {
    fn span(&self, offset: u64, len: u64) -> Option<u64> {
        ExternalMemory::span(self, offset, len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        ExternalMemory::read(self, offset, out)
    }
}

/// An imported timeline semaphore and the context its waits' streams belong to.
#[derive(Debug)]
struct Timeline {
    ctx: Arc<PrimaryContext>,
    semaphore: ExternalSemaphore,
}

impl FdTimeline for Timeline {
    fn wait(&self, stream: StreamRef<'_>, value: u64) -> Result<()> {
        Stream::scoped(&self.ctx, stream, |consumer| {
            self.semaphore.wait(consumer, value)
        })
    }
}
