/*
 * Buffer registration of a group: three all-gathers around the descriptor
 * exchange.
 *
 *   prepare  find each buffer's allocations (cuMemGetAddressRange), retain and
 *            check the new ones, export them, open the exchange socket
 *   R1       every rank's status and the size of its table  -> all fail together
 *   R2       every rank's table: new allocations (size, FABRIC handle), buffers
 *            as chains of allocation ids, the socket address
 *   exchange POSIX descriptors of the new allocations, within the node
 *   map      import every peer's new allocations; map each peer buffer's chain
 *            into one reserved range, every allocation at its own offset
 *   R3       every rank's status                            -> all commit or all undo
 *
 * Allocation ids are positions in the owner's table of shared allocations,
 * which only grows on success and shrinks back on failure on every rank
 * alike, so a peer's ids mean the same thing everywhere.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "group_internal.h"
#include "status.h"
#include "vmm.h"

#define CAUSE_LEN  480
#define MAX_R2     (64u << 20)
#define R1_MAGIC   "VMMTREG1"
#define MAX_BUFFER 65536

struct r1 {
    char magic[8];
    uint32_t seq;
    int32_t status;
    uint32_t nbuf;
    uint32_t r2_bytes;
    char cause[CAUSE_LEN];
};

struct r2_head {
    uint32_t first_id;
    uint32_t n_new;
    uint32_t nbuf;
    uint32_t nchain;
    struct vmmt__broker_addr addr;
    uint8_t pad[2];
};

struct r2_alloc {
    uint64_t size;
    uint8_t fabric[64];
};

struct r2_buf {
    uint64_t nbytes;
    uint64_t offset; /* of the buffer's start in its first allocation */
    uint32_t chain_first;
    uint32_t chain_len;
};

/* What one call holds until it commits or undoes. */
struct reg {
    vmmt_group *g;
    const vmmt_group_buffer *bufs;
    size_t nbuf;
    size_t local_mark, span_mark;
    size_t *import_mark; /* per rank */
    uint32_t *chain;     /* this rank's chain of allocation ids */
    size_t nchain, capchain;
    struct r2_buf *mybufs;
    int *fds; /* exported descriptors of new allocations */
    struct r2_alloc *newallocs;
    size_t n_new;
    struct vmmt__gx gx;
    uint8_t *table; /* R2 result: world * r2_size */
    size_t r2_size;
};

/*
 * Rounded up to 8 bytes: rank r's table starts at r times the largest, and
 * its 64-bit fields must stay aligned (an odd chain length broke that).
 */
static size_t r2_bytes(size_t n_new, size_t nbuf, size_t nchain)
{
    size_t n = sizeof(struct r2_head) + n_new * sizeof(struct r2_alloc) +
               nbuf * sizeof(struct r2_buf) + nchain * sizeof(uint32_t);

    return (n + 7) & ~(size_t)7;
}

/* ---------------------------------------------------------------- prepare */

static long find_local(const vmmt_group *g, CUdeviceptr base)
{
    for (size_t i = g->nlocals; i-- > 0;)
        if (g->locals[i].base == base) return (long)i;
    return -1;
}

/*
 * Whether the allocation mapped at locals[id].base is still the one shared
 * (1) or another one (0): an application may free an allocation and get a new
 * one at the same address. The driver hands out one handle per allocation.
 */
static int same_allocation(vmmt_group *g, long id, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUmemGenericAllocationHandle h;
    CUresult r = d->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)g->locals[id].base);

    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "buffer %zu: cuMemRetainAllocationHandle(0x%llx)", bi,
                             (unsigned long long)g->locals[id].base);
    d->cuMemRelease(h);
    return h == g->locals[id].handle;
}

