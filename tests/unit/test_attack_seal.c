/*
 * An outside attacker's sequences against the seal, the pool record and the
 * cancel that writes every rank's acknowledgement (docs/descriptor.md "The
 * seal", "The control table", "What a reader must verify, in order",
 * "Importing the pool"; docs/design.md "Invariants" 0 and 7), written from
 * the public header and the docs alone. A test named "finding" fails
 * against the library as it is and says what the docs promise instead; one
 * named "holds" is a regression test for an attack that was refused as
 * documented.
 *
 * The seal is computed here from the docs (SipHash-2-4 of the 512 bytes with
 * the seal field read as 0, under the key of the pool record), not with the
 * library's code, so that a forger is exactly as strong as the docs make
 * one: a key holder (a pool's own producer, or a process that imported it)
 * or someone who chose the key himself.
 */
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "emu.h"
#include "pattern.h"
#include "poolfix.h"
#include "rawbroker.h"

#define N 4096

/* Field offsets of docs/descriptor.md, "Layout". */
#define OFF_FLAGS          16
#define OFF_POOL_ID        24
#define OFF_BROKER_KIND    104
#define OFF_BROKER_LEN     105
#define OFF_BROKER_NAME    106
#define OFF_CONSUMER_COUNT 224
#define OFF_TABLE_SLOTS    228
#define OFF_ALLOC_SIZE     232
#define OFF_TABLE_OFFSET   240
#define OFF_SLOT_STRIDE    248
#define OFF_DATA_OFFSET    256
#define OFF_SLOT           264
#define OFF_GENERATION     268
#define OFF_SLICE_OFFSET   272
#define OFF_SLICE_BYTES    280
#define OFF_OFFSET         288
#define OFF_NBYTES         296
#define OFF_SEAL           392
#define OFF_CHUNK_SIZE     480

#define FLAG_HOST_TABLE 4u

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

/* ------------------------------------------------ SipHash-2-4, from the paper */

static uint64_t rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

#define SIPROUND                                                                                   \
    do {                                                                                           \
        v0 += v1;                                                                                  \
        v1 = rotl(v1, 13);                                                                         \
        v1 ^= v0;                                                                                  \
        v0 = rotl(v0, 32);                                                                         \
        v2 += v3;                                                                                  \
        v3 = rotl(v3, 16);                                                                         \
        v3 ^= v2;                                                                                  \
        v0 += v3;                                                                                  \
        v3 = rotl(v3, 21);                                                                         \
        v3 ^= v0;                                                                                  \
        v2 += v1;                                                                                  \
        v1 = rotl(v1, 17);                                                                         \
        v1 ^= v2;                                                                                  \
        v2 = rotl(v2, 32);                                                                         \
    } while (0)

static uint64_t siphash24(const uint8_t key[16], const uint8_t *m, size_t len)
{
    uint64_t k0 = le64(key), k1 = le64(key + 8);
    uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
    uint64_t b = (uint64_t)len << 56;
    size_t i;

    for (i = 0; i + 8 <= len; i += 8) {
        uint64_t w = le64(m + i);
        v3 ^= w;
        SIPROUND;
        SIPROUND;
        v0 ^= w;
    }
    for (size_t j = 0; i + j < len; j++)
        b |= (uint64_t)m[i + j] << (8 * j);
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* The seal a record must carry under key (docs/descriptor.md, "The seal"). */
static uint64_t seal_of(const vmmt_desc *d, const uint8_t key[16])
{
    vmmt_desc z = *d;

    memset(z.bytes + OFF_SEAL, 0, 8);
    return siphash24(key, z.bytes, VMMT_DESC_SIZE);
}

static void seal_with(vmmt_desc *d, const uint8_t key[16])
{
    tu_put64(d, OFF_SEAL, seal_of(d, key));
}

/* ------------------------------------------------------------------ helpers */

static void sync_stream(struct fixture *f)
{
    assert_int_equal(vmmt__drv()->cuStreamSynchronize(f->stream), CUDA_SUCCESS);
}

static int consume_on(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d, int first, int count)
{
    return vmmt_consume(c, d, 0, f->dst, f->cap, f->stream, first, count);
}

static int consume_all(struct fixture *f, vmmt_consumer *c, const vmmt_desc *d)
{
    return consume_on(f, c, d, VMMT_ALL_RANKS, 0);
}

static vmmt_consumer *fresh_consumer(void)
{
    vmmt_consumer *c;

    assert_vmmt_ok(vmmt_consumer_create(NULL, &c));
    return c;
}

/* Does `at` hold n bytes of pattern i? */
static int holds(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n);
    int ok;

    assert_non_null(h);
    assert_int_equal(vmmt__drv()->cuMemcpyDtoHAsync(h, at, n, f->stream), CUDA_SUCCESS);
    sync_stream(f);
    ok = tu_pattern_check(h, n, i) == n;
    free(h);
    return ok;
}

/* The first offset at which `at` differs from want, or -1 where it holds all n bytes. */
static long differs_at(struct fixture *f, CUdeviceptr at, const uint8_t *want, size_t n)
{
    uint8_t *h = malloc(n);
    long off = -1;

    assert_non_null(h);
    assert_int_equal(vmmt__drv()->cuMemcpyDtoHAsync(h, at, n, f->stream), CUDA_SUCCESS);
    sync_stream(f);
    for (size_t i = 0; i < n && off < 0; i++)
        if (h[i] != want[i]) off = (long)i;
    free(h);
    return off;
}

static void upload(struct fixture *f, CUdeviceptr at, const uint8_t *h, size_t n)
{
    assert_int_equal(vmmt__drv()->cuMemcpyHtoDAsync(at, h, n, f->stream), CUDA_SUCCESS);
    sync_stream(f);
}

static vmmt_pool *make(vmmt_pool_config c)
{
    vmmt_pool *p;

    assert_vmmt_ok(vmmt_pool_create(&c, &p));
    return p;
}

static vmmt_pool_config fixed(int consumers, uint32_t slices, int device_table)
{
    vmmt_pool_config c;

    vmmt_pool_config_init(&c);
    c.memory_size = 4 * MiB;
    c.consumer_count = consumers;
    c.max_slices = slices;
    c.device_control_table = device_table;
    return c;
}

static void fabric_on(void)
{
    setenv("VMMT_EMU_HANDLES", "fabric,posix_fd", 1);
    vmmt__emu_configure();
    vmmt_probe_reset();
}

static vmmt_pool_config fabric(int consumers, uint32_t slices)
{
    vmmt_pool_config c = fixed(consumers, slices, 0);

    c.handle_type = VMMT_HANDLE_FABRIC;
    c.allow_posix_fallback = 0;
    return c;
}

static vmmt_desc publish_pattern(struct fixture *f, vmmt_pool *p, CUdeviceptr at, size_t n,
                                 uint32_t i)
{
    vmmt_buffer b = bytes(at, n);
    vmmt_desc d;

    put(f, at, n, i);
    assert_vmmt_ok(vmmt_publish(p, &b, f->stream, &d));
    sync_stream(f);
    return d;
}

/* Wait (bounded) until cond() holds; the tests never assert on how long it took. */
static int eventually(int (*cond)(void *), void *arg)
{
    for (int i = 0; i < 5000; i++) {
        if (cond(arg)) return 1;
        sleep_ms(1);
    }
    return cond(arg);
}

/*
 * The process's fds, mappings and threads, once they stop changing: a
 * broker closes its end of a consumer's connection on its own thread, a
 * little after the consumer closed it.
 */
static tu_resources settled(void)
{
    tu_resources a, b;

    tu_resources_take(&a);
    for (int i = 0; i < 500; i++) {
        sleep_ms(10);
        tu_resources_take(&b);
        if (memcmp(&a, &b, sizeof a) == 0) return b;
        a = b;
    }
    return a;
}

struct want {
    tu_resources r;
};

