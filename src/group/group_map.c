/*
 * The peers' side of a registration: get their new allocations (descriptors
 * through the exchange, or FABRIC handles from the table), import them, and
 * map each peer buffer's chain of allocations into one reserved range.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "group_reg.h"
#include "status.h"
#include "vmm.h"

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

int vmmt__group_exchange_and_import(struct reg *R, const struct peer_table *t)
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

int vmmt__group_map_buffers(struct reg *R, const struct peer_table *t, uint64_t *ptrs)
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
