// `pixels` engine: renders each env's CartPole state into its RGBA8 frame, one invocation
// per pixel. Translated to SPIR-V by build.rs (naga); run by src/envs/pixels.rs through
// src/device/vulkan/vk.rs (`ComputeKernel`).
//
// Integer arithmetic only, so that any device computes the same bytes as the CPU
// reference (src/envs/pixels.rs `render_reference`, the same steps line for line): the
// host turns each env's f32 observation into fixed-point draw parameters (positions in
// 1/256 px, the pole's sine and cosine in 1/4096), and the picture is composed from
// exact area coverage (cart, track) and clamped distances (pole), each in 0..=256.
//
// `params` (i32): a header of HEADER words, then PER_ENV words per env.
//   header: [num_envs, height, width, PER_ENV, track_y, track_half, cart_half_w,
//            cart_half_h, pole_len, pole_half_w, 0...]   (lengths in 1/256 px)
//   env e:  [cart_x, axle_y, sin_q12, cos_q12]
// `frame` (u32): pixel (e, y, x) at e*height*width + y*width + x, RGBA little-endian.

const HEADER: u32 = 16u;

@group(0) @binding(0) var<storage, read> params: array<i32>;
@group(0) @binding(1) var<storage, read_write> frame: array<u32>;

// Overlap of [a0, a1) with [b0, b1), clamped to 0..=256 (both in 1/256 px).
fn overlap(a0: i32, a1: i32, b0: i32, b1: i32) -> i32 {
    return clamp(min(a1, b1) - max(a0, b0), 0, 256);
}

// `c` blended toward `fg` by `cov`/256, per channel (rgb packed in the low 24 bits).
fn blend(c: vec3<i32>, fg: vec3<i32>, cov: i32) -> vec3<i32> {
    return (c * (256 - cov) + fg * cov + vec3<i32>(128)) >> vec3<u32>(8u);
}

// Dispatched as a grid of (x, y) workgroups (a dimension holds at most 65535): pixel
// index i = gid.y * (groups.x * 64) + gid.x.
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let n = u32(params[0]);
    let h = u32(params[1]);
    let w = u32(params[2]);
    let per_env = u32(params[3]);
    let i = gid.y * groups.x * 64u + gid.x;
    if (i >= n * h * w) {
        return;
    }
    let env = i / (h * w);
    let y = i32((i / w) % h);
    let x = i32(i % w);
    let track_y = params[4];
    let track_half = params[5];
    let cart_half_w = params[6];
    let cart_half_h = params[7];
    let pole_len = params[8];
    let pole_half_w = params[9];
    let base = HEADER + env * per_env;
    let cart_x = params[base];
    let axle_y = params[base + 1u];
    let s = params[base + 2u];
    let c = params[base + 3u];

    // The pixel's square, in 1/256 px.
    let px0 = x * 256;
    let py0 = y * 256;

    var color = vec3<i32>(255, 255, 255);
    // Track: a horizontal band across the frame.
    let track = overlap(py0, py0 + 256, track_y - track_half, track_y + track_half);
    color = blend(color, vec3<i32>(0, 0, 0), track);
    // Cart: an axis-aligned rectangle centred on (cart_x, track_y).
    let cart_x_cov = overlap(px0, px0 + 256, cart_x - cart_half_w, cart_x + cart_half_w);
    let cart_y_cov = overlap(py0, py0 + 256, track_y - cart_half_h, track_y + cart_half_h);
    color = blend(color, vec3<i32>(40, 40, 40), (cart_x_cov * cart_y_cov) >> 8u);
    // Pole: a bar from the axle along (sin, -cos), clamped distances from its axis and
    // its two ends (the pixel centre against the bar, widened by half a pixel).
    let rx = px0 + 128 - cart_x;
    let ry = py0 + 128 - axle_y;
    let along = (rx * s - ry * c) >> 12u;
    let across = abs(rx * c + ry * s) >> 12u;
    let side = clamp(pole_half_w + 128 - across, 0, 256);
    let ends = clamp(min(along, pole_len - along) + 128, 0, 256);
    color = blend(color, vec3<i32>(202, 152, 101), (side * ends) >> 8u);
    // Axle: a square at the pole's base.
    let axle_x_cov = overlap(px0, px0 + 256, cart_x - pole_half_w, cart_x + pole_half_w);
    let axle_y_cov = overlap(py0, py0 + 256, axle_y - pole_half_w, axle_y + pole_half_w);
    color = blend(color, vec3<i32>(129, 132, 203), (axle_x_cov * axle_y_cov) >> 8u);

    frame[i] = u32(color.x) | (u32(color.y) << 8u) | (u32(color.z) << 16u) | (255u << 24u);
}
