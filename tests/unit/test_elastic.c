/*
 * Elastic device pools: nothing held while idle, growth under load, chunks
 * given back after idle_release_ms, chunks kept resident (a fixed pool is
 * min_resident = memory_size), a consumer (in this process and in another)
 * that imported a chunk the producer has since given back and made again, a
 * stale descriptor, and a growth that fails. (The transport suites test_pool
 * and test_pool_races run on elastic pools too: test_*_elastic.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "chunk_map.h"
#include "desc.h"
#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

#define CHUNK POOLFIX_CHUNK

/* Wait (bounded) until the pool holds `bytes` resident. */
static int resident_becomes(vmmt_pool *p, uint64_t bytes, long ms)
{
    for (long t = 0; t < ms; t += 10) {
        if (stats(p).resident_bytes == bytes) return 1;
        sleep_ms(10);
    }
    return stats(p).resident_bytes == bytes;
}

static unsigned long long device_bytes(void)
{
    return on_emu() ? vmmt__emu_device_bytes() : 0;
}

static void test_elastic_idle_holds_nothing(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(64 * MiB, 1500);
    unsigned long long before = device_bytes();
    vmmt_pool_stats s;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    s = stats(f->pool);
    assert_int_equal(s.resident_bytes, 0);
    assert_int_equal(s.device_bytes, 0);
    assert_int_equal(s.max_bytes, 64 * MiB);
    assert_int_equal(s.chunk_bytes, CHUNK);
    assert_int_equal(s.chunks_made, 0);
    assert_true(s.host_control_table);
    assert_int_equal(device_bytes(), before);
}

/* Growth while nothing is acknowledged, then every chunk back after the idle time. */
static void test_elastic_grows_under_load_and_shrinks_when_idle(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(64 * MiB, 50);
    unsigned long long before = device_bytes();
    vmmt_desc d[12];
    vmmt_pool_stats s;
    const size_t n = 1 * MiB + 4096;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t i = 0; i < 12; i++) {
        vmmt_buffer b = bytes(f->src, n);
        put(f, f->src, n, i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d[i]));
        s = stats(f->pool);
        /* Never more than the chunks the slices so far touch. */
        assert_true(s.resident_bytes <= ((i + 1) * (n + 256) / CHUNK + 2) * CHUNK);
    }
    s = stats(f->pool);
    assert_true(s.resident_bytes >= 12 * n);
    assert_int_equal(s.peak_bytes, s.resident_bytes);
    if (on_emu()) assert_int_equal(device_bytes() - before, s.resident_bytes);
    for (uint32_t i = 0; i < 12; i++) {
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &d[i], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        expect(f, f->dst, n, i);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(resident_becomes(f->pool, 0, 3000));
    s = stats(f->pool);
    assert_int_equal(s.chunks_released, s.chunks_made);
    assert_true(s.peak_bytes >= 12 * n);
    if (on_emu()) assert_int_equal(device_bytes(), before);
}

/* A steady trickle of small buffers keeps one chunk, as a fixed pool would keep all. */
static void test_elastic_steady_state_one_chunk(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(64 * MiB, 1500);

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    for (uint32_t i = 0; i < 50; i++) {
        tu_roundtrip(f, 4096, i);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
    assert_int_equal(stats(f->pool).resident_bytes, CHUNK);
    assert_int_equal(stats(f->pool).chunks_made, 1);
}

static void test_elastic_min_resident_and_fixed(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);

    c.min_resident = 3 * MiB; /* whole chunks: 2 */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(stats(f->pool).resident_bytes, 2 * CHUNK);
    tu_roundtrip(f, 5 * MiB, 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(resident_becomes(f->pool, 2 * CHUNK, 3000));
    vmmt_pool_destroy(f->pool);
    f->pool = NULL;
    /* min = max: everything made at once and never given back. */
    c.min_resident = c.memory_size;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(stats(f->pool).resident_bytes, 16 * MiB);
    tu_roundtrip(f, 3 * MiB, 2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    sleep_ms(100);
    assert_int_equal(stats(f->pool).resident_bytes, 16 * MiB);
    assert_int_equal(stats(f->pool).chunks_released, 0);
}

/*
 * A chunk that goes idle while the recycler sleeps without a deadline (no
 * slice in flight, every chunk then live): freed by another thread (here a
 * cancelled reservation), it must still be given back. It was kept for good
 * (the model under TSan in CI: "an idle elastic pool kept chunks").
 */
static void test_elastic_chunk_idle_while_recycler_sleeps(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);
    vmmt_reservation r;

    c.recycle_interval_us = 100; /* its grace before the untimed sleep: about 26 ms */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_reserve(f->pool, 4096, &r));
    assert_int_equal(stats(f->pool).resident_bytes, CHUNK);
    sleep_ms(300); /* the recycler is asleep now, nothing in flight and the chunk live */
    assert_vmmt_ok(vmmt_cancel(f->pool, &r.token));
    assert_true(resident_becomes(f->pool, 0, 3000));
    assert_int_equal(stats(f->pool).chunks_released, 1);
}