static int back_to(void *arg)
{
    tu_resources now;

    tu_resources_take(&now);
    return memcmp(&now, &((struct want *)arg)->r, sizeof now) == 0;
}

/*
 * The control table of a POSIX_FD pool as an independent reader finds it
 * (docs/descriptor.md, "The control table"), mapped read-write: the shared
 * memfd, or, for a device table, the emulated allocation itself (the
 * emulator's device memory is a memfd, docs/emulator.md).
 */
struct table {
    uint8_t *map;
    size_t len;
    uint8_t *rows;   /* row 0 */
    uint8_t *record; /* the 64-byte pool record, the table's first bytes */
};

static void table_open(const vmmt_desc *d, struct table *t)
{
    uint64_t rows = (uint64_t)tu_get32(d, OFF_TABLE_SLOTS) * tu_get32(d, OFF_SLOT_STRIDE);
    uint64_t chunk = tu_get64(d, OFF_CHUNK_SIZE);
    uint64_t words = chunk ? 4 * (tu_get64(d, OFF_ALLOC_SIZE) / chunk) : 0;
    int host = (tu_get32(d, OFF_FLAGS) & FLAG_HOST_TABLE) != 0;
    int fds[2], n, fd;
    struct stat sb;

    assert_int_equal(tu_raw_fetch(d, fds, &n), VMMT_OK);
    assert_int_equal(n, host && chunk == 0 ? 2 : 1);
    fd = fds[n - 1];
    if (n == 2) close(fds[0]);
    assert_int_equal(fstat(fd, &sb), 0);
    t->len = (size_t)sb.st_size;
    t->map = mmap(NULL, t->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    assert_true(t->map != MAP_FAILED);
    (void)host;
    t->record = t->map;
    t->rows = t->map + tu_get64(d, OFF_TABLE_OFFSET);
    assert_true(t->rows + rows + words <= t->map + t->len);
}

static void table_close(struct table *t)
{
    munmap(t->map, t->len);
}

static uint32_t word(const struct table *t, const vmmt_desc *d, int w)
{
    const uint8_t *row = t->rows + (size_t)tu_get32(d, OFF_SLOT) * tu_get32(d, OFF_SLOT_STRIDE);

    return __atomic_load_n((const uint32_t *)(row + 4 * w), __ATOMIC_ACQUIRE);
}

/* The key of a POSIX_FD pool, read from its record where the docs put it. */
static void pool_key(const vmmt_desc *d, uint8_t key[16])
{
    struct table t;

    table_open(d, &t);
    assert_memory_equal(t.record, "POOL", 4);
    assert_int_equal(le32(t.record + 4), tu_get32(d, OFF_TABLE_SLOTS));
    assert_int_equal(le32(t.record + 8), tu_get32(d, OFF_SLOT_STRIDE));
    assert_int_equal(le32(t.record + 12), tu_get32(d, OFF_CONSUMER_COUNT));
    assert_memory_equal(t.record + 16, d->bytes + OFF_POOL_ID, 16);
    memcpy(key, t.record + 48, 16);
    table_close(&t);
}

/* ============================================================ the seal itself */

/*
 * An independent reader computes the seal exactly as the docs define it,
 * with the key where the docs put it: in the pool record that opens every
 * control table (a shared table's memfd, a device table's allocation). Holds if every descriptor's
 * seal is that SipHash, the key differs between two pools of one process, and a record resealed
 * under it is consumed (the key really is the one the consumer uses).
 */
static void seal_as_documented(struct fixture *f, vmmt_pool_config c)
{
    vmmt_pool *other;
    vmmt_desc d, e;
    uint8_t key[16], key2[16];

    if (!on_emu()) skip();
    f->pool = make(c);
    other = make(c);
    d = publish_pattern(f, f->pool, f->src, N, 1);
    e = publish_pattern(f, other, f->src + N, N, 2);
    pool_key(&d, key);
    pool_key(&e, key2);
    assert_true(tu_get64(&d, OFF_SEAL) == seal_of(&d, key));
    assert_true(tu_get64(&e, OFF_SEAL) == seal_of(&e, key2));
    assert_memory_not_equal(key, key2, 16);
    assert_memory_not_equal(key, d.bytes + OFF_POOL_ID, 16);
    /* A key holder's change is consumed: shape [4096] of uint8 instead of untyped bytes. */
    d.bytes[308] = 1;
    d.bytes[309] = 8;
    d.bytes[310] = 1;
    tu_put32(&d, 312, 1);
    tu_put64(&d, 320, N);
    seal_with(&d, key);
    assert_vmmt_ok(consume_all(f, f->consumer, &d));
    assert_vmmt_ok(consume_all(f, f->consumer, &e));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_vmmt_ok(vmmt_pool_drain(other, 5000));
    vmmt_pool_destroy(other);
}

static void test_holds_seal_as_documented_host_table(void **state)
{
    seal_as_documented(*state, fixed(2, 8, 0));
}

static void test_holds_seal_as_documented_device_table(void **state)
{
    seal_as_documented(*state, fixed(2, 8, 1));
}

static void test_holds_seal_as_documented_host_pool(void **state)
{
    vmmt_pool_config c = fixed(1, 8, 0);

    c.memory_location = VMMT_MEMORY_HOST;
    seal_as_documented(*state, c);
}

static void test_holds_seal_as_documented_elastic(void **state)
{
    vmmt_pool_config c = fixed(1, 8, 0);

    c.elastic = 1;
    c.chunk_size = POOLFIX_CHUNK;
    seal_as_documented(*state, c);
}

/* ======================================== a pool record under another pool id */

/*
 * The pool record holds the geometry and the key, not the pool id, and a
 * FABRIC pool has no broker to say which pool it serves. So a process that
 * owns a FABRIC pool Q of its own (another tenant of the NVLink domain), and
 * has seen a descriptor of pool P in transit, takes one of Q's descriptors,
 * writes P's pool id into it and seals it with Q's key, which it holds.
 *
 * vmmt.h: "A descriptor changed in any byte after vmmt_publish returned it,
 * or made by a process that never held the pool, fails its seal:
 * VMMT_EPROTO, nothing imported, copied or written"; descriptor.md: the key
 * "lives in the pool record ..., so only the producer and processes that
 * imported the pool have it". What happens: a consumer that has not
 * imported P on that device imports Q's memory as pool P, finds Q's record
 * and key, and the seal passes: VMMT_OK with Q's bytes for a descriptor that
 * names pool P. The import then is the process's record of P on that
 * device, so P's real descriptors are refused there (VMMT_EPROTO, "same
 * pool") until it is evicted.
 */
struct swap_result {
    int forged, real;
    int got_q_bytes, real_bytes_ok, pools;
    char msg[512];
};

static void pool_id_swap(struct fixture *f, int other_device, struct swap_result *r)
{
    vmmt_pool *q;
    vmmt_consumer *c = fresh_consumer();
    vmmt_desc p1, p2, dq, forged;
    uint64_t dst1 = 0;

    fabric_on();
    f->pool = make(fabric(1, 8));
    q = make(fabric(1, 8));
    p1 = publish_pattern(f, f->pool, f->src, N, 1);
    p2 = publish_pattern(f, f->pool, f->src + N, N, 2);
    dq = publish_pattern(f, q, f->src + 2 * N, N, 3);
    if (other_device) {
        /* P is imported, the real way, on device 0 first. */
        assert_vmmt_ok(consume_all(f, c, &p1));
        sync_stream(f);
        assert_true(holds(f, f->dst, N, 1));
        assert_vmmt_ok(vmmt_mem_alloc(1, N, &dst1));
    }
    forged = dq;
    memcpy(forged.bytes + OFF_POOL_ID, p1.bytes + OFF_POOL_ID, 16);
    reseal(q, &forged); /* Q's producer holds Q's key */
    memset(r, 0, sizeof *r);
    if (other_device)
        r->forged = vmmt_consume(c, &forged, 1, dst1, N, NULL, VMMT_ALL_RANKS, 0);
    else
        r->forged = consume_all(f, c, &forged);
    snprintf(r->msg, sizeof r->msg, "%s", vmmt_last_error());
    sync_stream(f);
    if (r->forged == VMMT_OK && !other_device) r->got_q_bytes = holds(f, f->dst, N, 3);
    if (other_device) {
        r->real = vmmt_consume(c, &p2, 1, dst1, N, NULL, VMMT_ALL_RANKS, 0);
        if (r->real == VMMT_OK) {
            uint8_t h[N];
            assert_vmmt_ok(vmmt_mem_copy(1, (uint64_t)(uintptr_t)h, dst1, N, NULL));
            r->real_bytes_ok = tu_pattern_check(h, N, 2) == N;
        }
    } else {
        r->real = consume_all(f, c, &p1);
        sync_stream(f);
        r->real_bytes_ok = r->real == VMMT_OK && holds(f, f->dst, N, 1);
    }
    sync_stream(f);
    r->pools = vmmt_consumer_pool_count(c);
    vmmt_consumer_destroy(c);
    if (dst1) vmmt_mem_free(1, dst1);
    vmmt_pool_destroy(q);
}

static void test_finding_fabric_pool_id_swap_first_descriptor(void **state)
{
    struct swap_result r;

    if (!on_emu()) skip();
    pool_id_swap(*state, 0, &r);
    if (r.forged == VMMT_OK)
        fail_msg("Q's descriptor under P's pool id, sealed with Q's key: consume OK (dst holds "
                 "Q's bytes: %d); P's real descriptor afterwards: %d (%s)",
                 r.got_q_bytes, r.real, r.real == VMMT_OK ? "" : vmmt_last_error());
    assert_int_equal(r.forged, VMMT_EPROTO);
    assert_int_equal(r.real, VMMT_OK);
    assert_true(r.real_bytes_ok);
}

static void test_finding_fabric_pool_id_swap_other_device(void **state)
{
    struct swap_result r;

    if (!on_emu()) skip();
    pool_id_swap(*state, 1, &r);
    if (r.forged == VMMT_OK)
        fail_msg("P imported on device 0; Q's descriptor under P's pool id on device 1: consume "
                 "OK; P's real descriptor on device 1 afterwards: %d",
                 r.real);
    assert_int_equal(r.forged, VMMT_EPROTO);
    assert_int_equal(r.real, VMMT_OK);
    assert_true(r.real_bytes_ok);
}

/*
 * The same swap on POSIX_FD pools: Q's own broker is asked for P's id and
 * refuses it (docs/broker.md: the reply names the pool it serves). Holds if
 * the forgery is refused, leaves no import, and P's real descriptor goes
 * through.
 */
static void test_holds_posix_pool_id_swap(void **state)
{
    struct fixture *f = *state;
    vmmt_pool *q;
    vmmt_consumer *c = fresh_consumer();
    vmmt_desc p1, dq, forged;
    int st, pools, real;

    f->pool = make(fixed(1, 8, 0));
    q = make(fixed(1, 8, 0));
    p1 = publish_pattern(f, f->pool, f->src, N, 1);
    dq = publish_pattern(f, q, f->src + N, N, 3);
    forged = dq;
    memcpy(forged.bytes + OFF_POOL_ID, p1.bytes + OFF_POOL_ID, 16);
    reseal(q, &forged);
    st = consume_all(f, c, &forged);
    pools = vmmt_consumer_pool_count(c);
    real = consume_all(f, c, &p1);
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 1));
    assert_vmmt_ok(consume_all(f, c, &dq));
    sync_stream(f);
    vmmt_consumer_destroy(c);
    vmmt_pool_destroy(q);
    assert_int_not_equal(st, VMMT_OK);
    assert_int_equal(pools, 0);
    assert_int_equal(real, VMMT_OK);
}

