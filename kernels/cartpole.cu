// `cartpole` engine on the GPU: the dynamics, termination, truncation, same-step autoreset
// and final_obs of src/envs/cartpole.rs (Gymnasium CartPole-v1), one thread per env, state
// in f64, written as f32. Compiled at run time with NVRTC (src/envs/kernels.rs).
//
// Random numbers: each env owns a PCG32 (XSH-RR, 64-bit state, odd increment), as
// rand_pcg::Pcg32 on the CPU. The host computes every env's initial (state, increment)
// the way `Pcg32::seed_from_u64(seed + e)` does and uploads them (cartpole_reset_listed,
// which also serves `Reset` commands with seeds); a reset draws 4 uniforms in [-0.05, 0.05) the way rand's `random_range(-0.05..0.05)`
// does for f64 (one u64 = two u32 outputs, low word first; 52 mantissa bits -> [1, 2)
// -> minus 1 -> scale + low, one draw as rand 0.10 does). The scheme is mirrored in Rust
// and checked bit for bit against rand_pcg on CPU (src/envs/kernels.rs). This file,
// compiled for the host with -ffp-contract=off, agrees bit for bit with the CPU engine
// (tests/cartpole_kernel.rs). On the GPU, with --fmad=false (NVRTC then emits fma only
// inside libdevice's sincos), what can still differ is sincos itself (CUDA's is within
// 2 ulp, glibc's is what the CPU engine uses): to be measured on a GPU (tests/cuda.rs).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef long long i64;

#define GRAVITY 9.8
#define MASS_CART 1.0
#define MASS_POLE 0.1
#define TOTAL_MASS (MASS_CART + MASS_POLE)
#define FORCE_MAG 10.0
#define TAU 0.02
#define THETA_THRESHOLD (12.0 * 2.0 * 3.14159265358979323846 / 360.0)
#define X_THRESHOLD 2.4
#define MAX_STEPS 500u

#define PCG_MUL 6364136223846793005ULL

__device__ u32 pcg32_next(u64 *state, u64 inc) {
    u64 old = *state;
    *state = old * PCG_MUL + inc;
    u32 xorshifted = (u32)(((old >> 18) ^ old) >> 27);
    u32 rot = (u32)(old >> 59);
    return (xorshifted >> rot) | (xorshifted << ((32u - rot) & 31u));
}

// rand 0.10's UniformFloat::sample_single: one draw, no rejection (the result may round
// to `high`). Mirrored in Rust by src/envs/kernels.rs (tested against rand_pcg on CPU).
// Compiled with --fmad=false so the multiply and add round separately, as on the CPU.
__device__ double uniform(u64 *state, u64 inc, double low, double high) {
    double scale = high - low;
    u64 lo = pcg32_next(state, inc);
    u64 hi = pcg32_next(state, inc);
    u64 bits = (hi << 32) | lo;
    double v12 = __longlong_as_double((i64)((bits >> 12) | 0x3FF0000000000000ULL));
    return (v12 - 1.0) * scale + low;
}

__device__ void reset_env(double *s, u32 *steps, u64 *rng_state, const u64 *rng_inc, u64 e) {
    for (int k = 0; k < 4; k++) {
        s[4 * e + k] = uniform(&rng_state[e], rng_inc[e], -0.05, 0.05);
    }
    steps[e] = 0;
}

__device__ void write_obs(float *out, const double *s, u64 e) {
    for (int k = 0; k < 4; k++) out[4 * e + k] = (float)s[4 * e + k];
}

// Resets (frame 0's seeding and draws, `Reset` commands), one thread per listed env: env
// ids[k] (each env listed once; the host folded repeated listings, src/envs/kernels.rs
// ResetUpload) gets generator (seed_state[k], seed_inc[k]) when has_seeds, then is reset
// counts[k] times in a row: what the CPU engine's loop over the listing does for it.
extern "C" __global__ void cartpole_reset_listed(double *state, u32 *steps, u64 *rng_state,
                                                 u64 *rng_inc, const u32 *ids,
                                                 const u64 *counts, u64 n,
                                                 const u64 *seed_state, const u64 *seed_inc,
                                                 u32 has_seeds) {
    u64 k = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    u64 e = ids[k];
    if (has_seeds) {
        rng_state[e] = seed_state[k];
        rng_inc[e] = seed_inc[k];
    }
    for (u64 c = 0; c < counts[k]; c++) reset_env(state, steps, rng_state, rng_inc, e);
}

// obs and final_obs of every env from its state (after frame 0's draws or a `Reset`: the
// CPU engine rewrites both for all envs, so final_obs = obs afterwards).
extern "C" __global__ void cartpole_write_obs(const double *state, float *obs,
                                              float *final_obs, u64 num_envs) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_envs) return;
    write_obs(obs, state, e);
    write_obs(final_obs, state, e);
}

extern "C" __global__ void cartpole_step(double *state, u32 *steps, u64 *rng_state,
                                         const u64 *rng_inc, const i64 *actions,
                                         const unsigned char *reset_mask, float *obs,
                                         float *rewards, unsigned char *terminated,
                                         unsigned char *truncated, float *final_obs,
                                         double length, u64 num_envs) {
    u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= num_envs) return;
    double *s = &state[4 * e];
    if (reset_mask[e] != 0) {
        reset_env(state, steps, rng_state, rng_inc, e);
        rewards[e] = 0.0f;
        terminated[e] = 0;
        truncated[e] = 0;
        write_obs(final_obs, state, e);
        write_obs(obs, state, e);
        return;
    }
    double x = s[0], x_dot = s[1], theta = s[2], theta_dot = s[3];
    double pole_mass_length = MASS_POLE * length;
    double force = actions[e] != 0 ? FORCE_MAG : -FORCE_MAG;
    double sn, cs;
    sincos(theta, &sn, &cs);
    double temp = (force + pole_mass_length * theta_dot * theta_dot * sn) / TOTAL_MASS;
    double theta_acc = (GRAVITY * sn - cs * temp) /
                       (length * (4.0 / 3.0 - MASS_POLE * cs * cs / TOTAL_MASS));
    double x_acc = temp - pole_mass_length * theta_acc * cs / TOTAL_MASS;
    s[0] = x + TAU * x_dot;
    s[1] = x_dot + TAU * x_acc;
    s[2] = theta + TAU * theta_dot;
    s[3] = theta_dot + TAU * theta_acc;
    steps[e] += 1;
    int term = s[0] < -X_THRESHOLD || s[0] > X_THRESHOLD || s[2] < -THETA_THRESHOLD ||
               s[2] > THETA_THRESHOLD;
    int trunc = steps[e] >= MAX_STEPS;
    rewards[e] = 1.0f;
    terminated[e] = (unsigned char)term;
    truncated[e] = (unsigned char)trunc;
    write_obs(final_obs, state, e);  // before the autoreset replaces it
    if (term || trunc) reset_env(state, steps, rng_state, rng_inc, e);
    write_obs(obs, state, e);
}
