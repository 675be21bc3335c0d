#include <stdlib.h>
#include <string.h>

#include "slab.h"
#include "status.h"
#include "testutil.h"

static struct vmmt__slab *make(uint64_t size, uint32_t max_live)
{
    struct vmmt__slab *s = NULL;
    assert_vmmt_ok(vmmt__slab_create(size, max_live, &s));
    assert_non_null(s);
    return s;
}

static uint64_t take(struct vmmt__slab *s, uint64_t size, uint64_t align)
{
    uint64_t off = UINT64_MAX;
    assert_vmmt_ok(vmmt__slab_alloc(s, size, align, &off));
    assert_vmmt_ok(vmmt__slab_check(s));
    return off;
}

static void give(struct vmmt__slab *s, uint64_t off)
{
    assert_vmmt_ok(vmmt__slab_free(s, off));
    assert_vmmt_ok(vmmt__slab_check(s));
}

static struct vmmt__slab_stats stats_of(const struct vmmt__slab *s)
{
    struct vmmt__slab_stats t;
    vmmt__slab_stats(s, &t);
    return t;
}

static void expect_one_free_block(const struct vmmt__slab *s)
{
    struct vmmt__slab_stats t = stats_of(s);
    assert_int_equal(t.live, 0);
    assert_int_equal(t.free_blocks, 1);
    assert_int_equal(t.free_bytes, t.capacity);
    assert_int_equal(t.largest_free, t.capacity);
}

static void test_create_args(void **state)
{
    struct vmmt__slab *s = (void *)1;
    (void)state;
    assert_int_equal(vmmt__slab_create(0, 4, &s), VMMT_EINVAL);
    assert_null(s);
    assert_error_contains("size=0");
    assert_int_equal(vmmt__slab_create(4096, 0, &s), VMMT_EINVAL);
    assert_error_contains("max_live=0");
    assert_int_equal(vmmt__slab_create(4096, UINT32_MAX, &s), VMMT_EINVAL);
    assert_int_equal(vmmt__slab_create(4096, 4, NULL), VMMT_EINVAL);
    vmmt__slab_destroy(NULL);
}

static void test_alloc_free_sequence(void **state)
{
    struct vmmt__slab *s = make(1024, 8);
    (void)state;

    expect_one_free_block(s);
    assert_int_equal(take(s, 100, 1), 0);
    assert_int_equal(take(s, 200, 1), 100);
    assert_int_equal(take(s, 24, 1), 300);
    struct vmmt__slab_stats t = stats_of(s);
    assert_int_equal(t.live, 3);
    assert_int_equal(t.free_bytes, 1024 - 324);
    assert_int_equal(t.free_blocks, 1);
    assert_int_equal(t.largest_free, 1024 - 324);

    give(s, 100);
    t = stats_of(s);
    assert_int_equal(t.free_blocks, 2);
    assert_int_equal(t.largest_free, 700);
    /* The 200-byte hole is the best fit for 150 bytes, not the 700-byte tail. */
    assert_int_equal(take(s, 150, 1), 100);
    give(s, 0);
    give(s, 100);
    give(s, 300);
    expect_one_free_block(s);
    /* The whole region again, in one slice. */
    assert_int_equal(take(s, 1024, 1), 0);
    give(s, 0);
    vmmt__slab_destroy(s);
}

/* Holes of 300, 100, 200 and 100 bytes, each fenced by live slices. */
static struct vmmt__slab *holes(void)
{
    static const uint64_t sizes[] = {300, 8, 100, 8, 200, 8, 100, 8};
    struct vmmt__slab *s = make(732, 16);
    uint64_t off = 0;

    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        assert_int_equal(take(s, sizes[i], 1), off);
        off += sizes[i];
    }
    assert_int_equal(stats_of(s).free_bytes, 0);
    give(s, 0);   /* 300 */
    give(s, 308); /* 100 */
    give(s, 416); /* 200 */
    give(s, 624); /* 100 */
    return s;
}

