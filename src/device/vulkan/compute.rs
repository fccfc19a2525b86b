//! Compute on this process's Vulkan device: a compute shader bound to storage buffers
//! ([`ComputeKernel`], its dispatch recorded once and submitted for every frame) and the
//! host-visible buffers the CPU fills with its inputs ([`HostBuffer`]). On top of the
//! Vulkan layer ([`super::vk`]).

use std::ptr::NonNull;
use std::sync::Arc;

use ash::vk;

use super::vk::{call, BoundBuffer, Context, HOST};
use crate::error::{Error, Result};

/// A buffer of this process only (not exported) in host-visible, coherent memory,
/// mapped: the inputs a kernel reads, written by the CPU before each submission.
pub struct HostBuffer {
    bound: BoundBuffer,
    mapped: NonNull<u8>,
}

// SAFETY: as for `ExportedBuffer`.
unsafe impl Send for HostBuffer {}
// SAFETY: as for `ExportedBuffer`.
unsafe impl Sync for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("size", &self.bound.size)
            .finish_non_exhaustive()
    }
}

impl HostBuffer {
    /// At least `nbytes`, host-visible and coherent (the device-local kind first).
    pub fn allocate(ctx: &Arc<Context>, nbytes: u64) -> Result<HostBuffer> {
        let local = vk::MemoryPropertyFlags::DEVICE_LOCAL;
        let bound = BoundBuffer::allocate(ctx, nbytes, false, &[HOST | local, HOST])?;
        let Some(mapped) = bound.mapped else {
            return Err(Error::Vulkan {
                call: "vkMapMemory",
                detail: "a host-visible buffer was not mapped".into(),
            });
        };
        Ok(HostBuffer { bound, mapped })
    }

    pub fn buffer(&self) -> vk::Buffer {
        self.bound.buffer
    }

    /// The buffer's bytes. `&mut self`: the caller writes them between submissions,
    /// when no kernel reads them (the queue is idle after each frame).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let p = self.mapped;
        // SAFETY: a mapping of `size` bytes of coherent memory owned by this buffer, alive
        // while it is; `&mut self` makes this the only slice of it in this process, and
        // the device reads it only during a submission, which the owner waits for before
        // writing again.
        unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), self.bound.size as usize) }
    }
}

/// A compute shader bound to its storage buffers, with one command buffer that records
/// its dispatch once and is submitted again for every frame.
///
/// Binding `i` of descriptor set 0 is `buffers[i]`. The recording begins with a barrier
/// that makes the previous submission's shader writes visible to this one's dispatch and
/// ends with one that makes the shader's writes visible to the host (the client maps the
/// memory), and
/// each submission signals a fence the next one waits for, so the command buffer is
/// never resubmitted while pending. The engine waits for the queue before it publishes
/// ([`Context::queue_wait_idle`]).
pub struct ComputeKernel {
    ctx: Arc<Context>,
    module: vk::ShaderModule,
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    pipeline: vk::Pipeline,
    descriptors: vk::DescriptorPool,
    commands: vk::CommandPool,
    command: vk::CommandBuffer,
    fence: vk::Fence,
}

// SAFETY: the handles are valid in every thread; the owner submits from one thread at a
// time (`&mut self` in `submit`).
unsafe impl Send for ComputeKernel {}
// SAFETY: `&ComputeKernel` hands out nothing.
unsafe impl Sync for ComputeKernel {}

impl std::fmt::Debug for ComputeKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputeKernel").finish_non_exhaustive()
    }
}

