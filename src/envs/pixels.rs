//! `pixels`: CartPole stepped as `cartpole` does, each env's state drawn (track, cart,
//! pole, axle) into a stack of its last `k` frames, `rgb [N, k, H, W, C]` u8 (`C`: 4 RGBA,
//! 3 RGB or 1 grey), oldest first. By default a Vulkan compute shader
//! (`kernels/pixels.wgsl`, translated to SPIR-V by build.rs) advances the stack in memory
//! the library allocates and exports (protocol 1.3, path a): a client maps or imports
//! that memory and reads the frames with no copy. With `--image-device host` the CPU
//! reference [`render_reference`] does the same in the region's shared memory, byte for
//! byte.
//!
//! The picture is computed in integers from fixed-point draw parameters the host derives
//! from each env's observation ([`DrawParams`]), so that any device draws the same bytes
//! as [`render_reference`], which tests compare byte for byte. Edges are weighted by the
//! area (or, for the pole, the clamped distance) they cover in 1/256 of a pixel, so a
//! lean or a move smaller than a pixel changes intensities. The camera frames what the
//! policy needs: the width spans the track (±2.4 m, where an episode ends) and a margin,
//! and the pole is drawn long and thick (0.7 of the frame's height, 0.06 of its width),
//! not to the track's scale: a lean of 0.01 rad moves its tip by 0.007 of the height
//! (0.6 px at 84 px). Gymnasium's proportions (a 1 m pole in a 4.8 m wide frame) show the
//! same lean as 0.18 px at 84 px, and PPO from such frames stayed at a random policy's
//! return; from these it learns (`shmbridge-ppo --env pixels` trains on 48x48 grey
//! frames, two to a stack; the engine's default is 84x84 RGBA, two to a stack).
//!
//! The stack: each step every slot takes the next one's frame and the last slot gets the
//! new frame; an env whose episode starts (the first frame, an autoreset, `reset_mask`, a
//! `Reset` command) gets its new frame in every slot, so a stack never mixes two
//! episodes. The shift is a copy of `(k - 1) * H * W * C` bytes per env, done by the
//! same invocations that draw (each touches only its own word of each slot).
//!
//! Rendering on Vulkan needs the `vulkan` feature and a Vulkan device with external
//! memory (Mesa's lavapipe on a machine without a GPU); without them that engine is
//! `VulkanUnavailable`. The host path needs neither.

use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::compute::{ComputeShader, NotATarget, ShaderTarget};
use crate::device::{self, Device, Location, VulkanDevice};
use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::{DType, Direction};
use crate::tensor::Tensors;

use super::cartpole::{self, CartPole};
use super::reference::Reference;
use super::vec_env::{EnvOptions, VecEnv};

/// Words before the per-env parameters (the shader's `HEADER`).
pub const HEADER: usize = 16;
/// Words per env: `[cart_x, axle_y, sin_q12, cos_q12, update]` ([`StackUpdate`]).
pub const PER_ENV: usize = 5;
/// The frame shape when none is given: `[H, W, C]`.
pub const DEFAULT_IMAGE: [u64; 3] = [84, 84, 4];
/// The frames per env when no stack is given: two show the velocities one cannot.
pub const DEFAULT_STACK: u32 = 2;
/// The largest stack.
pub const MAX_STACK: u32 = 16;
/// The largest frame side. The pole's products (`rx * s`, positions below `1024 * 256`
/// times a Q12 sine) stay inside `i32` for every pixel of the frame; a cart clamped far
/// outside the frame may wrap, identically in the shader and the reference (both wrap).
pub const MAX_SIDE: u32 = 1024;
/// Workgroup size of the shader (`@workgroup_size(64)`).
const GROUP: u32 = 64;
/// Words each invocation of the shader draws (its `WORDS_PER_INVOCATION`).
const WORDS_PER_INVOCATION: u32 = 8;

/// Half the width the camera shows, in metres: the track's end (2.4 m) and a margin
/// that keeps a cart at the end whole.
const HALF_VIEW_M: f64 = cartpole::X_THRESHOLD + 0.35;
/// The cart's half-width, in metres.
const CART_HALF_W_M: f64 = 0.3;
/// The pole's drawn length and width, as fractions of the frame's height and width.
const POLE_LEN: f64 = 0.7;
const POLE_WIDTH: f64 = 0.06;
/// The track's height in the frame (fraction of the height from the top).
const TRACK_Y: f64 = 0.86;

const Q8: f64 = 256.0;
const Q12: f64 = 4096.0;

/// What a `pixels` engine draws: `stack` frames of `height x width x channels` per env.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameShape {
    pub height: u32,
    pub width: u32,
    pub channels: u32,
    pub stack: u32,
}

impl FrameShape {
    /// Bytes of one frame.
    pub fn frame_bytes(&self) -> u64 {
        u64::from(self.height) * u64::from(self.width) * u64::from(self.channels)
    }

