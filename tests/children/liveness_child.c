/*
 * Liveness where pidfds are refused (tu_refuse_pidfds: seccomp, inherited by
 * the processes this one starts), as under a container profile that does
 * not know pidfd_open, or on a kernel before 6.5 (no SO_PEERPIDFD).
 *
 *   liveness_child consumer-dies REFUSE
 *       The producer. REFUSE: "open" refuses pidfd_open only, "all"
 *       SO_PEERPIDFD too. Publishes 6 buffers for one rank; consumer_child
 *       consumes buffer 0, keeps 1..5 and forks a worker that keeps what it
 *       inherited, its liveness link among them; then it is killed. The
 *       pool must get the 5 slices back, and say once that it runs without
 *       pidfds with "all" (with "open", SO_PEERPIDFD gives the pidfd).
 *   liveness_child producer-dies DEVICE_TABLE
 *       The consumer, with pidfds refused altogether. producer_child (which
 *       forks a worker that keeps what it inherited) is killed with a copy
 *       queued behind its ready flag: the consumer's stream must be freed,
 *       vmmt_consumer_check must report that descriptor failed, new
 *       consumes must fail, the pool must be let go, and it must say once
 *       that it runs without pidfds.
 *
 * Exit 0 when all held; otherwise it prints what did not and exits with the
 * line number of the check (at most 255).
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "driver.h"
#include "pattern.h"
#include "testutil.h"

static pid_t g_worker; /* a forked worker to kill on the way out */

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "liveness_child:%d: %s failed (%s)\n", __LINE__, #cond,                \
                    vmmt_last_error());                                                            \
            if (g_worker > 0) kill(g_worker, SIGKILL);                                             \
            exit(__LINE__ & 0xff ? __LINE__ & 0xff : 1);                                           \
        }                                                                                          \
    } while (0)

#define SLICES 6
#define BYTES  4096

static atomic_int g_pidfd_warnings;

/* Counts the library's warnings that it runs without pidfds; prints everything, as by default. */
static void on_log(vmmt_log_level level, const char *message, void *user)
{
    (void)user;
    if (level == VMMT_LOG_WARN && strstr(message, "without pidfds") != NULL)
        atomic_fetch_add(&g_pidfd_warnings, 1);
    fprintf(stderr, "liveness_child %d: %s\n", (int)getpid(), message);
}

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static pid_t spawn_paired(const char *name, char **argv, int *sock)
{
    int sv[2];
    pid_t pid;

    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) == 0);
    pid = tu_spawn(name, argv, sv[1]);
    CHECK(pid > 0);
    close(sv[1]);
    *sock = sv[0];
    return pid;
}

static void send_msg(int sock, uint32_t i, const vmmt_desc *d, uint32_t pad)
{
    CHECK(tu_send_msg(sock, i, pad, d != NULL ? d->bytes : NULL) == 0);
}

static struct tu_reply reply(int sock, uint32_t i)
{
    struct tu_reply r;

    CHECK(read(sock, &r, sizeof r) == (ssize_t)sizeof r);
    CHECK(r.index == i);
    return r;
}

static void reap(pid_t pid)
{
    int status;

    CHECK(kill(pid, SIGKILL) == 0);
    CHECK(waitpid(pid, &status, 0) == pid);
}

static vmmt_pool_stats pool_stats(vmmt_pool *p)
{
    vmmt_pool_stats s;

    CHECK(vmmt_pool_get_stats(p, &s) == VMMT_OK);
    return s;
}

static int finish(pid_t worker, CUdeviceptr mem, CUstream s)
{
    CHECK(kill(worker, SIGKILL) == 0); /* not our child: its parent's death handed it on */
    vmmt__drv()->cuMemFree(mem);
    vmmt__drv()->cuStreamDestroy(s);
    vmmt__ctx_leave();
    return 0;
}

