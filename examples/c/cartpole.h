/* CartPole-v1 in plain C, the environment of examples/c/cartpole_engine.c and
 * examples/c/vulkan_engine.c: the same as the Rust reference engine
 * (src/envs/cartpole.rs, docs/protocol.md §7.2): vectorised, seeded resets (env e's stream
 * is PCG32 seeded from seed + e), same-step autoreset, reset_mask, final_obs, Reset
 * commands with env ids and seeds, and set_pole_length. The RNG and the float arithmetic
 * follow the Rust code exactly (state in double, written as float; the uniform draw as
 * rand 0.10 makes it), so build without FMA contraction (gcc: -ffp-contract=off), as
 * Rust never fuses a multiply and an add. */
#ifndef CARTPOLE_H
#define CARTPOLE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmbridge.h"

/* ---- PCG32 as rand_pcg 0.10 (Lcg64Xsh32) seeds and draws it ---------------------- */

typedef struct {
    uint64_t state;
    uint64_t increment;
} pcg32;

static inline uint32_t rotr32(uint32_t x, uint32_t r) { return (x >> r) | (x << ((32 - r) & 31)); }

static inline uint32_t pcg32_next(pcg32 *g) {
    uint64_t old = g->state;
    g->state = old * 6364136223846793005ULL + g->increment;
    return rotr32((uint32_t)(((old >> 18) ^ old) >> 27), (uint32_t)(old >> 59));
}

/* rand_core 0.10's default seed_from_u64: four outputs of a fixed PCG32 fill the 16-byte
 * seed (little-endian), read as (state, increment | 1), then from_state_incr. */
static inline pcg32 pcg32_seed_from_u64(uint64_t s) {
    uint8_t seed[16];
    for (int i = 0; i < 4; i++) {
        s = s * 0x5851F42D4C957F2DULL + 0xA17654E46FBE17F3ULL;
        uint32_t x = rotr32((uint32_t)(((s >> 18) ^ s) >> 27), (uint32_t)(s >> 59));
        for (int b = 0; b < 4; b++) seed[4 * i + b] = (uint8_t)(x >> (8 * b));
    }
    uint64_t words[2] = {0, 0};
    for (int w = 0; w < 2; w++)
        for (int b = 0; b < 8; b++) words[w] |= (uint64_t)seed[8 * w + b] << (8 * b);
    pcg32 g = {words[0], words[1] | 1};
    g.state += g.increment;
    g.state = g.state * 6364136223846793005ULL + g.increment;
    return g;
}

/* random_range(-0.05..0.05) for f64: 52 random bits as a double in [1, 2), minus 1,
 * times the range, plus its start (next_u64 = low word first). */
static inline double uniform(pcg32 *g, double low, double high) {
    uint64_t lo = pcg32_next(g);
    uint64_t hi = pcg32_next(g);
    uint64_t bits = ((hi << 32) | lo) >> 12 | 0x3FF0000000000000ULL;
    double value1_2;
    memcpy(&value1_2, &bits, sizeof value1_2);
    double scale = high - low;
    return (value1_2 - 1.0) * scale + low;
}

/* ---- CartPole-v1 ------------------------------------------------------------------ */

#define GRAVITY 9.8
#define MASS_CART 1.0
#define MASS_POLE 0.1
#define TOTAL_MASS (MASS_CART + MASS_POLE)
#define FORCE_MAG 10.0
#define TAU 0.02
#define X_THRESHOLD 2.4
#define MAX_STEPS 500
static const double THETA_THRESHOLD = 12.0 * 2.0 * 3.14159265358979323846 / 360.0;

typedef struct {
    uint32_t num_envs;
    double length;
    double (*state)[4];
    uint32_t *steps;
    pcg32 *rngs;
    /* The shared tensors: pointers into the region, taken once. */
    float *obs, *rewards, *final_obs;
    const int64_t *actions;
    uint8_t *terminated, *truncated;
    const uint8_t *reset_mask;
} cartpole;

