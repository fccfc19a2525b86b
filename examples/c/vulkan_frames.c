/* vulkan_frames: CartPole frames drawn by a Vulkan compute shader into memory this
 * process exports (see vulkan_frames.h). Needs the Vulkan headers and loader
 * (Debian: libvulkan-dev) and the shader compiled to SPIR-V as a C array
 * (vulkan_frames.spv.h, by glslangValidator: the command is in vulkan_frames.comp).
 *
 * One dedicated allocation, exported as OPAQUE_FD, holds the per-env drawing parameters
 * the host writes each frame, then (at a 256-byte aligned offset) the frames the shader
 * writes: the tensor shmbridge hands over is the second part, so its `offset` is not 0.
 * The memory is host-visible (so the host writes the parameters in place and a client
 * without CUDA maps it); a renderer on a discrete GPU would rather keep its frames in
 * device-local memory and upload its parameters through a staging buffer. */
#include "vulkan_frames.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vulkan/vulkan.h>

#include "vulkan_frames.spv.h"

struct vf_renderer {
    uint32_t num_envs, height, width;
    VkInstance instance;
    VkPhysicalDevice physical;
    VkDevice device;
    VkQueue queue;
    uint32_t queue_family;
    VkBuffer buffer;
    VkDeviceMemory memory;
    uint64_t alloc_size, params_bytes, frames_offset, frames_bytes;
    uint32_t memory_type_index;
    uint8_t *mapped;
    uint8_t device_uuid[VK_UUID_SIZE], driver_uuid[VK_UUID_SIZE];
    char name[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE];
    VkShaderModule shader;
    VkDescriptorSetLayout set_layout;
    VkPipelineLayout pipeline_layout;
    VkPipeline pipeline;
    VkDescriptorPool pool;
    VkCommandPool commands;
    VkCommandBuffer cmd;
    VkFence fence;
    PFN_vkGetMemoryFdKHR get_memory_fd;
};

static _Thread_local char error_text[512];

static void set_error(const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error_text, sizeof error_text, format, args);
    va_end(args);
}

const char *vf_error(void) { return error_text; }

#define VK(call)                                                                     \
    do {                                                                             \
        VkResult vk_result_ = (call);                                                \
        if (vk_result_ != VK_SUCCESS) {                                              \
            set_error("%s failed: VkResult %d", #call, (int)vk_result_);             \
            goto fail;                                                               \
        }                                                                            \
    } while (0)

static int has_extension(VkPhysicalDevice pd, const char *wanted) {
    uint32_t n = 0;
    if (vkEnumerateDeviceExtensionProperties(pd, NULL, &n, NULL) != VK_SUCCESS) return 0;
    VkExtensionProperties *exts = calloc(n ? n : 1, sizeof *exts);
    if (!exts) return 0;
    int found = 0;
    if (vkEnumerateDeviceExtensionProperties(pd, NULL, &n, exts) == VK_SUCCESS)
        for (uint32_t i = 0; i < n && !found; i++)
            found = strcmp(exts[i].extensionName, wanted) == 0;
    free(exts);
    return found;
}

/* A queue family with compute, or -1. */
static int compute_family(VkPhysicalDevice pd) {
    uint32_t n = 0;
    vkGetPhysicalDeviceQueueFamilyProperties(pd, &n, NULL);
    VkQueueFamilyProperties *families = calloc(n ? n : 1, sizeof *families);
    if (!families) return -1;
    vkGetPhysicalDeviceQueueFamilyProperties(pd, &n, families);
    int found = -1;
    for (uint32_t i = 0; i < n && found < 0; i++)
        if (families[i].queueFlags & VK_QUEUE_COMPUTE_BIT) found = (int)i;
    free(families);
    return found;
}

/* Lower is better: a GPU before a CPU driver such as lavapipe. */
static int device_rank(VkPhysicalDeviceType type) {
    switch (type) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return 0;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return 1;
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return 2;
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return 4;
    default: return 3;
    }
}

