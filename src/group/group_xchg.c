/*
 * The descriptor exchange of a group, between the ranks of one node. One
 * thread, one poll loop, every socket non-blocking, one deadline for the
 * whole exchange: a peer that dies, stalls or misbehaves makes the call
 * fail by the deadline at the latest, never hang. Each rank listens on its
 * own socket (address all-gathered beforehand); a sender connects, checks
 * that the listener belongs to the rank it means (SO_PEERCRED: announced
 * pid and uid), sends its descriptors in batches of SCM_RIGHTS messages and
 * closes; a receiver checks each connection's credentials the same way and
 * counts what arrives against what the sender announced through the
 * collective. Wire format: docs/group.md.
 */
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "group_internal.h"
#include "scm.h"
#include "status.h"

#define POLL_SLICE_MS 50

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static socklen_t to_sockaddr(const struct vmmt__broker_addr *a, struct sockaddr_un *sun)
{
    size_t len = a->len < sizeof sun->sun_path - 1 ? a->len : sizeof sun->sun_path - 1;

    memset(sun, 0, sizeof *sun);
    sun->sun_family = AF_UNIX;
    if (a->kind == 0) {
        memcpy(sun->sun_path + 1, a->name, len);
        return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
    }
    memcpy(sun->sun_path, a->name, len);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1);
}

int vmmt__gx_listen(const char *dir, struct vmmt__gx *x)
{
    struct sockaddr_un sun;
    unsigned char rnd[16];
    char hex[33];
    int n;

    memset(x, 0, sizeof *x);
    x->listen_fd = -1;
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
        return vmmt__sys_fail("group exchange: getrandom for a socket name");
    for (int i = 0; i < 16; i++)
        snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
    if (dir != NULL && dir[0] != '\0') {
        n = snprintf(x->path, sizeof x->path, "%s/vmmt-group-%.16s.sock", dir, hex);
        x->addr.kind = 1;
        if (n < 0 || (size_t)n >= sizeof x->addr.name)
            return vmmt__fail(VMMT_EINVAL, "group exchange: socket path in \"%s\" too long", dir);
        memcpy(x->addr.name, x->path, (size_t)n);
    } else {
        n = snprintf(x->addr.name, sizeof x->addr.name, "vmmt-group-%s", hex);
        x->addr.kind = 0;
    }
    x->addr.len = (uint8_t)n;
    x->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (x->listen_fd < 0) return vmmt__sys_fail("group exchange: socket(AF_UNIX, SEQPACKET)");
    if (bind(x->listen_fd, (struct sockaddr *)&sun, to_sockaddr(&x->addr, &sun)) != 0) {
        int st = vmmt__sys_fail("group exchange: bind %s%s", x->addr.kind ? "" : "@",
                                x->addr.kind ? x->path : x->addr.name);
        x->path[0] = '\0';
        vmmt__gx_close(x);
        return st;
    }
    /* Only our user may connect to a file socket; credentials are checked anyway. */
    if (x->path[0] != '\0') chmod(x->path, 0600);
    if (listen(x->listen_fd, 128) != 0) {
        int st = vmmt__sys_fail("group exchange: listen");
        vmmt__gx_close(x);
        return st;
    }
    return VMMT_OK;
}

void vmmt__gx_close(struct vmmt__gx *x)
{
    close_fd(&x->listen_fd);
    if (x->path[0] != '\0') unlink(x->path);
    x->path[0] = '\0';
}

/* ------------------------------------------------------------ run state */

struct out_state {
    int fd;
    int connected;
    uint32_t batch;  /* next batch to send */
    uint32_t nbatch; /* batches in all */
    int done;
};

struct in_state {
    int fd;
    int got;
    uint32_t batch; /* next batch expected */
    int eof;
};

struct run {
    struct vmmt__gx *x;
    int self;
    uint32_t seq;
    struct vmmt__gx_peer *peers;
    int npeers;
    struct out_state *out;
    struct in_state *in;
    int64_t deadline;
    int timeout_ms;
};

