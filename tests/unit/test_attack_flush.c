/*
 * An outside attack on vmmt_consumer_flush, written from include/vmmt.h and
 * the docs alone: flush at any time, from any thread, beside consumes, acks,
 * checks, evicts, the consumer's own acknowledgement thread, a producer's
 * reclaim, release, shutdown or death, injected driver failures, device
 * control tables, packed publishes and a second device. What must hold: no
 * OK for another buffer's bytes, no slice recycled under a copy still queued,
 * no acknowledgement lost (drain times out), no wait for a running copy, no
 * crash or leak (the fixture's teardown counts fds, mappings and threads),
 * and answers as the header gives them.
 *
 * Findings when written (the tests fail until fixed): a cuEventQuery that
 * fails (not NOT_READY) is taken for a completed copy, by the flush and by
 * the thread alike ("acknowledging anyway"), so the slice is released under
 * a copy still queued and the copy reads the next occupant's bytes with
 * consume and check OK (test_event_query_fails_*); on a device table, three
 * failed calls in a row (write, table read, stream query) give the
 * acknowledgement up for good, the flush saying VMMT_OK, and the check then
 * calls the right bytes another buffer's (test_three_*, test_fault_sweep_device,
 * test_fault_sweep_fabric).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "attack_helpers.h"
#include "emu.h"
#include "pattern.h"

/* Every bounded wait of this file: long enough for a loaded machine, never a timing assertion. */
#define BOUND_MS 5000

/* ------------------------------------------------------------------ helpers */

/* One flush in a thread of its own, so that the test can tell a flush that waits. */
struct one_flush {
    vmmt_consumer *c;
    pthread_t t, self;
    atomic_int done;
    int st;
    char msg[512];
};

static void *one_flush_main(void *arg)
{
    struct one_flush *o = arg;

    o->self = pthread_self();
    o->st = vmmt_consumer_flush(o->c);
    snprintf(o->msg, sizeof o->msg, "%s", o->st != VMMT_OK ? vmmt_last_error() : "");
    atomic_store(&o->done, 1);
    return NULL;
}

static void one_flush_start(struct one_flush *o, vmmt_consumer *c)
{
    memset(o, 0, sizeof *o);
    o->c = c;
    assert_int_equal(pthread_create(&o->t, NULL, one_flush_main, o), 0);
}

/* Did the flush return within ms? */
static int one_flush_wait(struct one_flush *o, int ms)
{
    for (int i = 0; i < ms && !atomic_load(&o->done); i++)
        sleep_ms(1);
    return atomic_load(&o->done);
}

static int one_flush_join(struct one_flush *o)
{
    pthread_join(o->t, NULL);
    return o->st;
}

/* A failure's answer: a status of the header's with a message. */
static void failure_well_formed(int st, const char *msg)
{
    if (st == VMMT_OK) return;
    PROMISE(st < 0 && st >= VMMT_ETOOBIG, "flush returned %d, no vmmt_status", st);
    PROMISE(msg[0] != '\0', "flush failed (%d) without a message", st);
}

/*
 * Which threads logged a line containing `needle` (the flush's or another):
 * a log callback that only records, for the findings' messages.
 */
static struct {
    pthread_mutex_t lock;
    const char *needle;
    pthread_t who[16];
    int n;
} g_logs = {PTHREAD_MUTEX_INITIALIZER, NULL, {0}, 0};

static void recording_log(vmmt_log_level level, const char *msg, void *user)
{
    (void)level;
    (void)user;
    pthread_mutex_lock(&g_logs.lock);
    if (g_logs.needle != NULL && strstr(msg, g_logs.needle) != NULL && g_logs.n < 16)
        g_logs.who[g_logs.n++] = pthread_self();
    pthread_mutex_unlock(&g_logs.lock);
}

static void record_logs(const char *needle)
{
    pthread_mutex_lock(&g_logs.lock);
    g_logs.needle = needle;
    g_logs.n = 0;
    pthread_mutex_unlock(&g_logs.lock);
    vmmt_set_log(recording_log, NULL);
}

/* Stop recording; whether `t` was among the threads that logged the line. */
static int logged_by(pthread_t t)
{
    int by = 0;

    vmmt_set_log(NULL, NULL);
    pthread_mutex_lock(&g_logs.lock);
    for (int i = 0; i < g_logs.n; i++)
        by |= pthread_equal(g_logs.who[i], t);
    g_logs.needle = NULL;
    pthread_mutex_unlock(&g_logs.lock);
    return by;
}

/* Flushes in a loop until told to stop. */
struct flush_loop {
    vmmt_consumer *c;
    pthread_t t;
    atomic_int stop;
    atomic_long calls;
    int bad; /* the first status other than VMMT_OK */
    char msg[512];
};

static void *flush_loop_main(void *arg)
{
    struct flush_loop *l = arg;

    while (!atomic_load(&l->stop)) {
        int st = vmmt_consumer_flush(l->c);
        if (st != VMMT_OK && l->bad == VMMT_OK) {
            l->bad = st;
            snprintf(l->msg, sizeof l->msg, "%s", vmmt_last_error());
        }
        atomic_fetch_add(&l->calls, 1);
        if ((atomic_load(&l->calls) & 63) == 0) sched_yield();
    }
    return NULL;
}

static void flush_loop_start(struct flush_loop *l, vmmt_consumer *c)
{
    memset(l, 0, sizeof *l);
    l->c = c;
    assert_int_equal(pthread_create(&l->t, NULL, flush_loop_main, l), 0);
}

static void flush_loop_stop(struct flush_loop *l)
{
    atomic_store(&l->stop, 1);
    pthread_join(l->t, NULL);
    PROMISE(l->bad == VMMT_OK, "a flush with nothing wrong failed: %d %s", l->bad, l->msg);
}

/* Reclaim until nothing is in flight, at most ms; the count left. */
static uint32_t settle(vmmt_pool *p, int ms)
{
    for (int i = 0; i < ms; i++) {
        assert_vmmt_ok(vmmt_pool_reclaim(p, NULL));
        if (stats(p).in_flight == 0) return 0;
        sleep_ms(1);
    }
    assert_vmmt_ok(vmmt_pool_reclaim(p, NULL));
    return stats(p).in_flight;
}

static uint32_t in_flight_now(vmmt_pool *p)
{
    assert_vmmt_ok(vmmt_pool_reclaim(p, NULL));
    return stats(p).in_flight;
}

/* The kinds of pool attacked: the `kind` argument of the tests. */
enum {
    HOST_TABLE = 0,   /* POSIX_FD device pool, shared host control table */
    DEVICE_TABLE = 1, /* the same with device_control_table = 1 */
    FABRIC = 2,       /* a FABRIC pool: device table, no broker */
    HOST_POOL = 3,    /* VMMT_MEMORY_HOST */
    ELASTIC = 4       /* an elastic device pool */
};

static int fabric_now;
/* Non-zero: the pool's recycler period, so that a failure injected for a flush does not hit it. */
static uint32_t recycle_us;

static void fabric_env(void)
{
    setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
}

/* emu_reset, keeping the FABRIC handles a FABRIC test needs. */
static void driver_reset(void)
{
    emu_reset();
    if (fabric_now) fabric_env();
}

static void make_pool(struct fixture *f, int kind, int consumers, uint32_t slices)
{
    vmmt_pool_config c = config(4 * MiB, consumers);

    fabric_now = 0;
    /* HOST_TABLE follows VMMT_TEST_POOL_KIND (config()); every other kind is what it says. */
    if (kind != HOST_TABLE) {
        c.memory_location = VMMT_MEMORY_DEVICE;
        c.elastic = 0;
        c.chunk_size = 0;
    }
    c.max_slices = slices;
    if (recycle_us != 0) c.recycle_interval_us = recycle_us;
    if (kind == DEVICE_TABLE) c.device_control_table = 1;
    if (kind == FABRIC) {
        if (!on_emu()) skip();
        fabric_now = 1;
        fabric_env();
        c.handle_type = VMMT_HANDLE_FABRIC;
        c.allow_posix_fallback = 0;
    }
    if (kind == HOST_POOL) c.memory_location = VMMT_MEMORY_HOST;
    if (kind == ELASTIC) {
        c.elastic = 1;
        c.chunk_size = 1 * MiB;
    }
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    if (kind == FABRIC) assert_int_equal(stats(f->pool).handle_type, VMMT_HANDLE_FABRIC);
}

