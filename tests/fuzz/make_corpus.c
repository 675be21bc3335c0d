/*
 * Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/):
 * real descriptors from publishes on the emulated driver (single, typed,
 * packed; shared host table and device table), a FABRIC one, and requests and
 * replies as the broker and its clients write them, plus a few near misses
 * of each. Run by hand when a format changes:
 *     build/tests/fuzz/make_corpus tests/fuzz/corpus
 * Kept apart from CTest: the committed corpus is the record, not this program.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "desc.h"
#include "driver.h"
#include "testutil.h"
#include "vmmt.h"

static const char *root;

static void put(const char *target, const char *name, const void *p, size_t n)
{
    char path[4096];
    FILE *f;

    snprintf(path, sizeof path, "%s/%s", root, target);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) perror(path);
    snprintf(path, sizeof path, "%s/%s/%s", root, target, name);
    f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

static void check(int st, const char *what)
{
    if (st != VMMT_OK) {
        fprintf(stderr, "%s: %s\n", what, vmmt_last_error());
        exit(1);
    }
}

/* Publish from one pool: a single byte buffer, a typed tensor, a packed group of three. */
static void descs_of_pool(int device_table, const char *tag)
{
    const struct vmmt_drv *d = vmmt__drv();
    vmmt_pool_config c;
    vmmt_pool *pool;
    vmmt_buffer bufs[3];
    vmmt_desc out[3];
    CUdeviceptr src;
    char name[64];

    vmmt_pool_config_init(&c);
    c.memory_size = 4u << 20;
    c.consumer_count = 3;
    c.max_slices = 32;
    c.device_control_table = device_table;
    check(vmmt_pool_create(&c, &pool), "pool");
    vmmt__ctx_enter(0);
    if (d->cuMemAlloc(&src, 1 << 16) != CUDA_SUCCESS) exit(1);
    memset(bufs, 0, sizeof bufs);
    bufs[0].ptr = src;
    bufs[0].nbytes = 1000;
    check(vmmt_publish(pool, &bufs[0], NULL, &out[0]), "publish");
    snprintf(name, sizeof name, "%s-bytes", tag);
    put("fuzz_desc_decode", name, out[0].bytes, VMMT_DESC_SIZE);

    bufs[0].nbytes = 4 * 8 * 16 * 2;
    bufs[0].dtype = (vmmt_dtype){.code = 4, .bits = 16, .lanes = 1};
    bufs[0].ndim = 3;
    bufs[0].shape[0] = 4, bufs[0].shape[1] = 8, bufs[0].shape[2] = 16;
    check(vmmt_publish(pool, &bufs[0], NULL, &out[0]), "publish typed");
    snprintf(name, sizeof name, "%s-bf16", tag);
    put("fuzz_desc_decode", name, out[0].bytes, VMMT_DESC_SIZE);

    for (int i = 0; i < 3; i++) {
        bufs[i] = bufs[0];
        bufs[i].ptr = src + 4096u * (unsigned)i;
        bufs[i].dtype = (vmmt_dtype){.code = 2, .bits = 32, .lanes = 1};
        bufs[i].ndim = 1;
        bufs[i].shape[0] = 3 + i;
        bufs[i].shape[1] = bufs[i].shape[2] = 0;
        bufs[i].nbytes = 4u * (3u + (unsigned)i);
    }
    check(vmmt_publish_packed(pool, bufs, 3, NULL, out), "publish packed");
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%s-packed%d", tag, i);
        put("fuzz_desc_decode", name, out[i].bytes, VMMT_DESC_SIZE);
    }
    /* A near miss: one bit of the buffer's offset flipped. */
    out[1].bytes[288] ^= 0x01;
    snprintf(name, sizeof name, "%s-packed1-offset-bit", tag);
    put("fuzz_desc_decode", name, out[1].bytes, VMMT_DESC_SIZE);
    d->cuMemFree(src);
    vmmt__ctx_leave();
    vmmt_pool_destroy(pool);
}

static void fabric_desc(void)
{
    struct vmmt__desc d;
    uint8_t wire[VMMT_DESC_SIZE];

    memset(&d, 0, sizeof d);
    for (int i = 0; i < 16; i++)
        d.pool_id[i] = (uint8_t)(0x40 + i);
    for (int i = 0; i < 64; i++)
        d.fabric[i] = (uint8_t)(0x80 + i);
    d.handle_type = VMMT_HANDLE_FABRIC;
    d.flags = VMMT__DESC_STREAM_ORDERED;
    d.consumer_count = 8;
    d.alloc_size = 1ull << 30;
    d.table_slots = 4096;
    d.slot_stride = 36;
    d.data_offset = 2u << 20;
    d.slot = 4095;
    d.generation = 0xfffffffdu; /* the last generation (src/wire/generation.h) */
    d.slice_offset = d.alloc_size - (1u << 20);
    d.slice_bytes = 1u << 20;
    d.offset = d.slice_offset;
    d.nbytes = 1u << 20;
    d.pack_count = 1;
    if (vmmt__desc_validate(&d) != VMMT_OK) {
        fprintf(stderr, "fabric seed: %s\n", vmmt_last_error());
        exit(1);
    }
    vmmt__desc_encode(&d, wire);
    put("fuzz_desc_decode", "fabric", wire, sizeof wire);
}

