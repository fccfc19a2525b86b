/* Trajectory streams through the C ABI. Run by capi/tests/c_programs.rs.
 *
 *   stream                      C producer processes (forked) write records in place, a C
 *                               consumer pops and checks every one (content, each
 *                               producer's order, nothing lost or doubled), then the
 *                               error paths; exit status 0 when every expectation held.
 *   stream produce NAME ID N    one C producer: N records of producer ID into stream NAME
 *                               (a Rust consumer checks them).
 *
 * Every record of producer `id`, number k, is a function of (id, k): record_len() and
 * fill() below, checked by check(); c_programs.rs computes the same in Rust. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shmbridge.h"
#include "expect.h"

#define SCHEMA "id: uint32, tokens: int32[*], score: float64[1], meta: uint8[*]"

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "line %d: %s does not hold\n", __LINE__, #cond);               \
            failures++;                                                                     \
        }                                                                                   \
    } while (0)

/* The variable lengths of record k of producer id: tokens, meta. */
static void record_len(uint32_t id, uint64_t k, uint32_t lengths[2]) {
    lengths[0] = 1 + (uint32_t)((k * 7 + id * 3) % 60);
    lengths[1] = (uint32_t)((k + id) % 5);
}

static int32_t token(uint32_t id, uint64_t k, size_t j) {
    return (int32_t)(id * 1000003u + (uint32_t)k * 131u + (uint32_t)j);
}

/* Writes record k of producer id into a reservation, through the field pointers. */
static int fill(shmb_stream_reservation *r, uint32_t id, uint64_t k) {
    void *p[4];
    size_t n[4];
    uint32_t dt[4];
    for (size_t f = 0; f < 4; f++) {
        if (shmb_stream_reservation_field(r, f, &p[f], &n[f], &dt[f]) != SHMB_OK) {
            fprintf(stderr, "field %zu: %s\n", f, shmb_last_error_message());
            return -1;
        }
    }
    uint32_t lengths[2];
    record_len(id, k, lengths);
    if (dt[0] != SHMB_U32 || n[0] != 1 || dt[1] != SHMB_I32 || n[1] != lengths[0] ||
        dt[2] != SHMB_F64 || n[2] != 1 || dt[3] != SHMB_U8 || n[3] != lengths[1]) {
        fprintf(stderr, "producer %u record %lu: unexpected fields\n", id, (unsigned long)k);
        return -1;
    }
    *(uint32_t *)p[0] = id;
    int32_t *tokens = p[1];
    for (size_t j = 0; j < n[1]; j++) tokens[j] = token(id, k, j);
    *(double *)p[2] = (double)k + id / 8.0;
    uint8_t *meta = p[3];
    for (size_t j = 0; j < n[3]; j++) meta[j] = (uint8_t)(k ^ j ^ id);
    return 0;
}

/* Checks a popped record is record k of producer id; returns id (or -1). */
static long check(shmb_stream_record *rec, uint64_t *next_of, size_t producers) {
    const void *p[4];
    size_t n[4];
    uint32_t dt[4];
    for (size_t f = 0; f < 4; f++) {
        if (shmb_stream_record_field(rec, f, &p[f], &n[f], &dt[f]) != SHMB_OK) {
            fprintf(stderr, "record field %zu: %s\n", f, shmb_last_error_message());
            return -1;
        }
    }
    uint32_t id = *(const uint32_t *)p[0];
    if (dt[0] != SHMB_U32 || n[0] != 1 || id >= producers) {
        fprintf(stderr, "a record of no producer: id %u\n", id);
        return -1;
    }
    uint64_t k = next_of[id], seq = 0;
    uint32_t lane = 0;
    if (shmb_stream_record_info(rec, &lane, &seq, NULL) != SHMB_OK || seq != k) {
        fprintf(stderr, "producer %u: record seq %lu, expected %lu (lost or out of order)\n", id,
                (unsigned long)seq, (unsigned long)k);
        return -1;
    }
    uint32_t lengths[2];
    record_len(id, k, lengths);
    if (dt[1] != SHMB_I32 || n[1] != lengths[0] || dt[2] != SHMB_F64 || n[2] != 1 ||
        dt[3] != SHMB_U8 || n[3] != lengths[1]) {
        fprintf(stderr, "producer %u record %lu: counts or dtypes differ\n", id, (unsigned long)k);
        return -1;
    }
    const int32_t *tokens = p[1];
    for (size_t j = 0; j < n[1]; j++)
        if (tokens[j] != token(id, k, j)) {
            fprintf(stderr, "producer %u record %lu: token %zu differs\n", id, (unsigned long)k, j);
            return -1;
        }
    if (*(const double *)p[2] != (double)k + id / 8.0) {
        fprintf(stderr, "producer %u record %lu: score differs\n", id, (unsigned long)k);
        return -1;
    }
    const uint8_t *meta = p[3];
    for (size_t j = 0; j < n[3]; j++)
        if (meta[j] != (uint8_t)(k ^ j ^ id)) {
            fprintf(stderr, "producer %u record %lu: meta %zu differs\n", id, (unsigned long)k, j);
            return -1;
        }
    next_of[id] = k + 1;
    return id;
}

