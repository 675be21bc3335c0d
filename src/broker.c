/*
 * The fd broker's server. One thread polls a listening socket, an eventfd
 * for stop, connections awaiting their request, and liveness links (with
 * their peers' pidfds); every socket is non-blocking so that no client,
 * however slow or hostile, can hold the thread. Credentials are checked at
 * accept, and a refused peer is closed at once. Connections awaiting a
 * request are bounded per uid and in all; when full, the oldest of the peer
 * holding the most is closed, so a flood of idle connections costs its
 * sender its own connections and never stops the listener. Wire format and
 * security model: docs/broker.md.
 */
#include "broker.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker_wire.h"
#include "status.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

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
    void *user;

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

    _Atomic uint64_t live[VMMT_BROKER_RANK_WORDS]; /* ranks held by links, for other threads */
    _Atomic uint64_t served, refused_peer, refused_pool, timed_out, malformed, evicted, held,
        deaths, goodbyes;
};

/* ---------------------------------------------------------------- helpers */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* The first four bytes in hex: enough to tell pools apart in a message. */
static const char *short_id(const uint8_t id[16], char buf[9])
{
    snprintf(buf, 9, "%02x%02x%02x%02x", id[0], id[1], id[2], id[3]);
    return buf;
}

static int new_socket(void)
{
    return socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
}

static void count(_Atomic uint64_t *counter)
{
    atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
}

static bool uid_allowed(const struct vmmt__broker *b, uid_t uid)
{
    if (uid == b->euid) return true;
    for (size_t i = 0; i < b->allowed_count; i++)
        if (b->allowed[i] == uid) return true;
    return false;
}

/* ------------------------------------------------------------ wire parsers */

const char *vmmt__breq_parse(const uint8_t *req, long n, uint16_t *flags, uint8_t pool_id[16],
                             char *why, size_t cap)
{
    if (n != VMMT__BREQ_SIZE) {
        snprintf(why, cap, "request of %ld bytes; version %d requests have %d", n,
                 VMMT__BROKER_PROTO, VMMT__BREQ_SIZE);
    } else if (memcmp(req, VMMT__BREQ_MAGIC, 4) != 0) {
        snprintf(why, cap, "request does not start with \"VMBQ\"; is the client a vmmt consumer?");
    } else if (vmmt__get_u16(req + 4) != VMMT__BROKER_PROTO) {
        snprintf(why, cap,
                 "request version %u is not supported; this broker speaks version %d: use the "
                 "same vmmt version on producer and consumers",
                 vmmt__get_u16(req + 4), VMMT__BROKER_PROTO);
    } else if ((vmmt__get_u16(req + 6) & ~VMMT__BREQ_FLAGS) != 0) {
        snprintf(why, cap, "request flags 0x%x has unknown bits; known: 0x%x",
                 vmmt__get_u16(req + 6), VMMT__BREQ_FLAGS);
    } else {
        *flags = vmmt__get_u16(req + 6);
        memcpy(pool_id, req + 8, 16);
        return NULL;
    }
    return why;
}

const char *vmmt__bmsg_parse(const uint8_t *buf, long n, int ranks, struct vmmt__bmsg *out,
                             char *why, size_t cap)
{
    if (n != VMMT__BMSG_SIZE) {
        snprintf(why, cap, "link message of %ld bytes; they have %d", n, VMMT__BMSG_SIZE);
        return why;
    }
    if (memcmp(buf, VMMT__BMSG_MAGIC, 4) != 0 || vmmt__get_u16(buf + 4) != VMMT__BROKER_PROTO) {
        snprintf(why, cap, "link message lacks the \"VMBM\" magic or version %d",
                 VMMT__BROKER_PROTO);
        return why;
    }
    out->type = vmmt__get_u16(buf + 6);
    out->first = vmmt__get_u32(buf + 8);
    out->count = vmmt__get_u32(buf + 12);
    if (out->type == VMMT__BMSG_BYE && out->first == 0 && out->count == 0) return NULL;
    if (out->type != VMMT__BMSG_HOLD) {
        snprintf(why, cap, "link message type %u (first %u, count %u) is unknown", out->type,
                 out->first, out->count);
        return why;
    }
    if (out->count == 0 || out->first >= (uint32_t)ranks ||
        out->count > (uint32_t)ranks - out->first) {
        snprintf(why, cap, "link message holds ranks [%u, +%u), outside the pool's %d", out->first,
                 out->count, ranks);
        return why;
    }
    return NULL;
}

