/*
 * A group: its creation (probe, hello all-gather, vote), accessors and
 * teardown. Registration is in group_reg.c, the descriptor exchange in
 * group_xchg.c, the local adapter in group_local.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"
#include "driver.h"
#include "group_internal.h"
#include "status.h"
#include "vmm.h"

static void config_defaults(vmmt_group_config *c)
{
    memset(c, 0, sizeof *c);
    c->handle_type = VMMT_HANDLE_AUTO;
    c->timeout_ms = VMMT__GROUP_DEF_TIMEOUT;
    c->max_allocations = VMMT__GROUP_DEF_ALLOCS;
}

void vmmt_group_config_init_size(vmmt_group_config *config, size_t size)
{
    vmmt_group_config c;

    config_defaults(&c);
    vmmt__struct_out(config, size, &c, sizeof c, VMMT__GROUP_CONFIG_V1,
                     "vmmt_group_config_init: config");
}

int vmmt__group_config_in(const vmmt_group_config *theirs, size_t size, const char *fn,
                          vmmt_group_config *ours)
{
    char what[64];

    snprintf(what, sizeof what, "%s: config", fn);
    /* Fields the caller's (older) struct lacks keep their defaults. */
    config_defaults(ours);
    return vmmt__struct_in(ours, sizeof *ours, theirs, size, VMMT__GROUP_CONFIG_V1, what);
}

int vmmt__group_grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    size_t n = *cap ? *cap : 8;
    void *p;

    if (need <= *cap) return VMMT_OK;
    while (n < need)
        n *= 2;
    if ((p = realloc(*arr, n * elem)) == NULL)
        return vmmt__fail(VMMT_ENOMEM, "group: no memory for %zu table entries", n);
    memset((char *)p + *cap * elem, 0, (n - *cap) * elem);
    *arr = p;
    *cap = n;
    return VMMT_OK;
}

int vmmt__group_allgather(vmmt_group *g, const void *send, void *recv, size_t bytes,
                          const char *what)
{
    char err[512] = "";
    int rc;

    if (g->broken)
        return vmmt__fail(VMMT_ESTATE,
                          "group: an earlier collective failed, so the ranks may be out of "
                          "step; destroy the group and create a new one");
    rc = g->coll.allgather(g->coll.ctx, send, recv, bytes, err, sizeof err);
    if (rc == 0) return VMMT_OK;
    g->broken = 1;
    err[sizeof err - 1] = '\0';
    /* Adapters return -1 (== VMMT_EINVAL) or their own codes: neither says what broke. */
    return vmmt__fail(VMMT_ESYS,
                      "group: the collective's all-gather of %zu bytes (%s) failed on rank %d: "
                      "%s",
                      bytes, what, g->rank, err[0] ? err : "no reason given");
}

static int check_config(const vmmt_group_config *c)
{
    if (c->world_size < 1 || c->world_size > VMMT__GROUP_MAX_WORLD)
        return vmmt__fail(VMMT_EINVAL, "group: world_size=%d is outside 1..%d", c->world_size,
                          VMMT__GROUP_MAX_WORLD);
    if (c->rank < 0 || c->rank >= c->world_size)
        return vmmt__fail(VMMT_EINVAL, "group: rank=%d is outside 0..%d (world_size=%d)", c->rank,
                          c->world_size - 1, c->world_size);
    if (c->collective.allgather == NULL)
        return vmmt__fail(VMMT_EINVAL,
                          "group: collective.allgather is NULL; give the job's all-gather, or "
                          "use vmmt_group_create_local or vmmt_group_create_mpi");
    if (c->timeout_ms < 0)
        return vmmt__fail(VMMT_EINVAL, "group: timeout_ms=%d is negative", c->timeout_ms);
    if (c->handle_type != VMMT_HANDLE_AUTO && c->handle_type != VMMT_HANDLE_FABRIC &&
        c->handle_type != VMMT_HANDLE_POSIX_FD)
        return vmmt__fail(VMMT_EINVAL, "group: handle_type=%d; use AUTO, FABRIC or POSIX_FD",
                          (int)c->handle_type);
    if (c->socket_dir != NULL && strlen(c->socket_dir) > 80)
        return vmmt__fail(VMMT_EINVAL,
                          "group: socket_dir \"%s\" is longer than 80 bytes; socket paths are "
                          "limited to 107",
                          c->socket_dir);
    return VMMT_OK;
}