static const char *addr_text(const struct vmmt__broker_addr *a, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s%.*s", a->kind == 0 ? "@" : "", (int)a->len, a->name);
    return buf;
}

static int peer_cred(int fd, struct ucred *c)
{
    socklen_t len = sizeof *c;

    return getsockopt(fd, SOL_SOCKET, SO_PEERCRED, c, &len);
}

/* Connect to peer i's socket; 1 when connected, 0 to retry later, or a failure. */
static int try_connect(struct run *R, int i)
{
    struct vmmt__gx_peer *p = &R->peers[i];
    struct out_state *o = &R->out[i];
    struct sockaddr_un sun;
    struct ucred c;
    char at[128];

    if (o->fd < 0) {
        o->fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (o->fd < 0) return vmmt__sys_fail("group exchange: socket for rank %d", p->rank);
    }
    if (connect(o->fd, (struct sockaddr *)&sun, to_sockaddr(&p->addr, &sun)) != 0) {
        int err = errno;
        if (err == EAGAIN || err == EINPROGRESS || err == EINTR) {
            close_fd(&o->fd); /* the listener's queue is full: try again with a new socket */
            return 0;
        }
        errno = err;
        return vmmt__sys_fail("group exchange: connect to rank %d at %s (has it died or left "
                              "the exchange?)",
                              p->rank, addr_text(&p->addr, at, sizeof at));
    }
    if (peer_cred(o->fd, &c) != 0)
        return vmmt__sys_fail("group exchange: SO_PEERCRED of rank %d's socket", p->rank);
    if (c.pid != p->pid || c.uid != p->uid)
        return vmmt__fail(VMMT_EPERM,
                          "group exchange: the socket at %s belongs to pid %d uid %u, but rank "
                          "%d announced pid %d uid %u; refusing to send it descriptors",
                          addr_text(&p->addr, at, sizeof at), (int)c.pid, (unsigned)c.uid, p->rank,
                          (int)p->pid, (unsigned)p->uid);
    o->connected = 1;
    return 1;
}

/* Send the next batch to peer i; 1 when sent, 0 when the socket is full, or a failure. */
static int send_batch(struct run *R, int i)
{
    struct vmmt__gx_peer *p = &R->peers[i];
    struct out_state *o = &R->out[i];
    struct vmmt__gx_head h;
    uint32_t first = o->batch * VMMT__GX_BATCH_MAX;
    uint32_t n = (uint32_t)p->send_count - first;

    if (n > VMMT__GX_BATCH_MAX) n = VMMT__GX_BATCH_MAX;
    memset(&h, 0, sizeof h);
    h.magic = VMMT__GX_MAGIC;
    h.version = VMMT__GX_VERSION;
    h.seq = R->seq;
    h.from = R->self;
    h.to = p->rank;
    h.batch = o->batch;
    h.nfds = n;
    h.total = (uint32_t)p->send_count;
    if (vmmt__scm_send(o->fd, &h, sizeof h, p->send_fds + first, (int)n, MSG_DONTWAIT) < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        return vmmt__sys_fail("group exchange: sending batch %u of %u (%u descriptors) to rank %d",
                              o->batch + 1, o->nbatch, n, p->rank);
    }
    if (++o->batch == o->nbatch) {
        /*
         * The peer sees the end; the socket stays open so that its close tells
         * us when the peer's own exchange ended (or it died).
         */
        o->done = 1;
        shutdown(o->fd, SHUT_WR);
    }
    return 1;
}

static int find_peer_by_cred(const struct run *R, const struct ucred *c)
{
    for (int i = 0; i < R->npeers; i++)
        if (R->peers[i].pid == c->pid && R->peers[i].uid == c->uid) return i;
    return -1;
}

