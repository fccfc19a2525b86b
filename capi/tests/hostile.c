/* Hostile calls through the C ABI: NULL and foreign handles, NULL pointers, wrong sizes
 * and enum values, use after close, calls out of order, overlapping calls from two
 * threads. Each must return its error code (and set a message), never crash. Run by
 * capi/tests/c_programs.rs; exit status 0 when every expectation held. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "shmbridge.h"
#include "expect.h"


static atomic_int waiting = 0;
static shmb_status waited;

static void *wait_in_thread(void *engine) {
    atomic_store(&waiting, 1);
    /* The main thread's calls may hold the handle for a moment: this one is then BUSY
     * too, and tries again, until it holds the handle for its 2 s wait. */
    do {
        waited = shmb_engine_wait_actions(engine, 2000, NULL, NULL);
    } while (waited == SHMB_BUSY);
    atomic_store(&waiting, 2);
    return NULL;
}

int main(void) {
    shmb_engine *foreign_engine = (shmb_engine *)(uintptr_t)0xdeadbeef;
    shmb_client *foreign_client = (shmb_client *)(uintptr_t)0x12345678;
    uint64_t u64 = 0;
    size_t size = 0;
    void *data = NULL;
    const char *text = NULL;

    /* Versions and names. */
    if (shmb_abi_version() != SHMB_ABI_VERSION) {
        fprintf(stderr, "ABI %u, header %u\n", shmb_abi_version(), SHMB_ABI_VERSION);
        failures++;
    }
    if (strcmp(shmb_status_name(SHMB_CLIENT_CLOSED), "CLIENT_CLOSED") != 0 ||
        strcmp(shmb_status_name(4242), "UNKNOWN") != 0) {
        fprintf(stderr, "status names\n");
        failures++;
    }

    /* NULL and foreign handles, on every kind of call. */
    EXPECT(shmb_engine_publish(NULL, &u64), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_publish(foreign_engine, &u64), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_wait_actions(foreign_engine, 0, NULL, NULL), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_tensor(foreign_engine, "obs", 0, &data, &size), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_close(NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_close(foreign_engine), SHMB_INVALID_HANDLE);
    EXPECT(shmb_client_step(NULL, 0, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_step(foreign_client, 0, NULL), SHMB_INVALID_HANDLE);
    EXPECT(shmb_client_close(foreign_client), SHMB_INVALID_HANDLE);
    EXPECT(shmb_spec_free(NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_publish_signaled(NULL, 0, &u64), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_publish_signaled(foreign_engine, 0, &u64), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_next_frame(foreign_engine, &u64), SHMB_INVALID_HANDLE);
    EXPECT(shmb_reply_add_arg(NULL, "k", "v"), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_reply_set_error(NULL, SHMB_REPLY_BAD_REQUEST, "x"), SHMB_INVALID_ARGUMENT);

    /* Specs: NULL strings and arrays, bad sizes and enum values, invalid UTF-8. */
    shmb_spec *spec = NULL;
    EXPECT(shmb_spec_new(NULL, 4, &spec), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_new("hostile", 4, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_new("\xff\xfe", 4, &spec), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_new("hostile", 4, &spec), SHMB_OK);
    uint64_t shape[9] = {4, 3, 1, 1, 1, 1, 1, 1, 1};
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 0, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 9, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, NULL, 2, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", 99, shape, 2, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 2, 7, SHMB_LOCATION_HOST, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 2, SHMB_ENGINE_TO_CLIENT, 9, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 2, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_CUDA, -1),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_metadata(spec, "key", NULL), SHMB_INVALID_ARGUMENT);
    /* How CUDA tensors are shared: the three codes, and nothing else. */
    EXPECT(shmb_spec_set_cuda_sharing(spec, 3), SHMB_INVALID_SPEC);
    EXPECT(shmb_spec_set_cuda_sharing(spec, 0xFFFFFFFFu), SHMB_INVALID_SPEC);
    EXPECT(shmb_spec_set_cuda_sharing(spec, SHMB_CUDA_SHARING_FD), SHMB_OK);
    EXPECT(shmb_spec_set_cuda_sharing(spec, SHMB_CUDA_SHARING_IPC), SHMB_OK);
    EXPECT(shmb_spec_set_cuda_sharing(spec, SHMB_CUDA_SHARING_AUTO), SHMB_OK);
    EXPECT(shmb_spec_set_cuda_sharing(NULL, SHMB_CUDA_SHARING_AUTO), SHMB_INVALID_ARGUMENT);
    /* Vulkan memory the engine exported: a NULL description, fds that are not fds. */
    shmb_vulkan_export exported = {.alloc_size = 4096, .dedicated = 1, .device_uuid = {1}};
    EXPECT(shmb_spec_add_vulkan_export(spec, "rgb", SHMB_U8, shape, 2, 0, NULL, SHMB_NO_FD, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_vulkan_export(spec, "rgb", SHMB_U8, shape, 2, -3, &exported, SHMB_NO_FD, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_vulkan_export(spec, "rgb", SHMB_U8, shape, 2, 1 << 30, &exported, SHMB_NO_FD, 0),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_vulkan_export(spec, "rgb", SHMB_U8, shape, 2, 0, &exported, 0, 9),
           SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_spec_add_vulkan_export(spec, "rgb", SHMB_U8, NULL, 2, 0, &exported, SHMB_NO_FD, 0),
           SHMB_INVALID_ARGUMENT);
    shmb_engine *engine = NULL;
    /* No tensors: the core refuses the spec. */
    EXPECT(shmb_engine_create(spec, &engine), SHMB_INVALID_SPEC);
    EXPECT(shmb_spec_add_standard(spec, 3, 2, SHMB_F32), SHMB_OK);
    /* A name twice: refused by the core too. */
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 2, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_HOST, 0),
           SHMB_OK);
    EXPECT(shmb_engine_create(spec, &engine), SHMB_INVALID_SPEC);
    EXPECT(shmb_spec_free(spec), SHMB_OK);
    EXPECT(shmb_spec_free(spec), SHMB_CLOSED);
    EXPECT(shmb_spec_set_spin(spec, 0), SHMB_CLOSED);
    EXPECT(shmb_spec_set_cuda_sharing(spec, SHMB_CUDA_SHARING_FD), SHMB_CLOSED);

    /* A CUDA tensor from a library built without the `cuda` feature (as the tests build
     * it): the reason, not a crash. */
    EXPECT(shmb_spec_new("gpu", 2, &spec), SHMB_OK);
    EXPECT(shmb_spec_add_tensor(spec, "obs", SHMB_F32, shape, 2, SHMB_ENGINE_TO_CLIENT, SHMB_LOCATION_CUDA, 0),
           SHMB_OK);
    EXPECT(shmb_engine_create(spec, &engine), SHMB_CUDA_UNAVAILABLE);
    EXPECT(shmb_spec_set_cuda_sharing(spec, SHMB_CUDA_SHARING_FD), SHMB_OK);
    EXPECT(shmb_engine_create(spec, &engine), SHMB_CUDA_UNAVAILABLE);
    EXPECT(shmb_spec_free(spec), SHMB_OK);

    EXPECT(shmb_spec_new("hostile", 4, &spec), SHMB_OK);
    EXPECT(shmb_spec_add_standard(spec, 3, 2, SHMB_F32), SHMB_OK);
    EXPECT(shmb_spec_set_name(spec, "bad name!"), SHMB_OK);
    EXPECT(shmb_engine_create(spec, &engine), SHMB_INVALID_NAME);
    EXPECT(shmb_spec_set_name(spec, NULL), SHMB_OK);
    EXPECT(shmb_engine_create(spec, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_create(spec, &engine), SHMB_OK);
    EXPECT(shmb_spec_free(spec), SHMB_OK);

    /* Engine calls out of order, and bad lookups. */
    EXPECT(shmb_engine_wait_actions(engine, 0, NULL, NULL), SHMB_OUT_OF_ORDER);
    EXPECT(shmb_engine_tensor(engine, "nope", 0, &data, &size), SHMB_NO_SUCH_TENSOR);
    EXPECT(shmb_engine_tensor(engine, NULL, 6, &data, &size), SHMB_NO_SUCH_TENSOR);
    EXPECT(shmb_engine_tensor(engine, "obs", 0, NULL, &size), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_engine_tensor(engine, "obs", 0, &data, NULL), SHMB_INVALID_ARGUMENT);
    /* A host tensor has no device pointer: an error either way (no `cuda` feature, or
     * not on CUDA), never a pointer. */
    if (shmb_engine_device_ptr(engine, "obs", 0, &u64) == SHMB_OK) {
        fprintf(stderr, "a device pointer for a host tensor\n");
        failures++;
    }
    EXPECT(shmb_engine_cuda_stream(engine, &u64), SHMB_CUDA_UNAVAILABLE);
    EXPECT(shmb_client_device_ptr(foreign_client, "obs", 0, &u64), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_tensor(engine, NULL, 0, &data, &size), SHMB_OK);
    if (size != 4 * 3 * sizeof(float)) {
        fprintf(stderr, "obs is %zu bytes\n", size);
        failures++;
    }
    EXPECT(shmb_engine_name(engine, &text), SHMB_OK);
    EXPECT(shmb_engine_next_frame(engine, NULL), SHMB_INVALID_ARGUMENT);
    /* A semaphore value from an engine without a semaphore: refused, nothing published. */
    EXPECT(shmb_engine_publish_signaled(engine, 0, &u64), SHMB_INVALID_SPEC);
    EXPECT(shmb_engine_publish(engine, &u64), SHMB_OK);
    EXPECT(shmb_engine_publish(engine, &u64), SHMB_OUT_OF_ORDER);

    /* Clients: bad names, a second client, calls with bad arrays. */
    shmb_client *client = NULL, *second = NULL;
    EXPECT(shmb_client_attach(NULL, 100, -1, &client), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_attach("shmbridge-no-such-region-here", 100, -1, &client), SHMB_NOT_FOUND);
    EXPECT(shmb_client_attach("../etc/passwd", 100, -1, &client), SHMB_INVALID_NAME);
    EXPECT(shmb_client_attach(text, 1000, 0, &client), SHMB_OK);
    EXPECT(shmb_client_attach(text, 1000, 0, &second), SHMB_ALREADY_ATTACHED);
    EXPECT(shmb_client_reset(client, NULL, 3, NULL, 0, 10, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_call(client, "echo", NULL, 2, NULL, 0, 10), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_call(client, NULL, NULL, 0, NULL, 0, 10), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_reply_arg(client, 5, &text, &text), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_client_tensor(client, "rewards", 0, &data, &size), SHMB_OK);

    /* A handle of one kind is no handle of another, whatever the numbers: the first
     * spec, engine and client of a process must not collide. */
    shmb_spec *live_spec = NULL;
    EXPECT(shmb_spec_new("kinds", 1, &live_spec), SHMB_OK);
    if ((uintptr_t)client == (uintptr_t)engine || (uintptr_t)client == (uintptr_t)live_spec ||
        (uintptr_t)engine == (uintptr_t)live_spec) {
        fprintf(stderr, "handles of different kinds are equal: spec %p engine %p client %p\n",
                (void *)live_spec, (void *)engine, (void *)client);
        failures++;
    }
    EXPECT(shmb_engine_publish((shmb_engine *)client, &u64), SHMB_INVALID_HANDLE);
    EXPECT(shmb_client_step((shmb_client *)engine, 0, NULL), SHMB_INVALID_HANDLE);
    EXPECT(shmb_engine_close((shmb_engine *)client), SHMB_INVALID_HANDLE);
    EXPECT(shmb_client_close((shmb_client *)engine), SHMB_INVALID_HANDLE);
    EXPECT(shmb_client_close((shmb_client *)live_spec), SHMB_INVALID_HANDLE);
    EXPECT(shmb_spec_free((shmb_spec *)engine), SHMB_INVALID_HANDLE);
    EXPECT(shmb_spec_free((shmb_spec *)client), SHMB_INVALID_HANDLE);
    EXPECT(shmb_spec_free(live_spec), SHMB_OK);

    /* One thread, both sides: the step times out until the engine answers it. */
    EXPECT(shmb_client_step(client, 1, &u64), SHMB_TIMEOUT);
    EXPECT(shmb_client_step(client, 1, &u64), SHMB_OUT_OF_ORDER);
    EXPECT(shmb_engine_wait_actions(engine, 1000, NULL, &u64), SHMB_OK);
    EXPECT(shmb_engine_publish(engine, &u64), SHMB_OK);
    EXPECT(shmb_client_wait_frame(client, 1000, &u64), SHMB_OK);
    if (u64 != 1) {
        fprintf(stderr, "frame %llu, want 1\n", (unsigned long long)u64);
        failures++;
    }

    /* Two threads on one engine handle: the second call is BUSY, not a race. */
    pthread_t thread;
    pthread_create(&thread, NULL, wait_in_thread, engine);
    while (atomic_load(&waiting) == 0) {
    }
    shmb_status busy = SHMB_OK;
    while (atomic_load(&waiting) == 1 && busy != SHMB_BUSY) busy = shmb_engine_publish(engine, NULL);
    pthread_join(thread, NULL);
    if (busy != SHMB_BUSY || waited != SHMB_TIMEOUT) {
        fprintf(stderr, "overlapping calls: %s, wait %s\n", shmb_status_name(busy),
                shmb_status_name(waited));
        failures++;
    }

    /* Close: the peer sees it; every later use of the handles is CLOSED. */
    EXPECT(shmb_client_close(client), SHMB_OK);
    EXPECT(shmb_engine_wait_actions(engine, 1000, NULL, NULL), SHMB_CLIENT_CLOSED);
    EXPECT(shmb_client_close(client), SHMB_CLOSED);
    EXPECT(shmb_client_step(client, 0, NULL), SHMB_CLOSED);
    EXPECT(shmb_client_tensor(client, "obs", 0, &data, &size), SHMB_CLOSED);
    EXPECT(shmb_engine_close(engine), SHMB_OK);
    EXPECT(shmb_engine_close(engine), SHMB_CLOSED);
    EXPECT(shmb_engine_publish(engine, NULL), SHMB_CLOSED);
    EXPECT(shmb_engine_publish_signaled(engine, 1, NULL), SHMB_CLOSED);
    EXPECT(shmb_engine_next_frame(engine, &u64), SHMB_CLOSED);
    EXPECT(shmb_engine_tensor(engine, "obs", 0, &data, &size), SHMB_CLOSED);

    if (failures) {
        fprintf(stderr, "%d hostile calls misbehaved\n", failures);
        return 1;
    }
    printf("every hostile call returned its error code\n");
    return 0;
}