/* This rank's hello: the probe's verdict for FABRIC and POSIX_FD, with causes. */
static void fill_hello(const vmmt_group_config *c, struct vmmt__group_hello *h)
{
    vmmt_device_probe p;
    int st;

    memset(h, 0, sizeof *h);
    memcpy(h->magic, "VMMTGRP1", 8);
    h->version = 1;
    h->rank = c->rank;
    h->world = c->world_size;
    h->pid = (int32_t)getpid();
    h->uid = (uint32_t)geteuid();
    h->device = c->device;
    h->requested = c->handle_type;
    /* As for pools: VMMT_HANDLE_TYPE decides where the config leaves it to the library. */
    if (c->handle_type == VMMT_HANDLE_AUTO && getenv("VMMT_HANDLE_TYPE") != NULL) {
        vmmt_handle_type t;
        if (vmmt_handle_type_parse(getenv("VMMT_HANDLE_TYPE"), &t) == VMMT_OK &&
            (t == VMMT_HANDLE_FABRIC || t == VMMT_HANDLE_POSIX_FD))
            h->requested = t;
    }
    vmmt__group_node_name(h->node, sizeof h->node);
    memset(&p, 0, sizeof p);
    st = vmmt_probe_device(c->device, &p);
    if (st != VMMT_OK && st != VMMT_ENOTSUP) {
        /* Still take part in the vote, so the other ranks learn why instead of waiting. */
        snprintf(h->fabric_cause, sizeof h->fabric_cause, "probe of device %d failed: %s",
                 c->device, vmmt_last_error());
        snprintf(h->posix_cause, sizeof h->posix_cause, "%s", h->fabric_cause);
        return;
    }
    h->fabric_ok = p.candidates[0].works;
    h->posix_ok = p.candidates[1].works;
    snprintf(h->fabric_cause, sizeof h->fabric_cause, "%s", p.candidates[0].cause);
    snprintf(h->posix_cause, sizeof h->posix_cause, "%s", p.candidates[1].cause);
}