/*
 * The same swap on POSIX_FD pools, through a broker of the attacker's own
 * written from docs/broker.md: it answers any pool id with the fds of his
 * pool Q (fetched from Q's broker) and names the id asked for in its reply.
 * The consumer authenticates the server by the descriptor's producer_uid
 * and producer_pid, fields the forger writes himself; so any local user who
 * runs a pool of his own and sees one descriptor of P can do this.
 *
 * vmmt.h, as above: VMMT_EPROTO, nothing imported. What happens: OK with
 * Q's bytes for a descriptor naming pool P, and P's real descriptors are
 * refused by that consumer afterwards.
 */
struct fake_broker {
    int listener, fds[2], served;
    uint8_t len;
    char name[64];
    pthread_t thread;
};

static void *fake_broker_run(void *arg)
{
    struct fake_broker *b = arg;
    struct pollfd pf = {b->listener, POLLIN, 0};

    while (poll(&pf, 1, 3000) == 1) {
        uint8_t req[64], rep[30] = {'V', 'M', 'B', 'R', 3, 0, 2, 0};
        char cbuf[CMSG_SPACE(2 * sizeof(int))];
        struct iovec iov = {rep, sizeof rep};
        struct msghdr mh = {0};
        struct cmsghdr *cm;
        int s = accept4(b->listener, NULL, NULL, SOCK_CLOEXEC);

        if (s < 0) break;
        if (recv(s, req, sizeof req, 0) == 24) {
            memcpy(rep + 14, req + 8, 16); /* "the pool id the broker serves" */
            mh.msg_iov = &iov;
            mh.msg_iovlen = 1;
            mh.msg_control = cbuf;
            mh.msg_controllen = sizeof cbuf;
            cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
            memcpy(CMSG_DATA(cm), b->fds, 2 * sizeof(int));
            if (sendmsg(s, &mh, MSG_NOSIGNAL) == (ssize_t)sizeof rep) b->served++;
        }
        close(s);
    }
    return NULL;
}

static void fake_broker_start(struct fake_broker *b, const vmmt_desc *q)
{
    struct sockaddr_un sa;
    int n;

    memset(b, 0, sizeof *b);
    assert_int_equal(tu_raw_fetch(q, b->fds, &n), VMMT_OK);
    assert_int_equal(n, 2);
    b->len = (uint8_t)snprintf(b->name, sizeof b->name, "vmmt-attack-%d", (int)getpid());
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path + 1, b->name, b->len);
    b->listener = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(b->listener >= 0);
    assert_int_equal(bind(b->listener, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + b->len)),
                     0);
    assert_int_equal(listen(b->listener, 8), 0);
    pthread_create(&b->thread, NULL, fake_broker_run, b);
}

static void fake_broker_stop(struct fake_broker *b)
{
    shutdown(b->listener, SHUT_RDWR);
    pthread_join(b->thread, NULL);
    close(b->listener);
    close(b->fds[0]);
    close(b->fds[1]);
}

static void test_finding_posix_pool_id_swap_own_broker(void **state)
{
    struct fixture *f = *state;
    vmmt_pool *q;
    vmmt_consumer *c = fresh_consumer();
    struct fake_broker fb;
    vmmt_desc p1, dq, forged;
    int st, real, got_q = 0, pools;

    f->pool = make(fixed(1, 8, 0));
    q = make(fixed(1, 8, 0));
    p1 = publish_pattern(f, f->pool, f->src, N, 1);
    dq = publish_pattern(f, q, f->src + N, N, 3);
    fake_broker_start(&fb, &dq);
    forged = dq;
    memcpy(forged.bytes + OFF_POOL_ID, p1.bytes + OFF_POOL_ID, 16);
    memset(forged.bytes + OFF_BROKER_NAME, 0, 108);
    forged.bytes[OFF_BROKER_KIND] = 0;
    forged.bytes[OFF_BROKER_LEN] = fb.len;
    memcpy(forged.bytes + OFF_BROKER_NAME, fb.name, fb.len);
    reseal(q, &forged); /* Q's producer holds Q's key */
    st = consume_all(f, c, &forged);
    sync_stream(f);
    if (st == VMMT_OK) got_q = holds(f, f->dst, N, 3);
    pools = vmmt_consumer_pool_count(c);
    real = consume_all(f, c, &p1);
    sync_stream(f);
    if (real != VMMT_OK) assert_vmmt_ok(consume_all(f, f->consumer, &p1));
    sync_stream(f);
    vmmt_consumer_destroy(c);
    fake_broker_stop(&fb);
    vmmt_pool_destroy(q);
    if (st == VMMT_OK)
        fail_msg("Q's descriptor under P's pool id, from a broker that serves any id: consume OK "
                 "(Q's bytes: %d, pools held: %d); P's real descriptor then: %d",
                 got_q, pools, real);
    assert_int_equal(st, VMMT_EPROTO);
    assert_int_equal(real, VMMT_OK);
}

