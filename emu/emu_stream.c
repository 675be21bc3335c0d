/*
 * Emulated streams and events. Each stream owns one worker thread that runs
 * its operations in order; enqueue only checks the arguments, as the driver
 * does, and returns. The NULL stream runs its operation on the caller's
 * thread after the context's blocking streams drained (legacy default-stream
 * semantics). A failing operation makes its stream's error sticky.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "emu.h"
#include "emu_internal.h"

#define STACK_SIZE  ((size_t)1 << 20)
#define POLL_MIN_NS 1000L
#define POLL_MAX_NS 200000L

/* Wait conditions of cuStreamWaitValue32 (cuda.h values). */
enum { WAIT_GEQ = 0x0, WAIT_EQ = 0x1, WAIT_AND = 0x2, WAIT_NOR = 0x3, WAIT_FLUSH = 1 << 30 };
enum { WRITE_NO_MEMORY_BARRIER = 0x1 };
enum { EVENT_FLAGS = 0x7 }; /* blocking sync, disable timing, interprocess */
/* Handles of the legacy and per-thread default streams, which act as the NULL stream. */
#define STREAM_LEGACY     ((CUstream)0x1)
#define STREAM_PER_THREAD ((CUstream)0x2)

enum op_kind {
    OP_COPY,
    OP_MEMSET,
    OP_WAIT_VALUE,
    OP_WRITE_VALUE,
    OP_RECORD,
    OP_WAIT_EVENT,
    OP_KERNEL /* the one kernel the emulator knows (emu_module.c): a copy, then a word */
};

struct CUevent_st {
    struct CUevent_st *next; /* live list */
    unsigned flags;
    int device;
    atomic_int refs; /* the handle, plus one per queued operation */
    /* Under g_ev_mu: */
    uint64_t recorded; /* number of the latest record enqueued */
    uint64_t done;     /* number of the latest record completed */
    uint64_t t_ns;
    CUresult error;
};

struct emu_op {
    struct emu_op *next;
    enum op_kind kind;
    int device; /* the accessing device, for checks when the stream reaches it */
    uintptr_t dst, src;
    size_t n;
    uintptr_t word; /* OP_KERNEL: where `value` goes once the copy is done */
    int dst_is_dev, src_is_dev;
    unsigned char byte;
    uint32_t value;
    unsigned flags;
    int timeout_ms;
    struct CUevent_st *event;
    uint64_t seq;
};

struct CUstream_st {
    struct CUstream_st *next; /* live list */
    int device;
    unsigned flags;
    atomic_int refs; /* the handle, plus one per call using it */
    pthread_t thread;
    void *stack;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    /* Under mu: */
    struct emu_op *head, *tail;
    struct emu_op *done; /* finished, freed by the next call on the stream */
    uint64_t enqueued, completed;
    CUresult error;
    int stopping;
};

static struct CUstream_st *g_streams; /* under the emulator mutex */
static struct CUevent_st *g_events;
static int g_n_streams, g_n_events;
static pthread_mutex_t g_ev_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_ev_cv = PTHREAD_COND_INITIALIZER;

int vmmt__emu_live_streams(void)
{
    int n;

    vmmt__emu_lock();
    n = g_n_streams;
    vmmt__emu_unlock();
    return n;
}

int vmmt__emu_live_events(void)
{
    int n;

    vmmt__emu_lock();
    n = g_n_events;
    vmmt__emu_unlock();
    return n;
}

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static int is_null_stream(CUstream s)
{
    return s == NULL || s == STREAM_LEGACY || s == STREAM_PER_THREAD;
}

/* ------------------------------------------------------- handle lookup */

