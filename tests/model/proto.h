/*
 * The model test's processes and what they say to each other. The driver
 * (tests/model/driver.c) holds the model and decides every step; a producer
 * process and 2-3 consumer processes (tests/model/children.c, the same
 * executable started with --producer or --consumer) run the real library
 * and answer one command at a time on a SOCK_SEQPACKET socket pair (fd 3 in
 * the child): one packet per command, one per reply.
 */
#ifndef VMMT_MODEL_PROTO_H
#define VMMT_MODEL_PROTO_H

#include <stdint.h>
#include <string.h>

#include "vmmt.h"

#define MT_MAX_MEMBERS 4 /* buffers of a packed group */
#define MT_MAX_RANKS   3 /* consumer_count of a pool */
#define MT_MAX_SEATS   3 /* consumer processes */
#define MT_MAX_RES     8 /* open reservations of one producer */
#define MT_MAX_DEFER   8 /* consumes of one consumer waiting for their verify */
#define MT_MSG_LEN     480
#define MT_MAX_UNIT    524288 /* the largest slice a pool of the test uses */
#define MT_CHILD_FD    3

enum mt_op {
    /* producer */
    P_CREATE = 1, /* params: create the pool, answer its statistics */
    P_PUBLISH,    /* members, uid[], nbytes[], typed[], flags MT_F_* */
    P_CANCEL,     /* desc */
    P_RESERVE,    /* nbytes[0]: answers the token and id */
    P_COMMIT,     /* id, uid[0], nbytes[0], typed[0] */
    P_RES_CANCEL, /* id: vmmt_cancel of the reservation's token */
    P_RELEASE_RANK,
    P_RECLAIM,
    P_STATS,
    P_WAIT, /* id: MT_WAIT_*, target, timeout_ms */
    P_SHUTDOWN,
    P_GATE_OPEN, /* let the publishes queued behind the gate run */
    P_END,       /* destroy everything, answer the leak check */
    /* consumer */
    C_CONSUME, /* desc, ranks, uid[0] and nbytes[0] expected, flags MT_F_DEFER / MT_F_NOCHECK */
    C_ACK,     /* desc, ranks, flags MT_F_DEFER (on the deferred stream) */
    C_VERIFY,  /* id: the deferred consume to synchronize and check */
    C_CHECK,   /* desc: vmmt_consumer_check */
    C_EVICT,   /* desc names the pool; flags MT_F_RETRY */
    C_END,
    C_FLUSH,      /* vmmt_consumer_flush */
    C_GATE_CLOSE, /* hold the deferred stream behind a gate of the consumer's own */
    C_GATE_OPEN,  /* let it run */
};

/* Command flags. */
#define MT_F_GATED   1  /* publish behind a closed gate: copy and ready flag stay queued */
#define MT_F_HOSTSRC 2  /* publish from pageable host memory */
#define MT_F_RETRY   4  /* the model says it must work: retry a refusal that timing explains */
#define MT_F_DEFER   8  /* consume on the deferred stream, verify later (C_VERIFY) */
#define MT_F_NOCHECK 16 /* a forged descriptor: no bytes to compare */
#define MT_F_POISON  32 /* check that a refusal wrote nothing into the destination */
#define MT_F_LIST    64 /* the driver's: ask the ranks as a list (mt_cmd.list), even a run */

#define MT_LIST_DOWN  (1u << 30)
#define MT_LIST_TWICE (1u << 29)
#define MT_LIST_RANKS 0xffffu

enum mt_wait { MT_WAIT_IDLE = 1, MT_WAIT_RELEASES, MT_WAIT_CHUNK_RELEASED };

/* A pool to create (P_CREATE). */
struct mt_params {
    uint64_t memory_size, chunk_size, unit;
    int32_t consumer_count, max_slices, device_table, handoff, memory_location, elastic,
        idle_release_ms, fabric;
};

