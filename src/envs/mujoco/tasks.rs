//! The Gymnasium MuJoCo tasks the native engine serves, each as Gymnasium 1.x's `-v5`
//! class defines it (`gymnasium/envs/mujoco/*_v5.py`, default arguments): the model file,
//! the frame skip, the observation, the reward, the termination and the reset noise:
//! HalfCheetah, InvertedPendulum, Hopper, Walker2d, Ant and Humanoid; and [`RAW`], any
//! MJCF file as a task (`mujoco/raw`).

/// The prefix of the engine names (`mujoco/HalfCheetah-v5`).
pub const PREFIX: &str = "mujoco/";

/// An env's MuJoCo data, on the model all of an engine's envs share.
pub(super) type Data = mujoco_rs::wrappers::MjData<std::sync::Arc<mujoco_rs::wrappers::MjModel>>;

/// How a task perturbs `init_qpos`/`init_qvel` (the model's `qpos0` and zeros) at reset.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ResetNoise {
    /// None: the model's initial state (`qpos0`, zero velocities) (`mujoco/raw`).
    None,
    /// `qpos += U(-s, s)`, `qvel += U(-s, s)` (InvertedPendulum, Hopper, Walker2d).
    Uniform(f64),
    /// `qpos += U(-s, s)`, `qvel += s * N(0, 1)` (HalfCheetah).
    UniformNormal(f64),
}

/// Whose x position the forward reward differentiates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Position {
    /// `qpos[0]` (HalfCheetah, Hopper, Walker2d).
    Qpos0,
    /// The x of body `b`'s frame, `xpos[b][0]` (Ant: the torso, body 1).
    Body(usize),
    /// The x of the mass centre, `sum(body_mass * xipos) / sum(body_mass)` (Humanoid).
    MassCenter,
    /// None: no forward reward (`mujoco/raw`).
    None,
}

/// What the observation holds after `qpos[skip_qpos..]` and `qvel`, in this order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Extra {
    /// `cinert[1..]`, 10 per body.
    Cinert,
    /// `cvel[1..]`, 6 per body.
    Cvel,
    /// `qfrc_actuator[6..]`.
    QfrcActuator,
    /// `cfrc_ext[1..]`, 6 per body, clipped to the range where given.
    CfrcExt(Option<(f64, f64)>),
    /// `sensordata`, every sensor's outputs in the model's order.
    Sensordata,
}

/// The contact cost subtracted from the reward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Contact {
    None,
    /// Ant: `weight * sum(clip(cfrc_ext, lo, hi)^2)` over every body.
    Clipped {
        weight: f64,
        range: (f64, f64),
    },
    /// Humanoid: `min(weight * sum(cfrc_ext^2), max)` over every body.
    Capped {
        weight: f64,
        max: f64,
    },
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
    /// Ant, Humanoid: healthy while `z = qpos[2]` lies in `z` (bounds included for Ant,
    /// `inclusive`, excluded for Humanoid) and (Ant, `finite`) `(qpos, qvel)` is finite.
    Height {
        reward: f64,
        z: (f64, f64),
        inclusive: bool,
        finite: bool,
    },
}

/// What a task reads of one env's `mjData` for its observation, reward and termination.
#[derive(Debug, Clone, Copy)]
pub struct State<'a> {
    pub qpos: &'a [f64],
    pub qvel: &'a [f64],
    pub cinert: &'a [[f64; 10]],
    pub cvel: &'a [[f64; 6]],
    pub qfrc_actuator: &'a [f64],
    pub cfrc_ext: &'a [[f64; 6]],
    pub sensordata: &'a [f64],
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
    pub position: Position,
    pub extras: &'static [Extra],
    pub contact: Contact,
    /// Truncation (the registered `max_episode_steps`).
    pub max_steps: u32,
}

/// The default truncation of `mujoco/raw` (`max_episode_steps` sets another).
pub const RAW_MAX_STEPS: u32 = 1000;

