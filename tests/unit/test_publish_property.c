/*
 * Property test of publishing: over thousands of random publishes (random
 * DLPack dtypes, sub-byte and vector types included, shapes of 0 to 8
 * dimensions, sizes from 0 bytes up, single and packed groups of 2 to 6),
 * every publish that succeeds yields descriptors that
 *   - decode, through vmmt_desc_inspect and the internal decoder, and say
 *     what was published (bytes, dtype, shape, pack index and count);
 *   - lie inside the pool: the slice within the allocation's data region,
 *     the buffer within its slice, aligned to its element size;
 *   - do not overlap any other slice in flight, nor (packed) each other;
 *   - carry the bytes: every one is consumed or dropped, the consumed ones
 *     checked byte for byte;
 * and every publish that fails says why. The seed is printed, and
 * VMMT_PROPERTY_SEED replays a run.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "desc.h"
#include "pattern.h"
#include "rng.h"
#include "poolfix.h"

#define ROUNDS       5000
#define MAX_PACK     6
#define MAX_OUT      64
#define MEMBER_SPACE (64 * 1024)

static uint64_t rng;
static uint64_t rnd(void)
{
    return tu_rng_next(&rng);
}

struct out {
    vmmt_desc desc;
    struct vmmt__desc d;
    uint32_t pattern;
    uint64_t nbytes;
};

static struct out outs[MAX_OUT];
static int nout;

/* A random tensor of at most MEMBER_SPACE bytes; untyped bytes a quarter of the time. */
static vmmt_buffer random_buffer(void)
{
    static const uint8_t bits[] = {1, 4, 8, 16, 32, 64};
    static const uint8_t codes[] = {0, 1, 2, 4, 5, 6};
    static const uint16_t lanes[] = {1, 1, 1, 2, 4};
    vmmt_buffer b;

    memset(&b, 0, sizeof b);
    if (rnd() % 4 == 0) {
        b.nbytes = rnd() % 3 == 0 ? rnd() % 16 : 1 + rnd() % (MEMBER_SPACE - 1);
        return b;
    }
    for (;;) {
        uint64_t elems = 1, total_bits;
        b.dtype.code = codes[rnd() % sizeof codes];
        b.dtype.bits = bits[rnd() % sizeof bits];
        b.dtype.lanes = lanes[rnd() % (sizeof lanes / sizeof lanes[0])];
        b.ndim = (int)(rnd() % (VMMT_MAX_DIMS + 1));
        for (int i = 0; i < b.ndim; i++) {
            /* Now and then an empty dimension: publish refuses 0 bytes, and must say so. */
            b.shape[i] = rnd() % 40 == 0 ? 0 : 1 + (int64_t)(rnd() % 8);
            if (rnd() % 3 == 0) b.shape[i] = 1 + (int64_t)(rnd() % 64);
            elems *= (uint64_t)b.shape[i];
        }
        total_bits = elems * b.dtype.bits * b.dtype.lanes;
        /* Sub-byte tensors round the last byte up; try the rounded-down size too. */
        b.nbytes = (total_bits + 7) / 8;
        if (total_bits % 8 != 0 && rnd() % 2 == 0) b.nbytes = total_bits / 8;
        if (b.nbytes <= MEMBER_SPACE && elems < (1u << 20)) return b;
    }
}

static uint64_t elem_align(const vmmt_buffer *b)
{
    uint64_t bytes = ((uint64_t)b->dtype.bits * b->dtype.lanes + 7) / 8, a = 1;
    while (a < bytes && a < 256)
        a *= 2;
    return a;
}

static void check_member(struct fixture *f, const vmmt_pool_stats *ps, const vmmt_buffer *b,
                         const vmmt_desc *desc, struct vmmt__desc *d, size_t index, size_t count)
{
    vmmt_desc_info info;

    (void)f;
    assert_vmmt_ok(vmmt_desc_inspect(desc, &info));
    assert_vmmt_ok(vmmt__desc_decode(desc->bytes, d));
    assert_int_equal(info.nbytes, b->nbytes);
    assert_int_equal(info.dtype.code, b->dtype.code);
    assert_int_equal(info.dtype.bits, b->dtype.bits);
    assert_int_equal(info.dtype.lanes, b->dtype.bits ? b->dtype.lanes : 0);
    assert_int_equal(info.ndim, b->dtype.bits ? b->ndim : info.ndim);
    if (b->dtype.bits)
        for (int i = 0; i < b->ndim; i++)
            assert_int_equal(info.shape[i], b->shape[i]);
    assert_int_equal(info.pack_index, (int)index);
    assert_int_equal(info.pack_count, (int)count);
    /* Inside the pool: the allocation the producer exported, past the control table. */
    assert_int_equal(d->alloc_size, ps->allocation_size);
    assert_true(d->slice_offset >= d->data_offset);
    assert_true(d->slice_offset <= d->alloc_size);
    assert_true(d->slice_bytes <= d->alloc_size - d->slice_offset);
    assert_true(d->offset >= d->slice_offset);
    assert_true(d->offset - d->slice_offset + d->nbytes <= d->slice_bytes);
    if (b->dtype.bits) assert_int_equal(d->offset % elem_align(b), 0);
}

/* 17 one-bit booleans (3 bytes by the decoder's rule) in src, claimed to be nbytes. */
static vmmt_buffer bools17(struct fixture *f, uint64_t nbytes)
{
    vmmt_buffer b;

    memset(&b, 0, sizeof b);
    b.ptr = f->src;
    b.dtype = (vmmt_dtype){.code = 6, .bits = 1, .lanes = 1};
    b.ndim = 1;
    b.shape[0] = 17;
    b.nbytes = nbytes;
    return b;
}

