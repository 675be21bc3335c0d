/*
 * A consumer process for transport tests. usage: consumer_child DEVICE
 * RANK_FIRST RANK_COUNT. Reads struct tu_msg from fd 3 until index
 * UINT32_MAX; for each, consumes into a device buffer on its own stream,
 * checks the bytes, and answers with struct tu_reply. A message whose pad is
 * TU_MSG_KEEP is only kept (status 1): the slice stays held, as by a slow
 * rank. TU_MSG_RANK(r) consumes for rank r alone (a process taking over a
 * rank). TU_MSG_LINGER forks a worker (no exec) that keeps every fd it
 * inherited and sleeps until killed, as a worker forked by an engine would;
 * its pid comes back in first_bad. Exits 0 if all matched.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "pattern.h"
#include "testutil.h"

static int handle(vmmt_consumer *c, int device, int first, int count, const struct tu_msg *m,
                  CUstream s, struct tu_reply *rep)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_desc desc;
    vmmt_desc_info info;
    CUdeviceptr dst = 0;
    uint8_t *host = NULL;
    int st;

    memcpy(desc.bytes, m->desc, sizeof desc.bytes);
    rep->index = m->index;
    rep->first_bad = 0;
    st = vmmt_desc_inspect(&desc, &info);
    if (st != VMMT_OK) return st;
    host = malloc(info.nbytes);
    if (d->cuMemAlloc(&dst, info.nbytes) != CUDA_SUCCESS) {
        free(host);
        return VMMT_ENOMEM;
    }
    st = vmmt_consume(c, &desc, device, dst, info.nbytes, s, first, count);
    if (st == VMMT_OK && (d->cuMemcpyDtoHAsync(host, dst, info.nbytes, s) != CUDA_SUCCESS ||
                          d->cuStreamSynchronize(s) != CUDA_SUCCESS))
        st = VMMT_ECUDA;
    if (st == VMMT_OK) rep->first_bad = tu_pattern_check(host, info.nbytes, m->index);
    if (st == VMMT_OK && rep->first_bad != info.nbytes) st = VMMT_EPROTO;
    d->cuMemFree(dst);
    free(host);
    return st;
}

int main(int argc, char **argv)
{
    const struct vmmt_drv *d;
    vmmt_consumer *c;
    CUstream s;
    int device, first, count, bad = 0;

    if (argc < 4) return 2;
    device = atoi(argv[1]);
    first = atoi(argv[2]);
    count = atoi(argv[3]);
    tu_use_test_driver();
    d = vmmt__drv();
    if (vmmt_consumer_create(NULL, &c) != VMMT_OK || vmmt__ctx_enter(device) != VMMT_OK ||
        d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        fprintf(stderr, "consumer_child: setup failed: %s\n", vmmt_last_error());
        return 3;
    }
    for (;;) {
        struct tu_msg m;
        struct tu_reply rep;
        ssize_t n = read(3, &m, sizeof m);
        if (n != (ssize_t)sizeof m || m.index == UINT32_MAX) break;
        if (m.pad == TU_MSG_KEEP || m.pad == TU_MSG_LINGER) {
            pid_t pid = m.pad == TU_MSG_LINGER ? fork() : 1;
            if (pid == 0) alarm(120); /* never outlives a test that forgot it */
            while (pid == 0)          /* the worker: it holds what it inherited until killed */
                pause();
            rep.index = m.index;
            rep.status = pid > 0 ? 1 : -1;
            rep.first_bad = m.pad == TU_MSG_LINGER && pid > 0 ? (uint64_t)pid : 0;
            if (write(3, &rep, sizeof rep) != (ssize_t)sizeof rep) break;
            continue;
        }
        if (m.pad >= TU_MSG_RANK(0))
            rep.status = handle(c, device, (int)(m.pad - TU_MSG_RANK(0)), 1, &m, s, &rep);
        else
            rep.status = handle(c, device, first, count, &m, s, &rep);
        if (rep.status != VMMT_OK) {
            fprintf(stderr, "consumer_child: buffer %u: %s\n", m.index, vmmt_last_error());
            bad++;
        }
        if (write(3, &rep, sizeof rep) != (ssize_t)sizeof rep) break;
    }
    d->cuStreamSynchronize(s);
    d->cuStreamDestroy(s);
    vmmt__ctx_leave();
    vmmt_consumer_destroy(c);
    return bad ? 1 : 0;
}
