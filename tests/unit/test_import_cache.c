/*
 * The consumer's import cache: eviction never unmaps a pool under a copy
 * still queued out of it, teardown that fails can be retried, pools of dead
 * producers are let go. Runs on the emulator (and on a GPU with
 * VMMT_TEST_DRIVER=cuda, where the cases that need fault injection skip).
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "status.h"
#include "testutil.h"

static vmmt_consumer *one_pool_consumer(void)
{
    vmmt_consumer_config cc;
    vmmt_consumer *c;

    vmmt_consumer_config_init(&cc);
    cc.max_pools = 1;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &c));
    return c;
}

/*
 * Caught (issue 8, defect 2): with max_pools reached, importing another pool
 * evicted one whose copy was still queued (a packed member consumed, the rest
 * of its group not yet): the queued copy read unmapped memory, and the
 * group's progress was lost.
 */
static void test_no_eviction_under_queued_copy(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_consumer *one = one_pool_consumer();
    vmmt_pool *second;
    vmmt_buffer b[2] = {bytes(f->src, 4096), bytes(f->src + 8192, 4096)};
    vmmt_desc pd[2], other;
    CUstream s2;
    struct gate g;

    put(f, b[0].ptr, 4096, 10);
    put(f, b[1].ptr, 4096, 11);
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_pool_create(&c, &second));
    assert_int_equal(d->cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, pd));
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    gate_close(&g, f->stream); /* the member's copy stays queued */
    assert_vmmt_ok(vmmt_consume(one, &pd[0], 0, f->dst, 8192, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_publish(second, &b[0], s2, &other));
    assert_vmmt_ok(vmmt_consume(one, &other, 0, f->dst + 65536, 8192, s2, VMMT_ALL_RANKS, 0));
    assert_int_equal(d->cuStreamSynchronize(s2), CUDA_SUCCESS);
    gate_open_later(&g, 20);
    gate_free(&g); /* the stream must have run its copy out of a mapped pool */
    expect(f, f->dst, 4096, 10);
    /* The group's progress survived: the second member completes it. */
    assert_vmmt_ok(vmmt_consume(one, &pd[1], 0, f->dst + 8192, 8192, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst + 8192, 4096, 11);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).recycled, 1);
    assert_vmmt_ok(vmmt_pool_drain(second, 5000));
    vmmt_consumer_destroy(one);
    vmmt_pool_destroy(second);
    d->cuStreamDestroy(s2);
}

/*
 * Caught (issue 8, defect 8): a failed cuMemUnmap during eviction left the
 * pool cached half released (its control table gone), and a later consume
 * of it read address 0. Now the pool leaves the cache first; its teardown is
 * retried, and a later descriptor of it imports it afresh.
 */
