/*
 * The fd broker's client: fetch a pool's fds from its producer's broker,
 * after making sure the server is that producer, and optionally keep the
 * connection as a liveness link. Wire format and what a client must check:
 * docs/broker.md.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "broker_wire.h"
#include "clock.h"
#include "fork_guard.h"
#include "status.h"

#define PREFIX         "CUDA VMM POSIX FD broker failed: "
#define CLIENT_MAX_FDS (2 * VMMT_BROKER_MAX_FDS) /* a surplus is seen (and closed), not cut off */
#define RETRY_PAUSE_MS 5

struct vmmt__broker_link {
    int fd;
    pid_t peer_pid;
    pthread_mutex_t lock; /* held, and sends */
    uint64_t held[VMMT_BROKER_RANK_WORDS];
    bool warned;
};

static int remaining_ms(int64_t deadline)
{
    int64_t left = deadline - vmmt__now_ms();
    return left < 0 ? 0 : (int)left;
}

uint64_t vmmt__pidns_id(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

void vmmt__broker_expect(uid_t uid, pid_t pid, uint64_t pidns, struct vmmt__broker_peer *out)
{
    out->uid = uid;
    /* A pid means something only in its own namespace. */
    out->pid = pidns != 0 && pidns == vmmt__pidns_id() ? pid : 0;
}

/* Wait for events on fd until deadline: 1 ready, 0 timed out, -1 failed (errno). */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, remaining_ms(deadline));
        if (r > 0) return 1;
        if (r == 0) return 0;
        if (errno != EINTR) return -1;
    }
}

static int connect_failed(const struct vmmt__broker_addr *addr, const char *where, int err)
{
    const char *hint = "is the producer running, and does the descriptor name its broker?";

    /*
     * A path broker's file permissions refuse a user the broker's own check
     * would: the same refusal, so the same status as its VMMT_EPERM reply
     * (VMMT_ECLOSED reads as "the producer is gone").
     */
    if (err == EACCES || err == EPERM)
        return vmmt__fail(VMMT_EPERM,
                          PREFIX "cannot connect to %s: %s; uid %u is refused by the socket "
                                 "file's mode (0600 unless the pool allows other uids) or by "
                                 "its directory's: ask the producer to add this uid to the "
                                 "pool's allowed uids, and to make the directory searchable "
                                 "by it",
                          where, strerror(err), (unsigned)geteuid());
    /*
     * Nobody listens there: the pool was shut down, or its producer exited
     * (a broker stops with its pool). That is the pool's end, as a consumer
     * of one already imported hears it, so the same status: an engine that
     * drops requests of a gone producer (vmmt.ProducerGone) drops these too;
     * before, a pool shut down before this process first imported it was
     * VMMT_ESYS (test_attack_sglang_flush, finding 5).
     */
    if (err == ECONNREFUSED || err == ENOENT) {
        if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT)
            hint = "or, across containers, a descriptor from another network namespace, whose "
                   "abstract sockets are not this one's: give the broker a filesystem path";
        else
            hint = "or the descriptor names another machine's or container's path";
        return vmmt__fail(VMMT_ECLOSED,
                          PREFIX "cannot connect to %s: %s: no broker listens there, so the "
                                 "pool was shut down or its producer exited (%s); drop the "
                                 "request",
                          where, strerror(err), hint);
    }
    return vmmt__fail(VMMT_ESYS, PREFIX "cannot connect to %s: %s; %s", where, strerror(err), hint);
}

