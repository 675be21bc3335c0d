/*
 * vmmt bench: the peer process (vmmt bench-peer, started with its socket as
 * fd 3, like the demo's consumers), the producer's side of the socket, and
 * legacy CUDA IPC loaded from libcuda by the bench itself.
 *
 * The peer answers each message once its work is complete on the GPU (its
 * stream synchronized), so a reply at the producer proves the bytes arrived.
 * Consume (or floor copy) messages that are already queued are taken as one
 * batch, copied back to back and synchronized once: a pipelined producer (S5,
 * and its same-GPU floor) keeps the peer's GPU busy, a ping-pong producer (S3)
 * sees one message per batch.
 */
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "status.h"

#define PEER_FD    3
#define PEER_BATCH 64

/* ------------------------------------------------------------- CUDA IPC */

int bench_ipc_load(struct bench_ipc *ipc, char *why, size_t cap)
{
    const char *path = getenv("VMMT_LIBCUDA");

    memset(ipc, 0, sizeof *ipc);
    if (path == NULL || *path == '\0') path = "libcuda.so.1";
    /* Already loaded by the library: this only takes another reference. */
    ipc->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (ipc->lib == NULL) {
        snprintf(why, cap, "%s could not be loaded: %s", path, dlerror());
        return -1;
    }
    ipc->get = (CUresult(*)(bench_ipc_handle *, CUdeviceptr))dlsym(ipc->lib, "cuIpcGetMemHandle");
    ipc->open = (CUresult(*)(CUdeviceptr *, bench_ipc_handle, unsigned int))dlsym(
        ipc->lib, "cuIpcOpenMemHandle_v2");
    if (ipc->open == NULL)
        ipc->open = (CUresult(*)(CUdeviceptr *, bench_ipc_handle, unsigned int))dlsym(
            ipc->lib, "cuIpcOpenMemHandle");
    ipc->close = (CUresult(*)(CUdeviceptr))dlsym(ipc->lib, "cuIpcCloseMemHandle");
    if (ipc->get == NULL || ipc->open == NULL || ipc->close == NULL) {
        snprintf(why, cap,
                 "%s lacks cuIpcGetMemHandle, cuIpcOpenMemHandle or "
                 "cuIpcCloseMemHandle",
                 path);
        bench_ipc_unload(ipc);
        return -1;
    }
    return 0;
}

void bench_ipc_unload(struct bench_ipc *ipc)
{
    if (ipc->lib != NULL) dlclose(ipc->lib);
    memset(ipc, 0, sizeof *ipc);
}

/* ---------------------------------------------------- producer's side */

int bench_peer_spawn(struct bench_env *e, int device, struct bench_peer *p)
{
    char dev[16], cap[32];
    char *args[] = {"vmmt",  "bench-peer", "--driver", (char *)e->driver, "--device", dev,
                    "--cap", cap,          NULL};
    int sv[2];

    p->sock = -1;
    p->pid = -1;
    snprintf(dev, sizeof dev, "%d", device);
    snprintf(cap, sizeof cap, "%llu", (unsigned long long)e->cap);
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        return vmmt__sys_fail("socketpair for a peer process");
    fflush(NULL); /* nothing buffered may be written twice */
    p->pid = fork();
    if (p->pid == 0) {
        /* Only async-signal-safe calls between fork and exec: the parent has threads. */
        if (dup2(sv[1], PEER_FD) < 0) _exit(126);
        execv(e->exe, args);
        _exit(127);
    }
    close(sv[1]);
    if (p->pid < 0) {
        close(sv[0]);
        return vmmt__sys_fail("fork of a peer process");
    }
    p->sock = sv[0];
    return VMMT_OK;
}

int bench_peer_send(struct bench_peer *p, const struct bench_msg *m, size_t payload)
{
    size_t len = sizeof m->h + payload;

    if (send(p->sock, m, len, MSG_NOSIGNAL) != (ssize_t)len)
        return vmmt__sys_fail("sending to the peer process %d", p->pid);
    return VMMT_OK;
}