/* ======================================= a pool record the descriptor points to */

/*
 * Found (fixed since): a device table's pool record was found where the
 * descriptor said the table ends (table_offset + table_slots * slot_stride),
 * and a first descriptor's table_offset, table_slots and slot_stride were
 * checked by nothing but that record. So an attacker who can get 48 chosen bytes into
 * one buffer the producer publishes (the content of a request it serves),
 * and sees that buffer's descriptor in transit, points a forged descriptor's
 * table into the buffer: a row that shows a generation LIVE, then a record
 * with matching geometry and a key of his choosing, and seals the forgery
 * with that key. He never held the pool.
 *
 * vmmt.h: a descriptor "made by a process that never held the pool, fails
 * its seal: VMMT_EPROTO, nothing imported, copied or written". What
 * happens: a consumer that has not imported the pool yet consumes the
 * forgery with VMMT_OK (any range of the pool's data it names), then
 * writes its acknowledgement into the forged row, i.e. into the live buffer
 * X, whose real consumer gets VMMT_OK with bytes that are not X's; the
 * real descriptors are refused by the poisoned consumer afterwards.
 */
struct fake_result {
    int forged, real_other, real, pools_after_forged;
    long x_differs;
    char msg[512];
};

static void fake_record(struct fixture *f, vmmt_pool_config c, struct fake_result *r)
{
    const uint32_t g = 0x105; /* 4k + 1: a generation any reader accepts */
    const uint8_t key[16] = "attacker's key!";
    vmmt_consumer *victim = fresh_consumer();
    vmmt_buffer b = bytes(f->src, 2 * N);
    uint8_t x[2 * N];
    vmmt_desc dx, forged;
    uint64_t ox;

    /* X: a buffer whose first 48 bytes the attacker chose, the rest of it data. */
    tu_pattern_fill(x, sizeof x, 1);
    memset(x, 0, 48);
    x[0] = (uint8_t)g; /* row 0: ready = g (LIVE), ack[0] = 0 */
    x[1] = (uint8_t)(g >> 8);
    memcpy(x + 16, "POOL", 4);
    x[20] = 1;  /* table_slots */
    x[24] = 16; /* slot_stride */
    x[28] = 1;  /* consumer_count */
    memcpy(x + 32, key, 16);
    f->pool = make(c);
    upload(f, f->src, x, sizeof x);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &dx));
    sync_stream(f);

    ox = tu_get64(&dx, OFF_OFFSET);
    forged = dx;
    tu_put64(&forged, OFF_TABLE_OFFSET, ox);
    tu_put32(&forged, OFF_TABLE_SLOTS, 1);
    tu_put32(&forged, OFF_SLOT_STRIDE, 16);
    tu_put64(&forged, OFF_DATA_OFFSET, ox + 256);
    tu_put32(&forged, OFF_SLOT, 0);
    tu_put32(&forged, OFF_GENERATION, g);
    tu_put64(&forged, OFF_SLICE_OFFSET, ox + N);
    tu_put64(&forged, OFF_SLICE_BYTES, N);
    tu_put64(&forged, OFF_OFFSET, ox + N);
    tu_put64(&forged, OFF_NBYTES, N);
    seal_with(&forged, key);
    /* Since the record opens the table at a fixed place, the decoder refuses any other
     * table_offset: the forgery never reaches an import. */
    assert_int_equal(vmmt_desc_inspect(&forged, &(vmmt_desc_info){0}), VMMT_EPROTO);

    memset(r, 0, sizeof *r);
    r->forged = consume_all(f, victim, &forged);
    snprintf(r->msg, sizeof r->msg, "%s", vmmt_last_error());
    sync_stream(f);
    sleep_ms(20); /* let an acknowledgement thread write what it would */
    r->pools_after_forged = vmmt_consumer_pool_count(victim);
    r->real_other = consume_all(f, victim, &dx);
    sync_stream(f);
    if (r->real_other != VMMT_OK) r->real = consume_all(f, f->consumer, &dx);
    sync_stream(f);
    r->x_differs = differs_at(f, f->dst, x, sizeof x);
    vmmt_consumer_destroy(victim);
    vmmt_pool_drain(f->pool, 5000);
}

static void expect_fake_refused(const struct fake_result *r)
{
    if (r->forged == VMMT_OK)
        fail_msg("a forgery whose table and record lie in a published buffer, sealed with the "
                 "attacker's own key: consume OK; the real descriptor then: %d in the poisoned "
                 "consumer, %d in another, whose bytes differ from X's from offset %ld on",
                 r->real_other, r->real, r->x_differs);
    assert_int_equal(r->forged, VMMT_EPROTO);
    assert_int_equal(r->pools_after_forged, 0);
    assert_int_equal(r->real_other, VMMT_OK);
    assert_int_equal(r->x_differs, -1);
}

static void test_holds_fake_record_in_slice_device_table(void **state)
{
    struct fake_result r;

    fake_record(*state, fixed(1, 8, 1), &r);
    expect_fake_refused(&r);
}

static void test_holds_fake_record_in_slice_fabric(void **state)
{
    struct fake_result r;

    if (!on_emu()) skip();
    fabric_on();
    fake_record(*state, fabric(1, 8), &r);
    expect_fake_refused(&r);
}

/*
 * A shared table's record is found at a place the memfd's exact size pins
 * down, and its bytes are the producer's (rows hold generations, never
 * "POOL"). Holds if the same forgery, its HOST_TABLE flag kept, is
 * refused: table_offset must be 0 there, so the attacker moves the
 * geometry instead (slots and stride that keep the memfd's size).
 */
static void test_holds_fake_geometry_host_table(void **state)
{
    struct fixture *f = *state;
    const uint8_t key[16] = "attacker's key!";
    vmmt_consumer *victim = fresh_consumer();
    vmmt_desc d, forged;
    int st, pools;

    f->pool = make(fixed(1, 64, 0));
    d = publish_pattern(f, f->pool, f->src, N, 1);
    forged = d;
    tu_put32(&forged, OFF_TABLE_SLOTS,
             tu_get32(&d, OFF_TABLE_SLOTS) - 1); /* record 16 bytes earlier */
    seal_with(&forged, key);
    st = consume_all(f, victim, &forged);
    pools = vmmt_consumer_pool_count(victim);
    assert_vmmt_ok(consume_all(f, victim, &d));
    sync_stream(f);
    vmmt_consumer_destroy(victim);
    assert_int_equal(st, VMMT_EPROTO);
    assert_int_equal(pools, 0);
}

/*
 * Device table geometry that puts the record at the allocation's very end,
 * or past it, or a stride near 2^32: refused by the decoder or the record,
 * never read out of bounds, nothing imported, no fd or mapping left.
 */