static int client_connect(const struct vmmt__broker_addr *addr, const char *where, int64_t deadline,
                          int timeout_ms, int *out)
{
    struct sockaddr_un sun;
    socklen_t sl = vmmt__broker_sockaddr(addr, &sun);
    /* Guarded: a child forked meanwhile must not keep what may become our liveness link. */
    int s = vmmt__guarded_socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0),
        err = 0;
    socklen_t el = sizeof err;

    if (s < 0) return vmmt__sys_fail(PREFIX "socket(AF_UNIX, SOCK_SEQPACKET)");
    /* AF_UNIX answers EAGAIN when the listener's backlog is full: retry until the deadline. */
    while (connect(s, (struct sockaddr *)&sun, sl) != 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN && remaining_ms(deadline) > 0) {
            poll(NULL, 0, remaining_ms(deadline) < 5 ? remaining_ms(deadline) : 5);
            continue;
        }
        if (errno == EAGAIN) {
            vmmt__guarded_close(s);
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "cannot connect to %s within %d ms: its backlog stays full; "
                                     "is the producer alive?",
                              where, timeout_ms);
        }
        if (errno != EINPROGRESS) {
            err = errno;
            vmmt__guarded_close(s);
            return connect_failed(addr, where, err);
        }
        int r = wait_fd(s, POLLOUT, deadline);
        if (r == 0) {
            vmmt__guarded_close(s);
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "cannot connect to %s within %d ms; is the producer alive?",
                              where, timeout_ms);
        }
        if (r < 0 || getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
        if (err != 0) {
            vmmt__guarded_close(s);
            return connect_failed(addr, where, err);
        }
        break;
    }
    *out = s;
    return VMMT_OK;
}

/* The text of a small /proc file, NUL-terminated; false if it cannot be read. */
static bool read_proc(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, cap - 1) : -1;

    if (fd >= 0) close(fd);
    buf[n > 0 ? n : 0] = '\0';
    return n > 0;
}

static bool same_userns(pid_t pid)
{
    char path[64];
    struct stat a, b;

    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
    return stat("/proc/self/ns/user", &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino &&
           a.st_dev == b.st_dev;
}

/*
 * Why a server of another uid than the descriptor's may be the producer
 * after all: a user namespace between the two maps the one uid to the other
 * (a rootless producer, a consumer in a container). Empty when no map says so.
 */
static void userns_hint(uint32_t named, uid_t seen, pid_t pid, char *buf, size_t cap)
{
    char map[4096], path[64], overflow[16] = "65534";
    uint32_t m;

    buf[0] = '\0';
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
    /*
     * Read from another user namespace, a process's map takes its uids to
     * ours, whichever namespace is the other's parent. Where its pid is not
     * visible (another pid namespace) our own map is all there is.
     */
    if (pid > 0 && !same_userns(pid) && read_proc(path, map, sizeof map) &&
        vmmt__uid_map_find(map, 1, named, &m) && m == seen) {
        snprintf(buf, cap,
                 "the server is in another user namespace, where uid %u (the descriptor's) is "
                 "uid %u here (%s)",
                 named, (unsigned)seen, path);
        return;
    }
    if (!read_proc("/proc/self/uid_map", map, sizeof map)) return;
    if (vmmt__uid_map_find(map, 0, named, &m)) {
        if (m == seen && m != named)
            snprintf(buf, cap,
                     "this process is in a user namespace where uid %u outside it (the "
                     "descriptor's) is uid %u (/proc/self/uid_map)",
                     named, (unsigned)seen);
        return;
    }
    read_proc("/proc/sys/kernel/overflowuid", overflow, sizeof overflow);
    if (seen == (uid_t)strtoul(overflow, NULL, 10))
        snprintf(buf, cap,
                 "the descriptor's uid %u has no mapping in this process's user namespace "
                 "(/proc/self/uid_map), where the server's uid shows as the overflow uid %u",
                 named, (unsigned)seen);
}

/*
 * Is the server the producer? SO_PEERCRED on a connected socket gives the
 * credentials of the process that created the listener: an impostor bound at
 * the producer's address (a name freed when the producer exited, a stale
 * path) has another uid or pid, and is told nothing, not even the pool id.
 */
static int check_server(int s, const struct vmmt__broker_peer *expect, const char *where,
                        pid_t *pid_out)
{
    struct ucred cred;
    socklen_t cl = sizeof cred;
    char hint[320] = "";

    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0)
        return vmmt__sys_fail(PREFIX "cannot read the credentials of the server at %s", where);
    *pid_out = cred.pid;
    if (cred.uid == expect->uid && (expect->pid == 0 || cred.pid == expect->pid)) return VMMT_OK;
    if (cred.uid != expect->uid) userns_hint(expect->uid, cred.uid, cred.pid, hint, sizeof hint);
    /* Not "has the producer exited?": the fix is the deployment's, not a retry. */
    if (hint[0] != '\0')
        return vmmt__fail(VMMT_EPERM,
                          PREFIX "the server at %s runs as uid %u pid %d, the descriptor names "
                                 "uid %u%s%.0d: %s. Uids are compared as this process sees "
                                 "them, so it is refused: run the producer and its consumers in "
                                 "one user namespace, or map the producer's uid to the same "
                                 "number in both (and add this process's uid to the pool's "
                                 "allowed uids if it differs)",
                          where, (unsigned)cred.uid, (int)cred.pid, (unsigned)expect->uid,
                          expect->pid != 0 ? " pid " : "", (int)expect->pid, hint);
    return vmmt__fail(VMMT_EPERM,
                      PREFIX "the server at %s is not the producer: it runs as uid %u pid %d, the "
                             "descriptor names uid %u%s%.0d; another process holds the "
                             "producer's address (has the producer exited?), refusing it",
                      where, (unsigned)cred.uid, (int)cred.pid, (unsigned)expect->uid,
                      expect->pid != 0 ? " pid " : "", (int)expect->pid);
}

