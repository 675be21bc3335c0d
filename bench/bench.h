/*
 * vmmt bench: shared pieces of the benchmark scenarios. Every scenario
 * measures itself and its floor in the same run with the same timer
 * (CLOCK_MONOTONIC around the whole operation, GPU work synchronized before
 * the stop), and reports the ratio against a target; nothing asserts on time.
 */
#ifndef VMMT_BENCH_H
#define VMMT_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "driver.h"
#include "vmm.h"
#include "vmmt.h"

#define BENCH_KIB (1024ull)
#define BENCH_MIB (1024ull * 1024ull)

#define BENCH_SCENARIOS  11
#define BENCH_MAX_SERIES 192
#define BENCH_MAX_ROWS   64
#define BENCH_MAX_INFO   32
#define BENCH_TIMEOUT_MS 30000

struct bench_opts {
    const char *driver; /* NULL: cuda */
    const char *json;   /* NULL: no JSON file */
    int quick;
    int reps;             /* 0: the defaults of the mode */
    unsigned only;        /* bit i: run S(i+1); 0: every scenario */
    const char *only_arg; /* --only as given */
    int device;
    int peer_device; /* -1: each peer on another device than the producer's, where there is one */
};

/* Samples of one quantity from one timer, kept whole for the JSON file. */
struct bench_series {
    char name[72];
    const char *unit;
    double *v;
    size_t n, cap;
};

struct bench_summary {
    double p50, p99, mean, min, max;
    size_t n;
};

enum bench_goal {
    BENCH_GOAL_NONE,      /* reported only */
    BENCH_GOAL_RATIO_MAX, /* ratio <= limit (latency against its floor) */
    BENCH_GOAL_RATIO_MIN, /* ratio >= limit (bandwidth, or how many times faster) */
    BENCH_GOAL_ABS_MAX,   /* p50 <= abs_limit, in the row's unit */
    BENCH_GOAL_BOTH_MAX   /* p50 <= abs_limit and ratio <= limit */
};

/* One line of the final table. NAN marks a value that does not apply. */
struct bench_row {
    char id[4];
    char label[48];
    const char *unit;
    double p50, p99, floor_p50, ratio;
    enum bench_goal goal;
    double limit, abs_limit;
    char target[40];
    int met; /* 1 met, 0 missed, -1 no target */
    int skipped, failed;
    char note[320];
};

struct bench_info {
    char key[64];
    double value;
    const char *unit;
};

struct bench_report {
    struct bench_series series[BENCH_MAX_SERIES];
    size_t nseries;
    struct bench_row rows[BENCH_MAX_ROWS];
    size_t nrows;
    struct bench_info info[BENCH_MAX_INFO];
    size_t ninfo;
    char driver[8];
    int driver_version;
    char device_name[128];
    int device_count;
    char handle_type[16];
    char handoff[24];
    char date[32];
};

/* What every scenario works with: one device, two streams, three buffers. */
struct bench_env {
    struct bench_opts opt;
    struct bench_report *rep;
    const struct vmmt_drv *d;
    const char *driver;
    int device;
    int ndevices;
    CUstream ps, cs;           /* producer's and in-process consumer's streams */
    CUdeviceptr src, dst, tmp; /* cap bytes each; src holds bench_byte() */
    uint64_t cap;
    char exe[4096];
};

/* Known content of the source buffers, checked after the timed loops. */
static inline uint8_t bench_byte(uint64_t j)
{
    return (uint8_t)(j * 131u + 7u);
}

static inline vmmt_buffer bench_buffer(uint64_t ptr, uint64_t nbytes)
{
    vmmt_buffer b = {0};
    b.ptr = ptr;
    b.nbytes = nbytes;
    return b;
}

/* ---- bench_stats.c: timers, samples, rows, output */
double bench_now_us(void);
struct bench_series *bench_series_new(struct bench_report *r, const char *unit, const char *fmt,
                                      ...) __attribute__((format(printf, 3, 4)));