static void test_holds_device_record_bounds(void **state)
{
    struct fixture *f = *state;
    const uint8_t key[16] = "attacker's key!";
    vmmt_consumer *victim = fresh_consumer();
    vmmt_desc d, forged;
    tu_resources before;
    uint64_t alloc;
    int st[4], pools = 0;

    f->pool = make(fixed(1, 8, 1));
    d = publish_pattern(f, f->pool, f->src, N, 1);
    alloc = tu_get64(&d, OFF_ALLOC_SIZE);
    before = settled();
    for (int i = 0; i < 4; i++) {
        forged = d;
        switch (i) {
        case 0: /* record in the last 32 bytes; a 0-byte buffer at the end */
            tu_put32(&forged, OFF_TABLE_SLOTS, 1);
            tu_put32(&forged, OFF_SLOT_STRIDE, 16);
            tu_put64(&forged, OFF_TABLE_OFFSET, alloc - 48);
            tu_put64(&forged, OFF_DATA_OFFSET, alloc);
            tu_put64(&forged, OFF_SLICE_OFFSET, alloc);
            tu_put64(&forged, OFF_SLICE_BYTES, 0);
            tu_put64(&forged, OFF_OFFSET, alloc);
            tu_put64(&forged, OFF_NBYTES, 0);
            tu_put32(&forged, OFF_SLOT, 0);
            break;
        case 1: /* record past the end */
            tu_put64(&forged, OFF_TABLE_OFFSET, alloc - 16);
            tu_put32(&forged, OFF_TABLE_SLOTS, 1);
            break;
        case 2: /* stride near 2^32 */ tu_put32(&forged, OFF_SLOT_STRIDE, 0xfffffff0u); break;
        default: /* the most slots the decoder allows */
            tu_put32(&forged, OFF_TABLE_SLOTS, 1u << 20);
            break;
        }
        seal_with(&forged, key);
        st[i] = consume_all(f, victim, &forged);
        pools += vmmt_consumer_pool_count(victim);
    }
    if (!eventually(back_to, &(struct want){before})) tu_resources_check(&before);
    assert_vmmt_ok(consume_all(f, victim, &d));
    sync_stream(f);
    vmmt_consumer_destroy(victim);
    for (int i = 0; i < 4; i++)
        assert_int_equal(st[i], VMMT_EPROTO);
    assert_int_equal(pools, 0);
}

/* ================================================ forged first descriptors */

struct links {
    vmmt_pool *pool;
};

static int no_links(void *arg)
{
    return stats(((struct links *)arg)->pool).consumer_links == 0;
}

/*
 * Forged first descriptors, again and again, against one consumer: each is
 * refused with a message that says the record was altered (what was asked,
 * found, and what to do), leaves no import, no fd, no mapping, no thread,
 * and no liveness link open at the producer. Holds if so.
 */
static void forged_firsts_leave_nothing(struct fixture *f, vmmt_pool_config c)
{
    vmmt_consumer *victim = fresh_consumer();
    vmmt_pool *warm = make(fixed(1, 8, 0));
    struct links l;
    tu_resources before, after;
    vmmt_desc d, w, forged;
    vmmt_desc_info in;
    int refused = 0, pools = 0, linked;
    char msg[512] = "";

    f->pool = make(c);
    l.pool = f->pool;
    d = publish_pattern(f, f->pool, f->src, N, 1);
    /* The consumer's own threads and files exist once it imported any pool: let one come and go. */
    w = publish_pattern(f, warm, f->src + N, N, 2);
    assert_vmmt_ok(consume_all(f, victim, &w));
    sync_stream(f);
    assert_vmmt_ok(vmmt_desc_inspect(&w, &in));
    assert_vmmt_ok(vmmt_pool_drain(warm, 5000));
    assert_vmmt_ok(vmmt_consumer_evict(victim, in.pool_id, 0));
    before = settled();
    for (int i = 0; i < 20; i++) {
        forged = d;
        forged.bytes[OFF_SEAL + (size_t)(i % 8)] ^= (uint8_t)(1u << (i % 8));
        if (consume_all(f, victim, &forged) == VMMT_EPROTO) refused++;
        if (i == 0) snprintf(msg, sizeof msg, "%s", vmmt_last_error());
        pools += vmmt_consumer_pool_count(victim);
    }
    linked = eventually(no_links, &l);
    eventually(back_to, &(struct want){before});
    tu_resources_take(&after);
    assert_vmmt_ok(consume_all(f, victim, &d));
    sync_stream(f);
    vmmt_consumer_destroy(victim);
    vmmt_pool_destroy(warm);
    print_message("forged first descriptor: %s\n", msg);
    assert_non_null(strstr(msg, "seal"));
    assert_int_equal(refused, 20);
    assert_int_equal(pools, 0);
    assert_true(linked);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* The sanitizers map quarantine and shadow memory as they go (tests/lib/testutil.c):
     * the mapping count means nothing there; the emulator's counters still judge. */
    after.maps = before.maps;
#endif
    if (after.fds != before.fds || after.maps != before.maps || after.threads != before.threads)
        fail_msg("20 forged first descriptors: fds %d -> %d, mappings %d -> %d, threads %d -> %d",
                 before.fds, after.fds, before.maps, after.maps, before.threads, after.threads);
}

static void test_holds_forged_firsts_leave_nothing_host_table(void **state)
{
    forged_firsts_leave_nothing(*state, fixed(1, 8, 0));
}

static void test_holds_forged_firsts_leave_nothing_device_table(void **state)
{
    forged_firsts_leave_nothing(*state, fixed(1, 8, 1));
}

static void test_holds_forged_firsts_leave_nothing_elastic(void **state)
{
    vmmt_pool_config c = fixed(1, 8, 0);

    c.elastic = 1;
    c.chunk_size = POOLFIX_CHUNK;
    forged_firsts_leave_nothing(*state, c);
}

/*
 * A forged and a real first descriptor of one pool, consumed at once by two
 * threads of a fresh consumer: the forgery's import must never become the
 * process's record of the pool (docs: "the import let go if it fails, so
 * that a forgery leaves nothing behind"), so the real one is always OK.
 */
struct race {
    vmmt_consumer *c;
    const vmmt_desc *d;
    CUdeviceptr dst;
    size_t n;
    pthread_barrier_t *go;
    int st;
    char msg[512];
};

static void *race_consume(void *arg)
{
    struct race *r = arg;

    pthread_barrier_wait(r->go);
    r->st = vmmt_consume(r->c, r->d, 0, r->dst, r->n, NULL, VMMT_ALL_RANKS, 0);
    snprintf(r->msg, sizeof r->msg, "%s", vmmt_last_error());
    return NULL;
}

