/*
 * The local adapter: a collective for processes of one node started
 * together (tools, tests, single-node jobs without MPI). Rank 0 listens on
 * an abstract AF_UNIX stream socket named after the job; every other rank
 * connects, says who it is, and for each all-gather sends its block and
 * receives everyone's. Every read and write has the same bound, and a rank
 * that dies closes its socket, so the others' current all-gather fails at
 * once instead of waiting: the property the group's failure tests rely on.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "group_internal.h"
#include "status.h"

#define LOCAL_MAGIC     0x4c474d56u /* "VMGL" */
#define CONNECT_RETRY   10          /* ms between attempts while rank 0 is not up yet */
#define DEF_TIMEOUT_MS  60000
#define MAX_BLOCK_BYTES (256ull << 20)
/* sun_path less its leading NUL, "vmmt-local-", a 10-digit uid and "-". */
#define LOCAL_JOB_MAX (int)(sizeof(((struct sockaddr_un *)0)->sun_path) - 1 - 11 - 10 - 1)

struct local {
    int rank, world, timeout_ms;
    int fd;   /* ranks > 0: the socket to rank 0 */
    int *fds; /* rank 0: one socket per rank (index 0 unused) */
    int broken;
};

struct join {
    uint32_t magic;
    int32_t rank;
    int32_t world;
    int32_t pid;
};

static void say(char *err, size_t cap, const char *fmt, const char *a, int b, int c)
{
    if (err != NULL && cap > 0) snprintf(err, cap, fmt, a, b, c);
}

/* Wait for events on fd until the deadline: 1 ready, 0 timed out, -1 error. */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {fd, events, 0};
        int64_t left = deadline - vmmt__now_ms();
        int n;

        if (left <= 0) return 0;
        n = poll(&p, 1, left > 1000 ? 1000 : (int)left);
        if (n > 0) return 1;
        if (n < 0 && errno != EINTR) return -1;
    }
}

/* 0 when all n bytes moved; else a short reason. */
static const char *xfer(int fd, void *buf, size_t n, int out, int64_t deadline)
{
    char *p = buf;

    while (n > 0) {
        ssize_t k =
            out ? send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL) : recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return "the peer closed the connection (it exited or failed)";
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return strerror(errno);
        int w = wait_fd(fd, out ? POLLOUT : POLLIN, deadline);
        if (w == 0) return "timed out";
        if (w < 0) return strerror(errno);
    }
    return NULL;
}