/* Retain and check the allocation mapped at base, then add it to the shared table. */
static int add_local(struct reg *R, CUdeviceptr base, uint64_t size, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_group *g = R->g;
    CUmemGenericAllocationHandle h;
    CUmemAllocationProp prop;
    CUresult r;
    int st;

    if (g->nlocals - R->local_mark >= g->max_allocs)
        return vmmt__fail(VMMT_ETOOBIG,
                          "the buffers cross more than %u new allocations; raise "
                          "max_allocations or register fewer buffers at once",
                          g->max_allocs);
    r = d->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r,
                             "buffer %zu: cuMemRetainAllocationHandle(0x%llx): not CUDA VMM "
                             "memory? allocate with cuMemCreate (PyTorch: "
                             "expandable_segments:True)",
                             bi, (unsigned long long)base);
    memset(&prop, 0, sizeof prop);
    r = d->cuMemGetAllocationPropertiesFromHandle(&prop, h);
    if (r != CUDA_SUCCESS) {
        st = vmmt__cu_fail(r, "buffer %zu: cuMemGetAllocationPropertiesFromHandle", bi);
        goto fail;
    }
    if ((prop.requestedHandleTypes & (unsigned)g->type) == 0) {
        st = vmmt__fail(VMMT_ENOTSUP,
                        "buffer %zu: the allocation at 0x%llx was created with handle types "
                        "0x%x, without %s, which this group exchanges; create it with "
                        "requestedHandleTypes including %s",
                        bi, (unsigned long long)base, (unsigned)prop.requestedHandleTypes,
                        vmmt__handle_type_upper(g->type), vmmt__handle_type_upper(g->type));
        goto fail;
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != g->device) {
        st = vmmt__fail(VMMT_EINVAL,
                        "buffer %zu: the allocation at 0x%llx lives on device %d, not on the "
                        "group's device %d",
                        bi, (unsigned long long)base, prop.location.id, g->device);
        goto fail;
    }
    st = vmmt__group_grow((void **)&g->locals, &g->caplocals, g->nlocals + 1, sizeof *g->locals);
    if (st != VMMT_OK) goto fail;
    g->locals[g->nlocals++] = (struct vmmt__group_local){base, size, h};
    return VMMT_OK;
fail:
    d->cuMemRelease(h);
    return st;
}

static int push_chain(struct reg *R, uint32_t id)
{
    int st = vmmt__group_grow((void **)&R->chain, &R->capchain, R->nchain + 1, sizeof *R->chain);

    if (st == VMMT_OK) R->chain[R->nchain++] = id;
    return st;
}

/* The allocations buffer bi crosses, in address order, into the chain. */
static int walk_buffer(struct reg *R, size_t bi)
{
    const struct vmmt_drv *d = vmmt__drv();
    const vmmt_group_buffer *b = &R->bufs[bi];
    uint64_t cur = b->ptr, end = b->ptr + b->nbytes;
    struct r2_buf *rb = &R->mybufs[bi];
    int st;

    if (b->ptr == 0 || b->nbytes == 0 || end < b->ptr)
        return vmmt__fail(VMMT_EINVAL,
                          "buffer %zu: ptr=0x%" PRIx64 " nbytes=%" PRIu64
                          " is not a range of device memory",
                          bi, b->ptr, b->nbytes);
    rb->nbytes = b->nbytes;
    rb->chain_first = (uint32_t)R->nchain;
    /* Bounded: every step moves past one allocation, and their number is capped. */
    for (uint32_t steps = 0; cur < end; steps++) {
        CUdeviceptr base = 0;
        size_t size = 0;
        long id;
        CUresult r = d->cuMemGetAddressRange(&base, &size, cur);

        if (r != CUDA_SUCCESS || size == 0 || base > cur || cur - base >= size)
            return vmmt__cu_fail(r ? r : CUDA_ERROR_INVALID_VALUE,
                                 "buffer %zu: cuMemGetAddressRange(0x%" PRIx64 ") at byte %" PRIu64
                                 " of %" PRIu64 ": not mapped device memory",
                                 bi, cur, cur - b->ptr, b->nbytes);
        if (steps >= R->g->max_allocs)
            return vmmt__fail(VMMT_ETOOBIG, "buffer %zu crosses more than %u allocations", bi,
                              R->g->max_allocs);
        if (cur == b->ptr) rb->offset = cur - base;
        if ((id = find_local(R->g, base)) >= 0 && (st = same_allocation(R->g, id, bi)) != 1) {
            if (st < 0) return st;
            id = -1; /* another allocation now lives at that address: share it anew */
        }
        if (id >= 0 && R->g->locals[id].size != size)
            return vmmt__fail(VMMT_ESTATE,
                              "buffer %zu: the allocation at 0x%llx is now %zu bytes, was %" PRIu64
                              " when shared; keep registered allocations mapped while the "
                              "group lives",
                              bi, (unsigned long long)base, size, R->g->locals[id].size);
        if (id < 0) {
            if ((st = add_local(R, base, size, bi)) != VMMT_OK) return st;
            id = (long)R->g->nlocals - 1;
        }
        if ((st = push_chain(R, (uint32_t)id)) != VMMT_OK) return st;
        cur = base + size;
    }
    rb->chain_len = (uint32_t)R->nchain - rb->chain_first;
    return VMMT_OK;
}

