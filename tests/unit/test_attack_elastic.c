/*
 * An outside attack on ELASTIC pools (vmmt_pool_config.elastic = 1: device
 * memory in chunks made on demand and given back after idle_release_ms;
 * consumers map each chunk on first use and map again a chunk made again),
 * written from include/vmmt.h and the docs alone (docs/descriptor.md "What a
 * reader must verify, in order" and "Elastic pools: chunks", docs/design.md
 * "Elastic pools", docs/reliability.md), not from src/.
 *
 * The contract attacked: every VMMT_OK of vmmt_consume / vmmt_consume_ranks
 * (and of vmmt_consumer_check after the stream is synchronized) means the
 * destination holds exactly that publish's bytes; a stale, recycled,
 * cancelled or replayed descriptor is refused (VMMT_ESTATE, or VMMT_ECLOSED
 * when its producer died), never OK with another buffer's bytes and never
 * VMMT_EINVAL / VMMT_EPROTO, and writes nothing; a live descriptor is not
 * refused; nothing leaks (fds, mappings, reservations, threads: the
 * fixture's teardown counts them) and nothing waits for ever.
 *
 * Two consumer objects of this process share nothing but the control table
 * and the broker, so they stand for two processes. A dead producer is this
 * very program started again as a child (main's "elastic-producer" mode)
 * and killed. Tests named test_finding_* assert the contract where the
 * library broke it (they failed until it was fixed); each says what went
 * wrong and how to replay it.
 *
 * Results (emulated driver, 2 cores busy, RelWithDebInfo and ASan/UBSan):
 * held: replays from old and fresh consumers with chunks resident, given
 * back and made again (small, boundary-ending and chunk-spanning buffers),
 * a remade second chunk under a spanning buffer, cancel under a queued copy
 * with the pool run round and the chunk made again, release_rank under a
 * queued copy, eviction (refused while a copy is queued) and max_pools = 1
 * over two elastic pools, injected import/map/access/reserve failures (a
 * driver status, the retry copies right), shutdown and producer death
 * (ECLOSED; the queued wait ends; check EFAILED), and a threaded race of
 * replays against 1 ms give-back (every OK right and unique, every refusal
 * ESTATE). One finding, fixed the same day (copies hold their chunks, counted
 * per chunk: src/consumer/chunks.c): test_finding_live_descriptor_refused_
 * while_unrelated_copy_queued failed before and passes now. (0-byte
 * buffers, which descriptor.md's step 2 mentions, cannot be published:
 * vmmt_publish, packed members, typed empty shapes and vmmt_commit all
 * refuse nbytes = 0 with VMMT_EINVAL.)
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "rawbroker.h"

#define CHUNK POOLFIX_CHUNK
#define SMALL 4096u
#define SENT  0xfeedu /* the pattern a destination holds where nothing may land */

/* ------------------------------------------------------------ helpers */

/* Word k (8 bytes) of buffer i: distinct for every buffer index, not periodic in 256 buffers. */
static uint64_t pw(uint32_t i, uint64_t k)
{
    uint64_t x = ((uint64_t)i + 1) * 0x9E3779B97F4A7C15ull ^ k * 0xC2B2AE3D27D4EB4Full;

    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return x;
}

static void pat_fill(uint8_t *h, size_t n, uint32_t i)
{
    for (size_t k = 0; k * 8 < n; k++) {
        uint64_t w = pw(i, k);
        memcpy(h + k * 8, &w, n - k * 8 < 8 ? n - k * 8 : 8);
    }
}

/* Index of the first byte of h that is not buffer i's (to 8 bytes), n when all are. */
static size_t pat_check(const uint8_t *h, size_t n, uint32_t i)
{
    for (size_t k = 0; k * 8 < n; k++) {
        uint64_t w = pw(i, k);
        if (memcmp(h + k * 8, &w, n - k * 8 < 8 ? n - k * 8 : 8) != 0) return k * 8;
    }
    return n;
}

/* Without cmocka's asserts, for threads: 0, or -1 where the driver failed. */
static int raw_fill(CUstream s, CUdeviceptr at, size_t n, uint32_t i, uint8_t *h)
{
    const struct vmmt_drv *d = vmmt__drv();

    pat_fill(h, n, i);
    if (d->cuMemcpyHtoDAsync(at, h, n, s) != CUDA_SUCCESS) return -1;
    return d->cuStreamSynchronize(s) == CUDA_SUCCESS ? 0 : -1;
}

static size_t raw_first_bad(CUstream s, CUdeviceptr at, size_t n, uint32_t i, uint8_t *h)
{
    const struct vmmt_drv *d = vmmt__drv();

    if (d->cuMemcpyDtoHAsync(h, at, n, s) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(s) != CUDA_SUCCESS)
        return (size_t)-1;
    return pat_check(h, n, i);
}

static void fill_dev(CUstream s, CUdeviceptr at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n ? n : 1);

    assert_non_null(h);
    assert_int_equal(raw_fill(s, at, n, i, h), 0);
    free(h);
}

/* Index of the first byte at `at` that is not buffer i's, n when all are. */
static size_t first_bad(CUstream s, CUdeviceptr at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n ? n : 1);
    size_t j;

    assert_non_null(h);
    j = raw_first_bad(s, at, n, i, h);
    free(h);
    return j;
}

#define EXPECT_BYTES(s, at, n, i)                                                                  \
    do {                                                                                           \
        size_t fb_ = first_bad((s), (at), (n), (i));                                               \
        if (fb_ != (size_t)(n))                                                                    \
            fail_msg("destination is not buffer %u's bytes: first wrong byte %zu of %zu",          \
                     (unsigned)(i), fb_, (size_t)(n));                                             \
    } while (0)

#define EXPECT_STATUS(expr, want)                                                                  \
    do {                                                                                           \
        int es_ = (expr);                                                                          \
        if (es_ != (want))                                                                         \
            fail_msg("%s -> %d (%s), wanted %d (%s): %s", #expr, es_, vmmt_strerror(es_), (want),  \
                     vmmt_strerror(want), vmmt_last_error());                                      \
    } while (0)

