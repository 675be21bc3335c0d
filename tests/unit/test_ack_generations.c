/*
 * Issue 8, defect 6: an acknowledgement may only ever release the occupant
 * it names.
 *
 * Before the fix: a forged descriptor one generation ahead, acknowledged
 * while its slot was free, had the slot's next occupant recycled before
 * anyone read it (test_forged_one_ahead); one far ahead wedged the slot for
 * good (test_forged_far_ahead); a consume whose wait for the ready word
 * failed still wrote its acknowledgement and the retry was refused
 * (test_failed_wait_acknowledges_nothing); a failed acknowledgement write
 * lost the slice and the retry was VMMT_ESTATE (test_failed_ack_write_retry);
 * after 2^31 cancels of a slot the next descriptor was judged stale and
 * leaked (test_wrap_after_many_cancels); a leftover acknowledgement equal to
 * a generation reached again after 2^32 - 1 occupants released it early
 * (test_leftover_ack_at_wrap). test_random_sequences runs thousands of
 * random publish / consume / ack / cancel / forged / failed sequences and
 * checks that no occupant is released before every rank acknowledged it
 * (or it was cancelled), that the bytes are right, and that nothing leaks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctrl.h"
#include "desc.h"
#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "pool_internal.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

#define rnd tu_rand

/* A short consumer timeout: forged descriptors one ahead wait it out. */
static void short_consumer(struct fixture *f, int timeout_ms)
{
    vmmt_consumer_config cc;

    vmmt_consumer_destroy(f->consumer);
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = timeout_ms;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &f->consumer));
}

/* The same descriptor with another generation: a forgery, or a replay of a stale one. */
/* d at another generation, sealed again: a key holder's forgery (poolfix.h, reseal). */
static vmmt_desc with_generation(vmmt_pool *p, const vmmt_desc *d, uint32_t gen)
{
    struct vmmt__desc raw;
    vmmt_desc out;

    assert_vmmt_ok(vmmt__desc_decode(d->bytes, &raw));
    raw.generation = gen;
    vmmt__desc_encode(&raw, out.bytes);
    reseal(p, &out);
    return out;
}

static uint32_t gen_of(const vmmt_desc *d)
{
    vmmt_desc_info i;
    assert_vmmt_ok(vmmt_desc_inspect(d, &i));
    return i.generation;
}

static uint32_t slot_of(const vmmt_desc *d)
{
    vmmt_desc_info i;
    assert_vmmt_ok(vmmt_desc_inspect(d, &i));
    return i.slot;
}

static uint32_t in_flight_now(struct fixture *f)
{
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    return stats(f->pool).in_flight;
}

/* ------------------------------------------------------- the arithmetic */

static void test_occupant_arithmetic(void **state)
{
    (void)state;
    tu_rand_seed(0x243f6a8885a308d3ull);
    assert_int_equal(vmmt__next_generation(0), VMMT__GEN_FIRST);
    assert_int_equal(vmmt__next_generation(VMMT__GEN_LAST), VMMT__GEN_FIRST); /* the wrap */
    assert_int_equal(vmmt__occupant_of(0, VMMT__GEN_FIRST), VMMT__OCC_GONE);  /* a fresh table */
    assert_int_equal(vmmt__occupant_of(vmmt__gen_retired(VMMT__GEN_LAST), VMMT__GEN_FIRST),
                     VMMT__OCC_GONE);
    assert_int_equal(vmmt__occupant_of(0, 9), VMMT__OCC_GONE);
    assert_int_equal(vmmt__occupant_of(0, 0), VMMT__OCC_GONE);
    assert_int_equal(vmmt__occupant_of(1, 1), VMMT__OCC_GONE); /* counter 0 is no generation */
    for (int i = 0; i < 100000; i++) {
        uint32_t g = ((uint32_t)rnd() & ~3u) | 1u, d = (uint32_t)rnd(), prev;
        if (i % 4 == 0) g = VMMT__GEN_LAST - 4 * (uint32_t)(rnd() % 3);
        if (!vmmt__generation_valid(g)) continue;
        prev = g == VMMT__GEN_FIRST ? VMMT__GEN_LAST : g - 4;
        assert_int_equal(vmmt__next_generation(prev), g);
        assert_int_equal(vmmt__occupant_of(g, g), VMMT__OCC_READY);
        assert_int_equal(vmmt__occupant_of(vmmt__gen_pending(g), g), VMMT__OCC_COPYING);
        assert_int_equal(vmmt__occupant_of(vmmt__gen_abandoned(g), g), VMMT__OCC_ABANDONED);
        assert_int_equal(vmmt__occupant_of(vmmt__gen_retired(prev), g), VMMT__OCC_GONE);
        /* Retired, the next occupant's words, 2^31 away: none of them names g. */
        assert_int_equal(vmmt__occupant_of(vmmt__gen_retired(g), g), VMMT__OCC_GONE);
        assert_int_equal(vmmt__occupant_of(vmmt__next_generation(g), g), VMMT__OCC_GONE);
        assert_int_equal(vmmt__occupant_of(g + 0x80000000u, g), VMMT__OCC_GONE);
        /* A stream wait for g (GEQ, wrap-aware) passes on LIVE and after, never before. */
        assert_true((int32_t)(vmmt__gen_pending(g) - g) < 0);
        assert_true((int32_t)(vmmt__gen_retired(prev) - g) < 0);
        assert_true((int32_t)(vmmt__gen_retired(g) - g) >= 0);
        assert_true((int32_t)(vmmt__gen_abandoned(g) - g) >= 0);
        if (d != g && d != vmmt__gen_pending(g) && d != vmmt__gen_abandoned(g))
            assert_int_equal(vmmt__occupant_of(d, g), VMMT__OCC_GONE);
    }
}

