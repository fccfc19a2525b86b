//! `null`: no physics. Frame `seq` holds a pattern that depends on `seq` and the element's
//! index, and `rewards[i]` echoes `actions[i, 0]`, so a client can check every step that
//! the frame is the right one, whole, and answered its own actions.
//!
//! Engine-defined method: `echo` answers with the arguments and payload it was sent.
//!
//! With an image shape `(h, w, c)` the engine also serves `rgb`, a `u8` tensor of shape
//! `(num_envs, h, w, c)` holding the low byte of the same pattern: the camera workload.
//!
//! Sparse mode writes only the first and last element of `obs` and `rewards`: the engine
//! then does O(1) work per step whatever the payload size, which is what the transport
//! benchmark wants to measure.

use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::{DType, Direction, TensorId};
use crate::tensor::Tensors;

use super::reference::Reference;
use super::vec_env::{EnvOptions, VecEnv};
use crate::command::{CommandError, CommandHandler, Reply, ResetRequest};

/// The value of flat element `index` of `obs` in frame `seq`: exact in f32 (< 2^24).
#[inline]
pub fn pattern(seq: u64, index: u64) -> f32 {
    pattern_bits(seq, index) as f32
}

/// The byte of flat element `index` of `rgb` in frame `seq`: the pattern's low byte.
#[inline]
pub fn pattern_u8(seq: u64, index: u64) -> u8 {
    pattern_bits(seq, index) as u8
}

#[inline]
fn pattern_bits(seq: u64, index: u64) -> u32 {
    (seq.wrapping_mul(2_654_435_761).wrapping_add(index) & 0x00FF_FFFF) as u32
}

/// `null`'s options ([`NullEnv::configured`]).
#[derive(Debug, Clone)]
pub struct NullOptions {
    /// Observation size per env, in f32 elements (default 16).
    pub obs_dim: u64,
    /// Action size per env, in f32 elements (default 1).
    pub act_dim: u64,
    /// Write the pattern to the first and last element of each tensor only.
    pub sparse: bool,
    /// Also serve an `rgb` u8 tensor of shape `(num_envs, h, w, c)`.
    pub image: Option<[u64; 3]>,
    /// The envs are the region's `first_env..` (a shard's slice).
    pub first_env: u32,
}

impl Reference for NullEnv {
    const NAME: &'static str = "null";
    const DESCRIPTION: &'static str =
        "the transport floor and integrity check: a known pattern in every frame";
    type Options = NullOptions;

    fn options(flags: &EnvOptions) -> NullOptions {
        NullOptions {
            obs_dim: flags.obs_dim.unwrap_or(16),
            act_dim: flags.act_dim.unwrap_or(1),
            sparse: flags.sparse,
            image: flags.image,
            first_env: flags.first_env,
        }
    }

    fn spec(num_envs: u32, options: &NullOptions) -> Result<EngineSpec> {
        Ok(NullEnv::configured(num_envs, options)?.spec())
    }

    fn build(num_envs: u32, options: &NullOptions) -> Result<Box<dyn VecEnv>> {
        Ok(Box::new(NullEnv::configured(num_envs, options)?))
    }
}

#[derive(Debug)]
pub struct NullEnv {
    // The configuration is read by the GPU `null` (envs::gpu), which serves the same spec.
    pub(super) num_envs: u32,
    pub(super) obs_dim: u64,
    pub(super) act_dim: u64,
    pub(super) sparse: bool,
    /// `(h, w, c)` of the `rgb` tensor, if served.
    pub(super) image: Option<[u64; 3]>,
    /// Global index of this env vector's first env (a shard's slice starts there): the
    /// pattern runs over the region's flat element index, whichever shard writes it.
    pub(super) first_env: u64,
    /// obs, actions, rewards, resolved on `reset`.
    ids: Option<[TensorId; 3]>,
    rgb: Option<TensorId>,
}

impl NullEnv {
    pub fn new(num_envs: u32, obs_dim: u64, act_dim: u64, sparse: bool) -> Result<Self> {
        if obs_dim == 0 || act_dim == 0 {
            return Err(Error::InvalidSpec(
                "null: obs_dim and act_dim must be at least 1".into(),
            ));
        }
        Ok(NullEnv {
            num_envs,
            obs_dim,
            act_dim,
            sparse,
            image: None,
            first_env: 0,
            ids: None,
            rgb: None,
        })
    }