static uint64_t d_off(const vmmt_desc *d)
{
    return tu_get64(d, 288);
}

static uint64_t d_nbytes(const vmmt_desc *d)
{
    return tu_get64(d, 296);
}

static vmmt_desc_info info_of(const vmmt_desc *d)
{
    vmmt_desc_info in;

    assert_vmmt_ok(vmmt_desc_inspect(d, &in));
    return in;
}

/* Publish n bytes of buffer i from src on s (VMMT_EFULL retried for at most 5 s), landed. */
static vmmt_desc pub_n(vmmt_pool *p, CUstream s, CUdeviceptr src, size_t n, uint32_t i)
{
    vmmt_buffer b = bytes(src, n);
    vmmt_desc d;
    int st;

    fill_dev(s, src, n, i);
    for (int k = 0; (st = vmmt_publish(p, &b, s, &d)) == VMMT_EFULL && k < 5000; k++)
        sleep_ms(1);
    assert_vmmt_ok(st);
    sync_on(s);
    return d;
}

static int cons(vmmt_consumer *c, const vmmt_desc *d, CUdeviceptr dst, CUstream s)
{
    return vmmt_consume(c, d, 0, dst, 8 * MiB, s, VMMT_ALL_RANKS, 0);
}

/* Consume, synchronize, check the bytes and vmmt_consumer_check: the whole promise of an OK. */
static void consume_good(vmmt_consumer *c, const vmmt_desc *d, CUdeviceptr dst, CUstream s,
                         uint32_t i)
{
    EXPECT_STATUS(cons(c, d, dst, s), VMMT_OK);
    sync_on(s);
    EXPECT_BYTES(s, dst, d_nbytes(d), i);
    assert_vmmt_ok(vmmt_consumer_flush(c));
    EXPECT_STATUS(vmmt_consumer_check(c, d), VMMT_OK);
}

/* A replay: refused with `want`, and not one byte of the destination written. */
static void refused(vmmt_consumer *c, const vmmt_desc *d, CUdeviceptr dst, CUstream s, int want)
{
    size_t n = d_nbytes(d) < 8 * MiB ? d_nbytes(d) : 8 * MiB;

    fill_dev(s, dst, n, SENT);
    EXPECT_STATUS(cons(c, d, dst, s), want);
    sync_on(s);
    EXPECT_BYTES(s, dst, n, SENT);
}

static long imports(void)
{
    return vmmt__emu_calls("cuMemImportFromShareableHandle");
}

static int resident_is(vmmt_pool *p, uint64_t bytes, long ms)
{
    for (long t = 0; t < ms; t += 2) {
        if (stats(p).resident_bytes == bytes) return 1;
        sleep_ms(2);
    }
    return stats(p).resident_bytes == bytes;
}

static void settle(struct fixture *f, vmmt_consumer *other)
{
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    if (other != NULL) assert_vmmt_ok(vmmt_consumer_flush(other));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static vmmt_consumer *new_consumer(void)
{
    vmmt_consumer *c = NULL;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &c));
    return c;
}

static vmmt_pool_config econf(uint64_t max, uint32_t idle_ms, int consumers)
{
    vmmt_pool_config c = elastic_config(max, idle_ms);

    c.consumer_count = consumers;
    return c;
}

/* ------------------------------------------------------------ replays */

/*
 * Replays of consumed descriptors, from the consumer that consumed them
 * (its chunks mapped) and from a fresh one, in the three states of their
 * chunks: still resident, given back, and made again for new buffers. The
 * buffers: one small, one ending exactly at a chunk boundary, one that
 * spans two chunks. Held: every replay VMMT_ESTATE, nothing written, no
 * chunk imported for a replay; the new buffers in the remade chunks are
 * copied right by the old consumer (it maps again).
 */
static void test_replays_across_chunk_lives(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(16 * MiB, 20, 1);
    /* 100 at 0, then [256, 2 MiB) ending at the boundary, then 3 MiB over chunks 1 and 2. */
    const size_t sizes[3] = {100, 2 * MiB - 256, 3 * MiB};
    vmmt_desc old[3], neu[3];
    vmmt_consumer *fresh;
    long before;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t i = 0; i < 3; i++)
        old[i] = pub_n(f->pool, f->stream, f->src, sizes[i], 10 + i);
    assert_int_equal(d_off(&old[1]) + d_nbytes(&old[1]), 2 * MiB);
    assert_int_equal(info_of(&old[2]).chunk, 1);
    for (uint32_t i = 0; i < 3; i++)
        consume_good(f->consumer, &old[i], f->dst, f->stream, 10 + i);
    settle(f, NULL);

    /* 1. Chunks still resident (20 ms is not over yet, or they are back: both hold). */
    fresh = new_consumer();
    before = imports();
    for (uint32_t i = 0; i < 3; i++) {
        refused(f->consumer, &old[i], f->dst, f->stream, VMMT_ESTATE);
        refused(fresh, &old[i], f->dst, f->stream, VMMT_ESTATE);
    }
    assert_int_equal(imports(), before);

    /* 2. Every chunk given back. */
    assert_true(resident_is(f->pool, 0, 3000));
    for (uint32_t i = 0; i < 3; i++) {
        refused(f->consumer, &old[i], f->dst, f->stream, VMMT_ESTATE);
        refused(fresh, &old[i], f->dst, f->stream, VMMT_ESTATE);
    }
    assert_int_equal(imports(), before);
    vmmt_consumer_destroy(fresh);

    /* 3. Made again for new buffers of the same sizes. */
    for (uint32_t i = 0; i < 3; i++)
        neu[i] = pub_n(f->pool, f->stream, f->src, sizes[i], 20 + i);
    fresh = new_consumer();
    for (uint32_t i = 0; i < 3; i++) {
        refused(f->consumer, &old[i], f->dst, f->stream, VMMT_ESTATE);
        refused(fresh, &old[i], f->dst, f->stream, VMMT_ESTATE);
    }
    for (uint32_t i = 0; i < 3; i++) {
        consume_good(f->consumer, &neu[i], f->dst, f->stream, 20 + i);
        refused(fresh, &neu[i], f->dst, f->stream, VMMT_ESTATE);
        refused(f->consumer, &neu[i], f->dst, f->stream, VMMT_ESTATE);
    }
    /* The old copies were good when they were made, and stay judged so. */
    for (uint32_t i = 0; i < 3; i++)
        EXPECT_STATUS(vmmt_consumer_check(f->consumer, &old[i]), VMMT_OK);
    vmmt_consumer_destroy(fresh);
    settle(f, NULL);
}

