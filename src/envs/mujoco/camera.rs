//! The engine's camera (`--camera NAME --camera-size HxW [--camera-depth]`,
//! docs/mujoco.md): each env's view through one named camera of the model, rendered
//! offscreen by MuJoCo's own renderer (`mjv_updateScene`, `mjr_render`, `mjr_readPixels`
//! on an EGL context: Mesa's llvmpipe on a machine without a GPU) and written, top row
//! first, into the env's row of the region's `rgb` tensor, `uint8 [N, H, W, 3]` (host),
//! and with `--camera-depth` its distances into `depth`, `float32 [N, H, W]`. What
//! `mujoco.Renderer(model, H, W)` gives after `update_scene(data, camera=NAME)` and
//! `render()`, with and without `enable_depth_rendering()`.
//!
//! The EGL context is made here (glutin, as `mujoco-rs`'s `MjRenderer` makes it), with
//! this module's own `MjvScene` and `MjrContext`: the depth pass sets the scene's
//! `mjRND_SEGMENT` and `mjRND_IDCOLOR` flags, as `mujoco.Renderer` does, which
//! `MjRenderer` does not let a caller set.
//!
//! With `rgb` in Vulkan memory the library exported (`--image-device vulkan`), OpenGL
//! writes the frames there itself when it can import that memory
//! (`GL_EXT_memory_object_fd` on the same device): [`GlFrames`].

use std::ffi::{c_void, CStr};
use std::num::NonZeroU32;
use std::os::fd::{AsRawFd, IntoRawFd};

use glutin::api::egl::context::PossiblyCurrentContext;
use glutin::api::egl::device::Device;
use glutin::api::egl::display::Display;
use glutin::api::egl::surface::Surface;
use glutin::config::{ConfigSurfaceTypes, ConfigTemplateBuilder};
use glutin::context::{ContextApi, ContextAttributesBuilder, GlProfile, Version};
use glutin::display::GetGlDisplay;
use glutin::prelude::{GlDisplay, NotCurrentGlContext, PossiblyCurrentGlContext};
use glutin::surface::{PbufferSurface, SurfaceAttributesBuilder};
use mujoco_rs::wrappers::{
    MjModel, MjrContext, MjrRectangle, MjtDepthMap, MjtObjBase, MjtRndFlag, MjvCamera, MjvOption,
    MjvPerturb, MjvScene,
};

use super::tasks::{Data, PREFIX};
use crate::device::compute::ShaderTarget;
use crate::error::{Error, Result};

/// The geoms a scene holds: `mujoco.Renderer`'s default `max_geom`.
const MAX_GEOM: usize = 10_000;

/// One camera, one GL context, scene and MuJoCo rendering context for all the envs, drawn
/// one after another. Fields drop in order: the MuJoCo context (which frees its GL
/// objects) before the GL context, made current first by `Drop`.
pub struct Camera {
    /// `rgb`'s Vulkan memory and its import in GL, or why GL cannot import it (`None`:
    /// `rgb` is in the region, or no frame was drawn yet).
    frames: Option<(ShaderTarget, std::result::Result<GlFrames, String>)>,
    context: MjrContext,
    scene: MjvScene,
    camera: MjvCamera,
    option: MjvOption,
    gl: Gl,
    /// `[H, W]`.
    size: [usize; 2],
    /// The depth pass too (`--camera-depth`).
    depth: bool,
    /// The camera's near and far clip distances (m), `float32` as `mujoco.Renderer`
    /// rounds them.
    near_far: [f32; 2],
    /// Bottom-up pixels as MuJoCo reads them, before they are flipped into the region.
    rgb_scratch: Vec<u8>,
    depth_scratch: Vec<f32>,
}

/// An EGL context with a pbuffer surface, on the first EGL device that gives one.
struct Gl {
    context: PossiblyCurrentContext,
    surface: Surface<PbufferSurface>,
}