static int client_send(int s, const uint8_t pool_id[16], uint16_t flags, const char *where,
                       int64_t deadline, int timeout_ms)
{
    uint8_t req[VMMT__BREQ_SIZE];

    memcpy(req, VMMT__BREQ_MAGIC, 4);
    vmmt__put_u16(req + 4, VMMT__BROKER_PROTO);
    vmmt__put_u16(req + 6, flags);
    memcpy(req + 8, pool_id, 16);
    for (;;) {
        if (send(s, req, sizeof req, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof req)
            return VMMT_OK;
        if (errno == EINTR) continue;
        /* A broker refuses a peer at accept and closes: its refusal is waiting to be read. */
        if (errno == EPIPE || errno == ECONNRESET) return VMMT_OK;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return vmmt__sys_fail(PREFIX "cannot send the request to %s", where);
        int r = wait_fd(s, POLLOUT, deadline);
        if (r == 0)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "cannot send to %s within %d ms; is the producer alive?",
                              where, timeout_ms);
        if (r < 0) return vmmt__sys_fail(PREFIX "poll on the socket to %s", where);
    }
}

struct reply {
    uint8_t buf[VMMT__BREP_MAX + 1];
    ssize_t len;
    int msg_flags;
    int fds[CLIENT_MAX_FDS];
    int nfds;
};

/* Take every fd out of the control data so that none can leak, whatever the reply says. */
static void collect_fds(struct msghdr *mh, struct reply *rp)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c != NULL; c = CMSG_NXTHDR(mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (rp->nfds < CLIENT_MAX_FDS)
                rp->fds[rp->nfds++] = fd;
            else
                close(fd);
        }
    }
}

static int client_recv(int s, const char *where, int64_t deadline, int timeout_ms, struct reply *rp)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * CLIENT_MAX_FDS)];
    } ctl;
    struct iovec iov = {.iov_base = rp->buf, .iov_len = sizeof rp->buf};
    struct msghdr mh;
    bool reset = false;

    for (;;) {
        int r = wait_fd(s, POLLIN, deadline);
        if (r == 0)
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "no reply from %s within %d ms; is the producer alive?", where,
                              timeout_ms);
        if (r < 0) return vmmt__sys_fail(PREFIX "poll on the socket to %s", where);
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof ctl.space;
        rp->len = recvmsg(s, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (rp->len >= 0) break;
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        /*
         * The broker closed with our request unread (it refused us at accept):
         * the kernel reports the reset once, ahead of the refusal still queued
         * for us; read again for it. Nothing queued reads as an empty reply.
         */
        if (errno == ECONNRESET && !reset) {
            reset = true;
            continue;
        }
        if (errno == ECONNRESET) {
            rp->len = 0;
            return VMMT_OK;
        }
        return vmmt__sys_fail(PREFIX "cannot read the reply from %s", where);
    }
    rp->msg_flags = mh.msg_flags;
    collect_fds(&mh, rp);
    return VMMT_OK;
}

/* Replace what is not printable: the peer's text ends up in our messages and logs. */
static void clean_text(char *dst, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (src[i] >= 0x20 && src[i] < 0x7f) ? (char)src[i] : '?';
    dst[n] = '\0';
}