    /// The `rgb` tensor's shape, `[num_envs, stack, height, width, channels]`.
    pub fn tensor_shape(&self, num_envs: u32) -> [u64; 5] {
        [
            u64::from(num_envs),
            u64::from(self.stack),
            u64::from(self.height),
            u64::from(self.width),
            u64::from(self.channels),
        ]
    }
}

/// What a frame does to its env's stack (the last per-env parameter word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum StackUpdate {
    /// The next step: every slot takes the next one's frame, the last slot the new frame.
    Push = 0,
    /// The episode starts with this frame: every slot holds it.
    Restart = 1,
    /// The stack stays as it is (an env a `Reset` command did not name).
    Keep = 2,
}

/// The fixed-point description of a batch of frames the shader and [`render_reference`]
/// draw: a header of [`HEADER`] words, then [`PER_ENV`] words per env.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrawParams {
    pub words: Vec<i32>,
}

impl DrawParams {
    /// The parameters of `num_envs` stacks of `shape` with every env at rest and
    /// starting an episode (set by [`DrawParams::set_states`]).
    pub fn new(num_envs: u32, shape: FrameShape) -> DrawParams {
        let (h, w) = (f64::from(shape.height), f64::from(shape.width));
        let scale = w / (2.0 * HALF_VIEW_M); // px per metre
        let q = |px: f64| (px * Q8).round() as i32;
        let mut words = vec![0i32; HEADER + PER_ENV * num_envs as usize];
        words[..12].copy_from_slice(&[
            num_envs as i32,
            shape.height as i32,
            shape.width as i32,
            shape.channels as i32,
            shape.stack as i32,
            PER_ENV as i32,
            q(h * TRACK_Y),                     // track_y
            q((h / 200.0).max(0.5)),            // track_half (at least 1 px thick)
            q(scale * CART_HALF_W_M),           // cart_half_w
            q((h * 0.05).max(1.0)),             // cart_half_h
            q(h * POLE_LEN),                    // pole_len
            q((w * POLE_WIDTH / 2.0).max(1.0)), // pole_half_w (at least 2 px wide)
        ]);
        for p in words[HEADER..].chunks_exact_mut(PER_ENV) {
            p[4] = StackUpdate::Restart as i32;
        }
        DrawParams { words }
    }

    fn header(&self, i: usize) -> i32 {
        self.words[i]
    }

    /// Sets each env's draw parameters from its observation `[x, x_dot, theta,
    /// theta_dot]` (`obs`: `num_envs * 4` values) and what the frame does to its stack
    /// (`updates`: one per env). Positions are clamped a frame's width outside the
    /// frame, so that no product overflows whatever the state.
    pub fn set_states(&mut self, obs: &[f32], updates: &[StackUpdate]) {
        let width = self.header(2);
        let scale = f64::from(width) / (2.0 * HALF_VIEW_M);
        let limit = f64::from(width) * Q8;
        let track_y = self.header(6);
        let cart_half_h = self.header(9);
        for ((p, o), &update) in self.words[HEADER..]
            .chunks_exact_mut(PER_ENV)
            .zip(obs.chunks_exact(4))
            .zip(updates)
        {
            let x = f64::from(o[0]);
            let theta = f64::from(o[2]);
            let cart_x = ((f64::from(width) / 2.0 + x * scale) * Q8).clamp(-limit, 2.0 * limit);
            // A NaN state draws as if at rest rather than as garbage.
            let cart_x = if cart_x.is_nan() { limit / 2.0 } else { cart_x };
            let (s, c) = if theta.is_finite() {
                theta.sin_cos()
            } else {
                (0.0, 1.0)
            };
            p[0] = cart_x.round() as i32;
            p[1] = track_y - cart_half_h / 2; // the axle: a quarter of the cart's height up
            p[2] = (s * Q12).round() as i32;
            p[3] = (c * Q12).round() as i32;
            p[4] = update as i32;
        }
    }
}

/// Overlap of `[a0, a1)` with `[b0, b1)`, clamped to `0..=256` (both in 1/256 px).
fn overlap(a0: i32, a1: i32, b0: i32, b1: i32) -> i32 {
    (a1.min(b1).wrapping_sub(a0.max(b0))).clamp(0, 256)
}

/// `c` blended toward `fg` by `cov / 256`, per channel.
fn blend(c: [i32; 3], fg: [i32; 3], cov: i32) -> [i32; 3] {
    std::array::from_fn(|k| {
        (c[k].wrapping_mul(256 - cov))
            .wrapping_add(fg[k].wrapping_mul(cov))
            .wrapping_add(128)
            >> 8
    })
}