/* Publish pattern i and let its copy land, so that only the consumer's copy is gated. */
static vmmt_desc landed(struct fixture *f, uint32_t i)
{
    vmmt_desc d = publish(f, i);
    sync_s(f->stream);
    return d;
}

/* -------------------------------------------------------------- arguments */

/* NULL, an idle consumer, a consumer with nothing pending from many threads. */
static void test_flush_arguments_and_idle(void **state)
{
    struct fixture *f = *state;
    struct flush_loop l[4];

    assert_int_equal(vmmt_consumer_flush(NULL), VMMT_EINVAL);
    assert_true(vmmt_last_error()[0] != '\0');
    assert_int_equal(vmmt_last_status(), VMMT_EINVAL);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    for (int i = 0; i < 4; i++)
        flush_loop_start(&l[i], f->consumer);
    sleep_ms(20);
    for (int i = 0; i < 4; i++)
        flush_loop_stop(&l[i]);
}

/* ------------------------------------------------------ never waits a copy */

/*
 * The copy queued behind a gate: a flush in another thread must come back
 * while the gate is still closed, and leave the slice in flight (its copy has
 * not run); once the copy ran, the next flush frees it at once.
 */
static void never_waits(struct fixture *f, int device_table)
{
    struct one_flush o;
    struct gate g;
    vmmt_desc d;
    int returned;

    make_pool(f, device_table, 1, 4);
    d = landed(f, 1);
    gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    one_flush_start(&o, f->consumer);
    returned = one_flush_wait(&o, BOUND_MS);
    gate_open_later(&g, 0);
    one_flush_join(&o);
    PROMISE(returned, "flush waited for a copy still queued (%d ms and more)", BOUND_MS);
    assert_vmmt_ok(o.st);
    gate_free(&g);
    assert_true(holds(f->stream, f->dst, 1));
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(in_flight_now(f->pool) == 0, "a flush after the synchronize left the slice owed");
}

static void test_never_waits_host(void **state)
{
    never_waits(*state, 0);
}

static void test_never_waits_device(void **state)
{
    never_waits(*state, 1);
}

/*
 * The consume's stream synchronized, then the application queues more work
 * on it (held behind a gate): the flush must neither wait for that work nor
 * leave the completed copy's slice owed.
 */
static void later_work(struct fixture *f, int device_table)
{
    struct one_flush o;
    struct gate g;
    vmmt_desc d;
    int returned;
    uint32_t owed;

    make_pool(f, device_table, 1, 4);
    d = landed(f, 2);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    sync_s(f->stream);
    gate_close(&g, f->stream); /* the application's next work, still queued */
    one_flush_start(&o, f->consumer);
    returned = one_flush_wait(&o, BOUND_MS);
    owed = returned ? in_flight_now(f->pool) : 99;
    gate_open_later(&g, 0);
    one_flush_join(&o);
    gate_free(&g);
    PROMISE(returned, "flush waited for work queued after the copy");
    assert_vmmt_ok(o.st);
    PROMISE(owed == 0, "flush after the synchronize left %u slices owed (work queued behind)",
            owed);
    assert_true(holds(f->stream, f->dst, 2));
}

static void test_later_work_host(void **state)
{
    later_work(*state, 0);
}

static void test_later_work_device(void **state)
{
    later_work(*state, 1);
}

/* ---------------------------------------------------- injected failures */

/*
 * cuEventQuery failing (not NOT_READY) while the copy is still queued: the
 * flush must not take the failure for a completed copy. Were the slice
 * acknowledged, the next publish would take it and the consumer's copy,
 * once the gate opens, would read the next occupant's bytes.
 */
static void event_query_fails(struct fixture *f, int device_table, const char *spec)
{
    struct one_flush o;
    struct gate g;
    vmmt_desc d, next;
    vmmt_buffer b = bytes(f->src + N, N);
    CUstream other;
    int returned, next_published = 0, by_flush;
    uint32_t owed;

    make_pool(f, device_table, 1, 1);
    other = new_stream();
    d = landed(f, 3);
    gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    record_logs("acknowledging anyway");
    emu_fail(spec);
    one_flush_start(&o, f->consumer);
    returned = one_flush_wait(&o, BOUND_MS);
    sleep_ms(20); /* the acknowledgement thread meets the same failures */
    driver_reset();
    by_flush = logged_by(o.self);
    owed = in_flight_now(f->pool);
    if (owed == 0) {
        /* Acknowledged under a queued copy: show what the consumer then reads. */
        put_on(other, f->src + N, N, 4);
        next_published = vmmt_publish(f->pool, &b, other, &next) == VMMT_OK;
        sync_s(other);
    }
    gate_open_later(&g, 0);
    one_flush_join(&o);
    gate_free(&g);
    /* Everything measured, then cleaned up, before any promise is judged. */
    int landed_own = holds(f->stream, f->dst, 3), holding = which(f->stream, f->dst);
    int check = vmmt_consumer_check(f->consumer, &d);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    if (next_published) assert_vmmt_ok(vmmt_cancel(f->pool, &next));
    uint32_t left = settle(f->pool, BOUND_MS);
    free_stream(other);
    PROMISE(returned, "flush waited for a queued copy when cuEventQuery failed (%s)", spec);
    failure_well_formed(o.st, o.msg);
    PROMISE(owed == 1,
            "%s: the slice was acknowledged (%s) while the consume's copy was still queued%s; "
            "consume said OK, dst now holds pattern %d (the buffer was 3), check says %d",
            spec, by_flush ? "by the flush itself" : "by the consumer's thread",
            next_published ? ", and the next publish took the slice" : "", holding, check);
    assert_true(landed_own);
    assert_vmmt_ok(check);
    PROMISE(left == 0, "%s: the acknowledgement was lost after cuEventQuery failed", spec);
}

static void test_event_query_fails_host(void **state)
{
    if (!on_emu()) skip();
    event_query_fails(*state, 0, "cuEventQuery:*:CUDA_ERROR_UNKNOWN");
}

static void test_event_query_fails_device(void **state)
{
    if (!on_emu()) skip();
    event_query_fails(*state, 1, "cuEventQuery:*:CUDA_ERROR_UNKNOWN");
}

static void test_event_query_fails_once_host(void **state)
{
    if (!on_emu()) skip();
    event_query_fails(*state, 0, "cuEventQuery:1:CUDA_ERROR_INVALID_HANDLE");
}

static void test_event_query_fails_once_device(void **state)
{
    if (!on_emu()) skip();
    event_query_fails(*state, 1, "cuEventQuery:1:CUDA_ERROR_INVALID_HANDLE");
}

/*
 * A gate the CPU opens (the emulator's device memory is host memory), so that
 * the copy completes while an injected failure is in force, whatever entry
 * it is: the flush and the acknowledgement thread both meet it.
 */
struct cpu_gate {
    CUdeviceptr word;
};

static void cpu_gate_close(struct cpu_gate *g, CUstream s)
{
    assert_int_equal(drv()->cuMemAlloc(&g->word, 4096), CUDA_SUCCESS);
    __atomic_store_n((uint32_t *)(uintptr_t)g->word, 0, __ATOMIC_RELEASE);
    assert_int_equal(drv()->cuStreamWaitValue32(s, g->word, 1, CU_STREAM_WAIT_VALUE_GEQ),
                     CUDA_SUCCESS);
}

