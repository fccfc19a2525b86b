//! Host memory: the tensors' bytes are in the region itself, which both processes map.
//! Nothing to export, import, order or release: every hook is a no-op.

use std::any::Any;
use std::time::Duration;

use super::backend::{ClientBackend, DevicePlace, DeviceRelease, EngineBackend, StreamRef};
use crate::control::{Control, ControlMapping};
use crate::error::{Error, Result};
use crate::layout::{Layout, TensorInfo};

/// The engine's host backend.
#[derive(Debug, Default)]
pub struct HostEngine;

/// The client's host backend.
#[derive(Debug, Default)]
pub struct HostClient;

fn no_device(t: &TensorInfo) -> Error {
    Error::NotOnHost {
        tensor: t.name.clone(),
        location: "host (this engine has no CUDA tensors)",
    }
}

impl EngineBackend for HostEngine {
    fn needs_hooks(&self) -> bool {
        false
    }
    #[inline]
    fn before_publish(&self) -> Result<()> {
        Ok(())
    }
    #[inline]
    fn before_actions(&mut self, _: Control<'_>) -> Result<()> {
        Ok(())
    }
    #[inline]
    fn before_command(&mut self, _: Control<'_>) -> Result<()> {
        Ok(())
    }
    fn forget_client(&mut self) {}
    fn device_ptr(&self, t: &TensorInfo) -> Result<u64> {
        Err(no_device(t))
    }
    fn release(self: Box<Self>, _: Control<'_>) -> DeviceRelease {
        DeviceRelease::NothingHeld
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl ClientBackend for HostClient {
    fn needs_hooks(&self) -> bool {
        false
    }
    fn open(&mut self, _: &Layout, _: &dyn ControlMapping) -> Result<()> {
        Ok(())
    }
    #[inline]
    fn before_post(
        &self,
        _: Option<StreamRef<'_>>,
        _: Duration,
        _: &dyn Fn() -> Result<()>,
    ) -> Result<()> {
        Ok(())
    }
    fn device_ptr(&self, _: usize, t: &TensorInfo) -> Result<u64> {
        Err(no_device(t))
    }
    fn place(&self, _: usize, _: &TensorInfo) -> Result<Option<DevicePlace>> {
        Ok(None)
    }
    fn order_after_frame(&self, _: StreamRef<'_>) -> Result<()> {
        Ok(())
    }
    unsafe fn copy_into(&self, _: u64, _: u64, _: usize, _: StreamRef<'_>) -> Result<()> {
        Err(Error::OutOfOrder(
            "a device copy into a host client's tensors: they live in the region",
        ))
    }
    fn release(&mut self, _: &dyn ControlMapping) {}
    fn as_any(&self) -> &dyn Any {
        self
    }
}