impl Gl {
    fn new(width: NonZeroU32, height: NonZeroU32) -> std::result::Result<Self, String> {
        let devices = Device::query_devices().map_err(|e| e.to_string())?;
        let mut last = "no EGL device".to_string();
        for device in devices {
            match Self::on(&device, width, height) {
                Ok(gl) => return Ok(gl),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    }

    fn on(device: &Device, width: NonZeroU32, height: NonZeroU32) -> glutin::error::Result<Self> {
        // SAFETY: `device` is one that `Device::query_devices` listed; no native display.
        let display = unsafe { Display::with_device(device, None)? };
        let template = ConfigTemplateBuilder::new()
            .with_surface_type(ConfigSurfaceTypes::PBUFFER)
            .with_alpha_size(0)
            .with_depth_size(24)
            .with_stencil_size(8)
            .build();
        // SAFETY: `display` is initialised; the template asks for ordinary attributes.
        let config = unsafe { display.find_configs(template)? }
            .next()
            .ok_or(glutin::error::ErrorKind::NotSupported("no EGL config"))?;
        let attributes = ContextAttributesBuilder::new()
            .with_profile(GlProfile::Compatibility)
            .with_context_api(ContextApi::OpenGl(Some(Version::new(2, 0))))
            .build(None);
        // SAFETY: `display` and `config` are valid and belong together.
        let context = unsafe { display.create_context(&config, &attributes)? };
        let surface = SurfaceAttributesBuilder::<PbufferSurface>::new().build(width, height);
        // SAFETY: as above; the surface's sides are nonzero.
        let surface = unsafe { display.create_pbuffer_surface(&config, &surface)? };
        let context = context.make_current(&surface)?;
        Ok(Gl { context, surface })
    }

    /// Makes the context current on the calling thread (MuJoCo's `mjr_*` draw with it).
    fn make_current(&self) -> Result<()> {
        self.context
            .make_current(&self.surface)
            .map_err(|e| failed(format!("making the EGL context current: {e}")))
    }
}

fn failed(what: String) -> Error {
    Error::Io {
        context: "mujoco camera".into(),
        source: std::io::Error::other(what),
    }
}

/// The id of camera `name` of `model`, or `InvalidSpec` listing the model's cameras.
pub fn camera_id(model: &MjModel, task: &str, name: &str) -> Result<usize> {
    let count = model.ffi().ncam.max(0) as usize;
    let names: Vec<&str> = (0..count)
        .map(|id| model.id_to_name(MjtObjBase::mjOBJ_CAMERA, id).unwrap_or(""))
        .collect();
    names
        .iter()
        .position(|n| *n == name && !n.is_empty())
        .ok_or_else(|| {
            Error::InvalidSpec(format!(
                "{PREFIX}{task}: no camera '{name}' in the model (its named cameras: {})",
                match names.iter().filter(|n| !n.is_empty()).count() {
                    0 => "none".to_string(),
                    _ => names
                        .iter()
                        .filter(|n| !n.is_empty())
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", "),
                }
            ))
        })
}

/// Makes MuJoCo's offscreen buffer of `model` hold a `[h, w]` image (as Gymnasium sets
/// `vis.global.offwidth`/`offheight` to its render size): visual settings only, the
/// physics does not read them.
pub fn fit_offscreen(model: &mut MjModel, [h, w]: [u64; 2]) {
    let global = &mut model.vis_mut().global;
    global.offwidth = global.offwidth.max(w as i32);
    global.offheight = global.offheight.max(h as i32);
}

impl Camera {
    /// A renderer of camera `id` of `model` at `[h, w]` (an EGL context of its own), with
    /// the depth pass where `depth`.
    pub fn new(
        model: &MjModel,
        task: &str,
        id: usize,
        [h, w]: [u64; 2],
        depth: bool,
    ) -> Result<Self> {
        let no_context = |e: String| {
            Error::InvalidSpec(format!(
                "{PREFIX}{task}: no offscreen OpenGL context for the camera ({e}); \
                 MuJoCo renders through EGL (Mesa's libEGL and llvmpipe on a CPU machine: \
                 scripts/lib.sh's ensure_mesa)"
            ))
        };
        let side = |s: u64| NonZeroU32::new(u32::try_from(s).unwrap_or(0));
        let (Some(width), Some(height)) = (side(w), side(h)) else {
            return Err(no_context(format!("size {h}x{w}")));
        };
        let gl = Gl::new(width, height).map_err(no_context)?;
        // SAFETY: `Gl::new` made its context current on this thread; `Camera` keeps it
        // and makes it current again before every use of the MuJoCo context and its drop.
        let mut context = unsafe { MjrContext::new(model) };
        context.offscreen();
        // `mjr_readPixels` gives MuJoCo 3's reverse-Z depth as is (1 near, 0 far), as
        // `mujoco.Renderer` sets it.
        // SAFETY: one `int` field of the context, set to a value of its enum; no pointer
        // or size changes.
        unsafe { context.ffi_mut() }.readDepthMap = MjtDepthMap::mjDEPTH_ZEROFAR as i32;
        let scene = MjvScene::new(model, MAX_GEOM.max(model.ffi().ngeom.max(0) as usize + 100));
        // `mujoco.Renderer`'s clip distances: `znear * extent` in float64, then float32.
        let extent = model.stat().extent;
        let map = &model.vis().map;
        let near_far = [
            (f64::from(map.znear) * extent) as f32,
            (f64::from(map.zfar) * extent) as f32,
        ];
        let (h, w) = (h as usize, w as usize);
        Ok(Camera {
            frames: None,
            context,
            scene,
            camera: MjvCamera::new_fixed(id),
            option: MjvOption::default(),
            gl,
            size: [h, w],
            depth,
            near_far,
            rgb_scratch: vec![0; h * w * 3],
            depth_scratch: if depth { vec![0.0; h * w] } else { Vec::new() },
        })
    }