static inline void reset_one(cartpole *c, uint32_t i) {
    for (int k = 0; k < 4; k++) c->state[i][k] = uniform(&c->rngs[i], -0.05, 0.05);
    c->steps[i] = 0;
}

static inline void write_state(float *out, const double s[4]) {
    for (int k = 0; k < 4; k++) out[k] = (float)s[k];
}

static inline void write_obs(cartpole *c) {
    for (uint32_t i = 0; i < c->num_envs; i++) write_state(&c->obs[4 * i], c->state[i]);
}

static inline void dynamics(double s[4], int push_right, double length) {
    double x = s[0], x_dot = s[1], theta = s[2], theta_dot = s[3];
    double pole_mass_length = MASS_POLE * length;
    double force = push_right ? FORCE_MAG : -FORCE_MAG;
    double sin_t = sin(theta), cos_t = cos(theta);
    double temp = (force + pole_mass_length * theta_dot * theta_dot * sin_t) / TOTAL_MASS;
    double theta_acc = (GRAVITY * sin_t - cos_t * temp) /
                       (length * (4.0 / 3.0 - MASS_POLE * cos_t * cos_t / TOTAL_MASS));
    double x_acc = temp - pole_mass_length * theta_acc * cos_t / TOTAL_MASS;
    s[0] = x + TAU * x_dot;
    s[1] = x_dot + TAU * x_acc;
    s[2] = theta + TAU * theta_dot;
    s[3] = theta_dot + TAU * theta_acc;
}

static inline int is_terminal(const double s[4]) {
    return s[0] < -X_THRESHOLD || s[0] > X_THRESHOLD || s[2] < -THETA_THRESHOLD ||
           s[2] > THETA_THRESHOLD;
}

static inline void step(cartpole *c) {
    for (uint32_t i = 0; i < c->num_envs; i++) {
        if (c->reset_mask[i]) {
            reset_one(c, i);
            c->rewards[i] = 0.0f;
            c->terminated[i] = 0;
            c->truncated[i] = 0;
        } else {
            dynamics(c->state[i], c->actions[i] != 0, c->length);
            c->steps[i] += 1;
            int term = is_terminal(c->state[i]);
            int trunc = c->steps[i] >= MAX_STEPS;
            c->rewards[i] = 1.0f;
            c->terminated[i] = (uint8_t)term;
            c->truncated[i] = (uint8_t)trunc;
            if (term || trunc) {
                /* The finished episode's last observation, before the autoreset. */
                write_state(&c->final_obs[4 * i], c->state[i]);
                reset_one(c, i);
                continue;
            }
        }
        write_state(&c->final_obs[4 * i], c->state[i]);
    }
    write_obs(c);
}

/* ---- Commands --------------------------------------------------------------------- */

/* Reset: the library checked the ids and expanded the seeds (one per listed env). */
static inline int32_t on_reset(void *user, const uint32_t *env_ids, size_t num_env_ids,
                        const uint64_t *seeds, shmb_reply *reply) {
    (void)reply;
    cartpole *c = user;
    for (size_t k = 0; k < num_env_ids; k++) {
        if (seeds) c->rngs[env_ids[k]] = pcg32_seed_from_u64(seeds[k]);
        reset_one(c, env_ids[k]);
    }
    write_obs(c);
    for (uint32_t i = 0; i < c->num_envs; i++) write_state(&c->final_obs[4 * i], c->state[i]);
    return 0;
}

