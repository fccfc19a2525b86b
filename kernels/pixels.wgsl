// `pixels` engine: advances each env's stack of frames by one frame and draws the new
// one from the env's CartPole state, one invocation per 32-bit word of a frame.
// Translated to SPIR-V by build.rs (naga); run by src/envs/pixels.rs through
// src/device/vulkan/vk.rs (`ComputeKernel`).
//
// Integer arithmetic only, so that any device computes the same bytes as the CPU
// reference (src/envs/pixels.rs `render_reference`, the same steps line for line): the
// host turns each env's f32 observation into fixed-point draw parameters (positions in
// 1/256 px, the pole's sine and cosine in 1/4096), and the picture is composed from
// exact area coverage (cart, track, axle) and clamped distances (pole), each in
// 0..=256, blended with rounding. Signed overflow wraps on both sides, `>>` of an i32
// is arithmetic on both sides; nothing is divided but unsigned indices.
//
// `params` (i32): a header of HEADER words, then PER_ENV words per env.
//   header: [num_envs, height, width, channels, stack, PER_ENV, track_y, track_half,
//            cart_half_w, cart_half_h, pole_len, pole_half_w, 0...] (lengths in 1/256 px)
//   env e:  [cart_x, axle_y, sin_q12, cos_q12, update]
// `frame` (u32): the bytes of [num_envs, stack, height, width, channels] u8, four to a
// word, little-endian; height * width * channels is a multiple of 4, so a word never
// straddles two frames. channels: 4 RGBA (alpha 255), 3 RGB, 1 grey (the luma of RGB).
// `update` says what the new frame does to the env's stack: 0 (a step) every slot takes
// the next slot's word (the oldest frame goes) and the last slot gets the new frame; 1
// (its episode starts here) every slot gets the new frame; 2 (a reset of other envs)
// nothing. Each invocation reads and writes only its own word of each slot.

const HEADER: u32 = 16u;

@group(0) @binding(0) var<storage, read> params: array<i32>;
@group(0) @binding(1) var<storage, read_write> frame: array<u32>;

// Overlap of [a0, a1) with [b0, b1), clamped to 0..=256 (both in 1/256 px).
fn overlap(a0: i32, a1: i32, b0: i32, b1: i32) -> i32 {
    return clamp(min(a1, b1) - max(a0, b0), 0, 256);
}

// `c` blended toward `fg` by `cov`/256, per channel.
fn blend(c: vec3<i32>, fg: vec3<i32>, cov: i32) -> vec3<i32> {
    return (c * (256 - cov) + fg * cov + vec3<i32>(128)) >> vec3<u32>(8u);
}

// floor(pixel / w), exactly, without an integer division (which a CPU driver such as
// lavapipe runs one lane at a time): a float estimate, off by at most one on any device
// (pixel < 2^20 is exact in f32, and Vulkan's division is within 2.5 ulp), corrected in
// integers.
fn row_of(pixel: u32, w: u32) -> u32 {
    var y = u32(f32(pixel) / f32(w));
    if (y * w > pixel) {
        y -= 1u;
    }
    if ((y + 1u) * w <= pixel) {
        y += 1u;
    }
    return y;
}

// The colour of pixel `pixel` (row-major in a frame `w` wide) of the env whose
// parameters start at `base`.
fn shade(pixel: u32, w: u32, base: u32) -> vec3<i32> {
    let row = row_of(pixel, w);
    let x = i32(pixel - row * w);
    let y = i32(row);
    let track_y = params[6];
    let track_half = params[7];
    let cart_half_w = params[8];
    let cart_half_h = params[9];
    let pole_len = params[10];
    let pole_half_w = params[11];
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
    return blend(color, vec3<i32>(129, 132, 203), (axle_x_cov * axle_y_cov) >> 8u);
}

// Byte `ch` of a pixel of colour `color` with `channels` channels.
fn channel(color: vec3<i32>, ch: u32, channels: u32) -> u32 {
    if (channels == 1u) {
        return u32((77 * color.x + 150 * color.y + 29 * color.z + 128) >> 8u);
    }
    if (ch == 3u) {
        return 255u;
    }
    return u32(color[ch]);
}

// Dispatched as a grid of (x, y, z) workgroups (a dimension holds at most 65535): x
// covers the words of one frame, y and z the envs (env = gid.z * groups.y + gid.y), so
// no index needs a division.
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let n = u32(params[0]);
    let h = u32(params[1]);
    let w = u32(params[2]);
    let channels = u32(params[3]);
    let stack = u32(params[4]);
    let per_env = u32(params[5]);
    let words = h * w * channels / 4u;
    let q = gid.x;
    let env = gid.z * groups.y + gid.y;
    if (q >= words || env >= n) {
        return;
    }
    let base = HEADER + env * per_env;
    let update = params[base + 4u];
    if (update == 2) {
        return;
    }

    // The four bytes of word q: byte 4q + b is channel ch of pixel `pixel`.
    var word = 0u;
    var last = 0xffffffffu;
    var color = vec3<i32>(0);
    for (var b = 0u; b < 4u; b++) {
        var pixel = q;
        var ch = b;
        if (channels == 1u) {
            pixel = 4u * q + b;
            ch = 0u;
        } else if (channels == 3u) {
            pixel = (4u * q + b) / 3u;
            ch = 4u * q + b - 3u * pixel;
        }
        if (pixel != last) {
            color = shade(pixel, w, base);
            last = pixel;
        }
        word = word | (channel(color, ch, channels) << (8u * b));
    }

    let first = env * stack * words + q;
    for (var j = 0u; j + 1u < stack; j++) {
        let at = first + j * words;
        if (update == 1) {
            frame[at] = word;
        } else {
            frame[at] = frame[at + words];
        }
    }
    frame[first + (stack - 1u) * words] = word;
}