static int export_new(struct reg *R)
{
    vmmt_group *g = R->g;
    int st;

    R->n_new = g->nlocals - R->local_mark;
    if (R->n_new == 0) return VMMT_OK;
    R->newallocs = calloc(R->n_new, sizeof *R->newallocs);
    R->fds = malloc(R->n_new * sizeof *R->fds);
    if (R->newallocs == NULL || R->fds == NULL)
        return vmmt__fail(VMMT_ENOMEM, "no memory for %zu allocations", R->n_new);
    for (size_t k = 0; k < R->n_new; k++)
        R->fds[k] = -1;
    for (size_t k = 0; k < R->n_new; k++) {
        const struct vmmt__group_local *l = &g->locals[R->local_mark + k];
        R->newallocs[k].size = l->size;
        if (g->type == VMMT_HANDLE_FABRIC)
            st = vmmt__export_fabric(l->handle, (CUmemFabricHandle *)R->newallocs[k].fabric);
        else
            st = vmmt__export_posix_fd(l->handle, &R->fds[k]);
        if (st != VMMT_OK)
            return vmmt__wrap(st, "exporting the allocation at 0x%llx",
                              (unsigned long long)l->base);
    }
    return VMMT_OK;
}

static int prepare(struct reg *R)
{
    int st;

    R->mybufs = calloc(R->nbuf ? R->nbuf : 1, sizeof *R->mybufs);
    if (R->mybufs == NULL) return vmmt__fail(VMMT_ENOMEM, "no memory for %zu buffers", R->nbuf);
    for (size_t i = 0; i < R->nbuf; i++)
        if ((st = walk_buffer(R, i)) != VMMT_OK) return st;
    if ((st = export_new(R)) != VMMT_OK) return st;
    if (R->g->type == VMMT_HANDLE_POSIX_FD && R->g->world > 1)
        return vmmt__gx_listen(R->g->socket_dir[0] ? R->g->socket_dir : NULL, &R->gx);
    return VMMT_OK;
}

/* ------------------------------------------------------------------- R1 */

static void join_causes(char *msg, size_t cap, const struct r1 *all, int world)
{
    size_t n = strlen(msg);

    for (int r = 0; r < world && n + 1 < cap; r++) {
        if (all[r].status == VMMT_OK) continue;
        n += (size_t)snprintf(msg + n, cap - n, " rank %d: %.*s;", r, CAUSE_LEN - 1, all[r].cause);
    }
}

static int round_status(struct reg *R, int st, const char *round, struct r1 *all)
{
    vmmt_group *g = R->g;
    struct r1 mine;
    char msg[2048];
    int failed = 0, worst = VMMT_OK;

    memset(&mine, 0, sizeof mine);
    memcpy(mine.magic, R1_MAGIC, 8);
    mine.seq = g->seq;
    mine.status = st;
    mine.nbuf = (uint32_t)R->nbuf;
    mine.r2_bytes = (uint32_t)r2_bytes(R->n_new, R->nbuf, R->nchain);
    if (st != VMMT_OK) snprintf(mine.cause, sizeof mine.cause, "%s", vmmt_last_error());
    if ((st = vmmt__group_allgather(g, &mine, all, sizeof mine, round)) != VMMT_OK) return st;
    for (int r = 0; r < g->world; r++) {
        if (memcmp(all[r].magic, R1_MAGIC, 8) != 0 || all[r].seq != g->seq)
            return vmmt__fail(VMMT_EPROTO,
                              "rank %d is at registration %u, this rank at %u: the ranks "
                              "called vmmt_group_register in a different order",
                              r, all[r].seq, g->seq);
        if (all[r].status != VMMT_OK) {
            failed++;
            if (worst == VMMT_OK) worst = all[r].status;
        }
    }
    if (failed == 0) return VMMT_OK;
    snprintf(msg, sizeof msg, "registration failed on %d of %d ranks:", failed, g->world);
    join_causes(msg, sizeof msg, all, g->world);
    return vmmt__fail(worst < 0 && worst >= VMMT_ETOOBIG ? worst : VMMT_EFAILED, "%s", msg);
}