    /// The `null` env `options` describe (its configuration; the GPU `null` serves the
    /// same).
    pub fn configured(num_envs: u32, options: &NullOptions) -> Result<NullEnv> {
        let env = NullEnv::new(num_envs, options.obs_dim, options.act_dim, options.sparse)?
            .with_first_env(options.first_env);
        match options.image {
            Some(shape) => env.with_image(shape),
            None => Ok(env),
        }
    }

    /// The envs are the region's `first_env..first_env + num_envs` (a shard's slice).
    pub fn with_first_env(mut self, first_env: u32) -> Self {
        self.first_env = u64::from(first_env);
        self
    }

    /// Also serve `rgb`, `u8` of shape `(num_envs, h, w, c)`.
    pub fn with_image(mut self, shape: [u64; 3]) -> Result<Self> {
        if shape.contains(&0) {
            return Err(Error::InvalidSpec(
                "null: every image dimension must be at least 1".into(),
            ));
        }
        self.image = Some(shape);
        Ok(self)
    }

    fn write(&self, seq: u64, io: &mut Tensors<'_>, obs: TensorId) -> Result<()> {
        let at = self.first_env * self.obs_dim;
        fill(self.sparse, io.write::<f32>(obs)?, |i| pattern(seq, at + i));
        if let (Some(rgb), Some([h, w, c])) = (self.rgb, self.image) {
            let at = self.first_env * h * w * c;
            fill(self.sparse, io.write::<u8>(rgb)?, |i| {
                pattern_u8(seq, at + i)
            });
        }
        Ok(())
    }
}

/// Writes `value(index)` to every element, or to the first and last only when sparse.
fn fill<T>(sparse: bool, out: &mut [T], value: impl Fn(u64) -> T) {
    if sparse {
        let last = out.len() - 1;
        out[0] = value(0);
        out[last] = value(last as u64);
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = value(i as u64);
        }
    }
}

/// `null` takes a bare `Reset` only (every env at once, no seeds: the pattern has neither).
pub(super) fn check_reset(req: &ResetRequest) -> Result<(), CommandError> {
    if req.env_ids.is_some() || !req.seeds.is_empty() {
        return Err(CommandError::unsupported(
            "null resets all envs at once and takes no seeds",
        ));
    }
    Ok(())
}

/// The engine-defined methods of `null` (CPU and GPU): `echo`.
pub(super) fn call_method(
    method: &str,
    args: &[(String, String)],
    payload: &[u8],
) -> Result<Reply, CommandError> {
    match method {
        "echo" => Ok(Reply {
            args: args.to_vec(),
            payload: payload.to_vec(),
        }),
        other => Err(CommandError::unknown_method(other, &["echo"])),
    }
}

impl CommandHandler for NullEnv {
    /// `Reset` of every env at once, without seeds (the pattern has neither).
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        check_reset(req)?;
        self.reset_all(io).map_err(CommandError::engine)
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        payload: &[u8],
    ) -> Result<Reply, CommandError> {
        call_method(method, args, payload)
    }
}

impl VecEnv for NullEnv {
    fn spec(&self) -> EngineSpec {
        let spec = EngineSpec::standard(
            "null",
            self.num_envs,
            self.obs_dim,
            self.act_dim,
            DType::F32,
        );
        match self.image {
            Some([h, w, c]) => spec.tensor(
                "rgb",
                DType::U8,
                &[self.num_envs as u64, h, w, c],
                Direction::EngineToClient,
            ),
            None => spec,
        }
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        let ids = [io.id("obs")?, io.id("actions")?, io.id("rewards")?];
        self.ids = Some(ids);
        self.rgb = match self.image {
            Some(_) => Some(io.id("rgb")?),
            None => None,
        };
        self.write(0, io, ids[0])
    }

    fn step(&mut self, seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        let [obs, actions, rewards] = self
            .ids
            .ok_or(Error::OutOfOrder("null: step() before reset()"))?;
        self.write(seq, io, obs)?;
        let actions = io.read::<f32>(actions)?;
        let rewards = io.write::<f32>(rewards)?;
        let a = self.act_dim as usize;
        if self.sparse {
            let last = rewards.len() - 1;
            rewards[0] = actions[0];
            rewards[last] = actions[last * a];
        } else {
            for (i, r) in rewards.iter_mut().enumerate() {
                *r = actions[i * a];
            }
        }
        Ok(())
    }
}
