/* The checks the C test programs share: EXPECT(call, status) counts a call that returns
 * another status, or an error status without a message; `failures` is their count. */
#ifndef SHMB_TEST_EXPECT_H
#define SHMB_TEST_EXPECT_H

#include <stdio.h>

#include "shmbridge.h"

static int failures = 0;

#define EXPECT(call, want)                                                                  \
    do {                                                                                    \
        shmb_status got_ = (call);                                                          \
        if (got_ != (want)) {                                                               \
            fprintf(stderr, "line %d: %s: got %s, want %s (%s)\n", __LINE__, #call,        \
                    shmb_status_name(got_), shmb_status_name(want), shmb_last_error_message()); \
            failures++;                                                                     \
        } else if ((want) != SHMB_OK && shmb_last_error_message()[0] == '\0') {             \
            fprintf(stderr, "line %d: %s: no error message\n", __LINE__, #call);           \
            failures++;                                                                     \
        }                                                                                   \
    } while (0)

#endif
