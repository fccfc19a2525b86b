// CartPole frames for examples/c/vulkan_frames.c: one invocation per pixel of each env's
// RGBA8 frame, integer arithmetic only, so that a CPU reference reproduces every byte
// (tests/python/vulkan_frames.py). Compiled to SPIR-V by glslangValidator (Debian's
// glslang-tools) when the example is built:
//
//   glslangValidator -V --target-env vulkan1.1 --vn vulkan_frames_spv
//       -o vulkan_frames.spv.h examples/c/vulkan_frames.comp
#version 450

layout(local_size_x = 8, local_size_y = 8, local_size_z = 1) in;

// Per env: x = the cart's centre column, y = the pole tip's offset in columns from the
// pivot (computed by the host from the observation: vulkan_frames.c, cart_params).
layout(std430, set = 0, binding = 0) readonly buffer Params { ivec4 cart[]; };
// The frames, [num_envs][height][width] pixels, each RGBA8 read as a little-endian uint.
layout(std430, set = 0, binding = 1) writeonly buffer Frames { uint rgba[]; };
layout(push_constant) uniform Size { uint width; uint height; uint num_envs; } size;

const uint SKY = 0xFFFFFFFFu;   // (255, 255, 255, 255)
const uint TRACK = 0xFF000000u; // (0, 0, 0, 255)
const uint POLE = 0xFF6699CCu;  // (204, 153, 102, 255)
const uint CART = 0xFFC83C3Cu;  // (60, 60, 200, 255)

// a / b rounded down, b > 0 (GLSL's `/` rounds towards zero).
int floor_div(int a, int b) {
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

void main() {
    uvec3 id = gl_GlobalInvocationID;
    if (id.x >= size.width || id.y >= size.height || id.z >= size.num_envs) {
        return;
    }
    int x = int(id.x), y = int(id.y), w = int(size.width), h = int(size.height);
    ivec4 p = cart[id.z];
    int ground = h * 3 / 4;
    int cart_half_width = max(w / 16, 2);
    int pivot = ground - max(h / 10, 3);
    int pole_length = max(h * 2 / 5, 4);
    int pole_half_width = max(w / 64, 1);

    uint color = SKY;
    if (y == ground) {
        color = TRACK;
    }
    int above = pivot - y;  // rows above the pivot
    if (above >= 1 && above <= pole_length) {
        int centre = p.x + floor_div(p.y * above, pole_length);
        if (abs(x - centre) <= pole_half_width) {
            color = POLE;
        }
    }
    if (y >= pivot && y < ground && abs(x - p.x) <= cart_half_width) {
        color = CART;
    }
    rgba[(id.z * size.height + id.y) * size.width + id.x] = color;
}