/* One producer: n records of producer id, each after an aborted reservation every 16th
 * (garbage that must never be seen). Returns 0 when every call succeeded. */
static int produce(const char *name, uint32_t id, uint64_t n) {
    shmb_stream_producer *producer = NULL;
    if (shmb_stream_attach_producer(name, SCHEMA, 10000, &producer) != SHMB_OK) {
        fprintf(stderr, "producer %u: attach: %s\n", id, shmb_last_error_message());
        return 1;
    }
    for (uint64_t k = 0; k < n; k++) {
        uint32_t lengths[2];
        record_len(id, k, lengths);
        shmb_stream_reservation *r = NULL;
        if (k % 16 == 5) {
            if (shmb_stream_reserve(producer, lengths, 2, 30000, &r) != SHMB_OK) goto fail;
            void *p;
            size_t count;
            uint32_t dtype;
            if (shmb_stream_reservation_field(r, 0, &p, &count, &dtype) != SHMB_OK) goto fail;
            *(uint32_t *)p = 0xdeadu;
            if (shmb_stream_abort(r) != SHMB_OK) goto fail;
        }
        if (shmb_stream_reserve(producer, lengths, 2, 30000, &r) != SHMB_OK) goto fail;
        if (fill(r, id, k) != 0) return 1;
        if (shmb_stream_commit(r) != SHMB_OK) goto fail;
    }
    if (shmb_stream_producer_close(producer) != SHMB_OK) goto fail;
    return 0;
fail:
    fprintf(stderr, "producer %u: %s\n", id, shmb_last_error_message());
    return 1;
}

#define PRODUCERS 3
#define RECORDS 3000

