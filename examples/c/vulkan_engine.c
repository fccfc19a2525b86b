/* A C engine that renders with Vulkan itself and hands its own render target to the
 * learner: CartPole-v1 (cartpole.h, the Rust reference engine's dynamics bit for bit)
 * whose frames a compute shader draws on the engine's own Vulkan device
 * (vulkan_frames.c), into memory the engine exported. shmbridge serves that memory as the
 * tensor `frames` (u8 [N, H, W, 4]): a learner imports it and reads the frames where the
 * shader wrote them, with no copy (shmb_spec_add_vulkan_export).
 *
 * With --frames host the same engine copies each rendered frame into a `frames` tensor in
 * the region's shared memory instead: the copy an engine without the export makes, kept
 * to measure the export against (python -m shmbridge.bench vulkan --c-engine).
 *
 * Each step: wait for the action, step the physics, draw (vf_draw waits for the device:
 * without a timeline semaphore the seq counters alone order the frame, so it must be
 * complete when it is published), publish. A Reset command redraws the reset envs'
 * frames before its reply.
 *
 * Build (needs libvulkan-dev and glslang-tools on Debian):
 *
 *   glslangValidator -V --target-env vulkan1.1 --vn vulkan_frames_spv \
 *       -o build/vulkan_frames.spv.h examples/c/vulkan_frames.comp
 *   cc -O2 -ffp-contract=off -Iinclude -Ibuild examples/c/vulkan_engine.c \
 *      examples/c/vulkan_frames.c -Ltarget/debug -lshmbridge -lvulkan -lm -o vulkan_engine
 *   ./vulkan_engine [--num-envs N] [--seed S] [--size HxW] [--frames export|host]
 *                   [--name NAME] [--idle-timeout SECONDS]
 *
 * Follows the engine CLI convention (docs/protocol.md §9). Without a Vulkan driver it
 * exits with status 1 and "vulkan_engine: Vulkan is unavailable: ..." on stderr. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cartpole.h"
#include "shmbridge.h"
#include "vulkan_frames.h"

typedef struct {
    cartpole env;
    vf_renderer *renderer;
    /* --frames host: the region's `frames` tensor, which each drawn frame is copied to. */
    uint8_t *host_frames;
} engine_state;

/* Draws the frames of the current observations (and copies them into shared memory with
 * --frames host). On return the device's work is complete. */
static int render(engine_state *s) {
    if (vf_draw(s->renderer, s->env.obs) != 0) return -1;
    if (s->host_frames)
        memcpy(s->host_frames, vf_frames(s->renderer), (size_t)vf_frames_bytes(s->renderer));
    return 0;
}

static int32_t reset_and_render(void *user, const uint32_t *env_ids, size_t num_env_ids,
                                const uint64_t *seeds, shmb_reply *reply) {
    engine_state *s = user;
    int32_t rc = on_reset(&s->env, env_ids, num_env_ids, seeds, reply);
    if (rc == 0 && render(s) != 0) {
        shmb_reply_set_error(reply, SHMB_REPLY_ENGINE_ERROR, vf_error());
        return 1;
    }
    return rc;
}

static int32_t call(void *user, const char *method, const shmb_kv *args, size_t num_args,
                    const uint8_t *payload, size_t payload_len, shmb_reply *reply) {
    engine_state *s = user;
    return on_call(&s->env, method, args, num_args, payload, payload_len, reply);
}

static volatile sig_atomic_t stop_signal = 0;
static void on_signal(int sig) { stop_signal = sig; }

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "vulkan_engine: %s: %s (%s)\n", what, shmb_last_error_message(),
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

#define RENDER(state)                                                  \
    do {                                                               \
        if (render(state) != 0) {                                      \
            fprintf(stderr, "vulkan_engine: drawing: %s\n", vf_error()); \
            rc = 1;                                                    \
            goto done;                                                 \
        }                                                              \
    } while (0)