/// Draws one env's frame (`env`: its parameters `[cart_x, axle_y, sin_q12, cos_q12, ..]`)
/// into `out`, `w * c` bytes a row: the shader's `shade` and `channel` for every pixel,
/// with the terms that depend on the row alone computed once per row. Integer
/// arithmetic wraps alike in either order, so the bytes are the shader's.
fn draw_frame(p: &[i32], env: &[i32], w: usize, c: usize, out: &mut [u8]) {
    let [track_y, track_half, cart_half_w, cart_half_h, pole_len, pole_half_w] =
        [p[6], p[7], p[8], p[9], p[10], p[11]];
    let [cart_x, axle_y, sin, cos] = [env[0], env[1], env[2], env[3]];
    for (y, row) in out.chunks_exact_mut(w * c).enumerate() {
        // The pixel's square, in 1/256 px.
        let py0 = (y as i32).wrapping_mul(256);
        let py1 = py0.wrapping_add(256);
        // Track: a horizontal band across the frame.
        let track = overlap(
            py0,
            py1,
            track_y.wrapping_sub(track_half),
            track_y.wrapping_add(track_half),
        );
        let background = blend([255, 255, 255], [0, 0, 0], track);
        let cart_y_cov = overlap(
            py0,
            py1,
            track_y.wrapping_sub(cart_half_h),
            track_y.wrapping_add(cart_half_h),
        );
        let ry = py0.wrapping_add(128).wrapping_sub(axle_y);
        let (ry_cos, ry_sin) = (ry.wrapping_mul(cos), ry.wrapping_mul(sin));
        let axle_y_cov = overlap(
            py0,
            py1,
            axle_y.wrapping_sub(pole_half_w),
            axle_y.wrapping_add(pole_half_w),
        );
        for (x, px) in row.chunks_exact_mut(c).enumerate() {
            let px0 = (x as i32).wrapping_mul(256);
            let px1 = px0.wrapping_add(256);
            // Cart: an axis-aligned rectangle centred on (cart_x, track_y).
            let cart_x_cov = overlap(
                px0,
                px1,
                cart_x.wrapping_sub(cart_half_w),
                cart_x.wrapping_add(cart_half_w),
            );
            let color = blend(
                background,
                [40, 40, 40],
                cart_x_cov.wrapping_mul(cart_y_cov) >> 8,
            );
            // Pole: clamped distances of the pixel centre from its axis and its ends.
            let rx = px0.wrapping_add(128).wrapping_sub(cart_x);
            let along = rx.wrapping_mul(sin).wrapping_sub(ry_cos) >> 12;
            let across = rx.wrapping_mul(cos).wrapping_add(ry_sin).wrapping_abs() >> 12;
            let side = pole_half_w
                .wrapping_add(128)
                .wrapping_sub(across)
                .clamp(0, 256);
            let ends = along
                .min(pole_len.wrapping_sub(along))
                .wrapping_add(128)
                .clamp(0, 256);
            let color = blend(color, [202, 152, 101], side.wrapping_mul(ends) >> 8);
            // Axle: a square at the pole's base.
            let axle_x_cov = overlap(
                px0,
                px1,
                cart_x.wrapping_sub(pole_half_w),
                cart_x.wrapping_add(pole_half_w),
            );
            let color = blend(
                color,
                [129, 132, 203],
                axle_x_cov.wrapping_mul(axle_y_cov) >> 8,
            );
            for (ch, b) in px.iter_mut().enumerate() {
                *b = channel(color, ch, c);
            }
        }
    }
}

/// The shader's `channel`: byte `ch` of a pixel of `color` with `channels` channels.
fn channel(color: [i32; 3], ch: usize, channels: usize) -> u8 {
    match (channels, ch) {
        (1, _) => ((77 * color[0] + 150 * color[1] + 29 * color[2] + 128) >> 8) as u8,
        (_, 3) => 255,
        _ => color[ch] as u8,
    }
}

/// The CPU reference of `kernels/pixels.wgsl`, and the host path's renderer: advances
/// every env's stack in `out` (`[num_envs, stack, height, width, channels]` u8, exactly
/// that many bytes) by one frame, drawn from `params` with the shader's integer steps and
/// its wrapping `i32` arithmetic. `out` holds the stacks
/// before this frame, as the engine's memory does: each env's [`StackUpdate`] says
/// what becomes of them.
pub fn render_reference(params: &DrawParams, out: &mut [u8]) -> Result<()> {
    let p = &params.words;
    let bad = |what: String| Error::InvalidSpec(format!("render_reference: {what}"));
    if p.len() < HEADER || p[5] != PER_ENV as i32 {
        return Err(bad(format!(
            "{} words, {PER_ENV} per env expected",
            p.len()
        )));
    }
    let dims = [p[0], p[1], p[2], p[3], p[4]].map(|v| u32::try_from(v).ok());
    let [Some(n), Some(height), Some(width), Some(channels), Some(stack)] = dims else {
        return Err(bad(format!("negative sizes {:?}", &p[..5])));
    };
    let shape = FrameShape {
        height,
        width,
        channels,
        stack,
    };
    check_shape(n, shape).map_err(|e| bad(e.to_string()))?;
    let frame = shape.frame_bytes() as usize;
    let (h, w, c, k) = (
        height as usize,
        width as usize,
        channels as usize,
        stack as usize,
    );
    let words = n as usize * PER_ENV + HEADER;
    if n as usize * k * frame != out.len() || words > p.len() {
        return Err(bad(format!(
            "{} bytes and {} words for {n} stacks of {k} frames of {h}x{w}x{c}",
            out.len(),
            p.len()
        )));
    }
    let mut new = vec![0u8; frame];
    for (e, stack_bytes) in out.chunks_exact_mut(k * frame).enumerate() {
        let env = &p[HEADER + e * PER_ENV..HEADER + (e + 1) * PER_ENV];
        if env[4] == StackUpdate::Keep as i32 {
            continue;
        }
        draw_frame(p, env, w, c, &mut new);
        if env[4] == StackUpdate::Restart as i32 {
            for slot in stack_bytes.chunks_exact_mut(frame) {
                slot.copy_from_slice(&new);
            }
        } else {
            stack_bytes.copy_within(frame.., 0);
            stack_bytes[(k - 1) * frame..].copy_from_slice(&new);
        }
    }
    Ok(())
}