static int pick_device(vf_renderer *r) {
    uint32_t n = 0;
    VK(vkEnumeratePhysicalDevices(r->instance, &n, NULL));
    VkPhysicalDevice *all = calloc(n ? n : 1, sizeof *all);
    if (!all) {
        set_error("out of memory");
        return -1;
    }
    if (vkEnumeratePhysicalDevices(r->instance, &n, all) != VK_SUCCESS) n = 0;
    int best_rank = 99;
    for (uint32_t i = 0; i < n; i++) {
        VkPhysicalDeviceProperties p;
        vkGetPhysicalDeviceProperties(all[i], &p);
        int family = compute_family(all[i]);
        if (p.apiVersion < VK_API_VERSION_1_1 || family < 0 ||
            !has_extension(all[i], VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME))
            continue;
        if (device_rank(p.deviceType) < best_rank) {
            best_rank = device_rank(p.deviceType);
            r->physical = all[i];
            r->queue_family = (uint32_t)family;
        }
    }
    free(all);
    if (best_rank == 99) {
        set_error("Vulkan is unavailable: none of the %u device(s) has %s and a compute queue",
                  n, VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME);
        return -1;
    }
    VkPhysicalDeviceIDProperties ids = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES};
    VkPhysicalDeviceProperties2 props = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                         .pNext = &ids};
    vkGetPhysicalDeviceProperties2(r->physical, &props);
    memcpy(r->device_uuid, ids.deviceUUID, VK_UUID_SIZE);
    memcpy(r->driver_uuid, ids.driverUUID, VK_UUID_SIZE);
    snprintf(r->name, sizeof r->name, "%s", props.properties.deviceName);
    return 0;
fail:
    return -1;
}

static VkResult make_buffer(vf_renderer *r, VkDeviceSize size) {
    VkExternalMemoryBufferCreateInfo external = {
        .sType = VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO,
        .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT,
    };
    VkBufferCreateInfo info = {
        .sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
        .pNext = &external,
        .size = size,
        .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT,
        .sharingMode = VK_SHARING_MODE_EXCLUSIVE,
    };
    return vkCreateBuffer(r->device, &info, NULL, &r->buffer);
}

/* The exported allocation: one buffer over all of it, in a dedicated allocation of
 * host-visible, coherent memory (device-local too if the device has such). */
static int allocate(vf_renderer *r) {
    VkPhysicalDeviceProperties p;
    vkGetPhysicalDeviceProperties(r->physical, &p);
    uint64_t align = p.limits.minStorageBufferOffsetAlignment;
    if (align < 256) align = 256;
    r->params_bytes = 16ull * r->num_envs;
    r->frames_offset = (r->params_bytes + align - 1) / align * align;
    r->frames_bytes = 4ull * r->num_envs * r->height * r->width;
    uint64_t needed = r->frames_offset + r->frames_bytes;
    VK(make_buffer(r, needed));
    VkMemoryRequirements req;
    vkGetBufferMemoryRequirements(r->device, r->buffer, &req);
    if (req.size != needed) {
        /* The buffer spans the whole allocation, so that an importer that repeats the
         * dedicated allocation with a buffer of `alloc_size` bytes can. */
        vkDestroyBuffer(r->device, r->buffer, NULL);
        r->buffer = VK_NULL_HANDLE;
        VK(make_buffer(r, req.size));
        VkDeviceSize size = req.size;
        vkGetBufferMemoryRequirements(r->device, r->buffer, &req);
        if (req.size != size) {
            set_error("a buffer of %llu bytes needs %llu bytes", (unsigned long long)size,
                      (unsigned long long)req.size);
            return -1;
        }
    }
    VkPhysicalDeviceMemoryProperties memory;
    vkGetPhysicalDeviceMemoryProperties(r->physical, &memory);
    const VkMemoryPropertyFlags host =
        VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    const VkMemoryPropertyFlags preference[2] = {host | VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, host};
    int type = -1;
    for (int k = 0; k < 2 && type < 0; k++)
        for (uint32_t i = 0; i < memory.memoryTypeCount && type < 0; i++)
            if ((req.memoryTypeBits & (1u << i)) &&
                (memory.memoryTypes[i].propertyFlags & preference[k]) == preference[k])
                type = (int)i;
    if (type < 0) {
        set_error("no host-visible, coherent memory type of %s fits the frames", r->name);
        return -1;
    }
    r->memory_type_index = (uint32_t)type;
    r->alloc_size = req.size;
    VkExportMemoryAllocateInfo export_info = {
        .sType = VK_STRUCTURE_TYPE_EXPORT_MEMORY_ALLOCATE_INFO,
        .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT,
    };
    VkMemoryDedicatedAllocateInfo dedicated = {
        .sType = VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO,
        .pNext = &export_info,
        .buffer = r->buffer,
    };
    VkMemoryAllocateInfo info = {
        .sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
        .pNext = &dedicated,
        .allocationSize = r->alloc_size,
        .memoryTypeIndex = r->memory_type_index,
    };
    VK(vkAllocateMemory(r->device, &info, NULL, &r->memory));
    VK(vkBindBufferMemory(r->device, r->buffer, r->memory, 0));
    void *mapped = NULL;
    VK(vkMapMemory(r->device, r->memory, 0, VK_WHOLE_SIZE, 0, &mapped));
    r->mapped = mapped;
    return 0;
fail:
    return -1;
}