static void name_of(const char *job, struct sockaddr_un *sun, socklen_t *len)
{
    int n;

    memset(sun, 0, sizeof *sun);
    sun->sun_family = AF_UNIX;
    n = snprintf(sun->sun_path + 1, sizeof sun->sun_path - 1, "vmmt-local-%u-%s",
                 (unsigned)geteuid(), job);
    if (n < 0 || (size_t)n >= sizeof sun->sun_path - 1) n = (int)sizeof sun->sun_path - 2;
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static void local_close(void *ctx)
{
    struct local *L = ctx;

    if (L == NULL) return;
    if (L->fd >= 0) close(L->fd);
    for (int r = 1; L->fds != NULL && r < L->world; r++)
        if (L->fds[r] >= 0) close(L->fds[r]);
    free(L->fds);
    free(L);
}

/* Rank 0 of a failed collective: drop every peer, so they fail now rather than at their bound. */
static void break_root(struct local *L)
{
    L->broken = 1;
    for (int r = 1; r < L->world; r++)
        if (L->fds[r] >= 0) close(L->fds[r]), L->fds[r] = -1;
}

static int root_gather(struct local *L, const void *send, void *recv, size_t bytes, char *err,
                       size_t cap)
{
    int64_t deadline = vmmt__now_ms() + L->timeout_ms;
    const char *why;

    memcpy(recv, send, bytes);
    for (int r = 1; r < L->world; r++) {
        uint64_t n = 0;
        if ((why = xfer(L->fds[r], &n, sizeof n, 0, deadline)) == NULL && n != bytes)
            why = "its block has another size (the ranks are out of step)";
        if (why == NULL)
            why = xfer(L->fds[r], (char *)recv + (size_t)r * bytes, bytes, 0, deadline);
        if (why != NULL) {
            say(err, cap, "local collective: rank 0 receiving from rank %2$d: %1$s", why, r, 0);
            break_root(L);
            return -1;
        }
    }
    for (int r = 1; r < L->world; r++) {
        if ((why = xfer(L->fds[r], recv, bytes * (size_t)L->world, 1, deadline)) != NULL) {
            say(err, cap, "local collective: rank 0 sending to rank %2$d: %1$s", why, r, 0);
            break_root(L);
            return -1;
        }
    }
    return 0;
}

static int local_allgather(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                           size_t cap)
{
    struct local *L = ctx;
    int64_t deadline = vmmt__now_ms() + L->timeout_ms;
    uint64_t n = bytes;
    const char *why;

    if (L->broken) {
        say(err, cap, "local collective: %s (rank %d)", "an earlier collective failed", L->rank, 0);
        return -1;
    }
    if (bytes > MAX_BLOCK_BYTES / (uint64_t)L->world) {
        say(err, cap, "local collective: %s (rank %d, world %d)", "block too large", L->rank,
            L->world);
        return -1;
    }
    if (L->rank == 0) return root_gather(L, send, recv, bytes, err, cap);
    why = xfer(L->fd, &n, sizeof n, 1, deadline);
    if (why == NULL) why = xfer(L->fd, (void *)send, bytes, 1, deadline);
    if (why == NULL) why = xfer(L->fd, recv, bytes * (size_t)L->world, 0, deadline);
    if (why != NULL) {
        say(err, cap, "local collective: rank %2$d with rank 0: %1$s", why, L->rank, 0);
        L->broken = 1;
        return -1;
    }
    return 0;
}

static int local_barrier(void *ctx, char *err, size_t cap)
{
    struct local *L = ctx;
    char one = 1, *all = calloc((size_t)L->world, 1);
    int rc;

    if (all == NULL) {
        say(err, cap, "local collective: %s (rank %d)", "no memory", L->rank, 0);
        return -1;
    }
    rc = local_allgather(ctx, &one, all, 1, err, cap);
    free(all);
    return rc;
}

/* Rank 0: accept every other rank once, each checked by credentials and its join message. */
static int root_accept(struct local *L, int lfd, int64_t deadline)
{
    int joined = 0;

    while (joined < L->world - 1) {
        struct join j;
        struct ucred c;
        socklen_t cl = sizeof c;
        const char *why;
        int fd, w = wait_fd(lfd, POLLIN, deadline);

        if (w <= 0)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "local collective: %d of %d ranks joined rank 0 within %d ms; start "
                              "every rank with the same job name and world size",
                              joined + 1, L->world, L->timeout_ms);
        if ((fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) < 0) continue;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &cl) != 0 || c.uid != geteuid()) {
            vmmt__log(VMMT_LOG_WARN, "local collective: refused a connection of another user");
            close(fd);
            continue;
        }
        if ((why = xfer(fd, &j, sizeof j, 0, deadline)) != NULL || j.magic != LOCAL_MAGIC ||
            j.pid != c.pid) {
            vmmt__log(VMMT_LOG_WARN, "local collective: dropped a malformed join (%s)",
                      why ? why : "bad message");
            close(fd);
            continue;
        }
        if (j.world != L->world || j.rank < 1 || j.rank >= L->world || L->fds[j.rank] >= 0) {
            close(fd);
            return vmmt__fail(VMMT_EINVAL,
                              "local collective: pid %d joins as rank %d of %d; rank 0 has world "
                              "size %d%s",
                              (int)j.pid, (int)j.rank, (int)j.world, L->world,
                              j.rank >= 1 && j.rank < L->world && L->fds[j.rank] >= 0
                                  ? " and that rank already joined (two processes claim it)"
                                  : "");
        }
        L->fds[j.rank] = fd;
        joined++;
    }
    return VMMT_OK;
}

static int root_open(struct local *L, const char *job, int64_t deadline)
{
    struct sockaddr_un sun;
    socklen_t len;
    int lfd, st;

    if ((L->fds = malloc((size_t)L->world * sizeof *L->fds)) == NULL)
        return vmmt__fail(VMMT_ENOMEM, "local collective: no memory");
    for (int r = 0; r < L->world; r++)
        L->fds[r] = -1;
    name_of(job, &sun, &len);
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (lfd < 0) return vmmt__sys_fail("local collective: socket");
    if (bind(lfd, (struct sockaddr *)&sun, len) != 0 || listen(lfd, L->world) != 0) {
        st = vmmt__sys_fail("local collective: rank 0 cannot listen as @%s (is another job "
                            "using the name?)",
                            sun.sun_path + 1);
        close(lfd);
        return st;
    }
    st = root_accept(L, lfd, deadline);
    close(lfd); /* nobody else may join once the world is complete */
    return st;
}