/*
 * The text after a header of `head` bytes, sanitised, when the reply's length
 * agrees with its msg_len; false otherwise. Every version puts msg_len at 12.
 */
static bool reply_text(const struct reply *rp, size_t head, char msg[VMMT__BREP_MSG_MAX + 1])
{
    uint16_t mlen = vmmt__get_u16(rp->buf + 12);

    msg[0] = '\0';
    if (mlen > VMMT__BREP_MSG_MAX || (size_t)rp->len != head + mlen) return false;
    clean_text(msg, rp->buf + head, mlen);
    return true;
}

static int no_fds(const struct reply *rp, const char *where, const uint8_t pool_id[16])
{
    char id[9];

    return vmmt__fail(VMMT_EPROTO,
                      PREFIX "broker returned no file descriptor for pool %s at %s: %s",
                      vmmt__short_id(pool_id, id), where,
                      (rp->msg_flags & MSG_CTRUNC)
                          ? "the kernel dropped it (MSG_CTRUNC); is this process at its "
                            "open-file limit (ulimit -n)?"
                          : "the success reply carried no SCM_RIGHTS data; is the server a "
                            "vmmt broker?");
}

/* VMMT_OK when rp is a success reply for pool_id carrying exactly `want` fds. */
static int reply_status(const struct reply *rp, const char *where, const uint8_t pool_id[16],
                        int want)
{
    char msg[VMMT__BREP_MSG_MAX + 1], mine[9], theirs[9];
    unsigned version, announced;
    int32_t status;

    if (rp->len == 0)
        return vmmt__fail(VMMT_ECLOSED,
                          PREFIX "%s closed the connection without a reply; the producer may be "
                                 "stopping, or it gave up on this client",
                          where);
    if ((rp->msg_flags & MSG_TRUNC) || rp->len < 14 || memcmp(rp->buf, VMMT__BREP_MAGIC, 4) != 0)
        return vmmt__fail(
            VMMT_EPROTO, PREFIX "malformed reply from %s (%zd bytes, %s); is it a vmmt broker?",
            where, rp->len,
            rp->len >= 4 && memcmp(rp->buf, VMMT__BREP_MAGIC, 4) == 0 ? "bad length"
                                                                      : "no VMBR magic");
    /* Before anything else in the header: the other fields may mean something else there. */
    version = vmmt__get_u16(rp->buf + 4);
    if (version != VMMT__BROKER_PROTO) {
        /* Its text, if it has one, is likely its own version complaint: worth passing on.
         * Versions 1 and 2 had a 14-byte header. */
        bool said = reply_text(rp, version < VMMT__BROKER_PROTO ? 14 : VMMT__BREP_HEAD, msg) &&
                    msg[0] != '\0';
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "%s speaks broker protocol version %u, this build speaks %d: use "
                                 "the same vmmt version on producer and consumers%s%s%s",
                          where, version, VMMT__BROKER_PROTO, said ? " (it said: \"" : "",
                          said ? msg : "", said ? "\")" : "");
    }
    if (rp->len < VMMT__BREP_HEAD || !reply_text(rp, VMMT__BREP_HEAD, msg))
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "malformed reply from %s: message length %u in a %zd-byte reply",
                          where, vmmt__get_u16(rp->buf + 12), rp->len);
    status = (int32_t)vmmt__get_u32(rp->buf + 8);
    if (status < VMMT_ETOOBIG || status > VMMT_OK)
        return vmmt__fail(VMMT_EPROTO, PREFIX "%s replied with unknown status %d: %s", where,
                          (int)status, msg);
    if (status != VMMT_OK) return vmmt__fail(status, PREFIX "%s", msg);
    if (memcmp(rp->buf + 14, pool_id, 16) != 0)
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "%s serves pool %s, not pool %s that the descriptor names; "
                                 "refusing its file descriptors",
                          where, vmmt__short_id(rp->buf + 14, theirs),
                          vmmt__short_id(pool_id, mine));
    if (rp->nfds == 0) return no_fds(rp, where, pool_id);
    announced = rp->buf[6];
    if (announced < 1 || announced > VMMT_BROKER_MAX_FDS)
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "malformed reply from %s: it announces %u file descriptors; a "
                                 "broker sends 1 to %d",
                          where, announced, VMMT_BROKER_MAX_FDS);
    if ((unsigned)rp->nfds != announced)
        return vmmt__fail(VMMT_EPROTO, PREFIX "%s announced %u file descriptor(s) but %d arrived%s",
                          where, announced, rp->nfds,
                          (rp->msg_flags & MSG_CTRUNC)
                              ? "; the kernel dropped some (MSG_CTRUNC): is this process at its "
                                "open-file limit (ulimit -n)?"
                              : "");
    if (rp->nfds != want)
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "broker returned %d file descriptor(s), expected %d, from %s; "
                                 "use the same vmmt version on producer and consumers",
                          rp->nfds, want, where);
    return VMMT_OK;
}