int bench_series_add(struct bench_series *s, double v);
void bench_summarize(const struct bench_series *s, struct bench_summary *out);
struct bench_row *bench_row_add(struct bench_report *r, const char *id, const char *unit,
                                const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void bench_row_values(struct bench_row *row, double p50, double p99, double floor_p50,
                      double ratio);
void bench_row_goal(struct bench_row *row, enum bench_goal goal, double limit, double abs_limit);
void bench_row_note(struct bench_row *row, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void bench_info_add(struct bench_report *r, const char *key, double value, const char *unit);
void bench_print_table(FILE *f, const struct bench_report *r);
int bench_write_json(const char *path, const struct bench_report *r, const struct bench_opts *o);
void bench_report_free(struct bench_report *r);
const char *bench_size_name(uint64_t bytes, char *buf, size_t cap);

/* ---- cmd_bench.c: shared measurement helpers */
int bench_reps(const struct bench_env *e, uint64_t bytes);
/* The stream operations behind S1 and S2, each against the copy floor (bench_parts.c). */
int bench_s1_parts(struct bench_env *e);
int bench_warmup(int reps);
int bench_pool_create(struct bench_env *e, uint64_t memory, int consumers, uint32_t max_slices,
                      vmmt_pool **out);
int bench_copy_sample(struct bench_env *e, CUstream s, uint64_t nbytes, double *us);
int bench_copy_floor(struct bench_env *e, CUstream s, uint64_t nbytes, int reps,
                     struct bench_series *out);
int bench_clear(struct bench_env *e, CUdeviceptr dst, uint64_t nbytes);
int bench_verify(struct bench_env *e, CUdeviceptr dst, uint64_t nbytes);
int bench_fail(struct bench_env *e, const char *id, const char *label, const char *what);
int bench_peer_device(const struct bench_env *e, int k);

/*
 * ---- bench_xdev.c: the copy a consumer on `device` makes out of the pool,
 * done directly in this process: the source is a VMM allocation on the
 * producer's device that `device` may read and write, the destination a
 * cuMemAlloc buffer on `device`, the stream one of its primary context. With
 * device the producer's own, it is the same copy without the peer hop.
 */
struct bench_xpath {
    int device;
    struct vmmt__mapping src;
    CUdeviceptr dst;
    CUstream s;
    uint64_t bytes; /* the largest copy */
};

int bench_xpath_open(struct bench_env *e, int device, uint64_t bytes, struct bench_xpath *x);
void bench_xpath_close(struct bench_xpath *x);
int bench_xpath_enqueue(struct bench_xpath *x, uint64_t nbytes, uint64_t copies);
int bench_xpath_sync(struct bench_xpath *x);
int bench_xpath_sample(struct bench_xpath *x, uint64_t nbytes, double *us);
/* "GPU 0->1" for a copy between devices, "GPU 0" within one. */
const char *bench_path_name(const struct bench_env *e, int device, char *buf, size_t cap);

/* ---- scenario groups; each returns CLI_OK, or CLI_FAIL after recording a failed row */
int bench_s1(struct bench_env *e);
int bench_s2(struct bench_env *e);
int bench_s4(struct bench_env *e);
int bench_s9(struct bench_env *e);
int bench_s3(struct bench_env *e);
int bench_s5(struct bench_env *e);
int bench_s8(struct bench_env *e);
int bench_s6(struct bench_env *e);
int bench_s7(struct bench_env *e);
int bench_overhead(struct bench_env *e);
/* bench_host.c: peers on the producer's GPU, host pools; bench_elastic.c: elastic pools, in place
 */
int bench_s10(struct bench_env *e);
int bench_s11(struct bench_env *e);

/* ---- bench_peer.c: the peer process and the socket protocol */
enum bench_op {
    BOP_PING = 1,
    BOP_CONSUME,
    BOP_IPC,
    BOP_VERIFY,
    BOP_RESET,
    BOP_END,
    BOP_COPY,         /* the peer's half of the two-process floor: a DtoD of nbytes + sync
                         (queued ones batched, one sync, as BOP_CONSUME) */
    BOP_MEMFD_ATTACH, /* map and register the inherited memfd `rank` of nbytes */
    BOP_MEMFD_COPY    /* copy nbytes from it to the device + sync (the host-pool floor) */
};

struct bench_msg_hdr {
    uint32_t op;
    uint32_t rank; /* BOP_CONSUME: the consumer rank to acknowledge */
    uint64_t nbytes;
};

/* The payload is the 512-byte descriptor (or a ping of that size) or a 64-byte IPC handle. */
struct bench_msg {
    struct bench_msg_hdr h;
    uint8_t payload[VMMT_DESC_SIZE];
};

struct bench_reply {
    int32_t status;
    uint32_t count; /* messages this reply answers */
    uint64_t value;
};

#define BENCH_IPC_HANDLE_SIZE 64
#define BENCH_IPC_LAZY_PEER   1u /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */

typedef struct {
    char reserved[BENCH_IPC_HANDLE_SIZE];
} bench_ipc_handle; /* CUipcMemHandle */

/* Legacy CUDA IPC, resolved from libcuda by the bench alone (not in the library's table). */
struct bench_ipc {
    void *lib;
    CUresult (*get)(bench_ipc_handle *, CUdeviceptr);
    CUresult (*open)(CUdeviceptr *, bench_ipc_handle, unsigned int);
    CUresult (*close)(CUdeviceptr);
};
int bench_ipc_load(struct bench_ipc *ipc, char *why, size_t cap);
void bench_ipc_unload(struct bench_ipc *ipc);

struct bench_peer {
    int sock;
    int pid;
};

int bench_peer_spawn(struct bench_env *e, int device, struct bench_peer *p);
int bench_peer_send(struct bench_peer *p, const struct bench_msg *m, size_t payload);
int bench_peer_recv(struct bench_peer *p, struct bench_reply *r, int timeout_ms);
int bench_peer_call(struct bench_peer *p, const struct bench_msg *m, size_t payload,
                    struct bench_reply *r);
void bench_peer_stop(struct bench_peer *p);
int bench_peer_verify(struct bench_peer *p, uint64_t n);
int bench_peer_reset(struct bench_peer *p);
int bench_peer_main(int argc, char **argv);

/* ---- bench_proc.c: what S3, S5 and S8 share */
void bench_consume_msg(struct bench_msg *m, const vmmt_desc *desc, uint32_t rank, uint64_t n);
int bench_rt_vmmt(struct bench_env *e, vmmt_pool *pool, struct bench_peer *peer, uint64_t n,
                  double *us);
/*
 * bench_host.c: one sample of the two-process floor, the floor of every row
 * whose peer is on the producer's GPU: this process copies n bytes and
 * synchronizes, then the peer does the same and answers.
 */
int bench_twoproc_sample(struct bench_env *e, struct bench_peer *peer, uint64_t n, double *us);
/* One sample of n bytes; ctx is the caller's. */
typedef int (*bench_sample_fn)(void *ctx, uint64_t n, double *us);
/*
 * bench_host.c: series a and b measured alternately, sample by sample, after
 * a warm-up of each: how every floor whose peer is on the producer's GPU is
 * measured against its row, so that both pay the same context switches.
 */
int bench_alternate(struct bench_env *e, uint64_t n, bench_sample_fn a, void *actx,
                    struct bench_series *sa, bench_sample_fn b, void *bctx,
                    struct bench_series *sb);

#endif