/// Checks a frame shape: both sides in `1..=MAX_SIDE`, 1, 3 or 4 channels, a frame's
/// bytes a multiple of 4 (the shader writes whole words), `1..=MAX_STACK` frames, and
/// the batch's words one dispatch can cover.
pub fn check_shape(num_envs: u32, shape: FrameShape) -> Result<()> {
    let FrameShape {
        height: h,
        width: w,
        channels: c,
        stack: k,
    } = shape;
    if !(1..=MAX_SIDE).contains(&h) || !(1..=MAX_SIDE).contains(&w) {
        return Err(Error::InvalidSpec(format!(
            "pixels: a frame is at most {MAX_SIDE}x{MAX_SIDE}, not {h}x{w}"
        )));
    }
    if ![1, 3, 4].contains(&c) {
        return Err(Error::InvalidSpec(format!(
            "pixels: frames are HxWx4 (RGBA), HxWx3 (RGB) or HxWx1 (grey), not {c} channels"
        )));
    }
    if shape.frame_bytes() % 4 != 0 {
        return Err(Error::InvalidSpec(format!(
            "pixels: a {h}x{w}x{c} frame is {} bytes; with {c} channel(s) H * W must be a \
             multiple of 4 (the renderer writes whole 32-bit words)",
            shape.frame_bytes()
        )));
    }
    if !(1..=MAX_STACK).contains(&k) {
        return Err(Error::InvalidSpec(format!(
            "pixels: --frame-stack is 1 to {MAX_STACK}, not {k}"
        )));
    }
    let words = shape.frame_bytes() / 4;
    let bytes = u64::from(num_envs) * words * 4 * u64::from(k);
    if bytes > u64::from(u32::MAX) || dispatch_grid(words, u64::from(num_envs)).is_none() {
        return Err(Error::InvalidSpec(format!(
            "pixels: {num_envs} stacks of {k} frames of {h}x{w}x{c} are {bytes} bytes; one \
             dispatch writes at most {} (fewer envs, frames or pixels)",
            u32::MAX
        )));
    }
    Ok(())
}

/// The frame shape `image` (`[H, W, C]`, default [`DEFAULT_IMAGE`]) and `stack` (default
/// [`DEFAULT_STACK`]) ask for, checked.
pub fn frame_shape(
    num_envs: u32,
    image: Option<[u64; 3]>,
    stack: Option<u32>,
) -> Result<FrameShape> {
    let [h, w, c] = image.unwrap_or(DEFAULT_IMAGE);
    let small = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let shape = FrameShape {
        height: small(h),
        width: small(w),
        channels: small(c),
        stack: stack.unwrap_or(DEFAULT_STACK),
    };
    check_shape(num_envs, shape)?;
    Ok(shape)
}

/// The shader's dispatch grid `(x, y, z)` of workgroups for `num_envs` frames of `words`
/// 32-bit words: `x` covers a frame's words (64 invocations a workgroup, each
/// `WORDS_PER_INVOCATION` words), `y * z` the envs (the
/// shader's env is `gid.z * y + gid.y`); each dimension at most 65535, the smallest
/// limit Vulkan guarantees.
pub fn dispatch_grid(words: u64, num_envs: u64) -> Option<[u32; 3]> {
    let x = words
        .div_ceil(u64::from(GROUP) * u64::from(WORDS_PER_INVOCATION))
        .max(1);
    let y = num_envs.clamp(1, 65_535);
    let z = num_envs.div_ceil(y).max(1);
    let dim = |v: u64| u32::try_from(v).ok().filter(|&v| v <= 65_535);
    Some([dim(x)?, dim(y)?, dim(z)?])
}

