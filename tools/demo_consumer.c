/*
 * The demo's consumer process (vmmt demo-consumer DEVICE RANK, started by
 * the producer with its socket as fd 3): consume each descriptor into its
 * own device buffer, bring the bytes back and check every one.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "demo_proto.h"
#include "driver.h"

struct consumer_ctx {
    const struct vmmt_drv *d;
    vmmt_consumer *consumer;
    int device, rank;
    CUstream stream;
    CUdeviceptr dst;
    uint8_t *host;
    uint64_t cap;
};

static uint64_t check(const uint8_t *p, uint64_t n, uint32_t pattern)
{
    for (uint64_t j = 0; j < n; j++)
        if (p[j] != demo_byte(pattern, j)) return j;
    return n;
}

/* Make room for n bytes on the device and on the host. */
static int ensure(struct consumer_ctx *c, uint64_t n)
{
    if (n <= c->cap) return VMMT_OK;
    if (c->dst) c->d->cuMemFree(c->dst);
    if (c->host) c->d->cuMemFreeHost(c->host);
    c->dst = 0;
    c->host = NULL;
    c->cap = 0;
    if (c->d->cuMemAlloc(&c->dst, n) != CUDA_SUCCESS ||
        c->d->cuMemAllocHost((void **)&c->host, n) != CUDA_SUCCESS)
        return VMMT_ENOMEM;
    c->cap = n;
    return VMMT_OK;
}

static void serve_one(struct consumer_ctx *c, const struct demo_msg *m, struct demo_reply *r)
{
    vmmt_desc_info info;
    int st;

    memset(r, 0, sizeof *r);
    r->index = m->index;
    st = vmmt_desc_inspect(&m->desc, &info);
    if (st == VMMT_OK) st = ensure(c, info.nbytes);
    if (st == VMMT_OK)
        st = vmmt_consume(c->consumer, &m->desc, c->device, c->dst, c->cap, c->stream, c->rank, 1);
    if (st == VMMT_OK &&
        (c->d->cuMemcpyDtoHAsync(c->host, c->dst, info.nbytes, c->stream) != CUDA_SUCCESS ||
         c->d->cuStreamSynchronize(c->stream) != CUDA_SUCCESS))
        st = VMMT_ECUDA;
    if (st == VMMT_OK) r->first_bad = check(c->host, info.nbytes, m->pattern);
    if (st == VMMT_OK && r->first_bad != info.nbytes) {
        st = VMMT_EPROTO;
        snprintf(r->error, sizeof r->error, "byte %llu differs", (unsigned long long)r->first_bad);
    } else if (st != VMMT_OK) {
        snprintf(r->error, sizeof r->error, "%s", vmmt_last_error());
    }
    r->status = st;
}

int demo_consumer_main(int argc, char **argv)
{
    struct consumer_ctx c;
    struct demo_msg m;
    struct demo_reply r;
    int rc = CLI_OK;

    memset(&c, 0, sizeof c);
    /* Internal arguments, from vmmt demo itself: anything else is a caller's mistake. */
    if (argc < 3 || cli_parse_int(argv[1], 0, 1 << 16, &c.device) != 0 ||
        cli_parse_int(argv[2], 0, 1 << 16, &c.rank) != 0) {
        fprintf(stderr,
                "vmmt demo consumer: expected DEVICE RANK (numbers from 0), got \"%s\" "
                "\"%s\": it is started by vmmt demo, not by hand\n",
                argc > 1 ? argv[1] : "", argc > 2 ? argv[2] : "");
        return CLI_ERROR;
    }
    if (argc >= 5 && strcmp(argv[3], "--driver") == 0 && cli_select_driver(argv[4]) != CLI_OK)
        return CLI_ERROR;
    c.d = vmmt__drv();
    if (c.d == NULL || vmmt_consumer_create(NULL, &c.consumer) != VMMT_OK ||
        vmmt__ctx_enter(c.device) != VMMT_OK ||
        c.d->cuStreamCreate(&c.stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        fprintf(stderr, "vmmt demo consumer %d: %s\n", c.rank, vmmt_last_error());
        return CLI_ERROR;
    }
    while (read(3, &m, sizeof m) == (ssize_t)sizeof m && m.index != DEMO_END) {
        serve_one(&c, &m, &r);
        if (r.status != VMMT_OK) rc = CLI_FAIL;
        if (write(3, &r, sizeof r) != (ssize_t)sizeof r) break;
    }
    c.d->cuStreamSynchronize(c.stream);
    vmmt_consumer_destroy(c.consumer);
    if (c.dst) c.d->cuMemFree(c.dst);
    if (c.host) c.d->cuMemFreeHost(c.host);
    c.d->cuStreamDestroy(c.stream);
    vmmt__ctx_leave();
    return rc;
}
