/* vulkan_frames: a renderer of its own, as a simulator has one. It creates its own
 * Vulkan device, allocates memory it can export (VK_KHR_external_memory_fd, OPAQUE_FD),
 * and draws each env's CartPole frame into it on the device with a compute shader
 * (vulkan_frames.comp). vf_export hands that memory to shmbridge
 * (shmb_spec_add_vulkan_export): a learner then reads the frames where the shader wrote
 * them, with no copy.
 *
 * Used by examples/c/vulkan_engine.c, and by the C# engine examples/csharp/
 * VulkanCartPoleEngine.cs through P/Invoke (built as libvulkan_frames.so).
 *
 * Frames: RGBA8, [num_envs][height][width][4]; what each pixel is, in vulkan_frames.comp;
 * tests/python/vulkan_frames.py computes the same bytes on the CPU. */
#ifndef VULKAN_FRAMES_H
#define VULKAN_FRAMES_H

#include <stdint.h>

#include "shmbridge.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct vf_renderer vf_renderer;

/* Opens a Vulkan device that can export memory as an fd (a GPU before a CPU driver),
 * allocates the frames of `num_envs` envs of height x width pixels (8..4096 each) in
 * memory made for export, and builds the pipeline. NULL on failure: vf_error() says why;
 * without a Vulkan driver its message starts with "Vulkan is unavailable". */
vf_renderer *vf_create(uint32_t num_envs, uint32_t height, uint32_t width);

/* The message of this thread's last failure ("" before any). */
const char *vf_error(void);

/* Exports the frames' memory: *memory_fd a new fd of it (vkGetMemoryFdKHR, owned by the
 * caller), *exported what shmb_spec_add_vulkan_export needs: the allocation's size,
 * where the frames lie in it, its memory type, that it is a dedicated allocation, and
 * the device's UUIDs. 0 on success, -1 on failure (vf_error). */
int vf_export(vf_renderer *r, int32_t *memory_fd, shmb_vulkan_export *exported);

/* Draws every env's frame from its CartPole observation (obs[4 * env + 0] the cart's
 * position, obs[4 * env + 2] the pole's angle) and waits until the device has written
 * it: once this returns, the frame may be published. 0 on success, -1 on failure. */
int vf_draw(vf_renderer *r, const float *obs);

/* The frames, mapped in this process (the memory is host-visible), for an engine that
 * copies them into host shared memory instead of exporting them; NULL if not mapped. */
const void *vf_frames(const vf_renderer *r);

/* The frames' size in bytes: num_envs * height * width * 4. */
uint64_t vf_frames_bytes(const vf_renderer *r);

/* The Vulkan device's name (vkGetPhysicalDeviceProperties), e.g. "llvmpipe (LLVM 15.0.6, 256 bits)". */
const char *vf_device_name(const vf_renderer *r);

/* Waits for the device, frees the memory and destroys the device. NULL: nothing. */
void vf_destroy(vf_renderer *r);

#ifdef __cplusplus
}
#endif

#endif
