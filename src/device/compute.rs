//! Device code an env runs on its engine's device, through types that name no backend's
//! own: CUDA C kernels ([`CudaKernels`], with device memory of the env's own,
//! [`DeviceMemory`]) launched on the engine's stream ([`EngineBackend::stream`]), and a
//! compute shader ([`ComputeShader`]) writing one of the engine's tensors in Vulkan memory
//! ([`ShaderTarget`]), dispatched on the engine's queue. Either way the engine's
//! publication follows the work: it records its event after what was queued on its
//! stream, or waits for its queue, before the frame is published.
//!
//! Compiled in every build, so the envs that use it need no feature of their own:
//! without the `cuda` (`vulkan`) feature every constructor answers `CudaUnavailable`
//! (`VulkanUnavailable`), and the values cannot exist.

use std::os::fd::OwnedFd;

use super::backend::{EngineBackend, StreamRef};
pub use super::cuda::Arg;
use super::VulkanDevice;
use crate::error::Result;

/// CUDA C kernels compiled with NVRTC for one CUDA device and loaded there (a cubin for
/// its compute capability, else PTX), and what launches them on a stream of it.
#[derive(Debug)]
pub struct CudaKernels(imp::Kernels);

/// Device memory an env allocated for itself with [`CudaKernels::alloc`] (never
/// exported): freed on drop.
#[derive(Debug)]
pub struct DeviceMemory(imp::Memory);

impl CudaKernels {
    /// Compiles `source` (CUDA C; `file` names it in messages) with NVRTC and `options`
    /// for CUDA device `ordinal` and loads it. `CudaUnavailable` where the driver, the
    /// device or NVRTC is missing, or without the `cuda` feature; `Cuda` where compiling
    /// or loading fails.
    pub fn build(ordinal: i32, file: &str, source: &str, options: &[&str]) -> Result<CudaKernels> {
        imp::Kernels::build(ordinal, file, source, options).map(CudaKernels)
    }

    /// `size` bytes (≥ 1) of memory on the same device, zeroed.
    pub fn alloc(&self, size: usize) -> Result<DeviceMemory> {
        self.0.alloc(size).map(DeviceMemory)
    }

    /// Launches `kernel` over `threads` threads (a 1-D grid of `block` threads per
    /// block) on `stream`, after the work queued there before.
    ///
    /// # Safety
    /// `stream` is a stream of this device (the engine's, [`EngineBackend::stream`]);
    /// `args` match the kernel's parameter list exactly (types and order), and every
    /// pointer argument is device memory valid for what the kernel does with it until
    /// the launch completes on `stream`.
    pub unsafe fn launch(
        &self,
        kernel: &str,
        stream: StreamRef<'_>,
        threads: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.0.launch(kernel, stream, threads, block, args) }
    }

    /// Blocks until the work queued on `stream` (a stream of this device) completed.
    pub fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        self.0.synchronize(stream)
    }
}

impl DeviceMemory {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.0.ptr()
    }

    pub fn size(&self) -> usize {
        self.0.size()
    }

    /// Synchronous host→device copy into `offset..offset + bytes.len()`: complete on
    /// the device when this returns, so work queued afterwards on any stream sees it.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.0.write(offset, bytes)
    }
}

/// One of the engine's tensors as a compute shader's output: its buffer in the memory
/// the library allocated on the engine's Vulkan device (path a). Another API on the
/// same device (OpenGL's `GL_EXT_memory_object_fd`) may import the memory itself
/// ([`ShaderTarget::memory_fd`]).
#[derive(Debug)]
pub struct ShaderTarget(shader::Target);

/// Why an engine's tensor is no [`ShaderTarget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotATarget {
    /// The engine has no Vulkan memory (its tensors are on the host or on CUDA).
    NotVulkan,
    /// Every Vulkan tensor of the engine is its renderer's own memory (path b).
    NotAllocated,
    /// The tensor has no buffer of the library's (another tensor, or the engine closed).
    NoBuffer,
}

impl ShaderTarget {
    /// Tensor `index` (its index in the engine's layout) of the engine whose backend is
    /// `engine`.
    pub fn of(engine: &dyn EngineBackend, index: usize) -> std::result::Result<Self, NotATarget> {
        shader::Target::of(engine, index).map(ShaderTarget)
    }

    /// Bytes of the tensor's buffer.
    pub fn bytes(&self) -> u64 {
        self.0.bytes()
    }

    /// The device's name, for messages.
    pub fn device_name(&self) -> &str {
        self.0.device_name()
    }

    /// `(maxStorageBufferRange, largest allocation)` of the device: the most bytes a
    /// shader can bind, and the most one allocation can have.
    pub fn storage_limits(&self) -> (u64, u64) {
        self.0.storage_limits()
    }