static void cpu_gate_open(struct cpu_gate *g)
{
    __atomic_store_n((uint32_t *)(uintptr_t)g->word, 1, __ATOMIC_RELEASE);
}

/* Whether s completed within ms, by whichever of query or synchronize is not failing. */
static int stream_done(CUstream s, int use_query, int ms)
{
    if (!use_query) return drv()->cuStreamSynchronize(s) == CUDA_SUCCESS;
    for (int i = 0; i < ms; i++) {
        if (drv()->cuStreamQuery(s) == CUDA_SUCCESS) return 1;
        sleep_ms(1);
    }
    return 0;
}

/*
 * A sweep: one driver entry failing (once, then always) from before the
 * copy completes until a flush after it has returned. The flush may fail
 * (with a status and a message) or leave the write to the thread, but must
 * come back, the bytes are the producer's (check OK), and the
 * acknowledgement must land once the driver works again: "a device table's
 * is tried again there if its write fails". The producer's recycler is kept
 * out of the window (same process, same injected failures).
 */
static const char *sweep_entries[] = {
    "cuEventQuery",        "cuStreamWriteValue32", "cuStreamQuery",
    "cuStreamSynchronize", "cuCtxPushCurrent",     "cuCtxPopCurrent",
    "cuCtxGetCurrent",     "cuMemcpyDtoHAsync",    "cuMemcpyAsync",
    "cuEventRecord",       "cuEventSynchronize",   "cuStreamWaitEvent",
    "cuStreamCreate",      "cuEventCreate",        "cuMemHostRegister",
    "cuStreamWaitValue32", "cuMemcpyHtoDAsync",    "cuDevicePrimaryCtxRetain",
};

static void fault_sweep(struct fixture *f, int device_table)
{
    char findings[4096] = "";
    uint32_t round = 5;

    if (!on_emu()) skip();
    recycle_us = 2000000;
    make_pool(f, device_table, 1, 2);
    recycle_us = 0;
    for (size_t e = 0; e < sizeof sweep_entries / sizeof sweep_entries[0]; e++) {
        for (int mode = 0; mode < 2; mode++) {
            char spec[128], line[768] = "";
            int use_query = strcmp(sweep_entries[e], "cuStreamSynchronize") == 0;
            struct cpu_gate g;
            vmmt_desc d;
            int st, check, done, given_up_by_flush;
            char msg[512];

            snprintf(spec, sizeof spec, "%s:%s:CUDA_ERROR_UNKNOWN", sweep_entries[e],
                     mode == 0 ? "1" : "*");
            d = landed(f, round);
            cpu_gate_close(&g, f->stream);
            assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
            record_logs("could not be written");
            emu_fail(spec);
            cpu_gate_open(&g);
            done = stream_done(f->stream, use_query, BOUND_MS);
            st = vmmt_consumer_flush(f->consumer);
            snprintf(msg, sizeof msg, "%s", st != VMMT_OK ? vmmt_last_error() : "");
            driver_reset();
            given_up_by_flush = logged_by(pthread_self());
            if (!done) sync_s(f->stream);
            assert_int_equal(drv()->cuMemFree(g.word), CUDA_SUCCESS);
            failure_well_formed(st, msg);
            PROMISE(holds(f->stream, f->dst, round), "%s: round %u's bytes are not its own", spec,
                    round);
            check = vmmt_consumer_check(f->consumer, &d);
            if (check != VMMT_OK)
                snprintf(line, sizeof line, "%s: check %d with the bytes right (%s); ", spec, check,
                         vmmt_last_error());
            assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
            if (settle(f->pool, BOUND_MS) != 0) {
                snprintf(line + strlen(line), sizeof line - strlen(line),
                         "acknowledgement lost: the slice stays in flight (given up by %s; the "
                         "flush said %d%s%s)",
                         given_up_by_flush ? "the flush itself" : "the consumer's thread", st,
                         msg[0] ? ": " : "", msg);
                assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
                assert_int_equal(settle(f->pool, BOUND_MS), 0);
            }
            if (line[0] != '\0') {
                print_error("FINDING: %s\n", line);
                snprintf(findings + strlen(findings), sizeof findings - strlen(findings), "  %s\n",
                         spec);
            }
            round = round % 60 + 1;
        }
    }
    PROMISE(findings[0] == '\0', "flush under injected failures:\n%s", findings);
}

/*
 * The shortest way to the sweep's finding: exactly three failures of one
 * entry (a transient fault: the fourth call works) around a completed
 * device-table copy and a flush. "A device table's is tried again there if
 * its write fails": the acknowledgement must land once the entry works, and
 * the check must not call the right bytes another buffer's.
 */
static void three_failures(struct fixture *f, int kind, const char *entry)
{
    char spec[256];
    struct cpu_gate g;
    vmmt_desc d;
    int st, check;
    uint32_t left;

    if (!on_emu()) skip();
    recycle_us = 2000000;
    make_pool(f, kind, 1, 2);
    recycle_us = 0;
    snprintf(spec, sizeof spec,
             "%s:1:CUDA_ERROR_UNKNOWN,%s:2:CUDA_ERROR_UNKNOWN,%s:3:CUDA_ERROR_UNKNOWN", entry,
             entry, entry);
    d = landed(f, 44);
    cpu_gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    emu_fail(spec);
    cpu_gate_open(&g);
    sync_s(f->stream);
    st = vmmt_consumer_flush(f->consumer);
    sleep_ms(5);
    driver_reset();
    assert_int_equal(drv()->cuMemFree(g.word), CUDA_SUCCESS);
    assert_true(holds(f->stream, f->dst, 44));
    check = vmmt_consumer_check(f->consumer, &d);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    left = settle(f->pool, BOUND_MS);
    if (left != 0) {
        assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
        assert_int_equal(settle(f->pool, BOUND_MS), 0);
    }
    PROMISE(left == 0,
            "three failed %s calls lost a completed copy's acknowledgement for good (the slice "
            "waits for vmmt_pool_release_rank; the flush said %d)",
            entry, st);
    PROMISE(check == VMMT_OK, "check said %d for the producer's own bytes", check);
}

static void test_three_write_failures_device(void **state)
{
    three_failures(*state, DEVICE_TABLE, "cuStreamWriteValue32");
}

static void test_three_write_failures_fabric(void **state)
{
    three_failures(*state, FABRIC, "cuStreamWriteValue32");
}

static void test_three_read_failures_device(void **state)
{
    three_failures(*state, DEVICE_TABLE, "cuMemcpyDtoHAsync");
}

static void test_three_read_failures_fabric(void **state)
{
    three_failures(*state, FABRIC, "cuMemcpyDtoHAsync");
}

static void test_three_query_failures_device(void **state)
{
    three_failures(*state, DEVICE_TABLE, "cuStreamQuery");
}

static void test_fault_sweep_host(void **state)
{
    fault_sweep(*state, 0);
}

static void test_fault_sweep_device(void **state)
{
    fault_sweep(*state, 1);
}

/*
 * A copy that failed on its stream (the wait before it timed out, so the
 * copy never ran and its event completes with the error): "a failed copy
 * still acknowledges", so a flush must release the slice, and the stream's
 * error stays the caller's.
 */