int bench_peer_recv(struct bench_peer *p, struct bench_reply *r, int timeout_ms)
{
    struct pollfd pf = {p->sock, POLLIN, 0};
    int n = poll(&pf, 1, timeout_ms);

    if (n == 0)
        return vmmt__fail(VMMT_ETIMEDOUT, "peer process %d did not answer within %d ms", p->pid,
                          timeout_ms);
    if (n < 0) return vmmt__sys_fail("poll on the peer's socket");
    if (recv(p->sock, r, sizeof *r, 0) != (ssize_t)sizeof *r)
        return vmmt__fail(VMMT_EPROTO, "peer process %d went away (see its message above)", p->pid);
    if (r->status != VMMT_OK)
        return vmmt__fail(r->status, "peer process %d failed: %s (its message is above)", p->pid,
                          vmmt_strerror(r->status));
    return VMMT_OK;
}

int bench_peer_call(struct bench_peer *p, const struct bench_msg *m, size_t payload,
                    struct bench_reply *r)
{
    int st = bench_peer_send(p, m, payload);
    return st == VMMT_OK ? bench_peer_recv(p, r, BENCH_TIMEOUT_MS) : st;
}

/* Check, outside the timing, that the peer's destination holds the source's first bytes. */
int bench_peer_verify(struct bench_peer *p, uint64_t n)
{
    struct bench_reply r;
    struct bench_msg m;

    memset(&m, 0, sizeof m);
    m.h.op = BOP_VERIFY;
    m.h.nbytes = n;
    return bench_peer_call(p, &m, 0, &r);
}

/* The peer unmaps every pool it imported: needed before its producer destroys one. */
int bench_peer_reset(struct bench_peer *p)
{
    struct bench_reply r;
    struct bench_msg m;

    memset(&m, 0, sizeof m);
    m.h.op = BOP_RESET;
    return bench_peer_call(p, &m, 0, &r);
}

void bench_peer_stop(struct bench_peer *p)
{
    struct bench_msg m;
    struct timespec pause = {0, 2000000};
    double give_up = bench_now_us() + 10e6;
    int status = 0;
    pid_t r = 0;

    if (p->pid <= 0) return;
    memset(&m, 0, sizeof m);
    m.h.op = BOP_END;
    send(p->sock, &m, sizeof m.h, MSG_NOSIGNAL);
    shutdown(p->sock, SHUT_WR);
    while ((r = waitpid(p->pid, &status, WNOHANG)) == 0 && bench_now_us() < give_up)
        nanosleep(&pause, NULL);
    if (r == 0) {
        fprintf(stderr, "vmmt bench: peer %d did not exit; killing it\n", p->pid);
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &status, 0);
    }
    close(p->sock);
    p->pid = -1;
    p->sock = -1;
}

/* ------------------------------------------------------------ the peer */

struct peer {
    const struct vmmt_drv *d;
    vmmt_consumer *c;
    int device;
    CUstream s;
    CUdeviceptr dst;
    uint64_t cap;
    struct bench_ipc ipc;
    struct bench_msg pending;
    int has_pending;
    void *memfd_map; /* BOP_MEMFD_ATTACH: the producer's shared memfd, registered */
    uint64_t memfd_bytes;
};

static int peer_next(struct peer *p, struct bench_msg *m)
{
    ssize_t n;

    if (p->has_pending) {
        *m = p->pending;
        p->has_pending = 0;
        return 0;
    }
    n = recv(PEER_FD, m, sizeof *m, 0);
    return n >= (ssize_t)sizeof m->h ? 0 : -1;
}

static int peer_reply(int status, uint32_t count, uint64_t value)
{
    struct bench_reply r = {status, count, value};
    return send(PEER_FD, &r, sizeof r, MSG_NOSIGNAL) == (ssize_t)sizeof r ? 0 : -1;
}

static void peer_error(const char *what)
{
    fprintf(stderr, "vmmt bench-peer %d: %s: %s\n", (int)getpid(), what, vmmt_last_error());
}

/* One message's GPU work, enqueued on the peer's stream. */
typedef int (*peer_item_fn)(struct peer *p, const struct bench_msg *m);

static int peer_consume_one(struct peer *p, const struct bench_msg *m)
{
    int st = vmmt_consume(p->c, (const vmmt_desc *)m->payload, p->device, p->dst, p->cap, p->s,
                          (int)m->h.rank, 1);
    if (st != VMMT_OK) peer_error("vmmt_consume");
    return st;
}

