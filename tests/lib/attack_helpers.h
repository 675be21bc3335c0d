/*
 * Helpers shared by the outside attackers' tests (tests/unit/test_attack_outside2.c
 * and test_attack_outside3.c), written from include/vmmt.h and the docs alone:
 * streams, publishing and consuming N-byte patterns, checking the bytes that
 * landed, the shared control table as any importing process sees it, and
 * consumer processes (tests/children/consumer_child) on socket pairs.
 */
#ifndef VMMT_ATTACK_HELPERS_H
#define VMMT_ATTACK_HELPERS_H

#include <stdint.h>
#include <sys/types.h>

#include "driver.h"
#include "poolfix.h"

/* The bytes of one buffer. */
#define N 4096

/* Field offsets of docs/descriptor.md, "Layout". */
#define OFF_ALLOC_SIZE   232
#define OFF_SLOT_STRIDE  248
#define OFF_SLOT         264
#define OFF_GENERATION   268
#define OFF_SLICE_OFFSET 272
#define OFF_OFFSET       288

/* A broken promise: fail with FINDING: and what happened. */
#define PROMISE(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            print_error("FINDING: " __VA_ARGS__);                                                  \
            print_error("\n");                                                                     \
            fail();                                                                                \
        }                                                                                          \
    } while (0)

const struct vmmt_drv *drv(void);
void sync_s(CUstream s); /* sync_on (poolfix.h), by the name these tests use */
void free_stream(CUstream s);

/* Pattern i into `at` through stream s (synchronized). */
void put_on(CUstream s, CUdeviceptr at, size_t n, uint32_t i);

/*
 * Publish N bytes of pattern i from `src` on stream s (not synchronized).
 * Acknowledgements are written by a consumer thread and swept by the
 * recycler a moment after a consume returns, so a loop that publishes fast
 * may find no room for a while: that is retried, at most 5 s.
 */
vmmt_desc publish_from(vmmt_pool *p, CUstream s, CUdeviceptr src, uint32_t i);
/* The same from the fixture's src on its stream. */
vmmt_desc publish(struct fixture *f, uint32_t i);

int consume_at(vmmt_consumer *c, const vmmt_desc *d, CUdeviceptr dst, CUstream s, int first,
               int count);

/* Does `at` hold N bytes of pattern i? (read through stream s) */
int holds(CUstream s, CUdeviceptr at, uint32_t i);
/* Which pattern in 0..63 `at` holds, or -1. */
int which(CUstream s, CUdeviceptr at);

uint32_t gen(const vmmt_desc *d);

/* The pool's in-flight count after a moment and a reclaim. */
uint32_t in_flight_settled(struct fixture *f);

/*
 * The shared control table as any process that fetched it from the broker
 * sees it (docs/descriptor.md, "The control table"): the memfd, its rows at
 * offset 64, slot_stride bytes each; word 0 ready, word 1 + r rank r's ack.
 */
struct rawtab {
    uint8_t *m;
    size_t len;
    uint32_t stride;
};

void rawtab_open(const vmmt_desc *d, struct rawtab *t);
uint32_t rawtab_word(const struct rawtab *t, const vmmt_desc *d, int idx);
void rawtab_close(struct rawtab *t);
/* Wait at most ms for word idx of d's slot to read `want`. */
int wait_word(const struct rawtab *t, const vmmt_desc *d, int idx, uint32_t want, int ms);

/* A consumer process (consumer_child) for ranks [first, first + count) on a stream socket pair. */
pid_t spawn_rank(int first, int count, int *sock);
void send_msg(int sock, uint32_t i, const vmmt_desc *d, uint32_t pad);
/* The status of the child's reply for buffer i (waits at most 20 s). */
int32_t reply(int sock, uint32_t i);
void kill_reap(pid_t pid);
/* Tell the child to exit, wait for it, close its socket. */
void end_child(int sock, pid_t pid);

/* Poll the pool's stats until it counts `links` consumer links, at most ms. */
int wait_links(struct fixture *f, uint32_t links, int ms);

#endif