/// The `pixels` engine: a [`CartPole`] and the renderer of its frames.
pub struct Pixels {
    cartpole: CartPole,
    num_envs: u32,
    shape: FrameShape,
    /// Where the frames live: Vulkan memory the shader writes, or the region (host).
    on_vulkan: bool,
    params: DrawParams,
    /// Scratch: the observations drawn, and what each does to its env's stack.
    obs: Vec<f32>,
    updates: Vec<StackUpdate>,
    renderer: Option<Renderer>,
}

impl std::fmt::Debug for Pixels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pixels")
            .field("num_envs", &self.num_envs)
            .field("shape", &self.shape)
            .field("on_vulkan", &self.on_vulkan)
            .finish_non_exhaustive()
    }
}

impl Pixels {
    /// `image`: `[H, W, C]` (default [`DEFAULT_IMAGE`]); `stack`: frames per env (default
    /// [`DEFAULT_STACK`]); `device`: where the frames live, `Device::Vulkan` (drawn by
    /// the shader) or `Device::Host` (drawn by [`render_reference`] into the region).
    pub fn new(
        num_envs: u32,
        seed: u64,
        image: Option<[u64; 3]>,
        stack: Option<u32>,
        device: Device,
    ) -> Result<Pixels> {
        let shape = frame_shape(num_envs, image, stack)?;
        let on_vulkan = match device {
            Device::Host => false,
            Device::Vulkan(_) => true,
            Device::Cuda(_) => {
                return Err(Error::InvalidSpec(
                    "pixels: frames live in Vulkan memory or on the host (--image-device \
                     vulkan or host), not on CUDA"
                        .into(),
                ))
            }
        };
        if on_vulkan {
            device::built_for(Location::Vulkan)?;
        }
        Ok(Pixels {
            cartpole: CartPole::new(num_envs, seed)?,
            num_envs,
            shape,
            on_vulkan,
            params: DrawParams::new(num_envs, shape),
            obs: Vec::new(),
            updates: vec![StackUpdate::Restart; num_envs as usize],
            renderer: None,
        })
    }

    /// The draw parameters of the last frame rendered (for tests: the CPU reference of
    /// that frame is `render_reference(params)` over the stack before it).
    pub fn params(&self) -> &DrawParams {
        &self.params
    }

    /// Draws every env's current observation into its stack as `self.updates` says, on
    /// the engine's Vulkan queue or into the region. The engine waits for the queue before it publishes the frame or a reply.
    /// The frame drawn is the observation the client reads (the state rounded to `f32`).
    fn render(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.obs.clear();
        self.obs
            .extend(self.cartpole.states().iter().flatten().map(|&v| v as f32));
        self.params.set_states(&self.obs, &self.updates);
        if !self.on_vulkan {
            return render_reference(&self.params, io.write::<u8>("rgb")?);
        }
        // Made for the engine's buffer on first use, and again should this env be served
        // by another engine (the recorded dispatch names the buffer).
        if !self.renderer.as_ref().is_some_and(|r| r.serves(io)) {
            self.renderer = None;
            self.renderer = Some(Renderer::new(io, &self.params)?);
        }
        if let Some(r) = &mut self.renderer {
            r.draw(&self.params)?;
        }
        Ok(())
    }
}

/// What `pixels` serves: `cartpole`'s tensors and `rgb [N, k, H, W, C]` u8, the last `k`
/// frames of each env (`image`: `[H, W, C]`, default [`DEFAULT_IMAGE`]; `stack`: `k`,
/// default [`DEFAULT_STACK`]), in Vulkan memory or (`device` host) in the region.
pub fn spec(
    num_envs: u32,
    image: Option<[u64; 3]>,
    stack: Option<u32>,
    device: Device,
) -> Result<EngineSpec> {
    Ok(spec_of_shape(
        num_envs,
        frame_shape(num_envs, image, stack)?,
        device,
    ))
}

fn spec_of_shape(num_envs: u32, shape: FrameShape, device: Device) -> EngineSpec {
    let device = match device {
        Device::Host => Device::Host,
        _ => Device::Vulkan(VulkanDevice::ANY),
    };
    cartpole::spec_of("pixels", num_envs)
        .metadata("image", "rgb")
        .metadata("frame_stack", &shape.stack.to_string())
        .tensor(
            "rgb",
            DType::U8,
            &shape.tensor_shape(num_envs),
            Direction::EngineToClient,
        )
        .place("rgb", device)
}

/// `pixels`' options ([`Pixels::new`]).
#[derive(Debug, Clone, Copy)]
pub struct PixelsOptions {
    /// `cartpole`'s seed: env `e` draws from a stream seeded with `seed + e`.
    pub seed: u64,
    /// `[H, W, C]` of a frame (default [`DEFAULT_IMAGE`]).
    pub image: Option<[u64; 3]>,
    /// Frames per env (default [`DEFAULT_STACK`]).
    pub frame_stack: Option<u32>,
    /// Where the frames live: Vulkan memory (the default) or the host.
    pub device: Device,
}