/*
 * The consumer keeps chunk 0 imported; the producer gives it back and makes it
 * again (new memory, new incarnation). The consumer must import it afresh:
 * the old mapping still shows the old bytes, so a copy from it would be wrong.
 */
static void test_elastic_remade_chunk_is_imported_again(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);
    vmmt_buffer b = bytes(f->src, 10000);
    vmmt_desc first, second;
    vmmt_desc_info i1, i2;
    long imports;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 10000, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &first));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &first, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 10000, 1);
    imports = vmmt__emu_calls("cuMemImportFromShareableHandle");
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(resident_becomes(f->pool, 0, 3000));
    put(f, f->src, 10000, 2);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &second));
    assert_vmmt_ok(vmmt_desc_inspect(&first, &i1));
    assert_vmmt_ok(vmmt_desc_inspect(&second, &i2));
    assert_int_equal(i1.chunk, 0);
    assert_int_equal(i2.chunk, 0);
    assert_int_not_equal(i1.incarnation, i2.incarnation);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &second, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 10000, 2);
    assert_int_equal(vmmt__emu_calls("cuMemImportFromShareableHandle"), imports + 1);
    /* The first descriptor names a making of chunk 0 that is gone: its slot holds the
     * second, which the occupant's check sees before any chunk is looked at. */
    assert_int_equal(
        vmmt_consume(f->consumer, &first, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ESTATE);
    assert_error_contains("recycled");
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* The same with the consumer in another process, keeping its imports between buffers. */
static void test_elastic_remade_chunk_across_processes(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);
    int sock;
    pid_t pid;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    spawn_consumer(0, 0, 1, &sock, &pid);
    for (uint32_t i = 0; i < 4; i++) {
        vmmt_buffer b = bytes(f->src, 3 * MiB); /* two chunks */
        vmmt_desc d;
        put(f, f->src, 3 * MiB, i);
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        send_desc(sock, i, &d);
        expect_reply(sock, i);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
        /* Every other round, let the chunks go back before the next buffer. */
        if (i % 2 == 0) assert_true(resident_becomes(f->pool, 0, 3000));
    }
    send_desc(sock, UINT32_MAX, NULL);
    assert_int_equal(tu_wait(pid, 30000), 0);
    close(sock);
    assert_true(stats(f->pool).chunks_made >= 4);
}

static void test_elastic_failed_growth(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 1500);
    vmmt_buffer b = bytes(f->src, 3 * MiB);
    vmmt_desc d;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    /* The second chunk of the slice cannot be made: the first goes back too. */
    emu_fail("cuMemCreate:2:CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_ENOMEM);
    assert_error_contains("growing the elastic pool by chunk 1");
    assert_error_contains("CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(stats(f->pool).resident_bytes, 0);
    assert_int_equal(stats(f->pool).in_flight, 0);
    emu_fail("cuMemExportToShareableHandle:1:CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_not_equal(vmmt_publish(f->pool, &b, f->stream, &d), VMMT_OK);
    assert_int_equal(stats(f->pool).resident_bytes, 0);
    emu_reset();
    tu_roundtrip(f, 3 * MiB, 3);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * A consumer lets go of a chunk the producer gave back, at its next call on
 * the pool: its mapping would otherwise keep the device memory allocated.
 */
static void test_elastic_consumer_lets_go_of_given_back_chunks(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);
    int before;

    if (!on_emu()) skip();
    c.min_resident = CHUNK; /* chunk 0 stays */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    before = vmmt__emu_live_allocations(); /* chunk 0, the producer's */
    tu_roundtrip(f, 3 * MiB, 1);           /* chunks 0 and 1, imported here too */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(resident_becomes(f->pool, CHUNK, 3000));
    /* The producer let go of chunk 1; this process's import of it is all that is left. */
    assert_int_equal(vmmt__emu_live_allocations(), before + 2);
    sleep_ms(60);
    tu_roundtrip(f, 4096, 2); /* chunk 0 only */
    assert_int_equal(vmmt__emu_live_allocations(), before + 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * Caught (issue 16, defect 6): the producer's shutdown gives every chunk back
 * whatever the consumers still do, and the consumer's next call on the pool
 * unmapped the chunks under its own copy still queued out of them (on a GPU
 * a fault of its context; the emulator fails the stream with
 * CUDA_ERROR_ILLEGAL_ADDRESS). A chunk is unmapped only once no copy out of
 * the pool is queued.
 */
static void test_elastic_no_unmap_under_queued_copy(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 1500);
    vmmt_buffer b = bytes(f->src, 3 * MiB); /* chunks 0 and 1 */
    vmmt_desc d;
    struct gate g;
    int mappings;

    if (!on_emu()) skip(); /* the unmap would fault a GPU's context */
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 3 * MiB, 5);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&g, f->stream); /* the copy out of the chunks stays queued */
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    mappings = vmmt__emu_live_mappings();
    /* The shutdown waits for the producer's own copies only, then gives the chunks back. */
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    sleep_ms(60); /* past the consumer's trim interval (50 ms) */
    /* Any call on the pool may let go of given-back chunks: not under the queued copy. */
    (void)vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0);
    assert_int_equal(vmmt__emu_live_mappings(), mappings - 2); /* the producer's two */
    gate_open_later(&g, 20);
    gate_free(&g); /* the stream must have run its copy out of mapped chunks */
    expect(f, f->dst, 3 * MiB, 5);
}