impl ComputeKernel {
    /// Builds the pipeline of `spirv` (entry point `main`) over `buffers` and records its
    /// dispatch over `groups` workgroups.
    pub fn new(
        ctx: &Arc<Context>,
        spirv: &[u32],
        buffers: &[vk::Buffer],
        groups: [u32; 3],
    ) -> Result<ComputeKernel> {
        let d = ctx.device();
        let mut k = ComputeKernel {
            ctx: ctx.clone(),
            module: vk::ShaderModule::null(),
            set_layout: vk::DescriptorSetLayout::null(),
            pipeline_layout: vk::PipelineLayout::null(),
            pipeline: vk::Pipeline::null(),
            descriptors: vk::DescriptorPool::null(),
            commands: vk::CommandPool::null(),
            command: vk::CommandBuffer::null(),
            fence: vk::Fence::null(),
        };
        // Each step fills one handle; on error, `Drop` destroys those made so far (it
        // skips null handles).
        let info = vk::ShaderModuleCreateInfo::default().code(spirv);
        // SAFETY: `spirv` is a SPIR-V module (translated and validated at build time);
        // `info` lives across the call.
        k.module =
            unsafe { d.create_shader_module(&info, None) }.map_err(call("vkCreateShaderModule"))?;
        let bindings: Vec<_> = (0..buffers.len() as u32)
            .map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings);
        // SAFETY: as above.
        k.set_layout = unsafe { d.create_descriptor_set_layout(&info, None) }
            .map_err(call("vkCreateDescriptorSetLayout"))?;
        let layouts = [k.set_layout];
        let info = vk::PipelineLayoutCreateInfo::default().set_layouts(&layouts);
        // SAFETY: as above.
        k.pipeline_layout = unsafe { d.create_pipeline_layout(&info, None) }
            .map_err(call("vkCreatePipelineLayout"))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(k.module)
            .name(c"main");
        let info = [vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(k.pipeline_layout)];
        // SAFETY: as above; the module and layout are live.
        k.pipeline = unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &info, None) }
            .map_err(|(_, e)| call("vkCreateComputePipelines")(e))?[0];
        let sizes = [vk::DescriptorPoolSize::default()
            .ty(vk::DescriptorType::STORAGE_BUFFER)
            .descriptor_count(buffers.len().max(1) as u32)];
        let info = vk::DescriptorPoolCreateInfo::default()
            .max_sets(1)
            .pool_sizes(&sizes);
        // SAFETY: as above.
        k.descriptors = unsafe { d.create_descriptor_pool(&info, None) }
            .map_err(call("vkCreateDescriptorPool"))?;
        let info = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(k.descriptors)
            .set_layouts(&layouts);
        // SAFETY: the pool has room for this one set.
        let set = unsafe { d.allocate_descriptor_sets(&info) }
            .map_err(call("vkAllocateDescriptorSets"))?[0];
        let infos: Vec<[vk::DescriptorBufferInfo; 1]> = buffers
            .iter()
            .map(|&b| {
                [vk::DescriptorBufferInfo::default()
                    .buffer(b)
                    .range(vk::WHOLE_SIZE)]
            })
            .collect();
        let writes: Vec<_> = infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(info)
            })
            .collect();
        // SAFETY: the set and the buffers are live; nothing uses the set yet.
        unsafe { d.update_descriptor_sets(&writes, &[]) };
        let info = vk::CommandPoolCreateInfo::default().queue_family_index(ctx.queue_family());
        // SAFETY: as above.
        k.commands =
            unsafe { d.create_command_pool(&info, None) }.map_err(call("vkCreateCommandPool"))?;
        let info = vk::CommandBufferAllocateInfo::default()
            .command_pool(k.commands)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(1);
        // SAFETY: a live pool.
        k.command = unsafe { d.allocate_command_buffers(&info) }
            .map_err(call("vkAllocateCommandBuffers"))?[0];
        let info = vk::FenceCreateInfo::default().flags(vk::FenceCreateFlags::SIGNALED);
        // SAFETY: as above.
        k.fence = unsafe { d.create_fence(&info, None) }.map_err(call("vkCreateFence"))?;
        let c = k.command;
        let after_previous = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE)];
        let to_host = [vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::HOST_READ)];
        // SAFETY: `c` is a fresh primary command buffer of a pool of this device, recorded
        // once here and only submitted afterwards; every handle recorded is live.
        unsafe {
            // Host writes before a submission are visible to it (vkQueueSubmit's
            // implicit host-write dependency). A kernel that reads what its previous
            // submission wrote (the `pixels` stack shifting its frames) needs that
            // write made visible: submission order alone does not do it.
            d.begin_command_buffer(c, &vk::CommandBufferBeginInfo::default())
                .map_err(call("vkBeginCommandBuffer"))?;
            d.cmd_pipeline_barrier(
                c,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::DependencyFlags::empty(),
                &after_previous,
                &[],
                &[],
            );
            d.cmd_bind_pipeline(c, vk::PipelineBindPoint::COMPUTE, k.pipeline);
            d.cmd_bind_descriptor_sets(
                c,
                vk::PipelineBindPoint::COMPUTE,
                k.pipeline_layout,
                0,
                &[set],
                &[],
            );
            d.cmd_dispatch(c, groups[0], groups[1], groups[2]);
            d.cmd_pipeline_barrier(
                c,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::PipelineStageFlags::HOST,
                vk::DependencyFlags::empty(),
                &to_host,
                &[],
                &[],
            );
            d.end_command_buffer(c)
                .map_err(call("vkEndCommandBuffer"))?;
        }
        Ok(k)
    }

    /// Waits until the last submission completed (so its inputs may be rewritten).
    pub fn wait(&self) -> Result<()> {
        // SAFETY: a live fence of this device; waiting has no other requirement.
        unsafe {
            self.ctx
                .device()
                .wait_for_fences(&[self.fence], true, u64::MAX)
        }
        .map_err(call("vkWaitForFences"))
    }

    /// Submits the recorded dispatch to the context's queue, after the previous
    /// submission completed. Returns at once; the engine's publish waits for the queue.
    pub fn submit(&mut self) -> Result<()> {
        self.wait()?;
        let d = self.ctx.device();
        let fences = [self.fence];
        // SAFETY: the fence is signalled (waited above) and no submission uses it.
        unsafe { d.reset_fences(&fences) }.map_err(call("vkResetFences"))?;
        let commands = [self.command];
        let submit = [vk::SubmitInfo::default().command_buffers(&commands)];
        // SAFETY: the command buffer is recorded and not pending (its last submission's
        // fence was waited for); the queue is used from this thread only (`&mut self`,
        // and the engine's stepping thread is the one that renders and publishes).
        unsafe { d.queue_submit(self.ctx.queue(), &submit, self.fence) }
            .map_err(call("vkQueueSubmit"))
    }
}