static void test_failed_unmap_on_eviction_is_retried(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_consumer *one = one_pool_consumer();
    vmmt_pool *second;
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    if (!on_emu()) skip();
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_pool_create(&c, &second));
    put(f, f->src, 4096, 3);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(one, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    emu_fail("cuMemUnmap:1:CUDA_ERROR_UNKNOWN"); /* the eviction's unmap */
    assert_vmmt_ok(vmmt_publish(second, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(one, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__emu_calls("cuMemUnmap"), 1);
    emu_reset();
    assert_vmmt_ok(vmmt_pool_drain(second, 5000));
    /* The first pool again: imported afresh, right bytes. */
    put(f, f->src, 4096, 4);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(one, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 4);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    vmmt_consumer_destroy(one); /* releases the retired import too: the fixture counts */
    vmmt_pool_destroy(second);
}

/* Beyond max_pools, a pool with a device control table is let go too once its copies are done. */
static void test_device_table_pool_evicted(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_consumer *one = one_pool_consumer();
    vmmt_pool *second;
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d;

    c.device_control_table = 1;
    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    assert_vmmt_ok(vmmt_pool_create(&c, &second));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(one, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_publish(second, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(one, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    assert_int_equal(vmmt_consumer_pool_count(one), 1);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_pool_drain(second, 5000));
    vmmt_consumer_destroy(one);
    vmmt_pool_destroy(second);
}

/*
 * Caught (issue 16, defect 15): eviction ran only after a consume that
 * succeeded, so consumes that failed once their pool was imported (stale
 * descriptors here) left 8 pools imported with max_pools = 4 (32 in the
 * report), each holding its mapping. Every import evicts now.
 */
static void test_eviction_after_failed_consumes(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_consumer_config cc;
    vmmt_consumer *four;
    vmmt_pool *pools[8];
    vmmt_buffer b = bytes(f->src, 4096);

    vmmt_consumer_config_init(&cc);
    cc.max_pools = 4;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &four));
    c.max_slices = 1;
    for (int i = 0; i < 8; i++) {
        vmmt_desc stale, d;
        assert_vmmt_ok(vmmt_pool_create(&c, &pools[i]));
        assert_vmmt_ok(vmmt_publish(pools[i], &b, f->stream, &stale));
        assert_vmmt_ok(
            vmmt_consume(f->consumer, &stale, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
        assert_vmmt_ok(vmmt_pool_drain(pools[i], 5000));
        /* Its one slot has a new occupant: `four` imports the pool, then refuses `stale`. */
        assert_vmmt_ok(vmmt_publish(pools[i], &b, f->stream, &d));
        assert_int_equal(
            vmmt_consume(four, &stale, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
            VMMT_ESTATE);
        assert_true(vmmt_consumer_pool_count(four) <= 4);
    }
    vmmt_consumer_destroy(four);
    for (int i = 0; i < 8; i++)
        vmmt_pool_destroy(pools[i]); /* each with its second descriptor unconsumed */
}

static int wait_pool_count(vmmt_consumer *c, int want, int ms);

/*
 * Caught (issue 16, defect 15): a pool whose producer shut it down (the
 * producer lives on) stayed imported, its memory pinned by the mapping,
 * until max_pools evicted it. Its liveness link hangs up: it is let go once
 * idle, and its descriptors fail with VMMT_ECLOSED.
 */
static void test_pool_let_go_after_producer_shutdown(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = config(4 * MiB, 1);
    vmmt_buffer b = bytes(f->src, 4096);
    vmmt_desc d, late;
    int allocations;

    assert_vmmt_ok(vmmt_pool_create(&c, &f->pool));
    put(f, f->src, 4096, 6);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &late));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 6);
    assert_int_equal(vmmt_consumer_pool_count(f->consumer), 1);
    allocations = on_emu() ? vmmt__emu_live_allocations() : 0;
    assert_vmmt_ok(vmmt_pool_shutdown(f->pool));
    assert_int_equal(wait_pool_count(f->consumer, 0, 20000), 0);
    /* The producer's allocation, then this process's import of it: both gone. */
    if (on_emu()) assert_true(vmmt__emu_live_allocations() <= allocations - 2);
    assert_int_equal(
        vmmt_consume(f->consumer, &late, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ECLOSED);
    assert_error_contains("shut its pool down");
}

/* ------------------------------------------------------ dead producers */

struct producer {
    pid_t pid;
    int sock;
    vmmt_desc d[3]; /* landed, landed, queued behind a wait that never opens */
};

static void spawn_producer(struct producer *p, int device_table)
{
    int sv[2];
    char arg[4];
    char *argv[] = {arg, NULL};

    snprintf(arg, sizeof arg, "%d", device_table);
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    p->pid = tu_spawn("producer_child", argv, sv[1]);
    assert_true(p->pid > 0);
    close(sv[1]);
    p->sock = sv[0];
    for (uint32_t i = 0; i < 3; i++) {
        struct tu_msg m;
        assert_int_equal(read(p->sock, &m, sizeof m), sizeof m);
        assert_int_equal(m.index, i + 1);
        memcpy(p->d[i].bytes, m.desc, sizeof p->d[i].bytes);
    }
}

static void kill_producer(struct producer *p)
{
    kill(p->pid, SIGKILL);
    assert_int_equal(tu_wait(p->pid, 5000), -1);
    close(p->sock);
}

static int wait_pool_count(vmmt_consumer *c, int want, int ms)
{
    for (int i = 0; i < ms && vmmt_consumer_pool_count(c) != want; i++)
        sleep_ms(1);
    return vmmt_consumer_pool_count(c);
}

/*
 * Caught (issue 9): a producer killed between enqueuing its copy and its
 * ready flag left the consumer's stream waiting on a flag nobody would set
 * (the emulator fails it with CUDA_ERROR_TIMEOUT after 10 s; a GPU waits for
 * ever), consumes of its pool went on, and its pool stayed mapped.
 */
static void dead_producer(struct fixture *f, int device_table)
{
    struct producer p;
    double t0;

    spawn_producer(&p, device_table);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &p.d[0], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, 4096, 1);
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &p.d[0]));
    /* The copy waits on the stream for a ready flag the producer will never set. */
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &p.d[2], 0, f->dst + 8192, 8192, f->stream, VMMT_ALL_RANKS, 0));
    t0 = vmmt__now_us();
    kill_producer(&p);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    print_message("%s table: consumer stream free %.1f ms after the producer was killed\n",
                  device_table ? "device" : "host", (vmmt__now_us() - t0) / 1e3);
    assert_true(vmmt__now_us() - t0 < 3e6);
    assert_int_equal(vmmt_consumer_check(f->consumer, &p.d[2]), VMMT_EFAILED);
    assert_error_contains("exited before the bytes of this descriptor");
    assert_vmmt_ok(vmmt_consumer_check(f->consumer, &p.d[0]));
    assert_int_equal(vmmt_consumer_check(NULL, &p.d[0]), VMMT_EINVAL);
    assert_int_equal(vmmt_consumer_check(f->consumer, NULL), VMMT_EINVAL);
    p.d[0].bytes[300] ^= 0xff; /* corrupt */
    assert_int_equal(vmmt_consumer_check(f->consumer, &p.d[0]), VMMT_EPROTO);
    p.d[0].bytes[300] ^= 0xff;
    assert_int_equal(
        vmmt_consume(f->consumer, &p.d[1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ECLOSED);
    assert_error_contains("has exited");
    /* Let go once its copies are done; what failed is still known. */
    assert_int_equal(wait_pool_count(f->consumer, 0, 2000), 0);
    print_message("pool let go %.1f ms after the producer was killed\n",
                  (vmmt__now_us() - t0) / 1e3);
    assert_int_equal(vmmt_consumer_check(f->consumer, &p.d[2]), VMMT_EFAILED);
    assert_int_equal(
        vmmt_consume(f->consumer, &p.d[1], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0),
        VMMT_ECLOSED);
}

static void test_dead_producer_host_table(void **state)
{
    dead_producer(*state, 0);
}

static void test_dead_producer_device_table(void **state)
{
    dead_producer(*state, 1);
}

/*
 * Caught (issue 16, defect 14): with pidfds refused (pidfd_open by seccomp,
 * no SO_PEERPIDFD before Linux 6.5) a consumer never noticed its producer's
 * death although its liveness link had hung up: its stream stayed wedged,
 * vmmt_consumer_check said OK for bytes that never arrived, and nothing was
 * logged. The link's hang-up tells now, even where the producer forked a
 * worker that keeps what it inherited. The consumer runs in a child: the
 * filter cannot be lifted.
 */
static void test_dead_producer_without_pidfds_host_table(void **state)
{
    (void)state;
    run_liveness_child("producer-dies", "0");
}

static void test_dead_producer_without_pidfds_device_table(void **state)
{
    (void)state;
    run_liveness_child("producer-dies", "1");
}

/*
 * Caught (issue 16, defect 3): the first consumer to see its producer dead
 * set the ready word so that stream waits finish, and wrote the generation
 * itself there: every other consumer of the pool then took the slice for
 * landed, and vmmt_consumer_check told it OK for bytes that never came. The
 * word says ABANDONED now, which every consumer can tell apart.
 */
static void dead_producer_every_consumer(struct fixture *f, int device_table)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_consumer *other, *late;
    struct producer p;
    CUstream s2;

    assert_int_equal(d->cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &other));
    spawn_producer(&p, device_table);
    /* Two processes' worth of consumers, one per rank, wait for the same copy, which never
     * lands. */
    assert_vmmt_ok(vmmt_consume(f->consumer, &p.d[2], 0, f->dst, f->cap, f->stream, 0, 1));
    assert_vmmt_ok(vmmt_consume(other, &p.d[2], 0, f->dst + 8192, 8192, s2, 1, 1));
    kill_producer(&p);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamSynchronize(s2), CUDA_SUCCESS);
    assert_int_equal(vmmt_consumer_check(f->consumer, &p.d[2]), VMMT_EFAILED);
    assert_int_equal(vmmt_consumer_check(other, &p.d[2]), VMMT_EFAILED);
    /* A consumer that comes later is refused too, whichever way it learns it. */
    assert_vmmt_ok(vmmt_consumer_create(NULL, &late));
    assert_int_not_equal(
        vmmt_consume(late, &p.d[2], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0), VMMT_OK);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    vmmt_consumer_destroy(late);
    vmmt_consumer_destroy(other);
    assert_int_equal(d->cuStreamDestroy(s2), CUDA_SUCCESS);
    assert_int_equal(wait_pool_count(f->consumer, 0, 2000), 0);
}

