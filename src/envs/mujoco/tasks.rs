//! The Gymnasium MuJoCo tasks the native engine serves, each as Gymnasium 1.x's `-v5`
//! class defines it (`gymnasium/envs/mujoco/*_v5.py`, default arguments): the model file,
//! the frame skip, the observation, the reward, the termination and the reset noise.

/// How a task perturbs `init_qpos`/`init_qvel` (the model's `qpos0` and zeros) at reset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResetNoise {
    /// `qpos += U(-s, s)`, `qvel += U(-s, s)` (InvertedPendulum, Hopper, Walker2d).
    Uniform(f64),
    /// `qpos += U(-s, s)`, `qvel += s * N(0, 1)` (HalfCheetah).
    UniformNormal(f64),
}

/// When an episode terminates, and the reward it adds for staying alive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Health {
    /// Never terminates (HalfCheetah).
    Always,
    /// InvertedPendulum: terminated when the observation is not finite or
    /// `|qpos[1]| > 0.2`; the reward is 1 while not terminated, else 0.
    Pendulum,
    /// Hopper, Walker2d: healthy while `z = qpos[1]` and `angle = qpos[2]` lie strictly
    /// inside their ranges and (Hopper) every element of `(qpos, qvel)[2..]` inside
    /// `state`; terminated when not healthy; `reward` added while healthy.
    Upright {
        reward: f64,
        z: (f64, f64),
        angle: (f64, f64),
        state: Option<(f64, f64)>,
    },
}

/// One Gymnasium task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Task {
    /// The Gymnasium id (`HalfCheetah-v5`); the engine's name is `mujoco/<id>`.
    pub id: &'static str,
    /// The model file in Gymnasium's `envs/mujoco/assets/`.
    pub xml: &'static str,
    pub frame_skip: u32,
    pub noise: ResetNoise,
    /// Leading elements of `qpos` left out of the observation (the x position: 1).
    pub skip_qpos: usize,
    /// `qvel` clipped to `[-c, c]` in the observation.
    pub clip_qvel: Option<f64>,
    /// Weight of `(x_after - x_before) / dt` in the reward (0: none).
    pub forward_weight: f64,
    /// Weight of `sum(action^2)`, subtracted from the reward.
    pub ctrl_cost_weight: f64,
    pub health: Health,
    /// Truncation (the registered `max_episode_steps`).
    pub max_steps: u32,
}

pub const TASKS: &[Task] = &[
    Task {
        id: "HalfCheetah-v5",
        xml: "half_cheetah.xml",
        frame_skip: 5,
        noise: ResetNoise::UniformNormal(0.1),
        skip_qpos: 1,
        clip_qvel: None,
        forward_weight: 1.0,
        ctrl_cost_weight: 0.1,
        health: Health::Always,
        max_steps: 1000,
    },
    Task {
        id: "InvertedPendulum-v5",
        xml: "inverted_pendulum.xml",
        frame_skip: 2,
        noise: ResetNoise::Uniform(0.01),
        skip_qpos: 0,
        clip_qvel: None,
        forward_weight: 0.0,
        ctrl_cost_weight: 0.0,
        health: Health::Pendulum,
        max_steps: 1000,
    },
    Task {
        id: "Hopper-v5",
        xml: "hopper.xml",
        frame_skip: 4,
        noise: ResetNoise::Uniform(5e-3),
        skip_qpos: 1,
        clip_qvel: Some(10.0),
        forward_weight: 1.0,
        ctrl_cost_weight: 1e-3,
        health: Health::Upright {
            reward: 1.0,
            z: (0.7, f64::INFINITY),
            angle: (-0.2, 0.2),
            state: Some((-100.0, 100.0)),
        },
        max_steps: 1000,
    },
    Task {
        id: "Walker2d-v5",
        xml: "walker2d_v5.xml",
        frame_skip: 4,
        noise: ResetNoise::Uniform(5e-3),
        skip_qpos: 1,
        clip_qvel: Some(10.0),
        forward_weight: 1.0,
        ctrl_cost_weight: 1e-3,
        health: Health::Upright {
            reward: 1.0,
            z: (0.8, 2.0),
            angle: (-1.0, 1.0),
            state: None,
        },
        max_steps: 1000,
    },
];