static int check_counts(struct reg *R, const struct r1 *all)
{
    size_t most = 0;

    for (int r = 0; r < R->g->world; r++) {
        if (all[r].nbuf != R->nbuf)
            return vmmt__fail(VMMT_EINVAL,
                              "rank %d registers %u buffers, rank %d registers %zu; every rank "
                              "must register the same number, in the same order",
                              r, all[r].nbuf, R->g->rank, R->nbuf);
        if (all[r].r2_bytes > most) most = all[r].r2_bytes;
    }
    if (most > MAX_R2)
        return vmmt__fail(VMMT_ETOOBIG, "a rank's allocation table has %zu bytes; at most %u", most,
                          MAX_R2);
    R->r2_size = most;
    return VMMT_OK;
}

/* ------------------------------------------------------------------- R2 */

static void fill_table(const struct reg *R, uint8_t *p)
{
    struct r2_head h;

    memset(&h, 0, sizeof h);
    h.first_id = (uint32_t)R->local_mark;
    h.n_new = (uint32_t)R->n_new;
    h.nbuf = (uint32_t)R->nbuf;
    h.nchain = (uint32_t)R->nchain;
    h.addr = R->gx.addr;
    memcpy(p, &h, sizeof h);
    p += sizeof h;
    if (R->n_new) memcpy(p, R->newallocs, R->n_new * sizeof *R->newallocs);
    p += R->n_new * sizeof *R->newallocs;
    memcpy(p, R->mybufs, R->nbuf * sizeof *R->mybufs);
    p += R->nbuf * sizeof *R->mybufs;
    if (R->nchain) memcpy(p, R->chain, R->nchain * sizeof *R->chain);
}

/* Rank r's table, validated against what this rank knows of it. */
struct peer_table {
    struct r2_head h;
    const struct r2_alloc *allocs;
    const struct r2_buf *bufs;
    const uint32_t *chain;
};

static int read_table(struct reg *R, int r, struct peer_table *t)
{
    const uint8_t *p = R->table + (size_t)r * R->r2_size;
    uint32_t ids;

    memcpy(&t->h, p, sizeof t->h);
    ids = t->h.first_id + t->h.n_new;
    if (t->h.first_id != (r == R->g->rank ? R->local_mark : R->import_mark[r]) ||
        t->h.n_new > R->g->max_allocs || t->h.nbuf != R->nbuf ||
        r2_bytes(t->h.n_new, t->h.nbuf, t->h.nchain) > R->r2_size)
        return vmmt__fail(VMMT_EPROTO,
                          "rank %d's allocation table (first id %u, %u new, %u buffers, %u chain "
                          "entries) does not fit this rank's view (first id %zu, %zu buffers)",
                          r, t->h.first_id, t->h.n_new, t->h.nbuf, t->h.nchain, R->import_mark[r],
                          R->nbuf);
    t->allocs = (const struct r2_alloc *)(p + sizeof t->h);
    t->bufs = (const struct r2_buf *)(t->allocs + t->h.n_new);
    t->chain = (const uint32_t *)(t->bufs + t->h.nbuf);
    for (uint32_t k = 0; k < t->h.nchain; k++)
        if (t->chain[k] >= ids)
            return vmmt__fail(VMMT_EPROTO, "rank %d names allocation %u of %u", r, t->chain[k],
                              ids);
    for (uint32_t b = 0; b < t->h.nbuf; b++) {
        const struct r2_buf *rb = &t->bufs[b];
        if (rb->chain_len == 0 || rb->chain_first > t->h.nchain ||
            rb->chain_len > t->h.nchain - rb->chain_first)
            return vmmt__fail(VMMT_EPROTO, "rank %d's buffer %u has a bad allocation chain", r, b);
    }
    return VMMT_OK;
}

