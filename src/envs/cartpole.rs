//! `cartpole`: Gymnasium CartPole-v1, vectorised. Same constants and Euler integration,
//! termination at |x| > 2.4 or |theta| > 12 degrees, truncation at 500 steps, reward 1
//! per step. Each env has its own PCG stream; as in Gymnasium's vector envs, a seed `s`
//! seeds env `i` with `s + i`, and a list seeds each env with its own entry, so a seed
//! fixes every env's episodes.
//!
//! Engine-defined method: `set_pole_length(length=<metres>)` changes the half-length of
//! every pole (Gymnasium's `length`, default 0.5) and answers `previous=<old length>`.
//!
//! Actions: `actions [N, 1] i64`, 0 pushes left, anything else pushes right.
//! Autoreset in the same step: an env that terminated or truncated is reset at once, its
//! frame holds the new episode's first observation along with the finished step's reward
//! and flags. `reset_mask[i]` set: env i is reset before the step and its frame holds the
//! reset observation, reward 0 and no flags (the action is ignored).
//!
//! `final_obs [N, 4] f32` holds what each env's step produced before any autoreset: the
//! same as `obs` except for the envs that finished this step, where it is the episode's
//! last observation (Gymnasium's `final_obs`), for bootstrapping truncated episodes.
//!
//! Every episode that ends (terminated or truncated, not one cut short by `reset_mask`
//! or a `Reset` command) is recorded in the region's stats area (`Tensors::episode_ended`:
//! its return, which is its length, and its length), for observers.

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg32;

use crate::engine::EngineSpec;
use crate::error::{Error, Result};
use crate::layout::{DType, Direction};
use crate::tensor::Tensors;

use super::reference::Reference;
use super::vec_env::{EnvOptions, VecEnv};
use crate::command::{arg, CommandError, CommandHandler, Reply, ResetRequest};

fn join(values: [f64; 4]) -> String {
    values.map(|v| format!("{v}")).join(",")
}

pub const GRAVITY: f64 = 9.8;
pub const MASS_CART: f64 = 1.0;
pub const MASS_POLE: f64 = 0.1;
pub const TOTAL_MASS: f64 = MASS_CART + MASS_POLE;
pub const LENGTH: f64 = 0.5;
pub const POLE_MASS_LENGTH: f64 = MASS_POLE * LENGTH;
pub const FORCE_MAG: f64 = 10.0;
pub const TAU: f64 = 0.02;
pub const THETA_THRESHOLD: f64 = 12.0 * 2.0 * std::f64::consts::PI / 360.0;
pub const X_THRESHOLD: f64 = 2.4;
pub const MAX_STEPS: u32 = 500;

/// One Euler step of CartPole-v1's dynamics.
pub fn dynamics(s: [f64; 4], push_right: bool) -> [f64; 4] {
    dynamics_with(s, push_right, LENGTH)
}

/// One Euler step with pole half-length `length`.
pub fn dynamics_with(s: [f64; 4], push_right: bool, length: f64) -> [f64; 4] {
    let [x, x_dot, theta, theta_dot] = s;
    let pole_mass_length = MASS_POLE * length;
    let force = if push_right { FORCE_MAG } else { -FORCE_MAG };
    let (sin, cos) = theta.sin_cos();
    let temp = (force + pole_mass_length * theta_dot * theta_dot * sin) / TOTAL_MASS;
    let theta_acc =
        (GRAVITY * sin - cos * temp) / (length * (4.0 / 3.0 - MASS_POLE * cos * cos / TOTAL_MASS));
    let x_acc = temp - pole_mass_length * theta_acc * cos / TOTAL_MASS;
    [
        x + TAU * x_dot,
        x_dot + TAU * x_acc,
        theta + TAU * theta_dot,
        theta_dot + TAU * theta_acc,
    ]
}

pub fn is_terminal(s: &[f64; 4]) -> bool {
    s[0] < -X_THRESHOLD || s[0] > X_THRESHOLD || s[2] < -THETA_THRESHOLD || s[2] > THETA_THRESHOLD
}

#[derive(Debug)]
pub struct CartPole {
    num_envs: u32,
    state: Vec<[f64; 4]>,
    steps: Vec<u32>,
    rngs: Vec<Pcg32>,
    length: f64,
}