/* A counted reference to a live stream; *out NULL for the NULL stream. */
static CUresult stream_get(CUstream hs, struct CUstream_st **out)
{
    struct CUstream_st *s;

    *out = NULL;
    if (is_null_stream(hs)) return CUDA_SUCCESS;
    vmmt__emu_lock();
    for (s = g_streams; s != NULL && s != hs; s = s->next) {
    }
    if (s != NULL) atomic_fetch_add(&s->refs, 1);
    vmmt__emu_unlock();
    *out = s;
    return s != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static void stream_put(struct CUstream_st *s)
{
    if (s == NULL || atomic_fetch_sub(&s->refs, 1) != 1) return;
    pthread_cond_destroy(&s->done_cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static CUresult event_get(CUevent he, struct CUevent_st **out)
{
    struct CUevent_st *e;

    vmmt__emu_lock();
    for (e = g_events; e != NULL && e != he; e = e->next) {
    }
    if (e != NULL) atomic_fetch_add(&e->refs, 1);
    vmmt__emu_unlock();
    *out = e;
    return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static void event_put(struct CUevent_st *e)
{
    if (e != NULL && atomic_fetch_sub(&e->refs, 1) == 1) free(e);
}

static void free_op(struct emu_op *op)
{
    event_put(op->event);
    free(op);
}

/* ------------------------------------------------------------ execution */

/* Re-check the op's device ranges now that it runs; memory read lock held. */
static CUresult ranges_still_valid(const struct emu_op *op, int dst_need)
{
    CUresult r = CUDA_SUCCESS;

    vmmt__emu_lock();
    if (op->dst_is_dev) r = vmmt__emu_range_check(op->dst, op->n, op->device, dst_need);
    if (r == CUDA_SUCCESS && op->src_is_dev)
        r = vmmt__emu_range_check(op->src, op->n, op->device, EMU_ACC_READ);
    vmmt__emu_unlock();
    /* Unmapped or freed after enqueue: on a GPU, a fault. */
    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

static CUresult run_memory_op(const struct emu_op *op)
{
    int need = op->kind == OP_WAIT_VALUE ? EMU_ACC_READ : EMU_ACC_WRITE;
    CUresult r;

    vmmt__emu_mem_read_lock();
    r = ranges_still_valid(op, need);
    if (r == CUDA_SUCCESS) {
        if (op->kind == OP_COPY)
            memmove((void *)op->dst, (const void *)op->src, op->n);
        else if (op->kind == OP_MEMSET)
            memset((void *)op->dst, op->byte, op->n);
        else
            __atomic_store_n((uint32_t *)op->dst, op->value, __ATOMIC_RELEASE);
    }
    vmmt__emu_mem_read_unlock();
    return r;
}

static int wait_met(uint32_t word, uint32_t v, unsigned flags)
{
    switch (flags & ~(unsigned)WAIT_FLUSH) {
    case WAIT_GEQ: return (int32_t)(word - v) >= 0;
    case WAIT_EQ: return word == v;
    case WAIT_AND: return (word & v) != 0;
    default: return ~(word | v) != 0;
    }
}

static CUresult load_word(const struct emu_op *op, uint32_t *word)
{
    CUresult r;

    vmmt__emu_mem_read_lock();
    r = ranges_still_valid(op, EMU_ACC_READ);
    if (r == CUDA_SUCCESS) *word = __atomic_load_n((const uint32_t *)op->dst, __ATOMIC_ACQUIRE);
    vmmt__emu_mem_read_unlock();
    return r;
}

/* Poll the word, backing off, until the condition holds or the timeout passes. */
static CUresult run_wait_value(const struct emu_op *op)
{
    uint64_t deadline = now_ns() + (uint64_t)op->timeout_ms * 1000000ULL;
    long delay = POLL_MIN_NS;

    for (;;) {
        uint32_t word;
        uint64_t now;
        struct timespec ts = {0, 0};
        CUresult r = load_word(op, &word);

        if (r != CUDA_SUCCESS) return r;
        if (wait_met(word, op->value, op->flags)) return CUDA_SUCCESS;
        /* A GPU would wait forever; the emulator must not. */
        if ((now = now_ns()) >= deadline) return CUDA_ERROR_TIMEOUT;
        ts.tv_nsec = (uint64_t)delay < deadline - now ? delay : (long)(deadline - now);
        nanosleep(&ts, NULL);
        delay = delay * 2 > POLL_MAX_NS ? POLL_MAX_NS : delay * 2;
    }
}

/* Complete record number seq of e, with the stream's error if it was skipped. */
static void complete_record(struct CUevent_st *e, uint64_t seq, CUresult error)
{
    uint64_t t = now_ns();

    pthread_mutex_lock(&g_ev_mu);
    if (seq > e->done) {
        e->done = seq;
        e->t_ns = t;
        e->error = error;
    }
    pthread_cond_broadcast(&g_ev_cv);
    pthread_mutex_unlock(&g_ev_mu);
}

static CUresult wait_record(struct CUevent_st *e, uint64_t seq)
{
    CUresult r;

    pthread_mutex_lock(&g_ev_mu);
    while (e->done < seq)
        pthread_cond_wait(&g_ev_cv, &g_ev_mu);
    r = e->error;
    pthread_mutex_unlock(&g_ev_mu);
    return r;
}

/*
 * The publish kernel: its bytes, then its word, as one operation. A kernel's
 * addresses are not checked at launch, so a bad one is found only here, as
 * on a GPU: a fault, which fails the stream.
 */
static CUresult run_kernel(const struct emu_op *op)
{
    CUresult r;

    vmmt__emu_mem_read_lock();
    r = ranges_still_valid(op, EMU_ACC_WRITE);
    vmmt__emu_lock();
    if (r == CUDA_SUCCESS && vmmt__emu_range_check(op->word, 4, op->device, EMU_ACC_WRITE) != 0)
        r = CUDA_ERROR_ILLEGAL_ADDRESS;
    vmmt__emu_unlock();
    if (r == CUDA_SUCCESS) {
        memmove((void *)op->dst, (const void *)op->src, op->n);
        /* The kernel fences its stores system-wide before the word (kernel_ptx.h). */
        __atomic_store_n((uint32_t *)op->word, op->value, __ATOMIC_RELEASE);
    }
    vmmt__emu_mem_read_unlock();
    return r;
}

static CUresult run_op(struct emu_op *op)
{
    switch (op->kind) {
    case OP_KERNEL: return run_kernel(op);
    case OP_WAIT_VALUE: return run_wait_value(op);
    case OP_RECORD: complete_record(op->event, op->seq, CUDA_SUCCESS); return CUDA_SUCCESS;
    case OP_WAIT_EVENT: return wait_record(op->event, op->seq);
    default: return run_memory_op(op);
    }
}

/* An op after a failure does nothing, but its event must still complete. */
static void skip_op(struct emu_op *op, CUresult error)
{
    if (op->kind == OP_RECORD) complete_record(op->event, op->seq, error);
}

/* Free what the worker finished. The worker itself never calls malloc or free:
 * glibc would give its thread a malloc arena, mappings that outlive the stream. */
static void reap(struct CUstream_st *s)
{
    struct emu_op *op;

    pthread_mutex_lock(&s->mu);
    op = s->done;
    s->done = NULL;
    pthread_mutex_unlock(&s->mu);
    while (op != NULL) {
        struct emu_op *next = op->next;
        free_op(op);
        op = next;
    }
}

static void *worker(void *arg)
{
    struct CUstream_st *s = arg;

    pthread_mutex_lock(&s->mu);
    for (;;) {
        struct emu_op *op;
        CUresult error, r = CUDA_SUCCESS;

        while (s->head == NULL && !s->stopping)
            pthread_cond_wait(&s->work_cv, &s->mu);
        if ((op = s->head) == NULL) break;
        if ((s->head = op->next) == NULL) s->tail = NULL;
        error = s->error;
        pthread_mutex_unlock(&s->mu);
        if (error != CUDA_SUCCESS)
            skip_op(op, error);
        else
            r = run_op(op);
        pthread_mutex_lock(&s->mu);
        op->next = s->done;
        s->done = op;
        if (r != CUDA_SUCCESS && s->error == CUDA_SUCCESS) s->error = r;
        s->completed++;
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* --------------------------------------------------- legacy NULL stream */

/* Counted references to the blocking streams of device; *n of them. */
static struct CUstream_st **blocking_streams(int device, int *n)
{
    struct CUstream_st **list;
    int cap;

    vmmt__emu_lock();
    cap = g_n_streams;
    list = calloc(cap > 0 ? (size_t)cap : 1, sizeof *list);
    *n = 0;
    for (struct CUstream_st *s = g_streams; s != NULL && list != NULL; s = s->next)
        if (s->device == device && !(s->flags & CU_STREAM_NON_BLOCKING)) {
            atomic_fetch_add(&s->refs, 1);
            list[(*n)++] = s;
        }
    vmmt__emu_unlock();
    return list;
}

static void put_all(struct CUstream_st **list, int n)
{
    for (int i = 0; i < n; i++)
        stream_put(list[i]);
    free(list);
}

static void drain(struct CUstream_st *s)
{
    uint64_t target;

    pthread_mutex_lock(&s->mu);
    target = s->enqueued;
    while (s->completed < target)
        pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Work on the legacy NULL stream starts after the blocking streams' earlier work. */
static void sync_legacy(int device)
{
    int n;
    struct CUstream_st **list = blocking_streams(device, &n);

    for (int i = 0; i < n; i++)
        drain(list[i]);
    put_all(list, n);
}

static int legacy_idle(int device)
{
    int n, idle = 1;
    struct CUstream_st **list = blocking_streams(device, &n);

    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&list[i]->mu);
        if (list[i]->completed < list[i]->enqueued) idle = 0;
        pthread_mutex_unlock(&list[i]->mu);
    }
    put_all(list, n);
    return idle;
}

/* ------------------------------------------------------------- enqueue */

/* Queue op on s, or run it now for the NULL stream. Takes op in all cases. */
static CUresult submit(struct CUstream_st *s, struct emu_op *op)
{
    CUresult r;

    if (s == NULL) {
        sync_legacy(op->device);
        if (op->kind == OP_RECORD) complete_record(op->event, op->seq, CUDA_SUCCESS);
        r = op->kind == OP_RECORD ? CUDA_SUCCESS : run_op(op);
        free_op(op);
        return r;
    }
    reap(s);
    pthread_mutex_lock(&s->mu);
    if ((r = s->error) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&s->mu);
        free_op(op);
        return r;
    }
    if (op->kind == OP_RECORD) {
        /* Numbered here, so that a refused record never leaves waiters behind. */
        pthread_mutex_lock(&g_ev_mu);
        op->seq = ++op->event->recorded;
        pthread_mutex_unlock(&g_ev_mu);
    }
    if (s->tail != NULL)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->enqueued++;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

/* Current device and stream of an enqueueing call. */
static CUresult begin(CUstream hs, int *device, struct CUstream_st **s)
{
    *s = NULL;
    if ((*device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return stream_get(hs, s);
}

/* Check op's device ranges at enqueue, then submit it; n == 0 does nothing. */
static CUresult enqueue_checked(CUstream hs, struct emu_op *op, int dst_need)
{
    struct CUstream_st *s;
    CUresult r;

    if ((r = begin(hs, &op->device, &s)) != CUDA_SUCCESS) goto out;
    if (op->n == 0) goto out;
    vmmt__emu_lock();
    if (op->dst_is_dev) r = vmmt__emu_range_check(op->dst, op->n, op->device, dst_need);
    if (r == CUDA_SUCCESS && op->src_is_dev)
        r = vmmt__emu_range_check(op->src, op->n, op->device, EMU_ACC_READ);
    vmmt__emu_unlock();
    if (r != CUDA_SUCCESS) goto out;
    r = submit(s, op);
    stream_put(s);
    return r;
out:
    stream_put(s);
    free_op(op);
    return r;
}

static struct emu_op *new_op(enum op_kind kind, uintptr_t dst, uintptr_t src, size_t n)
{
    struct emu_op *op = calloc(1, sizeof *op);

    if (op == NULL) return NULL;
    op->kind = kind;
    op->dst = dst;
    op->src = src;
    op->n = n;
    return op;
}

static CUresult copy(uintptr_t dst, int dst_is_dev, uintptr_t src, int src_is_dev, size_t n,
                     CUstream hs)
{
    struct emu_op *op;

    if ((!dst_is_dev && dst == 0) || (!src_is_dev && src == 0)) return CUDA_ERROR_INVALID_VALUE;
    if ((op = new_op(OP_COPY, dst, src, n)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    op->dst_is_dev = dst_is_dev;
    op->src_is_dev = src_is_dev;
    return enqueue_checked(hs, op, EMU_ACC_WRITE);
}

CUresult vmmt__emu_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs)
{
    EMU_ENTER(cuMemcpyDtoDAsync, 1);
    return copy(dst, 1, src, 1, n, hs);
}

CUresult vmmt__emu_cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream hs)
{
    EMU_ENTER(cuMemcpyHtoDAsync, 1);
    return copy(dst, 1, (uintptr_t)src, 0, n, hs);
}

CUresult vmmt__emu_cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream hs)
{
    EMU_ENTER(cuMemcpyDtoHAsync, 1);
    return copy((uintptr_t)dst, 0, src, 1, n, hs);
}

/* Unified addressing: each side is device or host memory by where it lies. */
CUresult vmmt__emu_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hs)
{
    int dst_dev, src_dev;

    EMU_ENTER(cuMemcpyAsync, 1);
    vmmt__emu_lock();
    dst_dev = vmmt__emu_is_device_memory(dst);
    src_dev = vmmt__emu_is_device_memory(src);
    vmmt__emu_unlock();
    return copy(dst, dst_dev, src, src_dev, n, hs);
}

CUresult vmmt__emu_cuMemsetD8Async(CUdeviceptr dst, unsigned char byte, size_t n, CUstream hs)
{
    struct emu_op *op;

    EMU_ENTER(cuMemsetD8Async, 1);
    if ((op = new_op(OP_MEMSET, dst, 0, n)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    op->dst_is_dev = 1;
    op->byte = byte;
    return enqueue_checked(hs, op, EMU_ACC_WRITE);
}

CUresult vmmt__emu_cuStreamWaitValue32(CUstream hs, CUdeviceptr addr, cuuint32_t value,
                                       unsigned int flags)
{
    unsigned cond = flags & ~(unsigned)WAIT_FLUSH;
    int wait_imported, imported, wait_host, host, timeout_ms;
    struct emu_op *op;

    EMU_ENTER(cuStreamWaitValue32, 1);
    if (cond > WAIT_NOR || addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    wait_imported = vmmt__emu_cfg()->wait_imported;
    timeout_ms = vmmt__emu_cfg()->wait_timeout_ms;
    imported = vmmt__emu_range_imported(addr, 4);
    wait_host = vmmt__emu_cfg()->wait_host;
    host = vmmt__emu_range_registered(addr, 4);
    vmmt__emu_unlock();
    /* Some platforms refuse waits on imported or host memory; the library must fall back. */
    if ((!wait_imported && imported) || (!wait_host && host)) return CUDA_ERROR_NOT_SUPPORTED;
    if ((op = new_op(OP_WAIT_VALUE, addr, 0, 4)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    op->dst_is_dev = 1;
    op->value = value;
    op->flags = flags;
    op->timeout_ms = timeout_ms;
    return enqueue_checked(hs, op, EMU_ACC_READ);
}

CUresult vmmt__emu_cuStreamWriteValue32(CUstream hs, CUdeviceptr addr, cuuint32_t value,
                                        unsigned int flags)
{
    struct emu_op *op;

    EMU_ENTER(cuStreamWriteValue32, 1);
    /* The H200's driver 580 refuses NO_MEMORY_BARRIER on host and device
     * memory alike (tests/gpu/RESULTS.md): so does the emulator. */
    if (flags != 0 || addr % 4 != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((op = new_op(OP_WRITE_VALUE, addr, 0, 4)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    op->dst_is_dev = 1;
    op->value = value;
    return enqueue_checked(hs, op, EMU_ACC_WRITE);
}

/* Enqueue the publish kernel's work on hs for device (emu_module.c checked the launch). */
CUresult vmmt__emu_enqueue_kernel(CUstream hs, int device, uintptr_t dst, uintptr_t src, size_t n,
                                  uintptr_t word, uint32_t value)
{
    struct CUstream_st *s;
    struct emu_op *op;
    int cur;
    CUresult r;

    if ((op = new_op(OP_KERNEL, dst, src, n)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    op->dst_is_dev = op->src_is_dev = 1;
    op->word = word;
    op->value = value;
    /* A module's kernel runs in its own context only: the current one, and the stream's. */
    if ((r = begin(hs, &cur, &s)) == CUDA_SUCCESS &&
        (cur != device || (s != NULL && s->device != device)))
        r = CUDA_ERROR_INVALID_HANDLE;
    op->device = device;
    if (r != CUDA_SUCCESS) {
        stream_put(s);
        free_op(op);
        return r;
    }
    r = submit(s, op);
    stream_put(s);
    return r;
}

/* -------------------------------------------------------------- streams */

/* The worker runs on a stack of our own, unmapped at destroy: glibc would cache its own. */
static int start_worker(struct CUstream_st *s)
{
    pthread_attr_t attr;
    int err;

    s->stack = mmap(NULL, STACK_SIZE, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (s->stack == MAP_FAILED) return ENOMEM;
    if ((err = pthread_attr_init(&attr)) != 0) goto fail_stack;
    err = pthread_attr_setstack(&attr, s->stack, STACK_SIZE);
    if (err == 0) err = pthread_create(&s->thread, &attr, worker, s);
    pthread_attr_destroy(&attr);
    if (err != 0) goto fail_stack;
    return 0;
fail_stack:
    munmap(s->stack, STACK_SIZE);
    return err;
}

static struct CUstream_st *new_stream(int device, unsigned flags)
{
    struct CUstream_st *s = calloc(1, sizeof *s);

    if (s == NULL) goto fail;
    s->device = device;
    s->flags = flags;
    atomic_init(&s->refs, 1);
    if (pthread_mutex_init(&s->mu, NULL) != 0) goto fail_s;
    if (pthread_cond_init(&s->work_cv, NULL) != 0) goto fail_mu;
    if (pthread_cond_init(&s->done_cv, NULL) != 0) goto fail_work;
    if (start_worker(s) != 0) goto fail_done;
    return s;
fail_done:
    pthread_cond_destroy(&s->done_cv);
fail_work:
    pthread_cond_destroy(&s->work_cv);
fail_mu:
    pthread_mutex_destroy(&s->mu);
fail_s:
    free(s);
fail:
    return NULL;
}

CUresult vmmt__emu_cuStreamCreate(CUstream *out, unsigned int flags)
{
    struct CUstream_st *s;
    int device;

    EMU_ENTER(cuStreamCreate, 1);
    if ((device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (out == NULL || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if ((s = new_stream(device, flags)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    vmmt__emu_lock();
    s->next = g_streams;
    g_streams = s;
    g_n_streams++;
    vmmt__emu_unlock();
    *out = s;
    return CUDA_SUCCESS;
}

static int unlink_stream(struct CUstream_st *s)
{
    int found = 0;

    vmmt__emu_lock();
    for (struct CUstream_st **pp = &g_streams; *pp != NULL; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            g_n_streams--;
            found = 1;
            break;
        }
    vmmt__emu_unlock();
    return found;
}

CUresult vmmt__emu_cuStreamDestroy(CUstream hs)
{
    struct CUstream_st *s;

    EMU_ENTER(cuStreamDestroy, 1);
    if (is_null_stream(hs) || stream_get(hs, &s) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_HANDLE;
    if (!unlink_stream(s)) {
        stream_put(s);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    /* Pending work runs to its end (waits are bounded), then the worker leaves. */
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    munmap(s->stack, STACK_SIZE);
    reap(s);
    stream_put(s); /* this call's */
    stream_put(s); /* the handle's */
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuStreamSynchronize(CUstream hs)
{
    struct CUstream_st *s;
    CUresult r;
    int device;

    EMU_ENTER(cuStreamSynchronize, 1);
    if (is_null_stream(hs)) {
        if ((device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
        sync_legacy(device);
        return CUDA_SUCCESS;
    }
    if ((r = stream_get(hs, &s)) != CUDA_SUCCESS) return r;
    drain(s);
    reap(s);
    pthread_mutex_lock(&s->mu);
    r = s->error;
    pthread_mutex_unlock(&s->mu);
    stream_put(s);
    return r;
}

CUresult vmmt__emu_cuStreamQuery(CUstream hs)
{
    struct CUstream_st *s;
    CUresult r;
    int device;

    EMU_ENTER(cuStreamQuery, 1);
    if (is_null_stream(hs)) {
        if ((device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
        return legacy_idle(device) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    }
    if ((r = stream_get(hs, &s)) != CUDA_SUCCESS) return r;
    reap(s);
    pthread_mutex_lock(&s->mu);
    r = s->error;
    if (r == CUDA_SUCCESS && s->completed < s->enqueued) r = CUDA_ERROR_NOT_READY;
    pthread_mutex_unlock(&s->mu);
    stream_put(s);
    return r;
}

CUresult vmmt__emu_cuStreamWaitEvent(CUstream hs, CUevent he, unsigned int flags)
{
    struct CUstream_st *s = NULL;
    struct CUevent_st *e;
    struct emu_op *op;
    CUresult r;

    EMU_ENTER(cuStreamWaitEvent, 1);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((r = event_get(he, &e)) != CUDA_SUCCESS) return r;
    if ((op = new_op(OP_WAIT_EVENT, 0, 0, 0)) == NULL) {
        event_put(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    op->event = e; /* the op owns the reference now */
    pthread_mutex_lock(&g_ev_mu);
    op->seq = e->recorded; /* the latest record at the time of the call */
    pthread_mutex_unlock(&g_ev_mu);
    op->device = vmmt__emu_current_device();
    if (is_null_stream(hs) && op->device < 0) r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS) r = stream_get(hs, &s);
    if (r != CUDA_SUCCESS) {
        free_op(op);
        return r;
    }
    r = submit(s, op);
    stream_put(s);
    return r;
}

/* --------------------------------------------------------------- events */

CUresult vmmt__emu_cuEventCreate(CUevent *out, unsigned int flags)
{
    struct CUevent_st *e;
    int device;

    EMU_ENTER(cuEventCreate, 1);
    if ((device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (out == NULL || (flags & ~(unsigned)EVENT_FLAGS) != 0) return CUDA_ERROR_INVALID_VALUE;
    if ((e = calloc(1, sizeof *e)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = flags;
    e->device = device;
    atomic_init(&e->refs, 1);
    vmmt__emu_lock();
    e->next = g_events;
    g_events = e;
    g_n_events++;
    vmmt__emu_unlock();
    *out = e;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuEventRecord(CUevent he, CUstream hs)
{
    struct CUstream_st *s = NULL;
    struct CUevent_st *e;
    struct emu_op *op;
    CUresult r;

    EMU_ENTER(cuEventRecord, 1);
    if ((r = event_get(he, &e)) != CUDA_SUCCESS) return r;
    if ((op = new_op(OP_RECORD, 0, 0, 0)) == NULL) {
        event_put(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    op->event = e;
    op->device = vmmt__emu_current_device();
    if (is_null_stream(hs) && op->device < 0) r = CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS) r = stream_get(hs, &s);
    /* An event records only on streams of its own device. */
    if (r == CUDA_SUCCESS && (s != NULL ? s->device : op->device) != e->device)
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r != CUDA_SUCCESS) {
        stream_put(s);
        free_op(op);
        return r;
    }
    if (s == NULL) {
        pthread_mutex_lock(&g_ev_mu);
        op->seq = ++e->recorded;
        pthread_mutex_unlock(&g_ev_mu);
    }
    r = submit(s, op);
    stream_put(s);
    return r;
}

CUresult vmmt__emu_cuEventQuery(CUevent he)
{
    struct CUevent_st *e;
    CUresult r;

    EMU_ENTER(cuEventQuery, 1);
    if ((r = event_get(he, &e)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&g_ev_mu);
    r = e->done < e->recorded ? CUDA_ERROR_NOT_READY : e->error;
    pthread_mutex_unlock(&g_ev_mu);
    event_put(e);
    return r;
}

CUresult vmmt__emu_cuEventSynchronize(CUevent he)
{
    struct CUevent_st *e;
    uint64_t seq;
    CUresult r;

    EMU_ENTER(cuEventSynchronize, 1);
    if ((r = event_get(he, &e)) != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&g_ev_mu);
    seq = e->recorded;
    pthread_mutex_unlock(&g_ev_mu);
    r = wait_record(e, seq);
    event_put(e);
    return r;
}

CUresult vmmt__emu_cuEventElapsedTime(float *ms, CUevent hstart, CUevent hend)
{
    struct CUevent_st *a, *b = NULL;
    CUresult r;

    EMU_ENTER(cuEventElapsedTime, 1);
    if (ms == NULL) return CUDA_ERROR_INVALID_VALUE;
    if ((r = event_get(hstart, &a)) != CUDA_SUCCESS) return r;
    if ((r = event_get(hend, &b)) != CUDA_SUCCESS) goto out;
    r = CUDA_ERROR_INVALID_HANDLE;
    if (((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) || a->device != b->device) goto out;
    pthread_mutex_lock(&g_ev_mu);
    if (a->recorded == 0 || b->recorded == 0)
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (a->done < a->recorded || b->done < b->recorded)
        r = CUDA_ERROR_NOT_READY;
    else if ((r = a->error) == CUDA_SUCCESS && (r = b->error) == CUDA_SUCCESS)
        *ms = (float)((double)((int64_t)(b->t_ns - a->t_ns)) / 1e6);
    pthread_mutex_unlock(&g_ev_mu);
out:
    event_put(b);
    event_put(a);
    return r;
}

CUresult vmmt__emu_cuEventDestroy(CUevent he)
{
    struct CUevent_st *e = NULL;

    EMU_ENTER(cuEventDestroy, 1);
    vmmt__emu_lock();
    for (struct CUevent_st **pp = &g_events; *pp != NULL; pp = &(*pp)->next)
        if (*pp == he) {
            e = *pp;
            *pp = e->next;
            g_n_events--;
            break;
        }
    vmmt__emu_unlock();
    /* Queued records and waits keep their own references, as the driver defers the free. */
    event_put(e);
    return e != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