/*
 * A buffer over chunks 0 and 1 with chunk 0 kept resident (min_resident):
 * chunk 1 goes back and is made again while the consumer still maps its
 * first making. The descriptor names chunk 0, whose incarnation did not
 * move; only the word of chunk 1 tells. Held: the consumer maps chunk 1
 * again (one import) and copies the new bytes; the old descriptor is
 * refused.
 */
static void test_remade_second_chunk_of_a_spanning_buffer(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(16 * MiB, 20, 1);
    vmmt_desc a, b;
    long before;

    if (!on_emu()) skip();
    c.min_resident = CHUNK;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t round = 0; round < 3; round++) {
        a = pub_n(f->pool, f->stream, f->src, 3 * MiB, 30 + round);
        assert_true(info_of(&a).chunk <= 1);
        consume_good(f->consumer, &a, f->dst, f->stream, 30 + round);
        settle(f, NULL);
        assert_true(resident_is(f->pool, CHUNK, 3000));
        refused(f->consumer, &a, f->dst, f->stream, VMMT_ESTATE);
    }
    /* And one more with the previous making still mapped here: */
    before = imports();
    b = pub_n(f->pool, f->stream, f->src, 3 * MiB, 40);
    consume_good(f->consumer, &b, f->dst, f->stream, 40);
    assert_true(imports() - before <= 2);
    settle(f, NULL);
}

/* ------------------------------------------------------------ cancel */

/*
 * Cancel of an elastic descriptor while another consumer's copy of it is
 * queued (a gate holds the stream), for a pool of two ranks. Then the pool
 * is run round so the allocator passes the cancelled slice again, the
 * chunk is given back and made again, and a new buffer lands in it. Held
 * (docs/descriptor.md "Acknowledgement words"): the other rank and other
 * consumers are refused the cancelled descriptor; the slice and its chunk
 * stay while the copy is queued, so the copy reads the cancelled buffer's
 * own bytes and checks OK; afterwards every replay is VMMT_ESTATE and the
 * taker maps the remade chunk for the new buffer.
 */
static void test_cancel_while_copy_queued_then_chunk_remade(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(8 * MiB, 20, 2);
    vmmt_consumer *y = new_consumer();
    CUstream s2 = new_stream();
    vmmt_desc d, e;
    struct gate g;
    uint64_t dchunk;
    uint32_t ei;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    d = pub_n(f->pool, f->stream, f->src, SMALL, 50);
    dchunk = info_of(&d).chunk;
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, 0, 1));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    EXPECT_STATUS(vmmt_consume(y, &d, 0, f->dst + SMALL, SMALL, s2, 1, 1), VMMT_ESTATE);
    EXPECT_STATUS(vmmt_consume(y, &d, 0, f->dst + SMALL, SMALL, s2, 0, 1), VMMT_ESTATE);
    EXPECT_STATUS(vmmt_consume(f->consumer, &d, 0, f->dst + SMALL, SMALL, s2, 1, 1), VMMT_ESTATE);
    /* Round the pool several times with y's buffers (both ranks): a freed slice would be reused. */
    for (uint32_t i = 0; i < 12; i++) {
        e = pub_n(f->pool, s2, f->src, 1 * MiB + 4096, 100 + i);
        consume_good(y, &e, f->dst + 2 * MiB, s2, 100 + i);
    }
    assert_true(stats(f->pool).resident_bytes >= CHUNK); /* d's chunk stays under the copy */
    gate_open_later(&g, 1);
    gate_free(&g);
    EXPECT_BYTES(f->stream, f->dst, SMALL, 50);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    EXPECT_STATUS(vmmt_consumer_check(f->consumer, &d), VMMT_OK);
    settle(f, y);
    assert_true(resident_is(f->pool, 0, 3000));
    /* A new buffer where d was: its chunk made again. */
    for (ei = 200; ei < 208; ei++) {
        e = pub_n(f->pool, s2, f->src, SMALL, ei);
        if (info_of(&e).chunk == dchunk) break;
        consume_good(y, &e, f->dst + 2 * MiB, s2, ei);
        settle(f, y);
    }
    assert_true(ei < 208);
    assert_int_not_equal(info_of(&e).incarnation, info_of(&d).incarnation);
    refused(f->consumer, &d, f->dst, f->stream, VMMT_ESTATE);
    refused(y, &d, f->dst, s2, VMMT_ESTATE);
    consume_good(f->consumer, &e, f->dst, f->stream, ei);
    settle(f, y);
    vmmt_consumer_destroy(y);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(s2), CUDA_SUCCESS);
}

/* ------------------------------------------------------------ queued copies and remade chunks */