    /// Bytes of one env's frame, `H * W * 3`.
    pub fn frame_len(&self) -> usize {
        self.size[0] * self.size[1] * 3
    }

    /// Pixels of one env's depth image, `H * W` (0 without the depth pass).
    pub fn depth_len(&self) -> usize {
        if self.depth {
            self.size[0] * self.size[1]
        } else {
            0
        }
    }

    /// Where the frames go, for `model_info`: `host` (the region, or `rgb`'s Vulkan
    /// memory through the engine's mapping: the reason follows) or `opengl` (written by
    /// OpenGL into the imported Vulkan memory).
    pub fn frames_path(&self) -> String {
        match &self.frames {
            None => "host".into(),
            Some((_, Ok(_))) => "opengl".into(),
            Some((_, Err(why))) => format!("host ({why})"),
        }
    }

    /// Frames into `rgb`'s Vulkan memory `target` (its first `bytes`) from now on:
    /// imported in GL once (again for another buffer). `Ok(false)` when GL cannot import
    /// it (the reason is kept for [`Self::frames_path`]): the frames then go through the
    /// engine's mapping.
    pub fn use_vulkan_memory(&mut self, target: ShaderTarget, bytes: u64) -> Result<bool> {
        let current = matches!(&self.frames, Some((t, _)) if t.same_as(&target));
        if !current {
            self.gl.make_current()?;
            self.frames = None;
            let frames = GlFrames::import(&self.gl, &target, bytes);
            self.frames = Some((target, frames));
        }
        Ok(self.on_gl())
    }

    /// Whether OpenGL writes the frames.
    fn on_gl(&self) -> bool {
        matches!(self.frames, Some((_, Ok(_))))
    }

    /// Draws `data`'s state through the camera into `rgb` (one env's `H * W * 3` bytes;
    /// empty when OpenGL writes the frame: at byte `offset` of the imported memory) and,
    /// with the depth pass, its distances into `depth` (`H * W`).
    pub fn render(
        &mut self,
        data: &mut Data,
        rgb: &mut [u8],
        offset: u64,
        depth: &mut [f32],
    ) -> Result<()> {
        let [h, w] = self.size;
        let rgb_len = if self.on_gl() { 0 } else { h * w * 3 };
        if rgb.len() != rgb_len || depth.len() != self.depth_len() {
            return Err(Error::InvalidSpec(format!(
                "mujoco camera: rows of {} and {} values for a {h}x{w} camera",
                rgb.len(),
                depth.len()
            )));
        }
        self.gl.make_current()?;
        self.scene
            .update(data, &self.option, &MjvPerturb::default(), &mut self.camera);
        let viewport = MjrRectangle::new(0, 0, w as i32, h as i32);
        self.context.offscreen();
        self.scene.render(&viewport, &self.context);
        if let Some((_, Ok(frames))) = &self.frames {
            frames.read(&self.context, [h, w], offset)?;
            self.context.restore_buffer();
        } else {
            self.context
                .read_pixels(Some(&mut self.rgb_scratch), None, &viewport)
                .map_err(|e| failed(format!("reading the frame: {e}")))?;
            flip_rows(&self.rgb_scratch, rgb, w * 3, |&v| v);
        }
        if !self.depth {
            return Ok(());
        }
        // `mujoco.Renderer`'s depth pass: the same scene drawn again with segmentation
        // colours (no lights, textures or skybox), the flags restored after.
        let segment = [
            MjtRndFlag::mjRND_SEGMENT as usize,
            MjtRndFlag::mjRND_IDCOLOR as usize,
        ];
        let saved = segment.map(|f| self.scene.flags()[f]);
        self.set_flags(segment, [1, 1]);
        self.scene.render(&viewport, &self.context);
        self.set_flags(segment, saved);
        self.context
            .read_pixels(None, Some(&mut self.depth_scratch), &viewport)
            .map_err(|e| failed(format!("reading the depth: {e}")))?;
        let metres = Metres::new(self.near_far, self.scene.camera()[0].orthographic != 0);
        flip_rows(&self.depth_scratch, depth, w, |&z| metres.of(z));
        Ok(())
    }

