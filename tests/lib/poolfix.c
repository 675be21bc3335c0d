#include "poolfix.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
#include <time.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "emu.h"
#include "pattern.h"
#include "pool_internal.h"

int on_emu(void)
{
    return strcmp(vmmt_driver_name(), "emu") == 0;
}

void emu_reset(void)
{
    if (!on_emu()) return;
    unsetenv("VMMT_EMU_FAIL");
    unsetenv("VMMT_EMU_HANDLES");
    unsetenv("VMMT_EMU_WAIT_IMPORTED");
    unsetenv("VMMT_EMU_WAIT_HOST");
    vmmt__emu_configure();
    vmmt_probe_reset();
}

void emu_fail(const char *spec)
{
    setenv("VMMT_EMU_FAIL", spec, 1);
    vmmt__emu_configure();
}

void emu_fail_without_kernel(const char *spec)
{
    char all[512];

    snprintf(all, sizeof all, "cuPointerGetAttributes:1:CUDA_ERROR_INVALID_VALUE,%s", spec);
    emu_fail(all);
}

vmmt_pool_config config(uint64_t size, int consumers)
{
    vmmt_pool_config c;
    vmmt_pool_config_init(&c);
    c.memory_size = size;
    c.consumer_count = consumers;
    c.max_slices = 64;
    if (pool_kind_host()) c.memory_location = VMMT_MEMORY_HOST;
    if (pool_kind_elastic()) {
        c.elastic = 1;
        c.chunk_size = 1 * MiB;
    }
    return c;
}

vmmt_pool_config elastic_config(uint64_t max, uint32_t idle_ms)
{
    vmmt_pool_config c = config(max, 1);
    c.elastic = 1;
    c.chunk_size = POOLFIX_CHUNK;
    c.idle_release_ms = idle_ms;
    return c;
}

int pool_kind_elastic(void)
{
    const char *k = getenv("VMMT_TEST_POOL_KIND");
    return k != NULL && strcmp(k, "elastic") == 0;
}

int pool_kind_host(void)
{
    const char *k = getenv("VMMT_TEST_POOL_KIND");
    return k != NULL && strcmp(k, "host") == 0;
}