static int consumer_dies(int also_peerpidfd)
{
    const struct vmmt_drv *d = vmmt__drv();
    char *argv[] = {"0", "0", "1", NULL};
    vmmt_pool_config cfg;
    vmmt_pool *pool;
    vmmt_desc desc[SLICES];
    CUstream s;
    CUdeviceptr src;
    uint8_t host[BYTES];
    vmmt_buffer b;
    pid_t consumer, worker;
    int sock;

    vmmt_pool_config_init(&cfg);
    cfg.memory_size = 4u << 20;
    cfg.consumer_count = 1;
    CHECK(vmmt_pool_create(&cfg, &pool) == VMMT_OK);
    CHECK(vmmt__ctx_enter(0) == VMMT_OK);
    CHECK(d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    CHECK(d->cuMemAlloc(&src, SLICES * BYTES) == CUDA_SUCCESS);
    memset(&b, 0, sizeof b);
    b.nbytes = BYTES;
    for (uint32_t i = 0; i < SLICES; i++) {
        tu_pattern_fill(host, BYTES, i);
        b.ptr = src + i * BYTES;
        CHECK(d->cuMemcpyHtoDAsync(b.ptr, host, BYTES, s) == CUDA_SUCCESS);
        CHECK(d->cuStreamSynchronize(s) == CUDA_SUCCESS);
        CHECK(vmmt_publish(pool, &b, s, &desc[i]) == VMMT_OK);
    }
    CHECK(d->cuStreamSynchronize(s) == CUDA_SUCCESS);
    consumer = spawn_paired("consumer_child", argv, &sock);
    for (uint32_t i = 0; i < SLICES; i++) {
        send_msg(sock, i, &desc[i], i == 0 ? 0 : TU_MSG_KEEP);
        CHECK(reply(sock, i).status == (i == 0 ? VMMT_OK : 1));
    }
    send_msg(sock, SLICES, NULL, TU_MSG_LINGER);
    worker = g_worker = (pid_t)reply(sock, SLICES).first_bad;
    CHECK(worker > 0);
    /* Buffer 0's acknowledgement may not be swept yet. */
    for (int k = 0; k < 2000 && pool_stats(pool).in_flight != SLICES - 1; k++) {
        CHECK(vmmt_pool_reclaim(pool, NULL) == VMMT_OK);
        sleep_ms(5);
    }
    CHECK(pool_stats(pool).in_flight == SLICES - 1);
    reap(consumer);
    close(sock);
    /* Its worker lives on, with what it inherited: the death must be seen all the same. */
    CHECK(vmmt_pool_drain(pool, 30000) == VMMT_OK);
    CHECK(pool_stats(pool).released_slices == SLICES - 1);
    CHECK(atomic_load(&g_pidfd_warnings) == (also_peerpidfd ? 1 : 0));
    vmmt_pool_destroy(pool);
    return finish(worker, src, s);
}

static int producer_dies(const char *device_table)
{
    const struct vmmt_drv *d = vmmt__drv();
    char linger[] = "linger";
    char *argv[] = {(char *)device_table, linger, NULL};
    vmmt_consumer_config cc;
    vmmt_consumer *c;
    vmmt_desc desc[3];
    struct tu_msg m;
    uint8_t host[BYTES];
    CUstream s;
    CUdeviceptr dst;
    pid_t producer, worker;
    int sock;

    vmmt_consumer_config_init(&cc);
    CHECK(vmmt_consumer_create(&cc, &c) == VMMT_OK);
    CHECK(vmmt__ctx_enter(0) == VMMT_OK);
    CHECK(d->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    CHECK(d->cuMemAlloc(&dst, 2 * BYTES) == CUDA_SUCCESS);
    producer = spawn_paired("producer_child", argv, &sock);
    /* Buffers 1 and 2 landed, buffer 3 queued behind a wait that never opens; its worker. */
    for (uint32_t i = 0; i < 3; i++) {
        CHECK(read(sock, &m, sizeof m) == (ssize_t)sizeof m && m.index == i + 1);
        memcpy(desc[i].bytes, m.desc, sizeof desc[i].bytes);
    }
    CHECK(read(sock, &m, sizeof m) == (ssize_t)sizeof m && m.index == 4 && m.pad > 0);
    worker = g_worker = (pid_t)m.pad;
    CHECK(vmmt_consume(c, &desc[0], 0, dst, 2 * BYTES, s, VMMT_ALL_RANKS, 0) == VMMT_OK);
    CHECK(d->cuMemcpyDtoHAsync(host, dst, BYTES, s) == CUDA_SUCCESS);
    CHECK(d->cuStreamSynchronize(s) == CUDA_SUCCESS);
    CHECK(tu_pattern_check(host, BYTES, 1) == BYTES);
    CHECK(vmmt_consume(c, &desc[2], 0, dst + BYTES, BYTES, s, VMMT_ALL_RANKS, 0) == VMMT_OK);
    reap(producer);
    close(sock);
    /* Its worker lives on with the broker's sockets it inherited: the death is seen anyway. */
    CHECK(d->cuStreamSynchronize(s) == CUDA_SUCCESS);
    CHECK(vmmt_consumer_check(c, &desc[2]) == VMMT_EFAILED);
    CHECK(vmmt_consumer_check(c, &desc[0]) == VMMT_OK);
    CHECK(vmmt_consume(c, &desc[1], 0, dst, 2 * BYTES, s, VMMT_ALL_RANKS, 0) == VMMT_ECLOSED);
    for (int k = 0; k < 3000 && vmmt_consumer_pool_count(c) != 0; k++)
        sleep_ms(10);
    CHECK(vmmt_consumer_pool_count(c) == 0);
    CHECK(vmmt_consumer_check(c, &desc[2]) == VMMT_EFAILED);
    CHECK(atomic_load(&g_pidfd_warnings) == 1);
    vmmt_consumer_destroy(c);
    return finish(worker, dst, s);
}

int main(int argc, char **argv)
{
    int consumer_side;

    if (argc < 3) return 2;
    consumer_side = strcmp(argv[1], "producer-dies") == 0;
    CHECK(consumer_side || strcmp(argv[1], "consumer-dies") == 0);
    /* Before anything can open a pidfd. */
    CHECK(tu_refuse_pidfds(consumer_side || strcmp(argv[2], "all") == 0) == 0);
    vmmt_set_log(on_log, NULL);
    tu_use_test_driver();
    return consumer_side ? producer_dies(argv[2]) : consumer_dies(strcmp(argv[2], "all") == 0);
}