    /// After a batch of frames: with OpenGL writing them, waits until it has (the
    /// learner reads the memory once the frame is published).
    pub fn finish(&mut self) -> Result<()> {
        if let Some((_, Ok(frames))) = &self.frames {
            self.gl.make_current()?;
            frames.finish()?;
        }
        Ok(())
    }

    fn set_flags(&mut self, flags: [usize; 2], values: [u8; 2]) {
        // SAFETY: only two bytes of the scene's render flags are written, each in
        // `0..mjNRNDFLAG` (mjtRndFlag values); no pointer or count of the scene changes.
        let scene = unsafe { self.scene.ffi_mut() };
        for (f, v) in flags.into_iter().zip(values) {
            scene.flags[f] = v;
        }
    }
}

/// The OpenGL commands the import and the reads use, from EGL's `eglGetProcAddress`.
macro_rules! gl_commands {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        #[allow(non_snake_case)]
        #[derive(Clone, Copy)]
        struct GlCommands {
            $($name: unsafe extern "system" fn($($arg),*) $(-> $ret)?,)*
        }

        impl GlCommands {
            fn load(gl: &Gl) -> std::result::Result<Self, String> {
                let display = gl.context.display();
                Ok(GlCommands {
                    $($name: {
                        let name = CStr::from_bytes_with_nul(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                        .map_err(|e| e.to_string())?;
                        let address = display.get_proc_address(name);
                        if address.is_null() {
                            return Err(format!("EGL has no {}", stringify!($name)));
                        }
                        // SAFETY: `address` is EGL's non-null entry point of this GL
                        // command, whose C signature the field's type spells.
                        unsafe {
                            std::mem::transmute::<
                                *const c_void,
                                unsafe extern "system" fn($($arg),*) $(-> $ret)?,
                            >(address)
                        }
                    },)*
                })
            }
        }
    };
}

gl_commands! {
    glGetError: fn() -> u32;
    glGetIntegerv: fn(u32, *mut i32);
    glGetStringi: fn(u32, u32) -> *const u8;
    glGetUnsignedBytevEXT: fn(u32, *mut u8);
    glGetUnsignedBytei_vEXT: fn(u32, u32, *mut u8);
    glCreateMemoryObjectsEXT: fn(i32, *mut u32);
    glDeleteMemoryObjectsEXT: fn(i32, *const u32);
    glImportMemoryFdEXT: fn(u32, u64, u32, i32);
    glMemoryObjectParameterivEXT: fn(u32, u32, *const i32);
    glGenBuffers: fn(i32, *mut u32);
    glDeleteBuffers: fn(i32, *const u32);
    glBindBuffer: fn(u32, u32);
    glBufferStorageMemEXT: fn(u32, isize, u32, u64);
    glBindFramebuffer: fn(u32, u32);
    glReadBuffer: fn(u32);
    glDrawBuffer: fn(u32);
    glBlitFramebuffer: fn(i32, i32, i32, i32, i32, i32, i32, i32, u32, u32);
    glReadPixels: fn(i32, i32, i32, i32, u32, u32, *mut c_void);
    glFinish: fn();
}

const GL_EXTENSIONS: u32 = 0x1F03;
const GL_NUM_EXTENSIONS: u32 = 0x821D;
const GL_DEVICE_UUID_EXT: u32 = 0x9597;
const GL_DRIVER_UUID_EXT: u32 = 0x9598;
const GL_HANDLE_TYPE_OPAQUE_FD_EXT: u32 = 0x9586;
const GL_DEDICATED_MEMORY_OBJECT_EXT: u32 = 0x9581;
const GL_RGB: i32 = 0x1907;
const GL_PIXEL_PACK_BUFFER: u32 = 0x88EB;
const GL_READ_FRAMEBUFFER: u32 = 0x8CA8;
const GL_DRAW_FRAMEBUFFER: u32 = 0x8CA9;
const GL_COLOR_ATTACHMENT0: u32 = 0x8CE0;
const GL_COLOR_BUFFER_BIT: u32 = 0x4000;
const GL_NEAREST: u32 = 0x2600;
const GL_UNSIGNED_BYTE: u32 = 0x1401;

/// `rgb`'s Vulkan memory as an OpenGL buffer (`glImportMemoryFdEXT`,
/// `glBufferStorageMemEXT`) that `glReadPixels` writes each frame into as a
/// `GL_PIXEL_PACK_BUFFER`, then `glFinish` before the frame is published. No semaphore
/// orders GL's writes against the learner's reads (Mesa's llvmpipe has no
/// `GL_EXT_semaphore_fd`): `glFinish` returns once GL's commands are done, and on
/// llvmpipe and lavapipe the memory is the same host pages (docs/mujoco.md).
struct GlFrames {
    commands: GlCommands,
    memory: u32,
    buffer: u32,
    /// Bytes of the GL buffer.
    bytes: u64,
}

impl GlFrames {
    /// Imports `target`'s memory and binds its first `bytes` to a GL buffer, or says why
    /// GL cannot. The GL context is current.
    fn import(gl: &Gl, target: &ShaderTarget, bytes: u64) -> std::result::Result<Self, String> {
        let commands = GlCommands::load(gl)?;
        let c = &commands;
        if !has_extension(c, "GL_EXT_memory_object_fd") {
            return Err("OpenGL has no GL_EXT_memory_object_fd".into());
        }
        let (mut device, mut driver) = ([0u8; 16], [0u8; 16]);
        // SAFETY: each writes GL_UUID_SIZE_EXT (16) bytes into its array.
        unsafe {
            (c.glGetUnsignedBytei_vEXT)(GL_DEVICE_UUID_EXT, 0, device.as_mut_ptr());
            (c.glGetUnsignedBytevEXT)(GL_DRIVER_UUID_EXT, driver.as_mut_ptr());
        }
        let vulkan = target.device();
        if device != vulkan.device_uuid || driver != vulkan.driver_uuid {
            return Err(format!(
                "OpenGL's device is not the Vulkan memory's ({})",
                target.device_name()
            ));
        }
        // Without `GL_EXT_semaphore_fd` nothing but `glFinish` orders GL's writes before
        // the learner's reads, which EXT_external_objects does not promise: it holds
        // where GL and Vulkan share host pages (llvmpipe and lavapipe), and is not
        // assumed on any other driver (a GPU's would need an exported semaphore).
        if !target.device_name().contains("llvmpipe") {
            return Err(format!(
                "no semaphore to order OpenGL's writes on {} (glFinish alone is trusted \
                 only where OpenGL and Vulkan share host pages: Mesa's software drivers)",
                target.device_name()
            ));
        }
        if target.bytes() < bytes {
            return Err(format!(
                "{} bytes of Vulkan memory for {bytes}",
                target.bytes()
            ));
        }
        let size = isize::try_from(bytes).map_err(|_| format!("{bytes} bytes"))?;
        let fd = target.memory_fd().map_err(|e| e.to_string())?;
        let mut frames = GlFrames {
            commands,
            memory: 0,
            buffer: 0,
            bytes,
        };
        // SAFETY: GL calls on the current context with valid arguments: the names are
        // written by the Create/Gen calls; the library's exports are dedicated
        // allocations (`ExportedBuffer`), which the import must say; `size` is within
        // the imported memory (checked above).
        let imported = unsafe {
            clear_errors(c);
            (c.glCreateMemoryObjectsEXT)(1, &mut frames.memory);
            (c.glMemoryObjectParameterivEXT)(frames.memory, GL_DEDICATED_MEMORY_OBJECT_EXT, &1);
            (c.glImportMemoryFdEXT)(
                frames.memory,
                target.bytes(),
                GL_HANDLE_TYPE_OPAQUE_FD_EXT,
                fd.as_raw_fd(),
            );
            (c.glGetError)()
        };
        if imported != 0 {
            // GL did not take the fd: it closes with `fd`.
            return Err(format!(
                "OpenGL did not import the Vulkan memory (error 0x{imported:x})"
            ));
        }
        // A successful import owns the fd.
        let _ = fd.into_raw_fd();
        // SAFETY: as above; the buffer's storage is the imported memory object.
        let error = unsafe {
            (c.glGenBuffers)(1, &mut frames.buffer);
            (c.glBindBuffer)(GL_PIXEL_PACK_BUFFER, frames.buffer);
            (c.glBufferStorageMemEXT)(GL_PIXEL_PACK_BUFFER, size, frames.memory, 0);
            (c.glBindBuffer)(GL_PIXEL_PACK_BUFFER, 0);
            (c.glGetError)()
        };
        match error {
            0 => Ok(frames),
            e => Err(format!(
                "OpenGL did not bind the imported memory to a buffer (error 0x{e:x})"
            )),
        }
    }

