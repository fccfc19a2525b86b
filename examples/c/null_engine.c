/* The `null` engine in plain C (docs/protocol.md §7.1): no physics; frame s holds the
 * pattern of s in `obs`, and `rewards[e]` echoes `actions[e, 0]`, so a client can check
 * every step. With --sparse it writes only the first and last element of each tensor,
 * O(1) work per step: what the round-trip benchmark (benches/roundtrip.rs) uses to put
 * the C engine's transport cost next to the Rust engine's.
 *
 *   ./null_engine [--num-envs N] [--obs-dim D] [--act-dim A] [--sparse]
 *
 * Follows the engine CLI convention (docs/protocol.md §9).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmbridge.h"

static float pattern(uint64_t seq, uint64_t index) {
    return (float)((seq * 2654435761ULL + index) & 0xFFFFFFULL);
}

static void write_obs(float *obs, size_t n, uint64_t seq, int sparse) {
    if (sparse) {
        obs[0] = pattern(seq, 0);
        obs[n - 1] = pattern(seq, n - 1);
    } else {
        for (size_t i = 0; i < n; i++) obs[i] = pattern(seq, i);
    }
}

static volatile sig_atomic_t stop_signal = 0;
static void on_signal(int sig) { stop_signal = sig; }

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "null_engine: %s: %s (%s)\n", what, shmb_last_error_message(),
            shmb_status_name(status));
    return 1;
}

int main(int argc, char **argv) {
    uint32_t num_envs = 1;
    uint64_t obs_dim = 16, act_dim = 1;
    int sparse = 0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--num-envs") == 0) num_envs = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--obs-dim") == 0) obs_dim = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--act-dim") == 0) act_dim = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--sparse") == 0) sparse = 1;
        else {
            fprintf(stderr, "usage: %s [--num-envs N] [--obs-dim D] [--act-dim A] [--sparse]\n", argv[0]);
            return 2;
        }
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);

    shmb_spec *spec = NULL;
    shmb_engine *engine = NULL;
    shmb_status s;
    int rc = 0;
    if ((s = shmb_spec_new("null-c", num_envs, &spec)) != SHMB_OK ||
        (s = shmb_spec_add_standard(spec, obs_dim, act_dim, SHMB_F32)) != SHMB_OK ||
        (s = shmb_engine_create(spec, &engine)) != SHMB_OK) {
        rc = fail("creating the engine", s);
        goto done;
    }
    float *obs = NULL, *rewards = NULL;
    const float *actions = NULL;
    size_t obs_bytes = 0, bytes = 0;
    const char *name = NULL;
    if ((s = shmb_engine_tensor(engine, "obs", 0, (void **)&obs, &obs_bytes)) != SHMB_OK ||
        (s = shmb_engine_tensor(engine, "actions", 0, (void **)&actions, &bytes)) != SHMB_OK ||
        (s = shmb_engine_tensor(engine, "rewards", 0, (void **)&rewards, &bytes)) != SHMB_OK ||
        (s = shmb_engine_name(engine, &name)) != SHMB_OK) {
        rc = fail("tensors", s);
        goto done;
    }
    size_t n_obs = obs_bytes / sizeof(float);
    write_obs(obs, n_obs, 0, sparse);
    if ((s = shmb_engine_publish(engine, NULL)) != SHMB_OK) {
        rc = fail("publish", s);
        goto done;
    }
    printf("%s\n", name);
    fflush(stdout);
    for (;;) {
        if (stop_signal) {
            rc = 128 + stop_signal;
            break;
        }
        uint64_t seq = 0;
        s = shmb_engine_wait_actions(engine, 100, NULL, &seq);
        if (s == SHMB_TIMEOUT) continue;
        if (s == SHMB_CLIENT_CLOSED) break;
        if (s != SHMB_OK) {
            rc = fail("waiting for actions", s);
            break;
        }
        write_obs(obs, n_obs, seq, sparse);
        if (sparse) {
            rewards[0] = actions[0];
            rewards[num_envs - 1] = actions[(num_envs - 1) * act_dim];
        } else {
            for (uint32_t e = 0; e < num_envs; e++) rewards[e] = actions[e * act_dim];
        }
        if ((s = shmb_engine_publish(engine, NULL)) != SHMB_OK) {
            rc = fail("publish", s);
            break;
        }
    }
done:
    if (engine) shmb_engine_close(engine);
    if (spec) shmb_spec_free(spec);
    return rc;
}