/// `mujoco/raw`: any MJCF file (`--model`). The observation is `qpos`, `qvel` and
/// `sensordata`; the reward 0; the action `ctrl`; one `mj_step` a step; no termination,
/// truncation at `max_episode_steps`; reset to the model's initial state, no noise.
pub const RAW: Task = Task {
    id: "raw",
    xml: "",
    frame_skip: 1,
    noise: ResetNoise::None,
    skip_qpos: 0,
    clip_qvel: None,
    forward_weight: 0.0,
    ctrl_cost_weight: 0.0,
    health: Health::Always,
    position: Position::None,
    extras: &[Extra::Sensordata],
    contact: Contact::None,
    max_steps: RAW_MAX_STEPS,
};

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
        position: Position::Qpos0,
        extras: &[],
        contact: Contact::None,
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
        position: Position::Qpos0,
        extras: &[],
        contact: Contact::None,
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
        position: Position::Qpos0,
        extras: &[],
        contact: Contact::None,
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
        position: Position::Qpos0,
        extras: &[],
        contact: Contact::None,
        max_steps: 1000,
    },
    Task {
        id: "Ant-v5",
        xml: "ant.xml",
        frame_skip: 5,
        noise: ResetNoise::UniformNormal(0.1),
        skip_qpos: 2,
        clip_qvel: None,
        forward_weight: 1.0,
        ctrl_cost_weight: 0.5,
        health: Health::Height {
            reward: 1.0,
            z: (0.2, 1.0),
            inclusive: true,
            finite: true,
        },
        position: Position::Body(1),
        extras: &[Extra::CfrcExt(Some((-1.0, 1.0)))],
        contact: Contact::Clipped {
            weight: 5e-4,
            range: (-1.0, 1.0),
        },
        max_steps: 1000,
    },
    Task {
        id: "Humanoid-v5",
        xml: "humanoid.xml",
        frame_skip: 5,
        noise: ResetNoise::Uniform(1e-2),
        skip_qpos: 2,
        clip_qvel: None,
        forward_weight: 1.25,
        ctrl_cost_weight: 0.1,
        health: Health::Height {
            reward: 5.0,
            z: (1.0, 2.0),
            inclusive: false,
            finite: false,
        },
        position: Position::MassCenter,
        extras: &[
            Extra::Cinert,
            Extra::Cvel,
            Extra::QfrcActuator,
            Extra::CfrcExt(None),
        ],
        contact: Contact::Capped {
            weight: 5e-7,
            max: 10.0,
        },
        max_steps: 1000,
    },
];

/// The task named `id` (`HalfCheetah-v5`).
pub fn task(id: &str) -> Option<&'static Task> {
    TASKS.iter().find(|t| t.id == id)
}

impl Task {
    /// The positions (`qpos` elements) and bodies (the world included) a model needs for
    /// this task: what its observation, reward and health read by index.
    pub fn needs(&self) -> (usize, usize) {
        let health = match self.health {
            Health::Always => 0,
            Health::Pendulum => 2,
            Health::Upright { .. } | Health::Height { .. } => 3,
        };
        let bodies = match self.position {
            Position::Body(b) => b + 1,
            Position::Qpos0 | Position::MassCenter | Position::None => 1,
        };
        (health.max(self.skip_qpos), bodies)
    }

    /// The observation's length for a model with `nq` positions, `nv` velocities,
    /// `nbody` bodies (the world included) and `nsensordata` sensor outputs.
    pub fn obs_dim(&self, nq: usize, nv: usize, nbody: usize, nsensordata: usize) -> usize {
        let bodies = nbody.saturating_sub(1);
        let extra: usize = self
            .extras
            .iter()
            .map(|e| match e {
                Extra::Cinert => 10 * bodies,
                Extra::Cvel | Extra::CfrcExt(_) => 6 * bodies,
                Extra::QfrcActuator => nv.saturating_sub(6),
                Extra::Sensordata => nsensordata,
            })
            .sum();
        nq - self.skip_qpos + nv + extra
    }

