/*
 * The read-back check of a group (see group_check.h). Buffer b of a rank is,
 * by b % 3: a whole allocation; the second half of the allocation of buffer
 * b - 1 (so one allocation is named by two buffers and must be shared once);
 * or a range that starts inside the first of `chunks` allocations and ends
 * inside the last, so it is read through a span mapping.
 */
#include "group_check.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver.h"
#include "status.h"

static uint8_t pattern(int rank, int buffer, uint64_t j)
{
    return (uint8_t)(rank * 31 + buffer * 7 + (int)(j % 251) * 13 + 1);
}

static double now_ms(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* Copy between host and device on the null stream and wait; VMMT status. */
static int copy(int device, void *host, uint64_t dev, uint64_t n, int to_device)
{
    const struct vmmt_drv *d;
    CUresult r;
    int st;

    if ((st = vmmt__ctx_enter(device)) != VMMT_OK) return st;
    d = vmmt__drv();
    r = to_device ? d->cuMemcpyHtoDAsync(dev, host, n, NULL)
                  : d->cuMemcpyDtoHAsync(host, dev, n, NULL);
    if (r == CUDA_SUCCESS) r = d->cuStreamSynchronize(NULL);
    vmmt__ctx_leave();
    return r == CUDA_SUCCESS ? VMMT_OK : vmmt__cu_check(r, "copy of a group buffer");
}

struct layout {
    vmmt_group_buffer *bufs;
    uint64_t *allocs; /* vmmt_group_alloc results, to free */
    int nallocs;
};

static int make_buffers(vmmt_group *g, const struct gc_opts *o, struct layout *L)
{
    uint64_t prev = 0;
    int st;

    for (int b = 0; b < o->buffers; b++) {
        uint64_t p;
        vmmt_group_buffer *vb = &L->bufs[b];
        if (b % 3 == 1) {
            /* The second half of the previous buffer's allocation. */
            vb->ptr = prev + o->size / 2;
            vb->nbytes = o->size - o->size / 2;
            L->bufs[b - 1].nbytes = o->size / 2;
            continue;
        }
        int chunks = b % 3 == 2 ? o->chunks : 1;
        if ((st = vmmt_group_alloc(g, o->size * (uint64_t)chunks, chunks, &p)) != VMMT_OK)
            return st;
        L->allocs[L->nallocs++] = p;
        prev = p;
        vb->ptr = p;
        vb->nbytes = o->size * (uint64_t)chunks;
        if (chunks > 1) {
            /* Start inside the first allocation and end inside the last. */
            uint64_t cut = o->size / 4 ? o->size / 4 : 1;
            vb->ptr += cut;
            vb->nbytes -= 2 * cut;
        }
    }
    return VMMT_OK;
}

static int fill(vmmt_group *g, const struct layout *L, int nbuf, uint8_t *host)
{
    int rank = vmmt_group_rank(g), st;

    for (int b = 0; b < nbuf; b++) {
        for (uint64_t j = 0; j < L->bufs[b].nbytes; j++)
            host[j] = pattern(rank, b, j);
        if ((st = copy(vmmt_group_device(g), host, L->bufs[b].ptr, L->bufs[b].nbytes, 1)) !=
            VMMT_OK)
            return st;
    }
    return VMMT_OK;
}

static int read_back(vmmt_group *g, const struct layout *L, int nbuf, const uint64_t *ptrs,
                     uint8_t *host, FILE *log, struct gc_result *res)
{
    int world = vmmt_group_world_size(g), rank = vmmt_group_rank(g), st;

    for (int b = 0; b < nbuf; b++)
        for (int r = 0; r < world; r++) {
            uint64_t n = L->bufs[b].nbytes; /* every rank lays out the same sizes */
            if (r == rank) continue;
            if ((st = copy(vmmt_group_device(g), host, ptrs[(size_t)b * (size_t)world + (size_t)r],
                           n, 0)) != VMMT_OK)
                return 2;
            for (uint64_t j = 0; j < n; j++)
                if (host[j] != pattern(r, b, j)) {
                    fprintf(log, "rank %d: rank %d's buffer %d: byte %llu is %u, expected %u\n",
                            rank, r, b, (unsigned long long)j, host[j], pattern(r, b, j));
                    return 1;
                }
            res->checked += n;
        }
    (void)st;
    return 0;
}

int gc_run(vmmt_group *g, const struct gc_opts *o, FILE *log, struct gc_result *res)
{
    int world = vmmt_group_world_size(g), rc = 2, st;
    struct layout L = {0};
    uint64_t *ptrs = NULL;
    uint8_t *host = NULL;
    size_t before, after;
    double t0;

    memset(res, 0, sizeof *res);
    L.bufs = calloc((size_t)o->buffers, sizeof *L.bufs);
    L.allocs = calloc((size_t)o->buffers, sizeof *L.allocs);
    ptrs = calloc((size_t)o->buffers * (size_t)world, sizeof *ptrs);
    host = malloc(o->size * (uint64_t)(o->chunks > 1 ? o->chunks : 1));
    if (L.bufs == NULL || L.allocs == NULL || ptrs == NULL || host == NULL) {
        fprintf(log, "rank %d: no memory\n", vmmt_group_rank(g));
        goto out;
    }
    if ((st = make_buffers(g, o, &L)) != VMMT_OK || (st = fill(g, &L, o->buffers, host)) != VMMT_OK)
        goto error;
    t0 = now_ms();
    st = vmmt_group_register(g, L.bufs, (size_t)o->buffers, ptrs);
    res->register_ms = now_ms() - t0;
    if (st != VMMT_OK) goto error;
    if ((rc = read_back(g, &L, o->buffers, ptrs, host, log, res)) != 0) goto out;
    vmmt_group_get_counts(g, NULL, &before);
    if (o->again) {
        if ((st = vmmt_group_register(g, L.bufs, (size_t)o->buffers, ptrs)) != VMMT_OK) goto error;
        vmmt_group_get_counts(g, NULL, &after);
        if (after != before) {
            fprintf(log, "rank %d: registering again imported %zu more allocations\n",
                    vmmt_group_rank(g), after - before);
            rc = 1;
            goto out;
        }
        if ((rc = read_back(g, &L, o->buffers, ptrs, host, log, res)) != 0) goto out;
    }
    res->peer_allocations = before;
    rc = 0;
    goto out;
error:
    fprintf(log, "rank %d: %s\n", vmmt_group_rank(g), vmmt_last_error());
    rc = 2;
out:
    for (int k = 0; k < L.nallocs; k++)
        vmmt_group_free(g, L.allocs[k]);
    free(L.bufs);
    free(L.allocs);
    free(ptrs);
    free(host);
    return rc;
}