impl Reference for Pixels {
    const NAME: &'static str = "pixels";
    const DESCRIPTION: &'static str = "cartpole with each env's last frames drawn by a Vulkan \
        compute shader into exported memory, or on the host: `rgb`, u8 (num_envs, K, H, W, C)";
    type Options = PixelsOptions;

    /// Frames in Vulkan memory unless `image_device` says host; a shard's slice
    /// (`first_env`) seeds its envs as the whole region would, as `cartpole` does.
    fn options(flags: &EnvOptions) -> PixelsOptions {
        PixelsOptions {
            seed: flags.seed.wrapping_add(u64::from(flags.first_env)),
            image: flags.image,
            frame_stack: flags.frame_stack,
            device: match flags.image_device {
                Some(Device::Host) => Device::Host,
                _ => Device::Vulkan(VulkanDevice::ANY),
            },
        }
    }

    fn spec(num_envs: u32, o: &PixelsOptions) -> Result<EngineSpec> {
        spec(num_envs, o.image, o.frame_stack, o.device)
    }

    fn build(num_envs: u32, o: &PixelsOptions) -> Result<Box<dyn VecEnv>> {
        let env = Pixels::new(num_envs, o.seed, o.image, o.frame_stack, o.device)?;
        Ok(Box::new(env))
    }
}

impl VecEnv for Pixels {
    fn spec(&self) -> EngineSpec {
        let device = if self.on_vulkan {
            Device::Vulkan(VulkanDevice::ANY)
        } else {
            Device::Host
        };
        spec_of_shape(self.num_envs, self.shape, device)
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.cartpole.reset_all(io)?;
        self.updates.fill(StackUpdate::Restart);
        self.render(io)
    }

    fn step(&mut self, seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        self.cartpole.step(seq, io)?;
        // An episode starts where the env was reset before the step (`reset_mask`) or
        // after it (autoreset on termination or truncation): it has taken no step yet.
        let steps = self.cartpole.episode_steps();
        for (u, &steps) in self.updates.iter_mut().zip(steps) {
            *u = if steps == 0 {
                StackUpdate::Restart
            } else {
                StackUpdate::Push
            };
        }
        self.render(io)
    }
}

impl CommandHandler for Pixels {
    /// `Reset` as `cartpole`, then the new observations' frames: the envs reset start
    /// their stacks anew, the others' stacks stay as they are (no step was taken).
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        CommandHandler::reset(&mut self.cartpole, io, req)?;
        let (ids, _) = req.plan(self.num_envs)?;
        self.updates.fill(StackUpdate::Keep);
        for &i in &ids {
            self.updates[i as usize] = StackUpdate::Restart;
        }
        self.render(io).map_err(CommandError::engine)
    }

    fn call(
        &mut self,
        io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        CommandHandler::call(&mut self.cartpole, io, method, args, payload)
    }
}

/// The SPIR-V of `kernels/pixels.wgsl` (build.rs; empty in a build without the `vulkan`
/// feature, which never gets as far as a renderer).
const SPIRV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pixels.spv"));

/// The shader over the engine's `rgb` buffer and a parameter buffer of its own.
#[derive(Debug)]
struct Renderer {
    // Drop order: the shader (it waits for its last dispatch), then the target.
    shader: ComputeShader,
    /// The engine's buffer the shader writes (recorded into its dispatch): a renderer is
    /// used only while the engine still has this one.
    rgb: ShaderTarget,
}

impl Renderer {
    /// The engine's `rgb` buffer in `io`.
    fn target(io: &Tensors<'_>) -> Result<ShaderTarget> {
        let engine = io.engine_backend()?;
        ShaderTarget::of(engine, io.id("rgb")?.index()).map_err(|why| {
            Error::InvalidSpec(
                match why {
                    NotATarget::NotVulkan => {
                        "pixels: the engine's rgb tensor is not in Vulkan memory"
                    }
                    NotATarget::NotAllocated => {
                        "pixels: rgb must be memory the library allocates (path a)"
                    }
                    NotATarget::NoBuffer => "pixels: rgb has no buffer (the engine closed?)",
                }
                .into(),
            )
        })
    }

    /// Whether this renderer writes the buffer `io`'s engine has now.
    fn serves(&self, io: &Tensors<'_>) -> bool {
        Self::target(io).is_ok_and(|rgb| rgb.same_as(&self.rgb))
    }

