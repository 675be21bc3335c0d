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
#include "broker_server.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "broker_wire.h"
#include "clock.h"
#include "fork_guard.h"
#include "status.h"

/* ---------------------------------------------------------------- helpers */

static _Atomic uint64_t g_tick;

uint64_t vmmt__liveness_tick(void)
{
    return atomic_fetch_add(&g_tick, 1) + 1;
}

/* Release, paired with vmmt__broker_stats' acquire: what was done before a
 * count is seen by whoever reads it. */
static void count(_Atomic uint64_t *counter)
{
    atomic_fetch_add_explicit(counter, 1, memory_order_release);
}

static bool uid_allowed(const struct vmmt__broker *b, uid_t uid)
{
    if (uid == b->euid) return true;
    for (size_t i = 0; i < b->allowed_count; i++)
        if (b->allowed[i] == uid) return true;
    return false;
}

/* ------------------------------------------------------------------ server */

/*
 * Best effort: the peer may be gone, or hostile and not reading; a reply is
 * one small packet, so a non-blocking send either fits or fails.
 */
static bool send_reply(const uint8_t id[16], int cfd, int status, const char *msg, const int *fds,
                       int nfds, uint8_t flags)
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
    /* Only a success names the pool (or chunk) served: a refused peer learns nothing of it. */
    if (status == VMMT_OK) memcpy(buf + 14, id, 16);
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
    vmmt__close_fd(&b->conns[i].pidfd);
    b->conns[i] = b->conns[--b->nconns];
}