/* ------------------------------------------------------------------ server */

/*
 * Best effort: the peer may be gone, or hostile and not reading; a reply is
 * one small packet, so a non-blocking send either fits or fails.
 */
static bool send_reply(const struct vmmt__broker *b, int cfd, int status, const char *msg,
                       const int *fds, int nfds, uint8_t flags)
{
    uint8_t buf[VMMT__BREP_MAX];
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * VMMT_BROKER_MAX_FDS)];
    } ctl;
    struct iovec iov;
    struct msghdr mh;
    size_t len = msg ? strlen(msg) : 0;

    if (len > VMMT__BREP_MSG_MAX) len = VMMT__BREP_MSG_MAX;
    memset(buf, 0, VMMT__BREP_HEAD);
    memcpy(buf, VMMT__BREP_MAGIC, 4);
    vmmt__put_u16(buf + 4, VMMT__BROKER_PROTO);
    buf[6] = (uint8_t)nfds;
    buf[7] = flags;
    vmmt__put_u32(buf + 8, (uint32_t)status);
    vmmt__put_u16(buf + 12, (uint16_t)len);
    /* Only a success names the pool: a refused peer learns nothing about it. */
    if (status == VMMT_OK) memcpy(buf + 14, b->pool_id, 16);
    if (len > 0) memcpy(buf + VMMT__BREP_HEAD, msg, len);

    iov.iov_base = buf;
    iov.iov_len = VMMT__BREP_HEAD + len;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (nfds > 0) {
        /* One control message keeps the fds in order: the client relies on their positions. */
        memset(&ctl, 0, sizeof ctl);
        mh.msg_control = ctl.space;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    if (sendmsg(cfd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
        vmmt__log(VMMT_LOG_INFO, "fd broker: reply to a client failed: %s", strerror(errno));
        return false;
    }
    return true;
}

static int count_state(const struct vmmt__broker *b, enum conn_state st, bool by_uid, uid_t uid)
{
    int n = 0;
    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].state == st && (!by_uid || b->conns[i].uid == uid)) n++;
    return n;
}

static void drain_close(int cfd);

static void remove_conn(struct vmmt__broker *b, int i)
{
    if (b->conns[i].state != CONN_PENDING) atomic_fetch_sub(&b->held, 1);
    if (b->conns[i].fd >= 0) drain_close(b->conns[i].fd);
    b->conns[i].fd = -1;
    close_fd(&b->conns[i].pidfd);
    b->conns[i] = b->conns[--b->nconns];
}

/*
 * Watch the peer process itself, so that its death is an event even when a
 * child it forked keeps the socket open. pidfd_open takes the pid SO_PEERCRED
 * gave at connect; should that process be gone and its pid reused already,
 * its socket is closed too, which the caller checks next (a poll for hang-up).
 */
