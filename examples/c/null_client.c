/* A client in plain C against include/shmbridge.h: attaches to a `null` engine
 * (`shmbridge engine --env null`), steps it and checks every frame: each observation is
 * the pattern of docs/protocol.md §7.1 for that frame number, and each reward echoes the
 * action this client sent. Prints the steps per second.
 *
 *   ./null_client REGION [STEPS] [--no-check]
 *
 * Before stepping it calls the engine's `echo` method and a bare reset through the
 * command channel and checks the replies.
 *
 * Exit status 0 when every step checked out; 1 on the first wrong value or error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shmbridge.h"

static float pattern(uint64_t seq, uint64_t index) {
    return (float)((seq * 2654435761ULL + index) & 0xFFFFFFULL);
}

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "null_client: %s: %s (%s)\n", what, shmb_last_error_message(),
            shmb_status_name(status));
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s REGION [STEPS] [--no-check]\n", argv[0]);
        return 2;
    }
    uint64_t steps = argc > 2 ? strtoull(argv[2], NULL, 10) : 100000;
    int check = !(argc > 3 && strcmp(argv[3], "--no-check") == 0);

    shmb_client *client = NULL;
    shmb_status s = shmb_client_attach(argv[1], 10000, SHMB_SPIN_DEFAULT, &client);
    if (s != SHMB_OK) return fail("attach", s);

    int rc = 0;
    float *obs = NULL, *actions = NULL, *rewards = NULL;
    size_t obs_bytes = 0, act_bytes = 0, rew_bytes = 0;
    uint32_t num_envs = 0;
    if ((s = shmb_client_tensor(client, "obs", 0, (void **)&obs, &obs_bytes)) != SHMB_OK ||
        (s = shmb_client_tensor(client, "actions", 0, (void **)&actions, &act_bytes)) != SHMB_OK ||
        (s = shmb_client_tensor(client, "rewards", 0, (void **)&rewards, &rew_bytes)) != SHMB_OK ||
        (s = shmb_client_num_envs(client, &num_envs)) != SHMB_OK) {
        rc = fail("tensors", s);
        goto done;
    }
    size_t n_obs = obs_bytes / sizeof(float), act_dim = act_bytes / sizeof(float) / num_envs;

    /* The command channel: `echo` answers with its arguments and payload. */
    const shmb_kv args[2] = {{"greeting", "hello"}, {"answer", "42"}};
    const uint8_t payload[3] = {1, 0, 255};
    const uint8_t *reply = NULL;
    size_t reply_len = 0, reply_args = 0;
    const char *key = NULL, *value = NULL;
    if ((s = shmb_client_call(client, "echo", args, 2, payload, 3, 10000)) != SHMB_OK ||
        (s = shmb_client_reply_payload(client, &reply, &reply_len)) != SHMB_OK ||
        (s = shmb_client_reply_arg_count(client, &reply_args)) != SHMB_OK ||
        (s = shmb_client_reply_arg(client, 1, &key, &value)) != SHMB_OK) {
        rc = fail("echo", s);
        goto done;
    }
    if (reply_len != 3 || memcmp(reply, payload, 3) != 0 || reply_args != 2 ||
        strcmp(key, "answer") != 0 || strcmp(value, "42") != 0) {
        fprintf(stderr, "null_client: echo answered something else\n");
        rc = 1;
        goto done;
    }
    if ((s = shmb_client_reset(client, NULL, 0, NULL, 0, 10000, NULL)) != SHMB_OK) {
        rc = fail("reset", s);
        goto done;
    }
    if (check && obs[n_obs - 1] != pattern(0, n_obs - 1)) {
        fprintf(stderr, "null_client: the reset did not rewrite frame 0's pattern\n");
        rc = 1;
        goto done;
    }

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint64_t k = 1; k <= steps; k++) {
        for (uint32_t e = 0; e < num_envs; e++) actions[e * act_dim] = (float)((k * 31 + e) % 1000);
        uint64_t frame = 0;
        if ((s = shmb_client_step(client, 10000, &frame)) != SHMB_OK) {
            rc = fail("step", s);
            goto done;
        }
        if (!check) continue;
        if (frame != k) {
            fprintf(stderr, "null_client: step %llu got frame %llu\n", (unsigned long long)k,
                    (unsigned long long)frame);
            rc = 1;
            goto done;
        }
        for (size_t i = 0; i < n_obs; i++) {
            if (obs[i] != pattern(frame, i)) {
                fprintf(stderr, "null_client: frame %llu obs[%zu] = %.1f, expected %.1f\n",
                        (unsigned long long)frame, i, obs[i], pattern(frame, i));
                rc = 1;
                goto done;
            }
        }
        for (uint32_t e = 0; e < num_envs; e++) {
            if (rewards[e] != (float)((k * 31 + e) % 1000)) {
                fprintf(stderr, "null_client: frame %llu rewards[%u] = %.1f does not echo its action\n",
                        (unsigned long long)frame, e, rewards[e]);
                rc = 1;
                goto done;
            }
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("%llu steps %s in %.3f s: %.0f steps/s\n", (unsigned long long)steps,
           check ? "checked" : "unchecked", seconds, (double)steps / seconds);

done:
    shmb_client_close(client);
    return rc;
}