/* Find a connection again by its accept number: handling one may reorder the table. */
static int find_conn(const struct vmmt__broker *b, uint64_t seq)
{
    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].seq == seq) return i;
    return -1;
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
    /* Watch the process itself too (SO_PEERPIDFD, or SO_PEERCRED's pid opened now): its exit
     * tells that none of its copies can still run, where the hang-up may come first. */
    c->pidfd = vmmt__broker_peer_pidfd(c->fd);
    c->state = CONN_HELD;
    memset(c->ranks, 0, sizeof c->ranks);
    memset(c->held, 0, sizeof c->held);
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
    vmmt__short_id(b->pool_id, mine);
    if (vmmt__breq_parse(req, n, &flags, want, msg, sizeof msg) != NULL) {
        send_reply(b->pool_id, cfd, VMMT_EPROTO, msg, NULL, 0, 0);
        count(&b->malformed);
        remove_conn(b, i);
        return true;
    }
    if (memcmp(want, b->pool_id, 16) != 0 && b->resolve != NULL) {
        /* An elastic pool's chunk: served once, never held (the pool's own fetch holds). */
        int fds[VMMT_BROKER_MAX_FDS], nfds = b->resolve(b->resolve_user, want, fds);
        if (nfds > 0) {
            if (send_reply(want, cfd, VMMT_OK, NULL, fds, nfds, 0)) count(&b->served);
            for (int k = 0; k < nfds; k++)
                close(fds[k]);
            remove_conn(b, i);
            return true;
        }
    }
    if (memcmp(want, b->pool_id, 16) != 0) {
        snprintf(msg, sizeof msg,
                 "pool %s is not served here: this vmmt broker serves pool %s; check the "
                 "descriptor's pool id and broker address",
                 vmmt__short_id(want, theirs), mine);
        send_reply(b->pool_id, cfd, VMMT_EINVAL, msg, NULL, 0, 0);
        count(&b->refused_pool);
        remove_conn(b, i);
        return true;
    }
    /* Held before the reply, so that the reply can say so; undone if the reply fails. */
    bool held = (flags & VMMT__BREQ_HOLD) && try_hold(b, i);
    if (!send_reply(b->pool_id, cfd, VMMT_OK, NULL, b->served_fds, b->nserved,
                    held ? VMMT__BREP_HELD : 0)) {
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

static bool serve_link(struct vmmt__broker *b, int i, bool own);

/*
 * Read every announcement the other links have sent so far (all links but
 * the one numbered `except`; 0: all). An announcement counts from when its
 * consumer sent it, not from when this thread gets to it: a consume that
 * returned before a death, or before vmmt_pool_release_rank, announced its
 * ranks before it, and the death must find them held (the model test saw a
 * live process's rank released when one poll round reported the death
 * first). Hang-ups are left for their own events.
 */
static void read_announcements(struct vmmt__broker *b, uint64_t except)
{
    /* Downwards: a link removed on the way (a goodbye) moves the last one, already read, in. */
    for (int j = b->nconns - 1; j >= 0; j--)
        if (b->conns[j].seq != except && b->conns[j].state == CONN_HELD && b->conns[j].fd >= 0)
            (void)serve_link(b, j, false);
}

/* The link's process is dead: hand its last-held ranks to the pool, then forget it. */
static void link_died(struct vmmt__broker *b, int i)
{
    uint64_t ranks[VMMT_BROKER_RANK_WORDS], shared[VMMT_BROKER_RANK_WORDS];
    uint64_t held[VMMT_BROKER_MAX_RANKS];
    uint64_t seq = b->conns[i].seq;
    bool any, any_shared = false;
    pid_t pid;
    uid_t uid;

    read_announcements(b, seq);
    i = find_conn(b, seq);
    pid = b->conns[i].pid;
    uid = b->conns[i].uid;
    any = orphaned_ranks(b, i, ranks);
    for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++) {
        shared[w] = b->conns[i].ranks[w] & ~ranks[w];
        any_shared |= shared[w] != 0;
    }

    memcpy(held, b->conns[i].held, sizeof held);
    remove_conn(b, i);
    vmmt__log(VMMT_LOG_INFO, "fd broker: consumer pid %d (uid %u) died%s", (int)pid, (unsigned)uid,
              any ? "; releasing the ranks it alone held" : "");
    /* The pool checks, when it releases, that no live link holds the ranks again:
     * the dead link must be gone from what it reads by then. */
    update_live(b);
    if (any && b->on_dead != NULL) b->on_dead(b->user, ranks, pid, uid, held);
    if (any_shared && b->on_dead_shared != NULL) b->on_dead_shared(b->user, shared, pid, uid);
    /* Counted once handed on: whoever reads the count may rely on the release. */
    count(&b->deaths);
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
    vmmt__guarded_close(c->fd);
    c->fd = -1;
    if (c->pidfd >= 0 && !readable_now(c->pidfd)) {
        /* One orphan per process is enough to watch it: merge into one already there. */
        for (int j = 0; j < b->nconns; j++) {
            if (j == i || b->conns[j].state != CONN_ORPHAN || b->conns[j].pid != c->pid) continue;
            uint64_t *into = b->conns[j].held;
            for (int w = 0; w < VMMT_BROKER_RANK_WORDS; w++)
                b->conns[j].ranks[w] |= c->ranks[w];
            /* The process held each rank since the earlier of the two links took it. */
            for (int r = 0; r < VMMT_BROKER_MAX_RANKS; r++)
                if (c->held[r] != 0 && (into[r] == 0 || c->held[r] < into[r])) into[r] = c->held[r];
            remove_conn(b, i);
            return;
        }
        c->state = CONN_ORPHAN;
        return;
    }
    link_died(b, i);
}

/*
 * Read what a link sent; returns false when the link is gone (removed or
 * orphaned). On its own event (`own`), a round's share, and a hang-up is
 * handled here; read ahead for another link's death or a sync, everything
 * it sent, and a hang-up is left for its own event.
 */