/*
 * Caught (issue 16, defect 18): a consumer reserved the whole maximum of
 * every elastic pool it imported, whatever the pool held (1 TiB for one of
 * at most 1 TiB), so 128 such imports exhausted the process's address space.
 * The elastic imports of a process now reserve at most 16 TiB together:
 * beyond, the least recently used idle one is let go, and where none is
 * idle the import fails with VMMT_ENOMEM, saying so.
 */
static void test_elastic_imports_reserve_bounded(void **state)
{
    enum { N = 17 };
    const uint64_t tib = 1ull << 40;
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = elastic_config(tib, 1500);
    vmmt_consumer_config cc;
    vmmt_consumer *all;
    vmmt_pool *pools[N];
    vmmt_desc desc[N];
    vmmt_buffer b = bytes(f->src, 4096);
    unsigned long long produced;
    struct gate g;

    if (!on_emu()) skip(); /* the producers here reserve 17 TiB too */
#if defined(__SANITIZE_THREAD__)
    skip(); /* ThreadSanitizer's shadow memory leaves no 17 TiB of address space */
#endif
    c.chunk_size = 16 * MiB; /* 65536 chunks, the most a pool may have */
    vmmt_consumer_config_init(&cc);
    cc.max_pools = 0; /* no count limit: only the address space bounds the imports */
    assert_vmmt_ok(vmmt_consumer_create(&cc, &all));
    for (int i = 0; i < N; i++) {
        assert_vmmt_ok(vmmt_pool_create(&c, &pools[i]));
        assert_vmmt_ok(vmmt_publish(pools[i], &b, f->stream, &desc[i]));
    }
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    produced = vmmt__emu_reserved_bytes();
    gate_close(&g, f->stream); /* every copy stays queued: no import is idle */
    for (int i = 0; i < N - 1; i++)
        assert_vmmt_ok(
            vmmt_consume(all, &desc[i], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_true(vmmt__emu_reserved_bytes() - produced == (N - 1) * tib);
    /* One more would pass 16 TiB, and none can be let go. */
    assert_int_equal(
        vmmt_consume(all, &desc[N - 1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ENOMEM);
    assert_error_contains("address space");
    assert_true(vmmt__emu_reserved_bytes() - produced == (N - 1) * tib);
    gate_open_later(&g, 20);
    gate_free(&g);
    /* The copies are done: the least recently used import makes room. */
    assert_vmmt_ok(
        vmmt_consume(all, &desc[N - 1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_true(vmmt__emu_reserved_bytes() - produced == (N - 1) * tib);
    assert_int_equal(vmmt_consumer_pool_count(all), N - 1);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    vmmt_consumer_destroy(all);
    for (int i = 0; i < N; i++)
        vmmt_pool_destroy(pools[i]);
}

/* The broker hands out resident chunks only, by their exact chunk id. */
static void test_elastic_broker_serves_resident_chunks_only(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 1500);
    vmmt_buffer b = bytes(f->src, 4096);
    struct vmmt__desc d;
    vmmt_desc desc;
    struct vmmt__broker_peer me;
    uint8_t id[16];
    int fd = -1;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &desc));
    assert_vmmt_ok(vmmt__desc_decode(desc.bytes, &d));
    vmmt__broker_expect(d.producer_uid, d.producer_pid, d.producer_pidns, &me);
    vmmt__chunk_id(d.pool_id, 0, id);
    assert_vmmt_ok(vmmt__broker_fetch_fds(&d.broker, id, &me, 2000, &fd, 1, NULL));
    assert_true(fd >= 0);
    close(fd);
    /* Chunk 1 is not resident; chunk 8 does not exist (16 MiB of 2 MiB chunks). */
    vmmt__chunk_id(d.pool_id, 1, id);
    assert_int_not_equal(vmmt__broker_fetch_fds(&d.broker, id, &me, 2000, &fd, 1, NULL), VMMT_OK);
    assert_int_equal(fd, -1);
    vmmt__chunk_id(d.pool_id, 8, id);
    assert_int_not_equal(vmmt__broker_fetch_fds(&d.broker, id, &me, 2000, &fd, 1, NULL), VMMT_OK);
    /* Another pool's id with our chunk tag is no chunk of ours. */
    vmmt__chunk_id(d.pool_id, 0, id);
    id[0] ^= 1;
    assert_int_not_equal(vmmt__broker_fetch_fds(&d.broker, id, &me, 2000, &fd, 1, NULL), VMMT_OK);
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &desc, 0, f->stream, VMMT_ALL_RANKS, 0));
}

/*
 * Caught (the model test, CI's ThreadSanitizer build, seed 15): a replay of a
 * consumed descriptor mapped its chunks before its occupant was checked, so
 * a chunk given back between the word's load and the broker's answer turned
 * the refusal into the broker's "not served here" (VMMT_EINVAL). A descriptor
 * with no live occupant is refused before anything is fetched or imported.
 */
static void test_elastic_replay_maps_nothing(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 60000);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_consumer_config cc;
    vmmt_consumer *fresh = NULL;
    vmmt_desc desc;
    long imports;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 1);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &desc));
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &desc, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 1);
    vmmt_consumer_config_init(&cc);
    assert_vmmt_ok(vmmt_consumer_create(&cc, &fresh));
    imports = vmmt__emu_calls("cuMemImportFromShareableHandle");
    /* Chunk 0 is still resident (a minute's idle time): only the occupant check refuses,
     * finding the rank's acknowledgement or, once the recycler retired the slot, no
     * occupant (CI's ThreadSanitizer build saw both). */
    assert_int_equal(vmmt_consume(fresh, &desc, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    assert_error_contains("nothing was acknowledged");
    assert_int_equal(vmmt__emu_calls("cuMemImportFromShareableHandle"), imports);
    vmmt_consumer_destroy(fresh);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/*
 * The flush callback of a chunk map, run after the word's load when a copy
 * holds the chunk: the copy completes, and the chunk goes back then.
 */
struct fetch_race {
    uint32_t *word;
    struct vmmt__chunk_map *m;
    struct vmmt__desc d;
};

static void give_back_while_fetched(void *arg)
{
    struct fetch_race *r = arg;

    __atomic_store_n(r->word, 0, __ATOMIC_RELEASE);
    vmmt__chunk_map_hold(r->m, r->d.offset, r->d.nbytes, -1);
}

/*
 * A chunk given back between the load of its word and the broker's answer is
 * the descriptor's staleness (VMMT_ESTATE), not a broker that serves another
 * pool (VMMT_EINVAL): the word, loaded again after the refusal, says so. The
 * table's words here are the test's, so the give-back lands at that moment.
 */
static void test_elastic_chunk_given_back_while_fetched(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 20);
    vmmt_buffer b = bytes(f->src, 4096);
    struct vmmt__chunk_map *m = NULL;
    struct vmmt__desc d;
    vmmt_desc desc;
    uint32_t words[8] = {0};
    struct fetch_race race = {.word = &words[0]};

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &desc));
    assert_vmmt_ok(vmmt__desc_decode(desc.bytes, &d));
    assert_int_equal(d.chunk, 0);
    assert_vmmt_ok(vmmt__ctx_enter(0));
    assert_vmmt_ok(vmmt__chunk_map_create(0, &d, 2000, give_back_while_fetched, &race, &m));
    words[0] = d.incarnation;
    assert_vmmt_ok(vmmt__chunk_map_ensure(m, words, &d)); /* chunk 0 mapped here */
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &desc, 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_true(resident_becomes(f->pool, 0, 3000)); /* the broker serves chunk 0 no more */
    /* A making the producer shows next; it goes back before the broker answers (the
     * copy that held chunk 0 completes then: the map's flush). */
    d.incarnation = words[0] = d.incarnation + 1;
    race.m = m;
    race.d = d;
    vmmt__chunk_map_hold(m, d.offset, d.nbytes, 1);
    assert_int_equal(vmmt__chunk_map_ensure(m, words, &d), VMMT_ESTATE);
    assert_error_contains("given back");
    assert_vmmt_ok(vmmt__chunk_map_destroy(m));
    vmmt__ctx_leave();
}