static void test_best_fit_prefers_smallest(void **state)
{
    struct vmmt__slab *s = holes();
    (void)state;

    assert_int_equal(stats_of(s).free_blocks, 4);
    assert_int_equal(take(s, 150, 1), 416); /* the 200 hole, not the 300 */
    assert_int_equal(take(s, 100, 1), 308); /* exact fit, lowest offset of the two */
    assert_int_equal(take(s, 90, 1), 624);  /* the other 100 hole */
    assert_int_equal(take(s, 50, 1), 566);  /* the 50 left of the 200 hole */
    assert_int_equal(take(s, 250, 1), 0);   /* only the 300 hole is left */
    assert_int_equal(vmmt__slab_alloc(s, 60, 1, &(uint64_t){0}), VMMT_EFULL);
    vmmt__slab_destroy(s);
}

static void test_coalesce_both_sides(void **state)
{
    struct vmmt__slab *s = make(400, 8);
    (void)state;

    uint64_t a = take(s, 100, 1), b = take(s, 100, 1), c = take(s, 100, 1);
    uint64_t d = take(s, 100, 1);
    assert_int_equal(stats_of(s).free_blocks, 0);

    give(s, a);
    give(s, c);
    assert_int_equal(stats_of(s).free_blocks, 2);
    give(s, b); /* merges with a on the left and c on the right */
    struct vmmt__slab_stats t = stats_of(s);
    assert_int_equal(t.free_blocks, 1);
    assert_int_equal(t.largest_free, 300);
    assert_int_equal(take(s, 300, 1), 0);

    give(s, 0);
    give(s, d); /* merges only on the left */
    expect_one_free_block(s);

    a = take(s, 100, 1);
    b = take(s, 100, 1);
    give(s, a);
    give(s, b); /* merges left with a and right with the tail */
    expect_one_free_block(s);
    vmmt__slab_destroy(s);
}

static void test_alignment_padding_restored(void **state)
{
    struct vmmt__slab *s = make(4096, 8);
    (void)state;

    assert_int_equal(take(s, 1, 1), 0);
    uint64_t a = take(s, 10, 64);
    assert_int_equal(a, 64);
    struct vmmt__slab_stats t = stats_of(s);
    assert_int_equal(t.free_blocks, 2); /* the padding [1, 64) and the tail */
    assert_int_equal(t.free_bytes, 4096 - 11);
    /* The padding is a real free block: 63 bytes fit there exactly. */
    assert_int_equal(take(s, 63, 1), 1);
    give(s, 1);
    /* The tail starts at 74; aligned to 128 the slice leaves [74, 128) free. */
    assert_int_equal(take(s, 100, 128), 128);
    t = stats_of(s);
    assert_int_equal(t.free_blocks, 3);
    assert_int_equal(t.free_bytes, 4096 - 111);
    assert_int_equal(vmmt__slab_alloc(s, 100, 4096, &(uint64_t){0}), VMMT_EFULL);
    give(s, 0);
    give(s, a);
    give(s, 128);
    expect_one_free_block(s);
    vmmt__slab_destroy(s);
}

static void test_alignment_every_power(void **state)
{
    struct vmmt__slab *s = make(1 << 20, 64);
    uint64_t offs[13];
    (void)state;

    take(s, 3, 1); /* misalign everything that follows */
    for (int k = 0; k <= 12; k++) {
        offs[k] = take(s, 5, (uint64_t)1 << k);
        assert_int_equal(offs[k] % ((uint64_t)1 << k), 0);
    }
    for (int k = 12; k >= 0; k--)
        give(s, offs[k]);
    give(s, 0);
    expect_one_free_block(s);
    vmmt__slab_destroy(s);
}