static inline int32_t on_call(void *user, const char *method, const shmb_kv *args, size_t num_args,
                       const uint8_t *payload, size_t payload_len, shmb_reply *reply) {
    (void)payload;
    (void)payload_len;
    cartpole *c = user;
    if (strcmp(method, "set_pole_length") != 0) {
        char message[160];
        snprintf(message, sizeof message,
                 "unknown method '%s' (this engine has: set_pole_length)", method);
        shmb_reply_set_error(reply, SHMB_REPLY_UNKNOWN_METHOD, message);
        return 1;
    }
    for (size_t k = 0; k < num_args; k++) {
        if (strcmp(args[k].key, "length") != 0) continue;
        char *end = NULL;
        double length = strtod(args[k].value, &end);
        if (end == args[k].value || *end != '\0' || !(isfinite(length) && length > 0.0 &&
                                                      length <= 100.0)) {
            shmb_reply_set_error(reply, SHMB_REPLY_BAD_REQUEST,
                                 "length must be a number in (0, 100] metres");
            return 1;
        }
        char previous[64];
        snprintf(previous, sizeof previous, "%.17g", c->length);
        c->length = length;
        shmb_reply_add_arg(reply, "previous", previous);
        return 0;
    }
    shmb_reply_set_error(reply, SHMB_REPLY_BAD_REQUEST, "missing argument 'length'");
    return 1;
}

/* Points the env at the engine's standard tensors and `final_obs`, seeds env e's stream
 * with seed + e and resets every env (the reset observations written: frame 0). 0 on
 * success; -1 if a tensor is missing (its status printed). */
static inline int cartpole_start(cartpole *c, shmb_engine *engine, uint64_t seed) {
    const char *names[] = {"obs", "actions", "rewards", "terminated",
                           "truncated", "reset_mask", "final_obs"};
    void *found[7];
    for (int k = 0; k < 7; k++) {
        size_t nbytes = 0;
        found[k] = NULL;
        shmb_status s = shmb_engine_tensor(engine, names[k], 0, &found[k], &nbytes);
        if (s != SHMB_OK) {
            fprintf(stderr, "%s: %s (%s)\n", names[k], shmb_last_error_message(),
                    shmb_status_name(s));
            return -1;
        }
    }
    c->obs = found[0];
    c->actions = found[1];
    c->rewards = found[2];
    c->terminated = found[3];
    c->truncated = found[4];
    c->reset_mask = found[5];
    c->final_obs = found[6];
    for (uint32_t i = 0; i < c->num_envs; i++) {
        c->rngs[i] = pcg32_seed_from_u64(seed + i);
        reset_one(c, i);
    }
    write_obs(c);
    for (uint32_t i = 0; i < c->num_envs; i++) write_state(&c->final_obs[4 * i], c->state[i]);
    return 0;
}

/* The Rust cartpole's tensors and schema metadata, in its order: the standard six and
 * `final_obs`. */
static inline shmb_status cartpole_spec(shmb_spec *spec, uint32_t num_envs) {
    uint64_t obs_shape[2] = {num_envs, 4};
    shmb_status s = shmb_spec_add_standard(spec, 4, 1, SHMB_I64);
    if (s == SHMB_OK)
        s = shmb_spec_add_tensor(spec, "final_obs", SHMB_F32, obs_shape, 2,
                                 SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0);
    const char *metadata[][2] = {
        {"env_id", "CartPole-v1"},
        {"autoreset_mode", "same-step"},
        {"observation_low", "-4.8,-inf,-0.41887902047863906,-inf"},
        {"observation_high", "4.8,inf,0.41887902047863906,inf"},
        {"action_space", "discrete:2"},
        {"max_episode_steps", "500"},
        {"final_obs", "final_obs"},
    };
    for (size_t k = 0; s == SHMB_OK && k < sizeof metadata / sizeof metadata[0]; k++)
        s = shmb_spec_add_metadata(spec, metadata[k][0], metadata[k][1]);
    return s;
}

/* Allocates the env's state for `num_envs` envs (length 0.5). 0 on success. */
static inline int cartpole_alloc(cartpole *c, uint32_t num_envs) {
    memset(c, 0, sizeof *c);
    c->num_envs = num_envs;
    c->length = 0.5;
    c->state = calloc(num_envs ? num_envs : 1, sizeof *c->state);
    c->steps = calloc(num_envs ? num_envs : 1, sizeof *c->steps);
    c->rngs = calloc(num_envs ? num_envs : 1, sizeof *c->rngs);
    return c->state && c->steps && c->rngs ? 0 : -1;
}

static inline void cartpole_free(cartpole *c) {
    free(c->state);
    free(c->steps);
    free(c->rngs);
}

#endif