static void failed_copy(struct fixture *f, int device_table)
{
    const struct vmmt_drv *dr = drv();
    CUstream s;
    CUdeviceptr word;
    vmmt_desc d;

    if (!on_emu()) skip();
    make_pool(f, device_table, 1, 1);
    s = new_stream();
    d = landed(f, 6);
    setenv("VMMT_EMU_WAIT_TIMEOUT_MS", "100", 1);
    vmmt__emu_configure();
    assert_int_equal(dr->cuMemAlloc(&word, 4096), CUDA_SUCCESS);
    assert_int_equal(dr->cuMemsetD8Async(word, 0, 4, s), CUDA_SUCCESS);
    sync_s(s);
    assert_int_equal(dr->cuStreamWaitValue32(s, word, 1, CU_STREAM_WAIT_VALUE_GEQ), CUDA_SUCCESS);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, s, VMMT_ALL_RANKS, 0));
    assert_int_equal(dr->cuStreamSynchronize(s), CUDA_ERROR_TIMEOUT);
    unsetenv("VMMT_EMU_WAIT_TIMEOUT_MS");
    vmmt__emu_configure();
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(settle(f->pool, BOUND_MS) == 0, "a failed copy's slice was never released");
    dr->cuStreamDestroy(s); /* its error is sticky: destroy may report it */
    assert_int_equal(dr->cuMemFree(word), CUDA_SUCCESS);
    /* The pool goes on. */
    d = landed(f, 7);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    assert_true(holds(f->stream, f->dst, 7));
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(settle(f->pool, BOUND_MS) == 0, "the pool stopped releasing after a failed copy");
}

static void test_failed_copy_host(void **state)
{
    failed_copy(*state, 0);
}

static void test_failed_copy_device(void **state)
{
    failed_copy(*state, 1);
}

/* ------------------------------------------------------- races with the acker */

/*
 * One slot, so that every round reuses it with a newer generation: two
 * threads flush without pause while the main thread publishes, consumes,
 * synchronizes, flushes, checks and waits for the slot (alternating with
 * dropped descriptors). A duplicate or late write of an earlier generation
 * would take back the next occupant's acknowledgement (the slot then stays
 * owed) or let a slice go under a copy (wrong bytes).
 */
#define HAMMER_ROUNDS 300

static void hammer(struct fixture *f, int device_table)
{
    struct flush_loop l[2];

    make_pool(f, device_table, 1, 1);
    for (int i = 0; i < 2; i++)
        flush_loop_start(&l[i], f->consumer);
    for (uint32_t r = 0; r < HAMMER_ROUNDS; r++) {
        uint32_t pat = r % 60 + 1;
        vmmt_desc d = publish(f, pat);
        uint32_t owed;

        if (r % 5 == 4) {
            assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
        } else {
            assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
        }
        sync_s(f->stream);
        if (r & 1) assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        if (r % 5 != 4) {
            PROMISE(holds(f->stream, f->dst, pat), "round %u: dst holds pattern %d, not %u", r,
                    which(f->stream, f->dst), pat);
            assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
        }
        owed = settle(f->pool, BOUND_MS);
        if (owed != 0) {
            for (int i = 0; i < 2; i++)
                flush_loop_stop(&l[i]);
        }
        PROMISE(owed == 0, "round %u: the acknowledgement was lost (slot owed for ever)", r);
        /* The same descriptor again: refused, and nothing written. */
        assert_int_equal(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0),
                         VMMT_ESTATE);
    }
    for (int i = 0; i < 2; i++)
        flush_loop_stop(&l[i]);
    assert_true(atomic_load(&l[0].calls) > 0);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, BOUND_MS));
}

static void test_hammer_host(void **state)
{
    hammer(*state, 0);
}

static void test_hammer_device(void **state)
{
    hammer(*state, 1);
}

/*
 * Several streams in flight at once over a pool of 4 slices, each consumed
 * behind its own gate, with flushes from two threads while the gates open in
 * turn: each slice is released only after its own copy ran, and every
 * destination holds its own buffer.
 */
static void many_in_flight(struct fixture *f, int device_table)
{
    enum { K = 4 };
    struct flush_loop l[2];
    struct gate g[K];
    CUstream s[K];
    vmmt_desc d[K];

    make_pool(f, device_table, 1, K);
    for (int k = 0; k < K; k++) {
        s[k] = new_stream();
        d[k] = landed(f, 20 + (uint32_t)k);
        gate_close(&g[k], s[k]);
        assert_vmmt_ok(
            consume_at(f->consumer, &d[k], f->dst + (CUdeviceptr)k * N, s[k], VMMT_ALL_RANKS, 0));
    }
    for (int i = 0; i < 2; i++)
        flush_loop_start(&l[i], f->consumer);
    for (int k = 0; k < K; k++) {
        uint32_t owed = in_flight_now(f->pool);
        PROMISE(owed == (uint32_t)(K - k), "%u in flight with %d copies still queued", owed, K - k);
        gate_open_later(&g[k], 0);
        gate_free(&g[k]);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(in_flight_now(f->pool) == (uint32_t)(K - k - 1),
                "flush after copy %d left its slice owed", k);
    }
    for (int i = 0; i < 2; i++)
        flush_loop_stop(&l[i]);
    for (int k = 0; k < K; k++) {
        PROMISE(holds(f->stream, f->dst + (CUdeviceptr)k * N, 20 + (uint32_t)k),
                "copy %d holds pattern %d", k, which(f->stream, f->dst + (CUdeviceptr)k * N));
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d[k]));
        free_stream(s[k]);
    }
}

static void test_many_in_flight_host(void **state)
{
    many_in_flight(*state, 0);
}

static void test_many_in_flight_device(void **state)
{
    many_in_flight(*state, 1);
}

/* ------------------------------------------------------------ evictions */

struct evictor {
    vmmt_consumer *c;
    uint8_t id[16];
    pthread_t t;
    atomic_int stop;
    atomic_long ok, refused;
    int bad;
};

static void *evictor_main(void *arg)
{
    struct evictor *e = arg;

    while (!atomic_load(&e->stop)) {
        int st = vmmt_consumer_evict(e->c, e->id, 0);
        if (st == VMMT_OK)
            atomic_fetch_add(&e->ok, 1);
        else if (st == VMMT_ESTATE)
            atomic_fetch_add(&e->refused, 1);
        else if (e->bad == 0)
            e->bad = st;
        sched_yield();
    }
    return NULL;
}

/*
 * Evictions of the pool from one thread, flushes from another, while the main
 * thread consumes and waits for each slice: an import let go between a
 * copy's completion and its acknowledgement must not lose the acknowledgement
 * nor have a flush store into a table already unmapped.
 */
static void evict_race(struct fixture *f, int device_table)
{
    struct flush_loop l;
    struct evictor e;
    vmmt_desc_info info;
    vmmt_desc d;

    make_pool(f, device_table, 1, 2);
    d = landed(f, 30);
    assert_vmmt_ok(vmmt_desc_inspect(&d, &info));
    memset(&e, 0, sizeof e);
    e.c = f->consumer;
    memcpy(e.id, info.pool_id, 16);
    assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    sync_s(f->stream);
    flush_loop_start(&l, f->consumer);
    assert_int_equal(pthread_create(&e.t, NULL, evictor_main, &e), 0);
    for (uint32_t r = 0; r < 150; r++) {
        uint32_t pat = r % 60 + 1;
        uint32_t owed;
        int st;

        d = publish(f, pat);
        st = consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0);
        PROMISE(st == VMMT_OK, "round %u: consume failed %d: %s", r, st, vmmt_last_error());
        sync_s(f->stream);
        if (r & 1) assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(holds(f->stream, f->dst, pat), "round %u: dst holds %d", r,
                which(f->stream, f->dst));
        owed = settle(f->pool, BOUND_MS);
        if (owed != 0) {
            atomic_store(&e.stop, 1);
            pthread_join(e.t, NULL);
            flush_loop_stop(&l);
        }
        PROMISE(owed == 0, "round %u: acknowledgement lost beside an eviction", r);
    }
    atomic_store(&e.stop, 1);
    pthread_join(e.t, NULL);
    flush_loop_stop(&l);
    PROMISE(e.bad == 0, "evict answered %d", e.bad);
    print_message("evictions: %ld done, %ld refused\n", atomic_load(&e.ok),
                  atomic_load(&e.refused));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, BOUND_MS));
}

static void test_evict_race_host(void **state)
{
    evict_race(*state, 0);
}

static void test_evict_race_device(void **state)
{
    evict_race(*state, 1);
}

