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
#include "group_reg.h"
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
    if (st == VMMT_OK) st = vmmt__group_exchange_and_import(R, t);
    if (st == VMMT_OK) st = vmmt__group_map_buffers(R, t, ptrs);
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
        st = vmmt__group_prepare(&R);
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
