/* An engine that hands over its Vulkan render target wrongly, one way per run, for the
 * fault tests (tests/python/test_vulkan_engines.py, built there with AddressSanitizer and
 * UndefinedBehaviorSanitizer). It renders with examples/c/vulkan_frames.c like
 * examples/c/vulkan_engine.c, serves the standard tensors and `frames`, and follows the
 * engine CLI convention (prints the region name, serves until the client closes or
 * SIGTERM).
 *
 *   ./vulkan_faults FAULT
 *
 * FAULT:
 *   none                nothing wrong (the control case)
 *   closed-fd           closes its memory fd before declaring it
 *   reused-fd           closes its memory fd, and the number then names a pipe when it
 *                       declares it (refused by shmb_engine_create: fstat says a pipe)
 *   closed-after        closes its memory fd right after declaring it (allowed: the
 *                       library holds its own copy)
 *   size                declares an allocation 1 GiB larger than it is (refused by
 *                       shmb_engine_create: lavapipe's memfd shows its size)
 *   memory-type         declares a memory type the device does not have
 *   die-before-publish  dies (SIGKILL) after rendering its first frame for an action,
 *                       before publishing it */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shmbridge.h"
#include "vulkan_frames.h"

static volatile sig_atomic_t stop_signal = 0;
static void on_signal(int sig) { stop_signal = sig; }

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "vulkan_faults: %s: %s (%s)\n", what, shmb_last_error_message(),
            shmb_status_name(status));
    return 1;
}

#define CHECK(call)                    \
    do {                               \
        shmb_status status_ = (call);  \
        if (status_ != SHMB_OK) {      \
            rc = fail(#call, status_); \
            goto done;                 \
        }                              \
    } while (0)

#define DRAW(renderer, obs)                                              \
    do {                                                                 \
        if (vf_draw(renderer, obs) != 0) {                               \
            fprintf(stderr, "vulkan_faults: drawing: %s\n", vf_error()); \
            rc = 1;                                                      \
            goto done;                                                   \
        }                                                                \
    } while (0)

int main(int argc, char **argv) {
    const char *faults[] = {"none", "closed-fd", "reused-fd", "closed-after",
                            "size", "memory-type", "die-before-publish"};
    const char *fault = argc == 2 ? argv[1] : "";
    int known = 0;
    for (size_t k = 0; k < sizeof faults / sizeof faults[0]; k++)
        known |= strcmp(fault, faults[k]) == 0;
    if (!known) {
        fprintf(stderr, "usage: %s none|closed-fd|reused-fd|closed-after|size|memory-type|"
                        "die-before-publish\n", argv[0]);
        return 2;
    }
    signal(SIGTERM, on_signal);

    const uint32_t num_envs = 2, height = 16, width = 16;
    int rc = 0;
    shmb_spec *spec = NULL;
    shmb_engine *engine = NULL;
    vf_renderer *renderer = vf_create(num_envs, height, width);
    if (!renderer) {
        fprintf(stderr, "vulkan_faults: %s\n", vf_error());
        return 1;
    }
    int32_t fd = -1;
    shmb_vulkan_export exported;
    if (vf_export(renderer, &fd, &exported) != 0) {
        fprintf(stderr, "vulkan_faults: %s\n", vf_error());
        vf_destroy(renderer);
        return 1;
    }
    if (strcmp(fault, "closed-fd") == 0) {
        close(fd);
    } else if (strcmp(fault, "reused-fd") == 0) {
        int pipe_fds[2];
        if (pipe(pipe_fds) != 0 || dup2(pipe_fds[0], fd) != fd) {
            perror("vulkan_faults: pipe");
            rc = 1;
            goto done;
        }
        close(pipe_fds[0]);
        close(pipe_fds[1]);
    } else if (strcmp(fault, "size") == 0) {
        exported.alloc_size += 1ull << 30;
    } else if (strcmp(fault, "memory-type") == 0) {
        exported.memory_type_index = 31;
    }
    uint64_t shape[4] = {num_envs, height, width, 4};
    CHECK(shmb_spec_new("vulkan-faults", num_envs, &spec));
    CHECK(shmb_spec_add_standard(spec, 4, 1, SHMB_I64));
    CHECK(shmb_spec_add_vulkan_export(spec, "frames", SHMB_U8, shape, 4, fd, &exported,
                                      SHMB_NO_FD, 0));
    if (strcmp(fault, "closed-after") == 0) {
        close(fd);
        fd = -1;
    }
    CHECK(shmb_engine_create(spec, &engine));
    float *obs = NULL;
    size_t nbytes = 0;
    CHECK(shmb_engine_tensor(engine, "obs", 0, (void **)&obs, &nbytes));
    DRAW(renderer, obs);
    CHECK(shmb_engine_publish(engine, NULL));
    const char *region = NULL;
    CHECK(shmb_engine_name(engine, &region));
    printf("%s\n", region);
    fflush(stdout);

    for (uint64_t step = 1; !stop_signal; step++) {
        shmb_status s = shmb_engine_wait_actions(engine, 100, NULL, NULL);
        if (s == SHMB_TIMEOUT) {
            step--;
            continue;
        }
        if (s == SHMB_CLIENT_CLOSED) break;
        if (s != SHMB_OK) {
            rc = fail("waiting for actions", s);
            break;
        }
        obs[0] = (float)step * 0.01f;  /* the cart moves: each frame differs */
        DRAW(renderer, obs);
        if (strcmp(fault, "die-before-publish") == 0) kill(getpid(), SIGKILL);
        CHECK(shmb_engine_publish(engine, NULL));
    }
    if (stop_signal) rc = 128 + stop_signal;

done:
    if (fd >= 0 && strcmp(fault, "closed-fd") != 0) close(fd);
    if (engine) shmb_engine_close(engine);
    if (spec) shmb_spec_free(spec);
    vf_destroy(renderer);
    return rc;
}