/*
 * A live descriptor whose chunk this consumer still maps at an old making,
 * while a copy of another buffer, out of ANOTHER chunk, is queued here. No
 * rank was released. docs/design.md: "A chunk made again whose previous
 * making is still mapped while copies are queued makes the consume fail
 * with VMMT_ESTATE (synchronize, then consume again); that happens only
 * after a rank of this process was released for it." The header: ESTATE is
 * for a descriptor whose slot no longer shows it live.
 *
 * Layout (4 MiB pool, two chunks): p1 = [0, 2 MiB) in chunk 0, p2 = 4 KiB at
 * 2 MiB in chunk 1; consume p1 (chunk 0 mapped here), hold the stream, consume
 * p2 (its copy queued); p1 is acknowledged, so chunk 0 goes back; fill chunk 1
 * to its end (c1) so that the next buffer (c2) wraps to offset 0: chunk 0 made
 * again, live, consumed on another stream.
 *
 * What went wrong (fixed 2026-12-07; the test failed before): c2, live and
 * never consumed, was refused with VMMT_ESTATE
 * ("chunk 0 of the pool was made again while a copy out of its previous
 * making may still be queued in this process (its rank was released on this
 * consumer's behalf?); synchronize the streams that consumed from the pool
 * and consume again"). The queued copy is p2's, out of chunk 1, not out of
 * chunk 0's previous making, and no rank was released: the consumer counted
 * queued copies per import, not per chunk. So an elastic consumer that
 * always has a copy in flight (stream-ordered, never synchronizing between
 * requests) is refused every live buffer that lands in a chunk it mapped
 * before, with the status that means "stale: drop it"; an engine that drops
 * it never acknowledges, and the slice stays in flight. Contradicts the
 * header (ESTATE: the slot no longer shows it live) and docs/design.md
 * ("that happens only after a rank of this process was released for it").
 * Replay: this test; the retry after synchronizing copies right.
 */
static void test_finding_live_descriptor_refused_while_unrelated_copy_queued(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(4 * MiB, 20, 1);
    CUstream s2 = new_stream();
    vmmt_desc p1, p2, c1, c2;
    struct gate g;
    uint64_t end;
    int st, first;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    p1 = pub_n(f->pool, f->stream, f->src, 2 * MiB, 60);
    p2 = pub_n(f->pool, f->stream, f->src, SMALL, 61);
    assert_int_equal(info_of(&p1).chunk, 0);
    assert_int_equal(info_of(&p2).chunk, 1);
    consume_good(f->consumer, &p1, f->dst, f->stream, 60);
    gate_close(&g, f->stream);
    assert_vmmt_ok(cons(f->consumer, &p2, f->dst + 2 * MiB, f->stream)); /* queued */
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_true(resident_is(f->pool, CHUNK, 3000)); /* chunk 0 given back, chunk 1 held by p2 */
    end = (d_off(&p2) + d_nbytes(&p2) + 255) & ~255ull;
    c1 = pub_n(f->pool, s2, f->src, 4 * MiB - end, 62);
    c2 = pub_n(f->pool, s2, f->src + 4 * MiB, SMALL, 63);
    assert_int_equal(info_of(&c1).chunk, 1);
    assert_int_equal(info_of(&c2).chunk, 0);
    assert_int_not_equal(info_of(&c2).incarnation, info_of(&p1).incarnation);
    /* c2 is live: its slot shows it, nobody consumed it. */
    first = st = cons(f->consumer, &c2, f->dst + 4 * MiB, s2);
    if (st != VMMT_OK)
        print_error("FINDING: live c2 (slot %u gen %u) refused with %d (%s) while a copy of p2 "
                    "(chunk 1) is queued; no rank released: %s\n",
                    info_of(&c2).slot, info_of(&c2).generation, st, vmmt_strerror(st),
                    vmmt_last_error());
    gate_open_later(&g, 1);
    gate_free(&g);
    EXPECT_BYTES(f->stream, f->dst + 2 * MiB, SMALL, 61);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    EXPECT_STATUS(vmmt_consumer_check(f->consumer, &p2), VMMT_OK);
    if (st != VMMT_OK) /* the retry the message asks for */
        st = cons(f->consumer, &c2, f->dst + 4 * MiB, s2);
    assert_vmmt_ok(st);
    sync_on(s2);
    EXPECT_BYTES(s2, f->dst + 4 * MiB, SMALL, 63);
    consume_good(f->consumer, &c1, f->dst, s2, 62);
    settle(f, NULL);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(s2), CUDA_SUCCESS);
    /* The contract: a live descriptor is not refused (and the pool held nothing to refuse it). */
    EXPECT_STATUS(first, VMMT_OK);
}

/*
 * vmmt_pool_release_rank while this consumer's copy is queued (a gate), then
 * the slice is recycled, its chunk given back, and the next publish makes
 * the chunk again. Held (docs/design.md "Elastic pools"): the queued copy
 * still reads from the mapping it had (the chunk is not unmapped under it),
 * and its check says EFAILED (the occupant left while it ran) or, if OK,
 * the bytes are the buffer's; the released descriptor is refused; the new
 * buffer is refused only while the copy is queued (VMMT_ESTATE, retry
 * after synchronizing) and then copied right.
 */
static void test_release_rank_under_queued_copy_then_remade(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(8 * MiB, 20, 1);
    CUstream s2 = new_stream();
    vmmt_desc d, e;
    struct gate g;
    int st, ck;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    d = pub_n(f->pool, f->stream, f->src, 3 * MiB, 70); /* chunks 0 and 1 */
    gate_close(&g, f->stream);
    assert_vmmt_ok(cons(f->consumer, &d, f->dst, f->stream));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    assert_true(resident_is(f->pool, 0, 3000));
    e = pub_n(f->pool, s2, f->src, SMALL, 71);
    st = cons(f->consumer, &e, f->dst + 4 * MiB, s2);
    if (st != VMMT_OK) EXPECT_STATUS(st, VMMT_ESTATE);
    EXPECT_STATUS(cons(f->consumer, &d, f->dst + 4 * MiB, s2), VMMT_ESTATE);
    gate_open_later(&g, 1);
    gate_free(&g);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    ck = vmmt_consumer_check(f->consumer, &d);
    if (ck == VMMT_OK)
        EXPECT_BYTES(f->stream, f->dst, 3 * MiB, 70);
    else
        EXPECT_STATUS(ck, VMMT_EFAILED);
    if (st != VMMT_OK) assert_vmmt_ok(cons(f->consumer, &e, f->dst + 4 * MiB, s2));
    sync_on(s2);
    EXPECT_BYTES(s2, f->dst + 4 * MiB, SMALL, 71);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    EXPECT_STATUS(vmmt_consumer_check(f->consumer, &e), VMMT_OK);
    refused(f->consumer, &d, f->dst, s2, VMMT_ESTATE);
    settle(f, NULL);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(s2), CUDA_SUCCESS);
}