    /// Writes the observation of `s` into `out` (`obs_dim` elements; a shorter `out`
    /// gets the first ones).
    pub fn observe(&self, s: &State<'_>, out: &mut [f32]) {
        let clip = |v: f64, range: Option<(f64, f64)>| match range {
            Some((lo, hi)) => v.clamp(lo, hi),
            None => v,
        };
        let mut slots = out.iter_mut();
        let mut put = |values: &mut dyn Iterator<Item = f64>| {
            // `values` first: zip stops at its end without taking another slot.
            for (v, o) in values.zip(&mut slots) {
                *o = v as f32;
            }
        };
        put(&mut s.qpos[self.skip_qpos..].iter().copied());
        let qvel_range = self.clip_qvel.map(|c| (-c, c));
        put(&mut s.qvel.iter().map(|v| clip(*v, qvel_range)));
        for extra in self.extras {
            match *extra {
                Extra::Cinert => put(&mut s.cinert.iter().skip(1).flatten().copied()),
                Extra::Cvel => put(&mut s.cvel.iter().skip(1).flatten().copied()),
                Extra::QfrcActuator => put(&mut s.qfrc_actuator.iter().skip(6).copied()),
                Extra::CfrcExt(range) => {
                    put(&mut s.cfrc_ext.iter().skip(1).flatten().map(|v| clip(*v, range)))
                }
                Extra::Sensordata => put(&mut s.sensordata.iter().copied()),
            }
        }
    }

    /// `(reward, terminated)` of a step that moved the x position from `x_before` to
    /// `x_after` in `dt` seconds with `action`, ending in `s`, in Gymnasium's order of
    /// operations: `(forward + healthy) - (control + contact)`.
    pub fn outcome(
        &self,
        x_before: f64,
        x_after: f64,
        dt: f64,
        action: &[f32],
        s: &State<'_>,
    ) -> (f64, bool) {
        let (qpos, qvel) = (s.qpos, s.qvel);
        // Without a control cost (`mujoco/raw`), none: `0 * NaN` of a non-finite action
        // would be a NaN reward.
        let ctrl_cost = if self.ctrl_cost_weight != 0.0 {
            self.ctrl_cost_weight * action.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>()
        } else {
            0.0
        };
        let forward = if self.forward_weight != 0.0 {
            self.forward_weight * ((x_after - x_before) / dt)
        } else {
            0.0
        };
        let squares = |range: Option<(f64, f64)>| {
            s.cfrc_ext
                .iter()
                .flatten()
                .map(|v| match range {
                    Some((lo, hi)) => v.clamp(lo, hi).powi(2),
                    None => v.powi(2),
                })
                .sum::<f64>()
        };
        let contact_cost = match self.contact {
            Contact::None => 0.0,
            Contact::Clipped { weight, range } => weight * squares(Some(range)),
            Contact::Capped { weight, max } => (weight * squares(None)).min(max),
        };
        let inside = |v: f64, (lo, hi): (f64, f64)| lo < v && v < hi;
        let (alive, terminated) = match self.health {
            Health::Always => (0.0, false),
            Health::Pendulum => {
                let finite = qpos.iter().chain(qvel).all(|v| v.is_finite());
                let terminated = !finite || qpos[1].abs() > 0.2;
                return (if terminated { 0.0 } else { 1.0 }, terminated);
            }
            Health::Upright {
                reward,
                z,
                angle,
                state,
            } => {
                let healthy = inside(qpos[1], z)
                    && inside(qpos[2], angle)
                    && state.is_none_or(|range| {
                        qpos.iter().chain(qvel).skip(2).all(|v| inside(*v, range))
                    });
                (if healthy { reward } else { 0.0 }, !healthy)
            }
            Health::Height {
                reward,
                z,
                inclusive,
                finite,
            } => {
                let in_range = if inclusive {
                    z.0 <= qpos[2] && qpos[2] <= z.1
                } else {
                    inside(qpos[2], z)
                };
                let healthy =
                    in_range && (!finite || qpos.iter().chain(qvel).all(|v| v.is_finite()));
                (if healthy { reward } else { 0.0 }, !healthy)
            }
        };
        ((forward + alive) - (ctrl_cost + contact_cost), terminated)
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
        let step = |qpos: &[f64], qvel: &[f64]| {
            hopper.outcome(0.0, 0.0, 0.008, &[0.0; 3], &joints(qpos, qvel))
        };
        assert_eq!(step(&up, &still), (1.0, false));
        assert_eq!(step(&fallen, &still), (0.0, true));
        // A velocity out of the state range ends it too.
        let fast = [0.0, 0.0, 0.0, 200.0, 0.0, 0.0];
        assert!(step(&up, &fast).1);
    }