static bool serve_link(struct vmmt__broker *b, int i, bool own)
{
    /* A consumer announces each rank once, so all it can have sent is one message per rank
     * and a goodbye; more than that is a flood, read on its own events. */
    int most = own ? MSGS_PER_ROUND : VMMT_BROKER_MAX_RANKS + 1;

    for (int k = 0; k < most; k++) {
        uint8_t buf[VMMT__BMSG_SIZE + 1];
        char why[160];
        struct vmmt__bmsg m;
        ssize_t n = recv(b->conns[i].fd, buf, sizeof buf, MSG_DONTWAIT | MSG_TRUNC);

        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
        if (n <= 0 && !own) return true;
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
        uint64_t now = vmmt__liveness_tick();
        for (uint32_t r = m.first; r < m.first + m.count; r++) {
            b->conns[i].ranks[r / 64] |= 1ull << (r % 64);
            if (b->conns[i].held[r] == 0) b->conns[i].held[r] = now;
        }
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
    vmmt__guarded_close(cfd);
}

/* Credentials first: a peer that is not allowed is told so and closed at once. */
static void admit(struct vmmt__broker *b, int cfd, int64_t now)
{
    struct ucred cred;
    socklen_t cl = sizeof cred;
    char msg[VMMT__BREP_MSG_MAX + 1], mine[9];

    if (getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
        count(&b->refused_peer);
        vmmt__guarded_close(cfd);
        return;
    }
    if (!uid_allowed(b, cred.uid)) {
        snprintf(msg, sizeof msg,
                 "uid %u is not allowed by the vmmt broker of pool %s; add it to the pool's "
                 "allowed uids",
                 (unsigned)cred.uid, vmmt__short_id(b->pool_id, mine));
        send_reply(b->pool_id, cfd, VMMT_EPERM, msg, NULL, 0, 0);
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
        /* Guarded: a child the producer forks must not keep a consumer's link open. */
        int cfd = vmmt__guarded_accept(b->listen_fd, SOCK_NONBLOCK | SOCK_CLOEXEC);
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
        if ((p->revents & POLLIN) && !serve_link(b, i, true)) return;
        /* Everything it sent is read: a hang-up now is its end. */
        if (p->revents & (POLLHUP | POLLERR)) {
            i = find_conn(b, seq);
            if (i >= 0 && b->conns[i].fd == p->fd && !readable_now(p->fd)) link_closed(b, i);
        }
    }
}

/* A thread waits in vmmt__broker_sync: read every link's announcements, then say so. */
static void answer_sync(struct vmmt__broker *b)
{
    uint64_t v, asked;

    /* Reset first: a request made after the ticket is read below wakes the next round. */
    if (read(b->wake_fd, &v, sizeof v) < 0 && errno != EAGAIN)
        vmmt__log(VMMT_LOG_WARN, "fd broker: reading its wake-up: %s", strerror(errno));
    pthread_mutex_lock(&b->sync_lock);
    asked = b->sync_asked;
    pthread_mutex_unlock(&b->sync_lock);
    read_announcements(b, 0);
    update_live(b);
    pthread_mutex_lock(&b->sync_lock);
    b->sync_done = asked;
    pthread_cond_broadcast(&b->sync_cond);
    pthread_mutex_unlock(&b->sync_lock);
}

/* One round of poll; returns false when stop was asked for. */
static bool serve_round(struct vmmt__broker *b)
{
    struct pollfd *pfd = b->pfd;
    int64_t now = vmmt__now_ms();
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
    if (r > 0 && pfd[0].revents != 0) {
        if (atomic_load(&b->stopping)) return false;
        answer_sync(b);
    }
    now = vmmt__now_ms();
    for (int k = 2; r > 0 && k < n; k++) {
        if (pfd[k].revents != 0) handle_event(b, &pfd[k], b->who[k].seq, b->who[k].pidfd);
    }
    expire_pending(b, now);
    if (r > 0 && (pfd[1].revents & POLLIN)) accept_new(b, now);
    update_live(b);
    return true;
}

void *vmmt__broker_main(void *arg)
{
    struct vmmt__broker *b = arg;
    while (serve_round(b)) {
    }
    while (b->nconns > 0)
        remove_conn(b, b->nconns - 1);
    return NULL;
}