    fn new(io: &Tensors<'_>, params: &DrawParams) -> Result<Renderer> {
        let rgb = Self::target(io)?;
        let rgb_bytes = rgb.bytes();
        let (range, largest) = rgb.storage_limits();
        if rgb_bytes > range || rgb_bytes > largest {
            return Err(Error::InvalidSpec(format!(
                "pixels: the frames take {rgb_bytes} bytes; {} binds at most {range} bytes \
                 to a shader and allocates at most {largest}: fewer envs or smaller frames",
                rgb.device_name()
            )));
        }
        let bytes = (params.words.len() * 4) as u64;
        // One invocation per word of each env's newest frame.
        let [n, h, w, c] = [0, 1, 2, 3].map(|i| params.words[i] as u64);
        let grid = dispatch_grid(h * w * c / 4, n).ok_or_else(|| {
            Error::InvalidSpec(format!(
                "pixels: {n} frames of {h}x{w}x{c} exceed one dispatch"
            ))
        })?;
        let shader = ComputeShader::new(&rgb, SPIRV, bytes, grid)?;
        Ok(Renderer { shader, rgb })
    }

    /// Writes `params` and submits the dispatch (after the previous one completed).
    fn draw(&mut self, params: &DrawParams) -> Result<()> {
        self.shader.dispatch(bytemuck::cast_slice(&params.words))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn shape(h: u32, w: u32, c: u32, k: u32) -> FrameShape {
        FrameShape {
            height: h,
            width: w,
            channels: c,
            stack: k,
        }
    }

    /// The stacks after drawing `obs` (one frame per env) with `updates` over `before`.
    fn draw(shape: FrameShape, obs: &[f32], updates: &[StackUpdate], before: &[u8]) -> Vec<u8> {
        let n = updates.len() as u32;
        let mut p = DrawParams::new(n, shape);
        p.set_states(obs, updates);
        let mut out = before.to_vec();
        render_reference(&p, &mut out).unwrap();
        out
    }

    fn frames(shape: FrameShape, obs: &[f32]) -> Vec<u8> {
        let n = obs.len() / 4;
        let bytes = n * (shape.frame_bytes() * u64::from(shape.stack)) as usize;
        draw(shape, obs, &vec![StackUpdate::Restart; n], &vec![0; bytes])
    }

    fn pixel(out: &[u8], s: FrameShape, env: usize, y: usize, x: usize) -> [u8; 4] {
        let (h, w) = (s.height as usize, s.width as usize);
        let i = ((env * s.stack as usize * h + y) * w + x) * 4;
        out[i..i + 4].try_into().unwrap()
    }

    #[test]
    fn the_picture_has_a_track_a_cart_and_a_long_leaning_pole() {
        let s = shape(84, 84, 4, 1);
        // Env 0 upright at the centre; env 1 a metre right, the pole leaning right.
        let out = frames(s, &[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.2, 0.0]);
        let white = [255, 255, 255, 255];
        assert_eq!(pixel(&out, s, 0, 2, 2), white, "background");
        // The track: 0.86 down, a dark band across the frame (rows 71.7 to 72.7).
        assert!(pixel(&out, s, 0, 72, 3)[0] < 128, "track");
        // Env 0's cart: 0.6 m (9.2 px) wide, centred at x = 42, rows 68 to 76.4.
        assert_eq!(pixel(&out, s, 0, 75, 40), [40, 40, 40, 255], "cart");
        // Its pole rises straight up from the axle (y 70.1), 5 px wide, 58.8 px long.
        for y in [20, 40, 60] {
            for x in [41, 42] {
                let pole = pixel(&out, s, 0, y, x);
                assert_eq!(&pole[..3], &[202, 152, 101], "pole at ({y}, {x})");
            }
            assert_eq!(pixel(&out, s, 0, y, 38), white, "beside the pole");
        }
        assert_eq!(pixel(&out, s, 0, 9, 41), white, "above the pole's top");
        // Env 1: the cart moved right by 15.3 px, the pole's top leans right of its axle.
        assert_eq!(
            pixel(&out, s, 1, 75, 40),
            white,
            "env 1's cart is not at the centre"
        );
        assert_eq!(
            pixel(&out, s, 1, 75, 57),
            [40, 40, 40, 255],
            "env 1's cart at x = 57.3"
        );
        let top_left = (0..84)
            .find(|&x| pixel(&out, s, 1, 20, x) != white)
            .unwrap();
        assert!(
            top_left > 62,
            "the pole leans right: first painted x at row 20 is {top_left}"
        );
        let (a, b) = out.split_at(84 * 84 * 4);
        assert_ne!(a, b);
    }

    #[test]
    fn a_lean_far_below_a_pixel_changes_the_frame() {
        // 0.002 rad moves the tip of the 58.8 px pole by 0.12 px: the coverage of the
        // pixels along its edges changes, in grey as in colour.
        for c in [1, 4] {
            let s = shape(84, 84, c, 1);
            let out = frames(s, &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.002, 0.0]);
            let (upright, leaning) = out.split_at(s.frame_bytes() as usize);
            let changed = upright.iter().zip(leaning).filter(|(a, b)| a != b).count();
            assert!(changed > 10, "{c} channels: {changed} bytes changed");
            // A cart 0.01 m (0.15 px) to the right: its edges change too.
            let out = frames(s, &[0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0]);
            let (a, b) = out.split_at(s.frame_bytes() as usize);
            assert_ne!(a, b, "{c} channels: a 0.01 m move");
        }
    }

