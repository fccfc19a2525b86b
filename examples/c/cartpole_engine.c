/* CartPole-v1 as a shmbridge engine in plain C, against include/shmbridge.h.
 *
 * The same environment as the Rust reference engine (src/envs/cartpole.rs,
 * docs/protocol.md §7.2): vectorised, seeded resets (env e's stream is PCG32 seeded from
 * seed + e), same-step autoreset, reset_mask, final_obs, Reset commands with env ids and
 * seeds, and set_pole_length. Its frames agree with the Rust engine's bit for bit on the
 * same seeds (tests/python/test_c_engine.py checks it): the environment, in cartpole.h,
 * follows the Rust code exactly. Build without FMA contraction (gcc: -ffp-contract=off),
 * as Rust never fuses a multiply and an add.
 *
 * It follows the engine CLI convention (docs/protocol.md §9): prints the region name on
 * stdout once frame 0 is published, serves until the client closes, exits 0; SIGINT or
 * SIGTERM close the region first.
 *
 *   cc -O2 -ffp-contract=off -Iinclude examples/c/cartpole_engine.c \
 *      -Ltarget/debug -lshmbridge -lm -o cartpole_engine
 *   ./cartpole_engine [--num-envs N] [--seed S] [--name NAME] [--idle-timeout SECONDS]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cartpole.h"
#include "shmbridge.h"

/* ---- Serving ---------------------------------------------------------------------- */

static volatile sig_atomic_t stop_signal = 0;
static void on_signal(int sig) { stop_signal = sig; }

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "cartpole_engine: %s: %s (%s)\n", what, shmb_last_error_message(),
            shmb_status_name(status));
    return 1;
}

#define CHECK(call)                                  \
    do {                                             \
        shmb_status status_ = (call);                \
        if (status_ != SHMB_OK) {                    \
            rc = fail(#call, status_);               \
            goto done;                               \
        }                                            \
    } while (0)

int main(int argc, char **argv) {
    uint32_t num_envs = 256;
    uint64_t seed = 0;
    const char *name = NULL;
    double idle_timeout = 3600.0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--num-envs") == 0) {
            num_envs = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--seed") == 0) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--name") == 0) {
            name = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--idle-timeout") == 0) {
            idle_timeout = strtod(argv[++i], NULL);
        } else {
            fprintf(stderr,
                    "usage: %s [--num-envs N] [--seed S] [--name NAME] [--idle-timeout SECONDS]\n",
                    argv[0]);
            return 2;
        }
    }
    if (shmb_abi_version() != SHMB_ABI_VERSION) {
        fprintf(stderr, "cartpole_engine: libshmbridge has ABI %u, this program needs %u\n",
                shmb_abi_version(), SHMB_ABI_VERSION);
        return 1;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);

    int rc = 0;
    shmb_spec *spec = NULL;
    shmb_engine *engine = NULL;
    cartpole c;
    if (cartpole_alloc(&c, num_envs) != 0) {
        fprintf(stderr, "cartpole_engine: out of memory\n");
        rc = 1;
        goto done;
    }

    CHECK(shmb_spec_new("cartpole-c", num_envs, &spec));
    CHECK(cartpole_spec(spec, num_envs));
    CHECK(shmb_spec_set_name(spec, name));
    CHECK(shmb_engine_create(spec, &engine));
    if (cartpole_start(&c, engine, seed) != 0) {
        rc = 1;
        goto done;
    }
    CHECK(shmb_engine_publish(engine, NULL));

    const char *region = NULL;
    CHECK(shmb_engine_name(engine, &region));
    printf("%s\n", region);
    fflush(stdout);

    /* Waits are cut into 100 ms slices so a signal is noticed (the handler only sets a
     * flag: closing is not async-signal-safe). */
    shmb_handlers handlers = {&c, on_reset, on_call};
    double idle = 0.0;
    uint64_t steps = 0;
    for (;;) {
        if (stop_signal) {
            rc = 128 + stop_signal;
            break;
        }
        shmb_status s = shmb_engine_wait_actions(engine, 100, &handlers, NULL);
        if (s == SHMB_TIMEOUT) {
            idle += 0.1;
            if (idle >= idle_timeout) {
                rc = fail("waiting for actions", s);
                break;
            }
            continue;
        }
        if (s == SHMB_CLIENT_CLOSED) break;
        if (s != SHMB_OK) {
            rc = fail("waiting for actions", s);
            break;
        }
        idle = 0.0;
        step(&c);
        CHECK(shmb_engine_publish(engine, NULL));
        steps++;
    }
    if (rc == 0) fprintf(stderr, "cartpole_engine: client closed after %llu steps\n",
                         (unsigned long long)steps);

done:
    if (engine) shmb_engine_close(engine);
    if (spec) shmb_spec_free(spec);
    cartpole_free(&c);
    return rc;
}