/// The task named `id` (`HalfCheetah-v5`).
pub fn task(id: &str) -> Option<&'static Task> {
    TASKS.iter().find(|t| t.id == id)
}

impl Task {
    /// The observation's length for a model with `nq` positions and `nv` velocities.
    pub fn obs_dim(&self, nq: usize, nv: usize) -> usize {
        nq - self.skip_qpos + nv
    }

    /// Writes the observation of `(qpos, qvel)` into `out` (`obs_dim` elements).
    pub fn observe(&self, qpos: &[f64], qvel: &[f64], out: &mut [f32]) {
        let (pos, vel) = out.split_at_mut(qpos.len() - self.skip_qpos);
        for (o, q) in pos.iter_mut().zip(&qpos[self.skip_qpos..]) {
            *o = *q as f32;
        }
        for (o, v) in vel.iter_mut().zip(qvel) {
            let v = match self.clip_qvel {
                Some(c) => v.clamp(-c, c),
                None => *v,
            };
            *o = v as f32;
        }
    }

    /// `(reward, terminated)` of a step that moved the x position from `x_before` to
    /// the current `qpos[0]` in `dt` seconds with `action`, in Gymnasium's order of
    /// operations.
    pub fn outcome(
        &self,
        x_before: f64,
        dt: f64,
        action: &[f32],
        qpos: &[f64],
        qvel: &[f64],
    ) -> (f64, bool) {
        let ctrl_cost =
            self.ctrl_cost_weight * action.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>();
        let forward = if self.forward_weight != 0.0 {
            self.forward_weight * ((qpos[0] - x_before) / dt)
        } else {
            0.0
        };
        match self.health {
            Health::Always => (forward - ctrl_cost, false),
            Health::Pendulum => {
                let finite = qpos.iter().chain(qvel).all(|v| v.is_finite());
                let terminated = !finite || qpos[1].abs() > 0.2;
                (if terminated { 0.0 } else { 1.0 }, terminated)
            }
            Health::Upright {
                reward,
                z,
                angle,
                state,
            } => {
                let inside = |v: f64, (lo, hi): (f64, f64)| lo < v && v < hi;
                let healthy = inside(qpos[1], z)
                    && inside(qpos[2], angle)
                    && state.is_none_or(|range| {
                        qpos.iter().chain(qvel).skip(2).all(|v| inside(*v, range))
                    });
                let alive = if healthy { reward } else { 0.0 };
                ((forward + alive) - ctrl_cost, !healthy)
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn hopper_terminates_when_it_falls_and_adds_the_healthy_reward_while_up() {
        let hopper = task("Hopper-v5").unwrap();
        let up = [0.0, 1.25, 0.0, 0.0, 0.0, 0.0];
        let fallen = [0.0, 0.5, 0.0, 0.0, 0.0, 0.0];
        let still = [0.0; 6];
        let (r, t) = hopper.outcome(0.0, 0.008, &[0.0; 3], &up, &still);
        assert_eq!((r, t), (1.0, false));
        let (r, t) = hopper.outcome(0.0, 0.008, &[0.0; 3], &fallen, &still);
        assert_eq!((r, t), (0.0, true));
        // A velocity out of the state range ends it too.
        let fast = [0.0, 0.0, 0.0, 200.0, 0.0, 0.0];
        assert!(hopper.outcome(0.0, 0.008, &[0.0; 3], &up, &fast).1);
    }

    #[test]
    fn the_observation_skips_x_and_clips_velocities() {
        let hopper = task("Hopper-v5").unwrap();
        let mut out = [0f32; 11];
        let qpos = [5.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let qvel = [20.0, -20.0, 1.0, 0.0, 0.0, 0.0];
        hopper.observe(&qpos, &qvel, &mut out);
        assert_eq!(
            out,
            [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, -10.0, 1.0, 0.0, 0.0, 0.0]
        );
    }
}