/* Record sizes of rank r's new allocations; handles come from the import. */
static int add_imports(struct reg *R, int r, const struct peer_table *t)
{
    vmmt_group *g = R->g;
    size_t need = t->h.first_id + t->h.n_new;
    int st;

    st = vmmt__group_grow((void **)&g->imports[r], &g->capimports[r], need, sizeof **g->imports);
    if (st != VMMT_OK) return st;
    for (uint32_t k = 0; k < t->h.n_new; k++) {
        struct vmmt__group_import *im = &g->imports[r][t->h.first_id + k];
        memset(im, 0, sizeof *im);
        im->size = t->allocs[k].size;
    }
    g->nimports[r] = need;
    return VMMT_OK;
}

/* ------------------------------------------------------ exchange, import */

static int import_one(struct reg *R, int r, uint32_t id, int fd, const struct r2_alloc *a)
{
    struct vmmt__group_import *im = &R->g->imports[r][id];
    int st;

    if (R->g->type == VMMT_HANDLE_FABRIC)
        st = vmmt__import_fabric((const CUmemFabricHandle *)a->fabric, &im->handle);
    else
        st = vmmt__import_posix_fd(fd, &im->handle);
    if (st != VMMT_OK) return vmmt__wrap(st, "importing rank %d's allocation %u", r, id);
    im->have_handle = 1;
    R->g->nimported++;
    return VMMT_OK;
}

static int exchange_and_import(struct reg *R, const struct peer_table *t)
{
    vmmt_group *g = R->g;
    struct vmmt__gx_peer *peers = NULL;
    int *recv = NULL, np = 0, st = VMMT_OK;
    size_t total = 0;

    if (g->type == VMMT_HANDLE_FABRIC) {
        for (int r = 0; r < g->world && st == VMMT_OK; r++)
            for (uint32_t k = 0; r != g->rank && k < t[r].h.n_new && st == VMMT_OK; k++)
                st = import_one(R, r, t[r].h.first_id + k, -1, &t[r].allocs[k]);
        return st;
    }
    for (int r = 0; r < g->world; r++)
        if (r != g->rank) total += t[r].h.n_new;
    peers = calloc((size_t)g->world, sizeof *peers);
    recv = malloc((total ? total : 1) * sizeof *recv);
    if (peers == NULL || recv == NULL) {
        st = vmmt__fail(VMMT_ENOMEM, "no memory for the exchange");
        goto out;
    }
    total = 0;
    for (int r = 0; r < g->world; r++) {
        if (r == g->rank || (R->n_new == 0 && t[r].h.n_new == 0)) continue;
        peers[np] = (struct vmmt__gx_peer){.rank = r,
                                           .pid = g->hellos[r].pid,
                                           .uid = g->hellos[r].uid,
                                           .addr = t[r].h.addr,
                                           .send_count = (int)R->n_new,
                                           .send_fds = R->fds,
                                           .recv_count = (int)t[r].h.n_new,
                                           .recv_fds = recv + total};
        total += t[r].h.n_new;
        np++;
    }
    st = vmmt__gx_run(&R->gx, g->rank, g->seq, peers, np, g->timeout_ms);
    /*
     * Stop listening at once: a late peer (one that stalled) is then refused at
     * once instead of sending into a backlog nobody reads and waiting its bound.
     */
    vmmt__gx_close(&R->gx);
    if (st != VMMT_OK) goto out;
    /* Each descriptor is closed as soon as it is imported (or not): the handle holds the memory. */
    for (int i = 0; i < np; i++)
        for (int k = 0; k < peers[i].recv_count; k++) {
            int r = peers[i].rank;
            if (st == VMMT_OK)
                st = import_one(R, r, t[r].h.first_id + (uint32_t)k, peers[i].recv_fds[k], NULL);
            close(peers[i].recv_fds[k]);
        }
out:
    free(peers);
    free(recv);
    return st;
}

/* ------------------------------------------------------------------ spans */

static long find_span(const vmmt_group *g, int r, const uint32_t *ids, uint32_t n)
{
    for (size_t i = 0; i < g->nspans; i++)
        if (g->spans[i].rank == r && g->spans[i].count == n &&
            memcmp(g->spans[i].ids, ids, n * sizeof *ids) == 0)
            return (long)i;
    return -1;
}