static void test_holds_forged_and_real_first_race(void **state)
{
    struct fixture *f = *state;
    int bad = 0, forged_ok = 0;
    char msg[512] = "";

    f->pool = make(fixed(1, 8, 0));
    for (int i = 0; i < 40; i++) {
        vmmt_consumer *c = fresh_consumer();
        vmmt_desc d = publish_pattern(f, f->pool, f->src, N, (uint32_t)i), forged = d;
        pthread_barrier_t go;
        pthread_t t[2];
        struct race r[2];

        forged.bytes[OFF_SEAL] ^= 1;
        pthread_barrier_init(&go, NULL, 2);
        r[0] = (struct race){c, &forged, f->dst, N, &go, 0, ""};
        r[1] = (struct race){c, &d, f->dst + N, N, &go, 0, ""};
        for (int k = 0; k < 2; k++)
            pthread_create(&t[k], NULL, race_consume, &r[k]);
        for (int k = 0; k < 2; k++)
            pthread_join(t[k], NULL);
        pthread_barrier_destroy(&go);
        if (r[0].st == VMMT_OK) forged_ok++;
        if (r[1].st != VMMT_OK) {
            bad++;
            snprintf(msg, sizeof msg, "%s", r[1].msg);
            assert_vmmt_ok(consume_all(f, c, &d)); /* let the slice go */
        }
        vmmt_consumer_destroy(c);
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
    if (bad) fail_msg("%d of 40 real first descriptors refused beside a forgery: %s", bad, msg);
    assert_int_equal(forged_ok, 0);
}

/* ================================================================ messages */

/*
 * Messages of vmmt_cancel's refusals. vmmt.h: VMMT_EPROTO for a descriptor
 * "altered after vmmt_publish returned it (its seal fails) or from another
 * pool"; the brief of every failure: a message naming what was asked, what
 * was found and what to do.
 *
 * What happens: a descriptor of another pool of the same producer (a
 * plain mix-up, nothing altered) is answered "the descriptor is not from
 * this pool: descriptor seal ... does not match its pool ...: the record
 * was changed after its producer wrote it, or made by a process that
 * never held the pool; hand out descriptors exactly as vmmt_publish
 * returned them": it names neither pool (the descriptor's id, the one
 * asked), and it tells the caller that the record was altered, which it
 * was not; the cure for a mix-up is to cancel on the pool it came from.
 * And a descriptor of this very pool with one seal bit flipped is told the
 * same "not from this pool". vmmt_commit of another pool's reservation
 * says the same ("the reservation is not from this pool: descriptor seal
 * ... was changed after its producer wrote it"). The two are told apart by
 * pool_id before any key is used.
 */
static void test_finding_cancel_refusal_messages(void **state)
{
    struct fixture *f = *state;
    vmmt_pool *other;
    vmmt_desc d, mine, flipped, junk;
    vmmt_reservation r;
    char id[9], m_other[512], m_flip[512], m_commit[512];
    int st_other, st_flip, st_commit;

    f->pool = make(fixed(1, 8, 0));
    other = make(fixed(1, 8, 0));
    d = publish_pattern(f, other, f->src, N, 1);
    mine = publish_pattern(f, f->pool, f->src + N, N, 2);
    st_other = vmmt_cancel(f->pool, &d);
    snprintf(m_other, sizeof m_other, "%s", vmmt_last_error());
    flipped = mine;
    flipped.bytes[OFF_SEAL] ^= 1;
    st_flip = vmmt_cancel(f->pool, &flipped);
    snprintf(m_flip, sizeof m_flip, "%s", vmmt_last_error());
    assert_vmmt_ok(vmmt_reserve(other, N, &r));
    st_commit = vmmt_commit(f->pool, &r, NULL, f->stream, &junk);
    snprintf(m_commit, sizeof m_commit, "%s", vmmt_last_error());
    assert_vmmt_ok(vmmt_cancel(other, &r.token));
    snprintf(id, sizeof id, "%02x%02x%02x%02x", d.bytes[OFF_POOL_ID], d.bytes[OFF_POOL_ID + 1],
             d.bytes[OFF_POOL_ID + 2], d.bytes[OFF_POOL_ID + 3]);
    assert_vmmt_ok(vmmt_cancel(other, &d));
    assert_vmmt_ok(vmmt_cancel(f->pool, &mine));
    assert_vmmt_ok(vmmt_pool_drain(other, 5000));
    vmmt_pool_destroy(other);
    print_message("another pool's: %s\nown, seal flipped: %s\ncommit of another pool's: %s\n",
                  m_other, m_flip, m_commit);
    assert_int_equal(st_other, VMMT_EPROTO);
    assert_int_equal(st_flip, VMMT_EPROTO);
    assert_int_equal(st_commit, VMMT_EPROTO);
    if (strstr(m_other, id) == NULL || strstr(m_other, "changed after") != NULL)
        fail_msg("another pool's descriptor: the message names neither pool, and says it was "
                 "altered: %s",
                 m_other);
    if (strstr(m_flip, "not from this pool") != NULL)
        fail_msg("this pool's descriptor with its seal flipped: %s", m_flip);
    if (strstr(m_commit, "changed after") != NULL)
        fail_msg("commit of another pool's reservation: %s", m_commit);
}

/* ==================================================================== cancel */

/*
 * A stale descriptor cancelled after its slot was reused. vmmt.h: cancel
 * is idempotent and "does nothing" for a descriptor already cancelled; a
 * descriptor whose occupant has left must not act on its successor. The new
 * cancel writes every rank's acknowledgement word: if it did so for the
 * descriptor's slot without checking the occupant, it would overwrite the
 * successor's acknowledgements (a rank whose word held the successor's
 * generation loses it, and the slice stays in flight for ever) or write
 * them (the successor is refused before its consumers see it).
 *
 * Sequence: one slot, two ranks; publish d1, consume it, drain; publish d2
 * (same slot); consume d2 for rank 0 and wait until its word holds d2;
 * cancel d1 (and d1 again); consume d2 for rank 1: OK with its bytes, and
 * the slice comes back.
 */
static void stale_cancel(struct fixture *f, int device_table, int d2_queued)
{
    vmmt_pool_config c = fixed(2, 1, device_table);
    vmmt_desc d1, d2;
    struct table t;
    struct gate g;
    int st1, st2, st3;
    uint32_t w0, w1;
    vmmt_buffer b = bytes(f->src, N);

    if (!on_emu()) skip();
    c.handoff = VMMT_HANDOFF_STREAM;
    f->pool = make(c);
    d1 = publish_pattern(f, f->pool, f->src, N, 1);
    assert_vmmt_ok(consume_all(f, f->consumer, &d1));
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    put(f, f->src, N, 2);
    if (d2_queued) gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d2));
    assert_int_equal(tu_get32(&d1, OFF_SLOT), tu_get32(&d2, OFF_SLOT));
    table_open(&d2, &t);
    if (!d2_queued) {
        sync_stream(f);
        assert_vmmt_ok(consume_on(f, f->consumer, &d2, 0, 1));
        sync_stream(f);
        for (int i = 0; i < 5000 && word(&t, &d2, 1) != tu_get32(&d2, OFF_GENERATION); i++)
            sleep_ms(1);
        assert_int_equal(word(&t, &d2, 1), tu_get32(&d2, OFF_GENERATION));
    }
    st1 = vmmt_cancel(f->pool, &d1);
    st2 = vmmt_cancel(f->pool, &d1);
    w0 = word(&t, &d2, 1);
    w1 = word(&t, &d2, 2);
    if (d2_queued) {
        gate_open_later(&g, 10);
        gate_free(&g);
        sync_stream(f);
        assert_vmmt_ok(consume_on(f, f->consumer, &d2, 0, 1));
    }
    st3 = consume_on(f, f->consumer, &d2, 1, 1);
    sync_stream(f);
    int bytes_ok = st3 == VMMT_OK && holds(f, f->dst, N, 2);
    int drained = vmmt_pool_drain(f->pool, 3000);
    table_close(&t);
    print_message("stale cancel: %d, again %d; d2's ack words then %#x %#x (d2 is %#x)\n", st1, st2,
                  w0, w1, tu_get32(&d2, OFF_GENERATION));
    if (st3 != VMMT_OK || !bytes_ok || drained != VMMT_OK)
        fail_msg("cancel of a stale descriptor (its slot now holds d2): d2 for rank 1 -> %d "
                 "(bytes right: %d), drain -> %d",
                 st3, bytes_ok, drained);
}

static void test_holds_stale_cancel_host_table(void **state)
{
    stale_cancel(*state, 0, 0);
}

static void test_holds_stale_cancel_device_table(void **state)
{
    stale_cancel(*state, 1, 0);
}

static void test_holds_stale_cancel_successor_queued_host_table(void **state)
{
    stale_cancel(*state, 0, 1);
}

static void test_holds_stale_cancel_successor_queued_device_table(void **state)
{
    stale_cancel(*state, 1, 1);
}

