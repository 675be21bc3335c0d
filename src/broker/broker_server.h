/*
 * The fd broker's server, shared by its two halves: broker.c serves (the
 * thread: accept, requests, links, deaths), broker_start.c sets up and tears
 * down (listener, thread, stop, counters). Private to them.
 */
#ifndef VMMT_BROKER_SERVER_H
#define VMMT_BROKER_SERVER_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include "broker.h"

#define STOP_JOIN_MS      5000
#define ACCEPT_BACKOFF_MS 100
#define ACCEPTS_PER_ROUND 64 /* then the other connections get their turn */
#define MSGS_PER_ROUND    16 /* link messages read from one link per round */
#define MAX_CONNS         (VMMT_BROKER_MAX_PENDING + VMMT_BROKER_MAX_HELD)

enum conn_state {
    CONN_PENDING, /* accepted, credentials allowed, request not yet here */
    CONN_HELD,    /* served; kept open as a liveness link */
    CONN_ORPHAN   /* link closed without a goodbye while its process lives: watch its pidfd */
};

struct conn {
    int fd;    /* the socket; -1 for an orphan */
    int pidfd; /* the peer process, -1 when it cannot be watched */
    enum conn_state state;
    uid_t uid;
    pid_t pid;
    int64_t deadline; /* pending: the request must arrive by then */
    uint64_t seq;     /* accept order, for eviction of the oldest */
    uint64_t ranks[VMMT_BROKER_RANK_WORDS];
    /* Links: per rank, the vmmt__liveness_tick of its first hold (vmmt__broker_dead_fn); 0
     * for ranks not held. In place: the broker thread never allocates (a thread's first
     * malloc maps an arena that outlives the thread). */
    uint64_t held[VMMT_BROKER_MAX_RANKS];
};

struct vmmt__broker {
    int served_fds[VMMT_BROKER_MAX_FDS];
    int nserved;
    uint8_t pool_id[16];
    uid_t euid;
    uid_t *allowed;
    size_t allowed_count;
    int timeout_ms;
    int ranks;
    vmmt__broker_dead_fn on_dead;
    vmmt__broker_shared_dead_fn on_dead_shared;
    void *user;
    int (*resolve)(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS]);
    void *resolve_user;

    int listen_fd;
    int wake_fd;
    struct vmmt__broker_addr addr;
    bool path_bound;
    dev_t path_dev; /* identity of the socket file we created, so stop unlinks only ours */
    ino_t path_ino;

    pthread_t thread;
    struct conn conns[MAX_CONNS];
    int nconns;
    uint64_t seq;
    int64_t accept_resume; /* monotonic ms; listener ignored before this */
    bool warned_bounds;
    struct pollfd pfd[2 + 2 * MAX_CONNS];
    struct {
        uint64_t seq; /* whose fd this poll entry is: numbers are reused within a round */
        bool pidfd;
    } who[2 + 2 * MAX_CONNS];

    /* vmmt__broker_sync and stop wake the thread through wake_fd; stopping tells which. */
    atomic_bool stopping;
    pthread_mutex_t sync_lock;
    pthread_cond_t sync_cond;       /* CLOCK_MONOTONIC */
    uint64_t sync_asked, sync_done; /* under sync_lock */

    _Atomic uint64_t live[VMMT_BROKER_RANK_WORDS]; /* ranks held by links, for other threads */
    _Atomic uint64_t served, refused_peer, refused_pool, timed_out, malformed, evicted, held,
        deaths, goodbyes;
};

/* The thread's body: serves until stop is asked for, then closes every connection. */
void *vmmt__broker_main(void *arg);

static inline void vmmt__close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

#endif