/* The peer's half of the two-process floor: a DtoD of the same size within its own memory. */
static int peer_copy_one(struct peer *p, const struct bench_msg *m)
{
    int st = VMMT_EINVAL;

    if (m->h.nbytes <= p->cap / 2)
        st = VMMT_CU(p->d, cuMemcpyDtoDAsync(p->dst + p->cap / 2, p->dst, m->h.nbytes, p->s));
    if (st != VMMT_OK) peer_error("the floor's copy");
    return st;
}

/*
 * Do this message and every message of the same kind already queued behind
 * it, then synchronize once: vmmt's consumes (BOP_CONSUME) and the plain
 * copies of the floors (BOP_COPY) are batched alike.
 */
static int peer_batch(struct peer *p, struct bench_msg *m, peer_item_fn item)
{
    uint32_t op = m->h.op, n = 0;
    int status = VMMT_OK, st;

    for (;;) {
        st = item(p, m);
        if (st != VMMT_OK && status == VMMT_OK) status = st;
        if (++n == PEER_BATCH || recv(PEER_FD, m, sizeof *m, MSG_DONTWAIT) < (ssize_t)sizeof m->h)
            break;
        if (m->h.op != op) {
            p->pending = *m;
            p->has_pending = 1;
            break;
        }
    }
    st = VMMT_CU(p->d, cuStreamSynchronize(p->s));
    if (st != VMMT_OK && status == VMMT_OK) {
        peer_error("synchronizing after a batch");
        status = st;
    }
    return peer_reply(status, n, 0);
}

static int peer_ipc_copy(struct peer *p, const struct bench_msg *m)
{
    bench_ipc_handle h;
    CUdeviceptr ptr = 0;
    char why[256];
    int st = VMMT_OK;

    if (p->ipc.lib == NULL && bench_ipc_load(&p->ipc, why, sizeof why) != 0) {
        fprintf(stderr, "vmmt bench-peer: %s\n", why);
        return peer_reply(VMMT_ENOTSUP, 1, 0);
    }
    memcpy(&h, m->payload, sizeof h);
    st = vmmt__cu_check(p->ipc.open(&ptr, h, BENCH_IPC_LAZY_PEER), "cuIpcOpenMemHandle");
    if (st == VMMT_OK) st = VMMT_CU(p->d, cuMemcpyDtoDAsync(p->dst, ptr, m->h.nbytes, p->s));
    if (st == VMMT_OK) st = VMMT_CU(p->d, cuStreamSynchronize(p->s));
    if (ptr != 0 && st == VMMT_OK) st = vmmt__cu_check(p->ipc.close(ptr), "cuIpcCloseMemHandle");
    if (st != VMMT_OK) peer_error("legacy IPC copy");
    return peer_reply(st, 1, 0);
}

static int peer_verify(struct peer *p, const struct bench_msg *m)
{
    uint64_t n = m->h.nbytes < 4096 ? m->h.nbytes : 4096;
    uint8_t *h = NULL;
    int st;

    st = VMMT_CU(p->d, cuMemAllocHost((void **)&h, n));
    if (st == VMMT_OK) st = VMMT_CU(p->d, cuMemcpyDtoHAsync(h, p->dst, n, p->s));
    if (st == VMMT_OK) st = VMMT_CU(p->d, cuStreamSynchronize(p->s));
    for (uint64_t j = 0; st == VMMT_OK && j < n; j++)
        if (h[j] != bench_byte(j))
            st = vmmt__fail(VMMT_EPROTO, "byte %llu differs", (unsigned long long)j);
    if (h != NULL) p->d->cuMemFreeHost(h);
    if (st != VMMT_OK) peer_error("checking the copied bytes");
    return peer_reply(st, 1, 0);
}

/* A plain shared memfd, registered once, as a consumer without vmmt would use it. */
static int peer_memfd_attach(struct peer *p, const struct bench_msg *m)
{
    void *map = mmap(NULL, m->h.nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, (int)m->h.rank, 0);
    int st;

    if (map == MAP_FAILED || p->memfd_map != NULL) {
        st = vmmt__sys_fail("mapping the floor's memfd");
        if (map != MAP_FAILED) munmap(map, m->h.nbytes);
        peer_error("attaching the memfd");
        return peer_reply(st, 1, 0);
    }
    st = VMMT_CU(p->d, cuMemHostRegister(map, m->h.nbytes, CU_MEMHOSTREGISTER_PORTABLE));
    if (st != VMMT_OK) {
        munmap(map, m->h.nbytes);
        peer_error("registering the memfd");
        return peer_reply(st, 1, 0);
    }
    close((int)m->h.rank);
    p->memfd_map = map;
    p->memfd_bytes = m->h.nbytes;
    return peer_reply(VMMT_OK, 1, 0);
}