int vmmt__brep_check(const uint8_t *buf, long len, int msg_flags, int nfds,
                     const uint8_t pool_id[16], int want, const char *where)
{
    struct reply rp;

    memset(&rp, 0, sizeof rp);
    if (buf == NULL || len < 0 || pool_id == NULL || where == NULL)
        return vmmt__fail(VMMT_EINVAL, PREFIX "reply check: buf, pool_id and where are required");
    /* What recvmsg would have done with a longer packet: cut it and say so. */
    if ((size_t)len > sizeof rp.buf) {
        len = (long)sizeof rp.buf;
        msg_flags |= MSG_TRUNC;
    }
    memcpy(rp.buf, buf, (size_t)len);
    rp.len = len;
    rp.msg_flags = msg_flags;
    rp.nfds = nfds < 0 ? 0 : nfds;
    return reply_status(&rp, where, pool_id, want);
}

/* One connection, request and reply; *s stays open for the caller. */
static int attempt(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                   const struct vmmt__broker_peer *expect, const char *where, int64_t deadline,
                   int timeout_ms, int want, uint16_t flags, struct reply *rp, int *s,
                   pid_t *peer_pid)
{
    int st;

    memset(rp, 0, sizeof *rp);
    st = client_connect(addr, where, deadline, timeout_ms, s);
    if (st == VMMT_OK) st = check_server(*s, expect, where, peer_pid);
    if (st == VMMT_OK) st = client_send(*s, pool_id, flags, where, deadline, timeout_ms);
    if (st == VMMT_OK) st = client_recv(*s, where, deadline, timeout_ms, rp);
    if (st == VMMT_OK) st = reply_status(rp, where, pool_id, want);
    return st;
}

static int new_link(int s, pid_t peer_pid, struct vmmt__broker_link **out)
{
    struct vmmt__broker_link *l = calloc(1, sizeof *l);

    if (l == NULL) return vmmt__fail(VMMT_ENOMEM, PREFIX "no memory for a liveness link");
    l->fd = s;
    l->peer_pid = peer_pid;
    pthread_mutex_init(&l->lock, NULL);
    *out = l;
    return VMMT_OK;
}

/*
 * Liveness without pidfds works from the links' hang-ups alone, and loses
 * what only a pidfd gives: an exit that is certain (a hang-up can come
 * before the kernel has torn the dying process's GPU context down). Said
 * once per process, by whichever side finds it first.
 */
static void warn_degraded(int by_option, int by_open)
{
    static atomic_flag warned = ATOMIC_FLAG_INIT;

    if (atomic_flag_test_and_set(&warned)) return;
    vmmt__log(VMMT_LOG_WARN,
              "liveness runs without pidfds in this process (SO_PEERPIDFD: %s; pidfd_open: %s): "
              "the death of a producer or consumer process is told by the hang-up of its "
              "liveness link alone, which may come before its GPU context is torn down; allow "
              "pidfd_open (seccomp) or use Linux 6.5 or later for the exit itself (warned once "
              "per process)",
              strerror(by_option),
              by_open ? strerror(by_open)
                      : "the peer's pid is not visible "
                        "in this pid namespace");
}