/* ------------------------------------------------------------ eviction */

/*
 * vmmt_consumer_evict of an elastic import: refused while a copy is queued,
 * then taken; a replay afterwards imports the table again but no chunk and
 * is VMMT_ESTATE; a live descriptor then maps its chunks afresh. Then a
 * consumer of max_pools = 1 alternating between two elastic pools whose
 * chunks come and go. Held: every OK right, every replay ESTATE, nothing
 * leaked (the fixture counts mappings and reservations at teardown).
 */
static void test_evict_and_alternate_pools(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(8 * MiB, 5, 1);
    vmmt_consumer_config cc;
    vmmt_consumer *one;
    vmmt_pool *p2;
    vmmt_desc d, e, old[2];
    vmmt_desc_info in;
    struct gate g;
    long before;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    d = pub_n(f->pool, f->stream, f->src, 3 * MiB, 80);
    in = info_of(&d);
    gate_close(&g, f->stream);
    assert_vmmt_ok(cons(f->consumer, &d, f->dst, f->stream));
    EXPECT_STATUS(vmmt_consumer_evict(f->consumer, in.pool_id, 0), VMMT_ESTATE);
    gate_open_later(&g, 1);
    gate_free(&g);
    EXPECT_BYTES(f->stream, f->dst, 3 * MiB, 80);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_vmmt_ok(vmmt_consumer_evict(f->consumer, in.pool_id, 0));
    assert_int_equal(vmmt_consumer_pool_count(f->consumer), 0);
    before = imports();
    refused(f->consumer, &d, f->dst, f->stream, VMMT_ESTATE);
    assert_int_equal(imports(), before);
    e = pub_n(f->pool, f->stream, f->src, 3 * MiB, 81);
    consume_good(f->consumer, &e, f->dst, f->stream, 81);
    settle(f, NULL);

    c.idle_release_ms = 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &p2));
    vmmt_consumer_config_init(&cc);
    cc.max_pools = 1;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &one));
    for (uint32_t i = 0; i < 16; i++) {
        vmmt_pool *p = (i & 1) ? p2 : f->pool;
        size_t n = (i % 3 == 0) ? 3 * MiB : (i % 3 == 1 ? 2 * MiB - 256 : 100);
        e = pub_n(p, f->stream, f->src, n, 300 + i);
        consume_good(one, &e, f->dst, f->stream, 300 + i);
        refused(one, &e, f->dst, f->stream, VMMT_ESTATE);
        if (i >= 2) refused(one, &old[i & 1], f->dst, f->stream, VMMT_ESTATE);
        old[i & 1] = e;
        assert_true(vmmt_consumer_pool_count(one) <= 2);
        if (i % 4 == 3) sleep_ms(10); /* let chunks go back now and then */
    }
    assert_vmmt_ok(vmmt_consumer_flush(one));
    assert_vmmt_ok(vmmt_pool_drain(p2, 5000));
    settle(f, NULL);
    vmmt_consumer_destroy(one);
    vmmt_pool_destroy(p2);
}

/* ------------------------------------------------------------ failures while mapping */

/*
 * The consumer's import of a chunk fails (cuMemImportFromShareableHandle,
 * cuMemMap of the second chunk of a spanning buffer, cuMemSetAccess): the
 * consume fails with a driver status before anything is taken, and a retry
 * of the same live descriptor copies it right; a failure never leaves a
 * half mapping that a later copy reads from. The producer's publish is
 * done before the failure is armed, and its chunks stay (a minute's idle).
 */
static void test_chunk_import_failures_then_retry(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(16 * MiB, 60000, 1);
    const char *specs[] = {
        "cuMemImportFromShareableHandle:1:CUDA_ERROR_OUT_OF_MEMORY",
        "cuMemImportFromShareableHandle:2:CUDA_ERROR_INVALID_VALUE",
        "cuMemMap:2:CUDA_ERROR_OUT_OF_MEMORY",
        "cuMemSetAccess:2:CUDA_ERROR_UNKNOWN",
        "cuMemAddressReserve:1:CUDA_ERROR_OUT_OF_MEMORY",
    };
    vmmt_desc d;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t k = 0; k < sizeof specs / sizeof specs[0]; k++) {
        vmmt_consumer *x = new_consumer();
        int st;

        d = pub_n(f->pool, f->stream, f->src, 3 * MiB, 90 + k);
        emu_fail(specs[k]);
        fill_dev(f->stream, f->dst, 3 * MiB, SENT);
        st = cons(x, &d, f->dst, f->stream);
        print_message("%s: %d: %s\n", specs[k], st, vmmt_last_error());
        emu_reset();
        if (st == VMMT_OK)
            print_error("note: %s did not fail the consume\n", specs[k]);
        else if (st == VMMT_ESTATE || st == VMMT_EINVAL || st == VMMT_EPROTO)
            fail_msg("%s: a live descriptor's failed import answered %d (%s): %s", specs[k], st,
                     vmmt_strerror(st), vmmt_last_error());
        else {
            sync_on(f->stream);
            EXPECT_BYTES(f->stream, f->dst, 3 * MiB, SENT);
            consume_good(x, &d, f->dst, f->stream, 90 + k);
        }
        sync_on(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(x));
        refused(x, &d, f->dst, f->stream, VMMT_ESTATE);
        vmmt_consumer_destroy(x);
        settle(f, NULL);
    }
}

/* ------------------------------------------------------------ shutdown */

/*
 * The producer shuts the pool down (every chunk given back) with a buffer
 * consumed, one live and never consumed whose second chunk this consumer
 * never mapped, and a copy queued. Held: the queued copy reads its bytes;
 * the live one is refused with VMMT_ESTATE or VMMT_ECLOSED (its chunks are
 * gone), never OK with other bytes nor EINVAL; replays likewise; a fresh
 * consumer gets VMMT_ECLOSED (no broker listens); nothing hangs.
 */
