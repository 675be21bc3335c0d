/*
 * The model test's producer and consumer processes: each runs the real
 * library and answers the driver's commands (tests/model/proto.h) one at a
 * time on fd 3. They decide nothing: the driver holds the model and judges
 * every answer. Every wait here is bounded, so a library that hangs shows as
 * a late answer, which the driver reports.
 */
#include "children.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "proto.h"
#include "testutil.h"

static void sleep_us(long us)
{
    struct timespec t = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int on_emu(void)
{
    const char *n = vmmt_driver_name();
    return n != NULL && strcmp(n, "emu") == 0;
}

void mt_res_take(struct mt_res *r)
{
    r->fds = tu_count_fds();
    r->maps = tu_count_maps();
    r->threads = tu_count_threads();
    r->allocations = vmmt__emu_live_allocations();
    r->reservations = vmmt__emu_live_reservations();
    r->mappings = vmmt__emu_live_mappings();
    r->streams = vmmt__emu_live_streams();
    r->events = vmmt__emu_live_events();
    r->blocks = vmmt__emu_live_blocks();
    r->pools = 0;
}

/*
 * Back to `before`? Threads being joined take a moment to leave /proc, so
 * the counts are read again for up to 5 s before they are judged; for the
 * same reason a thread that was leaving when `before` was taken (the test
 * library's warm-up threads) may have been counted then, so fewer threads
 * now is no leak; under a sanitizer /proc's mapping count is not compared.
 * On the real driver, whose own descriptors, mappings and
 * threads come and go, they are reported, not judged (as the soak does).
 */
static int res_back(const struct mt_res *before, struct mt_res *after)
{
    double until = now_ms() + 5000;
    for (;;) {
        struct mt_res b = *before;
        mt_res_take(after);
        if (!on_emu()) return 1;
        if (after->threads < b.threads) b.threads = after->threads;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
        /* The sanitizers map quarantine and shadow memory as they go (as in
         * tests/lib/testutil.c): mapping counts mean nothing there, and the
         * emulator's own counters still judge device mappings. */
        b.maps = after->maps;
#endif
        if (memcmp(&b, after, sizeof *after) == 0) return 1;
        if (now_ms() > until) return 0;
        sleep_us(2000);
    }
}

static void reply_send(struct mt_reply *r)
{
    if (send(MT_CHILD_FD, r, sizeof *r, MSG_NOSIGNAL) != (ssize_t)sizeof *r) exit(0);
}

static int cmd_recv(struct mt_cmd *c)
{
    ssize_t n = recv(MT_CHILD_FD, c, sizeof *c, 0);
    return n == (ssize_t)sizeof *c;
}

static void note(struct mt_reply *r, int st)
{
    r->status = st;
    if (st != VMMT_OK) snprintf(r->msg, sizeof r->msg, "%s", vmmt_last_error());
}

static void die(const char *who, const char *what)
{
    fprintf(stderr, "model %s: %s: %s\n", who, what, vmmt_last_error());
    exit(3);
}

/* ------------------------------------------------------------- producer */

struct prod {
    vmmt_pool *pool;
    struct mt_params prm;
    const struct vmmt_drv *d;
    CUstream s, gs; /* publishes; the gate's opener */
    CUdeviceptr src, gsrc, gate;
    uint8_t *host; /* pageable staging, MT_MAX_MEMBERS units */
    int gated, shut;
    vmmt_reservation res[MT_MAX_RES];
    int committed[MT_MAX_RES];
    struct mt_res before;
};

static void buffer_of(vmmt_buffer *b, uint64_t ptr, uint64_t n, int typed, int location)
{
    memset(b, 0, sizeof *b);
    b->ptr = ptr;
    b->nbytes = n;
    b->location = location;
    if (typed) {
        b->dtype = (vmmt_dtype){.code = 2, .bits = 32, .lanes = 1};
        b->ndim = 1;
        b->shape[0] = (int64_t)(n / 4);
    }
}

/* Bytes of uid into device memory at `at`, on the publish stream, landed before return. */
static void fill_device(struct prod *p, CUdeviceptr at, uint8_t *stage, uint64_t n, uint64_t uid)
{
    mt_fill(stage, n, uid);
    if (p->d->cuMemcpyHtoDAsync(at, stage, n, p->s) != CUDA_SUCCESS ||
        p->d->cuStreamSynchronize(p->s) != CUDA_SUCCESS)
        die("producer", "fill");
}

static void p_create(struct prod *p, const struct mt_cmd *c, struct mt_reply *r)
{
    vmmt_pool_config cfg;
    uint64_t span = MT_MAX_MEMBERS * c->params.unit;

    p->prm = c->params;
    if (p->d->cuStreamCreate(&p->s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        p->d->cuStreamCreate(&p->gs, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        p->d->cuMemAlloc(&p->src, span) != CUDA_SUCCESS ||
        p->d->cuMemAlloc(&p->gsrc, span) != CUDA_SUCCESS ||
        p->d->cuMemAlloc(&p->gate, 4096) != CUDA_SUCCESS || (p->host = malloc(span)) == NULL)
        die("producer", "setup");
    mt_res_take(&p->before);
    vmmt_pool_config_init(&cfg);
    cfg.memory_size = p->prm.memory_size;
    cfg.consumer_count = p->prm.consumer_count;
    cfg.max_slices = (uint32_t)p->prm.max_slices;
    cfg.device_control_table = p->prm.device_table;
    cfg.handoff = (vmmt_handoff)p->prm.handoff;
    cfg.memory_location = (vmmt_memory_location)p->prm.memory_location;
    cfg.elastic = p->prm.elastic;
    cfg.chunk_size = p->prm.chunk_size;
    cfg.idle_release_ms = (uint32_t)p->prm.idle_release_ms;
    if (p->prm.fabric) {
        cfg.handle_type = VMMT_HANDLE_FABRIC;
        cfg.allow_posix_fallback = 0;
    }
    note(r, vmmt_pool_create(&cfg, &p->pool));
    if (r->status == VMMT_OK) note(r, vmmt_pool_get_stats(p->pool, &r->stats));
    r->before = p->before;
}

static void p_publish(struct prod *p, const struct mt_cmd *c, struct mt_reply *r)
{
    vmmt_buffer b[MT_MAX_MEMBERS];
    int gated = c->flags & MT_F_GATED;
    CUdeviceptr base = gated ? p->gsrc : p->src;
    double until = now_ms() + c->timeout_ms;
    uint64_t at = 0, kernels;
    int st;

    /* No copy of an earlier publish may still read the staging or the source. */
    if (!p->gated && p->d->cuStreamSynchronize(p->s) != CUDA_SUCCESS) die("producer", "sync");
    for (int m = 0; m < c->members; m++) {
        uint8_t *stage = p->host + at;
        if (c->flags & MT_F_HOSTSRC) {
            mt_fill(stage, c->nbytes[m], c->uid[m]);
            buffer_of(&b[m], (uint64_t)(uintptr_t)stage, c->nbytes[m], c->typed[m], VMMT_LOC_HOST);
        } else {
            fill_device(p, base + at, stage, c->nbytes[m], c->uid[m]);
            buffer_of(&b[m], base + at, c->nbytes[m], c->typed[m], VMMT_LOC_DEVICE);
        }
        at += c->nbytes[m];
    }
    if (gated) {
        /* Hold the stream: the copies and the ready flag stay queued until P_GATE_OPEN. */
        if (p->d->cuMemsetD8Async(p->gate, 0, 4, p->s) != CUDA_SUCCESS ||
            p->d->cuStreamSynchronize(p->s) != CUDA_SUCCESS ||
            p->d->cuStreamWaitValue32(p->s, p->gate, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
            die("producer", "gate");
        p->gated = 1;
    }
    if (vmmt_pool_get_stats(p->pool, &r->stats) != VMMT_OK) die("producer", "stats");
    kernels = r->stats.kernel_publishes;
    for (;;) {
        r->attempts++;
        st = c->members == 1 ? vmmt_publish(p->pool, b, p->s, r->desc)
                             : vmmt_publish_packed(p->pool, b, (size_t)c->members, p->s, r->desc);
        /* The model says there is room: the acknowledgements may not be written yet. */
        if (st != VMMT_EFULL || !(c->flags & MT_F_RETRY) || now_ms() > until) break;
        vmmt_pool_reclaim(p->pool, NULL);
        sleep_us(1000);
    }
    note(r, st);
    /* How the publish went to the GPU, for the model to hold against the buffer it sent. */
    if (vmmt_pool_get_stats(p->pool, &r->stats) != VMMT_OK) die("producer", "stats");
    r->kernel = (int32_t)(r->stats.kernel_publishes - kernels);
}

static void p_gate_open(struct prod *p, struct mt_reply *r)
{
    int ok = p->d->cuStreamWriteValue32(p->gs, p->gate, 1, CU_STREAM_WRITE_VALUE_DEFAULT) ==
                 CUDA_SUCCESS &&
             p->d->cuStreamSynchronize(p->gs) == CUDA_SUCCESS &&
             p->d->cuStreamSynchronize(p->s) == CUDA_SUCCESS;
    p->gated = 0;
    r->status = ok ? VMMT_OK : VMMT_ECUDA;
    if (!ok) snprintf(r->msg, sizeof r->msg, "the gated stream did not finish");
}

static void p_reserve(struct prod *p, const struct mt_cmd *c, struct mt_reply *r)
{
    double until = now_ms() + c->timeout_ms;
    int st;

    for (;;) {
        r->attempts++;
        st = vmmt_reserve(p->pool, c->nbytes[0], &p->res[c->id]);
        if (st != VMMT_EFULL || !(c->flags & MT_F_RETRY) || now_ms() > until) break;
        vmmt_pool_reclaim(p->pool, NULL);
        sleep_us(1000);
    }
    note(r, st);
    p->committed[c->id] = 0;
    r->id = c->id;
    r->desc[0] = p->res[c->id].token;
}

static void p_commit(struct prod *p, const struct mt_cmd *c, struct mt_reply *r)
{
    vmmt_reservation *res = &p->res[c->id];
    vmmt_buffer what;
    void *stream = NULL;

    /* A committed, cancelled or shut-down reservation's slice is not ours to write:
     * it may hold another publish by now. */
    if (!p->committed[c->id] && !p->shut) {
        if (res->location == VMMT_LOC_HOST) {
            mt_fill((uint8_t *)(uintptr_t)res->ptr, c->nbytes[0], c->uid[0]);
        } else {
            fill_device(p, res->ptr, p->host, c->nbytes[0], c->uid[0]);
            stream = p->s;
        }
    } else if (res->location != VMMT_LOC_HOST) {
        stream = p->s;
    }
    buffer_of(&what, 0, c->nbytes[0], c->typed[0], VMMT_LOC_DEVICE);
    note(r, vmmt_commit(p->pool, res, &what, stream, &r->desc[0]));
    if (r->status == VMMT_OK) p->committed[c->id] = 1;
}

static void p_wait(struct prod *p, const struct mt_cmd *c, struct mt_reply *r)
{
    double until = now_ms() + c->timeout_ms;
    int st;

    for (;;) {
        r->attempts++;
        /* Acknowledged slices recycled, so that their chunks can fall idle; the give-back
         * of an idle chunk is still the pool's own timer. */
        if (c->id == MT_WAIT_IDLE || c->id == MT_WAIT_CHUNK_RELEASED)
            vmmt_pool_reclaim(p->pool, NULL);
        st = vmmt_pool_get_stats(p->pool, &r->stats);
        if (st != VMMT_OK) break;
        if (c->id == MT_WAIT_IDLE && r->stats.in_flight == 0 && r->stats.in_flight_bytes == 0)
            break;
        if (c->id == MT_WAIT_RELEASES && r->stats.rank_releases >= c->target) break;
        if (c->id == MT_WAIT_CHUNK_RELEASED && r->stats.chunks_released >= c->target) break;
        if (now_ms() > until) {
            st = VMMT_ETIMEDOUT;
            snprintf(r->msg, sizeof r->msg, "waited %d ms", c->timeout_ms);
            break;
        }
        sleep_us(1000);
    }
    r->status = st;
}

static void p_end(struct prod *p, struct mt_reply *r)
{
    if (p->gated) p_gate_open(p, r);
    p->d->cuStreamSynchronize(p->s);
    vmmt_pool_destroy(p->pool);
    p->pool = NULL;
    r->status = VMMT_OK;
    r->status2 = res_back(&p->before, &r->after) ? VMMT_OK : VMMT_ESTATE;
    r->before = p->before;
}

int mt_producer_main(void)
{
    static struct prod p;
    struct mt_cmd c;
    struct mt_reply r;

    tu_use_test_driver();
    if (vmmt__ctx_enter(0) != VMMT_OK) die("producer", "context");
    p.d = vmmt__drv();
    while (cmd_recv(&c)) {
        int end = 0;
        memset(&r, 0, sizeof r);
        r.seq = c.seq;
        if (c.op != P_CREATE && p.pool == NULL) {
            r.status = VMMT_ESTATE;
            snprintf(r.msg, sizeof r.msg, "no pool");
            reply_send(&r);
            continue;
        }
        switch (c.op) {
        case P_CREATE: p_create(&p, &c, &r); break;
        case P_PUBLISH: p_publish(&p, &c, &r); break;
        case P_CANCEL: note(&r, vmmt_cancel(p.pool, &c.desc)); break;
        case P_RESERVE: p_reserve(&p, &c, &r); break;
        case P_COMMIT: p_commit(&p, &c, &r); break;
        case P_RES_CANCEL:
            note(&r, vmmt_cancel(p.pool, &p.res[c.id].token));
            p.committed[c.id] = 1; /* closed either way: never written again */
            break;
        case P_RELEASE_RANK: note(&r, vmmt_pool_release_rank(p.pool, c.first)); break;
        case P_RECLAIM: {
            uint32_t freed = 0;
            note(&r, vmmt_pool_reclaim(p.pool, &freed));
            r.freed = freed;
            break;
        }
        case P_STATS: note(&r, vmmt_pool_get_stats(p.pool, &r.stats)); break;
        case P_WAIT: p_wait(&p, &c, &r); break;
        case P_SHUTDOWN:
            note(&r, vmmt_pool_shutdown(p.pool));
            p.shut = 1;
            break;
        case P_GATE_OPEN: p_gate_open(&p, &r); break;
        case P_END:
            p_end(&p, &r);
            end = 1;
            break;
        default: r.status = VMMT_EINVAL; snprintf(r.msg, sizeof r.msg, "unknown op %u", c.op);
        }
        reply_send(&r);
        if (end) break;
    }
    if (p.pool != NULL) vmmt_pool_destroy(p.pool);
    vmmt__ctx_leave();
    return 0;
}

/* ------------------------------------------------------------- consumer */

struct cons {
    vmmt_consumer *c;
    const struct vmmt_drv *d;
    CUstream a, b, gs; /* immediate consumes; deferred ones; the gate's opener */
    CUdeviceptr dst, ddst[MT_MAX_DEFER], gate;
    int gated;
    int dused[MT_MAX_DEFER];
    uint64_t duid[MT_MAX_DEFER], dn[MT_MAX_DEFER];
    int dflags[MT_MAX_DEFER];
    vmmt_desc ddesc[MT_MAX_DEFER];
    uint8_t *host;
    uint64_t unit;
    struct mt_res before;
};

/* Synchronize a stream; one that failed (a sticky error) is replaced, so later commands can run. */
static int sync_or_renew(struct cons *k, CUstream *s)
{
    if (k->d->cuStreamSynchronize(*s) == CUDA_SUCCESS) return 1;
    k->d->cuStreamDestroy(*s);
    if (k->d->cuStreamCreate(s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) die("consumer", "stream");
    return 0;
}

/* Read back n bytes of `from` after the stream passed the copy; compare with uid's. */
static void read_back(struct cons *k, CUstream *s, CUdeviceptr from, uint64_t n, uint64_t uid,
                      int nocheck, struct mt_reply *r)
{
    if (n > k->unit) n = k->unit;
    r->stream_ok = sync_or_renew(k, s);
    if (!r->stream_ok) return;
    if (k->d->cuMemcpyDtoHAsync(k->host, from, n, *s) != CUDA_SUCCESS ||
        k->d->cuStreamSynchronize(*s) != CUDA_SUCCESS) {
        r->stream_ok = 0;
        sync_or_renew(k, s);
        return;
    }
    r->verified = 1;
    r->nbytes = n;
    r->found_uid = mt_uid_of(k->host, n);
    r->first_bad = nocheck ? n : mt_first_bad(k->host, n, uid);
}

/* Nothing was written where a refused consume would have copied. */
static int poison_intact(struct cons *k, CUstream *s, CUdeviceptr at)
{
    if (!sync_or_renew(k, s)) return 0;
    if (k->d->cuMemcpyDtoHAsync(k->host, at, k->unit, *s) != CUDA_SUCCESS ||
        k->d->cuStreamSynchronize(*s) != CUDA_SUCCESS)
        return 0;
    for (uint64_t i = 0; i < k->unit; i++)
        if (k->host[i] != MT_POISON) return 0;
    return 1;
}

/* The ranks of c->list as the list vmmt_consume_ranks takes; their count. */
static int rank_list(const struct mt_cmd *c, int *ranks)
{
    int n = 0;

    for (int r = 0; r < 16; r++)
        if (c->list & (1u << r)) ranks[n++] = r;
    for (int i = 0; (c->list & MT_LIST_DOWN) && i < n / 2; i++) {
        int t = ranks[i];
        ranks[i] = ranks[n - 1 - i];
        ranks[n - 1 - i] = t;
    }
    if (c->list & MT_LIST_TWICE) ranks[n++] = ranks[0];
    return n;
}

static int consume_for(struct cons *k, const struct mt_cmd *c, CUdeviceptr at, CUstream s)
{
    int ranks[17], n;

    if (c->list == 0) return vmmt_consume(k->c, &c->desc, 0, at, k->unit, s, c->first, c->count);
    n = rank_list(c, ranks);
    return vmmt_consume_ranks(k->c, &c->desc, 0, at, k->unit, s, ranks, n);
}

static int ack_for(struct cons *k, const struct mt_cmd *c, CUstream s)
{
    int ranks[17], n;

    if (c->list == 0) return vmmt_consumer_ack(k->c, &c->desc, 0, s, c->first, c->count);
    n = rank_list(c, ranks);
    return vmmt_consumer_ack_ranks(k->c, &c->desc, 0, s, ranks, n);
}

static void c_consume(struct cons *k, const struct mt_cmd *c, struct mt_reply *r)
{
    int defer = c->flags & MT_F_DEFER, id = -1;
    CUstream *s = defer ? &k->b : &k->a;
    CUdeviceptr at = k->dst;

    if (defer) {
        for (int i = 0; i < MT_MAX_DEFER && id < 0; i++)
            if (!k->dused[i]) id = i;
        if (id < 0) die("consumer", "no deferred slot left");
        at = k->ddst[id];
    }
    if (k->d->cuMemsetD8Async(at, MT_POISON, k->unit, *s) != CUDA_SUCCESS)
        die("consumer", "poison");
    note(r, consume_for(k, c, at, *s));
    if (r->status == VMMT_OK && defer) {
        k->dused[id] = 1;
        k->duid[id] = c->uid[0];
        k->dn[id] = c->nbytes[0];
        k->dflags[id] = c->flags;
        k->ddesc[id] = c->desc;
        r->id = id;
        return;
    }
    if (r->status == VMMT_OK) {
        read_back(k, s, at, c->nbytes[0], c->uid[0], c->flags & MT_F_NOCHECK, r);
        if (r->verified && !(c->flags & MT_F_NOCHECK))
            r->status2 = vmmt_consumer_check(k->c, &c->desc);
    } else if (c->flags & MT_F_POISON) {
        r->poison_ok = poison_intact(k, s, at);
    } else {
        r->poison_ok = 1;
    }
}

static void c_verify(struct cons *k, const struct mt_cmd *c, struct mt_reply *r)
{
    int id = c->id;

    r->status = VMMT_OK;
    if (id < 0) { /* deferred acknowledgements only: the stream must get past them */
        r->stream_ok = sync_or_renew(k, &k->b);
        return;
    }
    if (id >= MT_MAX_DEFER || !k->dused[id]) {
        r->status = VMMT_EINVAL;
        snprintf(r->msg, sizeof r->msg, "no deferred consume %d", id);
        return;
    }
    read_back(k, &k->b, k->ddst[id], k->dn[id], k->duid[id], k->dflags[id] & MT_F_NOCHECK, r);
    r->status2 = vmmt_consumer_check(k->c, &k->ddesc[id]);
    if (r->status2 != VMMT_OK) snprintf(r->msg, sizeof r->msg, "%s", vmmt_last_error());
    k->dused[id] = 0;
}

/*
 * The deferred stream held behind a word of this process's own (not the
 * pool's: nothing the library reads), so that its consumes' copies stay
 * queued while the driver cancels what they took (op_cancel_taken).
 */
static void c_gate_close(struct cons *k, struct mt_reply *r)
{
    r->status = VMMT_OK;
    if (k->gated) return;
    /* The word is 0 before the wait is queued: an opener's 1 must not be overwritten by a
     * zeroing still queued on the stream, which would hold it for ever. */
    if (k->d->cuMemsetD8Async(k->gate, 0, 4, k->b) != CUDA_SUCCESS ||
        k->d->cuStreamSynchronize(k->b) != CUDA_SUCCESS ||
        k->d->cuStreamWaitValue32(k->b, k->gate, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
        die("consumer", "gate");
    k->gated = 1;
}

static void c_gate_open(struct cons *k, struct mt_reply *r)
{
    r->status = VMMT_OK;
    if (!k->gated) return;
    if (k->d->cuStreamWriteValue32(k->gs, k->gate, 1, CU_STREAM_WRITE_VALUE_DEFAULT) !=
            CUDA_SUCCESS ||
        k->d->cuStreamSynchronize(k->gs) != CUDA_SUCCESS) {
        r->status = VMMT_ECUDA;
        snprintf(r->msg, sizeof r->msg, "the consumer's gate did not open");
    }
    k->gated = 0;
}

static void c_evict(struct cons *k, const struct mt_cmd *c, struct mt_reply *r)
{
    double until = now_ms() + c->timeout_ms;
    int st;

    for (;;) {
        r->attempts++;
        st = vmmt_consumer_evict(k->c, c->desc.bytes + MT_OFF_POOL_ID, 0);
        /* An idle pool's last copy event may not have been seen yet by the acknowledger. */
        if (st != VMMT_ESTATE || !(c->flags & MT_F_RETRY) || now_ms() > until) break;
        sleep_us(1000);
    }
    note(r, st);
}

static void c_end(struct cons *k, struct mt_reply *r)
{
    struct mt_reply ignored;

    c_gate_open(k, &ignored);
    sync_or_renew(k, &k->a);
    sync_or_renew(k, &k->b);
    vmmt_consumer_destroy(k->c);
    k->c = NULL;
    r->status = VMMT_OK;
    r->status2 = res_back(&k->before, &r->after) ? VMMT_OK : VMMT_ESTATE;
    r->before = k->before;
}

int mt_consumer_main(int timeout_ms, uint64_t unit)
{
    static struct cons k;
    vmmt_consumer_config cfg;
    struct mt_cmd c;
    struct mt_reply r;

    tu_use_test_driver();
    if (vmmt__ctx_enter(0) != VMMT_OK) die("consumer", "context");
    k.d = vmmt__drv();
    k.unit = unit;
    if (k.d->cuStreamCreate(&k.a, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        k.d->cuStreamCreate(&k.b, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        k.d->cuStreamCreate(&k.gs, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        k.d->cuMemAlloc(&k.gate, 4096) != CUDA_SUCCESS ||
        k.d->cuMemAlloc(&k.dst, unit) != CUDA_SUCCESS || (k.host = malloc(unit)) == NULL)
        die("consumer", "setup");
    for (int i = 0; i < MT_MAX_DEFER; i++)
        if (k.d->cuMemAlloc(&k.ddst[i], unit) != CUDA_SUCCESS) die("consumer", "setup");
    mt_res_take(&k.before);
    vmmt_consumer_config_init(&cfg);
    cfg.timeout_ms = timeout_ms;
    if (vmmt_consumer_create(&cfg, &k.c) != VMMT_OK) die("consumer", "create");
    while (cmd_recv(&c)) {
        int end = 0;
        memset(&r, 0, sizeof r);
        r.seq = c.seq;
        r.id = -1;
        switch (c.op) {
        case C_CONSUME: c_consume(&k, &c, &r); break;
        case C_ACK:
            note(&r, ack_for(&k, &c, (c.flags & MT_F_DEFER) ? k.b : k.a));
            if (!(c.flags & MT_F_DEFER)) r.stream_ok = sync_or_renew(&k, &k.a);
            break;
        case C_VERIFY: c_verify(&k, &c, &r); break;
        case C_CHECK: note(&r, vmmt_consumer_check(k.c, &c.desc)); break;
        case C_FLUSH: note(&r, vmmt_consumer_flush(k.c)); break;
        case C_GATE_CLOSE: c_gate_close(&k, &r); break;
        case C_GATE_OPEN: c_gate_open(&k, &r); break;
        case C_EVICT: c_evict(&k, &c, &r); break;
        case C_END:
            c_end(&k, &r);
            end = 1;
            break;
        default: r.status = VMMT_EINVAL; snprintf(r.msg, sizeof r.msg, "unknown op %u", c.op);
        }
        r.after.pools = k.c != NULL ? vmmt_consumer_pool_count(k.c) : 0;
        reply_send(&r);
        if (end) break;
    }
    if (k.c != NULL) vmmt_consumer_destroy(k.c);
    vmmt__ctx_leave();
    return 0;
}
