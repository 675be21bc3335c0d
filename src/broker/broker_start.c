/*
 * Starting and stopping the fd broker: the listening socket (an abstract
 * name, or a path with its stale-socket and mode rules), the serving thread,
 * stop, and the counters. The serving itself is broker.c.
 */
#include "broker_server.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker_wire.h"
#include "fork_guard.h"
#include "status.h"

static int new_socket(void)
{
    return socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
}

static int bind_abstract(struct vmmt__broker *b, int s)
{
    struct sockaddr_un sun;
    uint8_t rnd[16];

    /* A clash of 128 random bits means the generator is broken; try a few times anyway. */
    for (int attempt = 0; attempt < 3; attempt++) {
        ssize_t got = -1;
        do
            got = getrandom(rnd, sizeof rnd, 0);
        while (got < 0 && errno == EINTR);
        if (got != (ssize_t)sizeof rnd)
            return vmmt__sys_fail("getrandom for the abstract socket name");
        b->addr.kind = VMMT_BROKER_ADDR_ABSTRACT;
        b->addr.len = 5 + 32;
        memcpy(b->addr.name, "vmmt-", 5);
        for (int i = 0; i < 16; i++)
            snprintf(b->addr.name + 5 + 2 * i, 3, "%02x", rnd[i]);
        if (bind(s, (struct sockaddr *)&sun, vmmt__broker_sockaddr(&b->addr, &sun)) == 0)
            return VMMT_OK;
        if (errno != EADDRINUSE) break;
    }
    return vmmt__sys_fail("bind to abstract socket @%.*s", (int)b->addr.len, b->addr.name);
}

/* Something is bound at the path: a live broker, a stale socket, or a file we must not touch. */
static int path_in_use(const char *path)
{
    struct sockaddr_un sun;
    struct vmmt__broker_addr a = {.kind = VMMT_BROKER_ADDR_PATH};
    struct stat st;
    int probe, r, err;

    if (lstat(path, &st) != 0) return vmmt__sys_fail("lstat(%s)", path);
    if (!S_ISSOCK(st.st_mode))
        return vmmt__fail(VMMT_EINVAL,
                          "cannot listen at %s: the path exists and is not a socket; "
                          "vmmt never removes such a file: choose another path or remove it",
                          path);
    a.len = (uint8_t)strlen(path);
    memcpy(a.name, path, a.len);
    probe = new_socket();
    if (probe < 0) return vmmt__sys_fail("socket to probe %s", path);
    r = connect(probe, (struct sockaddr *)&sun, vmmt__broker_sockaddr(&a, &sun));
    err = errno;
    close(probe);
    /* Only a refused connection proves nobody listens; a full backlog or another type is alive. */
    if (r != 0 && err == ECONNREFUSED) return VMMT_OK;
    return vmmt__fail(VMMT_EINVAL,
                      "cannot listen at %s: a live socket is already there (%s); stop "
                      "the process serving it or choose another path",
                      path, r == 0 ? "it accepted a connection" : strerror(err));
}

static bool others_allowed(const struct vmmt__broker *b)
{
    for (size_t i = 0; i < b->allowed_count; i++)
        if (b->allowed[i] != b->euid) return true;
    return false;
}

static int bind_path(struct vmmt__broker *b, int s, const char *path)
{
    struct sockaddr_un sun;
    struct stat st;
    size_t n = strlen(path);
    socklen_t sl;
    int rc = VMMT_OK;

    if (n == 0 || n > sizeof b->addr.name - 1)
        return vmmt__fail(VMMT_EINVAL,
                          "socket path \"%s\" has %zu bytes; AF_UNIX allows 1 to %zu: "
                          "choose a shorter path",
                          path, n, sizeof b->addr.name - 1);
    b->addr.kind = VMMT_BROKER_ADDR_PATH;
    b->addr.len = (uint8_t)n;
    memcpy(b->addr.name, path, n);
    sl = vmmt__broker_sockaddr(&b->addr, &sun);
    if (bind(s, (struct sockaddr *)&sun, sl) != 0) {
        if (errno != EADDRINUSE) return vmmt__sys_fail("bind to %s", path);
        rc = path_in_use(path);
        if (rc != VMMT_OK) return rc;
        if (unlink(path) != 0 && errno != ENOENT)
            return vmmt__sys_fail("remove stale socket %s", path);
        vmmt__log(VMMT_LOG_INFO, "replaced the stale socket file %s", path);
        if (bind(s, (struct sockaddr *)&sun, sl) != 0)
            return vmmt__sys_fail("bind to %s after removing a stale socket", path);
    }
    if (lstat(path, &st) != 0) {
        rc = vmmt__sys_fail("lstat(%s) right after bind", path);
        unlink(path); /* nobody else can have replaced it yet: we just created it */
        return rc;
    }
    b->path_dev = st.st_dev;
    b->path_ino = st.st_ino;
    b->path_bound = true;
    /* Nobody can connect before listen(), so fixing the mode now leaves no window. */
    if (chmod(path, others_allowed(b) ? 0666 : 0600) != 0) return vmmt__sys_fail("chmod %s", path);
    return VMMT_OK;
}