/* Reserve one range for the chain and map every allocation at its offset in the owner. */
static int map_span(vmmt_group *g, struct vmmt__group_span *s)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint64_t off = 0;
    CUresult r;
    int st;

    s->size = 0;
    for (uint32_t k = 0; k < s->count; k++)
        s->size += g->imports[s->rank][s->ids[k]].size;
    r = d->cuMemAddressReserve(&s->base, s->size, 0, 0, 0);
    if (r != CUDA_SUCCESS)
        return vmmt__cu_fail(r, "cuMemAddressReserve(%" PRIu64 ") for rank %d's buffer", s->size,
                             s->rank);
    s->reserved = 1;
    for (; s->mapped < s->count; s->mapped++) {
        const struct vmmt__group_import *im = &g->imports[s->rank][s->ids[s->mapped]];
        r = d->cuMemMap(s->base + off, im->size, 0, im->handle, 0);
        if (r != CUDA_SUCCESS)
            return vmmt__cu_fail(r, "cuMemMap of rank %d's allocation %u (%" PRIu64 " bytes)",
                                 s->rank, s->ids[s->mapped], im->size);
        off += im->size;
    }
    if ((st = vmmt__grant_rw(s->base, s->size, g->device)) != VMMT_OK)
        return vmmt__wrap(st, "rank %d's buffer", s->rank);
    return VMMT_OK;
}

static int map_buffers(struct reg *R, const struct peer_table *t, uint64_t *ptrs)
{
    vmmt_group *g = R->g;
    int st;

    for (size_t b = 0; b < R->nbuf; b++)
        for (int r = 0; r < g->world; r++) {
            const struct r2_buf *rb = &t[r].bufs[b];
            const uint32_t *ids = t[r].chain + rb->chain_first;
            struct vmmt__group_span *s;
            long i;

            if (r == g->rank) {
                ptrs[b * (size_t)g->world + (size_t)r] = R->bufs[b].ptr;
                continue;
            }
            if ((i = find_span(g, r, ids, rb->chain_len)) < 0) {
                st = vmmt__group_grow((void **)&g->spans, &g->capspans, g->nspans + 1,
                                      sizeof *g->spans);
                if (st != VMMT_OK) return st;
                s = &g->spans[g->nspans];
                memset(s, 0, sizeof *s);
                s->rank = r;
                s->count = rb->chain_len;
                if ((s->ids = malloc(rb->chain_len * sizeof *ids)) == NULL)
                    return vmmt__fail(VMMT_ENOMEM, "no memory for a span");
                memcpy(s->ids, ids, rb->chain_len * sizeof *ids);
                g->nspans++; /* counted before mapping, so a partial one is undone too */
                if ((st = map_span(g, s)) != VMMT_OK) return st;
                i = (long)g->nspans - 1;
            }
            s = &g->spans[i];
            if (rb->offset > s->size || rb->nbytes > s->size - rb->offset)
                return vmmt__fail(VMMT_EPROTO,
                                  "rank %d's buffer %zu (offset %" PRIu64 ", %" PRIu64
                                  " bytes) overruns its %" PRIu64 "-byte span",
                                  r, b, rb->offset, rb->nbytes, s->size);
            ptrs[b * (size_t)g->world + (size_t)r] = s->base + rb->offset;
        }
    return VMMT_OK;
}

/* ------------------------------------------------------------- rollback */

static void undo(struct reg *R)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_group *g = R->g;
    struct vmmt__saved_error e;

    vmmt__error_save(&e);
    while (g->nspans > R->span_mark)
        vmmt__group_span_release(g, &g->spans[--g->nspans]);
    for (int r = g->world; r-- > 0;) {
        while (g->nimports[r] > R->import_mark[r]) {
            struct vmmt__group_import *im = &g->imports[r][--g->nimports[r]];
            if (im->have_handle) {
                d->cuMemRelease(im->handle);
                im->have_handle = 0;
                g->nimported--;
            }
        }
    }
    while (g->nlocals > R->local_mark)
        d->cuMemRelease(g->locals[--g->nlocals].handle);
    vmmt__error_restore(&e);
}

static void finish(struct reg *R)
{
    vmmt__gx_close(&R->gx);
    for (size_t k = 0; R->fds != NULL && k < R->n_new; k++)
        if (R->fds[k] >= 0) close(R->fds[k]);
    free(R->fds);
    free(R->newallocs);
    free(R->mybufs);
    free(R->chain);
    free(R->table);
    free(R->import_mark);
}

/* ------------------------------------------------------------------ entry */

