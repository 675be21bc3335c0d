/*
 * A producer process that is killed mid-publish, for the dead-producer
 * tests. usage: producer_child DEVICE_TABLE (0 or 1). Creates a pool for one
 * consumer and writes to fd 3, as struct tu_msg: buffer 1, published and
 * landed (its ready flag set); buffer 2, published and landed, for a consume
 * after the death; buffer 3, whose copy and ready flag are queued behind a
 * stream wait that never opens. Then it waits (at most 60 s) to be killed.
 * With a second argument "linger" it first forks a worker (no exec) that
 * keeps every fd it inherited and sleeps until killed, as a worker forked by
 * an engine would, and sends its pid as message 4 (in pad).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "pattern.h"
#include "testutil.h"

int main(int argc, char **argv)
{
    const struct vmmt_drv *d;
    vmmt_pool_config cfg;
    vmmt_pool *pool;
    CUstream s;
    CUdeviceptr src, gate;
    vmmt_buffer b;
    vmmt_desc desc;
    uint8_t host[4096];

    tu_use_test_driver();
    d = vmmt__drv();
    vmmt_pool_config_init(&cfg);
    cfg.memory_size = 4u << 20;
    cfg.consumer_count = 2; /* two ranks: two consumers can copy the same slot within the rules */
    cfg.max_slices = 16;
    cfg.device_control_table = argc > 1 && atoi(argv[1]) != 0;
    if (vmmt_pool_create(&cfg, &pool) != VMMT_OK || vmmt__ctx_enter(0) != VMMT_OK ||
        d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
        d->cuMemAlloc(&src, 3 * sizeof host) != CUDA_SUCCESS ||
        d->cuMemAlloc(&gate, 4096) != CUDA_SUCCESS) {
        fprintf(stderr, "producer_child: setup failed: %s\n", vmmt_last_error());
        return 3;
    }
    memset(&b, 0, sizeof b);
    b.nbytes = sizeof host;
    for (uint32_t i = 1; i <= 3; i++) {
        tu_pattern_fill(host, sizeof host, i);
        if (d->cuMemcpyHtoDAsync(src + (i - 1) * sizeof host, host, sizeof host, s) !=
                CUDA_SUCCESS ||
            d->cuStreamSynchronize(s) != CUDA_SUCCESS)
            return 4;
    }
    for (uint32_t i = 1; i <= 2; i++) {
        b.ptr = src + (i - 1) * sizeof host;
        if (vmmt_publish(pool, &b, s, &desc) != VMMT_OK ||
            d->cuStreamSynchronize(s) != CUDA_SUCCESS || tu_send_msg(3, i, 0, desc.bytes) != 0)
            return 5;
    }
    /* Hold the stream: the third publish's copy and ready flag stay queued. */
    if (d->cuMemsetD8Async(gate, 0, 4, s) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(s) != CUDA_SUCCESS ||
        d->cuStreamWaitValue32(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
        return 6;
    b.ptr = src + 2 * sizeof host;
    if (vmmt_publish(pool, &b, s, &desc) != VMMT_OK || tu_send_msg(3, 3, 0, desc.bytes) != 0)
        return 7;
    if (argc > 2 && strcmp(argv[2], "linger") == 0) {
        pid_t pid = fork();
        if (pid == 0) alarm(120); /* never outlives a test that forgot it */
        while (pid == 0)
            pause();
        if (pid < 0 || tu_send_msg(3, 4, (uint32_t)pid, NULL) != 0) return 9;
    }
    sleep(60);
    return 8;
}