static int open_pidfd(pid_t pid)
{
    if (pid <= 0) return -1;
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

static bool readable_now(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return fd >= 0 && poll(&p, 1, 0) > 0;
}

/* Keep a served connection as a liveness link, if the bounds allow. */
static bool try_hold(struct vmmt__broker *b, int i)
{
    struct conn *c = &b->conns[i];

    int of_pid = 0;

    if (b->ranks <= 0) return false;
    for (int j = 0; j < b->nconns; j++)
        of_pid += b->conns[j].state != CONN_PENDING && b->conns[j].pid == c->pid;
    if (count_state(b, CONN_HELD, false, 0) + count_state(b, CONN_ORPHAN, false, 0) >=
            VMMT_BROKER_MAX_HELD ||
        count_state(b, CONN_HELD, true, c->uid) + count_state(b, CONN_ORPHAN, true, c->uid) >=
            VMMT_BROKER_HELD_PER_UID ||
        of_pid >= VMMT_BROKER_HELD_PER_PID) {
        /* Once per broker: a flood of such requests must not flood the log too. */
        if (!b->warned_bounds)
            vmmt__log(VMMT_LOG_WARN,
                      "fd broker: uid %u pid %d asked for a liveness link beyond the bounds (%d "
                      "per process, %d per uid, %d in all); it is served without one, so its "
                      "death will not be noticed (warned once)",
                      (unsigned)c->uid, (int)c->pid, VMMT_BROKER_HELD_PER_PID,
                      VMMT_BROKER_HELD_PER_UID, VMMT_BROKER_MAX_HELD);
        b->warned_bounds = true;
        return false;
    }
    c->pidfd = open_pidfd(c->pid);
    c->state = CONN_HELD;
    memset(c->ranks, 0, sizeof c->ranks);
    atomic_fetch_add(&b->held, 1);
    return true;
}

/*
 * Answer a pending connection whose request is readable. Returns false while
 * no request has arrived yet; true once answered (the connection is then
 * held, or closed and removed).
 */
static bool serve_request(struct vmmt__broker *b, int i)
{
    uint8_t req[VMMT__BREQ_SIZE + 1], want[16];
    char msg[VMMT__BREP_MSG_MAX + 1], mine[9], theirs[9];
    uint16_t flags = 0;
    int cfd = b->conns[i].fd;
    ssize_t n;

    /* No control buffer: fds a hostile client attaches are discarded by the kernel. */
    n = recv(cfd, req, sizeof req, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    if (n <= 0) {
        count(&b->malformed);
        remove_conn(b, i);
        return true;
    }
    short_id(b->pool_id, mine);
    if (vmmt__breq_parse(req, n, &flags, want, msg, sizeof msg) != NULL) {
        send_reply(b, cfd, VMMT_EPROTO, msg, NULL, 0, 0);
        count(&b->malformed);
        remove_conn(b, i);
        return true;
    }
    if (memcmp(want, b->pool_id, 16) != 0) {
        snprintf(msg, sizeof msg,
                 "pool %s is not served here: this vmmt broker serves pool %s; check the "
                 "descriptor's pool id and broker address",
                 short_id(want, theirs), mine);
        send_reply(b, cfd, VMMT_EINVAL, msg, NULL, 0, 0);
        count(&b->refused_pool);
        remove_conn(b, i);
        return true;
    }
    /* Held before the reply, so that the reply can say so; undone if the reply fails. */
    bool held = (flags & VMMT__BREQ_HOLD) && try_hold(b, i);
    if (!send_reply(b, cfd, VMMT_OK, NULL, b->served_fds, b->nserved, held ? VMMT__BREP_HELD : 0)) {
        remove_conn(b, i);
        return true;
    }
    count(&b->served);
    if (!held) remove_conn(b, i);
    return true;
}

/* The ranks c held that no other live link holds: those lose their last holder with c. */
static bool orphaned_ranks(const struct vmmt__broker *b, int i, uint64_t out[])
{
    bool any = false;

    memcpy(out, b->conns[i].ranks, sizeof b->conns[i].ranks);
    for (int j = 0; j < b->nconns; j++) {
        if (j == i || b->conns[j].state == CONN_PENDING) continue;
        for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
            out[w] &= ~b->conns[j].ranks[w];
    }
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        any |= out[w] != 0;
    return any;
}

/* The link's process is dead: hand its last-held ranks to the pool, then forget it. */
static void link_died(struct vmmt__broker *b, int i)
{
    uint64_t ranks[VMMT_BROKER_RANK_WORDS];
    pid_t pid = b->conns[i].pid;
    uid_t uid = b->conns[i].uid;
    bool any = orphaned_ranks(b, i, ranks);

    count(&b->deaths);
    remove_conn(b, i);
    vmmt__log(VMMT_LOG_INFO, "fd broker: consumer pid %d (uid %u) died%s", (int)pid, (unsigned)uid,
              any ? "; releasing the ranks it alone held" : "");
    if (any && b->on_dead != NULL) b->on_dead(b->user, ranks, pid, uid);
}

/*
 * The link's socket closed without a goodbye. Its process is dead, or about
 * to be (the kernel closes a dying process's files before its pidfd reports
 * the exit, and its GPU context goes with those files): with a pidfd, wait
 * for the exit, so that no copy of the process can still run when its ranks
 * are released; without one, the close is all there is to go by.
 */
static void link_closed(struct vmmt__broker *b, int i)
{
    struct conn *c = &b->conns[i];
    bool any = false;

    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        any |= c->ranks[w] != 0;
    if (!any) {
        /* It held no rank: nothing to release, whatever became of it. */
        remove_conn(b, i);
        return;
    }
    close_fd(&c->fd);
    if (c->pidfd >= 0 && !readable_now(c->pidfd)) {
        /* One orphan per process is enough to watch it: merge into one already there. */
        for (int j = 0; j < b->nconns; j++) {
            if (j == i || b->conns[j].state != CONN_ORPHAN || b->conns[j].pid != c->pid) continue;
            for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
                b->conns[j].ranks[w] |= c->ranks[w];
            remove_conn(b, i);
            return;
        }
        c->state = CONN_ORPHAN;
        return;
    }
    link_died(b, i);
}

/* Read what a link sent; returns false when the link is gone (removed or orphaned). */
static bool serve_link(struct vmmt__broker *b, int i)
{
    for (int k = 0; k < MSGS_PER_ROUND; k++) {
        uint8_t buf[VMMT__BMSG_SIZE + 1];
        char why[160];
        struct vmmt__bmsg m;
        ssize_t n = recv(b->conns[i].fd, buf, sizeof buf, MSG_DONTWAIT | MSG_TRUNC);

        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
        if (n <= 0) {
            link_closed(b, i);
            return false;
        }
        if (vmmt__bmsg_parse(buf, n, b->ranks, &m, why, sizeof why) != NULL) {
            /* A broken client loses its link, and with it the release of its ranks should it
             * die: its word can no longer be trusted either way. */
            vmmt__log(VMMT_LOG_INFO,
                      "fd broker: consumer pid %d (uid %u) sent a bad link message (%s); "
                      "closing its link",
                      (int)b->conns[i].pid, (unsigned)b->conns[i].uid, why);
            count(&b->malformed);
            remove_conn(b, i);
            return false;
        }
        if (m.type == VMMT__BMSG_BYE) {
            count(&b->goodbyes);
            remove_conn(b, i);
            return false;
        }
        for (uint32_t r = m.first; r < m.first + m.count; r++)
            b->conns[i].ranks[r / 64] |= 1ull << (r % 64);
    }
    return true;
}

/* Make room for one more pending connection: close the oldest of the uid or pid with the most. */
static void evict_pending(struct vmmt__broker *b, uid_t uid)
{
    int victim = -1, most = 0;
    bool uid_full = count_state(b, CONN_PENDING, true, uid) >= VMMT_BROKER_PENDING_PER_UID;

    if (!uid_full && count_state(b, CONN_PENDING, false, 0) < VMMT_BROKER_MAX_PENDING) return;
    for (int i = 0; i < b->nconns; i++) {
        const struct conn *c = &b->conns[i];
        int n = 0;
        if (c->state != CONN_PENDING || (uid_full && c->uid != uid)) continue;
        for (int j = 0; j < b->nconns; j++)
            n += b->conns[j].state == CONN_PENDING && b->conns[j].pid == c->pid;
        if (n > most || (n == most && c->seq < b->conns[victim].seq)) {
            most = n;
            victim = i;
        }
    }
    if (victim < 0) return;
    count(&b->evicted);
    remove_conn(b, victim);
}

/*
 * Closing with a request unread makes the kernel report a reset to the peer
 * ahead of the reply queued for it: read what is there first.
 */
static void drain_close(int cfd)
{
    uint8_t sink[64];
    for (int i = 0; i < 4 && recv(cfd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++)
        ;
    close(cfd);
}

/* Credentials first: a peer that is not allowed is told so and closed at once. */
static void admit(struct vmmt__broker *b, int cfd, int64_t now)
{
    struct ucred cred;
    socklen_t cl = sizeof cred;
    char msg[VMMT__BREP_MSG_MAX + 1], mine[9];

    if (getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
        count(&b->refused_peer);
        close(cfd);
        return;
    }
    if (!uid_allowed(b, cred.uid)) {
        snprintf(msg, sizeof msg,
                 "uid %u is not allowed by the vmmt broker of pool %s; add it to the pool's "
                 "allowed uids",
                 (unsigned)cred.uid, short_id(b->pool_id, mine));
        send_reply(b, cfd, VMMT_EPERM, msg, NULL, 0, 0);
        count(&b->refused_peer);
        drain_close(cfd);
        return;
    }
    evict_pending(b, cred.uid);
    /* Cannot happen (pending and links have their own bounds, and eviction made room for
     * this one), but the table must never overflow. */
    if (b->nconns >= MAX_CONNS) {
        count(&b->evicted);
        drain_close(cfd);
        return;
    }
    int i = b->nconns++;
    b->conns[i] = (struct conn){.fd = cfd,
                                .pidfd = -1,
                                .state = CONN_PENDING,
                                .uid = cred.uid,
                                .pid = cred.pid,
                                .deadline = now + b->timeout_ms,
                                .seq = ++b->seq};
    /* A client sends its request right after connecting: it is usually here
     * already, and answering now saves a round through poll. */
    serve_request(b, i);
}

static void accept_new(struct vmmt__broker *b, int64_t now)
{
    for (int k = 0; k < ACCEPTS_PER_ROUND; k++) {
        int cfd = accept4(b->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd >= 0) {
            admit(b, cfd, now);
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        /* EMFILE and friends leave the listener readable: back off instead of spinning. */
        vmmt__log(VMMT_LOG_WARN,
                  "fd broker: cannot accept a client: %s; retrying in %d ms (raise the "
                  "open-file limit if this persists)",
                  strerror(errno), ACCEPT_BACKOFF_MS);
        b->accept_resume = now + ACCEPT_BACKOFF_MS;
        return;
    }
}

static void expire_pending(struct vmmt__broker *b, int64_t now)
{
    for (int i = b->nconns - 1; i >= 0; i--) {
        if (b->conns[i].state == CONN_PENDING && b->conns[i].deadline <= now) {
            remove_conn(b, i);
            count(&b->timed_out);
        }
    }
}

/* Poll timeout: until the nearest request deadline or the end of an accept back-off. */
static int next_timeout(const struct vmmt__broker *b, int64_t now)
{
    int64_t next = INT64_MAX;
    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].state == CONN_PENDING && b->conns[i].deadline < next)
            next = b->conns[i].deadline;
    if (b->accept_resume > now && b->accept_resume < next) next = b->accept_resume;
    if (next == INT64_MAX) return -1;
    return next <= now ? 0 : (int)(next - now);
}

/* Find a connection again by its accept number: handling one may reorder the table. */
static int find_conn(const struct vmmt__broker *b, uint64_t seq)
{
    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].seq == seq) return i;
    return -1;
}