/* The compute pipeline, its descriptors over the two parts of the buffer, and one
 * command buffer recorded once: each frame only its parameters change. */
static int build_pipeline(vf_renderer *r) {
    VkShaderModuleCreateInfo module = {
        .sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
        .codeSize = sizeof vulkan_frames_spv,
        .pCode = vulkan_frames_spv,
    };
    VK(vkCreateShaderModule(r->device, &module, NULL, &r->shader));
    VkDescriptorSetLayoutBinding bindings[2];
    for (uint32_t b = 0; b < 2; b++)
        bindings[b] = (VkDescriptorSetLayoutBinding){
            .binding = b,
            .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
            .descriptorCount = 1,
            .stageFlags = VK_SHADER_STAGE_COMPUTE_BIT,
        };
    VkDescriptorSetLayoutCreateInfo set_info = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
        .bindingCount = 2,
        .pBindings = bindings,
    };
    VK(vkCreateDescriptorSetLayout(r->device, &set_info, NULL, &r->set_layout));
    VkPushConstantRange push = {.stageFlags = VK_SHADER_STAGE_COMPUTE_BIT, .size = 12};
    VkPipelineLayoutCreateInfo layout_info = {
        .sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
        .setLayoutCount = 1,
        .pSetLayouts = &r->set_layout,
        .pushConstantRangeCount = 1,
        .pPushConstantRanges = &push,
    };
    VK(vkCreatePipelineLayout(r->device, &layout_info, NULL, &r->pipeline_layout));
    VkComputePipelineCreateInfo pipeline_info = {
        .sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                  .stage = VK_SHADER_STAGE_COMPUTE_BIT,
                  .module = r->shader,
                  .pName = "main"},
        .layout = r->pipeline_layout,
    };
    VK(vkCreateComputePipelines(r->device, VK_NULL_HANDLE, 1, &pipeline_info, NULL,
                                &r->pipeline));

    VkDescriptorPoolSize sizes = {.type = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, .descriptorCount = 2};
    VkDescriptorPoolCreateInfo pool_info = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
        .maxSets = 1,
        .poolSizeCount = 1,
        .pPoolSizes = &sizes,
    };
    VK(vkCreateDescriptorPool(r->device, &pool_info, NULL, &r->pool));
    VkDescriptorSet set;
    VkDescriptorSetAllocateInfo set_alloc = {
        .sType = VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
        .descriptorPool = r->pool,
        .descriptorSetCount = 1,
        .pSetLayouts = &r->set_layout,
    };
    VK(vkAllocateDescriptorSets(r->device, &set_alloc, &set));
    VkDescriptorBufferInfo parts[2] = {
        {.buffer = r->buffer, .offset = 0, .range = r->params_bytes},
        {.buffer = r->buffer, .offset = r->frames_offset, .range = r->frames_bytes},
    };
    VkWriteDescriptorSet writes[2];
    for (uint32_t b = 0; b < 2; b++)
        writes[b] = (VkWriteDescriptorSet){
            .sType = VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
            .dstSet = set,
            .dstBinding = b,
            .descriptorCount = 1,
            .descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
            .pBufferInfo = &parts[b],
        };
    vkUpdateDescriptorSets(r->device, 2, writes, 0, NULL);

    VkCommandPoolCreateInfo pool = {
        .sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
        .queueFamilyIndex = r->queue_family,
    };
    VK(vkCreateCommandPool(r->device, &pool, NULL, &r->commands));
    VkCommandBufferAllocateInfo cmd_alloc = {
        .sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
        .commandPool = r->commands,
        .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
        .commandBufferCount = 1,
    };
    VK(vkAllocateCommandBuffers(r->device, &cmd_alloc, &r->cmd));
    VkCommandBufferBeginInfo begin = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
    VK(vkBeginCommandBuffer(r->cmd, &begin));
    /* The host's parameter writes (made available by the submission) before the shader
     * reads them; the shader's frame writes before any host read, in this process or
     * in a client's mapping of the same memory. */
    VkMemoryBarrier before = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                              .srcAccessMask = VK_ACCESS_HOST_WRITE_BIT,
                              .dstAccessMask = VK_ACCESS_SHADER_READ_BIT};
    vkCmdPipelineBarrier(r->cmd, VK_PIPELINE_STAGE_HOST_BIT, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                         0, 1, &before, 0, NULL, 0, NULL);
    vkCmdBindPipeline(r->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, r->pipeline);
    vkCmdBindDescriptorSets(r->cmd, VK_PIPELINE_BIND_POINT_COMPUTE, r->pipeline_layout, 0, 1,
                            &set, 0, NULL);
    uint32_t size[3] = {r->width, r->height, r->num_envs};
    vkCmdPushConstants(r->cmd, r->pipeline_layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, sizeof size,
                       size);
    vkCmdDispatch(r->cmd, (r->width + 7) / 8, (r->height + 7) / 8, r->num_envs);
    VkMemoryBarrier after = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                             .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT,
                             .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
    vkCmdPipelineBarrier(r->cmd, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, VK_PIPELINE_STAGE_HOST_BIT,
                         0, 1, &after, 0, NULL, 0, NULL);
    VK(vkEndCommandBuffer(r->cmd));
    VkFenceCreateInfo fence = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    VK(vkCreateFence(r->device, &fence, NULL, &r->fence));
    return 0;