/* ----------------------------------------------------------- packed groups */

/*
 * A packed group of two, every member on the consume's one stream (as the
 * library asks). Ways: 0, member 0 consumed and its copy done, member 1's
 * copy held behind a gate; 1, member 0's copy held, member 1 dropped (the
 * dropped member completes the group); 2, member 0 dropped first, member 1's
 * copy held. Flushes while a member's copy is queued must leave the slice in
 * flight (else the next publish takes it and the queued copy reads it); once
 * the copies ran, a flush releases it and the bytes are the members' own.
 */
static void packed(struct fixture *f, int device_table, int way)
{
    vmmt_buffer bufs[2];
    vmmt_desc d[2], next;
    CUstream other;
    struct gate g;
    uint32_t owed;
    int overwritten = 0, gated = way == 0 ? 1 : way == 1 ? 0 : 1;

    make_pool(f, device_table, 1, 1);
    other = new_stream();
    put_on(f->stream, f->src, N, 40);
    put_on(f->stream, f->src + N, N, 41);
    bufs[0] = bytes(f->src, N);
    bufs[1] = bytes(f->src + N, N);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, bufs, 2, f->stream, d));
    sync_s(f->stream);
    if (way == 0) {
        assert_vmmt_ok(consume_at(f->consumer, &d[0], f->dst, f->stream, VMMT_ALL_RANKS, 0));
        sync_s(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(in_flight_now(f->pool) == 1, "half a packed group consumed: slice released");
        gate_close(&g, f->stream);
        assert_vmmt_ok(consume_at(f->consumer, &d[1], f->dst + N, f->stream, VMMT_ALL_RANKS, 0));
    } else if (way == 1) {
        gate_close(&g, f->stream);
        assert_vmmt_ok(consume_at(f->consumer, &d[0], f->dst, f->stream, VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d[1], 0, f->stream, VMMT_ALL_RANKS, 0));
    } else {
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d[0], 0, f->stream, VMMT_ALL_RANKS, 0));
        sync_s(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(in_flight_now(f->pool) == 1, "half a packed group dropped: slice released");
        gate_close(&g, f->stream);
        assert_vmmt_ok(consume_at(f->consumer, &d[1], f->dst + N, f->stream, VMMT_ALL_RANKS, 0));
    }
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    sleep_ms(10);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    owed = in_flight_now(f->pool);
    if (owed == 0) {
        vmmt_buffer b = bytes(f->src + 2 * N, N);
        put_on(other, f->src + 2 * N, N, 42);
        overwritten = vmmt_publish(f->pool, &b, other, &next) == VMMT_OK;
        sync_s(other);
    }
    gate_open_later(&g, 0);
    gate_free(&g);
    PROMISE(owed == 1, "packed slice released with member %d's copy queued%s: it holds %d", gated,
            overwritten ? ", and republished" : "",
            which(f->stream, f->dst + (CUdeviceptr)gated * N));
    if (way != 2) assert_true(holds(f->stream, f->dst, 40));
    if (way != 1) assert_true(holds(f->stream, f->dst + N, 41));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d[gated]));
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(in_flight_now(f->pool) == 0,
            "packed group done and synchronized: the flush left its slice owed");
    free_stream(other);
}

static void test_packed_host(void **state)
{
    packed(*state, 0, 0);
}

static void test_packed_device(void **state)
{
    packed(*state, 1, 0);
}

static void test_packed_drop_second_host(void **state)
{
    packed(*state, 0, 1);
}

static void test_packed_drop_second_device(void **state)
{
    packed(*state, 1, 1);
}

static void test_packed_drop_first_host(void **state)
{
    packed(*state, 0, 2);
}

static void test_packed_drop_first_device(void **state)
{
    packed(*state, 1, 2);
}

/* ------------------------------------------------------------- devices */

struct ctx_flush {
    vmmt_consumer *c;
    int device; /* -1: no context current in the thread */
    int st;
    int ctx_kept;
};

static void *ctx_flush_main(void *arg)
{
    struct ctx_flush *x = arg;
    const struct vmmt_drv *dr = vmmt__drv();
    CUcontext before = NULL, after = NULL;

    if (x->device >= 0) vmmt__ctx_enter(x->device);
    dr->cuCtxGetCurrent(&before);
    x->st = vmmt_consumer_flush(x->c);
    dr->cuCtxGetCurrent(&after);
    x->ctx_kept = before == after;
    if (x->device >= 0) vmmt__ctx_leave();
    return NULL;
}

static struct ctx_flush flush_in_thread_with(vmmt_consumer *c, int device)
{
    struct ctx_flush x = {c, device, 0, 0};
    pthread_t t;

    assert_int_equal(pthread_create(&t, NULL, ctx_flush_main, &x), 0);
    pthread_join(t, NULL);
    return x;
}

/*
 * A consume into device 1's memory on device 1's stream out of a device-0
 * pool; the flush from a thread with no context, then from one with device
 * 1's context current (which it must leave current), and from one with
 * device 0's.
 */
static void other_device(struct fixture *f, int device_table)
{
    const struct vmmt_drv *dr = drv();
    CUdeviceptr dst1;
    CUstream s1;
    int count = 0;

    assert_int_equal(dr->cuDeviceGetCount(&count), CUDA_SUCCESS);
    if (count < 2) skip();
    make_pool(f, device_table, 1, 4);
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(dr->cuMemAlloc(&dst1, 4 * N), CUDA_SUCCESS);
    assert_int_equal(dr->cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    vmmt__ctx_leave();
    for (int k = 0; k < 3; k++) {
        vmmt_desc d = landed(f, 50 + (uint32_t)k);
        struct gate g;
        struct ctx_flush x;

        gate_close(&g, s1);
        assert_vmmt_ok(vmmt_consume(f->consumer, &d, 1, dst1, 4 * N, s1, VMMT_ALL_RANKS, 0));
        gate_open_later(&g, 0);
        gate_free(&g);
        x = flush_in_thread_with(f->consumer, k == 0 ? -1 : k == 1 ? 1 : 0);
        PROMISE(x.st == VMMT_OK, "flush from a thread (context %d) failed: %d", k, x.st);
        PROMISE(x.ctx_kept, "flush changed the calling thread's current context (%d)", k);
        PROMISE(in_flight_now(f->pool) == 0,
                "device 1's consume left owed after a flush (thread context %d)", k);
        PROMISE(holds(s1, dst1, 50 + (uint32_t)k), "device 1 holds the wrong bytes");
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
    }
    assert_vmmt_ok(vmmt__ctx_enter(1));
    assert_int_equal(dr->cuStreamDestroy(s1), CUDA_SUCCESS);
    assert_int_equal(dr->cuMemFree(dst1), CUDA_SUCCESS);
    vmmt__ctx_leave();
}

static void test_other_device_host(void **state)
{
    other_device(*state, 0);
}

static void test_other_device_device(void **state)
{
    other_device(*state, 1);
}

/* -------------------------------------------------- the producer goes away */

static int wait_pool_count(vmmt_consumer *c, int want, int ms)
{
    for (int i = 0; i < ms && vmmt_consumer_pool_count(c) != want; i++)
        sleep_ms(1);
    return vmmt_consumer_pool_count(c);
}

/*
 * The producer in this process shuts its pool down while this consumer's
 * copy out of it is queued, with flushes running: the pool is let go once
 * the copy ran (while flushes run beside the release), the bytes are the
 * producer's, nothing leaks. Repeated, so that the release meets a flush.
 */
static void producer_shutdown(struct fixture *f, int device_table)
{
    for (uint32_t r = 0; r < 12; r++) {
        struct flush_loop l;
        struct gate g;
        vmmt_desc d;

        make_pool(f, device_table, 1, 2);
        d = landed(f, 10 + r);
        gate_close(&g, f->stream);
        assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
        flush_loop_start(&l, f->consumer);
        vmmt_pool_destroy(f->pool);
        f->pool = NULL;
        gate_open_later(&g, r % 3);
        gate_free(&g);
        PROMISE(holds(f->stream, f->dst, 10 + r), "round %u: bytes lost to the shutdown", r);
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
        PROMISE(wait_pool_count(f->consumer, 0, 20000) == 0,
                "round %u: a shut-down pool stayed imported", r);
        flush_loop_stop(&l);
    }
}

static void test_producer_shutdown_host(void **state)
{
    producer_shutdown(*state, 0);
}

static void test_producer_shutdown_device(void **state)
{
    producer_shutdown(*state, 1);
}

/*
 * A producer process killed while this consumer has one copy held behind its
 * own gate (bytes landed) and one waiting for a ready flag the producer will
 * never set, with flushes running: the streams come free, the landed copy
 * checks OK, the other EFAILED, the pool is let go, flush keeps answering OK.
 */
static void producer_killed(struct fixture *f, int device_table)
{
    struct flush_loop l;
    struct gate g;
    vmmt_desc d[3];
    CUstream other;
    int sv[2];
    char arg[4];
    char *argv[] = {arg, NULL};
    pid_t pid;

    other = new_stream();
    snprintf(arg, sizeof arg, "%d", device_table);
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    pid = tu_spawn("producer_child", argv, sv[1]);
    assert_true(pid > 0);
    close(sv[1]);
    for (uint32_t i = 0; i < 3; i++) {
        struct tu_msg m;
        assert_int_equal(read(sv[0], &m, sizeof m), sizeof m);
        assert_int_equal(m.index, i + 1);
        memcpy(d[i].bytes, m.desc, sizeof d[i].bytes);
    }
    gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(f->consumer, &d[0], f->dst, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(consume_at(f->consumer, &d[2], f->dst + N, other, VMMT_ALL_RANKS, 0));
    flush_loop_start(&l, f->consumer);
    kill(pid, SIGKILL);
    assert_int_equal(tu_wait(pid, BOUND_MS), -1);
    close(sv[0]);
    sync_s(other); /* the consumer sets the dead producer's flag */
    gate_open_later(&g, 0);
    gate_free(&g);
    assert_true(holds(f->stream, f->dst, 1));
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d[0]));
    assert_int_equal(vmmt_consumer_check(f->consumer, &d[2]), VMMT_EFAILED);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(wait_pool_count(f->consumer, 0, 20000) == 0, "a dead producer's pool stayed");
    flush_loop_stop(&l);
    assert_int_equal(consume_at(f->consumer, &d[1], f->dst, f->stream, VMMT_ALL_RANKS, 0),
                     VMMT_ECLOSED);
    free_stream(other);
}