/* A new connection: whose is it? Unknown peers are refused without failing the exchange. */
static int accept_one(struct run *R, int *accepted)
{
    struct ucred c;
    int fd, i;

    *accepted = 0;
    fd = accept4(R->x->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
            return VMMT_OK;
        return vmmt__sys_fail("group exchange: accept");
    }
    *accepted = 1;
    if (peer_cred(fd, &c) != 0 || (i = find_peer_by_cred(R, &c)) < 0) {
        vmmt__log(VMMT_LOG_WARN,
                  "group exchange: refused a connection from pid %d uid %u, which is no rank "
                  "of this group",
                  (int)c.pid, (unsigned)c.uid);
        close(fd);
        return VMMT_OK;
    }
    if (R->peers[i].recv_count == 0) {
        close(fd);
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: extra descriptors: rank %d connected to send, but "
                          "announced none for rank %d",
                          R->peers[i].rank, R->self);
    }
    if (R->in[i].fd >= 0 || R->in[i].eof) {
        close(fd);
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: duplicate: rank %d (pid %d) connected a second time "
                          "in one exchange",
                          R->peers[i].rank, (int)c.pid);
    }
    R->in[i].fd = fd;
    return VMMT_OK;
}

static void close_all(int *fds, int n)
{
    for (int k = 0; k < n; k++)
        close_fd(&fds[k]);
}

/* Check a received batch against what the sender announced; the fds are ours either way. */
static int check_batch(struct run *R, int i, const struct vmmt__gx_head *h, ssize_t len, int nfds,
                       int truncated)
{
    struct vmmt__gx_peer *p = &R->peers[i];
    struct in_state *in = &R->in[i];

    if (truncated)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: extra descriptors: rank %d attached more than %d to one "
                          "message",
                          p->rank, VMMT__GX_BATCH_MAX);
    if (len != (ssize_t)sizeof *h || h->magic != VMMT__GX_MAGIC || h->version != VMMT__GX_VERSION)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: rank %d sent a %zd-byte message that is no version-%d "
                          "batch header",
                          p->rank, len, VMMT__GX_VERSION);
    if (h->seq != R->seq || h->from != p->rank || h->to != R->self)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: rank %d's batch is for exchange %u from rank %d to "
                          "rank %d; expected exchange %u from rank %d to rank %d",
                          p->rank, h->seq, (int)h->from, (int)h->to, R->seq, p->rank, R->self);
    if (h->batch < in->batch)
        return vmmt__fail(VMMT_EPROTO, "group exchange: duplicate: rank %d sent batch %u again",
                          p->rank, h->batch);
    if (h->batch > in->batch)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: missing descriptors: rank %d's batch %u arrived, "
                          "batch %u did not",
                          p->rank, h->batch, in->batch);
    if (h->nfds != (uint32_t)nfds)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: rank %d's batch %u says %u descriptors and carries "
                          "%d",
                          p->rank, h->batch, h->nfds, nfds);
    if (h->total != (uint32_t)p->recv_count || in->got + nfds > p->recv_count)
        return vmmt__fail(VMMT_EPROTO,
                          "group exchange: %s descriptors: rank %d sends %u (%d so far, %d in "
                          "this batch), but announced %d through the collective",
                          h->total < (uint32_t)p->recv_count ? "missing" : "extra", p->rank,
                          h->total, in->got, nfds, p->recv_count);
    return VMMT_OK;
}

