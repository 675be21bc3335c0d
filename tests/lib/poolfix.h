/*
 * The fixture shared by the transport tests: a stream, source and
 * destination device buffers, a consumer, and the pool under test, with a
 * leak check at teardown.
 */
#ifndef VMMT_POOLFIX_H
#define VMMT_POOLFIX_H

#include <pthread.h>

#include "driver.h"
#include "testutil.h"

#define MiB (1024ull * 1024)

struct fixture {
    tu_resources before;
    vmmt_pool *pool;
    vmmt_consumer *consumer;
    CUstream stream;
    CUdeviceptr src, dst;
    size_t cap;
};

int on_emu(void);
void emu_reset(void);
void emu_fail(const char *spec);
/*
 * emu_fail(spec) for a publish that enqueues a copy and a stream write: the
 * pointer query by which a publish decides for its one kernel fails first
 * (src/producer/publish_kernel.c), so even a buffer the kernel would copy
 * takes the two submissions, whose failures spec then injects.
 */
void emu_fail_without_kernel(const char *spec);
/*
 * A pool config for the transport tests: a device pool, or a host pool when
 * VMMT_TEST_POOL_KIND=host, or an elastic device pool of 1 MiB chunks when it
 * is elastic (CTest runs the suites all three ways).
 */
vmmt_pool_config config(uint64_t size, int consumers);

/* An elastic pool of at most `max` bytes, one consumer, chunks of one emulator
 * granularity unit (POOLFIX_CHUNK), given back after idle_ms. */
#define POOLFIX_CHUNK (2 * MiB)
vmmt_pool_config elastic_config(uint64_t max, uint32_t idle_ms);
int pool_kind_host(void);
int pool_kind_elastic(void);
int pool_setup(void **state);
int pool_teardown(void **state);

/* Write buffer i's pattern at `at`, and check it there. */
void put(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i);
void expect(struct fixture *f, CUdeviceptr at, size_t n, uint32_t i);
vmmt_buffer bytes(CUdeviceptr p, size_t n);
vmmt_pool_stats stats(vmmt_pool *p);

/* Publish n bytes of pattern i, consume them for all ranks, check them. */
void tu_roundtrip(struct fixture *f, size_t n, uint32_t i);

void sleep_ms(long ms);

/*
 * Seal d again with p's key after a test changed it: a forgery by a process
 * that holds the key (one that imported the pool), so that the checks
 * behind the seal are what the test reaches. A forgery without the key is
 * refused by the seal itself (tests/unit/test_seal.c).
 */
void reseal(vmmt_pool *p, vmmt_desc *d);

/*
 * A consumer process (tests/children/consumer_child) for ranks [first,
 * first + count) on `device`, talking over *sock: send_desc hands it a
 * descriptor to consume as buffer i (NULL with i = UINT32_MAX: exit),
 * read_reply gives the status of its consume of buffer i, expect_reply
 * checks it was VMMT_OK with every byte right.
 */
void spawn_consumer(int device, int first, int count, int *sock, pid_t *pid);

/* Run tests/children/liveness_child MODE ARG, which checks everything itself: it must exit 0. */
void run_liveness_child(const char *mode, const char *arg);
void send_desc(int sock, uint32_t i, const vmmt_desc *d);
int read_reply(int sock, uint32_t i);
void expect_reply(int sock, uint32_t i);

/*
 * A gate: a word that holds a stream back (cuStreamWaitValue32) until a
 * thread opens it after a delay, to keep GPU work queued on purpose.
 */
struct gate {
    CUdeviceptr word;
    CUstream stream;  /* opens the gate */
    CUstream blocked; /* waits on it */
    long delay_ms;
    pthread_t thread;
};
void gate_close(struct gate *g, CUstream blocked);
void gate_open_later(struct gate *g, long delay_ms);
/* Joins the opener, lets the blocked stream pass the wait, frees the word. */
void gate_free(struct gate *g);

/* Synchronize a stream, asserting success; a new non-blocking stream (the caller destroys it). */
void sync_on(CUstream s);
CUstream new_stream(void);

#define T(fn) cmocka_unit_test_setup_teardown(fn, pool_setup, pool_teardown)

#endif