/* The descriptor's chunk fields are checked before anything is mapped. */
static void test_elastic_descriptor_fields_checked(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 1500);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d, bad;
    vmmt_desc_info info;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
    assert_int_equal(info.chunk_size, CHUNK);
    assert_int_equal(info.memory_location, VMMT_MEMORY_DEVICE);
    bad = d;
    bad.bytes[488] = 3; /* chunk 3, but the buffer starts in chunk 0 */
    assert_int_equal(vmmt_desc_inspect(&bad, &info), VMMT_EPROTO);
    assert_error_contains("names chunk 3");
    bad = d;
    memset(bad.bytes + 492, 0, 4); /* incarnation 0 */
    assert_int_equal(vmmt_desc_inspect(&bad, &info), VMMT_EPROTO);
    bad = d;
    bad.bytes[480] = 1; /* chunk_size not a multiple of a page */
    assert_int_equal(vmmt_desc_inspect(&bad, &info), VMMT_EPROTO);
    assert_error_contains("chunk_size=");
    bad = d;
    bad.bytes[496] = 2;
    assert_int_equal(vmmt_desc_inspect(&bad, &info), VMMT_EPROTO);
    assert_error_contains("memory_location=2");
    /* Refused by the consumer too, and the real one still goes through. */
    assert_int_equal(
        vmmt_consume(f->consumer, &bad, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_EPROTO);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    vmmt_pool_destroy(f->pool);
    f->pool = NULL;
    /* A fixed pool's descriptor names no chunk. */
    c = config(8 * MiB, 1);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    bad = d;
    bad.bytes[492] = 1;
    assert_int_equal(vmmt_desc_inspect(&bad, &info), VMMT_EPROTO);
    assert_error_contains("of a pool without chunks");
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
}