int pool_setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    const struct vmmt_drv *d = vmmt__drv();

    emu_reset();
    /* Warm the probe cache and the primary context before counting resources. */
    vmmt_handle_type t;
    vmmt_select_handle_type(0, &t);
    vmmt__ctx_enter(0);
    tu_resources_take(&f->before);
    f->cap = 8 * MiB;
    assert_int_equal(d->cuStreamCreate(&f->stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(d->cuMemAlloc(&f->src, f->cap), CUDA_SUCCESS);
    assert_int_equal(d->cuMemAlloc(&f->dst, f->cap), CUDA_SUCCESS);
    assert_vmmt_ok(vmmt_consumer_create(NULL, &f->consumer));
    *state = f;
    return 0;
}

int pool_teardown(void **state)
{
    struct fixture *f = *state;
    const struct vmmt_drv *d = vmmt__drv();
    tu_resources before = f->before;

    emu_reset();
    d->cuStreamSynchronize(f->stream);
    vmmt_consumer_destroy(f->consumer);
    vmmt_pool_destroy(f->pool);
    d->cuMemFree(f->src);
    d->cuMemFree(f->dst);
    d->cuStreamDestroy(f->stream);
    free(f);
    vmmt__ctx_leave();
    tu_resources_check(&before);
    if (on_emu()) {
        assert_int_equal(vmmt__emu_live_allocations(), 0);
        assert_int_equal(vmmt__emu_live_mappings(), 0);
        assert_int_equal(vmmt__emu_live_reservations(), 0);
        assert_int_equal(vmmt__emu_live_streams(), 0);
        assert_int_equal(vmmt__emu_live_modules(), 0);
    }
    return 0;
}

/* Write buffer i's pattern at src + off. */
void put(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t *h = malloc(n);
    tu_pattern_fill(h, n, i);
    assert_int_equal(d->cuMemcpyHtoDAsync(at, h, n, f->stream), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    free(h);
}

void expect(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t *h = malloc(n);
    assert_int_equal(d->cuMemcpyDtoHAsync(h, at, n, f->stream), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
    assert_int_equal(tu_pattern_check(h, n, i), n);
    free(h);
}

vmmt_buffer bytes(CUdeviceptr p, size_t n)
{
    vmmt_buffer b;
    memset(&b, 0, sizeof b);
    b.ptr = p;
    b.nbytes = n;
    return b;
}

vmmt_pool_stats stats(vmmt_pool *p)
{
    vmmt_pool_stats s;
    assert_vmmt_ok(vmmt_pool_get_stats(p, &s));
    return s;
}

void tu_roundtrip(struct fixture *f, size_t n, uint32_t i)
{
    vmmt_buffer b = bytes(f->src, n);
    vmmt_desc d;

    put(f, f->src, n, i);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_consume(f->consumer, &d, 0, f->dst, f->cap, f->stream, VMMT_ALL_RANKS, 0));
    expect(f, f->dst, n, i);
}

void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static void *open_gate(void *arg)
{
    struct gate *g = arg;
    sleep_ms(g->delay_ms);
    vmmt__ctx_enter(0);
    /* A stream memory write: the waiting stream reads the word atomically too. */
    vmmt__drv()->cuStreamWriteValue32(g->stream, g->word, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
    vmmt__drv()->cuStreamSynchronize(g->stream);
    vmmt__ctx_leave();
    return NULL;
}

/* Make `blocked` wait until the gate opens. */
void gate_close(struct gate *g, CUstream blocked)
{
    const struct vmmt_drv *d = vmmt__drv();
    g->blocked = blocked;
    assert_int_equal(d->cuMemAlloc(&g->word, 4096), CUDA_SUCCESS);
    assert_int_equal(d->cuMemsetD8Async(g->word, 0, 4, blocked), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamSynchronize(blocked), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamCreate(&g->stream, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    assert_int_equal(d->cuStreamWaitValue32(blocked, g->word, 1, CU_STREAM_WAIT_VALUE_GEQ),
                     CUDA_SUCCESS);
}

void gate_open_later(struct gate *g, long delay_ms)
{
    g->delay_ms = delay_ms;
    pthread_create(&g->thread, NULL, open_gate, g);
}

/* The blocked stream must be past its wait before the word goes away. */
void gate_free(struct gate *g)
{
    pthread_join(g->thread, NULL);
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(g->blocked), CUDA_SUCCESS);
    vmmt__drv()->cuStreamDestroy(g->stream);
    vmmt__drv()->cuMemFree(g->word);
}

/* Consumer processes (tests/children/consumer_child.c) on a socket pair. */
void spawn_consumer(int device, int first, int count, int *sock, pid_t *pid)
{
    int sv[2];
    char dev[16], a[16], b[16];
    char *argv[] = {dev, a, b, NULL};

    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    snprintf(dev, sizeof dev, "%d", device);
    snprintf(a, sizeof a, "%d", first);
    snprintf(b, sizeof b, "%d", count);
    *pid = tu_spawn("consumer_child", argv, sv[1]);
    assert_true(*pid > 0);
    close(sv[1]);
    *sock = sv[0];
}

void run_liveness_child(const char *mode, const char *arg)
{
    char *argv[] = {(char *)mode, (char *)arg, NULL};
    pid_t pid = tu_spawn("liveness_child", argv, -1);

    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 120000), 0);
}

void send_desc(int sock, uint32_t i, const vmmt_desc *d)
{
    struct tu_msg m;
    memset(&m, 0, sizeof m);
    m.index = i;
    if (d) memcpy(m.desc, d->bytes, sizeof m.desc);
    assert_int_equal(write(sock, &m, sizeof m), sizeof m);
}

int read_reply(int sock, uint32_t i)
{
    struct tu_reply r;
    assert_int_equal(read(sock, &r, sizeof r), sizeof r);
    assert_int_equal(r.index, i);
    return r.status;
}

void expect_reply(int sock, uint32_t i)
{
    assert_int_equal(read_reply(sock, i), VMMT_OK);
}

void reseal(vmmt_pool *p, vmmt_desc *d)
{
    vmmt__desc_seal(d->bytes, p->seal_key);
}

void sync_on(CUstream s)
{
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(s), CUDA_SUCCESS);
}

CUstream new_stream(void)
{
    CUstream s;

    assert_int_equal(vmmt__drv()->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
    return s;
}