fail:
    return -1;
}

vf_renderer *vf_create(uint32_t num_envs, uint32_t height, uint32_t width) {
    if (num_envs < 1 || num_envs > 65535 || height < 8 || height > 4096 || width < 8 ||
        width > 4096 || (uint64_t)num_envs * height * width > (1ull << 28)) {
        set_error("frames of %u envs of %ux%u pixels: 1..65535 envs of 8..4096 pixels a side, "
                  "at most 2^28 pixels in all",
                  num_envs, height, width);
        return NULL;
    }
    vf_renderer *r = calloc(1, sizeof *r);
    if (!r) {
        set_error("out of memory");
        return NULL;
    }
    r->num_envs = num_envs;
    r->height = height;
    r->width = width;
    VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
                             .pApplicationName = "vulkan_frames",
                             .apiVersion = VK_API_VERSION_1_1};
    VkInstanceCreateInfo instance = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                     .pApplicationInfo = &app};
    VkResult created = vkCreateInstance(&instance, NULL, &r->instance);
    if (created != VK_SUCCESS) {
        set_error("Vulkan is unavailable: no Vulkan driver (vkCreateInstance gave %d; Debian's "
                  "mesa-vulkan-drivers has the CPU driver lavapipe)",
                  (int)created);
        r->instance = VK_NULL_HANDLE;
        goto fail;
    }
    if (pick_device(r) != 0) goto fail;
    float priority = 1.0f;
    VkDeviceQueueCreateInfo queue = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                     .queueFamilyIndex = r->queue_family,
                                     .queueCount = 1,
                                     .pQueuePriorities = &priority};
    const char *extensions[] = {VK_KHR_EXTERNAL_MEMORY_FD_EXTENSION_NAME};
    VkDeviceCreateInfo device = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                                 .queueCreateInfoCount = 1,
                                 .pQueueCreateInfos = &queue,
                                 .enabledExtensionCount = 1,
                                 .ppEnabledExtensionNames = extensions};
    VK(vkCreateDevice(r->physical, &device, NULL, &r->device));
    vkGetDeviceQueue(r->device, r->queue_family, 0, &r->queue);
    r->get_memory_fd = (PFN_vkGetMemoryFdKHR)vkGetDeviceProcAddr(r->device, "vkGetMemoryFdKHR");
    if (!r->get_memory_fd) {
        set_error("vkGetMemoryFdKHR is missing on %s", r->name);
        goto fail;
    }
    if (allocate(r) != 0 || build_pipeline(r) != 0) goto fail;
    return r;
fail:
    vf_destroy(r);
    return NULL;
}

