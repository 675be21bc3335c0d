/*
 * Liveness sockets stay in the process that opened them. The hang-up of a
 * liveness link tells the process at its other end that this one is gone
 * (docs/broker.md, "Liveness"): a consumer's end closes when the consumer
 * dies, the broker's ends when the producer does. That holds only while no
 * other process holds the socket, and a child forked without exec inherits
 * every fd (close-on-exec acts at exec only): a worker forked by an engine
 * would keep its parent's links, or a producer's broker connections, open
 * after the parent died, and where no pidfd can be had the death would
 * never be seen. So those sockets are made here, under a lock that fork
 * takes (pthread_atfork), and in the child each one is replaced by
 * /dev/null. The number stays taken, so no later open in the child gets a
 * number the library still names; a link used there reads as hung up and
 * its sends fail. (A forked child cannot use its parent's CUDA contexts
 * anyway.)
 *
 * The broker's thread accepts connections and may not allocate (a thread's
 * first malloc maps an arena that outlives it), so a broker reserves room
 * for every connection it may hold when it starts.
 */
#include "fork_guard.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "status.h"

struct guarded {
    int fd;
    int accepted; /* from a reservation */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct guarded *g_fds;
static size_t g_count, g_cap;
static size_t g_plain, g_accepted, g_reserved; /* g_cap >= g_plain + g_reserved */

static void before_fork(void)
{
    pthread_mutex_lock(&g_lock);
}

static void after_fork_parent(void)
{
    pthread_mutex_unlock(&g_lock);
}

/* In the child: only async-signal-safe calls. */
static void after_fork_child(void)
{
    int null = g_count > 0 ? open("/dev/null", O_RDWR | O_CLOEXEC) : -1;

    for (size_t i = 0; i < g_count; i++)
        if (null < 0 || dup3(null, g_fds[i].fd, O_CLOEXEC) < 0) close(g_fds[i].fd);
    if (null >= 0) close(null);
    pthread_mutex_unlock(&g_lock);
}

static void install(void)
{
    /* Fails only for want of memory; then forked children keep the sockets (logged). */
    if (pthread_atfork(before_fork, after_fork_parent, after_fork_child) != 0)
        vmmt__log(VMMT_LOG_WARN, "pthread_atfork failed: a child forked without exec keeps "
                                 "this process's liveness links open");
}

/* Room for `want` entries; lock held. */
static int grow(size_t want)
{
    struct guarded *n;
    size_t cap = g_cap ? g_cap : 16;

    if (want <= g_cap) return 0;
    while (cap < want)
        cap *= 2;
    n = realloc(g_fds, cap * sizeof *n);
    if (n == NULL) return -1;
    g_fds = n;
    g_cap = cap;
    return 0;
}

int vmmt__guarded_socket(int domain, int type, int protocol)
{
    int s, err = ENOMEM;

    pthread_once(&g_once, install);
    pthread_mutex_lock(&g_lock);
    s = grow(g_plain + 1 + g_reserved) == 0 ? socket(domain, type, protocol) : -1;
    if (s >= 0) {
        g_fds[g_count++] = (struct guarded){s, 0};
        g_plain++;
    } else if (g_cap >= g_plain + 1 + g_reserved) {
        err = errno;
    }
    pthread_mutex_unlock(&g_lock);
    if (s < 0) errno = err;
    return s;
}

int vmmt__guarded_accept(int listen_fd, int flags)
{
    int s, err = EMFILE;

    pthread_mutex_lock(&g_lock);
    s = g_accepted < g_reserved ? accept4(listen_fd, NULL, NULL, flags) : -1;
    if (s >= 0) {
        g_fds[g_count++] = (struct guarded){s, 1};
        g_accepted++;
    } else if (g_accepted < g_reserved) {
        err = errno;
    }
    pthread_mutex_unlock(&g_lock);
    if (s < 0) errno = err;
    return s;
}

int vmmt__guard_reserve(int count)
{
    int ok;

    pthread_once(&g_once, install);
    pthread_mutex_lock(&g_lock);
    ok = grow(g_plain + g_reserved + (size_t)count) == 0;
    if (ok) g_reserved += (size_t)count;
    pthread_mutex_unlock(&g_lock);
    if (!ok) return vmmt__fail(VMMT_ENOMEM, "no host memory to guard %d sockets", count);
    return VMMT_OK;
}

void vmmt__guard_unreserve(int count)
{
    pthread_mutex_lock(&g_lock);
    g_reserved -= (size_t)count;
    pthread_mutex_unlock(&g_lock);
}

void vmmt__guarded_close(int fd)
{
    if (fd < 0) return;
    /* Closed under the lock: a fork between forgetting and closing would keep it. */
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_count; i++) {
        if (g_fds[i].fd != fd) continue;
        if (g_fds[i].accepted)
            g_accepted--;
        else
            g_plain--;
        g_fds[i] = g_fds[--g_count];
        break;
    }
    close(fd);
    pthread_mutex_unlock(&g_lock);
}