static void test_producer_killed_host(void **state)
{
    producer_killed(*state, 0);
}

static void test_producer_killed_device(void **state)
{
    producer_killed(*state, 1);
}

/* ----------------------------------------------- a rank released, reoccupied */

/*
 * Two ranks. Rank 0's copy of A is held behind a gate; the producer releases
 * rank 0 (as for a restarted rank), rank 1 drops A, so A's slot is recycled
 * and B takes it. Rank 0 consumes B (flushed: acknowledged) and rank 1 has
 * not yet. Then A's copy runs and is flushed: its late acknowledgement must
 * not be stored over rank 0's of B (B would stay owed), and the check must
 * say A's bytes are not the buffer.
 */
static void released_and_reoccupied(struct fixture *f, int device_table)
{
    CUstream other;
    struct gate g;
    vmmt_desc a, b;
    vmmt_desc_info ia, ib;
    int st;

    make_pool(f, device_table, 2, 1);
    other = new_stream();
    a = landed(f, 60);
    gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(f->consumer, &a, f->dst, f->stream, 0, 1));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &a, 0, other, 1, 1));
    sync_s(other);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(settle(f->pool, BOUND_MS) == 0, "A's slot not released by the release and the drop");
    b = publish_from(f->pool, other, f->src + N, 61);
    sync_s(other);
    assert_vmmt_ok(vmmt_desc_inspect(&a, &ia));
    assert_vmmt_ok(vmmt_desc_inspect(&b, &ib));
    assert_int_equal(ia.slot, ib.slot);
    assert_vmmt_ok(consume_at(f->consumer, &b, f->dst + N, other, 0, 1));
    sync_s(other);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    assert_true(holds(other, f->dst + N, 61));
    /* Now A's copy runs (reading what is now B's slice), and is flushed. */
    gate_open_later(&g, 0);
    gate_free(&g);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    sleep_ms(10);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    st = vmmt_consumer_check(f->consumer, &a);
    PROMISE(st == VMMT_EFAILED || holds(f->stream, f->dst, 60),
            "check said %d for A, whose slice went to B while A's copy ran (dst holds %d)", st,
            which(f->stream, f->dst));
    /* Rank 1 drops B: B must be free, rank 0's acknowledgement still there. */
    assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &b, 0, other, 1, 1));
    sync_s(other);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(settle(f->pool, BOUND_MS) == 0,
            "A's late acknowledgement took back rank 0's acknowledgement of B");
    free_stream(other);
}

static void test_released_and_reoccupied_host(void **state)
{
    released_and_reoccupied(*state, 0);
}

static void test_released_and_reoccupied_device(void **state)
{
    released_and_reoccupied(*state, 1);
}

/* -------------------------------------------------------------- checks */

struct checker {
    vmmt_consumer *c;
    vmmt_desc d;
    pthread_t t;
    atomic_int stop;
    int bad;
};

static void *checker_main(void *arg)
{
    struct checker *k = arg;

    while (!atomic_load(&k->stop)) {
        int st = vmmt_consumer_check(k->c, &k->d);
        if (st != VMMT_OK && k->bad == 0) k->bad = st;
        sched_yield();
    }
    return NULL;
}

/*
 * Two consumers (two processes' worth) for two ranks, each with a flusher,
 * a third thread checking an earlier descriptor without pause: the slice is
 * released only once both copies ran, both hold the buffer, checks say OK.
 */
static void two_consumers(struct fixture *f, int device_table)
{
    vmmt_consumer *c2;
    struct flush_loop l1, l2;
    struct checker k;
    CUstream other;

    make_pool(f, device_table, 2, 1);
    other = new_stream();
    assert_vmmt_ok(vmmt_consumer_create(NULL, &c2));
    memset(&k, 0, sizeof k);
    k.c = f->consumer;
    k.d = landed(f, 1);
    assert_vmmt_ok(consume_at(f->consumer, &k.d, f->dst, f->stream, 0, 1));
    assert_vmmt_ok(consume_at(c2, &k.d, f->dst + N, other, 1, 1));
    sync_s(f->stream);
    sync_s(other);
    PROMISE(settle(f->pool, BOUND_MS) == 0, "first slice owed");
    flush_loop_start(&l1, f->consumer);
    flush_loop_start(&l2, c2);
    assert_int_equal(pthread_create(&k.t, NULL, checker_main, &k), 0);
    for (uint32_t r = 0; r < 100; r++) {
        uint32_t pat = r % 60 + 2;
        vmmt_desc d = publish(f, pat);
        struct gate g;

        sync_s(f->stream);
        gate_close(&g, other);
        assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, 0, 1));
        assert_vmmt_ok(consume_at(c2, &d, f->dst + N, other, 1, 1));
        sync_s(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(in_flight_now(f->pool) == 1, "round %u: freed with rank 1's copy queued", r);
        gate_open_later(&g, 0);
        gate_free(&g);
        assert_vmmt_ok(vmmt_consumer_flush(c2));
        PROMISE(holds(f->stream, f->dst, pat) && holds(other, f->dst + N, pat),
                "round %u: wrong bytes", r);
        PROMISE(settle(f->pool, BOUND_MS) == 0, "round %u: acknowledgement lost", r);
    }
    atomic_store(&k.stop, 1);
    pthread_join(k.t, NULL);
    flush_loop_stop(&l1);
    flush_loop_stop(&l2);
    PROMISE(k.bad == 0, "check of an earlier good descriptor said %d", k.bad);
    vmmt_consumer_destroy(c2);
    free_stream(other);
}

