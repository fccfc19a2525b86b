//! The engine's camera (`--camera NAME --camera-size HxW`, docs/mujoco.md): each env's
//! view through one named camera of the model, rendered offscreen by MuJoCo's own
//! renderer (`mjv_updateScene`, `mjr_render`, `mjr_readPixels`, through `mujoco-rs`'s
//! `MjRenderer` on an EGL context: Mesa's llvmpipe on a machine without a GPU) and
//! written, top row first, into the env's row of the region's `rgb` tensor, `uint8
//! [N, H, W, 3]` (host). What `mujoco.Renderer(model, H, W)` gives after
//! `update_scene(data, camera=NAME)` and `render()`.

use mujoco_rs::renderer::MjRenderer;
use mujoco_rs::wrappers::{MjModel, MjtObjBase, MjvCamera};

use super::tasks::{Data, PREFIX};
use crate::error::{Error, Result};

/// One camera, one renderer (one GL context) for all the envs, drawn one after another.
pub struct Camera {
    renderer: MjRenderer,
    /// Bytes of one env's frame: `H * W * 3`.
    frame: usize,
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
    /// A renderer of camera `id` of `model` at `[h, w]` (an EGL context of its own).
    pub fn new(model: &MjModel, task: &str, id: usize, [h, w]: [u64; 2]) -> Result<Self> {
        let renderer = MjRenderer::builder()
            .width(w as u32)
            .height(h as u32)
            .camera(MjvCamera::new_fixed(id))
            .rgb(true)
            .depth(false)
            .build(model)
            .map_err(|e| {
                Error::InvalidSpec(format!(
                    "{PREFIX}{task}: no offscreen OpenGL context for the camera ({e}); \
                     MuJoCo renders through EGL (Mesa's libEGL and llvmpipe on a CPU machine: \
                     scripts/lib.sh's ensure_mesa)"
                ))
            })?;
        Ok(Camera {
            renderer,
            frame: (h * w * 3) as usize,
        })
    }

    /// Bytes of one env's frame.
    pub fn frame_len(&self) -> usize {
        self.frame
    }

    /// Draws `data`'s state through the camera into `out` (one env's `H * W * 3` bytes).
    pub fn render(&mut self, data: &mut Data, out: &mut [u8]) -> Result<()> {
        let failed = |e: mujoco_rs::renderer::RendererError| Error::Io {
            context: "mujoco camera: rendering".into(),
            source: std::io::Error::other(e.to_string()),
        };
        self.renderer.sync_data(data).map_err(failed)?;
        self.renderer.render().map_err(failed)?;
        let rgb = self.renderer.rgb_flat().unwrap_or(&[]);
        match (rgb.get(..self.frame), out.get_mut(..self.frame)) {
            (Some(rgb), Some(out)) => {
                out.copy_from_slice(rgb);
                Ok(())
            }
            _ => Err(Error::InvalidSpec(format!(
                "mujoco camera: a frame of {} bytes for a row of {} (expected {})",
                rgb.len(),
                out.len(),
                self.frame
            ))),
        }
    }
}
