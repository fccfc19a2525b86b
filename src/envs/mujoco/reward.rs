//! `mujoco/raw`'s reward from the user's C code (`--reward-lib PATH`, docs/mujoco.md): a
//! shared library exporting [`SYMBOL`] with the signature [`RewardFn`], loaded by the
//! engine (every symbol bound at once: one it lacks is an error at start, not a process
//! killed by the loader at the first call) and called after every step of every env with
//! that env's `mjModel` and `mjData` (after the step's `mj_step`s and
//! `mj_rnePostConstraint`; both read-only), its action, and where to write the step's
//! reward and whether the episode terminated. It is called on the thread stepping the env
//! (`--threads`: several at once, each with its own env's `mjData`, the one `mjModel`
//! shared), so it must not keep state shared between envs without its own locking, and
//! must not unwind (C++ exceptions) through the call.

use libloading::Library;

use super::tasks::Data;
use crate::error::{Error, Result};

/// The exported function's name.
pub const SYMBOL: &str = "shmbridge_mujoco_reward";

/// `int32_t shmbridge_mujoco_reward(const mjModel* m, const mjData* d, uint32_t env,
/// const float* action, uint32_t nu, double* reward, uint8_t* terminated)`: `env` is the
/// region's env index, `action` its `nu` actions; it writes `*reward` (0 if left alone)
/// and `*terminated` (0 or 1; 0 if left alone) and returns 0, or anything else to stop
/// the engine with an error naming the env and the value.
pub type RewardFn = unsafe extern "C" fn(
    model: *const mujoco_rs::mujoco_c::mjModel,
    data: *const mujoco_rs::mujoco_c::mjData,
    env: u32,
    action: *const f32,
    nu: u32,
    reward: *mut f64,
    terminated: *mut u8,
) -> i32;

/// The loaded library (kept for the engine's life) and its function.
pub struct RewardLib {
    _library: Library,
    function: RewardFn,
}

impl RewardLib {
    /// Loads the file `path` (a path, never a name searched for on the library path) and
    /// finds [`SYMBOL`] in it; `InvalidSpec` saying what failed.
    pub fn load(path: &str) -> Result<Self> {
        let failed = |what: &str, e: &dyn std::fmt::Display| {
            Error::InvalidSpec(format!("mujoco/raw: --reward-lib {path}: {what}: {e}"))
        };
        let file = std::path::Path::new(path)
            .canonicalize()
            .map_err(|e| failed("cannot load it", &e))?;
        if !file.is_file() {
            return Err(failed("cannot load it", &"not a file"));
        }
        use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: loading a library runs its initialisers in this process: the user named
        // it to run in this engine (docs/mujoco.md); nothing else is assumed of it.
        let library: Library = unsafe { UnixLibrary::open(Some(&file), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| failed("cannot load it", &e))?
            .into();
        // SAFETY: `SYMBOL` is documented with the signature of `RewardFn`; the pointer is
        // copied out and used only while `library` (kept beside it) stays loaded.
        let function = unsafe { library.get::<RewardFn>(SYMBOL.as_bytes()) }
            .map(|f| *f)
            .map_err(|e| failed(&format!("no function {SYMBOL}"), &e))?;
        Ok(RewardLib {
            _library: library,
            function,
        })
    }

    /// The function, for the step threads (valid while `self` lives).
    pub(super) fn function(&self) -> RewardFn {
        self.function
    }
}

/// Calls `function` for env `env` in state `data` after `action`: its `(reward,
/// terminated)`, or the error that stops the engine (a nonzero return, a reward that is
/// not finite as the `float32` served, a `terminated` other than 0 or 1).
///
/// # Safety
/// `function` is [`RewardLib::function`] of a `RewardLib` that is still alive.
pub(super) unsafe fn reward_of(
    function: RewardFn,
    data: &Data,
    env: u32,
    action: &[f32],
) -> Result<(f64, bool)> {
    let (mut reward, mut terminated) = (0.0f64, 0u8);
    let model: &mujoco_rs::mujoco_c::mjModel = data.model().ffi();
    let state: &mujoco_rs::mujoco_c::mjData = data.ffi();
    // SAFETY: `function` is loaded and alive (this function's contract); `model` and
    // `state` are this env's live mjModel and mjData, borrowed for the call; `action`
    // points to `action.len()` floats; `reward` and `terminated` are locals. What the
    // function does with them is its author's contract (`RewardFn`, docs/mujoco.md).
    let status = unsafe {
        function(
            model,
            state,
            env,
            action.as_ptr(),
            action.len() as u32,
            &mut reward,
            &mut terminated,
        )
    };
    let bad = |why: String| Error::Io {
        context: format!("mujoco/raw: the reward callback ({SYMBOL}) for env {env}"),
        source: std::io::Error::other(why),
    };
    if status != 0 {
        return Err(bad(format!("returned {status}")));
    }
    if !(reward as f32).is_finite() {
        return Err(bad(format!("gave the reward {reward}")));
    }
    match terminated {
        0 | 1 => Ok((reward, terminated == 1)),
        t => Err(bad(format!("gave terminated = {t} (0 or 1)"))),
    }
}