static void test_bad_arguments(void **state)
{
    struct vmmt__slab *s = make(4096, 8);
    uint64_t off = 7;
    (void)state;

    assert_int_equal(vmmt__slab_alloc(s, 0, 1, &off), VMMT_EINVAL);
    assert_error_contains("size=0");
    assert_int_equal(vmmt__slab_alloc(s, 8, 0, &off), VMMT_EINVAL);
    assert_error_contains("align=0");
    assert_int_equal(vmmt__slab_alloc(s, 8, 48, &off), VMMT_EINVAL);
    assert_error_contains("align=48");
    assert_int_equal(vmmt__slab_alloc(s, 8, 8192, &off), VMMT_EINVAL);
    assert_int_equal(vmmt__slab_alloc(s, 8, 8, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt__slab_alloc(NULL, 8, 8, &off), VMMT_EINVAL);
    assert_int_equal(vmmt__slab_free(NULL, 0), VMMT_EINVAL);
    assert_int_equal(off, 7);
    expect_one_free_block(s);
    vmmt__slab_destroy(s);
}

static void test_full_versus_too_big(void **state)
{
    struct vmmt__slab *s = make(128, 8);
    uint64_t off;
    (void)state;

    assert_int_equal(vmmt__slab_alloc(s, 129, 1, &off), VMMT_ETOOBIG);
    assert_error_contains("129 bytes can never fit");
    assert_int_equal(vmmt__slab_alloc(s, UINT64_MAX, 4096, &off), VMMT_ETOOBIG);
    assert_int_equal(take(s, 1, 1), 0);
    /* 127 bytes are free, yet 100 bytes aligned to 64 would end at 164. */
    assert_int_equal(vmmt__slab_alloc(s, 100, 64, &off), VMMT_EFULL);
    assert_error_contains("no free block fits 100 bytes aligned to 64");
    assert_error_contains("127 of 128 bytes free");
    assert_int_equal(take(s, 100, 1), 1);
    assert_int_equal(vmmt__slab_alloc(s, 28, 1, &off), VMMT_EFULL);
    /* Still ETOOBIG, not EFULL, for what can never fit even when empty. */
    assert_int_equal(vmmt__slab_alloc(s, 1000, 1, &off), VMMT_ETOOBIG);
    vmmt__slab_destroy(s);
}

static void test_double_free(void **state)
{
    struct vmmt__slab *s = make(1024, 8);
    (void)state;

    uint64_t a = take(s, 100, 1);
    take(s, 100, 1);
    give(s, a);
    assert_int_equal(vmmt__slab_free(s, a), VMMT_EINVAL);
    assert_error_contains("offset=0 is not a live slice");
    assert_int_equal(vmmt__slab_free(s, 150), VMMT_EINVAL);
    assert_error_contains("offset=150 lies inside the live slice at 100");
    assert_int_equal(vmmt__slab_free(s, 5000), VMMT_EINVAL);
    assert_error_contains("offset=5000");
    assert_int_equal(vmmt__slab_free(s, UINT64_MAX), VMMT_EINVAL);
    assert_vmmt_ok(vmmt__slab_check(s));
    assert_int_equal(stats_of(s).live, 1);
    vmmt__slab_destroy(s);
}

static void test_max_live(void **state)
{
    struct vmmt__slab *s = make(1 << 20, 3);
    uint64_t off;
    (void)state;

    take(s, 10, 1);
    uint64_t b = take(s, 10, 1);
    take(s, 10, 1);
    assert_int_equal(vmmt__slab_alloc(s, 10, 1, &off), VMMT_EFULL);
    assert_error_contains("all 3 slices are live");
    give(s, b);
    assert_int_equal(take(s, 10, 1), b);
    vmmt__slab_destroy(s);
}

/*
 * The 4096-slot case the pool uses, at the node bound: 1-byte slices aligned
 * to 4 leave a padding block between each pair, so 4096 live slices make
 * 2 * 4096 + 1 blocks, every preallocated node.
 */
static void test_4096_live_at_node_bound(void **state)
{
    struct vmmt__slab *s = make(1 << 20, 4096);
    uint64_t *offs = calloc(4096, sizeof *offs);
    uint64_t off;
    (void)state;

    assert_non_null(offs);
    for (uint32_t i = 0; i < 4096; i++) {
        assert_vmmt_ok(vmmt__slab_alloc(s, 1, 4, &offs[i]));
        assert_int_equal(offs[i], 4 * (uint64_t)i);
    }
    assert_vmmt_ok(vmmt__slab_check(s));
    struct vmmt__slab_stats t = stats_of(s);
    assert_int_equal(t.live, 4096);
    assert_int_equal(t.free_blocks, 4096);
    assert_int_equal(vmmt__slab_alloc(s, 1, 1, &off), VMMT_EFULL);
    /* Free in a scrambled order (odd stride over a power of two visits each once). */
    for (uint32_t i = 0; i < 4096; i++)
        assert_vmmt_ok(vmmt__slab_free(s, offs[(i * 1237) % 4096]));
    assert_vmmt_ok(vmmt__slab_check(s));
    expect_one_free_block(s);
    free(offs);
    vmmt__slab_destroy(s);
}

/*
 * 40 holes of 10 bytes at offsets 16k + 1 (an 8-byte slice aligned to 8
 * does not fit there), then an aligned 10-byte hole that fits, then
 * optionally a 100-byte hole that fits anyway.
 */
static struct vmmt__slab *misaligned_holes(int with_big, uint64_t *fit_off, uint64_t *big_off)
{
    uint64_t cap = 40 * 16 + 16 + (with_big ? 108 : 0);
    struct vmmt__slab *s = make(cap, 128);
    uint64_t off = 0, hole[40];

    for (int i = 0; i < 40; i++) {
        take(s, 1, 1);
        hole[i] = take(s, 10, 1);
        take(s, 5, 1);
        off += 16;
    }
    *fit_off = take(s, 10, 1);
    assert_int_equal(*fit_off, off);
    take(s, 6, 1);
    if (with_big) {
        *big_off = take(s, 100, 1);
        take(s, 8, 1);
    }
    assert_int_equal(stats_of(s).free_bytes, 0);
    for (int i = 0; i < 40; i++)
        give(s, hole[i]);
    give(s, *fit_off);
    if (with_big) give(s, *big_off);
    return s;
}

static void test_scan_bound(void **state)
{
    uint64_t fit, big;
    struct vmmt__slab *s;
    (void)state;

    /* Past VMMT__SLAB_SCAN misfits, alloc settles for a block that fits at any offset. */
    s = misaligned_holes(1, &fit, &big);
    assert_int_equal(take(s, 8, 8), (big + 7) & ~(uint64_t)7);
    vmmt__slab_destroy(s);

    /* Without such a block it keeps scanning: a fit exists, so no EFULL. */
    s = misaligned_holes(0, &fit, &big);
    assert_int_equal(take(s, 8, 8), fit);
    uint64_t off;
    assert_int_equal(vmmt__slab_alloc(s, 8, 8, &off), VMMT_EFULL);
    vmmt__slab_destroy(s);
}

/* ------------------------------------------------- randomized, against a model */

#define MODEL_CAP  4096
#define MODEL_LIVE 96

struct model {
    uint8_t used[MODEL_CAP];
    uint64_t off[MODEL_LIVE], size[MODEL_LIVE];
    uint32_t live;
};

struct run {
    uint64_t off, len;
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int run_cmp(const void *a, const void *b)
{
    const struct run *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* Maximal free runs of the bitmap, sorted by (length, offset): the free tree's order. */
static uint32_t model_runs(const struct model *m, struct run *runs)
{
    uint32_t n = 0;
    for (uint64_t i = 0; i < MODEL_CAP;) {
        if (m->used[i]) {
            i++;
            continue;
        }
        uint64_t j = i;
        while (j < MODEL_CAP && !m->used[j])
            j++;
        runs[n++] = (struct run){i, j - i};
        i = j;
    }
    qsort(runs, n, sizeof *runs, run_cmp);
    return n;
}

static int run_fits(const struct run *r, uint64_t size, uint64_t align)
{
    uint64_t start = (r->off + align - 1) & ~(align - 1);
    return start + size <= r->off + r->len;
}

/* The documented choice, computed the slow way; returns the run index or -1. */
static int model_choice(const struct run *runs, uint32_t n, uint64_t size, uint64_t align)
{
    uint32_t i = 0, seen = 0;
    while (i < n && runs[i].len < size)
        i++;
    for (; i < n; i++) {
        if (run_fits(&runs[i], size, align)) return (int)i;
        if (++seen == VMMT__SLAB_SCAN) break;
    }
    if (i >= n) return -1;
    for (uint32_t j = 0; j < n; j++)
        if (runs[j].len >= size + align - 1) return (int)j;
    for (i++; i < n; i++)
        if (run_fits(&runs[i], size, align)) return (int)i;
    return -1;
}

static void model_compare(const struct vmmt__slab *s, const struct model *m)
{
    struct run runs[MODEL_CAP];
    uint32_t n = model_runs(m, runs);
    uint64_t free_bytes = 0, largest = 0;

    for (uint32_t i = 0; i < n; i++) {
        free_bytes += runs[i].len;
        if (runs[i].len > largest) largest = runs[i].len;
    }
    struct vmmt__slab_stats t = stats_of(s);
    assert_vmmt_ok(vmmt__slab_check(s));
    assert_int_equal(t.live, m->live);
    assert_int_equal(t.free_blocks, n);
    assert_int_equal(t.free_bytes, free_bytes);
    assert_int_equal(t.largest_free, largest);
}

static void model_alloc(struct vmmt__slab *s, struct model *m, uint64_t size, uint64_t align)
{
    struct run runs[MODEL_CAP];
    uint32_t n = model_runs(m, runs);
    uint64_t off = UINT64_MAX;
    int st = vmmt__slab_alloc(s, size, align, &off);

    if (size > MODEL_CAP) {
        assert_int_equal(st, VMMT_ETOOBIG);
        return;
    }
    int pick = m->live == MODEL_LIVE ? -1 : model_choice(runs, n, size, align);
    if (pick < 0) {
        assert_int_equal(st, VMMT_EFULL);
        return;
    }
    assert_vmmt_ok(st);
    assert_int_equal(off, (runs[pick].off + align - 1) & ~(align - 1));
    for (uint64_t i = off; i < off + size; i++) {
        assert_false(m->used[i]);
        m->used[i] = 1;
    }
    m->off[m->live] = off;
    m->size[m->live] = size;
    m->live++;
}

static void model_free(struct vmmt__slab *s, struct model *m, uint32_t k)
{
    assert_vmmt_ok(vmmt__slab_free(s, m->off[k]));
    memset(&m->used[m->off[k]], 0, m->size[k]);
    m->live--;
    m->off[k] = m->off[m->live];
    m->size[k] = m->size[m->live];
}

static int model_is_live_start(const struct model *m, uint64_t off)
{
    for (uint32_t i = 0; i < m->live; i++)
        if (m->off[i] == off) return 1;
    return 0;
}

static void test_randomized_against_model(void **state)
{
    struct vmmt__slab *s = make(MODEL_CAP, MODEL_LIVE);
    struct model *m = calloc(1, sizeof *m);
    (void)state;

    assert_non_null(m);
    for (int op = 0; op < 20000; op++) {
        uint64_t r = rng() % 100;
        if (r < 52 || m->live == 0) {
            uint64_t size = 1 + rng() % (rng() % 4 == 0 ? 700 : 48);
            uint64_t align = (uint64_t)1 << (rng() % 13);
            if (rng() % 200 == 0) size = MODEL_CAP + 1 + rng() % 1000;
            model_alloc(s, m, size, align);
        } else if (r < 97) {
            model_free(s, m, (uint32_t)(rng() % m->live));
        } else {
            uint64_t off = rng() % (MODEL_CAP + 16);
            if (!model_is_live_start(m, off))
                assert_int_equal(vmmt__slab_free(s, off), VMMT_EINVAL);
        }
        model_compare(s, m);
    }
    while (m->live > 0)
        model_free(s, m, (uint32_t)(rng() % m->live));
    expect_one_free_block(s);
    free(m);
    vmmt__slab_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_args),
        cmocka_unit_test(test_alloc_free_sequence),
        cmocka_unit_test(test_best_fit_prefers_smallest),
        cmocka_unit_test(test_coalesce_both_sides),
        cmocka_unit_test(test_alignment_padding_restored),
        cmocka_unit_test(test_alignment_every_power),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_full_versus_too_big),
        cmocka_unit_test(test_double_free),
        cmocka_unit_test(test_max_live),
        cmocka_unit_test(test_4096_live_at_node_bound),
        cmocka_unit_test(test_scan_bound),
        cmocka_unit_test(test_randomized_against_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