/* Unlink the socket file only if it is still the one we created. */
static void unlink_path(struct vmmt__broker *b)
{
    char path[sizeof b->addr.name];
    struct stat st;

    if (!b->path_bound) return;
    memcpy(path, b->addr.name, b->addr.len);
    path[b->addr.len] = '\0';
    if (lstat(path, &st) == 0 && st.st_dev == b->path_dev && st.st_ino == b->path_ino) unlink(path);
    b->path_bound = false;
}

static int open_listener(struct vmmt__broker *b, const char *path)
{
    /* Guarded: a child the producer forks must not keep listening in its place. */
    int s = vmmt__guarded_socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), st;

    if (s < 0) return vmmt__sys_fail("socket(AF_UNIX, SOCK_SEQPACKET)");
    st = path ? bind_path(b, s, path) : bind_abstract(b, s);
    if (st != VMMT_OK) goto fail;
    if (listen(s, VMMT_BROKER_MAX_PENDING) != 0) {
        st = vmmt__sys_fail("listen");
        goto fail;
    }
    b->listen_fd = s;
    return VMMT_OK;
fail:
    unlink_path(b);
    vmmt__guarded_close(s);
    return st;
}

static int check_config(const int *fds, int nfds, const uint8_t *pool_id,
                        const struct vmmt__broker_config *cfg, struct vmmt__broker **out)
{
    if (out == NULL || pool_id == NULL || fds == NULL)
        return vmmt__fail(VMMT_EINVAL, "fds, pool_id and out must not be NULL");
    if (nfds < 1 || nfds > VMMT_BROKER_MAX_FDS)
        return vmmt__fail(VMMT_EINVAL, "nfds is %d; a broker serves 1 to %d fds", nfds,
                          VMMT_BROKER_MAX_FDS);
    for (int i = 0; i < nfds; i++)
        if (fds[i] < 0)
            return vmmt__fail(VMMT_EINVAL, "fds[%d] is %d, not a file descriptor", i, fds[i]);
    if (cfg == NULL) return VMMT_OK;
    if (cfg->allowed_count > 0 && cfg->allowed_uids == NULL)
        return vmmt__fail(VMMT_EINVAL, "allowed_count is %zu but allowed_uids is NULL",
                          cfg->allowed_count);
    if (cfg->allowed_count > 65536)
        return vmmt__fail(VMMT_EINVAL, "allowed_count %zu is more than 65536", cfg->allowed_count);
    if (cfg->timeout_ms < 0)
        return vmmt__fail(VMMT_EINVAL, "timeout_ms is %d; use a positive number, or 0 for %d",
                          cfg->timeout_ms, VMMT_BROKER_DEFAULT_TIMEOUT_MS);
    if (cfg->ranks < 0 || cfg->ranks > VMMT_BROKER_MAX_RANKS)
        return vmmt__fail(VMMT_EINVAL, "ranks is %d; a broker tracks 0 to %d", cfg->ranks,
                          VMMT_BROKER_MAX_RANKS);
    return VMMT_OK;
}