static void test_two_consumers_host(void **state)
{
    two_consumers(*state, 0);
}

static void test_two_consumers_device(void **state)
{
    two_consumers(*state, 1);
}

/*
 * Destroy right after a flush that met a copy still queued (gate opened
 * later): destroy's own bound writes the acknowledgement, nothing leaks.
 */
static void flush_then_destroy(struct fixture *f, int device_table)
{
    vmmt_consumer *c2;
    struct gate g;
    vmmt_desc d;

    make_pool(f, device_table, 1, 2);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &c2));
    d = landed(f, 8);
    gate_close(&g, f->stream);
    assert_vmmt_ok(consume_at(c2, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_consumer_flush(c2));
    gate_open_later(&g, 50);
    vmmt_consumer_destroy(c2);
    gate_free(&g);
    assert_true(holds(f->stream, f->dst, 8));
    PROMISE(settle(f->pool, BOUND_MS) == 0, "destroy after a flush lost the acknowledgement");
}

static void test_flush_then_destroy_host(void **state)
{
    flush_then_destroy(*state, 0);
}

static void test_flush_then_destroy_device(void **state)
{
    flush_then_destroy(*state, 1);
}

/* ------------------------------------------------- threads that consume */

struct worker {
    vmmt_pool *pool;
    vmmt_consumer *c;
    CUdeviceptr src, dst;
    int index;
    pthread_t t;
    char err[512]; /* the first thing that went wrong */
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    const struct vmmt_drv *dr = vmmt__drv();
    uint8_t *h = malloc(N);
    vmmt_buffer b = bytes(w->src, N);
    CUstream s;

    vmmt__ctx_enter(0);
    if (dr->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        snprintf(w->err, sizeof w->err, "stream");
        goto out;
    }
    for (uint32_t r = 0; r < 120 && w->err[0] == '\0'; r++) {
        uint32_t pat = (uint32_t)(w->index * 16) + r % 16 + 1;
        vmmt_desc d;
        int st = VMMT_EFULL;

        tu_pattern_fill(h, N, pat);
        dr->cuMemcpyHtoDAsync(w->src, h, N, s);
        dr->cuStreamSynchronize(s);
        for (int k = 0; k < BOUND_MS && (st = vmmt_publish(w->pool, &b, s, &d)) == VMMT_EFULL; k++)
            sleep_ms(1);
        if (st != VMMT_OK) {
            snprintf(w->err, sizeof w->err, "round %u: publish %d (%s): an acknowledgement lost?",
                     r, st, vmmt_last_error());
            break;
        }
        if (r % 7 == 3) {
            st = vmmt_consumer_ack(w->c, &d, 0, s, VMMT_ALL_RANKS, 0);
        } else {
            st = vmmt_consume(w->c, &d, 0, w->dst, N, s, VMMT_ALL_RANKS, 0);
        }
        if (st != VMMT_OK) {
            snprintf(w->err, sizeof w->err, "round %u: consume %d (%s)", r, st, vmmt_last_error());
            break;
        }
        dr->cuStreamSynchronize(s);
        if (r & 1) vmmt_consumer_flush(w->c);
        if (r % 7 == 3) continue;
        memset(h, 0, N);
        dr->cuMemcpyDtoHAsync(h, w->dst, N, s);
        dr->cuStreamSynchronize(s);
        if (tu_pattern_check(h, N, pat) != N)
            snprintf(w->err, sizeof w->err, "round %u: wrong bytes with consume OK", r);
        else if ((st = vmmt_consumer_check(w->c, &d)) != VMMT_OK)
            snprintf(w->err, sizeof w->err, "round %u: check %d (%s)", r, st, vmmt_last_error());
    }
    dr->cuStreamDestroy(s);
out:
    vmmt__ctx_leave();
    free(h);
    return NULL;
}

/*
 * Three threads publish and consume (or drop) at once through one consumer,
 * flushing every other round, with two more threads flushing without pause:
 * the pool of 4 slices never stays full (an acknowledgement lost), every
 * destination holds its own buffer, every check says OK.
 */
static void threads(struct fixture *f, int kind)
{
    enum { W = 3 };
    struct worker w[W];
    struct flush_loop l[2];

    make_pool(f, kind, 1, 4);
    for (int i = 0; i < 2; i++)
        flush_loop_start(&l[i], f->consumer);
    for (int k = 0; k < W; k++) {
        memset(&w[k], 0, sizeof w[k]);
        w[k].pool = f->pool;
        w[k].c = f->consumer;
        w[k].src = f->src + (CUdeviceptr)(16 + k) * N;
        w[k].dst = f->dst + (CUdeviceptr)(16 + k) * N;
        w[k].index = k;
        assert_int_equal(pthread_create(&w[k].t, NULL, worker_main, &w[k]), 0);
    }
    for (int k = 0; k < W; k++)
        pthread_join(w[k].t, NULL);
    for (int i = 0; i < 2; i++)
        flush_loop_stop(&l[i]);
    for (int k = 0; k < W; k++)
        PROMISE(w[k].err[0] == '\0', "thread %d: %s", k, w[k].err);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    PROMISE(settle(f->pool, BOUND_MS) == 0, "slices owed after every copy was synchronized");
}

/*
 * An elastic pool whose chunks go back after 1 ms idle and are made again:
 * the consumer lets go of the old making at a consume, which must wait for
 * no copy a flush has not yet seen complete; flushes run throughout.
 */
static void test_elastic_churn(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = elastic_config(8 * MiB, 1);
    struct flush_loop l;

    c.memory_location = VMMT_MEMORY_DEVICE; /* whatever VMMT_TEST_POOL_KIND says */
    c.max_slices = 8;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    flush_loop_start(&l, f->consumer);
    for (uint32_t r = 0; r < 40; r++) {
        uint32_t pat = r % 60 + 1;
        vmmt_desc d = publish(f, pat);
        struct gate g;

        sync_s(f->stream);
        gate_close(&g, f->stream);
        assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
        gate_open_later(&g, r % 3);
        gate_free(&g);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        PROMISE(holds(f->stream, f->dst, pat), "round %u: wrong bytes", r);
        assert_vmmt_ok(vmmt_consumer_check(f->consumer, &d));
        PROMISE(settle(f->pool, BOUND_MS) == 0, "round %u: acknowledgement lost", r);
        sleep_ms(4); /* the chunk goes back */
    }
    flush_loop_stop(&l);
    print_message("chunks made %lu, released %lu\n", (unsigned long)stats(f->pool).chunks_made,
                  (unsigned long)stats(f->pool).chunks_released);
}

/* ----------------------------------------------------- the kinds of pool */

#define KIND_TESTS(fn)                                                                             \
    static void test_##fn##_fabric(void **state)                                                   \
    {                                                                                              \
        fn(*state, FABRIC);                                                                        \
    }                                                                                              \
    static void test_##fn##_host_pool(void **state)                                                \
    {                                                                                              \
        fn(*state, HOST_POOL);                                                                     \
    }                                                                                              \
    static void test_##fn##_elastic(void **state)                                                  \
    {                                                                                              \
        fn(*state, ELASTIC);                                                                       \
    }

KIND_TESTS(never_waits)
KIND_TESTS(later_work)
KIND_TESTS(hammer)
KIND_TESTS(many_in_flight)
KIND_TESTS(evict_race)
KIND_TESTS(released_and_reoccupied)
KIND_TESTS(two_consumers)
KIND_TESTS(flush_then_destroy)
KIND_TESTS(fault_sweep)
KIND_TESTS(failed_copy)
KIND_TESTS(other_device)