static void roundtrip_seeds(void)
{
    uint8_t b[512];

    memset(b, 0, sizeof b);
    put("fuzz_desc_roundtrip", "zeros", b, sizeof b);
    for (size_t i = 0; i < sizeof b; i++)
        b[i] = (uint8_t)(i * 37 + 11);
    put("fuzz_desc_roundtrip", "ramp", b, sizeof b);
    memset(b, 0xff, sizeof b);
    put("fuzz_desc_roundtrip", "ones", b, sizeof b);
    /* Fabric chosen, every field in the producer's shapes, small values. */
    memset(b, 0, sizeof b);
    b[4] = 1;
    for (size_t i = 5; i < sizeof b; i++)
        b[i] = (uint8_t)(1 + i % 5);
    put("fuzz_desc_roundtrip", "fabric-small", b, sizeof b);
}

static void broker_seeds(void)
{
    uint8_t req[24] = {'V', 'M', 'B', 'Q', 2, 0, 0, 0};
    uint8_t reply[3 + 14 + 200];
    const char *text = "pool 01020304 is not served here";

    for (int i = 0; i < 16; i++)
        req[8 + i] = (uint8_t)(i + 1);
    put("fuzz_broker_request", "valid", req, sizeof req);
    put("fuzz_broker_request", "short", req, 23);
    req[4] = 1;
    put("fuzz_broker_request", "version1", req, sizeof req);
    req[4] = 2;
    req[6] = 1;
    put("fuzz_broker_request", "reserved", req, sizeof req);
    put("fuzz_broker_request", "http", "GET / HTTP/1.1\r\n\r\n", 18);

    /* Selector bytes (flags, fds attached, fds wanted - 1), then the packet. */
    memset(reply, 0, sizeof reply);
    reply[0] = 0, reply[1] = 2, reply[2] = 1;
    memcpy(reply + 3, "VMBR", 4);
    reply[3 + 4] = 2;
    reply[3 + 6] = 2;
    put("fuzz_broker_reply", "ok-2fds", reply, 3 + 14);
    reply[1] = 1, reply[2] = 0, reply[3 + 6] = 1;
    put("fuzz_broker_reply", "ok-1fd", reply, 3 + 14);
    reply[1] = 0, reply[3 + 6] = 0;
    reply[3 + 8] = (uint8_t)VMMT_EINVAL, reply[3 + 9] = reply[3 + 10] = reply[3 + 11] = 0xff;
    reply[3 + 12] = (uint8_t)strlen(text);
    memcpy(reply + 3 + 14, text, strlen(text));
    put("fuzz_broker_reply", "refused", reply, 3 + 14 + strlen(text));
    reply[3 + 4] = 3;
    put("fuzz_broker_reply", "version3", reply, 3 + 14 + strlen(text));
    reply[0] = 2, reply[1] = 1, reply[3 + 4] = 2;
    put("fuzz_broker_reply", "ctrunc", reply, 3 + 14 + strlen(text));
}

/* Protocol 3 (liveness links, pool id in the reply): seeds for when the library speaks it. */
static void broker_v3_seeds(void)
{
    uint8_t req[24] = {'V', 'M', 'B', 'Q', 3, 0, 1, 0};
    uint8_t reply[3 + 30 + 200];
    uint8_t link[1 + 16] = {7, 'V', 'M', 'B', 'M', 3, 0, 1, 0, 2, 0, 0, 0, 3, 0, 0, 0};
    const char *text = "uid 1234 is not allowed";

    for (int i = 0; i < 16; i++)
        req[8 + i] = (uint8_t)(i + 1);
    put("fuzz_broker_request", "v3-hold", req, sizeof req);
    req[6] = 0;
    put("fuzz_broker_request", "v3-plain", req, sizeof req);
    req[6] = 2;
    put("fuzz_broker_request", "v3-unknown-flag", req, sizeof req);

    memset(reply, 0, sizeof reply);
    reply[0] = 0, reply[1] = 2, reply[2] = 1;
    memcpy(reply + 3, "VMBR", 4);
    reply[3 + 4] = 3;
    reply[3 + 6] = 2;
    reply[3 + 7] = 1;
    for (int i = 0; i < 16; i++)
        reply[3 + 14 + i] = (uint8_t)(i + 1);
    put("fuzz_broker_reply", "v3-ok-2fds-held", reply, 3 + 30);
    reply[3 + 14] ^= 0xff;
    put("fuzz_broker_reply", "v3-other-pool", reply, 3 + 30);
    reply[1] = 0, reply[3 + 6] = 0, reply[3 + 7] = 0;
    reply[3 + 8] = (uint8_t)VMMT_EPERM, reply[3 + 9] = reply[3 + 10] = reply[3 + 11] = 0xff;
    reply[3 + 12] = (uint8_t)strlen(text);
    memcpy(reply + 3 + 30, text, strlen(text));
    put("fuzz_broker_reply", "v3-refused", reply, 3 + 30 + strlen(text));

    put("fuzz_broker_link", "hold", link, sizeof link);
    link[7] = 2, link[9] = 0, link[13] = 0;
    put("fuzz_broker_link", "bye", link, sizeof link);
    link[7] = 1, link[9] = 7, link[13] = 2;
    put("fuzz_broker_link", "hold-outside", link, sizeof link);
    put("fuzz_broker_link", "short", link, 10);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    root = argv[1];
    if (mkdir(root, 0755) != 0 && errno != EEXIST) perror(root);
    setenv("VMMT_TEST_DRIVER", "emu", 1);
    tu_use_test_driver();
    descs_of_pool(0, "hosttable");
    descs_of_pool(1, "devtable");
    fabric_desc();
    roundtrip_seeds();
    broker_seeds();
    broker_v3_seeds();
    return 0;
}