/* The CPU acknowledgement store: written only while the ready word shows the generation. */
static void test_store_ack(void **state)
{
    uint32_t ready = 0, ack = 0;
    (void)state;
    tu_rand_seed(0x13198a2e03707344ull);

    ready = 5;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 6), 0); /* not given out yet */
    assert_int_equal(ack, 0);
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 5000), 0); /* far ahead */
    assert_int_equal(ack, 0);
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 5), 1);
    assert_int_equal(ack, 5);
    ready = 6;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 6), 1);
    /* A late acknowledgement of 5 never overwrites 6. */
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 5), 0);
    assert_int_equal(ack, 6);
    /* Across the wrap, and 2^31 apart, equality alone decides. */
    ready = 1;
    ack = UINT32_MAX;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 1), 1);
    assert_int_equal(ack, 1);
    ready = 0x80000010u;
    ack = 0x10;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 0x80000010u), 1);
    /* A word that holds gen already (the producer's cancel or release wrote it over this
     * process's TAKEN) is done only while the slot still shows gen: once it moved on, the
     * copy before it may have read the next buffer. */
    ready = 9;
    ack = 5;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 5), 0);
    assert_int_equal(ack, 5);
    ready = 5;
    assert_int_equal(vmmt__ctrl_store_ack(&ack, &ready, 5), 1);
    /* Random: 1 exactly when ready shows gen; the word then holds gen, else it is unchanged. */
    for (int i = 0; i < 100000; i++) {
        uint32_t r = (uint32_t)rnd(), a = (uint32_t)rnd(), g = (uint32_t)rnd();
        if (i % 3 == 0) g = r;
        if (i % 7 == 0) a = g;
        ready = r;
        ack = a;
        int stored = vmmt__ctrl_store_ack(&ack, &ready, g);
        assert_int_equal(stored, r == g);
        assert_int_equal(ack, stored ? g : a);
    }
}

/* ------------------------------------------------------- forged descriptors */