static void threads_all(struct fixture *f, int kind)
{
    threads(f, kind);
}

static void test_threads_host(void **state)
{
    threads_all(*state, HOST_TABLE);
}

static void test_threads_device(void **state)
{
    threads_all(*state, DEVICE_TABLE);
}

KIND_TESTS(threads_all)

static void event_query_fails_kind(struct fixture *f, int kind)
{
    if (!on_emu()) skip();
    event_query_fails(f, kind, "cuEventQuery:*:CUDA_ERROR_UNKNOWN");
}

KIND_TESTS(event_query_fails_kind)

static void packed_kind(struct fixture *f, int kind)
{
    for (int way = 0; way < 3; way++) {
        packed(f, kind, way);
        vmmt_pool_destroy(f->pool);
        f->pool = NULL;
    }
}

KIND_TESTS(packed_kind)

static void producer_shutdown_kind(struct fixture *f, int kind)
{
    producer_shutdown(f, kind);
}

static void test_producer_shutdown_host_pool(void **state)
{
    producer_shutdown_kind(*state, HOST_POOL);
}

static void test_producer_shutdown_elastic(void **state)
{
    producer_shutdown_kind(*state, ELASTIC);
}

#define KIND_ENTRIES(fn) T(test_##fn##_fabric), T(test_##fn##_host_pool), T(test_##fn##_elastic)

/* ------------------------------------------- dropped, and producer behind */

/*
 * A dropped descriptor (vmmt_consumer_ack) after its bytes landed, the
 * stream synchronized and a flush: the slice is free at once, as for a copy
 * (the producer that recycles right after, as sglang's tests do, drops too).
 */
static void dropped_at_once(struct fixture *f, int kind)
{
    int owed = 0;

    make_pool(f, kind, 1, 2);
    for (uint32_t r = 0; r < 50; r++) {
        vmmt_desc d = landed(f, r % 60 + 1);
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
        sync_s(f->stream);
        assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
        owed += in_flight_now(f->pool) != 0;
        PROMISE(settle(f->pool, BOUND_MS) == 0, "round %u: a drop's acknowledgement lost", r);
    }
    PROMISE(owed == 0, "%d of 50 drops still owed right after the synchronize and a flush", owed);
}

static void test_dropped_at_once_host(void **state)
{
    dropped_at_once(*state, HOST_TABLE);
}

static void test_dropped_at_once_device(void **state)
{
    dropped_at_once(*state, DEVICE_TABLE);
}

static void test_dropped_at_once_fabric(void **state)
{
    dropped_at_once(*state, FABRIC);
}

/*
 * The producer's own copy held behind a gate on its publish stream, so the
 * ready flag is not set when the consumer consumes (or, device table, drops):
 * the consumer's stream waits on the flag. A flush then must come back at
 * once and leave the slice; once the producer's copy landed and the
 * consumer's stream passed, a flush frees it and the bytes are the buffer.
 */
static void producer_behind(struct fixture *f, int kind, int drop)
{
    CUstream p;
    vmmt_buffer b = bytes(f->src, N);
    struct one_flush o;
    struct gate g;
    vmmt_desc d;
    int returned;
    uint32_t owed;

    make_pool(f, kind, 1, 2);
    p = new_stream();
    put_on(p, f->src, N, 33);
    gate_close(&g, p);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, p, &d));
    if (drop)
        assert_vmmt_ok(vmmt_consumer_ack(f->consumer, &d, 0, f->stream, VMMT_ALL_RANKS, 0));
    else
        assert_vmmt_ok(consume_at(f->consumer, &d, f->dst, f->stream, VMMT_ALL_RANKS, 0));
    one_flush_start(&o, f->consumer);
    returned = one_flush_wait(&o, BOUND_MS);
    owed = returned ? in_flight_now(f->pool) : 99;
    gate_open_later(&g, 0);
    one_flush_join(&o);
    gate_free(&g);
    sync_s(p);
    sync_s(f->stream);
    assert_vmmt_ok(vmmt_consumer_flush(f->consumer));
    uint32_t after = in_flight_now(f->pool);
    int own = drop || holds(f->stream, f->dst, 33);
    free_stream(p);
    PROMISE(returned, "flush waited for a copy queued behind the producer's flag");
    assert_vmmt_ok(o.st);
    PROMISE(owed == 1, "slice released before the producer's copy landed (%u in flight)", owed);
    PROMISE(own, "the consume's bytes are not the buffer");
    PROMISE(after == 0, "after the synchronize, the flush left the slice owed");
}

static void test_producer_behind_host(void **state)
{
    producer_behind(*state, HOST_TABLE, 0);
}

static void test_producer_behind_device(void **state)
{
    producer_behind(*state, DEVICE_TABLE, 0);
}

static void test_producer_behind_drop_device(void **state)
{
    producer_behind(*state, DEVICE_TABLE, 1);
}

static void test_producer_behind_host_pool(void **state)
{
    producer_behind(*state, HOST_POOL, 0);
}

static void test_producer_behind_elastic(void **state)
{
    producer_behind(*state, ELASTIC, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_flush_arguments_and_idle),
        T(test_dropped_at_once_host),
        T(test_dropped_at_once_device),
        T(test_dropped_at_once_fabric),
        T(test_producer_behind_host),
        T(test_producer_behind_device),
        T(test_producer_behind_drop_device),
        T(test_producer_behind_host_pool),
        T(test_producer_behind_elastic),
        T(test_never_waits_host),
        T(test_never_waits_device),
        T(test_later_work_host),
        T(test_later_work_device),
        T(test_event_query_fails_host),
        T(test_event_query_fails_device),
        T(test_event_query_fails_once_host),
        T(test_event_query_fails_once_device),
        T(test_fault_sweep_host),
        T(test_fault_sweep_device),
        T(test_three_write_failures_device),
        T(test_three_write_failures_fabric),
        T(test_three_read_failures_device),
        T(test_three_read_failures_fabric),
        T(test_three_query_failures_device),
        T(test_failed_copy_host),
        T(test_failed_copy_device),
        T(test_hammer_host),
        T(test_hammer_device),
        T(test_many_in_flight_host),
        T(test_many_in_flight_device),
        T(test_evict_race_host),
        T(test_evict_race_device),
        T(test_packed_host),
        T(test_packed_device),
        T(test_packed_drop_second_host),
        T(test_packed_drop_second_device),
        T(test_packed_drop_first_host),
        T(test_packed_drop_first_device),
        T(test_other_device_host),
        T(test_other_device_device),
        T(test_producer_shutdown_host),
        T(test_producer_shutdown_device),
        T(test_producer_killed_host),
        T(test_producer_killed_device),
        T(test_released_and_reoccupied_host),
        T(test_released_and_reoccupied_device),
        T(test_two_consumers_host),
        T(test_two_consumers_device),
        T(test_flush_then_destroy_host),
        T(test_flush_then_destroy_device),
        T(test_threads_host),
        T(test_threads_device),
        T(test_elastic_churn),
        T(test_producer_shutdown_host_pool),
        T(test_producer_shutdown_elastic),
        KIND_ENTRIES(never_waits),
        KIND_ENTRIES(later_work),
        KIND_ENTRIES(hammer),
        KIND_ENTRIES(many_in_flight),
        KIND_ENTRIES(evict_race),
        KIND_ENTRIES(released_and_reoccupied),
        KIND_ENTRIES(two_consumers),
        KIND_ENTRIES(flush_then_destroy),
        KIND_ENTRIES(fault_sweep),
        KIND_ENTRIES(failed_copy),
        KIND_ENTRIES(other_device),
        KIND_ENTRIES(threads_all),
        KIND_ENTRIES(event_query_fails_kind),
        KIND_ENTRIES(packed_kind),
    };
    tu_use_test_driver();
    if (getenv("ATK_FILTER") != NULL) cmocka_set_test_filter(getenv("ATK_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