struct mt_cmd {
    uint32_t op, seq;
    int32_t first, count; /* ranks of a consume or ack */
    int32_t flags, members, id, timeout_ms;
    uint64_t target;
    uint64_t uid[MT_MAX_MEMBERS];
    uint64_t nbytes[MT_MAX_MEMBERS];
    uint8_t typed[MT_MAX_MEMBERS];
    /* A consume or ack for a rank list (vmmt_consume_ranks): bit r for rank r, MT_LIST_DOWN for
     * the list in descending order, MT_LIST_TWICE for its first rank listed again (refused);
     * 0: the run first, count. */
    uint32_t list;
    struct mt_params params;
    vmmt_desc desc;
};

/* What a process holds, for the leak check at its end. */
struct mt_res {
    int32_t fds, maps, threads;
    int32_t allocations, reservations, mappings, streams, events, blocks, pools;
};

struct mt_reply {
    uint32_t seq;
    int32_t status;  /* the library's answer */
    int32_t status2; /* C_CONSUME: vmmt_consumer_check after the verify; P_END: the leak verdict */
    int32_t attempts;
    int32_t id;        /* P_RESERVE: the reservation; C_CONSUME with MT_F_DEFER: the deferred one */
    int32_t verified;  /* the bytes were read back */
    int32_t stream_ok; /* the stream synchronized without error */
    int32_t poison_ok; /* a refusal left the destination as it was */
    int32_t kernel;    /* P_PUBLISH: publishes the pool counted as one kernel (kernel_publishes) */
    uint64_t found_uid, first_bad, nbytes, freed;
    struct mt_res before, after;
    vmmt_pool_stats stats;
    char msg[MT_MSG_LEN]; /* vmmt_last_error of the call */
    vmmt_desc desc[MT_MAX_MEMBERS];
};

/*
 * The bytes of publish `uid`: its uid in the first 8 bytes (little-endian),
 * then a stream only that uid gives, so a consumer that got other bytes can
 * say whose they were. Buffers are at least 16 bytes.
 */
static inline uint64_t mt_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static inline void mt_fill(uint8_t *p, uint64_t n, uint64_t uid)
{
    for (uint64_t j = 0; j < n; j += 8) {
        uint64_t w = j == 0 ? uid : mt_mix(uid * 0x100000001b3ull + j);
        for (uint64_t k = 0; k < 8 && j + k < n; k++)
            p[j + k] = (uint8_t)(w >> (8 * k));
    }
}

/* The uid a buffer names (its first 8 bytes). */
static inline uint64_t mt_uid_of(const uint8_t *p, uint64_t n)
{
    uint64_t u = 0;
    for (uint64_t k = 0; k < 8 && k < n; k++)
        u |= (uint64_t)p[k] << (8 * k);
    return u;
}

/* Offset of the first byte that differs from publish uid's, n if none. */
static inline uint64_t mt_first_bad(const uint8_t *p, uint64_t n, uint64_t uid)
{
    for (uint64_t j = 0; j < n; j += 8) {
        uint64_t v = j == 0 ? uid : mt_mix(uid * 0x100000001b3ull + j);
        for (uint64_t k = 0; k < 8 && j + k < n; k++)
            if (p[j + k] != (uint8_t)(v >> (8 * k))) return j + k;
    }
    return n;
}

/* The destination's bytes before a consume, so that a refusal that wrote is seen. */
#define MT_POISON 0xa5

/* Little-endian fields of a descriptor at the offsets of docs/descriptor.md. */
static inline uint64_t mt_get(const vmmt_desc *d, unsigned off, unsigned size)
{
    uint64_t v = 0;
    for (unsigned k = 0; k < size; k++)
        v |= (uint64_t)d->bytes[off + k] << (8 * k);
    return v;
}

static inline void mt_put(vmmt_desc *d, unsigned off, unsigned size, uint64_t v)
{
    for (unsigned k = 0; k < size; k++)
        d->bytes[off + k] = (uint8_t)(v >> (8 * k));
}

#define MT_OFF_POOL_ID      24
#define MT_OFF_SLOT         264
#define MT_OFF_GENERATION   268
#define MT_OFF_SLICE_OFFSET 272
#define MT_OFF_SLICE_BYTES  280
#define MT_OFF_PACK_INDEX   304
#define MT_OFF_PACK_COUNT   306

#endif