/*
 * Cancel of one packed member while the group's copy is still queued: the
 * whole group is cancelled (vmmt.h: cancelling another member "succeeds and
 * does nothing"), so every member is refused at once by every consumer,
 * consume and acknowledgement alike, and the slice comes back once the copy
 * landed (holds, the "queued" tests).
 *
 * half = 1 (finding): a consumer consumed member 0 before the cancel; its
 * consume of member 1 right after the cancel is refused (VMMT_ESTATE,
 * right: every rank's word holds the generation), but the half group is not
 * forgotten, and after the slice is recycled the pool can never be
 * evicted: vmmt_consumer_evict says "1 packed group(s) are partly consumed
 * ...; consume or acknowledge their other members first", which is refused.
 * design.md Invariant 2: "a group whose occupant left is forgotten, so it
 * never keeps its pool from eviction"; vmmt.h max_pools: the pool is let go
 * once idle. half = 2 (holds): the same refusal made after the recycler
 * retired the slot forgets the group (a device table; a shared table's
 * half group holds the slice until that refusal, docs/descriptor.md,
 * "Acknowledgement words", so there the drain before it times out).
 */
static void packed_cancel_queued(struct fixture *f, int device_table, int half)
{
    vmmt_pool_config c = fixed(2, 4, device_table);
    vmmt_buffer b[2] = {bytes(f->src, N), bytes(f->src + N, N)};
    vmmt_consumer *other = fresh_consumer();
    vmmt_desc pair[2];
    vmmt_desc_info in;
    struct gate g;
    int st[4], ev;

    c.handoff = VMMT_HANDOFF_STREAM;
    f->pool = make(c);
    put(f, f->src, 2 * N, 4);
    if (!half) gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish_packed(f->pool, b, 2, f->stream, pair));
    if (half) {
        sync_stream(f);
        assert_vmmt_ok(consume_all(f, f->consumer, &pair[0]));
        sync_stream(f);
    }
    assert_vmmt_ok(vmmt_cancel(f->pool, &pair[1]));
    assert_vmmt_ok(vmmt_cancel(f->pool, &pair[0]));
    /* RETIRED. A shared table's half group holds the slice until the consumer learns of the
     * cancel (docs/descriptor.md, "Acknowledgement words"), so there the drain waits. */
    if (half > 1 && device_table) assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    if (half > 1 && !device_table) assert_int_equal(vmmt_pool_drain(f->pool, 50), VMMT_ETIMEDOUT);
    st[0] = consume_all(f, f->consumer, &pair[1]);
    st[1] = vmmt_consumer_ack(f->consumer, &pair[half ? 1 : 0], 0, f->stream, VMMT_ALL_RANKS, 0);
    st[2] = consume_on(f, other, &pair[0], 0, 1);
    st[3] = vmmt_consumer_ack(other, &pair[1], 0, f->stream, 1, 1);
    if (!half) {
        gate_open_later(&g, 10);
        gate_free(&g);
    }
    sync_stream(f);
    assert_vmmt_ok(vmmt_desc_inspect(&pair[0], &in));
    /* Once the slice is recycled (RETIRED), nothing of the group can ever be consumed. */
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    ev = vmmt_consumer_evict(f->consumer, in.pool_id, 0);
    vmmt_consumer_destroy(other);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    for (int i = 0; i < 4; i++)
        if (st[i] != VMMT_ESTATE) fail_msg("after the group's cancel, call %d -> %d", i, st[i]);
    assert_vmmt_ok(ev);
}

static void test_holds_packed_cancel_queued_host_table(void **state)
{
    packed_cancel_queued(*state, 0, 0);
}

static void test_holds_packed_cancel_queued_device_table(void **state)
{
    packed_cancel_queued(*state, 1, 0);
}

static void test_finding_packed_cancel_half_consumed_host_table(void **state)
{
    packed_cancel_queued(*state, 0, 1);
}

static void test_finding_packed_cancel_half_consumed_device_table(void **state)
{
    packed_cancel_queued(*state, 1, 1);
}

static void test_holds_packed_cancel_half_retired_host_table(void **state)
{
    packed_cancel_queued(*state, 0, 2);
}

static void test_holds_packed_cancel_half_retired_device_table(void **state)
{
    packed_cancel_queued(*state, 1, 2);
}

/*
 * Cancel of a queued publish, then vmmt_pool_release_rank of a rank: the
 * slice comes back once the copy landed, and a later publish into the same
 * slot still needs that rank ("Slices published later still need the
 * rank") and is consumed by both with its bytes.
 */
static void cancel_then_release(struct fixture *f, int device_table)
{
    vmmt_pool_config c = fixed(2, 1, device_table);
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d, d2;
    struct gate g;

    c.handoff = VMMT_HANDOFF_STREAM;
    f->pool = make(c);
    put(f, f->src, N, 5);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    assert_vmmt_ok(vmmt_pool_release_rank(f->pool, 0));
    assert_int_equal(consume_on(f, f->consumer, &d, 1, 1), VMMT_ESTATE);
    gate_open_later(&g, 10);
    gate_free(&g);
    sync_stream(f);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    d2 = publish_pattern(f, f->pool, f->src + N, N, 6);
    assert_vmmt_ok(consume_on(f, f->consumer, &d2, 1, 1));
    sync_stream(f);
    sleep_ms(20);
    assert_int_equal(stats(f->pool).in_flight, 1); /* rank 0 still owes it */
    assert_vmmt_ok(consume_on(f, f->consumer, &d2, 0, 1));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 6));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
}

static void test_holds_cancel_then_release_host_table(void **state)
{
    cancel_then_release(*state, 0);
}

static void test_holds_cancel_then_release_device_table(void **state)
{
    cancel_then_release(*state, 1);
}

/*
 * Cancel races the LIVE write of the publish it cancels (the copy lands
 * while cancel writes the acknowledgements). The word only moves forwards
 * (Invariant 8): whichever comes first, the slice comes back and the
 * descriptor stays refused. Holds if every one of many tries drains.
 */
static void cancel_races_live(struct fixture *f, int device_table)
{
    vmmt_pool_config c = fixed(1, 2, device_table);
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;

    c.handoff = VMMT_HANDOFF_STREAM;
    f->pool = make(c);
    put(f, f->src, N, 7);
    for (int i = 0; i < 100; i++) {
        assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
        assert_vmmt_ok(vmmt_cancel(f->pool, &d));
        if (consume_all(f, f->consumer, &d) == VMMT_OK)
            fail_msg("try %d: consumed after cancel", i);
        sync_stream(f);
        if (vmmt_pool_drain(f->pool, 5000) != VMMT_OK)
            fail_msg("try %d: the cancelled slice stayed in flight: %s", i, vmmt_last_error());
    }
}

static void test_holds_cancel_races_live_host_table(void **state)
{
    cancel_races_live(*state, 0);
}

static void test_holds_cancel_races_live_device_table(void **state)
{
    cancel_races_live(*state, 1);
}

/*
 * Elastic pool: a cancelled publish whose copy is still queued keeps its
 * chunk until the copy landed ("its slice is free once the publish's copy
 * has landed"; a chunk goes back only when idle), however long the copy
 * waits past idle_release_ms. Holds if the copy lands (the stream has no
 * error), the descriptor stays refused, and the chunk goes back afterwards.
 */
static void test_holds_cancel_queued_elastic_keeps_chunk(void **state)
{
    struct fixture *f = *state;
    vmmt_buffer b = bytes(f->src, N);
    vmmt_desc d;
    struct gate g;
    CUresult r;

    f->pool = make(elastic_config(8 * MiB, 5));
    put(f, f->src, N, 9);
    gate_close(&g, f->stream);
    assert_vmmt_ok(vmmt_publish(f->pool, &b, f->stream, &d));
    assert_vmmt_ok(vmmt_cancel(f->pool, &d));
    sleep_ms(60); /* many idle periods; the recycler runs meanwhile */
    assert_int_equal(stats(f->pool).chunks_released, 0);
    gate_open_later(&g, 1);
    gate_free(&g);
    r = vmmt__drv()->cuStreamSynchronize(f->stream);
    assert_int_equal(r, CUDA_SUCCESS);
    assert_int_equal(consume_all(f, f->consumer, &d), VMMT_ESTATE);
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(stats(f->pool).in_flight, 0);
}

/* ================================================================ reservations */