/*
 * The process at the other end of a connected socket, as a pidfd, or -1.
 * SO_PEERPIDFD (Linux 6.5) names the very process; before it, SO_PEERCRED's
 * pid opened at once, while the connection is fresh (a pid recycled in the
 * microseconds between is not a practical risk). 0 from SO_PEERCRED means a
 * peer in a pid namespace this process cannot see: no pidfd then.
 */
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
int vmmt__broker_peer_pidfd(int sock)
{
    struct ucred cr;
    socklen_t len;
    int fd = -1, by_option, by_open = 0;

    len = sizeof fd;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) == 0 && fd >= 0) return fd;
    by_option = errno;
    len = sizeof cr;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) return -1;
    if (cr.pid > 0) {
        fd = (int)syscall(SYS_pidfd_open, (pid_t)cr.pid, 0);
        if (fd >= 0) return fd;
        by_open = errno;
        /* Exited already: its socket tells as much; nothing is missing here. */
        if (by_open == ESRCH) return -1;
    }
    warn_degraded(by_option, by_open);
    return -1;
}

static int fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                 const struct vmmt__broker_peer *expect, int timeout_ms, int *fds_out, int want,
                 struct vmmt__broker_link **link, int *pidfd_out)
{
    char where[4 * sizeof addr->name + 2];
    struct reply rp;
    int64_t deadline;
    pid_t peer_pid = 0;
    int s = -1, st;

    if (fds_out != NULL)
        for (int i = 0; i < want && i < VMMT_BROKER_MAX_FDS; i++)
            fds_out[i] = -1;
    if (link != NULL) *link = NULL;
    if (addr == NULL || pool_id == NULL || fds_out == NULL || expect == NULL)
        return vmmt__fail(VMMT_EINVAL, PREFIX "addr, pool_id, expect and fds_out must not be NULL");
    if (want < 1 || want > VMMT_BROKER_MAX_FDS)
        return vmmt__fail(VMMT_EINVAL, PREFIX "want is %d; a broker serves 1 to %d fds", want,
                          VMMT_BROKER_MAX_FDS);
    if (timeout_ms < 0)
        return vmmt__fail(VMMT_EINVAL,
                          PREFIX "timeout_ms is %d; use a positive number, or 0 "
                                 "for %d",
                          timeout_ms, VMMT_BROKER_DEFAULT_TIMEOUT_MS);
    if (timeout_ms == 0) timeout_ms = VMMT_BROKER_DEFAULT_TIMEOUT_MS;
    st = vmmt__broker_addr_check(addr);
    if (st != VMMT_OK) return vmmt__wrap(st, PREFIX "bad address");
    vmmt__broker_addr_format(addr, where, sizeof where);
    deadline = vmmt__now_ms() + timeout_ms;

    /*
     * A broker flooded with idle connections closes the oldest of whoever
     * holds the most; should that be us (we connected but were slow to send),
     * a new connection within our deadline is served.
     */
    for (;;) {
        st = attempt(addr, pool_id, expect, where, deadline, timeout_ms, want,
                     link != NULL ? VMMT__BREQ_HOLD : 0, &rp, &s, &peer_pid);
        /* Closed after connecting, with no reply: try again; nobody listening: do not. */
        if (st != VMMT_ECLOSED || s < 0 || rp.len != 0 || remaining_ms(deadline) <= RETRY_PAUSE_MS)
            break;
        for (int i = 0; i < rp.nfds; i++)
            close(rp.fds[i]);
        vmmt__guarded_close(s);
        s = -1;
        poll(NULL, 0, RETRY_PAUSE_MS);
    }
    /* The server passed check_server: the pidfd is the producer's. */
    if (st == VMMT_OK && pidfd_out != NULL) *pidfd_out = vmmt__broker_peer_pidfd(s);
    if (st == VMMT_OK && link != NULL && (rp.buf[7] & VMMT__BREP_HELD)) {
        st = new_link(s, peer_pid, link);
        if (st == VMMT_OK) s = -1;
    }
    if (st == VMMT_OK) {
        /* Handed over: the caller owns them now, so the cleanup below must not close them. */
        memcpy(fds_out, rp.fds, sizeof(int) * (size_t)want);
        rp.nfds = 0;
    } else if (pidfd_out != NULL && *pidfd_out >= 0) {
        close(*pidfd_out);
        *pidfd_out = -1;
    }
    for (int i = 0; i < rp.nfds; i++)
        close(rp.fds[i]);
    vmmt__guarded_close(s);
    return st;
}