static int copy_config(struct vmmt__broker *b, const struct vmmt__broker_config *cfg)
{
    b->timeout_ms = VMMT_BROKER_DEFAULT_TIMEOUT_MS;
    if (cfg == NULL) return VMMT_OK;
    if (cfg->timeout_ms > 0) b->timeout_ms = cfg->timeout_ms;
    b->ranks = cfg->ranks;
    b->on_dead = cfg->on_dead;
    b->on_dead_shared = cfg->on_dead_shared;
    b->user = cfg->user;
    b->resolve = cfg->resolve;
    b->resolve_user = cfg->resolve_user;
    if (cfg->allowed_count == 0) return VMMT_OK;
    /* The caller's array need not outlive start. */
    b->allowed = calloc(cfg->allowed_count, sizeof *b->allowed);
    if (b->allowed == NULL)
        return vmmt__fail(VMMT_ENOMEM, "no memory for %zu allowed uids", cfg->allowed_count);
    memcpy(b->allowed, cfg->allowed_uids, cfg->allowed_count * sizeof *b->allowed);
    b->allowed_count = cfg->allowed_count;
    return VMMT_OK;
}

/* The thread takes no signals: they belong to the application's own threads. */
static int start_thread(struct vmmt__broker *b)
{
    sigset_t all, old;
    int err;

    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    err = pthread_create(&b->thread, NULL, vmmt__broker_main, b);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        return vmmt__sys_fail("pthread_create");
    }
    pthread_setname_np(b->thread, "vmmt-broker");
    return VMMT_OK;
}

/* The lock and condition of vmmt__broker_sync; the condition times on CLOCK_MONOTONIC. */
static int init_sync(struct vmmt__broker *b)
{
    pthread_condattr_t ca;
    int err = pthread_condattr_init(&ca);

    if (err == 0) err = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (err == 0) err = pthread_cond_init(&b->sync_cond, &ca);
    pthread_condattr_destroy(&ca);
    if (err == 0) {
        err = pthread_mutex_init(&b->sync_lock, NULL);
        if (err != 0) pthread_cond_destroy(&b->sync_cond);
    }
    if (err == 0) return VMMT_OK;
    errno = err;
    return vmmt__sys_fail("the broker's sync condition");
}

/* The broker's own copies: the caller may close its fds as soon as start returns. */
static int dup_served(struct vmmt__broker *b, const int *fds, int nfds)
{
    for (int i = 0; i < nfds; i++) {
        b->served_fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
        if (b->served_fds[i] < 0) return vmmt__sys_fail("dup of the pool's fds[%d] %d", i, fds[i]);
        b->nserved = i + 1;
    }
    return VMMT_OK;
}

static void close_served(struct vmmt__broker *b)
{
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        vmmt__close_fd(&b->served_fds[i]);
    b->nserved = 0;
}

int vmmt__broker_start_fds(const int *fds, int nfds, const uint8_t pool_id[16],
                           const struct vmmt__broker_config *cfg, struct vmmt__broker **out)
{
    struct vmmt__broker *b;
    char id[9] = "?";
    int st;

    if (out != NULL) *out = NULL;
    st = check_config(fds, nfds, pool_id, cfg, out);
    if (st != VMMT_OK) goto fail_args;
    b = calloc(1, sizeof *b);
    if (b == NULL) return vmmt__fail(VMMT_ENOMEM, "no memory for the broker");
    b->listen_fd = b->wake_fd = -1;
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        b->served_fds[i] = -1;
    memcpy(b->pool_id, pool_id, 16);
    b->euid = geteuid();
    st = copy_config(b, cfg);
    if (st != VMMT_OK) goto fail_free;
    st = init_sync(b);
    if (st != VMMT_OK) goto fail_free;
    st = dup_served(b, fds, nfds);
    if (st != VMMT_OK) goto fail_served;
    b->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (b->wake_fd < 0) {
        st = vmmt__sys_fail("eventfd");
        goto fail_served;
    }
    /* Every connection the thread may hold at once, and the one it accepts before it
     * checks the bounds. */
    st = vmmt__guard_reserve(MAX_CONNS + 1);
    if (st != VMMT_OK) goto fail_wake;
    st = open_listener(b, cfg ? cfg->path : NULL);
    if (st != VMMT_OK) goto fail_reserve;
    st = start_thread(b);
    if (st != VMMT_OK) goto fail_listener;
    *out = b;
    return VMMT_OK;

fail_listener:
    vmmt__guarded_close(b->listen_fd);
    b->listen_fd = -1;
    unlink_path(b);
fail_reserve:
    vmmt__guard_unreserve(MAX_CONNS + 1);
fail_wake:
    vmmt__close_fd(&b->wake_fd);
fail_served:
    close_served(b);
    pthread_cond_destroy(&b->sync_cond);
    pthread_mutex_destroy(&b->sync_lock);
fail_free:
    free(b->allowed);
    free(b);
fail_args:
    if (pool_id != NULL) vmmt__short_id(pool_id, id);
    return vmmt__wrap(st, "cannot start the CUDA VMM POSIX FD broker of pool %s", id);
}