static void test_dead_producer_every_consumer_host_table(void **state)
{
    dead_producer_every_consumer(*state, 0);
}

static void test_dead_producer_every_consumer_device_table(void **state)
{
    dead_producer_every_consumer(*state, 1);
}

/* Caught (issue 9): destroy waited behind a stream wedged by a dead producer. */
static void test_destroy_bounded_after_producer_death(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer_config cc;
    struct producer p;
    double t0;

    vmmt_consumer_destroy(f->consumer);
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 1000;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &f->consumer));
    spawn_producer(&p, 0);
    assert_vmmt_ok(
        vmmt_consume(f->consumer, &p.d[2], 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    kill_producer(&p);
    t0 = vmmt__now_us();
    vmmt_consumer_destroy(f->consumer); /* sets the dead producer's flag, then finishes */
    assert_true(vmmt__now_us() - t0 < 1500e3);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &f->consumer));
}

struct killer {
    pid_t pid;
    long delay_ms;
    pthread_t thread;
};

static void *kill_later(void *arg)
{
    struct killer *k = arg;
    sleep_ms(k->delay_ms);
    kill(k->pid, SIGKILL);
    return NULL;
}

/*
 * The legacy stream: a consume whose wait on it blocks (the emulator runs
 * the NULL stream on the caller's thread, as a synchronous GPU call would
 * block) returns once the producer is found dead; destroy stays bounded.
 */