impl CartPole {
    /// `num_envs` envs, env `i` seeded with `seed + i` (wrapping). Its state is as large
    /// as its region: memory it cannot get is `InvalidSpec`, never an abort.
    pub fn new(num_envs: u32, seed: u64) -> Result<Self> {
        let n = num_envs as usize;
        let mut env = CartPole {
            num_envs,
            state: allocate(n)?,
            steps: allocate(n)?,
            rngs: allocate(n)?,
            length: LENGTH,
        };
        env.state.resize(n, [0.0; 4]);
        env.steps.resize(n, 0);
        env.rngs
            .extend((0..n as u64).map(|i| Pcg32::seed_from_u64(seed.wrapping_add(i))));
        for i in 0..n {
            env.reset_one(i);
        }
        Ok(env)
    }

    fn reset_one(&mut self, i: usize) {
        let rng = &mut self.rngs[i];
        self.state[i] = std::array::from_fn(|_| rng.random_range(-0.05..0.05));
        self.steps[i] = 0;
    }

    /// The state of every env (for tests).
    pub fn states(&self) -> &[[f64; 4]] {
        &self.state
    }

    /// The steps each env's episode has taken: 0 for an env whose episode starts with
    /// its current observation (reset, or autoreset by the last step).
    pub fn episode_steps(&self) -> &[u32] {
        &self.steps
    }

    fn write_obs(&self, obs: &mut [f32]) {
        for (o, s) in obs.chunks_exact_mut(4).zip(&self.state) {
            write_state(o, s);
        }
    }
}

/// An empty vector with room for `n` elements, or `InvalidSpec` if the memory is not there.
fn allocate<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::InvalidSpec(format!(
            "cartpole: no memory for the state of {n} envs ({} bytes)",
            (n as u128) * std::mem::size_of::<T>() as u128
        ))
    })?;
    Ok(v)
}

fn write_state(out: &mut [f32], state: &[f64; 4]) {
    for (o, s) in out.iter_mut().zip(state) {
        *o = *s as f32;
    }
}

/// The tensors and metadata of a `cartpole` engine with `num_envs` envs, in host memory
/// (the GPU engine places the same ones on its device).
pub fn spec(num_envs: u32) -> EngineSpec {
    spec_of("cartpole", num_envs)
}

/// [`spec`] under another engine kind (`pixels` serves the same tensors and more).
pub fn spec_of(kind: &str, num_envs: u32) -> EngineSpec {
    let high = [
        X_THRESHOLD * 2.0,
        f64::INFINITY,
        THETA_THRESHOLD * 2.0,
        f64::INFINITY,
    ];
    EngineSpec::standard(kind, num_envs, 4, 1, DType::I64)
        .metadata("env_id", "CartPole-v1")
        .metadata("autoreset_mode", "same-step")
        .metadata("observation_low", &join(high.map(|h| -h)))
        .metadata("observation_high", &join(high))
        .metadata("action_space", "discrete:2")
        .metadata("max_episode_steps", &MAX_STEPS.to_string())
        .metadata("final_obs", "final_obs")
        .tensor(
            "final_obs",
            DType::F32,
            &[num_envs as u64, 4],
            Direction::EngineToClient,
        )
}

/// The engine-defined methods of `cartpole` (CPU and GPU): `set_pole_length` sets
/// `*length` and answers the previous one.
pub fn call_method(
    length: &mut f64,
    method: &str,
    args: &[(String, String)],
) -> Result<Reply, CommandError> {
    match method {
        "set_pole_length" => {
            let new: f64 = arg(args, "length")?;
            if !(new.is_finite() && new > 0.0 && new <= 100.0) {
                return Err(CommandError::bad_request(format!(
                    "length must be in (0, 100] metres, not {new}"
                )));
            }
            let previous = std::mem::replace(length, new);
            Ok(Reply::args(vec![("previous".into(), previous.to_string())]))
        }
        other => Err(CommandError::unknown_method(other, &["set_pole_length"])),
    }
}

/// `cartpole`'s options.
#[derive(Debug, Clone, Copy)]
pub struct CartPoleOptions {
    /// Env `e` draws from a stream seeded with `seed + e` (wrapping).
    pub seed: u64,
}

impl Reference for CartPole {
    const NAME: &'static str = "cartpole";
    const DESCRIPTION: &'static str = "Gymnasium CartPole-v1 dynamics, vectorised";
    type Options = CartPoleOptions;