    /// MuJoCo's offscreen frame of `[h, w]` into the buffer at byte `offset`, top row
    /// first: what `mjr_readPixels` reads (the multisample buffer resolved by a blit
    /// into MuJoCo's resolve buffer, `readPixelFormat` bytes), a row per `glReadPixels`
    /// so the rows land flipped. The caller restores MuJoCo's buffer after.
    fn read(&self, context: &MjrContext, [h, w]: [usize; 2], offset: u64) -> Result<()> {
        let c = &self.commands;
        let con = context.ffi();
        let (hi, wi) = (h as i32, w as i32);
        let row = (w * 3) as u64;
        if con.readPixelFormat != GL_RGB {
            return Err(failed(format!(
                "MuJoCo reads pixels as GL format 0x{:x}, not RGB",
                con.readPixelFormat
            )));
        }
        if offset
            .checked_add(h as u64 * row)
            .is_none_or(|end| end > self.bytes)
        {
            return Err(failed(format!(
                "a {h}x{w} frame at byte {offset} of a {}-byte buffer",
                self.bytes
            )));
        }
        // SAFETY: GL calls on the current context (made current by `render`); the
        // framebuffers are the MuJoCo context's; each row lies within the buffer (checked
        // above), where GL writes it (a pack buffer is bound: the pointer is an offset).
        unsafe {
            // Judge only these reads: an error MuJoCo's drawing left is not theirs.
            clear_errors(c);
            if con.offSamples != 0 {
                (c.glBindFramebuffer)(GL_READ_FRAMEBUFFER, con.offFBO);
                (c.glReadBuffer)(GL_COLOR_ATTACHMENT0);
                (c.glBindFramebuffer)(GL_DRAW_FRAMEBUFFER, con.offFBO_r);
                (c.glDrawBuffer)(GL_COLOR_ATTACHMENT0);
                (c.glBlitFramebuffer)(0, 0, wi, hi, 0, 0, wi, hi, GL_COLOR_BUFFER_BIT, GL_NEAREST);
                (c.glBindFramebuffer)(GL_READ_FRAMEBUFFER, con.offFBO_r);
            } else {
                (c.glBindFramebuffer)(GL_READ_FRAMEBUFFER, con.offFBO);
            }
            (c.glReadBuffer)(GL_COLOR_ATTACHMENT0);
            (c.glBindBuffer)(GL_PIXEL_PACK_BUFFER, self.buffer);
            for y in 0..h {
                let at = offset + (h - 1 - y) as u64 * row;
                (c.glReadPixels)(
                    0,
                    y as i32,
                    wi,
                    1,
                    con.readPixelFormat as u32,
                    GL_UNSIGNED_BYTE,
                    at as usize as *mut c_void,
                );
            }
            (c.glBindBuffer)(GL_PIXEL_PACK_BUFFER, 0);
            match (c.glGetError)() {
                0 => Ok(()),
                e => Err(failed(format!(
                    "reading the frame into the Vulkan memory: GL error 0x{e:x}"
                ))),
            }
        }
    }

