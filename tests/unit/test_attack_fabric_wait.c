/*
 * Outside attack on "no stream wait that only a dead FABRIC producer could
 * end" (include/vmmt.h, vmmt_consume and vmmt_consumer_ack; docs/design.md,
 * "Nothing waits forever"; docs/descriptor.md, "Wait"). A FABRIC pool has no
 * broker, so its consumer cannot see its producer die: a descriptor whose
 * bytes have not landed is waited for on the host, at most the consumer's
 * timeout_ms, and VMMT_ETIMEDOUT leaves nothing queued and nothing
 * acknowledged; a device-table row that shows the bytes landed queues no
 * stream wait at all. Written from the public documents alone.
 *
 * "No stream wait queued" is checked by counting the emulator's
 * cuStreamWaitValue32 calls and by cuStreamQuery of the consumer's stream;
 * "nothing acknowledged" by reading the slot's ack word in the producer's
 * device table (docs/descriptor.md, "The control table") and by the pool's
 * in_flight count.
 */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "pattern.h"
#include "pool_internal.h"
#include "poolfix.h"

#define N 4096

static const struct vmmt_drv *drv(void)
{
    return vmmt__drv();
}

static long stream_waits(void)
{
    return vmmt__emu_calls("cuStreamWaitValue32");
}

static void fabric_env(void)
{
    setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
}

/* A FABRIC device pool (device table, stream-ordered unless handoff says otherwise). */
static void make_fabric_pool(struct fixture *f, int consumers, vmmt_handoff handoff, int timeout_ms)
{
    vmmt_pool_config c = config(8 * MiB, consumers);

    fabric_env();
    c.handle_type = VMMT_HANDLE_FABRIC;
    c.allow_posix_fallback = 0;
    c.handoff = handoff;
    c.max_slices = 8;
    if (timeout_ms > 0) c.timeout_ms = timeout_ms;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_int_equal(stats(f->pool).handle_type, VMMT_HANDLE_FABRIC);
    assert_int_equal(stats(f->pool).host_control_table, 0);
}

static vmmt_consumer *make_consumer(int timeout_ms)
{
    vmmt_consumer_config cc;
    vmmt_consumer *k;

    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = timeout_ms;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &k));
    return k;
}

static void sync_s(CUstream s)
{
    assert_int_equal(drv()->cuStreamSynchronize(s), CUDA_SUCCESS);
}

static void free_stream(CUstream s)
{
    sync_s(s);
    assert_int_equal(drv()->cuStreamDestroy(s), CUDA_SUCCESS);
}

static vmmt_desc_info info(const vmmt_desc *d)
{
    vmmt_desc_info i;
    assert_vmmt_ok(vmmt_desc_inspect(d, &i));
    return i;
}

/*
 * Word `word` of d's row in the producer's device table: 0 is ready, 1 + r
 * is ack[r]. Read on a stream of its own (the producer's stream may be
 * gated).
 */
static uint32_t table_word(struct fixture *f, const vmmt_desc *d, int word)
{
    vmmt_desc_info i = info(d);
    CUstream s = new_stream();
    uint32_t v = 0;

    assert_int_equal(
        drv()->cuMemcpyDtoHAsync(
            &v, vmmt__ctrl_ready(f->pool->ctrl_dev, f->pool->stride, i.slot) + 4u * word, 4, s),
        CUDA_SUCCESS);
    free_stream(s);
    return v;
}

/* Wait (at most 10 s) until d's ack word for rank r shows d's generation. */
static int wait_acked(struct fixture *f, const vmmt_desc *d, int r)
{
    uint32_t gen = info(d).generation;

    for (int i = 0; i < 2000; i++) {
        if (table_word(f, d, 1 + r) == gen) return 1;
        sleep_ms(5);
    }
    return 0;
}

/* Check the pattern of buffer i at a device address. */
static void expect_at(CUdeviceptr at, size_t n, uint32_t i)
{
    CUstream s = new_stream();
    uint8_t *h = malloc(n);

    assert_int_equal(drv()->cuMemcpyDtoHAsync(h, at, n, s), CUDA_SUCCESS);
    free_stream(s);
    assert_int_equal(tu_pattern_check(h, n, i), n);
    free(h);
}

/* The message of a failed host wait says what was asked, found and what to do. */
static void expect_timeout_message(const vmmt_desc *d, int timeout_ms)
{
    vmmt_desc_info i = info(d);
    char gen[32], ms[32];

    snprintf(gen, sizeof gen, "%u", i.generation);
    snprintf(ms, sizeof ms, "%d", timeout_ms);
    assert_int_equal(vmmt_last_status(), VMMT_ETIMEDOUT);
    assert_error_contains("did not land");
    assert_error_contains(gen); /* which occupant was asked for */
    assert_error_contains(ms);  /* how long it waited */
}

/* Device pools on the emulator only: the attacks count its calls and gate its streams. */
static void need_device_emu(void)
{
    if (!on_emu() || pool_kind_host() || pool_kind_elastic()) skip();
}

/*
 * Where most attacks start: a stream-ordered FABRIC pool of `ranks` ranks
 * (pool_timeout_ms 0: the pool's default), a consumer that waits at most
 * timeout_ms and, where s2 is given, a stream of the consumer's own (gates
 * hold the producer's, f->stream).
 */
static vmmt_consumer *fabric_setup(struct fixture *f, int ranks, int pool_timeout_ms,
                                   int timeout_ms, CUstream *s2)
{
    vmmt_consumer *k;

    need_device_emu();
    make_fabric_pool(f, ranks, VMMT_HANDOFF_STREAM, pool_timeout_ms);
    k = make_consumer(timeout_ms);
    if (s2) *s2 = new_stream();
    return k;
}

/* Publish f->src's first N bytes as *d behind a gate closed on f->stream: not landed yet. */
static void publish_gated(struct fixture *f, struct gate *g, vmmt_desc *d)
{
    vmmt_buffer b = bytes(f->src, N);

    gate_close(g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, d));
}

/* The same with buffer `pattern` written first. */
static void publish_pending(struct fixture *f, uint32_t pattern, struct gate *g, vmmt_desc *d)
{
    put(f, f->src, N, pattern);
    publish_gated(f, g, d);
}

/*
 * Write buffer `pattern`, publish it, let it land and consume it on s2 (ack:
 * acknowledge it instead), so the pool is imported before what is measured.
 */
static void import_first(struct fixture *f, vmmt_consumer *k, CUstream s2, uint32_t pattern,
                         int ack)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d0;

    put(f, f->src, N, pattern);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d0));
    sync_s(f->stream);
    if (ack)
        assert_vmmt_ok(vmmt_consumer_ack(k, &d0, 0, s2, VMMT_ALL_RANKS, 0));
    else
        assert_vmmt_ok(vmmt_consume(k, &d0, 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0));
    sync_s(s2);
    /* The acknowledgement is written by the consumer's thread after the copy: wait for it
     * here, or a test's injected failure may find it still on its way (its slice then waits
     * for a release: seen under ASan with both cores busy, test_fabric_row_read_fails...). */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