static void handle_event(struct vmmt__broker *b, const struct pollfd *p, uint64_t seq, bool pidfd)
{
    int i = find_conn(b, seq);

    if (i < 0) return;
    if (pidfd ? b->conns[i].pidfd != p->fd : b->conns[i].fd != p->fd) return;
    if (pidfd) {
        /* The process exited: whatever holds its socket, none of its copies can run now. */
        if (b->conns[i].state != CONN_PENDING) link_died(b, i);
        return;
    }
    if (b->conns[i].state == CONN_PENDING) {
        if (p->revents & POLLIN) {
            serve_request(b, i);
        } else {
            /* Hung up or failed before sending anything. */
            remove_conn(b, i);
            count(&b->malformed);
        }
        return;
    }
    if (b->conns[i].state == CONN_HELD) {
        if ((p->revents & POLLIN) && !serve_link(b, i)) return;
        /* Everything it sent is read: a hang-up now is its end. */
        if (p->revents & (POLLHUP | POLLERR)) {
            i = find_conn(b, seq);
            if (i >= 0 && b->conns[i].fd == p->fd && !readable_now(p->fd)) link_closed(b, i);
        }
    }
}

/* Publish the ranks live links hold, for vmmt__broker_live_ranks. */
static void update_live(struct vmmt__broker *b)
{
    uint64_t live[VMMT_BROKER_RANK_WORDS] = {0};

    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].state != CONN_PENDING)
            for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
                live[w] |= b->conns[i].ranks[w];
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
        atomic_store_explicit(&b->live[w], live[w], memory_order_relaxed);
}

