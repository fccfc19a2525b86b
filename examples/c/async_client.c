/* Asynchronous batches from plain C (docs/async.md): attaches to a sharded region whose
 * engines write, for each env e, obs[e] = [steps of e, e, the action e took last], starts
 * batches of BATCH envs and checks every one: each env handed out at most once until its
 * action is sent, its row holding exactly as many steps as actions were sent to it.
 *
 *   ./async_client REGION BATCH ROUNDS
 *
 * Exit status 0 when every batch checked out; 1 on the first wrong value or error.
 */
#include <stdio.h>
#include <stdlib.h>

#include "shmbridge.h"

static int fail(const char *what, shmb_status status) {
    fprintf(stderr, "async_client: %s: %s (%s)\n", what, shmb_last_error_message(),
            shmb_status_name(status));
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s REGION BATCH ROUNDS\n", argv[0]);
        return 2;
    }
    size_t batch = strtoull(argv[2], NULL, 10);
    unsigned long rounds = strtoul(argv[3], NULL, 10);
    shmb_client *client = NULL;
    shmb_status s = shmb_client_attach(argv[1], 10000, SHMB_SPIN_DEFAULT, &client);
    if (s != SHMB_OK) return fail("attach", s);

    int rc = 0;
    float *obs = NULL, *actions = NULL;
    size_t obs_bytes = 0, act_bytes = 0, count = 0;
    uint32_t num_envs = 0;
    uint32_t *ids = NULL;
    unsigned long *sent = NULL;
    char *held = NULL;
    if ((s = shmb_client_tensor(client, "obs", 0, (void **)&obs, &obs_bytes)) != SHMB_OK ||
        (s = shmb_client_tensor(client, "actions", 0, (void **)&actions, &act_bytes)) != SHMB_OK ||
        (s = shmb_client_num_envs(client, &num_envs)) != SHMB_OK) {
        rc = fail("tensors", s);
        goto done;
    }
    ids = calloc(batch, sizeof *ids);
    sent = calloc(num_envs, sizeof *sent);
    held = calloc(num_envs, 1);
    if (!ids || !sent || !held) {
        rc = 1;
        goto done;
    }
    if ((s = shmb_client_async_reset(client, batch, NULL, 0, 10000)) != SHMB_OK) {
        rc = fail("async_reset", s);
        goto done;
    }
    /* A buffer too small is refused before anything is handed out; count says the size
     * needed. */
    count = 0;
    if ((s = shmb_client_recv(client, 10000, ids, batch - 1, &count)) != SHMB_BUFFER_TOO_SMALL) {
        rc = fail("recv into a small buffer", s);
        goto done;
    }
    if (count != batch) {
        fprintf(stderr, "recv into a small buffer: count %zu, want %zu\n", count, batch);
        rc = 1;
        goto done;
    }
    for (unsigned long r = 0; r < rounds; r++) {
        if ((s = shmb_client_recv(client, 10000, ids, batch, &count)) != SHMB_OK) {
            rc = fail("recv", s);
            goto done;
        }
        if (count != batch) {
            fprintf(stderr, "async_client: %zu envs in a batch of %zu\n", count, batch);
            rc = 1;
            goto done;
        }
        for (size_t i = 0; i < count; i++) {
            uint32_t e = ids[i];
            if (e >= num_envs || held[e] || obs[3 * e] != (float)sent[e] || obs[3 * e + 1] != (float)e) {
                fprintf(stderr, "async_client: round %lu: env %u wrong (steps %g, sent %lu)\n", r,
                        e, e < num_envs ? obs[3 * e] : -1.0f, e < num_envs ? sent[e] : 0);
                rc = 1;
                goto done;
            }
            held[e] = 1;
            actions[e] = (float)(e * 1000 + sent[e]);
        }
        if (r == 0) {
            /* Sending an env twice is refused, and posts nothing. */
            uint32_t twice[2] = {ids[0], ids[0]};
            if ((s = shmb_client_send(client, twice, 2)) != SHMB_OUT_OF_ORDER) {
                rc = fail("send twice", s);
                goto done;
            }
        }
        if ((s = shmb_client_send(client, ids, count)) != SHMB_OK) {
            rc = fail("send", s);
            goto done;
        }
        for (size_t i = 0; i < count; i++) {
            held[ids[i]] = 0;
            sent[ids[i]]++;
        }
    }
    /* Take every frame still in flight before closing: a close does not wait for them,
     * so a shard could see the client gone before its last action. */
    for (size_t left = num_envs / batch; left > 0; left--) {
        if ((s = shmb_client_recv(client, 10000, ids, batch, &count)) != SHMB_OK) {
            rc = fail("recv the last frames", s);
            goto done;
        }
    }
    printf("%lu batches checked\n", rounds);
done:
    free(ids);
    free(sent);
    free(held);
    shmb_client_close(client);
    return rc;
}