static void test_forged_one_ahead(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d1, d2, forged;

    c.max_slices = 4;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    short_consumer(f, 100);
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d1, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    /* The slot is free; a descriptor of its next occupant does not exist yet. */
    forged = with_generation(f->pool, &d1, vmmt__next_generation(gen_of(&d1)));
    assert_int_not_equal(vmmt_consumer_ack(f->consumer, &forged, 0, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_OK);
    /* The next occupant takes that slot and generation ... */
    put(f, f->src, 4096, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d2));
    assert_int_equal(slot_of(&d2), slot_of(&d1));
    assert_int_equal(gen_of(&d2), gen_of(&forged));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* ... and is not released before its reader comes. */
    assert_int_equal(in_flight_now(f), 1);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d2, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_forged_far_ahead(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d[4];

    c.max_slices = 4;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (int i = 0; i < 4; i++)
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d[i]));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    /* Far ahead of two occupants, and one behind: refused at once, nothing written. */
    for (int i = 0; i < 2; i++) {
        vmmt_desc far = with_generation(f->pool, &d[i], gen_of(&d[i]) + 1000);
        vmmt_desc behind = with_generation(f->pool, &d[i], gen_of(&d[i]) + 0x80000000u);
        assert_int_equal(vmmt_consumer_ack(f->consumer, &far, 0, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_ESTATE);
        assert_error_contains("names no live occupant of the slot");
        assert_int_equal(
            vmmt_consume(f->consumer, &behind, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
            VMMT_ESTATE);
    }
    /* Every slot still cycles: nothing is wedged. */
    for (int i = 0; i < 4; i++)
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d[i], 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 4; i++)
            assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d[i]));
        for (int i = 0; i < 4; i++)
            assert_vmmt_ok(
                vmmt_consume(f->consumer, &d[i], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
}

/*
 * The same across processes: a consumer process given descriptors far ahead
 * of and half a cycle away from the real ones refuses each before it copies
 * or writes anything, and every slot keeps cycling.
 */
static void test_forged_across_processes(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d[4];
    uint32_t idx = 0;
    int sock;
    pid_t pid;

    c.max_slices = 4;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    /* Before the fix the child's stream waited on a forged generation: let such a wait fail soon.
     */
    setenv("VMMT_EMU_WAIT_TIMEOUT_MS", "300", 1);
    spawn_consumer(0, 0, 1, &sock, &pid);
    unsetenv("VMMT_EMU_WAIT_TIMEOUT_MS");
    for (int round = 0; round < 3; round++) {
        for (uint32_t i = 0; i < 4; i++) {
            put(f, f->src, 4096, idx + i);
            assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d[i]));
        }
        for (uint32_t i = 0; i < 4; i++, idx++) {
            vmmt_desc forged =
                with_generation(f->pool, &d[i], gen_of(&d[i]) + (i % 2 ? 1000 : 0x80000000u));
            send_desc(sock, idx, &forged);
            assert_int_equal(read_reply(sock, idx), VMMT_ESTATE);
            send_desc(sock, idx, &d[i]);
            expect_reply(sock, idx);
        }
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
    send_desc(sock, UINT32_MAX, NULL);
    /* The child counts each refused descriptor as a failure: 12 of them. */
    assert_int_equal(tu_wait(pid, 30000), 1);
    close(sock);
    assert_int_equal(stats(f->pool).recycled, 12);
}

/* ------------------------------------------------------------- failures */

