/*
 * Attacks on the merged code, each a defect found by playing a careless user
 * or a hostile peer: hostile but well-typed arguments, and the places where
 * elastic pools, reservations, the import cache and the group exchange meet.
 * Each test says what it caught.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

#define CHUNK (2 * MiB) /* the emulator's granularity */

static vmmt_pool_config elastic_config(uint64_t max, uint32_t idle_ms)
{
    vmmt_pool_config c = config(max, 1);
    c.elastic = 1;
    c.chunk_size = CHUNK;
    c.idle_release_ms = idle_ms;
    return c;
}

/*
 * idle_release_ms was turned into microseconds in 32 bits: 4294968 ms (about
 * 72 minutes) wrapped to 704 us, so a pool asked to keep its chunks for an
 * hour gave them back at once (and UINT32_MAX, "keep for ever", meant 71
 * minutes).
 */
static void test_elastic_long_idle_release_does_not_wrap(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 4294968u);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    /* Several recycler periods: a wrapped bound of 704 us has long passed. */
    sleep_ms(100);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    sleep_ms(50);
    assert_int_equal(stats(f->pool).resident_bytes, CHUNK);
    assert_int_equal(stats(f->pool).chunks_released, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_elastic_long_idle_release_does_not_wrap),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