/* Let a gated publish land: open the gate and wait for the producer's stream. */
static void open_gate(struct fixture *f, struct gate *g)
{
    gate_open_later(g, 0);
    gate_free(g);
    sync_s(f->stream);
}

/* A failed wait queued nothing: no stream wait since `w`, and s2 idle. */
static void expect_nothing_queued(long w, CUstream s2)
{
    assert_int_equal(stream_waits(), w);
    assert_int_equal(drv()->cuStreamQuery(s2), CUDA_SUCCESS);
}

/*
 * d landed after a call that failed: that call acknowledged nothing (given
 * time to show up), and the slot is still in flight.
 */
static void expect_not_acked(struct fixture *f, const vmmt_desc *d)
{
    sleep_ms(50);
    assert_int_not_equal(table_word(f, d, 1), info(d).generation);
    assert_int_equal(stats(f->pool).in_flight, 1);
}

/*
 * The retry once d landed: consume it on s2 and get buffer `pattern`; then
 * drain the pool, free s2 and destroy k (unless it is the fixture's own,
 * which the teardown destroys).
 */
static void consume_and_finish(struct fixture *f, vmmt_consumer *k, const vmmt_desc *d, CUstream s2,
                               uint32_t pattern)
{
    assert_vmmt_ok(vmmt_consume(k, d, 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0));
    sync_s(s2);
    expect(f, f->dst, N, pattern);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s2);
    if (k != f->consumer) vmmt_consumer_destroy(k);
}

/*
 * What most attacks hold: the consumer, its stream, the gate on the
 * producer's stream and the descriptor that gate keeps pending.
 */
struct pending {
    vmmt_consumer *k;
    CUstream s2;
    struct gate g;
    vmmt_desc d;
};

/* The commonest start: fabric_setup's one-rank pool, then publish_pending's descriptor. */
static void pending_setup(struct fixture *f, struct pending *p, int timeout_ms, uint32_t pattern)
{
    p->k = fabric_setup(f, 1, 0, timeout_ms, &p->s2);
    publish_pending(f, pattern, &p->g, &p->d);
}

/* The same with the pool imported first (import_first), so the wait is on a mapped pool. */
static void imported_pending_setup(struct fixture *f, struct pending *p, int timeout_ms,
                                   uint32_t pattern)
{
    p->k = fabric_setup(f, 1, 0, timeout_ms, &p->s2);
    import_first(f, p->k, p->s2, pattern, 0);
    publish_gated(f, &p->g, &p->d);
}