static void test_elastic_config_errors(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(16 * MiB, 1500);

    c.memory_location = VMMT_MEMORY_HOST;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("elastic pools are device pools");
    c = elastic_config(16 * MiB, 1500);
    c.handle_type = VMMT_HANDLE_FABRIC;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    c = elastic_config(16 * MiB, 1500);
    c.device_control_table = 1;
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("shared host control table");
    c = elastic_config(1 * MiB, 1500);
    assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_EINVAL);
    assert_error_contains("whole chunks");
    if (on_emu()) {
        /* Without POSIX_FD the first chunk could never be exported: refused at creation. */
        setenv("VMMT_EMU_HANDLES", "fabric", 1);
        vmmt__emu_configure();
        vmmt_probe_reset();
        c = elastic_config(16 * MiB, 1500);
        assert_int_equal(vmmt_pool_create(&c, &f->pool), VMMT_ENOTSUP);
        assert_error_contains("POSIX_FD does not work on device 0");
        emu_reset();
    }
    assert_null(f->pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_elastic_idle_holds_nothing),
        T(test_elastic_grows_under_load_and_shrinks_when_idle),
        T(test_elastic_steady_state_one_chunk),
        T(test_elastic_min_resident_and_fixed),
        T(test_elastic_remade_chunk_is_imported_again),
        T(test_elastic_remade_chunk_across_processes),
        T(test_elastic_failed_growth),
        T(test_elastic_consumer_lets_go_of_given_back_chunks),
        T(test_elastic_no_unmap_under_queued_copy),
        T(test_elastic_imports_reserve_bounded),
        T(test_elastic_broker_serves_resident_chunks_only),
        T(test_elastic_replay_maps_nothing),
        T(test_elastic_chunk_given_back_while_fetched),
        T(test_elastic_descriptor_fields_checked),
        T(test_elastic_config_errors),
        T(test_elastic_chunk_idle_while_recycler_sleeps),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