    /// A shard's slice (`first_env`) seeds its envs as the whole region would.
    fn options(flags: &EnvOptions) -> CartPoleOptions {
        CartPoleOptions {
            seed: flags.seed.wrapping_add(u64::from(flags.first_env)),
        }
    }

    fn spec(num_envs: u32, _: &CartPoleOptions) -> Result<EngineSpec> {
        Ok(spec(num_envs))
    }

    fn build(num_envs: u32, options: &CartPoleOptions) -> Result<Box<dyn VecEnv>> {
        Ok(Box::new(CartPole::new(num_envs, options.seed)?))
    }
}

impl VecEnv for CartPole {
    fn spec(&self) -> EngineSpec {
        spec(self.num_envs)
    }

    fn reset_all(&mut self, io: &mut Tensors<'_>) -> Result<()> {
        self.write_obs(io.write::<f32>("obs")?);
        self.write_obs(io.write::<f32>("final_obs")?);
        Ok(())
    }

    fn step(&mut self, _seq: u64, io: &mut Tensors<'_>) -> Result<()> {
        let actions = io.read::<i64>("actions")?;
        let reset_mask = io.read::<u8>("reset_mask")?;
        let rewards = io.write::<f32>("rewards")?;
        let terminated = io.write::<u8>("terminated")?;
        let truncated = io.write::<u8>("truncated")?;
        let final_obs = io.write::<f32>("final_obs")?;
        for i in 0..self.num_envs as usize {
            if reset_mask[i] != 0 {
                self.reset_one(i);
                rewards[i] = 0.0;
                terminated[i] = 0;
                truncated[i] = 0;
            } else {
                self.state[i] = dynamics_with(self.state[i], actions[i] != 0, self.length);
                self.steps[i] += 1;
                let term = is_terminal(&self.state[i]);
                let trunc = self.steps[i] >= MAX_STEPS;
                rewards[i] = 1.0;
                terminated[i] = term as u8;
                truncated[i] = trunc as u8;
                if term || trunc {
                    // What the step produced, before the autoreset replaces it: the
                    // learner bootstraps a truncated episode from this.
                    write_state(&mut final_obs[4 * i..4 * i + 4], &self.state[i]);
                    // Reward 1 per step: the return is the length. For observers.
                    let length = u64::from(self.steps[i]);
                    io.episode_ended(i, length as f64, length)?;
                    self.reset_one(i);
                    continue;
                }
            }
            write_state(&mut final_obs[4 * i..4 * i + 4], &self.state[i]);
        }
        self.write_obs(io.write::<f32>("obs")?);
        Ok(())
    }
}

impl CommandHandler for CartPole {
    /// `Reset`: the listed envs (all if none), reseeded as Gymnasium does.
    fn reset(&mut self, io: &mut Tensors<'_>, req: &ResetRequest) -> Result<(), CommandError> {
        let (ids, seeds) = req.plan(self.num_envs)?;
        for (k, &i) in ids.iter().enumerate() {
            if let Some(seeds) = &seeds {
                self.rngs[i as usize] = Pcg32::seed_from_u64(seeds[k]);
            }
            self.reset_one(i as usize);
        }
        self.write_obs(io.write::<f32>("obs").map_err(CommandError::engine)?);
        self.write_obs(io.write::<f32>("final_obs").map_err(CommandError::engine)?);
        Ok(())
    }

    fn call(
        &mut self,
        _io: &mut Tensors<'_>,
        method: &str,
        args: &[(String, String)],
        _payload: &[u8],
    ) -> Result<Reply, CommandError> {
        call_method(&mut self.length, method, args)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pushing_one_way_terminates_within_a_few_dozen_steps() {
        let mut s = [0.0, 0.0, 0.01, 0.0];
        let mut n = 0;
        while !is_terminal(&s) {
            s = dynamics(s, true);
            n += 1;
            assert!(n < 200);
        }
        assert!(n > 5, "{n}");
    }

    #[test]
    fn same_seed_same_starts_other_seed_other_starts() {
        let a = CartPole::new(8, 7).unwrap();
        let b = CartPole::new(8, 7).unwrap();
        let c = CartPole::new(8, 8).unwrap();
        assert_eq!(a.states(), b.states());
        assert_ne!(a.states(), c.states());
        for s in a.states() {
            assert!(s.iter().all(|v| (-0.05..0.05).contains(v)));
        }
        // Envs of one engine differ from each other.
        assert_ne!(a.states()[0], a.states()[1]);
    }
}