/* A consume of p->d, still pending, on p->s2: it times out. */
static void consume_times_out(struct fixture *f, struct pending *p)
{
    assert_int_equal(vmmt_consume(p->k, &p->d, 0, f->dst, f->cap, p->s2, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
}

/* The end once every slot came back: drain, `recycled` recycled in all; free p->s2 and p->k. */
static void finish_recycled(struct fixture *f, struct pending *p, int recycled)
{
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, recycled);
    free_stream(p->s2);
    vmmt_consumer_destroy(p->k);
}

/* After a call that failed and queued nothing (p->s2 idle): let the bytes land and retry. */
static void retry_after_failure(struct fixture *f, struct pending *p, uint32_t pattern)
{
    assert_int_equal(drv()->cuStreamQuery(p->s2), CUDA_SUCCESS);
    open_gate(f, &p->g);
    consume_and_finish(f, p->k, &p->d, p->s2, pattern);
}

/*
 * Attack 1: a pending FABRIC descriptor. Expected: ETIMEDOUT, no stream wait,
 * the stream idle, no acknowledgement written even once the bytes land;
 * the retry then succeeds once, with the right bytes, and only once.
 */
static void test_fabric_pending_consume_times_out_then_retries_once(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    long w;

    pending_setup(f, &p, 200, 21);
    assert_true(info(&p.d).stream_ordered);
    w = stream_waits();
    consume_times_out(f, &p);
    expect_timeout_message(&p.d, 200);
    expect_nothing_queued(w, p.s2);
    open_gate(f, &p.g);
    /* Landed now; the timed-out call acknowledged nothing. */
    assert_int_equal(table_word(f, &p.d, 0), info(&p.d).generation);
    expect_not_acked(f, &p.d);
    assert_int_equal(vmmt_pool_drain(f->pool, 50), VMMT_ETIMEDOUT);
    /* The retry: no wait needed (the row shows it landed). */
    w = stream_waits();
    assert_vmmt_ok(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    assert_int_equal(stream_waits(), w);
    sync_s(p.s2);
    expect(f, f->dst, N, 21);
    assert_vmmt_ok(vmmt_consumer_check(p.k, &p.d));
    assert_int_equal(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    assert_int_equal(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    finish_recycled(f, &p, 1);
}

/* Attack 2: the same through vmmt_consumer_ack (a dropped request). */
static void test_fabric_pending_ack_times_out_then_retries_once(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    long w;

    pending_setup(f, &p, 150, 22);
    w = stream_waits();
    assert_int_equal(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ETIMEDOUT);
    expect_timeout_message(&p.d, 150);
    expect_nothing_queued(w, p.s2);
    /* Twice: still nothing recorded by the first. */
    assert_int_equal(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ETIMEDOUT);
    open_gate(f, &p.g);
    expect_not_acked(f, &p.d);
    w = stream_waits();
    assert_vmmt_ok(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0));
    assert_int_equal(stream_waits(), w);
    assert_int_equal(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    assert_int_equal(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    sync_s(p.s2);
    finish_recycled(f, &p, 1);
}

/*
 * Attack 3: bytes that landed before the consume (FABRIC, stream-ordered
 * and AUTO; a POSIX_FD pool with a device table) queue no stream wait,
 * neither for a consume nor for an acknowledgement.
 */
static void landed_no_wait(struct fixture *f, vmmt_consumer *k)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d1, d2;
    long w;

    put(f, f->src, N, 23);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d2));
    sync_s(f->stream);
    w = stream_waits();
    assert_vmmt_ok(vmmt_consume(k, &d1, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_consumer_ack(k, &d2, 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(stream_waits(), w);
    sync_s(f->stream);
    expect(f, f->dst, N, 23);
    assert_vmmt_ok(vmmt_consumer_check(k, &d1));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_fabric_landed_queues_no_stream_wait(void **state)
{
    struct fixture *f = *state;
    /* A landed buffer needs no wait: the stream-wait count says so. Not a
     * 1 ms timeout, which the import's own reads can exceed under
     * ThreadSanitizer (CI, 2026-12-02: "reading the producer's control
     * table took more than 1 ms"). */
    vmmt_consumer *k = fabric_setup(f, 1, 0, 5000, NULL);

    landed_no_wait(f, k);
    vmmt_consumer_destroy(k);
}

static void test_fabric_auto_handoff_landed_queues_no_stream_wait(void **state)
{
    struct fixture *f = *state;

    need_device_emu();
    make_fabric_pool(f, 1, VMMT_HANDOFF_AUTO, 0);
    landed_no_wait(f, f->consumer);
}

static void test_fabric_sync_handoff_queues_no_stream_wait(void **state)
{
    struct fixture *f = *state;

    need_device_emu();
    make_fabric_pool(f, 1, VMMT_HANDOFF_SYNC, 0);
    landed_no_wait(f, f->consumer);
}

/* A POSIX_FD pool with a device table, stream-ordered. */
static void make_posix_device_table_pool(struct fixture *f)
{
    vmmt_pool_config c = config(8 * MiB, 1);

    need_device_emu();
    c.device_control_table = 1;
    c.handoff = VMMT_HANDOFF_STREAM;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
}

static void test_posix_device_table_landed_queues_no_stream_wait(void **state)
{
    struct fixture *f = *state;

    make_posix_device_table_pool(f);
    assert_int_equal(stats(f->pool).host_control_table, 0);
    landed_no_wait(f, f->consumer);
}

/*
 * Regression: a POSIX_FD device-table pool (its producer's death is seen
 * through the broker) may still wait on the stream for a pending
 * descriptor, and gets the right bytes.
 */
static void test_posix_device_table_pending_still_stream_ordered(void **state)
{
    struct fixture *f = *state;
    struct gate g;
    CUstream s2;
    vmmt_desc d;

    make_posix_device_table_pool(f);
    s2 = new_stream();
    publish_pending(f, 24, &g, &d);
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0));
    gate_open_later(&g, 20);
    gate_free(&g);
    sync_s(s2);
    expect(f, f->dst, N, 24);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s2);
}

/*
 * Attack 4: a packed group behind a gate. A member that timed out records
 * nothing. Dropping a member that is not the group's last may be recorded
 * at once (the slot is acknowledged only after the last member); it binds
 * the group to its stream ("Packed publish"). The slot is acknowledged once,
 * after the last member, only once the bytes landed, and the pool is not
 * left "half consumed" (evict succeeds).
 */
static void test_fabric_packed_group_behind_gate(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer bufs[3];
    const size_t sz[3] = {N, 3 * N, 2 * N};
    CUdeviceptr at[3];
    uint8_t pid[16];
    vmmt_consumer *k;
    struct gate g;
    CUstream s2;
    vmmt_desc d[3];
    long w;
    int st;

    k = fabric_setup(f, 1, 0, 150, &s2);
    for (int i = 0; i < 3; i++) {
        at[i] = f->src + (CUdeviceptr)i * 64 * 1024;
        put(f, at[i], sz[i], 30 + i);
        bufs[i] = bytes(at[i], sz[i]);
    }
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, bufs, 3, f->stream, d));
    assert_int_equal(info(&d[1]).pack_count, 3);
    w = stream_waits();
    assert_int_equal(vmmt_consume(k, &d[0], 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    expect_timeout_message(&d[0], 150);
    st = vmmt_consumer_ack(k, &d[1], 0, s2, VMMT_ALL_RANKS, 0);
    assert_true(st == VMMT_OK || st == VMMT_ETIMEDOUT);
    assert_int_equal(vmmt_consume(k, &d[2], 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    expect_nothing_queued(w, s2);
    open_gate(f, &g);
    sleep_ms(30);
    assert_int_not_equal(table_word(f, &d[0], 1), info(&d[0]).generation);
    assert_vmmt_ok(vmmt_consume(k, &d[2], 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0));
    sync_s(s2);
    expect_at(f->dst, sz[2], 32);
    /* Not acknowledged while a member is outstanding. */
    sleep_ms(30);
    assert_int_not_equal(table_word(f, &d[0], 1), info(&d[0]).generation);
    assert_vmmt_ok(
        vmmt_consume(k, &d[0], 0, f->dst + 64 * 1024, f->cap - 64 * 1024, s2, VMMT_ALL_RANKS, 0));
    if (st != VMMT_OK) assert_vmmt_ok(vmmt_consumer_ack(k, &d[1], 0, s2, VMMT_ALL_RANKS, 0));
    assert_int_equal(stream_waits(), w);
    sync_s(s2);
    expect_at(f->dst + 64 * 1024, sz[0], 30);
    for (int i = 0; i < 3; i++) {
        if (i != 1) assert_vmmt_ok(vmmt_consumer_check(k, &d[i]));
        assert_int_equal(vmmt_consume(k, &d[i], 0, f->dst, f->cap, s2, VMMT_ALL_RANKS, 0),
                         VMMT_ESTATE);
    }
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    memcpy(pid, info(&d[0]).pool_id, 16);
    assert_vmmt_ok(vmmt_consumer_evict(k, pid, 0));
    assert_int_equal(vmmt_consumer_pool_count(k), 0);
    free_stream(s2);
    vmmt_consumer_destroy(k);
}

/*
 * Member `timed` of a pending packed group times out on one stream; once the
 * bytes land, the whole group is consumed on the stream `other` names (0:
 * a fresh one, 1: the first one's). Nothing the timed-out call did binds a
 * stream or refuses a member.
 */
static void packed_timeout_then_stream(struct fixture *f, int timed, uint32_t pattern)
{
    vmmt_buffer bufs[2];
    vmmt_consumer *k;
    struct gate g;
    CUstream s2, s3;
    vmmt_desc d[2];

    k = fabric_setup(f, 1, 0, 100, &s2);
    s3 = new_stream();
    put(f, f->src, N, pattern);
    put(f, f->src + 64 * 1024, N, pattern + 1);
    bufs[0] = bytes(f->src, N);
    bufs[1] = bytes(f->src + 64 * 1024, N);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, bufs, 2, f->stream, d));
    assert_int_equal(
        vmmt_consume(k, &d[timed], 0, f->dst, f->cap, timed ? s3 : s2, VMMT_ALL_RANKS, 0),
        VMMT_ETIMEDOUT);
    open_gate(f, &g);
    CUstream use = timed ? s2 : s3;
    assert_vmmt_ok(vmmt_consume(k, &d[0], 0, f->dst, f->cap, use, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_consume(k, &d[1], 0, f->dst + 64 * 1024, N, use, VMMT_ALL_RANKS, 0));
    sync_s(use);
    expect_at(f->dst, N, pattern);
    expect_at(f->dst + 64 * 1024, N, pattern + 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(s2);
    free_stream(s3);
    vmmt_consumer_destroy(k);
}

/* Attack 4a: the first member timed out on one stream; the group then on another. */
static void test_fabric_packed_timed_out_member_binds_no_stream(void **state)
{
    packed_timeout_then_stream(*state, 0, 33);
}

/*
 * Attack 4c: every member of a pending group dropped. The last drop is the
 * one that acknowledges: it must wait on the host (ETIMEDOUT while the bytes
 * have not landed, nothing written), and the retry after they land
 * acknowledges once.
 */
static void test_fabric_packed_all_dropped_while_pending(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer bufs[2];
    vmmt_consumer *k;
    struct gate g;
    CUstream s2;
    vmmt_desc d[2];
    long w;
    int st0, st1, acked_early;

    k = fabric_setup(f, 1, 0, 150, &s2);
    bufs[0] = bytes(f->src, N);
    bufs[1] = bytes(f->src + 64 * 1024, N);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, bufs, 2, f->stream, d));
    w = stream_waits();
    st0 = vmmt_consumer_ack(k, &d[0], 0, s2, VMMT_ALL_RANKS, 0);
    st1 = vmmt_consumer_ack(k, &d[1], 0, s2, VMMT_ALL_RANKS, 0);
    expect_nothing_queued(w, s2);
    sleep_ms(50);
    /* Still PENDING: no acknowledgement may be in the table. */
    acked_early = table_word(f, &d[0], 1) == info(&d[0]).generation;
    open_gate(f, &g);
    if (st0 != VMMT_OK) assert_vmmt_ok(vmmt_consumer_ack(k, &d[0], 0, s2, VMMT_ALL_RANKS, 0));
    if (st1 != VMMT_OK) assert_vmmt_ok(vmmt_consumer_ack(k, &d[1], 0, s2, VMMT_ALL_RANKS, 0));
    sync_s(s2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    free_stream(s2);
    vmmt_consumer_destroy(k);
    assert_false(acked_early);
    assert_true(st0 == VMMT_OK || st0 == VMMT_ETIMEDOUT);
    assert_int_equal(st1, VMMT_ETIMEDOUT);
}

/*
 * Attack 4b: a packed group whose first member was consumed on one stream
 * once it landed, a later member timing out first on another stream is not
 * a reason to refuse the group's members on their own stream afterwards.
 */
static void test_fabric_packed_member_times_out_on_other_stream(void **state)
{
    packed_timeout_then_stream(*state, 1, 35);
}

/* A consume or acknowledgement run on another thread. */
struct bg {
    vmmt_consumer *k;
    const vmmt_desc *d;
    CUdeviceptr dst;
    uint64_t cap;
    CUstream s;
    int ack; /* vmmt_consumer_ack instead of vmmt_consume */
    int rank_first, rank_count;
    int status;
    int done; /* set (atomically) once the call returned */
    char message[1024];
    pthread_t t;
};

static void *bg_run(void *arg)
{
    struct bg *b = arg;

    if (b->ack)
        b->status = vmmt_consumer_ack(b->k, b->d, 0, b->s, b->rank_first, b->rank_count);
    else
        b->status = vmmt_consume(b->k, b->d, 0, b->dst, b->cap, b->s, b->rank_first, b->rank_count);
    snprintf(b->message, sizeof b->message, "%s", vmmt_last_error());
    __atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void bg_start_ranks(struct bg *b, vmmt_consumer *k, const vmmt_desc *d, CUdeviceptr dst,
                           uint64_t cap, CUstream s, int ack, int rank_first, int rank_count)
{
    memset(b, 0, sizeof *b);
    b->k = k;
    b->d = d;
    b->dst = dst;
    b->cap = cap;
    b->s = s;
    b->ack = ack;
    b->rank_first = rank_first;
    b->rank_count = rank_count;
    assert_int_equal(pthread_create(&b->t, NULL, bg_run, b), 0);
}

static void bg_start(struct bg *b, vmmt_consumer *k, const vmmt_desc *d, CUdeviceptr dst,
                     uint64_t cap, CUstream s, int ack)
{
    bg_start_ranks(b, k, d, dst, cap, s, ack, VMMT_ALL_RANKS, 0);
}

static int bg_join(struct bg *b)
{
    assert_int_equal(pthread_join(b->t, NULL), 0);
    return b->status;
}

/*
 * Attack 5: cancel while a host wait runs on another thread. vmmt_cancel:
 * "From the moment it returns every consumer refuses the descriptor". The
 * gate opens only after the cancel returned, so no consume could have seen
 * the bytes land before it: OK is never right here. Expected: ESTATE (the
 * word moved to RETIRED), or ETIMEDOUT if the cancel cannot be seen while
 * PENDING; nothing queued; the slot recycled; the descriptor refused after.
 * DEFECT (found by the attack, fixed since; this holds it): both return VMMT_OK. The cancel marks
 * the slot's ack words while the copy is queued (check_occupant refuses a later consume for that),
 * but host_wait then watches only the ready word: once the bytes land it returns OK and the call
 * copies (or acknowledges) a cancelled descriptor, without reading the ack words again. Observed:
 * VMMT_OK (check OK); expected VMMT_ESTATE.
 */
static void cancel_during_wait(struct fixture *f, int ack)
{
    struct pending p;
    struct bg bg;
    long w;
    int st, check = -1, again;

    pending_setup(f, &p, 3000, 40);
    w = stream_waits();
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, ack);
    sleep_ms(200); /* most likely in its host wait by now; any order must hold */
    assert_vmmt_ok(vmmt_cancel(f->pool, &p.d));
    gate_open_later(&p.g, 0); /* the bytes land after the cancel returned */
    st = bg_join(&bg);
    gate_free(&p.g);
    sync_s(f->stream);
    sync_s(p.s2);
    if (st == VMMT_OK) check = vmmt_consumer_check(p.k, &p.d);
    again = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    sync_s(p.s2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
    assert_int_equal(stats(f->pool).cancelled, 1);
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
    if (st == VMMT_OK)
        fail_msg("DEFECT: a %s waiting on the host while vmmt_cancel returned (the bytes landed "
                 "only after the cancel) got VMMT_OK, and vmmt_consumer_check said %d; "
                 "expected VMMT_ESTATE (or VMMT_ETIMEDOUT)",
                 ack ? "vmmt_consumer_ack" : "vmmt_consume", check);
    if (st != VMMT_ESTATE && st != VMMT_ETIMEDOUT)
        fail_msg("unexpected status %d: %s", st, bg.message);
    assert_int_equal(again, VMMT_ESTATE);
    assert_true(stream_waits() == w || w < 0);
}

static void test_fabric_cancel_during_host_wait_consume(void **state)
{
    cancel_during_wait(*state, 0);
}

static void test_fabric_cancel_during_host_wait_ack(void **state)
{
    cancel_during_wait(*state, 1);
}

/*
 * Attack 5c: the same race made harmful. The consumer's stream is held, so
 * the copy the late consume queued is still pending when the cancelled
 * slice is handed to the next publish (the cancel frees it once its copy
 * landed, without waiting for any consumer). If the consume says OK, the
 * copy reads the next buffer's bytes, and vmmt_consumer_check must say so
 * (VMMT_EFAILED); OK from both with the next buffer's bytes is wrong bytes
 * with VMMT_OK.
 * DEFECT (found by the attack, fixed since; this holds it): the consume returns VMMT_OK and its
 * copy reads the next buffer's bytes; only vmmt_consumer_check (VMMT_EFAILED), which vmmt.h asks
 * for "wherever producers may die" (this producer is alive), says so. Expected: VMMT_ESTATE from
 * the consume, nothing copied.
 */
static uint64_t desc_offset(const vmmt_desc *d)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | d->bytes[288 + i];
    return v;
}

static void test_fabric_cancel_during_host_wait_slice_reused(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c;
    vmmt_buffer b1, b2;
    struct pending p;
    struct gate held;
    struct bg bg;
    vmmt_desc d2;
    size_t n;
    int st, check = -1, pub = VMMT_EFULL, right_bytes = -1;
    uint8_t *h;

    need_device_emu();
    fabric_env();
    c = config(2 * MiB, 1);
    c.handle_type = VMMT_HANDLE_FABRIC;
    c.allow_posix_fallback = 0;
    c.handoff = VMMT_HANDOFF_STREAM;
    c.max_slices = 4;
    c.recycle_interval_us = 1000;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    /* More than half the data region: two slices can never coexist. */
    n = (size_t)(stats(f->pool).data_bytes * 6 / 10) & ~(size_t)4095;
    p.k = make_consumer(3000);
    p.s2 = new_stream();
    put(f, f->src, n, 80);
    put(f, f->src + 4 * MiB, n, 81);
    b1 = bytes(f->src, n);
    b2 = bytes(f->src + 4 * MiB, n);
    gate_close(&held, p.s2); /* the consumer's copy will stay queued */
    gate_close(&p.g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b1, f->stream, &p.d));
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, 0);
    sleep_ms(200);
    assert_vmmt_ok(vmmt_cancel(f->pool, &p.d));
    gate_open_later(&p.g, 0);
    st = bg_join(&bg);
    gate_free(&p.g);
    sync_s(f->stream);
    /* The next publish gets the cancelled slice as soon as the recycler frees it. */
    for (int i = 0; i < 1000 && pub == VMMT_EFULL; i++) {
        pub = vmmt_publish(f->pool, &b2, f->stream, &d2);
        if (pub == VMMT_EFULL) sleep_ms(5);
    }
    assert_vmmt_ok(pub);
    assert_int_equal(desc_offset(&d2), desc_offset(&p.d));
    sync_s(f->stream);
    gate_open_later(&held, 0);
    gate_free(&held);
    sync_s(p.s2);
    if (st == VMMT_OK) {
        check = vmmt_consumer_check(p.k, &p.d);
        h = malloc(n);
        assert_int_equal(drv()->cuMemcpyDtoHAsync(h, f->dst, n, p.s2), CUDA_SUCCESS);
        sync_s(p.s2);
        right_bytes = tu_pattern_check(h, n, 80) == n;
        free(h);
    }
    assert_vmmt_ok(vmmt_consume(f->consumer, &d2, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    sync_s(p.s2);
    expect(f, f->dst, n, 81);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
    if (st == VMMT_OK && check == VMMT_OK && !right_bytes)
        fail_msg("DEFECT: wrong bytes with VMMT_OK: a consume racing vmmt_cancel returned OK, "
                 "its copy read the next buffer's bytes, and vmmt_consumer_check said OK");
    if (st == VMMT_OK)
        fail_msg("DEFECT: a consume waiting on the host while vmmt_cancel returned got VMMT_OK "
                 "(check %d, bytes %s); expected VMMT_ESTATE",
                 check, right_bytes ? "the cancelled buffer's" : "the next buffer's");
    assert_true(st == VMMT_ESTATE || st == VMMT_ETIMEDOUT);
}

/*
 * Attack 5b: the cancel while the gate stays closed for the whole wait: the
 * host wait ends (ESTATE or ETIMEDOUT, never OK), nothing queued.
 */
static void test_fabric_cancel_pending_gate_closed(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    struct bg bg;
    int st;

    pending_setup(f, &p, 600, 41);
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, 0);
    sleep_ms(100);
    assert_vmmt_ok(vmmt_cancel(f->pool, &p.d));
    st = bg_join(&bg);
    print_message("wait across a cancel: %d (%s)\n", st, bg.message);
    assert_true(st == VMMT_ESTATE || st == VMMT_ETIMEDOUT);
    assert_int_equal(drv()->cuStreamQuery(p.s2), CUDA_SUCCESS);
    assert_int_equal(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    open_gate(f, &p.g);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
}

/*
 * Attack 6: the producer's pool is shut down and destroyed while a consume
 * of a pending descriptor waits on the host. Expected: the wait ends within
 * the consumer's timeout (ETIMEDOUT) or sooner (ECLOSED), nothing queued;
 * a later consume is refused or, if the bytes are there, right.
 */
struct destroyer {
    vmmt_pool *pool;
    pthread_t t;
};

static void *destroy_run(void *arg)
{
    struct destroyer *x = arg;
    vmmt_pool_destroy(x->pool);
    return NULL;
}

static void test_fabric_pool_destroyed_during_host_wait(void **state)
{
    struct fixture *f = *state;
    struct destroyer x;
    struct pending p;
    struct bg bg;
    int st;

    p.k = fabric_setup(f, 1, 10000, 400, &p.s2);
    publish_pending(f, 42, &p.g, &p.d);
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, 0);
    sleep_ms(50);
    /* The destroy waits for the gated publish (its shutdown bound is 10 s). */
    x.pool = f->pool;
    f->pool = NULL;
    assert_int_equal(pthread_create(&x.t, NULL, destroy_run, &x), 0);
    st = bg_join(&bg);
    print_message("wait while the pool is destroyed: %d (%s)\n", st, bg.message);
    if (st != VMMT_ETIMEDOUT && st != VMMT_ECLOSED) fail_msg("status %d: %s", st, bg.message);
    assert_int_equal(drv()->cuStreamQuery(p.s2), CUDA_SUCCESS);
    gate_open_later(&p.g, 0);
    gate_free(&p.g);
    assert_int_equal(pthread_join(x.t, NULL), 0);
    sync_s(f->stream);
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    print_message("consume after the destroy: %d (%s)\n", st, st ? vmmt_last_error() : "");
    if (st == VMMT_OK) {
        sync_s(p.s2);
        if (vmmt_consumer_check(p.k, &p.d) == VMMT_OK) expect(f, f->dst, N, 42);
    } else {
        assert_true(st == VMMT_ECLOSED || st == VMMT_ESTATE || st == VMMT_ETIMEDOUT);
        assert_int_equal(drv()->cuStreamQuery(p.s2), CUDA_SUCCESS);
    }
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
}

/*
 * Attack 6b: the pool is destroyed while a copy is still gated and the
 * consumer then waits: the ready word never lands for it.
 */
static void test_fabric_consume_after_pool_destroyed_pending(void **state)
{
    struct fixture *f = *state;
    struct destroyer x;
    struct pending p;
    int st;

    p.k = fabric_setup(f, 1, 10000, 300, &p.s2);
    /* Import first (a landed descriptor), so the pool is mapped here. */
    import_first(f, p.k, p.s2, 43, 0);
    publish_gated(f, &p.g, &p.d);
    x.pool = f->pool;
    f->pool = NULL;
    assert_int_equal(pthread_create(&x.t, NULL, destroy_run, &x), 0);
    sleep_ms(50);
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    print_message("consume after a destroy began: %d (%s)\n", st, vmmt_last_error());
    if (st != VMMT_ETIMEDOUT && st != VMMT_ECLOSED)
        fail_msg("status %d: %s", st, vmmt_last_error());
    assert_int_equal(drv()->cuStreamQuery(p.s2), CUDA_SUCCESS);
    gate_open_later(&p.g, 0);
    gate_free(&p.g);
    assert_int_equal(pthread_join(x.t, NULL), 0);
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
}

/*
 * Attack 7: timeout_ms edges. 0 is the default 5000 (vmmt.h), not "no wait":
 * a gate opened after 300 ms must be waited for. Negative is EINVAL.
 * INT_MAX and 3000000 must not overflow into an instant timeout.
 */
static void waits_for_late_bytes(struct fixture *f, int timeout_ms, uint32_t pattern)
{
    struct pending p;
    long w;
    int st;

    pending_setup(f, &p, timeout_ms, pattern);
    w = stream_waits();
    gate_open_later(&p.g, 300);
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    if (st != VMMT_OK) {
        gate_free(&p.g);
        fail_msg("timeout_ms=%d: %d after a 300 ms gate: %s", timeout_ms, st, vmmt_last_error());
    }
    gate_free(&p.g);
    assert_int_equal(stream_waits(), w);
    sync_s(p.s2);
    expect(f, f->dst, N, pattern);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
}

static void test_fabric_timeout_zero_is_default(void **state)
{
    waits_for_late_bytes(*state, 0, 50);
}

static void test_fabric_timeout_int_max(void **state)
{
    waits_for_late_bytes(*state, INT_MAX, 51);
}

static void test_fabric_timeout_3e6(void **state)
{
    waits_for_late_bytes(*state, 3000000, 52);
}

static void test_fabric_timeout_1ms(void **state)
{
    struct fixture *f = *state;
    struct pending p;

    /* With 1 ms, the import's own control-table reads may be what runs out
     * first under ThreadSanitizer (CI, 2026-12-02): VMMT_ETIMEDOUT either
     * way, nothing queued; the retry goes through a consumer of the default
     * timeout, which the import can always meet. */
    pending_setup(f, &p, 1, 53);
    consume_times_out(f, &p);
    assert_int_equal(vmmt_consumer_ack(p.k, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ETIMEDOUT);
    assert_int_equal(drv()->cuStreamQuery(p.s2), CUDA_SUCCESS);
    open_gate(f, &p.g);
    vmmt_consumer_destroy(p.k);
    consume_and_finish(f, make_consumer(5000), &p.d, p.s2, 53);
}

static void test_consumer_timeout_negative_refused(void **state)
{
    vmmt_consumer_config cc;
    vmmt_consumer *k = NULL;

    (void)state;
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = -1;
    assert_int_equal(vmmt_consumer_create(&cc, &k), VMMT_EINVAL);
    assert_null(k);
    assert_error_contains("timeout_ms");
    cc.timeout_ms = INT_MIN;
    assert_int_equal(vmmt_consumer_create(&cc, &k), VMMT_EINVAL);
    assert_null(k);
}

/*
 * Attack 8: two ranks of one pool, consumed by two threads of one consumer
 * on two streams, both waiting on the host for the same occupant: both get
 * the right bytes, the slot is acknowledged once per rank and recycled.
 */
static void test_fabric_two_ranks_wait_together(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    struct bg b0, b1;
    CUstream s3;

    p.k = fabric_setup(f, 2, 0, 8000, &p.s2);
    s3 = new_stream();
    publish_pending(f, 60, &p.g, &p.d);
    bg_start_ranks(&b0, p.k, &p.d, f->dst, N, p.s2, 0, 0, 1);
    bg_start_ranks(&b1, p.k, &p.d, f->dst + 64 * 1024, N, s3, 0, 1, 1);
    sleep_ms(200);
    gate_open_later(&p.g, 0);
    if (bg_join(&b0) != VMMT_OK) fail_msg("rank 0: %d: %s", b0.status, b0.message);
    if (bg_join(&b1) != VMMT_OK) fail_msg("rank 1: %d: %s", b1.status, b1.message);
    gate_free(&p.g);
    sync_s(p.s2);
    sync_s(s3);
    expect_at(f->dst, N, 60);
    expect_at(f->dst + 64 * 1024, N, 60);
    assert_vmmt_ok(vmmt_consumer_check(p.k, &p.d));
    assert_int_equal(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, 0, 1), VMMT_ESTATE);
    assert_int_equal(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, 1, 1), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    free_stream(p.s2);
    free_stream(s3);
    vmmt_consumer_destroy(p.k);
}

/*
 * Attack 9: a timed-out descriptor poisons nothing else of the pool: a
 * landed one is consumed at once, before and after.
 */
static void test_fabric_timeout_leaves_other_descriptors_alone(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    struct pending p;
    vmmt_desc d1, d2, d3;

    p.k = fabric_setup(f, 1, 0, 100, &p.s2);
    put(f, f->src, N, 70);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d3));
    sync_s(f->stream);
    gate_close(&p.g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d2));
    assert_int_equal(vmmt_consume(p.k, &d2, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    assert_vmmt_ok(vmmt_consume(p.k, &d1, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    sync_s(p.s2);
    expect_at(f->dst, N, 70); /* f->stream is gated */
    assert_int_equal(vmmt_consumer_ack(p.k, &d2, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ETIMEDOUT);
    assert_vmmt_ok(vmmt_consumer_ack(p.k, &d3, 0, p.s2, VMMT_ALL_RANKS, 0));
    open_gate(f, &p.g);
    assert_vmmt_ok(vmmt_consume(p.k, &d2, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    sync_s(p.s2);
    expect(f, f->dst, N, 70);
    finish_recycled(f, &p, 3);
}

/*
 * Attack 10: after one consumer timed out, another (another process of the
 * rank, after the first gave up) consumes it; the first's retry is then
 * refused (ESTATE, "any of the ranks asked for has already consumed or
 * acknowledged, in this process or any other"), never a second
 * acknowledgement or copy.
 */
static void test_fabric_retry_after_another_consumer_took_it(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer *k1, *k2;
    struct pending p;

    k1 = fabric_setup(f, 1, 0, 100, &p.s2);
    k2 = make_consumer(5000);
    publish_pending(f, 71, &p.g, &p.d);
    assert_int_equal(vmmt_consume(k1, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ETIMEDOUT);
    open_gate(f, &p.g);
    assert_vmmt_ok(vmmt_consume(k2, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    sync_s(p.s2);
    expect(f, f->dst, N, 71);
    assert_true(wait_acked(f, &p.d, 0));
    assert_int_equal(vmmt_consume(k1, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0),
                     VMMT_ESTATE);
    assert_int_equal(vmmt_consumer_ack(k1, &p.d, 0, p.s2, VMMT_ALL_RANKS, 0), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    vmmt_consumer_destroy(k1);
    vmmt_consumer_destroy(k2);
}

/*
 * Attack 11: evict from another thread while a host wait runs. vmmt.h:
 * VMMT_ESTATE "while a call uses it"; OK only if the wait had not begun.
 * Either way the wait ends as it would and nothing breaks.
 */
static void test_fabric_evict_during_host_wait(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    struct bg bg;
    int st, ev;

    imported_pending_setup(f, &p, 1500, 72);
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, 0);
    sleep_ms(300);
    ev = vmmt_consumer_evict(p.k, info(&p.d).pool_id, 0);
    st = bg_join(&bg);
    assert_true(ev == VMMT_ESTATE || ev == VMMT_OK);
    if (st != VMMT_ETIMEDOUT) fail_msg("status %d (evict %d): %s", st, ev, bg.message);
    retry_after_failure(f, &p, 72);
}

/*
 * Attack 12: the host wait's row read fails (a driver error, not a timeout):
 * an error naming the cause, nothing queued, nothing acknowledged, and the
 * retry works once the driver does.
 */
static void test_fabric_row_read_fails_during_wait(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    long w;
    int st;

    imported_pending_setup(f, &p, 300, 73);
    w = stream_waits();
    emu_fail("cuMemcpyDtoHAsync:*:CUDA_ERROR_UNKNOWN");
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    setenv("VMMT_EMU_FAIL", "", 1);
    vmmt__emu_configure();
    assert_int_not_equal(st, VMMT_OK);
    assert_int_equal(stream_waits(), 0); /* configure reset the counters: none since */
    (void)w;
    retry_after_failure(f, &p, 73);
}

/*
 * Attack 13: the consumer destroyed right after a timeout, with the gate
 * still closed: nothing of it waits (no copy queued), it does not hang, and
 * no acknowledgement is written later for it.
 */
static void test_fabric_destroy_consumer_after_timeout(void **state)
{
    struct fixture *f = *state;
    struct pending p;

    pending_setup(f, &p, 100, 74);
    consume_times_out(f, &p);
    vmmt_consumer_destroy(p.k);
    open_gate(f, &p.g);
    expect_not_acked(f, &p.d);
    /* A fresh consumer (a restarted process) still gets it. */
    consume_and_finish(f, f->consumer, &p.d, p.s2, 74);
}

/*
 * Attack 14: the caller's stream is busy with earlier work of its own (held
 * by a gate the test opens only afterwards). A landed descriptor is queued
 * behind that work and returns at once; a pending one times out within
 * timeout_ms: the host wait must not read the row on, or synchronize, the
 * caller's stream (it would then wait for the caller's own work, and on
 * the emulator fail the stream after 10 s).
 */
static void busy_stream(struct fixture *f, int pending)
{
    vmmt_buffer b = bytes(f->src, N);
    struct pending p;
    struct gate held;
    int st;

    p.k = fabric_setup(f, 1, 0, 200, &p.s2);
    import_first(f, p.k, p.s2, 90, 1); /* on an idle stream */
    if (pending) gate_close(&p.g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &p.d));
    if (!pending) sync_s(f->stream);
    gate_close(&held, p.s2);
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0);
    gate_open_later(&held, 0);
    gate_free(&held); /* asserts p.s2 did not fail */
    if (pending) {
        assert_int_equal(st, VMMT_ETIMEDOUT);
        open_gate(f, &p.g);
        assert_vmmt_ok(vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, p.s2, VMMT_ALL_RANKS, 0));
    } else {
        assert_vmmt_ok(st);
    }
    sync_s(p.s2);
    expect(f, f->dst, N, 90);
    assert_vmmt_ok(vmmt_consumer_check(p.k, &p.d));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    vmmt_consumer_destroy(p.k);
}

static void test_fabric_busy_consumer_stream_landed(void **state)
{
    busy_stream(*state, 0);
}

static void test_fabric_busy_consumer_stream_pending(void **state)
{
    busy_stream(*state, 1);
}

/*
 * Attack 15: during the host wait the word moves to ABANDONED (another
 * consumer saw the producer die and repaired the word; docs/descriptor.md,
 * "a word that moves to anything but d ... refuses"): the wait ends with
 * VMMT_ECLOSED at once, not OK and not after the whole timeout, nothing
 * queued, nothing acknowledged.
 */
static void test_fabric_abandoned_during_host_wait(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    struct bg bg;
    CUstream s3;
    uint32_t gen;
    long w;
    int st;

    p.k = fabric_setup(f, 1, 0, 30000, &p.s2);
    s3 = new_stream();
    publish_pending(f, 91, &p.g, &p.d);
    gen = info(&p.d).generation;
    w = stream_waits();
    bg_start(&bg, p.k, &p.d, f->dst, f->cap, p.s2, 0);
    sleep_ms(200);
    assert_int_equal(drv()->cuStreamWriteValue32(
                         s3, vmmt__ctrl_ready(f->pool->ctrl_dev, f->pool->stride, info(&p.d).slot),
                         gen + 2, CU_STREAM_WRITE_VALUE_DEFAULT),
                     CUDA_SUCCESS);
    sync_s(s3);
    st = bg_join(&bg); /* 30 s would be the timeout; the word ends it */
    expect_nothing_queued(w, p.s2);
    assert_int_not_equal(table_word(f, &p.d, 1), gen);
    open_gate(f, &p.g);
    /* The live producer's copy then writes LIVE; hand the slot back for the teardown. */
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    free_stream(p.s2);
    free_stream(s3);
    vmmt_consumer_destroy(p.k);
    if (st != VMMT_ECLOSED) fail_msg("status %d, expected VMMT_ECLOSED: %s", st, bg.message);
}

/*
 * Attack 16: the timeout's message. vmmt.h: a failure "says what was asked,
 * what was found and what to do". It names the generation asked for, what
 * the word reads and how long it waited.
 * DEFECT (found by the attack, fixed since; this holds it): what to do is only "is the producer
 * alive?": it does not say that nothing was queued or acknowledged and the call may be retried
 * (vmmt.h documents exactly that), nor that the descriptor may be dropped; nor which pool and slot.
 * Observed: "vmmt_consume: the producer's ready flag did not reach generation 5 within 200 ms (it
 * reads 4); is the producer alive?". Expected: also "retry" (and the slot).
 */
static void test_fabric_timeout_message_says_what_to_do(void **state)
{
    struct fixture *f = *state;
    struct pending p;
    char msg[1024], slot[48];
    int st;

    p.k = fabric_setup(f, 1, 0, 100, NULL); /* consumed on f->stream */
    publish_pending(f, 92, &p.g, &p.d);
    st = vmmt_consume(p.k, &p.d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0);
    snprintf(msg, sizeof msg, "%s", vmmt_last_error());
    open_gate(f, &p.g);
    assert_vmmt_ok(vmmt_consumer_ack(p.k, &p.d, 0, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(p.k);
    assert_int_equal(st, VMMT_ETIMEDOUT);
    assert_non_null(strstr(msg, "generation"));
    snprintf(slot, sizeof slot, "slot %u", info(&p.d).slot);
    if (strstr(msg, "retr") == NULL || strstr(msg, slot) == NULL)
        fail_msg("DEFECT: the timeout's message says no \"what to do\" beyond a question, "
                 "nor which slot: %s",
                 msg);
}

static int bg_done(struct bg *b)
{
    return __atomic_load_n(&b->done, __ATOMIC_ACQUIRE);
}

/* Wait (at most 60 s) until `want` or `other` returned; 1 if `want` was first. */
static int returned_first(struct bg *want, struct bg *other)
{
    for (int i = 0; i < 12000; i++) {
        if (bg_done(want)) return 1;
        if (bg_done(other)) return bg_done(want);
        sleep_ms(5);
    }
    return 0;
}

/*
 * Attack 17: one pending FABRIC descriptor's host wait must not hold up
 * other calls. Thread A waits (timeout 6 s, the gate stays closed) for a
 * descriptor whose bytes have not landed; 300 ms later thread C consumes a
 * descriptor of the same pool whose bytes landed long ago (no wait at all,
 * vmmt.h); and, in the second test, thread D then consumes from another
 * pool (POSIX_FD, shared table) of the same consumer. Expected: C (and D)
 * return while A still waits: the gate opens once they returned, and A
 * must then get its bytes (VMMT_OK) rather than have timed out already. No
 * timing assertion: more than 5 s of slack.
 * DEFECT (found by the attack, fixed since; this holds it): host_wait holds the import's poll_lock
 * for its whole wait, and check_occupant (load_row) takes that lock to read the row of a landed
 * descriptor while prepare() holds the consumer's lock: C waits for A's
 * timeout, and D, on a pool that has nothing to do with it, waits for C.
 * Observed: C and D return only after A's 6 s timeout; expected: at once.
 */
static void host_wait_holds_up(struct fixture *f, int other_pool)
{
    vmmt_buffer b = bytes(f->src, N);
    vmmt_pool_config pc;
    vmmt_pool *p2 = NULL;
    vmmt_consumer *k;
    struct bg a, cc, dd;
    struct gate g;
    CUstream s2, s3, s4;
    vmmt_desc d1, d3, d4;
    int c_first = 1, d_first = 1, st_a;

    need_device_emu();
    /* The gate below may stay closed past the emulator's default 10 s limit. */
    setenv("VMMT_EMU_WAIT_TIMEOUT_MS", "60000", 1);
    make_fabric_pool(f, 1, VMMT_HANDOFF_STREAM, 0);
    if (other_pool) {
        pc = config(8 * MiB, 1);
        pc.handle_type = VMMT_HANDLE_POSIX_FD;
        assert_vmmt_ok(vmmt_pool_create(&pc, &p2));
    }
    k = make_consumer(6000);
    s2 = new_stream();
    s3 = new_stream();
    s4 = new_stream();
    put(f, f->src, N, 95);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d3));
    if (other_pool) assert_vmmt_ok(vmmt_publish(p2, &b, f->stream, &d4));
    sync_s(f->stream);
    /* Import both pools first, so no import is part of what is measured. */
    if (other_pool) {
        vmmt_desc d5;
        assert_vmmt_ok(vmmt_publish(p2, &b, f->stream, &d5));
        sync_s(f->stream);
        assert_vmmt_ok(vmmt_consumer_ack(k, &d5, 0, s4, VMMT_ALL_RANKS, 0));
    }
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d1));
    bg_start(&a, k, &d1, f->dst, N, s2, 0);
    sleep_ms(300);
    bg_start(&cc, k, &d3, f->dst + 64 * 1024, N, s3, 0);
    if (other_pool) {
        sleep_ms(300);
        bg_start(&dd, k, &d4, f->dst + 128 * 1024, N, s4, 0);
        d_first = returned_first(&dd, &a);
    } else {
        c_first = returned_first(&cc, &a);
    }
    /* A's bytes land as soon as C (or D) returned: A, still waiting, gets them. */
    gate_open_later(&g, 0);
    st_a = bg_join(&a);
    if (st_a != VMMT_OK) { /* A had timed out by then */
        if (other_pool)
            d_first = 0;
        else
            c_first = 0;
    }
    assert_int_equal(bg_join(&cc), VMMT_OK);
    if (other_pool) assert_int_equal(bg_join(&dd), VMMT_OK);
    gate_free(&g);
    sync_s(f->stream);
    sync_s(s3);
    sync_s(s4);
    expect_at(f->dst + 64 * 1024, N, 95);
    if (other_pool) expect_at(f->dst + 128 * 1024, N, 95);
    if (st_a == VMMT_ETIMEDOUT)
        assert_vmmt_ok(vmmt_consume(k, &d1, 0, f->dst, N, s2, VMMT_ALL_RANKS, 0));
    else
        assert_vmmt_ok(st_a);
    sync_s(s2);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    if (other_pool) assert_vmmt_ok(vmmt_pool_drain(p2, 5000));
    free_stream(s2);
    free_stream(s3);
    free_stream(s4);
    vmmt_consumer_destroy(k);
    vmmt_pool_destroy(p2);
    unsetenv("VMMT_EMU_WAIT_TIMEOUT_MS");
    vmmt__emu_configure();
    if (!c_first)
        fail_msg("DEFECT: a consume of a landed descriptor of the same FABRIC pool returned "
                 "only after another thread's host wait (pending descriptor, timeout_ms "
                 "6000) ended%s",
                 st_a == VMMT_ETIMEDOUT ? " by its timeout" : "");
    if (!d_first)
        fail_msg("DEFECT: a consume from another pool (POSIX_FD) of the same consumer returned "
                 "only after a FABRIC host wait ended");
}

static void test_fabric_host_wait_holds_up_landed_same_pool(void **state)
{
    host_wait_holds_up(*state, 0);
}

static void test_fabric_host_wait_holds_up_other_pool(void **state)
{
    host_wait_holds_up(*state, 1);
}

/* One test alone: test_attack_fabric_wait PATTERN (cmocka's filter). */
int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        T(test_fabric_pending_consume_times_out_then_retries_once),
        T(test_fabric_pending_ack_times_out_then_retries_once),
        T(test_fabric_landed_queues_no_stream_wait),
        T(test_fabric_auto_handoff_landed_queues_no_stream_wait),
        T(test_fabric_sync_handoff_queues_no_stream_wait),
        T(test_posix_device_table_landed_queues_no_stream_wait),
        T(test_posix_device_table_pending_still_stream_ordered),
        T(test_fabric_packed_group_behind_gate),
        T(test_fabric_packed_member_times_out_on_other_stream),
        T(test_fabric_packed_timed_out_member_binds_no_stream),
        T(test_fabric_packed_all_dropped_while_pending),
        T(test_fabric_cancel_during_host_wait_consume),
        T(test_fabric_cancel_during_host_wait_ack),
        T(test_fabric_cancel_pending_gate_closed),
        T(test_fabric_cancel_during_host_wait_slice_reused),
        T(test_fabric_pool_destroyed_during_host_wait),
        T(test_fabric_consume_after_pool_destroyed_pending),
        T(test_fabric_timeout_zero_is_default),
        T(test_fabric_timeout_int_max),
        T(test_fabric_timeout_3e6),
        T(test_fabric_timeout_1ms),
        T(test_consumer_timeout_negative_refused),
        T(test_fabric_two_ranks_wait_together),
        T(test_fabric_timeout_leaves_other_descriptors_alone),
        T(test_fabric_retry_after_another_consumer_took_it),
        T(test_fabric_evict_during_host_wait),
        T(test_fabric_row_read_fails_during_wait),
        T(test_fabric_destroy_consumer_after_timeout),
        T(test_fabric_busy_consumer_stream_landed),
        T(test_fabric_busy_consumer_stream_pending),
        T(test_fabric_abandoned_during_host_wait),
        T(test_fabric_timeout_message_says_what_to_do),
        T(test_fabric_host_wait_holds_up_landed_same_pool),
        T(test_fabric_host_wait_holds_up_other_pool),
    };
    if (argc > 1) cmocka_set_test_filter(argv[1]);
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