/* Forked producers, one C consumer checking every record. */
static void many_producers(void) {
    /* Names of this process: the tests run programs side by side. */
    char name[64];
    snprintf(name, sizeof name, "c-stream-%d", (int)getpid());
    shmb_stream_consumer *consumer = NULL;
    /* 4 KiB lanes: the producers run ahead of the consumer and wait for room. */
    EXPECT(shmb_stream_create(name, SCHEMA, 4, 4096, 1, &consumer), SHMB_OK);
    if (!consumer) return;
    pid_t pids[PRODUCERS];
    for (uint32_t id = 0; id < PRODUCERS; id++) {
        pids[id] = fork();
        if (pids[id] == 0) _exit(produce(name, id, RECORDS));
        CHECK(pids[id] > 0);
    }
    uint64_t next_of[PRODUCERS] = {0};
    shmb_stream_record *held[3];
    size_t nheld = 0;
    uint64_t total = 0;
    while (total < (uint64_t)PRODUCERS * RECORDS) {
        shmb_stream_record *rec = NULL;
        shmb_status s = shmb_stream_pop(consumer, 30000, &rec);
        if (s != SHMB_OK) {
            fprintf(stderr, "pop after %lu records: %s: %s\n", (unsigned long)total,
                    shmb_status_name(s), shmb_last_error_message());
            failures++;
            break;
        }
        if (check(rec, next_of, PRODUCERS) < 0) {
            failures++;
            break;
        }
        total++;
        /* Records released in an order other than popped: three held, released last
         * first. */
        held[nheld++] = rec;
        if (nheld == 3) {
            while (nheld > 0) EXPECT(shmb_stream_release(held[--nheld]), SHMB_OK);
        }
    }
    while (nheld > 0) EXPECT(shmb_stream_release(held[--nheld]), SHMB_OK);
    for (uint32_t id = 0; id < PRODUCERS; id++) {
        int status = 0;
        CHECK(waitpid(pids[id], &status, 0) == pids[id]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        CHECK(next_of[id] == RECORDS);
    }
    /* Nothing more: pop times out, its out-pointer untouched. */
    shmb_stream_record *none = (shmb_stream_record *)(uintptr_t)1;
    EXPECT(shmb_stream_pop(consumer, 20, &none), SHMB_TIMEOUT);
    CHECK(none == (shmb_stream_record *)(uintptr_t)1);
    shmb_stream_stats st;
    EXPECT(shmb_stream_consumer_stats(consumer, &st), SHMB_OK);
    CHECK(st.lanes == 4 && st.ranks == 1 && st.producers == 0);
    CHECK(st.depth == 0 && st.bytes_in_use == 0 && st.records_lost == 0);
    CHECK(st.records_committed == (uint64_t)PRODUCERS * RECORDS);
    CHECK(st.records_released == (uint64_t)PRODUCERS * RECORDS);
    EXPECT(shmb_stream_consumer_close(consumer), SHMB_OK);
    printf("%lu records of %d C producers checked (%lu reserves waited for room)\n",
           (unsigned long)total, PRODUCERS, (unsigned long)st.full_waits);
}

/* Errors: each a status and a message, never a crash. */
static void error_paths(void) {
    char name[64];
    snprintf(name, sizeof name, "c-stream-errors-%d", (int)getpid());
    shmb_stream_consumer *consumer = NULL;
    shmb_stream_consumer *rank1 = NULL;
    shmb_stream_producer *producer = NULL, *other = NULL;
    shmb_stream_reservation *r = NULL;
    shmb_stream_record *rec = NULL;
    shmb_stream_stats st;
    void *p = NULL;
    const void *cp = NULL;
    size_t count = 0;
    uint32_t dtype = 0, four = 4, big = 1000;

    /* Creating: NULLs, bad schema texts, bad sizes. */
    EXPECT(shmb_stream_create(NULL, "t: int32[*]", 1, 256, 1, &consumer), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_create(name, NULL, 1, 256, 1, &consumer), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_create(name, "t: int32[*]", 1, 256, 1, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_create(name, "tokens int32", 1, 256, 1, &consumer), SHMB_INVALID_HEADER);
    EXPECT(shmb_stream_create(name, "t: complex[1]", 1, 256, 1, &consumer), SHMB_INVALID_HEADER);
    EXPECT(shmb_stream_create(name, "t: int32[*]", 1, 100, 1, &consumer), SHMB_INVALID_HEADER);
    EXPECT(shmb_stream_create(name, "t: int32[*]", 0, 256, 1, &consumer), SHMB_INVALID_HEADER);
    CHECK(consumer == NULL);
    EXPECT(shmb_stream_attach_producer(name, NULL, 0, &producer), SHMB_NOT_FOUND);

    /* One lane of 256 bytes: records of at most 128. */
    EXPECT(shmb_stream_create(name, "t: int32[*]", 1, 256, 1, &consumer), SHMB_OK);
    EXPECT(shmb_stream_create(name, "t: int32[*]", 1, 256, 1, &consumer), SHMB_NAME_IN_USE);
    EXPECT(shmb_stream_attach_producer(name, "t: float32[*]", 0, &producer), SHMB_LAYOUT_MISMATCH);
    EXPECT(shmb_stream_attach_producer(name, "t float32", 0, &producer), SHMB_INVALID_HEADER);
    EXPECT(shmb_stream_attach_producer(name, NULL, 0, &producer), SHMB_OK);
    EXPECT(shmb_stream_attach_producer(name, NULL, 0, &other), SHMB_ALREADY_ATTACHED);
    EXPECT(shmb_stream_attach_consumer(name, 1, 0, &rank1), SHMB_INVALID_HEADER);
    EXPECT(shmb_stream_attach_consumer(name, 0, 0, &rank1), SHMB_ALREADY_ATTACHED);
    CHECK(rank1 == NULL && other == NULL);
    uint32_t lane = 7;
    uint64_t max_record = 0;
    EXPECT(shmb_stream_producer_info(producer, &lane, &max_record), SHMB_OK);
    CHECK(lane == 0 && max_record == 128);

    /* Reserving: too large, wrong lengths, NULLs, a second one while one is open. */
    EXPECT(shmb_stream_reserve(producer, &big, 1, 0, &r), SHMB_RECORD_TOO_LARGE);
    EXPECT(shmb_stream_reserve(producer, NULL, 0, 0, &r), SHMB_INVALID_TENSOR);
    EXPECT(shmb_stream_reserve(producer, NULL, 1, 0, &r), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reserve(NULL, &four, 1, 0, &r), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reserve((shmb_stream_producer *)consumer, &four, 1, 0, &r),
           SHMB_INVALID_HANDLE);
    CHECK(r == NULL);
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, &r), SHMB_OK);
    shmb_stream_reservation *second = NULL;
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, &second), SHMB_OUT_OF_ORDER);
    EXPECT(shmb_stream_reservation_field(r, 1, &p, &count, &dtype), SHMB_INVALID_TENSOR);
    EXPECT(shmb_stream_reservation_field(r, 0, NULL, &count, &dtype), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reservation_field(r, 0, &p, NULL, &dtype), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reservation_field(r, 0, &p, &count, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_reservation_field(r, 0, &p, &count, &dtype), SHMB_OK);
    CHECK(count == 4 && dtype == SHMB_I32);
    /* An aborted reservation publishes nothing. */
    EXPECT(shmb_stream_abort(r), SHMB_OK);
    EXPECT(shmb_stream_abort(r), SHMB_CLOSED);
    EXPECT(shmb_stream_commit(r), SHMB_CLOSED);
    EXPECT(shmb_stream_reservation_field(r, 0, &p, &count, &dtype), SHMB_CLOSED);
    EXPECT(shmb_stream_pop(consumer, 0, &rec), SHMB_TIMEOUT);

    /* Full: records of 4 int32 until the lane has no room; the reserve that finds it
     * full waits 20 ms, then SHMB_FULL with nothing published. */
    int committed = 0;
    shmb_status s = SHMB_OK;
    for (int i = 0; i < 64; i++) {
        s = shmb_stream_reserve(producer, &four, 1, i == 0 ? 0 : 20, &r);
        if (s != SHMB_OK) break;
        EXPECT(shmb_stream_reservation_field(r, 0, &p, &count, &dtype), SHMB_OK);
        for (int j = 0; j < 4; j++) ((int32_t *)p)[j] = 100 * i + j;
        EXPECT(shmb_stream_commit(r), SHMB_OK);
        EXPECT(shmb_stream_commit(r), SHMB_CLOSED);
        committed++;
    }
    if (s != SHMB_FULL) {
        fprintf(stderr, "reserve into a full lane: %s (%s)\n", shmb_status_name(s),
                shmb_last_error_message());
        failures++;
    }
    CHECK(committed > 1 && committed < 64);
    EXPECT(shmb_stream_producer_stats(producer, &st), SHMB_OK);
    CHECK(st.depth == (uint64_t)committed && st.full_waits >= 1 && st.producers == 1);
    EXPECT(shmb_stream_producer_stats(producer, NULL), SHMB_INVALID_ARGUMENT);

    /* Every committed record, in order, and nothing of the one that found the lane full. */
    for (int i = 0; i < committed; i++) {
        EXPECT(shmb_stream_pop(consumer, 1000, &rec), SHMB_OK);
        uint64_t seq = 99;
        EXPECT(shmb_stream_record_info(rec, NULL, &seq, NULL), SHMB_OK);
        CHECK(seq == (uint64_t)i);
        EXPECT(shmb_stream_record_field(rec, 0, &cp, &count, &dtype), SHMB_OK);
        CHECK(count == 4 && dtype == SHMB_I32 && ((const int32_t *)cp)[3] == 100 * i + 3);
        EXPECT(shmb_stream_record_field(rec, 1, &cp, &count, &dtype), SHMB_INVALID_TENSOR);
        EXPECT(shmb_stream_record_field(rec, 0, NULL, &count, &dtype), SHMB_INVALID_ARGUMENT);
        EXPECT(shmb_stream_release(rec), SHMB_OK);
        /* A released record's handle: closed, whatever is asked of it. */
        EXPECT(shmb_stream_release(rec), SHMB_CLOSED);
        EXPECT(shmb_stream_record_field(rec, 0, &cp, &count, &dtype), SHMB_CLOSED);
        EXPECT(shmb_stream_record_info(rec, NULL, &seq, NULL), SHMB_CLOSED);
    }
    shmb_stream_record *untouched = NULL;
    EXPECT(shmb_stream_pop(consumer, 10, &untouched), SHMB_TIMEOUT);
    CHECK(untouched == NULL);
    EXPECT(shmb_stream_consumer_stats(consumer, &st), SHMB_OK);
    CHECK(st.depth == 0 && st.records_released == (uint64_t)committed);

    /* Handles: NULL, foreign, of another kind. */
    EXPECT(shmb_stream_pop(NULL, 0, &rec), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_pop(consumer, 0, NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_pop((shmb_stream_consumer *)producer, 0, &rec), SHMB_INVALID_HANDLE);
    EXPECT(shmb_stream_pop((shmb_stream_consumer *)(uintptr_t)0xdeadbeef, 0, &rec),
           SHMB_INVALID_HANDLE);
    EXPECT(shmb_stream_release(NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_release((shmb_stream_record *)(uintptr_t)0x12345678), SHMB_INVALID_HANDLE);
    EXPECT(shmb_stream_commit(NULL), SHMB_INVALID_ARGUMENT);
    EXPECT(shmb_stream_producer_info(NULL, &lane, NULL), SHMB_INVALID_ARGUMENT);

    /* A record outlives its consumer's handle; with no consumer left, producers are told. */
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, &r), SHMB_OK);
    EXPECT(shmb_stream_commit(r), SHMB_OK);
    EXPECT(shmb_stream_pop(consumer, 1000, &rec), SHMB_OK);
    EXPECT(shmb_stream_consumer_close(consumer), SHMB_OK);
    EXPECT(shmb_stream_consumer_close(consumer), SHMB_CLOSED);
    EXPECT(shmb_stream_pop(consumer, 0, &rec), SHMB_CLOSED);
    EXPECT(shmb_stream_record_field(rec, 0, &cp, &count, &dtype), SHMB_OK);
    CHECK(count == 4);
    EXPECT(shmb_stream_release(rec), SHMB_OK);
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, &r), SHMB_CLIENT_CLOSED);
    EXPECT(shmb_stream_producer_close(producer), SHMB_OK);
    EXPECT(shmb_stream_producer_close(producer), SHMB_CLOSED);
    EXPECT(shmb_stream_reserve(producer, &four, 1, 0, &r), SHMB_CLOSED);
    /* The creator's close removed the name. */
    EXPECT(shmb_stream_attach_producer(name, NULL, 0, &producer), SHMB_NOT_FOUND);
}

int main(int argc, char **argv) {
    if (argc == 5 && strcmp(argv[1], "produce") == 0)
        return produce(argv[2], (uint32_t)strtoul(argv[3], NULL, 10),
                       strtoull(argv[4], NULL, 10));
    if (argc != 1) {
        fprintf(stderr, "usage: %s [produce NAME ID N]\n", argv[0]);
        return 2;
    }
    many_producers();
    error_paths();
    if (failures) {
        fprintf(stderr, "%d expectations failed\n", failures);
        return 1;
    }
    printf("every stream expectation held\n");
    return 0;
}