/*
 * Commit and cancel of tokens that no longer name the slot's reservation.
 * docs: "A reservation is committed or cancelled once; a second try is
 * VMMT_ESTATE"; "once committed it cancels nothing". Sequence: one slot;
 * reserve r1, cancel its token; commit r1 (refused); reserve r2 (the same
 * slot); commit and cancel r1 again (both must leave r2 alone); commit r2
 * and consume it; cancel r2's token (nothing); the descriptor is still
 * consumed by a second rank with its bytes.
 */
static void test_holds_tokens_after_cancel(void **state)
{
    struct fixture *f = *state;
    vmmt_reservation r1, r2, big;
    vmmt_desc d, junk;
    int st[3];

    f->pool = make(fixed(2, 1, 0));
    assert_vmmt_ok(vmmt_reserve(f->pool, N, &r1));
    assert_vmmt_ok(vmmt_cancel(f->pool, &r1.token));
    st[0] = vmmt_commit(f->pool, &r1, NULL, f->stream, &junk);
    assert_vmmt_ok(vmmt_reserve(f->pool, N, &r2));
    assert_int_equal(tu_get32(&r1.token, OFF_SLOT), tu_get32(&r2.token, OFF_SLOT));
    st[1] = vmmt_commit(f->pool, &r1, NULL, f->stream, &junk);
    vmmt_cancel(f->pool, &r1.token);
    put(f, r2.ptr, N, 8);
    /* A reservation whose nbytes the caller changed: the token says N. */
    big = r2;
    big.nbytes = 4 * MiB;
    st[2] = vmmt_commit(f->pool, &big, NULL, f->stream, &d);
    if (st[2] == VMMT_OK)
        assert_int_equal(tu_get64(&d, OFF_NBYTES), N);
    else
        assert_vmmt_ok(vmmt_commit(f->pool, &r2, NULL, f->stream, &d));
    sync_stream(f);
    assert_vmmt_ok(consume_on(f, f->consumer, &d, 0, 1));
    vmmt_cancel(f->pool, &r2.token); /* committed: cancels nothing */
    assert_vmmt_ok(consume_on(f, f->consumer, &d, 1, 1));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 8));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_equal(st[0], VMMT_ESTATE);
    assert_int_equal(st[1], VMMT_ESTATE);
}

/*
 * Commit and cancel of one reservation raced in two threads: exactly one
 * acts. A commit that returned OK handed out a descriptor, which the
 * cancel of its token must not take back ("once committed it cancels
 * nothing"): it is consumed with its bytes.
 */
struct cc_race {
    vmmt_pool *pool;
    vmmt_reservation *r;
    vmmt_desc d;
    pthread_barrier_t *go;
    int commit, st;
    CUstream stream;
};

static void *cc_run(void *arg)
{
    struct cc_race *c = arg;

    pthread_barrier_wait(c->go);
    if (c->commit)
        c->st = vmmt_commit(c->pool, c->r, NULL, NULL, &c->d);
    else
        c->st = vmmt_cancel(c->pool, &c->r->token);
    return NULL;
}

static void test_holds_commit_cancel_race(void **state)
{
    struct fixture *f = *state;
    vmmt_pool_config c = fixed(1, 2, 0);
    int commits = 0, bad = 0;

    c.memory_location = VMMT_MEMORY_HOST;
    f->pool = make(c);
    for (int i = 0; i < 100; i++) {
        vmmt_reservation r;
        pthread_barrier_t go;
        pthread_t t[2];
        struct cc_race cr[2];

        assert_vmmt_ok(vmmt_reserve(f->pool, N, &r));
        tu_pattern_fill((void *)(uintptr_t)r.ptr, N, (uint32_t)i);
        pthread_barrier_init(&go, NULL, 2);
        for (int k = 0; k < 2; k++) {
            cr[k] = (struct cc_race){f->pool, &r, {{0}}, &go, k == 0, 0, NULL};
            pthread_create(&t[k], NULL, cc_run, &cr[k]);
        }
        for (int k = 0; k < 2; k++)
            pthread_join(t[k], NULL);
        pthread_barrier_destroy(&go);
        if (cr[0].st == VMMT_OK) {
            commits++;
            int st = consume_all(f, f->consumer, &cr[0].d);
            sync_stream(f);
            if (st != VMMT_OK || !holds(f, f->dst, N, (uint32_t)i)) bad++;
        }
        assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    }
    print_message("%d of 100 commits won\n", commits);
    assert_int_equal(bad, 0);
}

/* ================================================== replay after a new pool */

/*
 * The producer shuts its pool down and makes another (same process, new
 * key, new id); a consumer still holds the first. Its descriptors, replayed,
 * are never consumed with another pool's bytes: one consumed already is
 * refused, one not yet consumed is either its own bytes or refused; the new
 * pool's descriptors go through; nothing leaks.
 */
static void test_holds_replay_after_new_pool(void **state)
{
    struct fixture *f = *state;
    vmmt_pool *old;
    vmmt_desc a1, a2, b1;
    int st1, st2;

    old = make(fixed(1, 8, 0));
    a1 = publish_pattern(f, old, f->src, N, 1);
    a2 = publish_pattern(f, old, f->src + N, N, 2);
    assert_vmmt_ok(consume_all(f, f->consumer, &a1));
    sync_stream(f);
    vmmt_pool_destroy(old);
    f->pool = make(fixed(1, 8, 0));
    b1 = publish_pattern(f, f->pool, f->src + 2 * N, N, 3);
    st1 = consume_all(f, f->consumer, &a1);
    st2 = consume_all(f, f->consumer, &a2);
    sync_stream(f);
    if (st2 == VMMT_OK) assert_true(holds(f, f->dst, N, 2));
    assert_vmmt_ok(consume_all(f, f->consumer, &b1));
    sync_stream(f);
    assert_true(holds(f, f->dst, N, 3));
    assert_vmmt_ok(vmmt_pool_drain(f->pool, 5000));
    assert_int_not_equal(st1, VMMT_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_holds_seal_as_documented_host_table),
        T(test_holds_seal_as_documented_device_table),
        T(test_holds_seal_as_documented_host_pool),
        T(test_holds_seal_as_documented_elastic),
        T(test_finding_fabric_pool_id_swap_first_descriptor),
        T(test_finding_fabric_pool_id_swap_other_device),
        T(test_holds_posix_pool_id_swap),
        T(test_finding_posix_pool_id_swap_own_broker),
        T(test_holds_fake_record_in_slice_device_table),
        T(test_holds_fake_record_in_slice_fabric),
        T(test_holds_fake_geometry_host_table),
        T(test_holds_device_record_bounds),
        T(test_holds_forged_firsts_leave_nothing_host_table),
        T(test_holds_forged_firsts_leave_nothing_device_table),
        T(test_holds_forged_firsts_leave_nothing_elastic),
        T(test_holds_forged_and_real_first_race),
        T(test_finding_cancel_refusal_messages),
        T(test_holds_stale_cancel_host_table),
        T(test_holds_stale_cancel_device_table),
        T(test_holds_stale_cancel_successor_queued_host_table),
        T(test_holds_stale_cancel_successor_queued_device_table),
        T(test_holds_packed_cancel_queued_host_table),
        T(test_holds_packed_cancel_queued_device_table),
        T(test_finding_packed_cancel_half_consumed_host_table),
        T(test_finding_packed_cancel_half_consumed_device_table),
        T(test_holds_packed_cancel_half_retired_host_table),
        T(test_holds_packed_cancel_half_retired_device_table),
        T(test_holds_cancel_then_release_host_table),
        T(test_holds_cancel_then_release_device_table),
        T(test_holds_cancel_races_live_host_table),
        T(test_holds_cancel_races_live_device_table),
        T(test_holds_cancel_queued_elastic_keeps_chunk),
        T(test_holds_tokens_after_cancel),
        T(test_holds_commit_cancel_race),
        T(test_holds_replay_after_new_pool),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