static void test_failed_wait_acknowledges_nothing(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;
    struct gate g;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    short_consumer(f, 100);
    tu_roundtrip(f, 4096, 1);
    put(f, f->src, 4096, 7);
    setenv("VMMT_EMU_WAIT_HOST", "0", 1); /* the consumer polls the ready word */
    vmmt__emu_configure();
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d)); /* its copy waits behind the gate */
    assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, g.stream, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    assert_int_equal(vmmt_consumer_ack(f->consumer, &d, 0, g.stream, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    gate_open_later(&g, 0);
    gate_free(&g);
    /* The copy landed; no acknowledgement was written for the failed waits. */
    assert_int_equal(in_flight_now(f), 1);
    /* The retry works. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    unsetenv("VMMT_EMU_WAIT_HOST");
    vmmt__emu_configure();
    expect(f, f->dst, 4096, 7);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * A device table's acknowledgement after a copy is written by the acker's
 * thread once the copy is done (after a read of the ready word): a failed
 * write there cannot reach vmmt_consume's caller, so it is tried again and
 * the slice comes back; one that keeps failing past the consumer's timeout
 * leaves the slice to vmmt_pool_release_rank and vmmt_consumer_check says
 * VMMT_EFAILED. (Only a
 * dropped descriptor of a synchronous hand-off is written in the call, its
 * failure returned; the random sequences below cover it.)
 */
static void test_failed_ack_write_retry(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 2);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_buffer pk[2] = {bytes(f->src, 1000), bytes(f->src + 8192, 3000)};
    vmmt_desc d, p[2];

    if (!on_emu()) skip();
    c.device_control_table = 1; /* acknowledgements are stream writes, which can fail */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 3);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    /* The second rank's write fails once: tried again, the slice comes back. */
    emu_fail("cuStreamWriteValue32:2:CUDA_ERROR_INVALID_VALUE");
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    emu_reset();
    expect(f, f->dst, 4096, 3);
    assert_int_equal(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);

    /* Every write fails for a while: tried again on the acker's later passes, the
     * bytes are right (check OK), and the acknowledgement lands once the driver works
     * again (three failures in a row lost it for good: test_attack_flush). */
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    emu_fail("cuStreamWriteValue32:*:CUDA_ERROR_INVALID_VALUE");
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    assert_int_equal(in_flight_now(f), 1);
    emu_reset();
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));

    /* Failing past the consumer's timeout: given up, the check says so, and the
     * ranks' release gives the slice back. */
    vmmt_consumer_config cc;
    vmmt_consumer *brief;
    int st = VMMT_OK;
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 100;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &brief));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    emu_fail("cuStreamWriteValue32:*:CUDA_ERROR_INVALID_VALUE");
    assert_vmmt_ok(vmmt_consume(brief, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    for (int i = 0; i < 500 && (st = vmmt_consumer_check(brief, &d)) == VMMT_OK; i++)
        usleep(10 * 1000);
    assert_int_equal(st, VMMT_EFAILED);
    assert_non_null(strstr(vmmt_last_error(), "driver kept failing"));
    emu_reset();
    assert_int_equal(in_flight_now(f), 1);
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(brief);

    /* A dropped descriptor: its acknowledgement follows the stream's wait for the ready
     * word, so the acker writes it too, and tries again. */
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    emu_fail("cuStreamWriteValue32:1:CUDA_ERROR_INVALID_VALUE");
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 1));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    emu_reset();
    assert_int_equal(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 0, 1), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, 1, 1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));

    /* The member completing a packed group: written after the copies, tried again. */
    assert_vmmt_ok(vmmt_publish_packed(f->pool, pk, 2, f->stream, p));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &p[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    emu_fail("cuStreamWriteValue32:1:CUDA_ERROR_INVALID_VALUE");
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &p[1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    emu_reset();
    assert_int_equal(
        vmmt_consume(f->consumer, &p[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ESTATE);
}

/* ------------------------------------------------------------------ wrap */

/*
 * Stand in for n cancels of slot `slot` (2^31 of them would take half an
 * hour): each would have advanced the generation and left its ready word,
 * and no consumer would have seen them.
 */
static void skip_generations(struct fixture *f, uint32_t slot, uint32_t to)
{
    struct vmmt_pool *p = f->pool;
    CUdeviceptr word = vmmt__ctrl_ready(p->ctrl_dev, p->stride, slot);

    assert_int_equal(in_flight_now(f), 0);
    p->slot[slot].generation = to;
    p->last_generation = to;
    if (p->host_table) {
        p->table_host[vmmt__ctrl_ready(0, p->stride, slot) / 4] = vmmt__gen_retired(to);
    } else {
        assert_int_equal(
            vmmt__drv()->cuStreamWriteValue32(f->stream, word, vmmt__gen_retired(to), 0),
            CUDA_SUCCESS);
        assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    }
}

static void wrap_after_many_cancels(struct fixture *f, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d, d1;
    uint32_t g;

    c.max_slices = 1;
    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1));
    /* The consumer saw the first generation of slot 0. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d1, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    g = VMMT__GEN_FIRST + 0x80000000u + 4 * 5;
    skip_generations(f, 0, g);
    put(f, f->src, 4096, 9);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(gen_of(&d), g + 4);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 9);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    /* A replay of the first generation is refused, not taken for the newer one. */
    assert_int_equal(
        vmmt_consume(f->consumer, &d1, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ESTATE);
    assert_error_contains("names no live occupant of the slot");
}

static void test_wrap_after_many_cancels(void **state)
{
    wrap_after_many_cancels(*state, 0);
}

static void test_wrap_after_many_cancels_device_table(void **state)
{
    wrap_after_many_cancels(*state, 1);
}

static void leftover_ack_at_wrap(struct fixture *f, int device_table)
{
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    c.max_slices = 1;
    c.device_control_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    tu_roundtrip(f, 4096, 1); /* rank 0's word holds the first generation */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    skip_generations(f, 0, VMMT__GEN_LAST - 4);
    for (uint32_t i = 0; i < 3; i++) {
        put(f, f->src, 4096, 20 + i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
        /* The last generation, then the first (which rank 0's word still held), then the next. */
        assert_int_equal(gen_of(&d), i == 0 ? VMMT__GEN_LAST : VMMT__GEN_FIRST + 4 * (i - 1));
        assert_int_equal(in_flight_now(f), 1);
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        expect(f, f->dst, 4096, 20 + i);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
}

static void test_leftover_ack_at_wrap(void **state)
{
    leftover_ack_at_wrap(*state, 0);
}

static void test_leftover_ack_at_wrap_device_table(void **state)
{
    leftover_ack_at_wrap(*state, 1);
}

/* ------------------------------------------------------ random sequences */

#define SLOTS 4
#define RANKS 2
#define KEEP  64

struct real {
    vmmt_desc d;
    uint32_t slot, gen, pattern;
    size_t n;
    int acked[RANKS];
    int cancelled;
    int live; /* published, not yet finished by every rank or cancelled */
};

struct model {
    struct fixture *f;
    vmmt_consumer *quick;     /* a second consumer with a short timeout, for forgeries that wait */
    uint32_t last_gen[SLOTS]; /* a slot's generations so far are exactly 1..last_gen */
    int device_table;
    struct real r[KEEP];
    int count;
    uint32_t next_pattern;
    int ops[16];
};

static int unfinished(const struct model *m)
{
    int n = 0;
    for (int i = 0; i < m->count; i++)
        n += m->r[i].live;
    return n;
}

static void update_live(struct real *x)
{
    int all = 1;
    for (int k = 0; k < RANKS; k++)
        all &= x->acked[k];
    x->live = !x->cancelled && !all;
}

/* Forget finished entries so the table stays small; keep a few as replays. */
static void compact(struct model *m)
{
    int w = 0;
    for (int i = 0; i < m->count; i++)
        if (m->r[i].live || (rnd() % 4 == 0 && w < KEEP / 2)) m->r[w++] = m->r[i];
    m->count = w;
}

static struct real *pick_live(struct model *m)
{
    int n = unfinished(m), k;
    if (n == 0) return NULL;
    k = (int)(rnd() % (uint64_t)n);
    for (int i = 0; i < m->count; i++)
        if (m->r[i].live && k-- == 0) return &m->r[i];
    return NULL;
}

static void op_publish(struct model *m)
{
    struct fixture *f = m->f;
    struct real x;
    vmmt_buffer b;
    int st;

    if (m->count >= KEEP) compact(m);
    if (m->count >= KEEP) return;
    memset(&x, 0, sizeof x);
    x.n = 64 + rnd() % 8192;
    x.pattern = ++m->next_pattern;
    b = bytes(f->src, x.n);
    put(f, f->src, x.n, x.pattern);
    if (on_emu() && rnd() % 10 == 0) {
        /* A publish whose copy fails hands its generation back: no gap in a slot's sequence. */
        emu_fail_without_kernel("cuMemcpyDtoDAsync:1:CUDA_ERROR_INVALID_VALUE");
        st = vmmt_publish(f->pool, &b, f->stream, &x.d);
        emu_reset();
        assert_true(st == VMMT_ECUDA || st == VMMT_EFULL);
        m->ops[7]++;
        return;
    }
    st = vmmt_publish(f->pool, &b, f->stream, &x.d);
    if (st == VMMT_EFULL) {
        assert_int_equal(unfinished(m) > 0 || stats(f->pool).in_flight > 0, 1);
        return;
    }
    assert_vmmt_ok(st);
    x.slot = slot_of(&x.d);
    x.gen = gen_of(&x.d);
    x.live = 1;
    assert_true(x.slot < SLOTS);
    /* One counter for the pool (src/wire/generation.h), failed publishes retiring what
     * they took: the slot's next occupant is later, never the same. */
    assert_true(x.gen > m->last_gen[x.slot] && vmmt__generation_valid(x.gen));
    m->last_gen[x.slot] = x.gen;
    /* No live occupant of this slot in the model: that would be an early release. */
    for (int i = 0; i < m->count; i++)
        if (m->r[i].live && m->r[i].slot == x.slot)
            fail_msg("slot %u given to generation %u while generation %u is unfinished", x.slot,
                     x.gen, m->r[i].gen);
    m->r[m->count++] = x;
    m->ops[0]++;
}

/* Consume or drop a live descriptor for one rank or all; sometimes with a failing write. */
static void op_consume(struct model *m, int drop)
{
    struct fixture *f = m->f;
    struct real *x = pick_live(m);
    int first, count, st, inject;

    if (x == NULL) return;
    if (rnd() % 2) {
        first = VMMT_ALL_RANKS, count = 0;
        for (int k = 0; k < RANKS; k++)
            if (x->acked[k]) first = -2;
        if (first == -2) return;
    } else {
        first = (int)(rnd() % RANKS), count = 1;
        if (x->acked[first]) return;
    }
    inject = m->device_table && on_emu() && rnd() % 8 == 0;
    if (inject) emu_fail("cuStreamWriteValue32:1:CUDA_ERROR_INVALID_VALUE");
    if (drop)
        st = vmmt_consumer_ack(f->consumer, &x->d, 0, f->stream, first, count);
    else
        st = vmmt_consume(f->consumer, &x->d, 0, f->dst, f->cap, f->stream, first, count);
    if (inject) emu_reset();
    /* A write in the call fails it (nothing recorded: the model retries later); one by the
     * acker's thread, after the copy, is tried again there, and the call was OK. */
    if (inject && st == VMMT_ECUDA) {
        m->ops[1]++;
        return;
    }
    if (st != VMMT_OK) fail_msg("%s -> %d: %s", drop ? "ack" : "consume", st, vmmt_last_error());
    if (!drop && rnd() % 4 == 0) expect(f, f->dst, x->n, x->pattern);
    for (int k = 0; k < RANKS; k++)
        if (first == VMMT_ALL_RANKS || k == first) x->acked[k] = 1;
    update_live(x);
    m->ops[drop ? 2 : 3]++;
}

static void op_cancel(struct model *m)
{
    struct real *x = pick_live(m);
    if (x == NULL) return;
    for (int k = 0; k < RANKS; k++)
        if (x->acked[k]) return; /* only a descriptor no consumer has seen */
    assert_vmmt_ok(vmmt_cancel(m->f->pool, &x->d));
    x->cancelled = 1;
    update_live(x);
    m->ops[4]++;
}

/*
 * A forged or replayed descriptor: another generation of a real one's slot.
 * It must never return OK for a generation that is not the slot's occupant,
 * and whatever it returns, the model's invariants must hold afterwards.
 */
static void op_forge(struct model *m)
{
    struct fixture *f = m->f;
    struct real *x;
    uint32_t gen;
    vmmt_desc forged;
    int st, kind = (int)(rnd() % 4), live_same = 0;

    if (m->count == 0) return;
    x = &m->r[rnd() % (uint64_t)m->count];
    if (x->cancelled && kind == 3) return; /* a cancelled occupant may still be read */
    switch (kind) {
    case 0: gen = x->gen + 2 + (uint32_t)(rnd() % 1000); break; /* far ahead */
    case 1: gen = x->gen - 1 - (uint32_t)(rnd() % 3); break;    /* behind */
    case 2: gen = x->gen + 0x80000000u; break;                  /* half a cycle away */
    default: gen = x->gen; break;                               /* a replay as it was */
    }
    if (gen == 0) gen = 1;
    /* One ahead of the slot's last occupant cannot be told from the occupant
     * the producer will publish next: it waits for it (op_forge_next). */
    if (gen == vmmt__next_generation(m->last_gen[x->slot])) return;
    /* Whether this (slot, generation) is a real unfinished occupant. */
    for (int i = 0; i < m->count; i++)
        if (m->r[i].slot == x->slot && m->r[i].gen == gen && m->r[i].live) live_same = 1;
    if (live_same) return; /* that is no forgery */
    forged = with_generation(f->pool, &x->d, gen);
    if (rnd() % 2)
        st = vmmt_consumer_ack(f->consumer, &forged, 0, f->stream, VMMT_ALL_RANKS, 0);
    else
        st = vmmt_consume(f->consumer, &forged, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0);
    /* A generation the producer never gave out must be refused; an old one
     * (a replay) may be read, but its acknowledgement releases nobody else. */
    if (st == VMMT_OK && gen > m->last_gen[x->slot])
        fail_msg("forged slot %u generation %u (kind %d, last %u, x %u) was accepted", x->slot, gen,
                 kind, m->last_gen[x->slot], x->gen);
    m->ops[5]++;
}

/*
 * One ahead of a slot's last occupant while none is published: the shared
 * table's consumer waits its (short) timeout out and writes nothing.
 */
static void op_forge_next(struct model *m)
{
    struct fixture *f = m->f;
    struct real *x = NULL;
    vmmt_desc forged;
    uint32_t slot = (uint32_t)(rnd() % SLOTS);

    if (m->device_table) return; /* a device table's consumer waits on its stream */
    for (int i = 0; i < m->count; i++) {
        if (m->r[i].slot != slot) continue;
        if (m->r[i].live) return;
        if (m->r[i].gen == m->last_gen[slot]) x = &m->r[i];
    }
    if (x == NULL) return;
    forged = with_generation(f->pool, &x->d, vmmt__next_generation(x->gen));
    assert_int_not_equal(vmmt_consumer_ack(m->quick, &forged, 0, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_OK);
    m->ops[6]++;
}

/* No unfinished occupant is ever released; recycled slots come back. */
static void check_invariants(struct model *m)
{
    struct fixture *f = m->f;
    uint32_t in_flight;

    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    in_flight = in_flight_now(f);
    if (in_flight < (uint32_t)unfinished(m))
        fail_msg("%u slices in flight but %d occupants unfinished: one was released early",
                 in_flight, unfinished(m));
}

static void random_sequences(struct fixture *f, int device_table, uint64_t seed, int steps)
{
    vmmt_pool_config c = config(4 * MiB, RANKS);
    struct model *m = calloc(1, sizeof *m);

    tu_rand_seed(seed);
    c.max_slices = SLOTS;
    c.device_control_table = device_table;
    /* Injected write failures are meant for the consumer's acknowledgements;
     * the recycler writes RETIRED words with the same entry point, so it is
     * kept quiet (publishes that find no room reclaim themselves). */
    if (device_table) c.recycle_interval_us = 60u * 1000 * 1000;
    m->f = f;
    m->device_table = device_table;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    {
        vmmt_consumer_config cc;
        vmmt_consumer_config_init(&cc);
        cc.timeout_ms = 10;
        assert_vmmt_ok(vmmt_consumer_create(&cc, &m->quick));
    }
    for (int step = 0; step < steps; step++) {
        int r = (int)(rnd() % 100);
        if (r < 30)
            op_publish(m);
        else if (r < 55)
            op_consume(m, 0);
        else if (r < 75)
            op_consume(m, 1);
        else if (r < 82)
            op_cancel(m);
        else if (r < 98)
            op_forge(m);
        else
            op_forge_next(m);
        if (step % 8 == 0) check_invariants(m);
    }
    /* Finish every live occupant: then nothing may stay in flight. */
    for (int i = 0; i < m->count; i++) {
        struct real *x = &m->r[i];
        for (int k = 0; k < RANKS && x->live; k++)
            if (!x->acked[k])
                assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &x->d, 0, f->stream, k, 1));
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(m->quick);
    print_message("seed %llx, %s table: %d publishes, %d failed publishes, %d failed writes, "
                  "%d drops, %d consumes, %d cancels, %d forged, %d forged one ahead\n",
                  (unsigned long long)seed, device_table ? "device" : "host", m->ops[0], m->ops[7],
                  m->ops[1], m->ops[2], m->ops[3], m->ops[4], m->ops[5], m->ops[6]);
    free(m);
}

static void test_random_sequences(void **state)
{
    struct fixture *f = *state;
    for (uint64_t seed = 1; seed <= 12; seed++) {
        random_sequences(f, 0, seed * 0x9e3779b97f4a7c15ull, 1500);
        vmmt_pool_destroy(f->pool);
        f->pool = NULL;
    }
}

static void test_random_sequences_device_table(void **state)
{
    struct fixture *f = *state;
    for (uint64_t seed = 1; seed <= 12; seed++) {
        random_sequences(f, 1, seed * 0xbf58476d1ce4e5b9ull, 1500);
        vmmt_pool_destroy(f->pool);
        f->pool = NULL;
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_occupant_arithmetic),
        cmocka_unit_test(test_store_ack),
        T(test_forged_one_ahead),
        T(test_forged_far_ahead),
        T(test_forged_across_processes),
        T(test_failed_wait_acknowledges_nothing),
        T(test_failed_ack_write_retry),
        T(test_wrap_after_many_cancels),
        T(test_wrap_after_many_cancels_device_table),
        T(test_leftover_ack_at_wrap),
        T(test_leftover_ack_at_wrap_device_table),
        T(test_random_sequences),
        T(test_random_sequences_device_table),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