impl Drop for ComputeKernel {
    fn drop(&mut self) {
        if !self.ctx.made_here() {
            return;
        }
        let d = self.ctx.device();
        // SAFETY: every non-null handle was made by this kernel on this device; the
        // fence wait (when a fence exists) ends the last submission that used them;
        // destroying a null handle is skipped.
        unsafe {
            if self.fence != vk::Fence::null() {
                let _ = d.wait_for_fences(&[self.fence], true, u64::MAX);
                d.destroy_fence(self.fence, None);
            }
            if self.commands != vk::CommandPool::null() {
                d.destroy_command_pool(self.commands, None);
            }
            if self.descriptors != vk::DescriptorPool::null() {
                d.destroy_descriptor_pool(self.descriptors, None);
            }
            if self.pipeline != vk::Pipeline::null() {
                d.destroy_pipeline(self.pipeline, None);
            }
            if self.pipeline_layout != vk::PipelineLayout::null() {
                d.destroy_pipeline_layout(self.pipeline_layout, None);
            }
            if self.set_layout != vk::DescriptorSetLayout::null() {
                d.destroy_descriptor_set_layout(self.set_layout, None);
            }
            if self.module != vk::ShaderModule::null() {
                d.destroy_shader_module(self.module, None);
            }
        }
    }
}