static int overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn)
{
    return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

/* Consume or drop everything in flight; the consumed ones are checked byte for byte. */
static void settle(struct fixture *f)
{
    for (int i = 0; i < nout; i++) {
        if (rnd() % 4 == 0) {
            assert_vmmt_ok(
                vmmt_consumer_ack(f->consumer, &outs[i].desc, 0, f->stream, VMMT_ALL_RANKS, 0));
            continue;
        }
        assert_vmmt_ok(vmmt_consume(f->consumer, &outs[i].desc, 0, f->dst, f->cap, f->stream,
                                    VMMT_ALL_RANKS, 0));
        if (outs[i].nbytes > 0) expect(f, f->dst, outs[i].nbytes, outs[i].pattern);
    }
    nout = 0;
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_every_publish_decodes_inside_the_pool(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    const char *seed_env = getenv("VMMT_PROPERTY_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 0) : (uint64_t)time(NULL);
    uint32_t pattern = 1;
    int ok = 0, refused = 0, full = 0;

    rng = seed ? seed : 1;
    print_message("publish property: seed %" PRIu64 " (VMMT_PROPERTY_SEED replays it)\n", seed);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    vmmt_pool_stats ps = stats(f->pool);

    for (int round = 0; round < ROUNDS; round++) {
        size_t count = rnd() % 3 == 0 ? 2 + rnd() % (MAX_PACK - 1) : 1;
        vmmt_buffer bufs[MAX_PACK];
        vmmt_desc descs[MAX_PACK];
        struct vmmt__desc d[MAX_PACK];
        int st;

        if (nout + (int)count > MAX_OUT) settle(f);
        for (size_t m = 0; m < count; m++) {
            bufs[m] = random_buffer();
            bufs[m].ptr = f->src + m * MEMBER_SPACE;
            if (bufs[m].nbytes > 0) put(f, bufs[m].ptr, bufs[m].nbytes, pattern + (uint32_t)m);
        }
        st = count == 1 ? vmmt_publish(f->pool, bufs, f->stream, descs)
                        : vmmt_publish_packed(f->pool, bufs, count, f->stream, descs);
        if (st == VMMT_EFULL) {
            full++;
            settle(f);
            continue;
        }
        if (st != VMMT_OK) {
            /* A refusal is allowed (an unusual dtype, say) but must say why. */
            assert_true(vmmt_last_error()[0] != '\0');
            refused++;
            if (getenv("VMMT_PROPERTY_VERBOSE")) print_message("refused: %s\n", vmmt_last_error());
            continue;
        }
        ok++;
        for (size_t m = 0; m < count; m++) {
            check_member(f, &ps, &bufs[m], &descs[m], &d[m], count == 1 ? 0 : m, count);
            /* Members of one group share a slice and never overlap each other. */
            for (size_t o = 0; o < m; o++) {
                assert_int_equal(d[o].slice_offset, d[m].slice_offset);
                assert_false(overlaps(d[o].offset, d[o].nbytes, d[m].offset, d[m].nbytes));
            }
        }
        /* Slices in flight never overlap. */
        for (int i = 0; i < nout; i++)
            if (outs[i].d.slot != d[0].slot || outs[i].d.generation != d[0].generation)
                assert_false(overlaps(outs[i].d.slice_offset, outs[i].d.slice_bytes,
                                      d[0].slice_offset, d[0].slice_bytes));
        for (size_t m = 0; m < count; m++) {
            outs[nout].desc = descs[m];
            outs[nout].d = d[m];
            outs[nout].pattern = pattern + (uint32_t)m;
            outs[nout].nbytes = bufs[m].nbytes;
            nout++;
        }
        pattern += (uint32_t)count;
    }
    settle(f);
    print_message("publish property: %d publishes accepted and checked, %d refused with a reason, "
                  "%d full\n",
                  ok, refused, full);
    /* The property means little if most publishes were refused. */
    assert_true(ok > ROUNDS / 2);
}

/*
 * Sub-byte sizes: 17 one-bit booleans are 3 bytes (the decoder's rule,
 * docs/descriptor.md). Publishing 3 bytes must work and decode; 2 bytes must
 * be refused, or else decode and cancel. (Caught a defect since fixed on
 * main: publish took 2 bytes and refused 3, and the 2-byte descriptor neither
 * decoded nor cancelled, its slice stuck until shutdown.)
 */
static void test_subbyte_sizes_agree(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(8 * MiB, 1);
    vmmt_buffer b;
    vmmt_desc desc;
    vmmt_desc_info info;
    int st_up, st_down, decodes_down = 0;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    b = bools17(f, 3);
    st_up = vmmt_publish(f->pool, &b, f->stream, &desc);
    if (st_up == VMMT_OK) {
        assert_vmmt_ok(vmmt_desc_inspect(&desc, &info));
        assert_vmmt_ok(vmmt_cancel(f->pool, &desc));
    }
    b.nbytes = 2;
    st_down = vmmt_publish(f->pool, &b, f->stream, &desc);
    if (st_down == VMMT_OK) {
        decodes_down = vmmt_desc_inspect(&desc, &info) == VMMT_OK;
        /* An undecodable descriptor cannot be cancelled either: its slice stays until teardown. */
        if (decodes_down) assert_vmmt_ok(vmmt_cancel(f->pool, &desc));
    }
    assert_vmmt_ok(st_up);
    assert_true(st_down != VMMT_OK || decodes_down);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_every_publish_decodes_inside_the_pool),
        T(test_subbyte_sizes_agree),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