static void test_shutdown_mid_stream(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(16 * MiB, 60000, 1);
    CUstream s2 = new_stream();
    vmmt_consumer *fresh;
    vmmt_desc done, live, queued;
    struct gate g;
    int st;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    done = pub_n(f->pool, f->stream, f->src, SMALL, 110);
    queued = pub_n(f->pool, f->stream, f->src, SMALL, 111);
    live = pub_n(f->pool, f->stream, f->src, 5 * MiB, 112); /* into chunks 0..2 */
    consume_good(f->consumer, &done, f->dst, f->stream, 110);
    gate_close(&g, f->stream);
    assert_vmmt_ok(cons(f->consumer, &queued, f->dst + SMALL, f->stream));
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    st = cons(f->consumer, &live, f->dst + 2 * MiB, s2);
    print_message("shut pool, live descriptor: %d: %s\n", st, vmmt_last_error());
    if (st != VMMT_ESTATE && st != VMMT_ECLOSED)
        fail_msg("live descriptor of a shut pool: %d (%s): %s", st, vmmt_strerror(st),
                 vmmt_last_error());
    st = cons(f->consumer, &done, f->dst + 2 * MiB, s2);
    if (st != VMMT_ESTATE && st != VMMT_ECLOSED)
        fail_msg("replay on a shut pool: %d (%s): %s", st, vmmt_strerror(st), vmmt_last_error());
    gate_open_later(&g, 1);
    gate_free(&g);
    EXPECT_BYTES(f->stream, f->dst + SMALL, SMALL, 111);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    st = vmmt_consumer_check(f->consumer, &queued);
    if (st != VMMT_OK) EXPECT_STATUS(st, VMMT_EFAILED);
    fresh = new_consumer();
    EXPECT_STATUS(cons(fresh, &live, f->dst, s2), VMMT_ECLOSED);
    EXPECT_STATUS(cons(fresh, &done, f->dst, s2), VMMT_ECLOSED);
    vmmt_consumer_destroy(fresh);
    sync_on(s2);
    assert_int_equal(vmmt__drv()->cuStreamDestroy(s2), CUDA_SUCCESS);
}

/* ------------------------------------------------------------ producer death */

/* This program as an elastic producer (main's "elastic-producer" mode), on fd 3. */
/*
 * Publishes into an elastic pool of one rank (16 MiB of 2 MiB chunks, kept a
 * minute): 1, 4 KiB in chunk 0, landed; 3, 4 KiB in chunk 0 whose copy and
 * ready flag wait behind a gate that never opens; 2, 3 MiB over chunks 0
 * and 1, landed (on another stream). Sends them as 1, 2, 3 and waits to be
 * killed (at most 60 s).
 */