/* Read what peer i's connection holds; a failure on anything unexpected. */
static int receive(struct run *R, int i)
{
    struct vmmt__gx_peer *p = &R->peers[i];
    struct in_state *in = &R->in[i];

    for (int guard = 0; guard < 1024; guard++) {
        union {
            struct cmsghdr c;
            char space[CMSG_SPACE(sizeof(int) * (VMMT__GX_BATCH_MAX + 8))];
        } ctl;
        struct vmmt__gx_head h;
        char extra[16];
        struct iovec iov[2] = {{&h, sizeof h}, {extra, sizeof extra}};
        int fds[VMMT__GX_BATCH_MAX + 8], nfds = 0, st;
        struct msghdr mh;
        ssize_t n;

        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = 2;
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof ctl.space;
        n = recvmsg(in->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return VMMT_OK;
        if (n < 0) return vmmt__sys_fail("group exchange: receiving from rank %d", p->rank);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t j = 0; j < k && nfds < (int)(sizeof fds / sizeof fds[0]); j++)
                memcpy(&fds[nfds++], CMSG_DATA(c) + j * sizeof(int), sizeof(int));
        }
        if (n == 0 && nfds == 0) {
            /* Kept open until the end: its close would tell the sender we are done. */
            in->eof = 1;
            if (in->got < p->recv_count)
                return vmmt__fail(VMMT_EPROTO,
                                  "group exchange: missing descriptors: rank %d closed its "
                                  "connection after %d of %d",
                                  p->rank, in->got, p->recv_count);
            return VMMT_OK;
        }
        if (in->got == p->recv_count) {
            close_all(fds, nfds);
            return vmmt__fail(VMMT_EPROTO,
                              "group exchange: extra descriptors: rank %d sent more after all %d "
                              "it announced",
                              p->rank, p->recv_count);
        }
        st = check_batch(R, i, &h, n, nfds, (mh.msg_flags & MSG_CTRUNC) != 0);
        if (st != VMMT_OK) {
            close_all(fds, nfds);
            return st;
        }
        memcpy(p->recv_fds + in->got, fds, sizeof(int) * (size_t)nfds);
        in->got += nfds;
        in->batch++;
    }
    return VMMT_OK;
}

/*
 * Peer i closed the connection we sent on: its exchange ended (or it died).
 * Everything it sent us before is queued by now; take that, then judge.
 */
static int peer_left(struct run *R, int i)
{
    struct vmmt__gx_peer *p = &R->peers[i];
    int st, accepted = 1;

    close_fd(&R->out[i].fd);
    for (int k = 0; accepted && k <= R->npeers + 8; k++)
        if ((st = accept_one(R, &accepted)) != VMMT_OK) return st;
    if (R->in[i].fd >= 0 && !R->in[i].eof && (st = receive(R, i)) != VMMT_OK) return st;
    if (R->in[i].eof) return VMMT_OK;
    return vmmt__fail(VMMT_EPROTO,
                      "group exchange: missing descriptors: rank %d left the exchange (it died or "
                      "failed) after sending %d of %d",
                      p->rank, R->in[i].got, p->recv_count);
}

static int all_done(const struct run *R)
{
    for (int i = 0; i < R->npeers; i++) {
        if (R->peers[i].send_count > 0 && !R->out[i].done) return 0;
        if (R->peers[i].recv_count > 0 && !R->in[i].eof) return 0;
    }
    return 1;
}

static int timed_out(const struct run *R)
{
    char msg[700] = "";
    size_t n = 0;

    for (int i = 0; i < R->npeers && n + 1 < sizeof msg; i++) {
        const struct vmmt__gx_peer *p = &R->peers[i];
        if (p->recv_count > 0 && !R->in[i].eof)
            n += (size_t)snprintf(msg + n, sizeof msg - n, " rank %d sent %d of %d descriptors%s;",
                                  p->rank, R->in[i].got, p->recv_count,
                                  R->in[i].fd < 0 ? " (never connected)" : "");
        if (n + 1 < sizeof msg && p->send_count > 0 && !R->out[i].done)
            n += (size_t)snprintf(msg + n, sizeof msg - n, " %d of %u batches sent to rank %d;",
                                  (int)R->out[i].batch, R->out[i].nbatch, p->rank);
    }
    return vmmt__fail(VMMT_ETIMEDOUT,
                      "group exchange: missing descriptors after %d ms:%s a rank died, stalled, "
                      "or the timeout is too short",
                      R->timeout_ms, msg);
}

