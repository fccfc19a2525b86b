//! `pixels`: CartPole stepped as `cartpole` does, each env's state rendered into an
//! `rgb [N, H, W, 4] u8` frame (track, cart, pole, axle) by a Vulkan compute shader
//! (`kernels/pixels.wgsl`, translated to SPIR-V by build.rs) writing straight into
//! memory the library allocates and exports (protocol 1.3, path a). A client maps or
//! imports that memory: the frames reach it with no copy.
//!
//! The picture is computed in integers from fixed-point draw parameters the host derives
//! from each env's observation ([`DrawParams`]), so that any device draws the same bytes
//! as the CPU reference [`render_reference`], which tests compare byte for byte. Its
//! proportions follow Gymnasium's CartPole renderer (600x400: a 4.8 m wide world, the cart
//! 50x30 px on a track 3/4 down, the pole 10 px wide and `2 * length` long).
//!
//! Rendering needs the `vulkan` feature and a Vulkan device with external memory (Mesa's
//! lavapipe on a machine without a GPU); without them the engine is `VulkanUnavailable`.
//! With `--image-device host` the frames live in the region instead, drawn on the CPU by
//! [`render_reference`]: no Vulkan needed, and observers (`shmbridge view`) can read them.

use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};
use crate::device::compute::{ComputeShader, NotATarget, ShaderTarget};
use crate::device::{self, Device, Location, VulkanDevice};
use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::{DType, Direction};
use crate::tensor::Tensors;

use super::cartpole::{self, CartPole};
use super::vec_env::VecEnv;

/// Words before the per-env parameters (the shader's `HEADER`).
pub const HEADER: usize = 16;
/// Words per env: `[cart_x, axle_y, sin_q12, cos_q12]`.
pub const PER_ENV: usize = 4;
/// The frame size when none is given.
pub const DEFAULT_SIZE: [u32; 2] = [84, 84];
/// The largest frame side. The pole's products (`rx * s`, positions below `3 * 1024 * 256`
/// times a Q12 sine) stay inside `i32` for every state on screen; a cart clamped far
/// outside the frame may wrap, identically in the shader and the reference (both wrap).
pub const MAX_SIDE: u32 = 1024;
/// Workgroup size of the shader (`@workgroup_size(64)`).
const GROUP: u32 = 64;

const Q8: f64 = 256.0;
const Q12: f64 = 4096.0;

/// The fixed-point description of a batch of frames the shader and [`render_reference`]
/// draw: a header of [`HEADER`] words, then [`PER_ENV`] words per env.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrawParams {
    pub words: Vec<i32>,
}

impl DrawParams {
    /// The parameters of `num_envs` frames of `height` x `width` with every env at rest
    /// (filled in by [`DrawParams::set_states`]).
    pub fn new(num_envs: u32, height: u32, width: u32) -> DrawParams {
        let (h, w) = (f64::from(height), f64::from(width));
        let scale = w / (2.0 * cartpole::X_THRESHOLD); // px per metre
        let q = |px: f64| (px * Q8).round() as i32;
        let mut words = vec![0i32; HEADER + PER_ENV * num_envs as usize];
        words[..10].copy_from_slice(&[
            num_envs as i32,
            height as i32,
            width as i32,
            PER_ENV as i32,
            q(h * 0.75),                       // track_y
            q((h / 400.0).max(1.0)),           // track_half (at least 2 px wide)
            q(w * 25.0 / 600.0),               // cart_half_w
            q(h * 15.0 / 400.0),               // cart_half_h
            q(scale * 2.0 * cartpole::LENGTH), // pole_len
            q((w * 5.0 / 600.0).max(1.0)),     // pole_half_w (at least 2 px wide)
        ]);
        DrawParams { words }
    }

    fn header(&self, i: usize) -> i32 {
        self.words[i]
    }