    /// Whether both are the same buffer of the same device.
    pub fn same_as(&self, other: &ShaderTarget) -> bool {
        self.0.same_as(&other.0)
    }

    /// The device's and its driver's UUIDs (what another API's import must match).
    pub fn device(&self) -> VulkanDevice {
        self.0.device()
    }

    /// A new fd of the buffer's memory (its `OPAQUE_FD` export, [`Self::bytes`] long),
    /// for another API to import; the tensor's data starts at its offset 0.
    pub fn memory_fd(&self) -> Result<OwnedFd> {
        self.0.memory_fd()
    }
}

/// A compute shader (SPIR-V, entry point `main`) whose binding 0 is a parameter buffer
/// of its own, which the CPU fills before each dispatch, and binding 1 a
/// [`ShaderTarget`]; its dispatch over a 3-D grid of workgroups is recorded once. Each
/// dispatch sees what the previous one wrote to the target (a compute-to-compute
/// barrier precedes it), so a shader may read its last output, as a frame stack does.
#[derive(Debug)]
pub struct ComputeShader(shader::Shader);

impl ComputeShader {
    /// Builds the shader of `spirv` over a parameter buffer of at least `params_len`
    /// bytes and `target`, dispatched over `grid` workgroups (`[x, y, z]`). `VulkanUnavailable`
    /// without the `vulkan` feature; `Vulkan` where the device refuses.
    pub fn new(
        target: &ShaderTarget,
        spirv: &[u8],
        params_len: u64,
        grid: [u32; 3],
    ) -> Result<ComputeShader> {
        shader::Shader::new(&target.0, spirv, params_len, grid).map(ComputeShader)
    }