/* One round of poll; returns false when stop was asked for. */
static bool serve_round(struct vmmt__broker *b)
{
    struct pollfd *pfd = b->pfd;
    int64_t now = now_ms();
    int n = 2, r;
    /* Never left out for being full: a new connection evicts an idle one. */
    bool listening = now >= b->accept_resume;

    pfd[0] = (struct pollfd){.fd = b->wake_fd, .events = POLLIN};
    /* A negative fd makes poll skip the listener while we back off. */
    pfd[1] = (struct pollfd){.fd = listening ? b->listen_fd : -1, .events = POLLIN};
    for (int i = 0; i < b->nconns; i++) {
        const struct conn *c = &b->conns[i];
        if (c->fd >= 0) {
            b->who[n].seq = c->seq;
            b->who[n].pidfd = false;
            pfd[n++] = (struct pollfd){.fd = c->fd, .events = POLLIN};
        }
        if (c->pidfd >= 0 && c->state != CONN_PENDING) {
            b->who[n].seq = c->seq;
            b->who[n].pidfd = true;
            pfd[n++] = (struct pollfd){.fd = c->pidfd, .events = POLLIN};
        }
    }
    r = poll(pfd, (nfds_t)n, next_timeout(b, now));
    if (r < 0 && errno != EINTR) {
        vmmt__log(VMMT_LOG_WARN, "fd broker: poll failed: %s; retrying", strerror(errno));
        /* Sleep a little rather than spin; stop still wakes us within that. */
        poll(pfd, 1, 10);
    }
    if (r > 0 && pfd[0].revents != 0) return false;
    now = now_ms();
    for (int k = 2; r > 0 && k < n; k++) {
        if (pfd[k].revents != 0) handle_event(b, &pfd[k], b->who[k].seq, b->who[k].pidfd);
    }
    expire_pending(b, now);
    if (r > 0 && (pfd[1].revents & POLLIN)) accept_new(b, now);
    update_live(b);
    return true;
}