    /// Sets each env's draw parameters from its observation `[x, x_dot, theta,
    /// theta_dot]` (`obs`: `num_envs * 4` values). Positions are clamped a frame's width
    /// outside the frame, so that no product overflows whatever the state.
    pub fn set_states(&mut self, obs: &[f32]) {
        let width = self.header(2);
        let scale = f64::from(width) / (2.0 * cartpole::X_THRESHOLD);
        let limit = f64::from(width) * Q8;
        let track_y = self.header(4);
        let cart_half_h = self.header(7);
        for (p, o) in self.words[HEADER..]
            .chunks_exact_mut(PER_ENV)
            .zip(obs.chunks_exact(4))
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

/// The CPU reference of `kernels/pixels.wgsl`: the same integer steps, in the same order,
/// with the shader's wrapping `i32` arithmetic. Writes `num_envs * height * width` RGBA
/// pixels into `out` (which must hold exactly that many bytes times 4).
pub fn render_reference(params: &DrawParams, out: &mut [u8]) -> Result<()> {
    let p = &params.words;
    let bad = |what: String| Error::InvalidSpec(format!("render_reference: {what}"));
    if p.len() < HEADER || p[3] != PER_ENV as i32 {
        return Err(bad(format!(
            "{} words, {PER_ENV} per env expected",
            p.len()
        )));
    }
    let dims = [p[0], p[1], p[2]].map(|v| usize::try_from(v).ok());
    let [Some(n), Some(h), Some(w)] = dims else {
        return Err(bad(format!("negative sizes {:?}", &p[..3])));
    };
    let per_env = PER_ENV;
    let pixels = n.checked_mul(h).and_then(|v| v.checked_mul(w));
    let words = n.checked_mul(per_env).and_then(|v| v.checked_add(HEADER));
    if pixels.and_then(|v| v.checked_mul(4)) != Some(out.len()) || words.is_none_or(|v| v > p.len())
    {
        return Err(bad(format!(
            "{} bytes for {n} frames of {h}x{w}",
            out.len()
        )));
    }
    let [track_y, track_half, cart_half_w, cart_half_h, pole_len, pole_half_w] =
        [p[4], p[5], p[6], p[7], p[8], p[9]];
    for (i, px) in out.chunks_exact_mut(4).enumerate() {
        let env = i / (h * w);
        let y = ((i / w) % h) as i32;
        let x = (i % w) as i32;
        let base = HEADER + env * per_env;
        let [cart_x, axle_y, s, c] = [p[base], p[base + 1], p[base + 2], p[base + 3]];
        let px0 = x * 256;
        let py0 = y * 256;

        let mut color = [255, 255, 255];
        let track = overlap(py0, py0 + 256, track_y - track_half, track_y + track_half);
        color = blend(color, [0, 0, 0], track);
        let cart_x_cov = overlap(px0, px0 + 256, cart_x - cart_half_w, cart_x + cart_half_w);
        let cart_y_cov = overlap(py0, py0 + 256, track_y - cart_half_h, track_y + cart_half_h);
        color = blend(color, [40, 40, 40], (cart_x_cov * cart_y_cov) >> 8);
        let rx = (px0 + 128).wrapping_sub(cart_x);
        let ry = (py0 + 128).wrapping_sub(axle_y);
        let along = rx.wrapping_mul(s).wrapping_sub(ry.wrapping_mul(c)) >> 12;
        let across = rx
            .wrapping_mul(c)
            .wrapping_add(ry.wrapping_mul(s))
            .wrapping_abs()
            >> 12;
        let side = (pole_half_w + 128).wrapping_sub(across).clamp(0, 256);
        let ends = along
            .min(pole_len.wrapping_sub(along))
            .wrapping_add(128)
            .clamp(0, 256);
        color = blend(color, [202, 152, 101], (side * ends) >> 8);
        let axle_x_cov = overlap(px0, px0 + 256, cart_x - pole_half_w, cart_x + pole_half_w);
        let axle_y_cov = overlap(py0, py0 + 256, axle_y - pole_half_w, axle_y + pole_half_w);
        color = blend(color, [129, 132, 203], (axle_x_cov * axle_y_cov) >> 8);

        px.copy_from_slice(&[color[0] as u8, color[1] as u8, color[2] as u8, 255]);
    }
    Ok(())
}

/// Checks a frame size: both sides in `1..=MAX_SIDE`, four channels, and the batch's
/// pixel count a dispatch can cover.
pub fn check_size(num_envs: u32, shape: [u64; 3]) -> Result<[u32; 2]> {
    let [h, w, c] = shape;
    let side = |v: u64| u32::try_from(v).ok().filter(|v| (1..=MAX_SIDE).contains(v));
    let (Some(h), Some(w)) = (side(h), side(w)) else {
        return Err(Error::InvalidSpec(format!(
            "pixels: a frame is at most {MAX_SIDE}x{MAX_SIDE}, not {h}x{w}"
        )));
    };
    if c != 4 {
        return Err(Error::InvalidSpec(format!(
            "pixels: frames are RGBA, HxWx4, not {c} channels"
        )));
    }
    let pixels = u64::from(num_envs) * u64::from(h) * u64::from(w);
    if pixels > u64::from(u32::MAX) || dispatch_grid(pixels).is_none() {
        return Err(Error::InvalidSpec(format!(
            "pixels: {num_envs} frames of {h}x{w} are {pixels} pixels; one dispatch draws \
             at most {}",
            u32::MAX
        )));
    }
    Ok([h, w])
}

/// The shader's dispatch grid `(x, y)` of workgroups covering `pixels`, with `x` at most
/// 65535 (the smallest limit Vulkan guarantees per dimension): the shader's pixel index
/// is `gid.y * x * 64 + gid.x`.
pub fn dispatch_grid(pixels: u64) -> Option<[u32; 2]> {
    let groups = pixels.div_ceil(u64::from(GROUP)).max(1);
    let x = groups.min(65_535);
    let y = groups.div_ceil(x);
    Some([
        u32::try_from(x).ok()?,
        u32::try_from(y).ok().filter(|&y| y <= 65_535)?,
    ])
}

/// The `pixels` engine: a [`CartPole`] and the renderer of its frames.
pub struct Pixels {
    cartpole: CartPole,
    /// Where the frames live.
    device: Device,
    num_envs: u32,
    size: [u32; 2],
    params: DrawParams,
    /// Scratch: the observations drawn.
    obs: Vec<f32>,
    renderer: Option<Renderer>,
}

impl std::fmt::Debug for Pixels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pixels")
            .field("num_envs", &self.num_envs)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Pixels {
    /// `image`: `[H, W, 4]` (default [`DEFAULT_SIZE`]). `device`: where the frames live:
    /// Vulkan memory the shader draws into, or (`Device::Host`) the region, drawn on the
    /// CPU by [`render_reference`], which an observer can read.
    pub fn new(
        num_envs: u32,
        seed: u64,
        image: Option<[u64; 3]>,
        device: Device,
    ) -> Result<Pixels> {
        let size = check_size(num_envs, image_shape(image))?;
        if device != Device::Host {
            device::built_for(Location::Vulkan)?;
        }
        Ok(Pixels {
            device,
            cartpole: CartPole::new(num_envs, seed)?,
            num_envs,
            size,
            params: DrawParams::new(num_envs, size[0], size[1]),
            obs: Vec::new(),
            renderer: None,
        })
    }

    /// The draw parameters of the last frame rendered (for tests: the CPU reference of
    /// that frame is `render_reference(params)`).
    pub fn params(&self) -> &DrawParams {
        &self.params
    }

    /// Renders every env's current observation into `rgb` on the engine's Vulkan queue.
    /// The engine waits for the queue before it publishes the frame or a reply.
    /// The frame drawn is the observation the client reads (the state rounded to `f32`).
    fn render(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.obs.clear();
        self.obs
            .extend(self.cartpole.states().iter().flatten().map(|&v| v as f32));
        self.params.set_states(&self.obs);
        if io.info("rgb")?.location() == Location::Host {
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

/// What `pixels` serves: `cartpole`'s tensors and an `rgb [N, H, W, 4]` frame in Vulkan
/// memory (`image`: `[H, W, 4]`, default [`DEFAULT_SIZE`]).
/// `device`: as for [`Pixels::new`].
pub fn spec(num_envs: u32, image: Option<[u64; 3]>, device: Device) -> Result<EngineSpec> {
    Ok(spec_of_size(num_envs, check_size(num_envs, image_shape(image))?).place("rgb", device))
}

fn image_shape(image: Option<[u64; 3]>) -> [u64; 3] {
    image.unwrap_or([u64::from(DEFAULT_SIZE[0]), u64::from(DEFAULT_SIZE[1]), 4])
}

fn spec_of_size(num_envs: u32, size: [u32; 2]) -> EngineSpec {
    let n = u64::from(num_envs);
    let [h, w] = size.map(u64::from);
    cartpole::spec_of("pixels", num_envs)
        .metadata("image", "rgb")
        .tensor("rgb", DType::U8, &[n, h, w, 4], Direction::EngineToClient)
        .place("rgb", Device::Vulkan(VulkanDevice::ANY))
}

impl VecEnv for Pixels {
    fn spec(&self) -> EngineSpec {
        spec_of_size(self.num_envs, self.size).place("rgb", self.device)
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.cartpole.reset_all(io)?;
        self.render(io)
    }

    fn step(&mut self, seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        self.cartpole.step(seq, io)?;
        self.render(io)
    }
}

impl CommandHandler for Pixels {
    /// `Reset` as `cartpole`, then the new observations' frames.
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        CommandHandler::reset(&mut self.cartpole, io, req)?;
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
        let engine = io.engine_device()?;
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
        let [n, h, w] = [params.words[0], params.words[1], params.words[2]].map(|v| v as u64);
        let grid = dispatch_grid(n * h * w).ok_or_else(|| {
            Error::InvalidSpec(format!("pixels: {n} frames of {h}x{w} exceed one dispatch"))
        })?;
        let shader = ComputeShader::new(&rgb, SPIRV, bytes, grid)?;
        Ok(Renderer { shader, rgb })
    }

    /// Writes `params` and submits the dispatch (after the previous one completed).
    fn draw(&mut self, params: &DrawParams) -> Result<()> {
        self.shader.dispatch(bytemuck::cast_slice(&params.words))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(params: &DrawParams) -> Vec<u8> {
        let p = &params.words;
        let mut out = vec![0u8; (p[0] * p[1] * p[2] * 4) as usize];
        render_reference(params, &mut out).unwrap();
        out
    }

    fn pixel(out: &[u8], w: usize, h: usize, env: usize, y: usize, x: usize) -> [u8; 4] {
        let i = ((env * h + y) * w + x) * 4;
        out[i..i + 4].try_into().unwrap()
    }

    #[test]
    fn the_picture_has_a_track_a_cart_and_a_leaning_pole() {
        let (h, w) = (84usize, 84usize);
        let mut p = DrawParams::new(2, h as u32, w as u32);
        // Env 0 upright at the centre; env 1 a metre right, the pole leaning right.
        p.set_states(&[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.2, 0.0]);
        let out = frame(&p);
        let white = [255, 255, 255, 255];
        assert_eq!(pixel(&out, w, h, 0, 2, 2), white, "background");
        // The track: rows 62 and 63 (3/4 down), black across the frame.
        assert_eq!(pixel(&out, w, h, 0, 62, 3), [0, 0, 0, 255], "track");
        // Env 0's cart: 7 px wide, centred at x = 42, rows 60 to 65.
        assert_eq!(pixel(&out, w, h, 0, 64, 40), [40, 40, 40, 255], "cart");
        // Its pole rises straight up from the axle, 2 px wide, 17.5 px long.
        for y in [46, 50, 55] {
            for x in [41, 42] {
                let pole = pixel(&out, w, h, 0, y, x);
                assert_eq!(&pole[..3], &[202, 152, 101], "pole at ({y}, {x})");
            }
            assert_eq!(pixel(&out, w, h, 0, y, 39), white, "beside the pole");
        }
        assert_eq!(pixel(&out, w, h, 0, 40, 41), white, "above the pole's top");
        // Env 1: the cart moved right by 17.5 px, the pole's top leans right of its axle.
        assert_eq!(
            pixel(&out, w, h, 1, 64, 40),
            white,
            "env 1's cart is not at the centre"
        );
        assert_eq!(
            pixel(&out, w, h, 1, 64, 58),
            [40, 40, 40, 255],
            "env 1's cart at x = 59.5"
        );
        let top_left = (0..w)
            .find(|&x| pixel(&out, w, h, 1, 47, x) != white)
            .unwrap();
        assert!(
            top_left > 60,
            "the pole leans right: first painted x at row 47 is {top_left}"
        );
        // Two different states, two different frames.
        let (a, b) = out.split_at(h * w * 4);
        assert_ne!(a, b);
    }

    #[test]
    fn draw_params_survive_any_state() {
        let mut p = DrawParams::new(3, 16, 16);
        p.set_states(&[
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
        ]);
        let out = frame(&p);
        assert_eq!(out.len(), 3 * 16 * 16 * 4);
    }

    #[test]
    fn frame_sizes_are_checked() {
        assert!(check_size(4, [84, 84, 4]).is_ok());
        assert!(check_size(4, [84, 84, 3]).is_err());
        assert!(check_size(4, [0, 84, 4]).is_err());
        assert!(check_size(4, [2048, 84, 4]).is_err());
        assert!(check_size(u32::MAX, [1024, 1024, 4]).is_err());
    }
}