    /// Waits for the previous dispatch, writes `params` at the start of the parameter
    /// buffer and submits the dispatch to the engine's queue (whose publication waits
    /// for it). `InvalidSpec` for more parameters than the buffer holds.
    pub fn dispatch(&mut self, params: &[u8]) -> Result<()> {
        self.0.dispatch(params)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use super::Arg;
    use crate::device::backend::StreamRef;
    use crate::device::cuda::driver::{DeviceAllocation, Driver, PrimaryContext, Stream};
    use crate::device::cuda::kernel::{self, Module};
    use crate::error::Result;

    #[derive(Debug)]
    pub struct Kernels {
        // Drop order: the module, then the context.
        module: Module,
        ctx: Arc<PrimaryContext>,
    }

    pub type Memory = DeviceAllocation;

    impl Kernels {
        pub fn build(ordinal: i32, file: &str, source: &str, options: &[&str]) -> Result<Self> {
            let d = Driver::get()?;
            let ctx = PrimaryContext::retain(d, ordinal)?;
            let module = kernel::build(d, &ctx, file, source, options)?;
            Ok(Kernels { module, ctx })
        }

        pub fn alloc(&self, size: usize) -> Result<Memory> {
            DeviceAllocation::new(&self.ctx, size)
        }

        /// # Safety
        /// As [`super::CudaKernels::launch`].
        pub unsafe fn launch(
            &self,
            kernel: &str,
            stream: StreamRef<'_>,
            threads: u32,
            block: u32,
            args: &[Arg],
        ) -> Result<()> {
            Stream::scoped(&self.ctx, stream, |s| {
                // SAFETY: the caller's contract on `args`.
                unsafe { self.module.launch(kernel, s, threads, block, args) }
            })
        }

        pub fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
            Stream::scoped(&self.ctx, stream, Stream::synchronize)
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::Arg;
    use crate::device::backend::StreamRef;
    use crate::error::Result;

    /// No value: a build without the `cuda` feature builds no kernels.
    #[derive(Debug)]
    pub enum Kernels {}

    /// No value: see [`Kernels`].
    #[derive(Debug)]
    pub enum Memory {}

    impl Kernels {
        pub fn build(_: i32, _: &str, _: &str, _: &[&str]) -> Result<Self> {
            Err(crate::device::cuda::unavailable_without_feature())
        }

        pub fn alloc(&self, _: usize) -> Result<Memory> {
            match *self {}
        }

        /// # Safety
        /// As [`super::CudaKernels::launch`].
        pub unsafe fn launch(
            &self,
            _: &str,
            _: StreamRef<'_>,
            _: u32,
            _: u32,
            _: &[Arg],
        ) -> Result<()> {
            match *self {}
        }

        pub fn synchronize(&self, _: StreamRef<'_>) -> Result<()> {
            match *self {}
        }
    }

    impl Memory {
        pub fn ptr(&self) -> u64 {
            match *self {}
        }

        pub fn size(&self) -> usize {
            match *self {}
        }

        pub fn write(&self, _: usize, _: &[u8]) -> Result<()> {
            match *self {}
        }
    }
}

#[cfg(feature = "vulkan")]
mod shader {
    use std::sync::Arc;

    use ash::vk;

    use std::os::fd::{AsFd, OwnedFd};

    use super::NotATarget;
    use crate::device::backend::EngineBackend;
    use crate::device::vulkan::compute::{ComputeKernel, HostBuffer};
    use crate::device::vulkan::vk::Context;
    use crate::device::VulkanDevice;
    use crate::error::{Error, Result};
    use crate::layout::vulkan::SharedFd;

    #[derive(Debug)]
    pub struct Target {
        buffer: vk::Buffer,
        bytes: u64,
        fd: SharedFd,
        ctx: Arc<Context>,
    }

    impl Target {
        pub fn of(engine: &dyn EngineBackend, index: usize) -> Result<Self, NotATarget> {
            let vulkan = engine.as_vulkan().ok_or(NotATarget::NotVulkan)?;
            let ctx = vulkan.context().cloned().ok_or(NotATarget::NotAllocated)?;
            let buffer = vulkan.buffer(index).ok_or(NotATarget::NoBuffer)?;
            Ok(Target {
                buffer: buffer.buffer(),
                bytes: buffer.table().alloc_size,
                fd: buffer.fd(),
                ctx,
            })
        }

        pub fn bytes(&self) -> u64 {
            self.bytes
        }

        pub fn device_name(&self) -> &str {
            self.ctx.name()
        }

        pub fn storage_limits(&self) -> (u64, u64) {
            self.ctx.storage_limits()
        }

        pub fn same_as(&self, other: &Target) -> bool {
            Arc::ptr_eq(&self.ctx, &other.ctx) && self.buffer == other.buffer
        }

        pub fn device(&self) -> VulkanDevice {
            self.ctx.ids()
        }

        pub fn memory_fd(&self) -> Result<OwnedFd> {
            self.fd.as_fd().try_clone_to_owned().map_err(|e| Error::Io {
                context: "duplicating a Vulkan memory fd".into(),
                source: e,
            })
        }
    }

    #[derive(Debug)]
    pub struct Shader {
        // Drop order: the kernel (it waits for its last submission), then the buffer.
        kernel: ComputeKernel,
        params: HostBuffer,
    }

    impl Shader {
        pub fn new(target: &Target, spirv: &[u8], params_len: u64, grid: [u32; 3]) -> Result<Self> {
            let params = HostBuffer::allocate(&target.ctx, params_len)?;
            let words = ash::util::read_spv(&mut std::io::Cursor::new(spirv)).map_err(|e| {
                Error::Vulkan {
                    call: "vkCreateShaderModule",
                    detail: format!("the built-in SPIR-V does not read: {e}"),
                }
            })?;
            let kernel =
                ComputeKernel::new(&target.ctx, &words, &[params.buffer(), target.buffer], grid)?;
            Ok(Shader { kernel, params })
        }

        pub fn dispatch(&mut self, params: &[u8]) -> Result<()> {
            self.kernel.wait()?;
            let dst = self.params.bytes_mut();
            let Some(dst) = dst.get_mut(..params.len()) else {
                return Err(Error::InvalidSpec(format!(
                    "{} bytes of shader parameters for a {}-byte buffer",
                    params.len(),
                    dst.len()
                )));
            };
            dst.copy_from_slice(params);
            self.kernel.submit()
        }
    }
}

#[cfg(not(feature = "vulkan"))]
mod shader {
    use std::os::fd::OwnedFd;

    use super::NotATarget;
    use crate::device::backend::EngineBackend;
    use crate::device::VulkanDevice;
    use crate::error::Result;

    /// No value: a build without the `vulkan` feature has no Vulkan memory.
    #[derive(Debug)]
    pub enum Target {}

    /// No value: see [`Target`].
    #[derive(Debug)]
    pub enum Shader {}

    impl Target {
        pub fn of(_: &dyn EngineBackend, _: usize) -> Result<Self, NotATarget> {
            Err(NotATarget::NotVulkan)
        }

        pub fn bytes(&self) -> u64 {
            match *self {}
        }

        pub fn device_name(&self) -> &str {
            match *self {}
        }

        pub fn storage_limits(&self) -> (u64, u64) {
            match *self {}
        }

        pub fn same_as(&self, _: &Target) -> bool {
            match *self {}
        }

        pub fn device(&self) -> VulkanDevice {
            match *self {}
        }

        pub fn memory_fd(&self) -> Result<OwnedFd> {
            match *self {}
        }
    }

    impl Shader {
        pub fn new(target: &Target, _: &[u8], _: u64, _: [u32; 3]) -> Result<Self> {
            match *target {}
        }

        pub fn dispatch(&mut self, _: &[u8]) -> Result<()> {
            match *self {}
        }
    }
}