static int peer_open(struct local *L, const char *job, int64_t deadline)
{
    struct sockaddr_un sun;
    struct join j = {LOCAL_MAGIC, L->rank, L->world, (int32_t)getpid()};
    struct ucred c;
    socklen_t len, cl = sizeof c;
    const char *why;

    name_of(job, &sun, &len);
    /* Rank 0 may start later: retry a refused connection until the deadline. */
    for (;;) {
        struct timeval tv = {1, 0};
        L->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (L->fd < 0) return vmmt__sys_fail("local collective: socket");
        /* A full backlog would block connect; this bounds each attempt. */
        setsockopt(L->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(L->fd, (struct sockaddr *)&sun, len) == 0) break;
        close(L->fd);
        L->fd = -1;
        if (vmmt__now_ms() >= deadline)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "local collective: rank %d found no rank 0 at @%s within %d ms",
                              L->rank, sun.sun_path + 1, L->timeout_ms);
        struct timespec ts = {0, CONNECT_RETRY * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (getsockopt(L->fd, SOL_SOCKET, SO_PEERCRED, &c, &cl) != 0 || c.uid != geteuid())
        return vmmt__fail(VMMT_EPERM, "local collective: @%s belongs to another user",
                          sun.sun_path + 1);
    if ((why = xfer(L->fd, &j, sizeof j, 1, deadline)) != NULL)
        return vmmt__fail(VMMT_ESYS, "local collective: rank %d joining: %s", L->rank, why);
    return VMMT_OK;
}

int vmmt_group_local_collective(const char *job, int rank, int world_size, int timeout_ms,
                                vmmt_group_collective *out)
{
    struct local *L;
    int64_t deadline;
    int st;

    if (out != NULL) memset(out, 0, sizeof *out);
    if (out == NULL || job == NULL || job[0] == '\0')
        return vmmt__fail(VMMT_EINVAL, "vmmt_group_local_collective: job and out must be set "
                                       "(job: a name every rank shares)");
    if (world_size < 1 || world_size > VMMT__GROUP_MAX_WORLD || rank < 0 || rank >= world_size)
        return vmmt__fail(VMMT_EINVAL, "vmmt_group_local_collective: rank=%d world_size=%d", rank,
                          world_size);
    /* A name cut to fit would let two jobs sharing a long prefix meet at one socket. */
    if (strlen(job) > LOCAL_JOB_MAX)
        return vmmt__fail(VMMT_EINVAL,
                          "vmmt_group_local_collective: job name of %zu bytes; at most %d fit in "
                          "the socket name (use a shorter one, or a hash of it)",
                          strlen(job), LOCAL_JOB_MAX);
    if ((L = calloc(1, sizeof *L)) == NULL)
        return vmmt__fail(VMMT_ENOMEM, "vmmt_group_local_collective: no memory");
    L->rank = rank;
    L->world = world_size;
    L->fd = -1;
    L->timeout_ms = timeout_ms > 0 ? timeout_ms : DEF_TIMEOUT_MS;
    deadline = vmmt__now_ms() + L->timeout_ms;
    st = world_size == 1 ? VMMT_OK
         : rank == 0     ? root_open(L, job, deadline)
                         : peer_open(L, job, deadline);
    if (st != VMMT_OK) {
        local_close(L);
        return vmmt__wrap(st, "vmmt_group_local_collective(job=\"%s\", rank=%d)", job, rank);
    }
    *out = (vmmt_group_collective){local_allgather, local_barrier, local_close, L};
    return VMMT_OK;
}

int vmmt_group_create_local_size(const vmmt_group_config *theirs, size_t size, const char *job,
                                 vmmt_group **out)
{
    vmmt_group_config c, *config = &c;
    int64_t bound;
    int st;

    if (out != NULL) *out = NULL;
    if (theirs == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_group_create_local: config and out must be set");
    st = vmmt__group_config_in(theirs, size, "vmmt_group_create_local", &c);
    if (st != VMMT_OK) return st;
    /* A collective waits while peers exchange descriptors: give it that bound and more
     * (in 64 bits, capped: a timeout near INT_MAX must not overflow). */
    bound =
        (int64_t)(config->timeout_ms > 0 ? config->timeout_ms : VMMT__GROUP_DEF_TIMEOUT) + 10000;
    st = vmmt_group_local_collective(job, config->rank, config->world_size,
                                     bound > INT_MAX ? INT_MAX : (int)bound, &c.collective);
    if (st != VMMT_OK) return st;
    return vmmt_group_create(&c, out);
}