    /// Waits until GL has executed every command (the frames are in the memory).
    fn finish(&self) -> Result<()> {
        // SAFETY: GL calls on the current context.
        match unsafe {
            clear_errors(&self.commands);
            (self.commands.glFinish)();
            (self.commands.glGetError)()
        } {
            0 => Ok(()),
            e => Err(failed(format!("glFinish: GL error 0x{e:x}"))),
        }
    }
}

impl Drop for GlFrames {
    fn drop(&mut self) {
        // SAFETY: names this value made, on the context `Camera` makes current before
        // it drops or replaces them (names 0 are ignored).
        unsafe {
            (self.commands.glDeleteBuffers)(1, &self.buffer);
            (self.commands.glDeleteMemoryObjectsEXT)(1, &self.memory);
        }
    }
}

/// Whether the current context lists OpenGL extension `name`.
/// Takes every error GL has recorded so far (`glGetError` reports one per call), so
/// that the next `glGetError` judges only the calls after this one. The GL context is
/// current.
unsafe fn clear_errors(c: &GlCommands) {
    // Each call clears one recorded error; GL records at most one per error kind.
    for _ in 0..16 {
        // SAFETY: the caller's: a GL call on the current context.
        if unsafe { (c.glGetError)() } == 0 {
            break;
        }
    }
}

fn has_extension(c: &GlCommands, name: &str) -> bool {
    let mut count = 0;
    // SAFETY: GL calls on the current context; `glGetStringi` is asked for indices below
    // the count it reported and gives a NUL-terminated string (or null).
    unsafe {
        (c.glGetIntegerv)(GL_NUM_EXTENSIONS, &mut count);
        (0..count.max(0) as u32).any(|i| {
            let s = (c.glGetStringi)(GL_EXTENSIONS, i);
            !s.is_null() && CStr::from_ptr(s.cast()).to_bytes() == name.as_bytes()
        })
    }
}

impl Drop for Camera {
    fn drop(&mut self) {
        // `mjr_freeContext` (the MuJoCo context's drop) needs the GL context current.
        let _ = self.gl.make_current();
    }
}

/// `src`'s rows (`row` values each, bottom-up as OpenGL reads them) into `dst` top row
/// first, each value through `map`.
fn flip_rows<S, D>(src: &[S], dst: &mut [D], row: usize, map: impl Fn(&S) -> D) {
    for (out, line) in dst.chunks_exact_mut(row).zip(src.chunks_exact(row).rev()) {
        for (o, v) in out.iter_mut().zip(line) {
            *o = map(v);
        }
    }
}

/// MuJoCo 3's reverse-Z depth buffer value (1 at the near plane, 0 at the far one) to the
/// distance along the camera's axis, as `mujoco.Renderer` computes it: the projection's
/// coefficients in `float32` (as `glFrustum` would), the division in `float64`, the
/// result rounded to `float32`.
struct Metres {
    near: f32,
    far: f32,
    orthographic: bool,
    c: f32,
    d: f32,
}

impl Metres {
    fn new([near, far]: [f32; 2], orthographic: bool) -> Self {
        let c = -(far + near) / (far - near);
        let d = -(2.0 * far * near) / (far - near);
        Metres {
            near,
            far,
            orthographic,
            c: -0.5 * c - 0.5,
            d: -0.5 * d,
        }
    }

    fn of(&self, z: f32) -> f32 {
        let z = f64::from(z);
        let metres = if self.orthographic {
            // `zfar - z * (zfar - znear)`, the difference of the planes in float32.
            f64::from(self.far) - z * f64::from(self.far - self.near)
        } else {
            f64::from(self.d) / (z + f64::from(self.c))
        };
        metres as f32
    }
}

#[cfg(test)]
mod tests {
    use super::Metres;

    /// The conversion gives the clip planes at the buffer's ends (reverse Z: 1 near, 0
    /// far) and is monotonic in between.
    #[test]
    fn reverse_z_maps_to_the_clip_planes() {
        let m = Metres::new([0.05, 50.0], false);
        assert!((m.of(1.0) - 0.05).abs() < 1e-6, "{}", m.of(1.0));
        assert!((m.of(0.0) - 50.0).abs() < 1e-3, "{}", m.of(0.0));
        assert!(m.of(0.25) > m.of(0.5) && m.of(0.5) > m.of(0.75));
        let o = Metres::new([0.05, 50.0], true);
        assert!((o.of(1.0) - 0.05).abs() < 1e-5, "{}", o.of(1.0));
        assert_eq!(o.of(0.0), 50.0);
    }
}