static void test_dead_producer_null_stream(void **state)
{
    struct fixture *f = *state;
    vmmt_consumer_config cc;
    struct producer p;
    struct killer k;
    double t0;

    if (!on_emu()) skip(); /* on a GPU the NULL stream does not block the call */
    vmmt_consumer_destroy(f->consumer);
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = 1000;
    assert_vmmt_ok(vmmt_consumer_create(&cc, &f->consumer));
    spawn_producer(&p, 0);
    k.pid = p.pid;
    k.delay_ms = 100;
    pthread_create(&k.thread, NULL, kill_later, &k);
    t0 = vmmt__now_us();
    assert_vmmt_ok(vmmt_consume(f->consumer, &p.d[2], 0, f->dst, f->cap, NULL, VMMT_ALL_RANKS, 0));
    assert_true(vmmt__now_us() - t0 < 2e6);
    pthread_join(k.thread, NULL);
    assert_int_equal(vmmt_consumer_check(f->consumer, &p.d[2]), VMMT_EFAILED);
    assert_int_equal(tu_wait(p.pid, 5000), -1);
    close(p.sock);
    t0 = vmmt__now_us();
    vmmt_consumer_destroy(f->consumer);
    assert_true(vmmt__now_us() - t0 < 1500e3);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &f->consumer));
}

/*
 * Caught (issue 9): destroy waited for the events of copies behind a stream
 * that never moves (on the emulator until its wait timeout, here 5 s; on a
 * GPU for ever). In a child process: the mapping it keeps is leaked on
 * purpose.
 */
static void test_destroy_bounded_with_wedged_stream(void **state)
{
    char arg[] = "300";
    char *argv[] = {arg, NULL};
    pid_t pid;

    (void)state;
    setenv("VMMT_EMU_WAIT_TIMEOUT_MS", "5000", 1);
    pid = tu_spawn("wedged_consumer", argv, -1);
    unsetenv("VMMT_EMU_WAIT_TIMEOUT_MS");
    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 4000), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        /* clang-format off */
        T(test_no_eviction_under_queued_copy),
        T(test_failed_unmap_on_eviction_is_retried),
        T(test_device_table_pool_evicted),
        T(test_eviction_after_failed_consumes),
        T(test_pool_let_go_after_producer_shutdown),
        T(test_dead_producer_host_table),
        T(test_dead_producer_device_table),
        T(test_dead_producer_every_consumer_host_table),
        T(test_dead_producer_every_consumer_device_table),
        T(test_dead_producer_without_pidfds_host_table),
        T(test_dead_producer_without_pidfds_device_table),
        T(test_destroy_bounded_after_producer_death),
        T(test_dead_producer_null_stream),
        T(test_destroy_bounded_with_wedged_stream),
        /* clang-format on */
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