int main(int argc, char **argv) {
    uint32_t num_envs = 64, height = 84, width = 84;
    uint64_t seed = 0;
    const char *name = NULL;
    int export_frames = 1;
    double idle_timeout = 3600.0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--num-envs") == 0) {
            num_envs = (uint32_t)strtoul(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--seed") == 0) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (i + 1 < argc && strcmp(argv[i], "--size") == 0 &&
                   sscanf(argv[i + 1], "%ux%u", &height, &width) == 2) {
            i++;
        } else if (i + 1 < argc && strcmp(argv[i], "--frames") == 0 &&
                   (strcmp(argv[i + 1], "export") == 0 || strcmp(argv[i + 1], "host") == 0)) {
            export_frames = strcmp(argv[++i], "export") == 0;
        } else if (i + 1 < argc && strcmp(argv[i], "--name") == 0) {
            name = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--idle-timeout") == 0) {
            idle_timeout = strtod(argv[++i], NULL);
        } else {
            fprintf(stderr,
                    "usage: %s [--num-envs N] [--seed S] [--size HxW] [--frames export|host] "
                    "[--name NAME] [--idle-timeout SECONDS]\n",
                    argv[0]);
            return 2;
        }
    }
    if (shmb_abi_version() != SHMB_ABI_VERSION) {
        fprintf(stderr, "vulkan_engine: libshmbridge has ABI %u, this program needs %u\n",
                shmb_abi_version(), SHMB_ABI_VERSION);
        return 1;
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);

    int rc = 0;
    shmb_spec *spec = NULL;
    shmb_engine *engine = NULL;
    engine_state s = {0};
    if (cartpole_alloc(&s.env, num_envs) != 0) {
        fprintf(stderr, "vulkan_engine: out of memory\n");
        rc = 1;
        goto done;
    }
    s.renderer = vf_create(num_envs, height, width);
    if (!s.renderer) {
        fprintf(stderr, "vulkan_engine: %s\n", vf_error());
        rc = 1;
        goto done;
    }

    uint64_t shape[4] = {num_envs, height, width, 4};
    CHECK(shmb_spec_new("cartpole-vulkan-c", num_envs, &spec));
    CHECK(cartpole_spec(spec, num_envs));
    CHECK(shmb_spec_add_metadata(spec, "renderer", vf_device_name(s.renderer)));
    if (export_frames) {
        int32_t fd = -1;
        shmb_vulkan_export exported;
        if (vf_export(s.renderer, &fd, &exported) != 0) {
            fprintf(stderr, "vulkan_engine: exporting the frames: %s\n", vf_error());
            rc = 1;
            goto done;
        }
        shmb_status added = shmb_spec_add_vulkan_export(spec, "frames", SHMB_U8, shape, 4, fd,
                                                        &exported, SHMB_NO_FD, 0);
        /* The library holds its own copy of the fd: ours is closed either way. */
        close(fd);
        CHECK(added);
    } else {
        CHECK(shmb_spec_add_tensor(spec, "frames", SHMB_U8, shape, 4, SHMB_ENGINE_TO_CLIENT,
                                   SHMB_LOCATION_HOST, 0));
    }
    CHECK(shmb_spec_set_name(spec, name));
    CHECK(shmb_engine_create(spec, &engine));
    if (cartpole_start(&s.env, engine, seed) != 0) {
        rc = 1;
        goto done;
    }
    if (!export_frames) {
        size_t nbytes = 0;
        void *host = NULL;
        CHECK(shmb_engine_tensor(engine, "frames", 0, &host, &nbytes));
        s.host_frames = host;
    }
    RENDER(&s);
    CHECK(shmb_engine_publish(engine, NULL));

    const char *region = NULL;
    CHECK(shmb_engine_name(engine, &region));
    printf("%s\n", region);
    fflush(stdout);

    /* Waits are cut into 100 ms slices so a signal is noticed (the handler only sets a
     * flag: closing is not async-signal-safe). */
    shmb_handlers handlers = {&s, reset_and_render, call};
    double idle = 0.0;
    uint64_t steps = 0;
    for (;;) {
        if (stop_signal) {
            rc = 128 + stop_signal;
            break;
        }
        shmb_status st = shmb_engine_wait_actions(engine, 100, &handlers, NULL);
        if (st == SHMB_TIMEOUT) {
            idle += 0.1;
            if (idle >= idle_timeout) {
                rc = fail("waiting for actions", st);
                break;
            }
            continue;
        }
        if (st == SHMB_CLIENT_CLOSED) break;
        if (st != SHMB_OK) {
            rc = fail("waiting for actions", st);
            break;
        }
        idle = 0.0;
        step(&s.env);
        RENDER(&s);
        CHECK(shmb_engine_publish(engine, NULL));
        steps++;
    }
    if (rc == 0)
        fprintf(stderr, "vulkan_engine: client closed after %llu steps\n",
                (unsigned long long)steps);

done:
    if (engine) shmb_engine_close(engine);
    if (spec) shmb_spec_free(spec);
    /* The engine is closed: no client receives the memory's fd any more. A client that
     * imported it holds its own reference, so freeing ours pulls nothing from under it. */
    vf_destroy(s.renderer);
    cartpole_free(&s.env);
    return rc;
}