/* One round: connect, send, accept and receive whatever is ready, waiting at most a slice. */
static int step(struct run *R, struct pollfd *pfd, int *owner)
{
    int n = 0, st = 0, wait;

    for (int i = 0; i < R->npeers; i++) {
        if (R->peers[i].send_count > 0 && !R->out[i].done) {
            if (!R->out[i].connected && (st = try_connect(R, i)) < 0) return st;
            while (R->out[i].connected && !R->out[i].done && (st = send_batch(R, i)) == 1)
                ;
            if (st < 0) return st;
        }
        if (R->out[i].fd >= 0 && !R->out[i].done)
            pfd[n] = (struct pollfd){R->out[i].fd, POLLOUT, 0}, owner[n++] = i;
        else if (R->out[i].fd >= 0 && R->peers[i].recv_count > 0 && !R->in[i].eof)
            pfd[n] = (struct pollfd){R->out[i].fd, POLLRDHUP, 0}, owner[n++] = 2 * R->npeers + i;
        if (R->in[i].fd >= 0 && !R->in[i].eof)
            pfd[n] = (struct pollfd){R->in[i].fd, POLLIN, 0}, owner[n++] = R->npeers + i;
    }
    pfd[n] = (struct pollfd){R->x->listen_fd, POLLIN, 0}, owner[n++] = -1;
    if (all_done(R)) return 1;
    wait = (int)(R->deadline - vmmt__now_ms());
    if (wait <= 0) return timed_out(R);
    if (poll(pfd, (nfds_t)n, wait < POLL_SLICE_MS ? wait : POLL_SLICE_MS) < 0 && errno != EINTR)
        return vmmt__sys_fail("group exchange: poll");
    for (int k = 0; k < n; k++) {
        if (pfd[k].revents == 0) continue;
        int accepted;
        if (owner[k] == -1)
            st = accept_one(R, &accepted);
        else if (owner[k] >= 2 * R->npeers)
            st = peer_left(R, owner[k] - 2 * R->npeers);
        else if (owner[k] >= R->npeers)
            st = receive(R, owner[k] - R->npeers);
        else
            st = VMMT_OK; /* writable: the next step sends */
        if (st != VMMT_OK) return st;
    }
    return 0;
}

int vmmt__gx_run(struct vmmt__gx *x, int self_rank, uint32_t seq, struct vmmt__gx_peer *peers,
                 int npeers, int timeout_ms)
{
    struct run R;
    struct pollfd *pfd = NULL;
    int *owner = NULL, st = VMMT_OK;

    memset(&R, 0, sizeof R);
    R.x = x;
    R.self = self_rank;
    R.seq = seq;
    R.peers = peers;
    R.npeers = npeers;
    R.timeout_ms = timeout_ms;
    R.deadline = vmmt__now_ms() + timeout_ms;
    for (int i = 0; i < npeers; i++)
        for (int k = 0; k < peers[i].recv_count; k++)
            peers[i].recv_fds[k] = -1;
    R.out = calloc((size_t)npeers + 1, sizeof *R.out);
    R.in = calloc((size_t)npeers + 1, sizeof *R.in);
    pfd = calloc(2 * (size_t)npeers + 1, sizeof *pfd);
    owner = calloc(2 * (size_t)npeers + 1, sizeof *owner);
    if (R.out == NULL || R.in == NULL || pfd == NULL || owner == NULL) {
        st = vmmt__fail(VMMT_ENOMEM, "group exchange: no memory for %d peers", npeers);
        goto out;
    }
    for (int i = 0; i < npeers; i++) {
        R.out[i].fd = R.in[i].fd = -1;
        R.out[i].nbatch =
            ((uint32_t)peers[i].send_count + VMMT__GX_BATCH_MAX - 1) / VMMT__GX_BATCH_MAX;
    }
    /* Bounded by the deadline: each step waits at most one slice. */
    while ((st = step(&R, pfd, owner)) == 0)
        ;
    if (st == 1) st = VMMT_OK;
out:
    for (int i = 0; R.out != NULL && R.in != NULL && i < npeers; i++) {
        close_fd(&R.out[i].fd);
        close_fd(&R.in[i].fd);
        if (st != VMMT_OK) close_all(peers[i].recv_fds, peers[i].recv_count);
    }
    free(R.out);
    free(R.in);
    free(pfd);
    free(owner);
    return st;
}