int vf_export(vf_renderer *r, int32_t *memory_fd, shmb_vulkan_export *exported) {
    if (!r || !memory_fd || !exported) {
        set_error("vf_export: a NULL argument");
        return -1;
    }
    VkMemoryGetFdInfoKHR info = {.sType = VK_STRUCTURE_TYPE_MEMORY_GET_FD_INFO_KHR,
                                 .memory = r->memory,
                                 .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD_BIT};
    int fd = -1;
    VK(r->get_memory_fd(r->device, &info, &fd));
    *memory_fd = fd;
    memset(exported, 0, sizeof *exported);
    exported->alloc_size = r->alloc_size;
    exported->offset = r->frames_offset;
    exported->memory_type_index = r->memory_type_index;
    exported->dedicated = 1;
    memcpy(exported->device_uuid, r->device_uuid, sizeof exported->device_uuid);
    memcpy(exported->driver_uuid, r->driver_uuid, sizeof exported->driver_uuid);
    return 0;
fail:
    return -1;
}

/* floor(v) clamped to [lo, hi]; NaN draws as 0. tests/python/vulkan_frames.py does the
 * same in float64 (no fused multiply-add here: build with -ffp-contract=off). */
static int32_t clamp_floor(double v, int32_t lo, int32_t hi) {
    if (v != v) return 0;
    double f = floor(v);
    if (f < lo) return lo;
    if (f > hi) return hi;
    return (int32_t)f;
}

int vf_draw(vf_renderer *r, const float *obs) {
    if (!r || !obs) {
        set_error("vf_draw: a NULL argument");
        return -1;
    }
    int32_t w = (int32_t)r->width, h = (int32_t)r->height;
    int32_t pole_length = h * 2 / 5 > 4 ? h * 2 / 5 : 4;
    int32_t *params = (int32_t *)r->mapped;
    for (uint32_t e = 0; e < r->num_envs; e++) {
        /* Gymnasium's picture: 4.8 m across the frame; the pole leans by its angle in
         * radians times its length (a small-angle picture: no trigonometry, so the CPU
         * reference matches bit for bit). */
        params[4 * e + 0] = w / 2 + clamp_floor((double)obs[4 * e] * ((double)w / 4.8), -w, w);
        params[4 * e + 1] =
            clamp_floor((double)obs[4 * e + 2] * (double)pole_length, -2 * pole_length,
                        2 * pole_length);
        params[4 * e + 2] = 0;
        params[4 * e + 3] = 0;
    }
    VkSubmitInfo submit = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO,
                           .commandBufferCount = 1,
                           .pCommandBuffers = &r->cmd};
    VK(vkQueueSubmit(r->queue, 1, &submit, r->fence));
    VK(vkWaitForFences(r->device, 1, &r->fence, VK_TRUE, UINT64_MAX));
    VK(vkResetFences(r->device, 1, &r->fence));
    return 0;
fail:
    return -1;
}

const void *vf_frames(const vf_renderer *r) {
    return r && r->mapped ? r->mapped + r->frames_offset : NULL;
}

uint64_t vf_frames_bytes(const vf_renderer *r) { return r ? r->frames_bytes : 0; }

const char *vf_device_name(const vf_renderer *r) { return r ? r->name : ""; }

void vf_destroy(vf_renderer *r) {
    if (!r) return;
    if (r->device) {
        vkDeviceWaitIdle(r->device);
        if (r->fence) vkDestroyFence(r->device, r->fence, NULL);
        if (r->commands) vkDestroyCommandPool(r->device, r->commands, NULL);
        if (r->pool) vkDestroyDescriptorPool(r->device, r->pool, NULL);
        if (r->pipeline) vkDestroyPipeline(r->device, r->pipeline, NULL);
        if (r->pipeline_layout) vkDestroyPipelineLayout(r->device, r->pipeline_layout, NULL);
        if (r->set_layout) vkDestroyDescriptorSetLayout(r->device, r->set_layout, NULL);
        if (r->shader) vkDestroyShaderModule(r->device, r->shader, NULL);
        if (r->mapped) vkUnmapMemory(r->device, r->memory);
        if (r->buffer) vkDestroyBuffer(r->device, r->buffer, NULL);
        if (r->memory) vkFreeMemory(r->device, r->memory, NULL);
        vkDestroyDevice(r->device, NULL);
    }
    if (r->instance) vkDestroyInstance(r->instance, NULL);
    free(r);
}
