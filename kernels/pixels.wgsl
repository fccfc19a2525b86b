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

// One env's draw parameters (the header's and its own), read once per invocation.
struct Scene {
    track_y: i32,
    track_half: i32,
    cart_half_w: i32,
    cart_half_h: i32,
    pole_len: i32,
    pole_half_w: i32,
    cart_x: i32,
    axle_y: i32,
    s: i32,
    c: i32,
}

// The colour of pixel `pixel` (row-major in a frame `w` wide) of scene `e`.
fn shade(pixel: u32, w: u32, e: Scene) -> vec3<i32> {
    let row = row_of(pixel, w);
    let x = i32(pixel - row * w);
    let y = i32(row);
    // The pixel's square, in 1/256 px.
    let px0 = x * 256;
    let py0 = y * 256;

    var color = vec3<i32>(255, 255, 255);
    // Track: a horizontal band across the frame.
    let track = overlap(py0, py0 + 256, e.track_y - e.track_half, e.track_y + e.track_half);
    color = blend(color, vec3<i32>(0, 0, 0), track);
    // Cart: an axis-aligned rectangle centred on (cart_x, track_y).
    let cart_x_cov = overlap(px0, px0 + 256, e.cart_x - e.cart_half_w, e.cart_x + e.cart_half_w);
    let cart_y_cov = overlap(py0, py0 + 256, e.track_y - e.cart_half_h, e.track_y + e.cart_half_h);
    color = blend(color, vec3<i32>(40, 40, 40), (cart_x_cov * cart_y_cov) >> 8u);
    // Pole: a bar from the axle along (sin, -cos), clamped distances from its axis and
    // its two ends (the pixel centre against the bar, widened by half a pixel).
    let rx = px0 + 128 - e.cart_x;
    let ry = py0 + 128 - e.axle_y;
    let along = (rx * e.s - ry * e.c) >> 12u;
    let across = abs(rx * e.c + ry * e.s) >> 12u;
    let side = clamp(e.pole_half_w + 128 - across, 0, 256);
    let ends = clamp(min(along, e.pole_len - along) + 128, 0, 256);
    color = blend(color, vec3<i32>(202, 152, 101), (side * ends) >> 8u);
    // Axle: a square at the pole's base.
    let axle_x_cov = overlap(px0, px0 + 256, e.cart_x - e.pole_half_w, e.cart_x + e.pole_half_w);
    let axle_y_cov = overlap(py0, py0 + 256, e.axle_y - e.pole_half_w, e.axle_y + e.pole_half_w);
    return blend(color, vec3<i32>(129, 132, 203), (axle_x_cov * axle_y_cov) >> 8u);
}

// The grey value of a colour: its luma, in integers.
fn luma(c: vec3<i32>) -> u32 {
    return u32((77 * c.x + 150 * c.y + 29 * c.z + 128) >> 8u);
}

// Channel `ch` (0, 1 or 2) of a colour, without indexing a vector by a variable (which a
// CPU driver may do through memory).
fn pick(c: vec3<i32>, ch: u32) -> u32 {
    return u32(select(select(c.z, c.y, ch == 1u), c.x, ch == 0u));
}

// Words each invocation draws (a CPU driver such as lavapipe pays a fixed cost per
// invocation that dwarfs drawing one word).
const WORDS_PER_INVOCATION: u32 = 8u;

// Dispatched as a grid of (x, y, z) workgroups (a dimension holds at most 65535): x
// covers the words of one frame, each invocation WORDS_PER_INVOCATION of them (word q,
// q + stride, ...: neighbouring invocations write neighbouring words), y and z the envs
// (env = gid.z * groups.y + gid.y), so no index needs a division.
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
    let env = gid.z * groups.y + gid.y;
    if (env >= n) {
        return;
    }
    let base = HEADER + env * per_env;
    let update = params[base + 4u];
    if (update == 2) {
        return;
    }
    let e = Scene(params[6], params[7], params[8], params[9], params[10], params[11],
                  params[base], params[base + 1u], params[base + 2u], params[base + 3u]);
    let stride = groups.x * 64u;
    for (var t = 0u; t < WORDS_PER_INVOCATION; t++) {
        let q = gid.x + t * stride;
        if (q >= words) {
            return;
        }
        let word = draw_word(q, w, channels, e);
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
}

// Word q of a frame: its bytes 4q to 4q + 3.
fn draw_word(q: u32, w: u32, channels: u32, e: Scene) -> u32 {
    if (channels == 4u) {
        // One pixel, RGBA.
        let c = shade(q, w, e);
        return u32(c.x) | (u32(c.y) << 8u) | (u32(c.z) << 16u) | (255u << 24u);
    }
    if (channels == 1u) {
        // Four pixels, grey.
        return luma(shade(4u * q, w, e)) | (luma(shade(4u * q + 1u, w, e)) << 8u)
            | (luma(shade(4u * q + 2u, w, e)) << 16u) | (luma(shade(4u * q + 3u, w, e)) << 24u);
    }
    // RGB: the bytes from channel r of pixel p on, into pixel p + 1 (4 bytes span two
    // pixels of 3).
    let p = (4u * q) / 3u;
    let r = 4u * q - 3u * p;
    let a = shade(p, w, e);
    let b = shade(p + 1u, w, e);
    var word = 0u;
    for (var k = 0u; k < 4u; k++) {
        let at = r + k;
        let v = select(pick(b, at - 3u), pick(a, at), at < 3u);
        word = word | (v << (8u * k));
    }
    return word;
}