int vmmt__broker_fetch_fds(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                           const struct vmmt__broker_peer *expect, int timeout_ms, int *fds_out,
                           int want, struct vmmt__broker_link **link)
{
    return fetch(addr, pool_id, expect, timeout_ms, fds_out, want, link, NULL);
}

int vmmt__broker_fetch_fds_pidfd(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                                 const struct vmmt__broker_peer *expect, int timeout_ms,
                                 int *fds_out, int want, struct vmmt__broker_link **link,
                                 int *pidfd_out)
{
    if (pidfd_out != NULL) *pidfd_out = -1;
    return fetch(addr, pool_id, expect, timeout_ms, fds_out, want, link, pidfd_out);
}

int vmmt__broker_fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                       const struct vmmt__broker_peer *expect, int timeout_ms, int *fd_out)
{
    /* Checked here so that the message names this function's parameter. */
    if (fd_out == NULL)
        return vmmt__fail(VMMT_EINVAL, PREFIX "addr, pool_id, expect and fd_out must not be NULL");
    return vmmt__broker_fetch_fds(addr, pool_id, expect, timeout_ms, fd_out, 1, NULL);
}

/* ------------------------------------------------------------------- link */

static int link_send(struct vmmt__broker_link *l, uint16_t type, uint32_t first, uint32_t count)
{
    uint8_t m[VMMT__BMSG_SIZE];

    memcpy(m, VMMT__BMSG_MAGIC, 4);
    vmmt__put_u16(m + 4, VMMT__BROKER_PROTO);
    vmmt__put_u16(m + 6, type);
    vmmt__put_u32(m + 8, first);
    vmmt__put_u32(m + 12, count);
    /* Never block a consume: the broker reads at once, so a full buffer means it is stuck. */
    if (send(l->fd, m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof m) return VMMT_OK;
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
        return vmmt__fail(VMMT_ECLOSED,
                          "the producer (pid %d) closed its liveness link: it exited or shut "
                          "its pool down",
                          (int)l->peer_pid);
    return vmmt__sys_fail("telling the producer (pid %d) which ranks this process consumes for",
                          (int)l->peer_pid);
}

int vmmt__broker_link_hold(struct vmmt__broker_link *l, uint32_t first, uint32_t count)
{
    bool news = false;
    int st = VMMT_OK;

    if (l == NULL) return VMMT_OK;
    if (count == 0 || first >= VMMT_BROKER_MAX_RANKS || count > VMMT_BROKER_MAX_RANKS - first)
        return vmmt__fail(VMMT_EINVAL, "ranks [%u, +%u) are outside 0..%d", first, count,
                          VMMT_BROKER_MAX_RANKS - 1);
    pthread_mutex_lock(&l->lock);
    for (uint32_t r = first; r < first + count && !news; r++)
        news = !(l->held[r / 64] & (1ull << (r % 64)));
    if (news) st = link_send(l, VMMT__BMSG_HOLD, first, count);
    if (news && st == VMMT_OK)
        for (uint32_t r = first; r < first + count; r++)
            l->held[r / 64] |= 1ull << (r % 64);
    pthread_mutex_unlock(&l->lock);
    return st;
}

int vmmt__broker_link_fd(const struct vmmt__broker_link *l)
{
    return l ? l->fd : -1;
}

pid_t vmmt__broker_link_peer_pid(const struct vmmt__broker_link *l)
{
    return l ? l->peer_pid : 0;
}

int vmmt__broker_link_peer_gone(const struct vmmt__broker_link *l)
{
    struct pollfd p = {.fd = l ? l->fd : -1, .events = POLLIN};

    if (l == NULL) return 0;
    /* The broker never writes on a link: readable means end-of-file or reset. */
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

void vmmt__broker_link_close(struct vmmt__broker_link *l, int goodbye)
{
    if (l == NULL) return;
    if (goodbye) {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        pthread_mutex_lock(&l->lock);
        (void)link_send(l, VMMT__BMSG_BYE, 0, 0); /* the producer may be gone: nothing to do */
        pthread_mutex_unlock(&l->lock);
        vmmt__error_restore(&e);
    }
    vmmt__guarded_close(l->fd);
    pthread_mutex_destroy(&l->lock);
    free(l);
}
