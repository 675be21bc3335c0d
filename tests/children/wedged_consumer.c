/*
 * A consumer whose stream is blocked for good (a wait that nothing opens,
 * with the producer alive) is destroyed: vmmt_consumer_destroy must return
 * within the consumer's timeout, leaving the pool mapped (the copy out of it
 * is still queued) rather than waiting for the stream. usage: wedged_consumer
 * TIMEOUT_MS. Prints the time destroy took; exits 0 if it stayed within
 * twice the timeout. Its own process, because the kept mapping is leaked on
 * purpose.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "driver.h"
#include "testutil.h"

int main(int argc, char **argv)
{
    const struct vmmt_drv *d;
    vmmt_pool_config cfg;
    vmmt_consumer_config cc;
    vmmt_pool *pool;
    vmmt_consumer *c;
    CUstream s;
    CUdeviceptr src, dst, gate;
    vmmt_buffer b;
    vmmt_desc desc;
    int timeout_ms = argc > 1 ? atoi(argv[1]) : 300;
    double t0, ms;

    tu_use_test_driver();
    d = vmmt__drv();
    vmmt_pool_config_init(&cfg);
    cfg.memory_size = 4u << 20;
    cfg.consumer_count = 1;
    vmmt_consumer_config_init(&cc);
    cc.timeout_ms = timeout_ms;
    if (vmmt_pool_create(&cfg, &pool) != VMMT_OK || vmmt_consumer_create(&cc, &c) != VMMT_OK ||
        vmmt__ctx_enter(0) != VMMT_OK ||
        d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuMemAlloc(&src, 4096) != CUDA_SUCCESS || d->cuMemAlloc(&dst, 4096) != CUDA_SUCCESS ||
        d->cuMemAlloc(&gate, 4096) != CUDA_SUCCESS) {
        fprintf(stderr, "wedged_consumer: setup failed: %s\n", vmmt_last_error());
        return 3;
    }
    memset(&b, 0, sizeof b);
    b.ptr = src;
    b.nbytes = 4096;
    if (vmmt_publish(pool, &b, s, &desc) != VMMT_OK || d->cuStreamSynchronize(s) != CUDA_SUCCESS ||
        d->cuMemsetD8Async(gate, 0, 4, s) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(s) != CUDA_SUCCESS ||
        d->cuStreamWaitValue32(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS ||
        vmmt_consume(c, &desc, 0, dst, 4096, s, VMMT_ALL_RANKS, 0) != VMMT_OK) {
        fprintf(stderr, "wedged_consumer: consume failed: %s\n", vmmt_last_error());
        return 4;
    }
    t0 = vmmt__now_us();
    vmmt_consumer_destroy(c);
    ms = (vmmt__now_us() - t0) / 1e3;
    printf("vmmt_consumer_destroy with a wedged stream took %.1f ms (timeout_ms=%d)\n", ms,
           timeout_ms);
    fflush(stdout);
    _exit(ms < 2.0 * timeout_ms ? 0 : 1);
}