static int peer_memfd_copy(struct peer *p, const struct bench_msg *m)
{
    int st = VMMT_EINVAL;

    if (p->memfd_map != NULL && m->h.nbytes <= p->memfd_bytes && m->h.nbytes <= p->cap) {
        st = VMMT_CU(p->d, cuMemcpyHtoDAsync(p->dst, p->memfd_map, m->h.nbytes, p->s));
        if (st == VMMT_OK) st = VMMT_CU(p->d, cuStreamSynchronize(p->s));
    }
    if (st != VMMT_OK) peer_error("the memfd floor's copy");
    return peer_reply(st, 1, 0);
}

/* Forget every imported pool: unmapped before its producer releases it. */
static int peer_reset(struct peer *p)
{
    int st;

    vmmt_consumer_destroy(p->c);
    p->c = NULL;
    st = vmmt_consumer_create(NULL, &p->c);
    return peer_reply(st, 1, 0);
}

static int peer_serve(struct peer *p)
{
    struct bench_msg m;

    while (peer_next(p, &m) == 0) {
        int r;
        switch (m.h.op) {
        case BOP_PING: r = peer_reply(VMMT_OK, 1, 0); break;
        case BOP_CONSUME: r = peer_batch(p, &m, peer_consume_one); break;
        case BOP_IPC: r = peer_ipc_copy(p, &m); break;
        case BOP_VERIFY: r = peer_verify(p, &m); break;
        case BOP_RESET: r = peer_reset(p); break;
        case BOP_COPY: r = peer_batch(p, &m, peer_copy_one); break;
        case BOP_MEMFD_ATTACH: r = peer_memfd_attach(p, &m); break;
        case BOP_MEMFD_COPY: r = peer_memfd_copy(p, &m); break;
        case BOP_END: return CLI_OK;
        default: r = peer_reply(VMMT_EPROTO, 1, 0); break;
        }
        if (r != 0) return CLI_ERROR;
    }
    return CLI_OK;
}

static int peer_args(int argc, char **argv, struct peer *p)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--driver") == 0) {
            if (cli_select_driver(argv[i + 1]) != CLI_OK) return -1;
        } else if (strcmp(argv[i], "--device") == 0) {
            p->device = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--cap") == 0) {
            p->cap = strtoull(argv[i + 1], NULL, 10);
        } else {
            return -1;
        }
    }
    return p->cap > 0 ? 0 : -1;
}

int bench_peer_main(int argc, char **argv)
{
    struct peer p;
    int rc = CLI_ERROR;

    memset(&p, 0, sizeof p);
    if (peer_args(argc, argv, &p) != 0) {
        fprintf(stderr, "usage: vmmt bench-peer --driver cuda|emu --device N --cap BYTES "
                        "(started by vmmt bench with its socket as fd 3)\n");
        return CLI_ERROR;
    }
    vmmt_set_log_level(VMMT_LOG_ERROR);
    p.d = vmmt__drv();
    if (p.d == NULL || vmmt__ctx_enter(p.device) != VMMT_OK) {
        peer_error("start");
        return CLI_ERROR;
    }
    if (vmmt_consumer_create(NULL, &p.c) == VMMT_OK &&
        VMMT_CU(p.d, cuStreamCreate(&p.s, CU_STREAM_NON_BLOCKING)) == VMMT_OK &&
        VMMT_CU(p.d, cuMemAlloc(&p.dst, p.cap)) == VMMT_OK)
        rc = peer_serve(&p);
    else
        peer_error("setting up");
    if (p.s) p.d->cuStreamSynchronize(p.s);
    vmmt_consumer_destroy(p.c);
    if (p.memfd_map != NULL) {
        p.d->cuMemHostUnregister(p.memfd_map);
        munmap(p.memfd_map, p.memfd_bytes);
    }
    if (p.dst) p.d->cuMemFree(p.dst);
    if (p.s) p.d->cuStreamDestroy(p.s);
    bench_ipc_unload(&p.ipc);
    vmmt__ctx_leave();
    return rc;
}