int vmmt_group_create_size(const vmmt_group_config *theirs, size_t size, vmmt_group **out)
{
    struct vmmt__group_hello mine;
    vmmt_group_config cfg, *config = &cfg;
    vmmt_group *g = NULL;
    int st;

    if (out != NULL) *out = NULL;
    if (theirs == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_group_create: config and out must not be NULL");
    st = vmmt__group_config_in(theirs, size, "vmmt_group_create", &cfg);
    if (st != VMMT_OK) {
        /* The group owns the adapter from the call on: close it where the struct is one. */
        if (size >= VMMT__GROUP_CONFIG_V1 && size <= VMMT__STRUCT_MAX &&
            theirs->collective.close != NULL)
            theirs->collective.close(theirs->collective.ctx);
        return st;
    }
    if ((st = check_config(config)) != VMMT_OK) goto fail_close;
    if ((g = calloc(1, sizeof *g)) == NULL) {
        st = vmmt__fail(VMMT_ENOMEM, "vmmt_group_create: no memory");
        goto fail_close;
    }
    g->rank = config->rank;
    g->world = config->world_size;
    g->device = config->device;
    g->coll = config->collective;
    g->timeout_ms = config->timeout_ms ? config->timeout_ms : VMMT__GROUP_DEF_TIMEOUT;
    g->max_allocs = config->max_allocations ? config->max_allocations : VMMT__GROUP_DEF_ALLOCS;
    if (config->socket_dir != NULL)
        snprintf(g->socket_dir, sizeof g->socket_dir, "%s", config->socket_dir);
    g->hellos = calloc((size_t)g->world, sizeof *g->hellos);
    g->imports = calloc((size_t)g->world, sizeof *g->imports);
    g->nimports = calloc((size_t)g->world, sizeof *g->nimports);
    g->capimports = calloc((size_t)g->world, sizeof *g->capimports);
    if (g->hellos == NULL || g->imports == NULL || g->nimports == NULL || g->capimports == NULL) {
        st = vmmt__fail(VMMT_ENOMEM, "vmmt_group_create: no memory for %d ranks", g->world);
        goto fail;
    }
    fill_hello(config, &mine);
    st = vmmt__group_allgather(g, &mine, g->hellos, sizeof mine, "hello");
    if (st == VMMT_OK) st = vmmt__group_vote(g->hellos, g->world, &g->type);
    if (st != VMMT_OK) goto fail;
    vmmt__log(VMMT_LOG_INFO, "group: rank %d of %d uses %s handles", g->rank, g->world,
              vmmt__handle_type_upper(g->type));
    *out = g;
    return VMMT_OK;

fail:
    vmmt__wrap(st, "vmmt_group_create(rank=%d, world_size=%d)", config->rank, config->world_size);
    vmmt_group_destroy(g);
    return st;
fail_close:
    vmmt__wrap(st, "vmmt_group_create(rank=%d, world_size=%d)", config->rank, config->world_size);
    if (config->collective.close != NULL) config->collective.close(config->collective.ctx);
    return st;
}

vmmt_handle_type vmmt_group_handle_type(const vmmt_group *group)
{
    return group != NULL ? group->type : VMMT_HANDLE_NONE;
}

int vmmt_group_rank(const vmmt_group *group)
{
    return group != NULL ? group->rank : -1;
}

int vmmt_group_device(const vmmt_group *group)
{
    return group != NULL ? group->device : -1;
}

int vmmt_group_world_size(const vmmt_group *group)
{
    return group != NULL ? group->world : 0;
}

int vmmt_group_get_counts(const vmmt_group *group, size_t *buffers, size_t *peer_allocations)
{
    if (group == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_group_get_counts: group must not be NULL");
    if (buffers != NULL) *buffers = group->nbuffers;
    if (peer_allocations != NULL) *peer_allocations = group->nimported;
    return VMMT_OK;
}

void vmmt__group_span_release(vmmt_group *g, struct vmmt__group_span *s)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint64_t off = 0;
    CUresult r;

    if (d == NULL) return;
    /* Unmap chunk by chunk, as mapped; then free the range. */
    for (uint32_t i = 0; i < s->mapped; i++) {
        uint64_t size = g->imports[s->rank][s->ids[i]].size;
        r = d->cuMemUnmap(s->base + off, size);
        if (r != CUDA_SUCCESS)
            vmmt__log(VMMT_LOG_WARN, "group: cuMemUnmap of rank %d's span -> %s", s->rank,
                      vmmt__cu_name(r));
        off += size;
    }
    s->mapped = 0;
    if (s->reserved && (r = d->cuMemAddressFree(s->base, s->size)) != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_WARN, "group: cuMemAddressFree of rank %d's span -> %s", s->rank,
                  vmmt__cu_name(r));
    s->reserved = 0;
    free(s->ids);
    s->ids = NULL;
}

/* Everything, in the reverse order of acquisition: spans, imports, shared locals, own buffers. */
static void release_all(vmmt_group *g)
{
    const struct vmmt_drv *d = vmmt__drv();

    if (d == NULL || vmmt__ctx_enter(g->device) != VMMT_OK) {
        vmmt__log(VMMT_LOG_WARN, "group: cannot reach the driver to release mappings: %s",
                  vmmt_last_error());
        return;
    }
    while (g->nspans > 0)
        vmmt__group_span_release(g, &g->spans[--g->nspans]);
    for (int r = 0; r < g->world; r++)
        for (size_t i = g->nimports[r]; i-- > 0;)
            if (g->imports[r][i].have_handle) {
                d->cuMemRelease(g->imports[r][i].handle);
                g->imports[r][i].have_handle = 0;
            }
    while (g->nlocals > 0)
        d->cuMemRelease(g->locals[--g->nlocals].handle);
    vmmt__ctx_leave();
    while (g->nowns > 0)
        vmmt_group_free(g, g->owns[g->nowns - 1].base);
}

void vmmt_group_destroy(vmmt_group *group)
{
    struct vmmt__saved_error e;

    if (group == NULL) return;
    vmmt__error_save(&e);
    if (group->nspans || group->nlocals || group->nimported || group->nowns) release_all(group);
    for (int r = 0; group->imports != NULL && r < group->world; r++)
        free(group->imports[r]);
    free(group->imports);
    free(group->nimports);
    free(group->capimports);
    free(group->spans);
    free(group->locals);
    free(group->owns);
    free(group->hellos);
    if (group->coll.close != NULL) group->coll.close(group->coll.ctx);
    free(group);
    vmmt__error_restore(&e);
}