static int after_r1(struct reg *R, uint64_t *ptrs, struct r1 *all)
{
    vmmt_group *g = R->g;
    struct peer_table *t = NULL;
    struct vmmt__saved_error local;
    uint8_t *mine = NULL;
    int st, st3;

    mine = calloc(1, R->r2_size);
    R->table = calloc((size_t)g->world, R->r2_size);
    t = calloc((size_t)g->world, sizeof *t);
    if (mine == NULL || R->table == NULL || t == NULL) {
        /* Without the tables this rank cannot take part; the others fail by their bound. */
        g->broken = 1;
        st = vmmt__fail(VMMT_ENOMEM, "no memory for %d allocation tables", g->world);
        goto out;
    }
    fill_table(R, mine);
    if ((st = vmmt__group_allgather(g, mine, R->table, R->r2_size, "allocation tables")) != VMMT_OK)
        goto out;
    for (int r = 0; r < g->world && st == VMMT_OK; r++)
        if ((st = read_table(R, r, &t[r])) == VMMT_OK && r != g->rank)
            st = add_imports(R, r, &t[r]);
    if (st == VMMT_OK) st = exchange_and_import(R, t);
    if (st == VMMT_OK) st = map_buffers(R, t, ptrs);
    if (st != VMMT_OK) vmmt__error_save(&local);
    st3 = round_status(R, st, "registration status", all);
    if (st == VMMT_OK) {
        st = st3;
    } else if (g->broken) {
        /* The collective failed too (a rank died, say): say both, this rank's cause first. */
        char coll[1024];
        snprintf(coll, sizeof coll, "%s", vmmt_last_error());
        vmmt__error_restore(&local);
        vmmt__wrap(st, "%s; this rank's own failure before that", coll);
    }
out:
    free(mine);
    free(t);
    return st;
}

int vmmt_group_register(vmmt_group *g, const vmmt_group_buffer *buffers, size_t count,
                        uint64_t *ptrs)
{
    struct reg R;
    struct r1 *all = NULL;
    int st;

    if (g == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_group_register: group must not be NULL");
    if (g->broken)
        return vmmt__fail(VMMT_ESTATE,
                          "vmmt_group_register: an earlier collective of this group failed; "
                          "destroy it and create a new one");
    memset(&R, 0, sizeof R);
    R.g = g;
    R.bufs = buffers;
    R.nbuf = count;
    R.local_mark = g->nlocals;
    R.span_mark = g->nspans;
    R.gx.listen_fd = -1;
    all = calloc((size_t)g->world, sizeof *all);
    R.import_mark = calloc((size_t)g->world, sizeof *R.import_mark);
    if (all == NULL || R.import_mark == NULL) {
        free(all);
        free(R.import_mark);
        /* Cannot take part in the rounds: the others fail by their collective's bound. */
        g->broken = 1;
        return vmmt__fail(VMMT_ENOMEM, "vmmt_group_register: no memory for %d ranks", g->world);
    }
    for (int r = 0; r < g->world; r++)
        R.import_mark[r] = g->nimports[r];
    if ((count > 0 && (buffers == NULL || ptrs == NULL)) || count > MAX_BUFFER) {
        /* Still take part, so that the others fail with this rank's cause rather than hang. */
        st =
            vmmt__fail(VMMT_EINVAL, "buffers and ptrs must be set and count at most %d (count=%zu)",
                       MAX_BUFFER, count);
        R.nbuf = 0;
        st = round_status(&R, st, "registration request", all);
    } else if ((st = vmmt__ctx_enter(g->device)) == VMMT_OK) {
        st = prepare(&R);
        st = round_status(&R, st, "registration request", all);
        if (st == VMMT_OK) st = check_counts(&R, all);
        /* check_counts fails alike on every rank: the same bytes were gathered. */
        if (st == VMMT_OK) st = after_r1(&R, ptrs, all);
        if (st != VMMT_OK) undo(&R);
        vmmt__ctx_leave();
    } else {
        st = round_status(&R, st, "registration request", all);
    }
    if (st == VMMT_OK) {
        g->nbuffers += count;
    } else {
        if (ptrs != NULL && count <= MAX_BUFFER)
            memset(ptrs, 0, count * (size_t)g->world * sizeof *ptrs);
        vmmt__wrap(st, "vmmt_group_register(rank %d of %d, %zu buffers)", g->rank, g->world, count);
    }
    g->seq++;
    finish(&R);
    free(all);
    return st;
}