int vmmt__broker_start(int fd, const uint8_t pool_id[16], const struct vmmt__broker_config *cfg,
                       struct vmmt__broker **out)
{
    return vmmt__broker_start_fds(&fd, 1, pool_id, cfg, out);
}

const struct vmmt__broker_addr *vmmt__broker_address(const struct vmmt__broker *b)
{
    return b ? &b->addr : NULL;
}

void vmmt__broker_stop(struct vmmt__broker *b)
{
    struct timespec until;
    uint64_t one = 1;
    int err;

    if (b == NULL) return;
    atomic_store(&b->stopping, true);
    /* The eventfd is non-blocking and far from overflow: the write cannot fail here. */
    if (write(b->wake_fd, &one, sizeof one) != (ssize_t)sizeof one)
        vmmt__log(VMMT_LOG_ERROR, "fd broker: cannot wake the thread: %s", strerror(errno));
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += STOP_JOIN_MS / 1000;
    err = pthread_timedjoin_np(b->thread, NULL, &until);
    if (err != 0) {
        /* The thread never blocks outside poll, so this is a bug; leaking beats a use after free.
         */
        vmmt__log(VMMT_LOG_ERROR,
                  "fd broker: thread did not stop within %d ms (%s); leaving it and its memory",
                  STOP_JOIN_MS, strerror(err));
        return;
    }
    vmmt__guarded_close(b->listen_fd);
    b->listen_fd = -1;
    unlink_path(b);
    vmmt__guard_unreserve(MAX_CONNS + 1);
    vmmt__close_fd(&b->wake_fd);
    close_served(b);
    pthread_cond_destroy(&b->sync_cond);
    pthread_mutex_destroy(&b->sync_lock);
    free(b->allowed);
    free(b);
}

int vmmt__broker_sync(struct vmmt__broker *b, int timeout_ms)
{
    struct timespec until;
    uint64_t one = 1, ticket;
    bool done;
    int err = 0;

    if (b == NULL) return VMMT_OK;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&b->sync_lock);
    ticket = ++b->sync_asked;
    pthread_mutex_unlock(&b->sync_lock);
    if (write(b->wake_fd, &one, sizeof one) != (ssize_t)sizeof one)
        return vmmt__sys_fail("waking the fd broker's thread to read its links");
    pthread_mutex_lock(&b->sync_lock);
    while (b->sync_done < ticket && err == 0)
        err = pthread_cond_timedwait(&b->sync_cond, &b->sync_lock, &until);
    done = b->sync_done >= ticket;
    pthread_mutex_unlock(&b->sync_lock);
    if (done) return VMMT_OK;
    return vmmt__fail(VMMT_ETIMEDOUT,
                      "the fd broker's thread did not read its liveness links within %d ms (it "
                      "is busy or stuck)",
                      timeout_ms);
}

void vmmt__broker_live_ranks(const struct vmmt__broker *b, uint64_t out[VMMT_BROKER_RANK_WORDS])
{
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        out[w] = b ? atomic_load_explicit(&b->live[w], memory_order_relaxed) : 0;
}

void vmmt__broker_stats(const struct vmmt__broker *b, struct vmmt__broker_stats *out)
{
    if (out == NULL) return;
    memset(out, 0, sizeof *out);
    if (b == NULL) return;
    out->served = atomic_load_explicit(&b->served, memory_order_acquire);
    out->refused_peer = atomic_load_explicit(&b->refused_peer, memory_order_acquire);
    out->refused_pool = atomic_load_explicit(&b->refused_pool, memory_order_acquire);
    out->timed_out = atomic_load_explicit(&b->timed_out, memory_order_acquire);
    out->malformed = atomic_load_explicit(&b->malformed, memory_order_acquire);
    out->evicted = atomic_load_explicit(&b->evicted, memory_order_acquire);
    out->held = atomic_load_explicit(&b->held, memory_order_acquire);
    out->deaths = atomic_load_explicit(&b->deaths, memory_order_acquire);
    out->goodbyes = atomic_load_explicit(&b->goodbyes, memory_order_acquire);
}
