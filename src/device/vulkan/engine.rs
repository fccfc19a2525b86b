//! The engine's Vulkan backend: the memory of every Vulkan tensor (allocated here, path
//! a, or taken over from the engine's renderer, path b), its fds, and the fd server.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use super::vk::{Context, ExportedBuffer};
use crate::control::{self, Control, ControlMapping};
use crate::device::backend::{DeviceRelease, EngineBackend};
use crate::device::server::FdServer;
use crate::error::{Error, Result};
use crate::layout::location::Device;
use crate::layout::vulkan::{SharedFd, VulkanSource};
use crate::layout::{HeaderBuilder, TensorInfo};
use crate::os;

/// Called before every frame is published: a renderer with its own queue (path b)
/// waits for its frame's work here.
pub type BeforePublish = Box<dyn Fn() -> Result<()> + Send + Sync>;

pub struct EngineVulkan {
    // Drop order: the server (no more sends), then the buffers, then the context.
    server: Option<FdServer>,
    /// The fds to send, in protocol order.
    fds: Vec<SharedFd>,
    /// Path (a) buffers, by tensor index.
    buffers: Vec<Option<ExportedBuffer>>,
    hook: Mutex<Option<BeforePublish>>,
    ctx: Option<Arc<Context>>,
}

impl std::fmt::Debug for EngineVulkan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineVulkan")
            .field("fds", &self.fds)
            .field("buffers", &self.buffers)
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

impl EngineVulkan {
    /// Allocates (path a) or takes over (path b) every Vulkan tensor's memory and fills
    /// in the table. The region's socket is bound by [`EngineBackend::start`], once the
    /// region's name is this engine's and before it is published; a name too long for
    /// the socket's path is refused here, before anything is allocated.
    pub fn create(builder: &mut HeaderBuilder, name: &str) -> Result<EngineVulkan> {
        control::socket_path(name)?;
        let mut buffers: Vec<Option<ExportedBuffer>> = Vec::new();
        buffers.resize_with(builder.tensors.len(), || None);
        let mut fds = Vec::new();
        let mut ctx: Option<Arc<Context>> = None;
        for (index, source) in std::mem::take(&mut builder.vulkan) {
            let t = &builder.tensors[index];
            match source {
                VulkanSource::Allocate => {
                    let Device::Vulkan(want) = t.device else {
                        return Err(Error::InvalidSpec(format!(
                            "tensor '{}' is not on Vulkan",
                            t.name
                        )));
                    };
                    let c = match &ctx {
                        Some(c) if want == crate::device::VulkanDevice::ANY || c.ids() == want => {
                            c.clone()
                        }
                        Some(_) => {
                            return Err(Error::InvalidSpec(
                                "the library allocates Vulkan tensors on one device per engine"
                                    .into(),
                            ))
                        }
                        None => {
                            let c = Context::open(want)?;
                            ctx = Some(c.clone());
                            c
                        }
                    };
                    let buffer = ExportedBuffer::allocate(&c, t.nbytes)?;
                    builder.set_vulkan_export(index, c.ids(), buffer.table());
                    fds.push(buffer.fd());
                    buffers[index] = Some(buffer);
                }
                VulkanSource::Import {
                    memory, semaphore, ..
                } => {
                    // The table was filled from the spec's export by the builder. The fds
                    // are the engine's now: not inherited by programs it runs.
                    close_on_exec(&memory)?;
                    fds.push(memory);
                    if let Some((fd, _)) = semaphore {
                        close_on_exec(&fd)?;
                        fds.push(fd);
                    }
                }
            }
        }
        Ok(EngineVulkan {
            server: None,
            fds,
            buffers,
            hook: Mutex::new(None),
            ctx,
        })
    }

    /// The device the library allocated on (path a); `None` when every Vulkan tensor is
    /// the renderer's own memory (path b).
    pub fn context(&self) -> Option<&Arc<Context>> {
        self.ctx.as_ref()
    }

    /// The buffer of tensor `t` (path a): record GPU work writing a frame into it on
    /// [`Context::queue`]; [`Engine::publish`](crate::Engine::publish) waits for that
    /// queue before the frame is published.
    /// `index`: the tensor's index in the layout (`TensorId::index`).
    pub fn buffer(&self, index: usize) -> Option<&ExportedBuffer> {
        self.buffers.get(index)?.as_ref()
    }

    /// Sets a hook called before every frame is published, after the library's queue
    /// is idle: a renderer with its own queue (path b) waits for its frame there, since
    /// without a semaphore the seq counters alone order frames for the client.
    pub fn set_before_publish(&self, hook: Option<BeforePublish>) {
        *self.hook.lock().unwrap_or_else(|p| p.into_inner()) = hook;
    }
}

impl EngineBackend for EngineVulkan {
    fn before_publish(&self) -> Result<()> {
        if let Some(c) = &self.ctx {
            c.queue_wait_idle()?;
        }
        if let Some(h) = &*self.hook.lock().unwrap_or_else(|p| p.into_inner()) {
            h()?;
        }
        Ok(())
    }

    fn before_actions(&mut self, _: Control<'_>) -> Result<()> {
        Ok(())
    }

    fn before_command(&mut self, _: Control<'_>) -> Result<()> {
        Ok(())
    }

    fn forget_client(&mut self) {}

    fn device_ptr(&self, t: &TensorInfo) -> Result<u64> {
        Err(Error::NotOnHost {
            tensor: t.name.clone(),
            location: "vulkan (use its buffer: Tensors::engine_backend()?.as_vulkan())",
        })
    }

    /// Binds the region's socket (1.6: `<name>.fd` beside it in /dev/shm) and starts
    /// serving it. Called once the region's name is this engine's and before it is
    /// published, so a client that sees the region finds the socket.
    fn start(&mut self, region: &dyn ControlMapping) -> Result<()> {
        if self.server.is_none() {
            self.server = Some(FdServer::bind_and_start(region, self.fds.clone())?);
        }
        Ok(())
    }

    fn host_ptr(&self, index: usize, _t: &TensorInfo) -> Option<NonNull<u8>> {
        self.buffers.get(index)?.as_ref()?.mapped()
    }

    fn release(mut self: Box<Self>, _: Control<'_>) -> DeviceRelease {
        // No more fds go out; then the memory goes. A client's import holds its own
        // reference to the payload, so freeing ours never pulls it from under the client.
        if let Some(mut s) = self.server.take() {
            s.stop();
        }
        if let Some(c) = &self.ctx {
            let _ = c.queue_wait_idle();
        }
        self.buffers.clear();
        DeviceRelease::NothingHeld
    }

    /// A truncated region: the fd server stops (it reads the control block, which it
    /// checks the size of first, but nobody must connect to a closed engine), the
    /// memory goes as at any release: an import holds its own reference.
    fn release_truncated(mut self: Box<Self>) {
        if let Some(mut s) = self.server.take() {
            s.stop();
        }
        if let Some(c) = &self.ctx {
            let _ = c.queue_wait_idle();
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Sets `FD_CLOEXEC` on an fd the engine keeps: drivers and renderers hand out exported
/// memory fds without it, and a program the engine runs must not inherit them.
fn close_on_exec(fd: &SharedFd) -> Result<()> {
    os::set_cloexec(fd)
}

impl dyn EngineBackend {
    /// The Vulkan side of an engine with Vulkan tensors (its device, queue and
    /// buffers); `None` for any other backend.
    pub fn as_vulkan(&self) -> Option<&EngineVulkan> {
        self.as_any().downcast_ref()
    }
}