static int producer_main(void)
{
    const struct vmmt_drv *d;
    vmmt_pool_config c;
    vmmt_pool *pool;
    CUstream s, held;
    CUdeviceptr src, gate;
    vmmt_buffer b;
    vmmt_desc d1, d2, d3;
    uint8_t *h = malloc(3 * MiB);

    tu_use_test_driver();
    d = vmmt__drv();
    vmmt_pool_config_init(&c);
    c.memory_size = 16 * MiB;
    c.consumer_count = 1;
    c.max_slices = 16;
    c.elastic = 1;
    c.chunk_size = CHUNK;
    c.idle_release_ms = 60000;
    if (h == NULL || vmmt_pool_create(&c, &pool) != VMMT_OK || vmmt__ctx_enter(0) != VMMT_OK ||
        d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuStreamCreate(&held, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuMemAlloc(&src, 4 * MiB) != CUDA_SUCCESS || d->cuMemAlloc(&gate, 4096) != CUDA_SUCCESS)
        return 3;
    b = bytes(src, SMALL);
    if (raw_fill(s, src, SMALL, 1, h) != 0 || vmmt_publish(pool, &b, s, &d1) != VMMT_OK ||
        d->cuStreamSynchronize(s) != CUDA_SUCCESS)
        return 4;
    if (d->cuMemsetD8Async(gate, 0, 4, held) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(held) != CUDA_SUCCESS ||
        d->cuStreamWaitValue32(held, gate, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
        return 5;
    if (raw_fill(s, src + SMALL, SMALL, 3, h) != 0) return 6;
    b = bytes(src + SMALL, SMALL);
    if (vmmt_publish(pool, &b, held, &d3) != VMMT_OK) return 7;
    b = bytes(src + 2 * SMALL, 3 * MiB);
    if (raw_fill(s, src + 2 * SMALL, 3 * MiB, 2, h) != 0 ||
        vmmt_publish(pool, &b, s, &d2) != VMMT_OK || d->cuStreamSynchronize(s) != CUDA_SUCCESS)
        return 8;
    if (tu_send_msg(3, 1, 0, d1.bytes) != 0 || tu_send_msg(3, 2, 0, d2.bytes) != 0 ||
        tu_send_msg(3, 3, 0, d3.bytes) != 0)
        return 9;
    sleep(60);
    return 10;
}

static double now_s(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/*
 * The producer (another process) dies: with a consume of a buffer whose
 * bytes never landed queued on a stream of ours, a landed buffer over a
 * chunk this process never mapped, and a consumed one. Held to: the queued
 * wait ends soon after the death (the consumer writes ABANDONED; the
 * emulator's own wait timeout is lowered to 4 s so that a hang shows as
 * CUDA_ERROR_TIMEOUT), its check is VMMT_EFAILED; the unmapped buffer is
 * VMMT_ECLOSED (or OK with its bytes), never EINVAL; replays are ESTATE or
 * ECLOSED; a fresh consumer gets ECLOSED.
 */
static void test_producer_death_with_elastic_chunks(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    CUstream s2 = new_stream();
    vmmt_consumer *fresh;
    vmmt_desc desc[4];
    struct timeval tv = {20, 0};
    int sv[2], st, status;
    CUresult r;
    double t0, waited;
    pid_t pid;

    if (!on_emu()) skip();
    setenv("VMMT_EMU_WAIT_TIMEOUT_MS", "4000", 1);
    vmmt__emu_configure();
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid = fork();
    if (pid == 0) {
        char *argv[] = {"test_attack_elastic", "elastic-producer", NULL};
        if (dup2(sv[1], 3) < 0) _exit(126);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    assert_true(pid > 0);
    close(sv[1]);
    assert_int_equal(setsockopt(sv[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    for (uint32_t i = 1; i <= 3; i++) {
        struct tu_msg m;
        assert_int_equal(read(sv[0], &m, sizeof m), sizeof m);
        assert_int_equal(m.index, i);
        memcpy(desc[i].bytes, m.desc, sizeof m.desc);
    }
    consume_good(f->consumer, &desc[1], f->dst, f->stream, 1);
    /* Queued: the stream waits for 3's ready flag, which the producer never sets. */
    EXPECT_STATUS(cons(f->consumer, &desc[3], f->dst + SMALL, s2), VMMT_OK);
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    close(sv[0]);
    t0 = now_s();
    r = d->cuStreamSynchronize(s2);
    waited = now_s() - t0;
    if (r != CUDA_SUCCESS || waited > 3.0)
        fail_msg("the queued wait on a dead producer's ready flag ended after %.1f s with "
                 "CUresult %d",
                 waited, (int)r);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    EXPECT_STATUS(vmmt_consumer_check(f->consumer, &desc[3]), VMMT_EFAILED);
    EXPECT_STATUS(vmmt_consumer_check(f->consumer, &desc[1]), VMMT_OK);
    fill_dev(f->stream, f->dst, 3 * MiB, SENT);
    st = cons(f->consumer, &desc[2], f->dst, f->stream);
    print_message("dead producer, landed buffer over an unmapped chunk: %d: %s\n", st,
                  vmmt_last_error());
    if (st == VMMT_OK) {
        sync_on(f->stream);
        EXPECT_BYTES(f->stream, f->dst, 3 * MiB, 2);
    } else {
        EXPECT_STATUS(st, VMMT_ECLOSED);
        EXPECT_BYTES(f->stream, f->dst, 3 * MiB, SENT);
    }
    st = cons(f->consumer, &desc[1], f->dst, f->stream);
    if (st != VMMT_ESTATE) EXPECT_STATUS(st, VMMT_ECLOSED);
    st = cons(f->consumer, &desc[3], f->dst, f->stream);
    if (st != VMMT_ESTATE) EXPECT_STATUS(st, VMMT_ECLOSED);
    fresh = new_consumer();
    EXPECT_STATUS(cons(fresh, &desc[2], f->dst, f->stream), VMMT_ECLOSED);
    EXPECT_STATUS(cons(fresh, &desc[1], f->dst, f->stream), VMMT_ECLOSED);
    vmmt_consumer_destroy(fresh);
    sync_on(f->stream);
    assert_int_equal(d->cuStreamDestroy(s2), CUDA_SUCCESS);
    unsetenv("VMMT_EMU_WAIT_TIMEOUT_MS");
    vmmt__emu_configure();
}

/* ------------------------------------------------------------ races */

#define RACE_N 200

static const size_t race_sizes[5] = {4096, 2 * MiB - 256, 3 * MiB, 100, 1 * MiB + 17};

struct race {
    vmmt_desc descs[RACE_N];
    int published; /* descriptors in descs (release/acquire) */
    int stop;
    int winner[RACE_N]; /* 0 nobody yet, 1 the in-order consumer, 2 the racer */
    int bad;
    char msg[768];
    vmmt_consumer *in_order;
    unsigned long replays, refusals;
};

static void race_fail(struct race *r, const char *fmt, int i, int st)
{
    if (__atomic_exchange_n(&r->bad, 1, __ATOMIC_ACQ_REL) == 0)
        snprintf(r->msg, sizeof r->msg, fmt, i, st, vmmt_strerror(st), vmmt_last_error());
}

/* An OK: bytes, check, and the one winner of descriptor i. */
static void race_ok(struct race *r, vmmt_consumer *c, CUstream s, CUdeviceptr dst, uint8_t *h,
                    int i, int who)
{
    int zero = 0;
    size_t n = race_sizes[i % 5];
    int st;

    if (vmmt__drv()->cuStreamSynchronize(s) != CUDA_SUCCESS)
        race_fail(r, "descriptor %d: stream failed after OK %d (%s) %s", i, 0);
    if (raw_first_bad(s, dst, n, (uint32_t)i, h) != n)
        race_fail(r, "descriptor %d: OK (%d %s) but the bytes are another buffer's: %s", i, 0);
    (void)vmmt_consumer_flush(c);
    st = vmmt_consumer_check(c, &r->descs[i]);
    if (st != VMMT_OK) race_fail(r, "descriptor %d: check after a good copy %d (%s): %s", i, st);
    if (!__atomic_compare_exchange_n(&r->winner[i], &zero, who, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        race_fail(r, "descriptor %d: consumed twice for one rank (second OK %d %s): %s", i, 0);
}

static void *in_order_thread(void *p)
{
    struct race *r = p;
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t *h = malloc(8 * MiB);
    CUstream s;
    CUdeviceptr dst;

    vmmt__ctx_enter(0);
    if (h == NULL || d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuMemAlloc(&dst, 8 * MiB) != CUDA_SUCCESS) {
        race_fail(r, "in-order thread setup %d %d %s %s", 0, 0);
        return NULL;
    }
    for (int i = 0; i < RACE_N && !__atomic_load_n(&r->bad, __ATOMIC_ACQUIRE); i++) {
        int st;
        for (int t = 0; __atomic_load_n(&r->published, __ATOMIC_ACQUIRE) <= i; t++) {
            if (t > 20000 || __atomic_load_n(&r->stop, __ATOMIC_ACQUIRE)) goto out;
            usleep(500);
        }
        st = vmmt_consume(r->in_order, &r->descs[i], 0, dst, 8 * MiB, s, VMMT_ALL_RANKS, 0);
        if (st == VMMT_OK)
            race_ok(r, r->in_order, s, dst, h, i, 1);
        else if (st != VMMT_ESTATE)
            race_fail(r, "in-order consume of %d: %d (%s): %s", i, st);
    }
out:
    d->cuStreamSynchronize(s);
    d->cuMemFree(dst);
    d->cuStreamDestroy(s);
    vmmt__ctx_leave();
    free(h);
    return NULL;
}

/* Consumes the newest descriptor (racing the in-order thread) and replays old ones. */
static void *racer_thread(void *p)
{
    struct race *r = p;
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t *h = malloc(8 * MiB);
    vmmt_consumer *c = NULL;
    CUstream s;
    CUdeviceptr dst;
    uint64_t seed = 0x2545F4914F6CDD1Dull;

    vmmt__ctx_enter(0);
    if (h == NULL || d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuMemAlloc(&dst, 8 * MiB) != CUDA_SUCCESS || vmmt_consumer_create(NULL, &c) != VMMT_OK) {
        race_fail(r, "racer setup %d %d %s %s", 0, 0);
        return NULL;
    }
    for (unsigned long k = 0; !__atomic_load_n(&r->stop, __ATOMIC_ACQUIRE) &&
                              !__atomic_load_n(&r->bad, __ATOMIC_ACQUIRE);
         k++) {
        int n = __atomic_load_n(&r->published, __ATOMIC_ACQUIRE), i, st, sentinel;
        if (n == 0) {
            usleep(200);
            continue;
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        i = (k % 3 == 0) ? n - 1 : (int)(seed % (uint64_t)n);
        sentinel = (k % 4 == 0);
        if (sentinel && raw_fill(s, dst, race_sizes[i % 5], SENT, h) != 0)
            race_fail(r, "racer sentinel %d %d %s %s", i, 0);
        st = vmmt_consume(c, &r->descs[i], 0, dst, 8 * MiB, s, VMMT_ALL_RANKS, 0);
        r->replays++;
        if (st == VMMT_OK) {
            race_ok(r, c, s, dst, h, i, 2);
        } else if (st != VMMT_ESTATE) {
            race_fail(r, "racer consume of %d: %d (%s) for a stale or raced descriptor: %s", i, st);
        } else {
            r->refusals++;
            if (sentinel && raw_first_bad(s, dst, race_sizes[i % 5], SENT, h) != race_sizes[i % 5])
                race_fail(r, "racer: refused %d (%d %s) but bytes were written: %s", i, st);
        }
        if (k % 60 == 59) { /* a fresh consumer: imports the pool again, no chunk mapped */
            d->cuStreamSynchronize(s);
            vmmt_consumer_destroy(c);
            c = NULL;
            if (vmmt_consumer_create(NULL, &c) != VMMT_OK) {
                race_fail(r, "racer: consumer_create %d %d %s %s", 0, 0);
                break;
            }
        }
    }
    d->cuStreamSynchronize(s);
    vmmt_consumer_destroy(c);
    d->cuMemFree(dst);
    d->cuStreamDestroy(s);
    vmmt__ctx_leave();
    free(h);
    return NULL;
}

/*
 * Threads: one consumer takes every descriptor in order, another races it
 * for the newest and replays old ones (a fresh consumer every 60 tries),
 * while the producer publishes buffers of 100 B to 3 MiB (spanning chunks,
 * ending at a chunk boundary) into a 16 MiB pool whose chunks go back after
 * 1 ms idle, pausing now and then so they do. Held: every OK's bytes are
 * its buffer's and check OK; exactly one OK per descriptor; every other
 * answer VMMT_ESTATE with nothing written; nothing left in flight.
 */
static void test_race_replays_against_give_back(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = econf(16 * MiB, 1, 1);
    struct race *r = calloc(1, sizeof *r);
    pthread_t a, b;
    vmmt_pool_stats st;

    if (!on_emu()) skip();
    assert_non_null(r);
    c.recycle_interval_us = 100;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    r->in_order = f->consumer;
    pthread_create(&a, NULL, in_order_thread, r);
    pthread_create(&b, NULL, racer_thread, r);
    for (int i = 0; i < RACE_N && !__atomic_load_n(&r->bad, __ATOMIC_ACQUIRE); i++) {
        size_t n = race_sizes[i % 5];
        vmmt_buffer buf = bytes(f->src, n);
        int s = VMMT_EFULL;
        fill_dev(f->stream, f->src, n, (uint32_t)i);
        for (int k = 0;
             k < 5000 && (s = vmmt_publish(f->pool, &buf, f->stream, &r->descs[i])) == VMMT_EFULL;
             k++)
            sleep_ms(1);
        assert_vmmt_ok(s);
        sync_on(f->stream);
        __atomic_store_n(&r->published, i + 1, __ATOMIC_RELEASE);
        if (i % 9 == 8) sleep_ms(4); /* let the recycler give idle chunks back */
    }
    pthread_join(a, NULL);
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
    pthread_join(b, NULL);
    if (r->bad) fail_msg("FINDING: %s", r->msg);
    for (int i = 0; i < RACE_N; i++)
        if (r->winner[i] == 0) fail_msg("descriptor %d (live) was refused by both consumers", i);
    settle(f, NULL);
    st = stats(f->pool);
    print_message("race: %lu racer consumes, %lu refused; chunks made %llu, released %llu\n",
                  r->replays, r->refusals, (unsigned long long)st.chunks_made,
                  (unsigned long long)st.chunks_released);
    assert_true(st.chunks_made > 3);
    free(r);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        T(test_replays_across_chunk_lives),
        T(test_remade_second_chunk_of_a_spanning_buffer),
        T(test_cancel_while_copy_queued_then_chunk_remade),
        T(test_finding_live_descriptor_refused_while_unrelated_copy_queued),
        T(test_release_rank_under_queued_copy_then_remade),
        T(test_evict_and_alternate_pools),
        T(test_chunk_import_failures_then_retry),
        T(test_shutdown_mid_stream),
        T(test_producer_death_with_elastic_chunks),
        T(test_race_replays_against_give_back),
    };
    if (argc > 1 && strcmp(argv[1], "elastic-producer") == 0) return producer_main();
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
