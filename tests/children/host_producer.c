/*
 * A host-pool producer that never touches a GPU, for the test that a
 * tokenizer-like process can publish. usage: host_producer COUNT NBYTES.
 * Publishes COUNT buffers of pattern i from host memory (every third one
 * written in place with vmmt_reserve + memcpy + vmmt_commit), sends each
 * descriptor as a struct tu_msg on fd 3 and waits for the struct tu_reply;
 * then drains, and checks that it made no context and held no device memory
 * (the emulator's counters; on a real driver only the pool's own numbers).
 * Exits 0 when all held, else prints why and exits non-zero.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "emu.h"
#include "pattern.h"
#include "testutil.h"

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "host_producer: " __VA_ARGS__);                                        \
            fprintf(stderr, " (%s)\n", vmmt_last_error());                                         \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static int publish_one(vmmt_pool *pool, uint32_t i, size_t n, uint8_t *buf, vmmt_desc *d)
{
    vmmt_buffer b;
    vmmt_reservation r;

    if (i % 3 == 2) {
        int st = vmmt_reserve(pool, n, &r);
        if (st != VMMT_OK) return st;
        if (r.location != VMMT_LOC_HOST) return VMMT_ESTATE;
        tu_pattern_fill((uint8_t *)(uintptr_t)r.ptr, n, i);
        return vmmt_commit(pool, &r, NULL, NULL, d);
    }
    tu_pattern_fill(buf, n, i);
    memset(&b, 0, sizeof b);
    b.ptr = (uint64_t)(uintptr_t)buf;
    b.nbytes = n;
    b.location = VMMT_LOC_HOST;
    return vmmt_publish(pool, &b, NULL, d);
}

static int run(vmmt_pool *pool, uint32_t count, size_t n, uint8_t *buf)
{
    for (uint32_t i = 0; i < count; i++) {
        struct tu_reply rep;
        vmmt_desc d;
        CHECK(publish_one(pool, i, n, buf, &d) == VMMT_OK, "publish %u failed", i);
        CHECK(tu_send_msg(3, i, 0, d.bytes) == 0, "sending descriptor %u", i);
        CHECK(read(3, &rep, sizeof rep) == (ssize_t)sizeof rep, "reading reply %u", i);
        CHECK(rep.status == VMMT_OK && rep.index == i, "consumer refused buffer %u: %d", i,
              rep.status);
    }
    return 0;
}

static int check_no_gpu(vmmt_pool *pool)
{
    vmmt_pool_stats s;

    CHECK(vmmt_pool_get_stats(pool, &s) == VMMT_OK, "stats");
    CHECK(s.memory_location == VMMT_MEMORY_HOST, "not a host pool");
    CHECK(s.device_bytes == 0 && s.host_bytes > 0, "pool holds %llu device bytes",
          (unsigned long long)s.device_bytes);
    if (strcmp(vmmt_driver_name(), "emu") != 0) return 0;
    CHECK(vmmt__emu_calls("cuDevicePrimaryCtxRetain") == 0, "a primary context was retained");
    CHECK(vmmt__emu_calls("cuCtxPushCurrent") == 0, "a context was made current");
    CHECK(vmmt__emu_calls("cuStreamCreate") == 0, "a stream was created");
    CHECK(vmmt__emu_calls("cuMemHostRegister") == 0, "host memory was registered");
    CHECK(vmmt__emu_live_contexts() == 0, "%d live context(s)", vmmt__emu_live_contexts());
    CHECK(vmmt__emu_device_bytes() == 0, "%llu bytes of device memory held",
          vmmt__emu_device_bytes());
    CHECK(vmmt__emu_host_numa_bytes() >= s.host_bytes, "the pool is not host-NUMA memory");
    return 0;
}

int main(int argc, char **argv)
{
    vmmt_pool_config c;
    vmmt_pool *pool = NULL;
    struct tu_msg end;
    uint32_t count;
    size_t n;
    uint8_t *buf;
    int rc;

    if (argc < 3) return 2;
    count = (uint32_t)atoi(argv[1]);
    n = (size_t)atol(argv[2]);
    tu_use_test_driver();
    buf = malloc(n);
    vmmt_pool_config_init(&c);
    c.memory_size = 8ull << 20;
    c.consumer_count = 1;
    c.max_slices = 16;
    c.memory_location = VMMT_MEMORY_HOST;
    CHECK(buf != NULL, "no memory");
    CHECK(vmmt_pool_create(&c, &pool) == VMMT_OK, "creating the host pool");
    rc = run(pool, count, n, buf);
    if (rc == 0) CHECK(vmmt_pool_drain(pool, 5000) == VMMT_OK, "draining");
    if (rc == 0) rc = check_no_gpu(pool);
    memset(&end, 0, sizeof end);
    end.index = UINT32_MAX;
    if (write(3, &end, sizeof end) != (ssize_t)sizeof end) rc = 1;
    vmmt_pool_destroy(pool);
    if (rc == 0 && strcmp(vmmt_driver_name(), "emu") == 0) {
        CHECK(vmmt__emu_live_allocations() == 0 && vmmt__emu_live_mappings() == 0,
              "leaked %d allocation(s), %d mapping(s)", vmmt__emu_live_allocations(),
              vmmt__emu_live_mappings());
        CHECK(vmmt__emu_live_contexts() == 0, "a context after destroy");
    }
    free(buf);
    return rc;
}