static void *broker_main(void *arg)
{
    struct vmmt__broker *b = arg;
    while (serve_round(b)) {
    }
    while (b->nconns > 0)
        remove_conn(b, b->nconns - 1);
    return NULL;
}
/* ------------------------------------------------------------ server setup */

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
    int s = new_socket(), st;

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
    close(s);
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
    b->user = cfg->user;
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
    err = pthread_create(&b->thread, NULL, broker_main, b);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        errno = err;
        return vmmt__sys_fail("pthread_create");
    }
    pthread_setname_np(b->thread, "vmmt-broker");
    return VMMT_OK;
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
        close_fd(&b->served_fds[i]);
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
    st = dup_served(b, fds, nfds);
    if (st != VMMT_OK) goto fail_served;
    b->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (b->wake_fd < 0) {
        st = vmmt__sys_fail("eventfd");
        goto fail_served;
    }
    st = open_listener(b, cfg ? cfg->path : NULL);
    if (st != VMMT_OK) goto fail_wake;
    st = start_thread(b);
    if (st != VMMT_OK) goto fail_listener;
    *out = b;
    return VMMT_OK;

fail_listener:
    close_fd(&b->listen_fd);
    unlink_path(b);
fail_wake:
    close_fd(&b->wake_fd);
fail_served:
    close_served(b);
fail_free:
    free(b->allowed);
    free(b);
fail_args:
    if (pool_id != NULL) short_id(pool_id, id);
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
    close_fd(&b->listen_fd);
    unlink_path(b);
    close_fd(&b->wake_fd);
    close_served(b);
    free(b->allowed);
    free(b);
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
    out->served = atomic_load_explicit(&b->served, memory_order_relaxed);
    out->refused_peer = atomic_load_explicit(&b->refused_peer, memory_order_relaxed);
    out->refused_pool = atomic_load_explicit(&b->refused_pool, memory_order_relaxed);
    out->timed_out = atomic_load_explicit(&b->timed_out, memory_order_relaxed);
    out->malformed = atomic_load_explicit(&b->malformed, memory_order_relaxed);
    out->evicted = atomic_load_explicit(&b->evicted, memory_order_relaxed);
    out->held = atomic_load_explicit(&b->held, memory_order_relaxed);
    out->deaths = atomic_load_explicit(&b->deaths, memory_order_relaxed);
    out->goodbyes = atomic_load_explicit(&b->goodbyes, memory_order_relaxed);
}