    #[test]
    fn grey_is_the_luma_of_the_colour_frame_and_rgb_drops_alpha() {
        let obs = [0.3, 0.0, -0.1, 0.0, -2.0, 0.0, 0.15, 0.0];
        let rgba = frames(shape(20, 24, 4, 1), &obs);
        let rgb = frames(shape(20, 24, 3, 1), &obs);
        let grey = frames(shape(20, 24, 1, 1), &obs);
        for (i, px) in rgba.chunks_exact(4).enumerate() {
            let [r, g, b, a] = [px[0], px[1], px[2], px[3]].map(u32::from);
            assert_eq!(a, 255);
            assert_eq!(&rgb[3 * i..3 * i + 3], &px[..3]);
            assert_eq!(u32::from(grey[i]), (77 * r + 150 * g + 29 * b + 128) >> 8);
        }
    }

    #[test]
    fn a_stack_pushes_restarts_and_keeps() {
        use StackUpdate::{Keep, Push, Restart};
        let s = shape(8, 12, 1, 3);
        let fb = s.frame_bytes() as usize;
        let state = |x: f32| [x, 0.0, 0.0, 0.0, -x, 0.0, 0.0, 0.0];
        let single = |x: f32| frames(shape(8, 12, 1, 1), &state(x));
        let (f0, f1, f2) = (single(0.0), single(0.5), single(1.0));
        // Frame 0: every slot of both envs holds it.
        let st = draw(s, &state(0.0), &[Restart, Restart], &vec![7; 2 * 3 * fb]);
        let slots = |st: &[u8], env: usize, j: usize| st[(env * 3 + j) * fb..][..fb].to_vec();
        for env in 0..2 {
            for j in 0..3 {
                assert_eq!(
                    slots(&st, env, j),
                    f0[env * fb..][..fb],
                    "env {env} slot {j}"
                );
            }
        }
        // A step: oldest first, the new frame last.
        let st = draw(s, &state(0.5), &[Push, Push], &st);
        let st = draw(s, &state(1.0), &[Push, Restart], &st);
        let want0 = [&f0[..fb], &f1[..fb], &f2[..fb]];
        for (j, want) in want0.iter().enumerate() {
            assert_eq!(slots(&st, 0, j), *want, "env 0 slot {j}");
            // Env 1 started an episode: its stack holds only that episode's frame.
            assert_eq!(slots(&st, 1, j), f2[fb..2 * fb], "env 1 slot {j}");
        }
        // Keep: the stack stays, whatever the state says.
        let kept = draw(s, &state(-1.0), &[Keep, Push], &st);
        assert_eq!(kept[..3 * fb], st[..3 * fb]);
        assert_ne!(kept[3 * fb..], st[3 * fb..]);
    }

    #[test]
    fn draw_params_survive_any_state() {
        let s = shape(16, 16, 4, 2);
        let out = frames(
            s,
            &[
                f32::NAN,
                0.0,
                f32::INFINITY,
                0.0,
                1e30,
                0.0,
                -1e30,
                0.0,
                -1e30,
                0.0,
                f32::NAN,
                0.0,
            ],
        );
        assert_eq!(out.len(), 3 * 2 * 16 * 16 * 4);
    }

    #[test]
    fn frame_shapes_are_checked() {
        assert!(check_shape(4, shape(84, 84, 4, 2)).is_ok());
        assert!(check_shape(4, shape(84, 84, 1, 4)).is_ok());
        assert!(check_shape(4, shape(84, 84, 3, 1)).is_ok());
        assert!(check_shape(4, shape(84, 84, 2, 1)).is_err());
        assert!(check_shape(4, shape(37, 53, 4, 1)).is_ok());
        assert!(
            check_shape(4, shape(37, 53, 1, 1)).is_err(),
            "odd grey frames"
        );
        assert!(check_shape(4, shape(0, 84, 4, 1)).is_err());
        assert!(check_shape(4, shape(2048, 84, 4, 1)).is_err());
        assert!(check_shape(4, shape(84, 84, 4, 0)).is_err());
        assert!(check_shape(4, shape(84, 84, 4, MAX_STACK + 1)).is_err());
        assert!(check_shape(u32::MAX, shape(1024, 1024, 4, 1)).is_err());
        assert!(frame_shape(4, Some([84, 84, 5]), None).is_err());
        assert_eq!(
            frame_shape(4, None, None).unwrap(),
            shape(84, 84, 4, DEFAULT_STACK)
        );
        assert!(frame_shape(4, Some([u64::MAX, 84, 4]), None).is_err());
        // A reference call with the wrong buffer size is an error, not a panic.
        let p = DrawParams::new(2, shape(8, 8, 4, 2));
        assert!(render_reference(&p, &mut [0u8; 10]).is_err());
    }
}