    /// `mujoco/raw` has no control cost: a non-finite action (which MuJoCo zeroes) gives
    /// reward 0, not `0 * NaN`.
    #[test]
    fn raw_rewards_zero_for_a_non_finite_action() {
        let state = joints(&[0.0], &[0.0]);
        for action in [[f32::NAN, 0.0], [f32::INFINITY, f32::NEG_INFINITY]] {
            assert_eq!(RAW.outcome(0.0, 0.0, 0.01, &action, &state), (0.0, false));
        }
    }

    #[test]
    fn the_observation_skips_x_and_clips_velocities() {
        let hopper = task("Hopper-v5").unwrap();
        let mut out = [0f32; 11];
        let qpos = [5.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let qvel = [20.0, -20.0, 1.0, 0.0, 0.0, 0.0];
        hopper.observe(&joints(&qpos, &qvel), &mut out);
        assert_eq!(
            out,
            [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, -10.0, 1.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn ant_clips_contact_forces_in_its_observation_and_cost() {
        let ant = task("Ant-v5").unwrap();
        let (qpos, qvel) = ([0.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0], [0.0; 6]);
        // World, then two bodies: the world's row is in the cost, not the observation.
        let forces = [[3.0; 6], [-2.0, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0; 6]];
        let s = State {
            cfrc_ext: &forces,
            ..joints(&qpos, &qvel)
        };
        assert_eq!(ant.obs_dim(7, 6, 3, 0), 5 + 6 + 12);
        let mut out = [9f32; 23];
        ant.observe(&s, &mut out);
        assert_eq!(out[11..17], [-1.0, 0.5, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(out[17..], [0.0; 6]);
        let (r, t) = ant.outcome(0.0, 0.0, 0.05, &[0.0; 2], &s);
        assert!(!t);
        assert_eq!(r, 1.0 - 5e-4 * (6.0 + 1.0 + 0.25));
        // Out of its height range (bounds included), or not finite: terminated.
        let low = [0.0, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0];
        assert!(
            ant.outcome(0.0, 0.0, 0.05, &[0.0; 2], &joints(&low, &qvel))
                .1
        );
        let edge = [0.0, 0.0, 0.2, 1.0, 0.0, 0.0, 0.0];
        assert!(
            !ant.outcome(0.0, 0.0, 0.05, &[0.0; 2], &joints(&edge, &qvel))
                .1
        );
        let nan = [f64::NAN, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert!(
            ant.outcome(0.0, 0.0, 0.05, &[0.0; 2], &joints(&qpos, &nan))
                .1
        );
    }

    fn joints<'a>(qpos: &'a [f64], qvel: &'a [f64]) -> State<'a> {
        State {
            qpos,
            qvel,
            cinert: &[],
            cvel: &[],
            qfrc_actuator: &[],
            cfrc_ext: &[],
            sensordata: &[],
        }
    }
}
