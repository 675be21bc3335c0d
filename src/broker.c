/*
 * The fd broker. The server is one thread polling a listening socket, an
 * eventfd for stop, and at most VMMT_BROKER_MAX_PENDING accepted connections,
 * each with its own deadline; every socket is non-blocking so that no client,
 * however slow or hostile, can hold the thread. One request per connection:
 * the thread answers (or times out) and closes. Wire format: docs/broker.md.
 */
#include "broker.h"

#include <errno.h>
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
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "status.h"

#define PREFIX "CUDA VMM POSIX FD broker failed: "

/*
 * Every version's request is 24 bytes, so that a broker of another version
 * reaches its version check (not its length check) and names both versions.
 * A client takes more fds than a broker may send, so that a surplus is seen
 * (and closed) rather than cut off.
 */
#define PROTO_VERSION     2
#define REQ_SIZE          24 /* magic 4, version 2, reserved 2, pool_id 16 */
#define REPLY_HEAD        14 /* magic 4, version 2, nfds 1, reserved 1, status 4, msg_len 2 */
#define REPLY_MSG_MAX     200
#define REPLY_MAX         (REPLY_HEAD + REPLY_MSG_MAX)
#define CLIENT_MAX_FDS    (2 * VMMT_BROKER_MAX_FDS)
#define STOP_JOIN_MS      5000
#define ACCEPT_BACKOFF_MS 100

static const char REQ_MAGIC[4] = {'V', 'M', 'B', 'Q'};
static const char REPLY_MAGIC[4] = {'V', 'M', 'B', 'R'};

struct conn {
    int fd;
    int64_t deadline;
};

struct vmmt__broker {
    int served_fds[VMMT_BROKER_MAX_FDS];
    int nserved;
    uint8_t pool_id[16];
    uid_t euid;
    uid_t *allowed;
    size_t allowed_count;
    int timeout_ms;

    int listen_fd;
    int wake_fd;
    struct vmmt__broker_addr addr;
    bool path_bound;
    dev_t path_dev; /* identity of the socket file we created, so stop unlinks only ours */
    ino_t path_ino;

    pthread_t thread;
    struct conn conns[VMMT_BROKER_MAX_PENDING];
    int nconns;
    int64_t accept_resume; /* monotonic ms; listener ignored before this */

    _Atomic uint64_t served, refused_peer, refused_pool, timed_out, malformed;
};

/* ---------------------------------------------------------------- helpers */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int remaining_ms(int64_t deadline)
{
    int64_t left = deadline - now_ms();
    return left < 0 ? 0 : (int)left;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static void put_i32(uint8_t *p, int32_t v)
{
    uint32_t u = (uint32_t)v;
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(u >> (8 * i));
}

static int32_t get_i32(const uint8_t *p)
{
    uint32_t u = 0;
    for (int i = 0; i < 4; i++)
        u |= (uint32_t)p[i] << (8 * i);
    return (int32_t)u;
}

/* The first four bytes in hex: enough to tell pools apart in a message. */
static const char *short_id(const uint8_t id[16], char buf[9])
{
    snprintf(buf, 9, "%02x%02x%02x%02x", id[0], id[1], id[2], id[3]);
    return buf;
}

const char *vmmt__broker_addr_format(const struct vmmt__broker_addr *addr, char *buf, size_t cap)
{
    size_t n = 0;

    if (cap == 0) return buf;
    buf[0] = '\0';
    if (addr == NULL) return buf;
    if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT && cap > 1) buf[n++] = '@';
    for (size_t i = 0; i < addr->len && i < sizeof addr->name && n + 1 < cap; i++) {
        unsigned char c = (unsigned char)addr->name[i];
        if (c >= 0x20 && c < 0x7f) {
            buf[n++] = (char)c;
        } else if (n + 5 < cap) {
            snprintf(buf + n, 5, "\\x%02x", c);
            n += 4;
        } else {
            break;
        }
    }
    buf[n] = '\0';
    return buf;
}

int vmmt__broker_addr_parse(const char *text, struct vmmt__broker_addr *out)
{
    size_t n;
    int kind = VMMT_BROKER_ADDR_PATH;

    if (text == NULL || out == NULL)
        return vmmt__fail(VMMT_EINVAL, "broker address: text and out must not be NULL");
    if (text[0] == '@') {
        kind = VMMT_BROKER_ADDR_ABSTRACT;
        text++;
    }
    n = strlen(text);
    if (n == 0 || n > sizeof out->name - 1)
        return vmmt__fail(VMMT_EINVAL,
                          "broker address \"%s\" has %zu bytes; a name needs 1 to %zu bytes", text,
                          n, sizeof out->name - 1);
    memset(out, 0, sizeof *out);
    out->kind = (uint8_t)kind;
    out->len = (uint8_t)n;
    memcpy(out->name, text, n);
    return VMMT_OK;
}

static int addr_check(const struct vmmt__broker_addr *addr)
{
    if (addr->kind != VMMT_BROKER_ADDR_ABSTRACT && addr->kind != VMMT_BROKER_ADDR_PATH)
        return vmmt__fail(VMMT_EINVAL,
                          "broker address kind %u is unknown; expected 0 (abstract) or 1 (path)",
                          addr->kind);
    if (addr->len == 0 || addr->len > sizeof addr->name - 1)
        return vmmt__fail(VMMT_EINVAL, "broker address length %u is outside 1..%zu", addr->len,
                          sizeof addr->name - 1);
    /* A path with a NUL inside would name a different file than the one printed. */
    if (addr->kind == VMMT_BROKER_ADDR_PATH && memchr(addr->name, '\0', addr->len) != NULL)
        return vmmt__fail(VMMT_EINVAL, "broker path contains a NUL byte");
    return VMMT_OK;
}

static socklen_t to_sockaddr(const struct vmmt__broker_addr *addr, struct sockaddr_un *sun)
{
    memset(sun, 0, sizeof *sun);
    sun->sun_family = AF_UNIX;
    if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT) {
        memcpy(sun->sun_path + 1, addr->name, addr->len);
        return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + addr->len);
    }
    memcpy(sun->sun_path, addr->name, addr->len);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + addr->len + 1);
}

static int new_socket(void)
{
    return socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
}

/* ------------------------------------------------------------------ server */

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

/*
 * Best effort: the peer may be gone, or hostile and not reading; either way
 * the connection is closed next, so a failure is only logged.
 */
static bool send_reply(int cfd, int status, const char *msg, const int *fds, int nfds)
{
    uint8_t buf[REPLY_MAX];
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * VMMT_BROKER_MAX_FDS)];
    } ctl;
    struct iovec iov;
    struct msghdr mh;
    size_t len = msg ? strlen(msg) : 0;

    if (len > REPLY_MSG_MAX) len = REPLY_MSG_MAX;
    memcpy(buf, REPLY_MAGIC, 4);
    put_u16(buf + 4, PROTO_VERSION);
    buf[6] = (uint8_t)nfds;
    buf[7] = 0;
    put_i32(buf + 8, status);
    put_u16(buf + 12, (uint16_t)len);
    if (len > 0) memcpy(buf + REPLY_HEAD, msg, len);

    iov.iov_base = buf;
    iov.iov_len = REPLY_HEAD + len;
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

/* Why a request is malformed, or NULL when it is a request of our version. */
static const char *request_problem(const uint8_t *req, ssize_t n, char *why, size_t cap)
{
    if (n != REQ_SIZE) {
        snprintf(why, cap, "request of %zd bytes; version %d requests have %d", n, PROTO_VERSION,
                 REQ_SIZE);
    } else if (memcmp(req, REQ_MAGIC, 4) != 0) {
        snprintf(why, cap, "request does not start with \"VMBQ\"; is the client a vmmt consumer?");
    } else if (get_u16(req + 4) != PROTO_VERSION) {
        snprintf(why, cap,
                 "request version %u is not supported; this broker speaks version %d: use the "
                 "same vmmt version on producer and consumers",
                 get_u16(req + 4), PROTO_VERSION);
    } else if (get_u16(req + 6) != 0) {
        snprintf(why, cap, "request reserved field is %u; it must be 0", get_u16(req + 6));
    } else {
        return NULL;
    }
    return why;
}

/* Answer one readable connection. Returns false while no request has arrived yet. */
static bool serve_conn(struct vmmt__broker *b, int cfd)
{
    uint8_t req[REQ_SIZE + 1];
    char msg[REPLY_MSG_MAX + 1], mine[9], theirs[9];
    struct ucred cred;
    socklen_t cl = sizeof cred;
    ssize_t n;

    /* No control buffer: fds a hostile client attaches are discarded by the kernel. */
    n = recv(cfd, req, sizeof req, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    if (n < 0) {
        count(&b->malformed);
        return true;
    }
    /* Credentials first: an unknown peer learns nothing but that it is refused. */
    if (getsockopt(cfd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
        count(&b->refused_peer);
        return true;
    }
    short_id(b->pool_id, mine);
    if (!uid_allowed(b, cred.uid)) {
        snprintf(msg, sizeof msg,
                 "uid %u is not allowed by the vmmt broker of pool %s; add it to the pool's "
                 "allowed uids",
                 (unsigned)cred.uid, mine);
        send_reply(cfd, VMMT_EPERM, msg, NULL, 0);
        count(&b->refused_peer);
        return true;
    }
    if (request_problem(req, n, msg, sizeof msg) != NULL) {
        send_reply(cfd, VMMT_EPROTO, msg, NULL, 0);
        count(&b->malformed);
        return true;
    }
    if (memcmp(req + 8, b->pool_id, 16) != 0) {
        snprintf(msg, sizeof msg,
                 "pool %s is not served here: this vmmt broker serves pool %s; check the "
                 "descriptor's pool id and broker address",
                 short_id(req + 8, theirs), mine);
        send_reply(cfd, VMMT_EINVAL, msg, NULL, 0);
        count(&b->refused_pool);
        return true;
    }
    if (send_reply(cfd, VMMT_OK, NULL, b->served_fds, b->nserved)) count(&b->served);
    return true;
}

static void drop_conn(struct vmmt__broker *b, int i)
{
    close(b->conns[i].fd);
    b->conns[i] = b->conns[--b->nconns];
}

static void accept_new(struct vmmt__broker *b, int64_t now)
{
    while (b->nconns < VMMT_BROKER_MAX_PENDING) {
        int cfd = accept4(b->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd >= 0) {
            /* A client sends its request right after connecting: it is usually
             * here already, and answering now saves a round through poll. */
            if (serve_conn(b, cfd)) {
                close(cfd);
                continue;
            }
            b->conns[b->nconns].fd = cfd;
            b->conns[b->nconns].deadline = now + b->timeout_ms;
            b->nconns++;
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

static void expire_conns(struct vmmt__broker *b, int64_t now)
{
    for (int i = b->nconns - 1; i >= 0; i--) {
        if (b->conns[i].deadline <= now) {
            drop_conn(b, i);
            count(&b->timed_out);
        }
    }
}

/* Poll timeout: until the nearest deadline or the end of an accept back-off. */
static int next_timeout(const struct vmmt__broker *b, int64_t now)
{
    int64_t next = INT64_MAX;
    for (int i = 0; i < b->nconns; i++)
        if (b->conns[i].deadline < next) next = b->conns[i].deadline;
    if (b->accept_resume > now && b->accept_resume < next) next = b->accept_resume;
    if (next == INT64_MAX) return -1;
    return next <= now ? 0 : (int)(next - now);
}

/* One round of poll; returns false when stop was asked for. */
static bool serve_round(struct vmmt__broker *b)
{
    struct pollfd pfd[2 + VMMT_BROKER_MAX_PENDING];
    int fds_of[VMMT_BROKER_MAX_PENDING];
    int64_t now = now_ms();
    int n = b->nconns, r;
    bool listening = b->nconns < VMMT_BROKER_MAX_PENDING && now >= b->accept_resume;

    pfd[0] = (struct pollfd){.fd = b->wake_fd, .events = POLLIN};
    /* A negative fd makes poll skip the listener while we are full or backing off. */
    pfd[1] = (struct pollfd){.fd = listening ? b->listen_fd : -1, .events = POLLIN};
    for (int i = 0; i < n; i++) {
        pfd[2 + i] = (struct pollfd){.fd = b->conns[i].fd, .events = POLLIN};
        fds_of[i] = b->conns[i].fd;
    }
    r = poll(pfd, (nfds_t)(2 + n), next_timeout(b, now));
    if (r < 0 && errno != EINTR) {
        vmmt__log(VMMT_LOG_WARN, "fd broker: poll failed: %s; retrying", strerror(errno));
        /* Sleep a little rather than spin; stop still wakes us within that. */
        poll(pfd, 1, 10);
    }
    if (pfd[0].revents != 0 && r > 0) return false;
    now = now_ms();
    /* drop_conn reorders the table, so find each connection again by its fd. */
    for (int i = n - 1; i >= 0; i--) {
        if (r <= 0 || pfd[2 + i].revents == 0) continue;
        int j = b->nconns - 1;
        while (j >= 0 && b->conns[j].fd != fds_of[i])
            j--;
        if (j < 0) continue;
        if (pfd[2 + i].revents & POLLIN) {
            if (serve_conn(b, fds_of[i])) drop_conn(b, j);
        } else {
            /* Hung up or failed before sending anything. */
            drop_conn(b, j);
            count(&b->malformed);
        }
    }
    expire_conns(b, now);
    if (r > 0 && (pfd[1].revents & POLLIN)) accept_new(b, now);
    return true;
}

static void *broker_main(void *arg)
{
    struct vmmt__broker *b = arg;
    while (serve_round(b)) {
    }
    while (b->nconns > 0)
        drop_conn(b, b->nconns - 1);
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
        if (bind(s, (struct sockaddr *)&sun, to_sockaddr(&b->addr, &sun)) == 0) return VMMT_OK;
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
    r = connect(probe, (struct sockaddr *)&sun, to_sockaddr(&a, &sun));
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
    sl = to_sockaddr(&b->addr, &sun);
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
    return VMMT_OK;
}

static int copy_config(struct vmmt__broker *b, const struct vmmt__broker_config *cfg)
{
    b->timeout_ms = VMMT_BROKER_DEFAULT_TIMEOUT_MS;
    if (cfg == NULL) return VMMT_OK;
    if (cfg->timeout_ms > 0) b->timeout_ms = cfg->timeout_ms;
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
}

/* ------------------------------------------------------------------ client */

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

    if (err == EACCES || err == EPERM)
        hint = "the socket file's permissions refuse this user; ask the producer to add this "
               "uid to the pool's allowed uids";
    else if (addr->kind == VMMT_BROKER_ADDR_ABSTRACT && err == ECONNREFUSED)
        hint = "is the producer running? abstract sockets exist per network namespace: across "
               "containers, give the broker a filesystem path";
    return vmmt__fail(VMMT_ESYS, PREFIX "cannot connect to %s: %s; %s", where, strerror(err), hint);
}

static int client_connect(const struct vmmt__broker_addr *addr, const char *where, int64_t deadline,
                          int timeout_ms, int *out)
{
    struct sockaddr_un sun;
    socklen_t sl = to_sockaddr(addr, &sun);
    int s = new_socket(), err = 0;
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
            close(s);
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "cannot connect to %s within %d ms: its backlog stays full; "
                                     "is the producer alive?",
                              where, timeout_ms);
        }
        if (errno != EINPROGRESS) {
            err = errno;
            close(s);
            return connect_failed(addr, where, err);
        }
        int r = wait_fd(s, POLLOUT, deadline);
        if (r == 0) {
            close(s);
            return vmmt__fail(VMMT_ETIMEDOUT,
                              PREFIX "cannot connect to %s within %d ms; is the producer alive?",
                              where, timeout_ms);
        }
        if (r < 0 || getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
        if (err != 0) {
            close(s);
            return connect_failed(addr, where, err);
        }
        break;
    }
    *out = s;
    return VMMT_OK;
}

static int client_send(int s, const uint8_t pool_id[16], const char *where, int64_t deadline,
                       int timeout_ms)
{
    uint8_t req[REQ_SIZE];

    memcpy(req, REQ_MAGIC, 4);
    put_u16(req + 4, PROTO_VERSION);
    put_u16(req + 6, 0);
    memcpy(req + 8, pool_id, 16);
    for (;;) {
        if (send(s, req, sizeof req, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof req)
            return VMMT_OK;
        if (errno == EINTR) continue;
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
    uint8_t buf[REPLY_MAX + 1];
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
 * The text after the header, sanitised, when the reply's length agrees with its
 * msg_len; false otherwise. Every version so far puts msg_len at the same place.
 */
static bool reply_text(const struct reply *rp, char msg[REPLY_MSG_MAX + 1])
{
    uint16_t mlen = get_u16(rp->buf + 12);

    msg[0] = '\0';
    if (mlen > REPLY_MSG_MAX || rp->len != REPLY_HEAD + mlen) return false;
    clean_text(msg, rp->buf + REPLY_HEAD, mlen);
    return true;
}

static int no_fds(const struct reply *rp, const char *where, const uint8_t pool_id[16])
{
    char id[9];

    return vmmt__fail(VMMT_EPROTO,
                      PREFIX "broker returned no file descriptor for pool %s at %s: %s",
                      short_id(pool_id, id), where,
                      (rp->msg_flags & MSG_CTRUNC)
                          ? "the kernel dropped it (MSG_CTRUNC); is this process at its "
                            "open-file limit (ulimit -n)?"
                          : "the success reply carried no SCM_RIGHTS data; is the server a "
                            "vmmt broker?");
}

/* VMMT_OK when rp is a success reply carrying exactly `want` fds. */
static int reply_status(const struct reply *rp, const char *where, const uint8_t pool_id[16],
                        int want)
{
    char msg[REPLY_MSG_MAX + 1];
    unsigned version, announced;
    int32_t status;

    if (rp->len == 0)
        return vmmt__fail(VMMT_ECLOSED,
                          PREFIX "%s closed the connection without a reply; the producer may be "
                                 "stopping, or it gave up on this client",
                          where);
    if ((rp->msg_flags & MSG_TRUNC) || rp->len < REPLY_HEAD || memcmp(rp->buf, REPLY_MAGIC, 4) != 0)
        return vmmt__fail(
            VMMT_EPROTO, PREFIX "malformed reply from %s (%zd bytes, %s); is it a vmmt broker?",
            where, rp->len,
            rp->len >= 4 && memcmp(rp->buf, REPLY_MAGIC, 4) == 0 ? "bad length" : "no VMBR magic");
    /* Before anything else in the header: the other fields may mean something else there. */
    version = get_u16(rp->buf + 4);
    if (version != PROTO_VERSION) {
        /* Its text, if it has one, is likely its own version complaint: worth passing on. */
        bool said = reply_text(rp, msg) && msg[0] != '\0';
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "%s speaks broker protocol version %u, this build speaks %d: use "
                                 "the same vmmt version on producer and consumers%s%s%s",
                          where, version, PROTO_VERSION, said ? " (it said: \"" : "",
                          said ? msg : "", said ? "\")" : "");
    }
    if (!reply_text(rp, msg))
        return vmmt__fail(VMMT_EPROTO,
                          PREFIX "malformed reply from %s: message length %u in a %zd-byte reply",
                          where, get_u16(rp->buf + 12), rp->len);
    status = get_i32(rp->buf + 8);
    if (status < VMMT_ETOOBIG || status > VMMT_OK)
        return vmmt__fail(VMMT_EPROTO, PREFIX "%s replied with unknown status %d: %s", where,
                          (int)status, msg);
    if (status != VMMT_OK) return vmmt__fail(status, PREFIX "%s", msg);
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

/*
 * The two parsers without a socket, for the fuzzers (tests/fuzz/): the same
 * checks the server and the client run on what a peer sent.
 */
const char *vmmt__broker_request_problem(const uint8_t *req, size_t n, char *why, size_t cap)
{
    return request_problem(req, (ssize_t)n, why, cap);
}

int vmmt__broker_parse_reply(const uint8_t *buf, size_t len, int msg_flags, int nfds,
                             const uint8_t pool_id[16], int want)
{
    struct reply rp;

    memset(&rp, 0, sizeof rp);
    /* What recvmsg into REPLY_MAX + 1 bytes would have kept, and said. */
    if (len > sizeof rp.buf) {
        len = sizeof rp.buf;
        msg_flags |= MSG_TRUNC;
    }
    memcpy(rp.buf, buf, len);
    rp.len = (ssize_t)len;
    rp.msg_flags = msg_flags;
    rp.nfds = nfds < 0 ? 0 : nfds > CLIENT_MAX_FDS ? CLIENT_MAX_FDS : nfds;
    return reply_status(&rp, "@fuzz", pool_id, want);
}

int vmmt__broker_fetch_fds(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                           int timeout_ms, int *fds_out, int want)
{
    char where[4 * sizeof addr->name + 2];
    struct reply rp;
    int64_t deadline;
    int s = -1, st;

    if (fds_out != NULL)
        for (int i = 0; i < want && i < VMMT_BROKER_MAX_FDS; i++)
            fds_out[i] = -1;
    if (addr == NULL || pool_id == NULL || fds_out == NULL)
        return vmmt__fail(VMMT_EINVAL, PREFIX "addr, pool_id and fds_out must not be NULL");
    if (want < 1 || want > VMMT_BROKER_MAX_FDS)
        return vmmt__fail(VMMT_EINVAL, PREFIX "want is %d; a broker serves 1 to %d fds", want,
                          VMMT_BROKER_MAX_FDS);
    if (timeout_ms < 0)
        return vmmt__fail(VMMT_EINVAL,
                          PREFIX "timeout_ms is %d; use a positive number, or 0 "
                                 "for %d",
                          timeout_ms, VMMT_BROKER_DEFAULT_TIMEOUT_MS);
    if (timeout_ms == 0) timeout_ms = VMMT_BROKER_DEFAULT_TIMEOUT_MS;
    st = addr_check(addr);
    if (st != VMMT_OK) return vmmt__wrap(st, PREFIX "bad address");
    vmmt__broker_addr_format(addr, where, sizeof where);
    deadline = now_ms() + timeout_ms;
    memset(&rp, 0, sizeof rp);

    st = client_connect(addr, where, deadline, timeout_ms, &s);
    if (st != VMMT_OK) goto out;
    st = client_send(s, pool_id, where, deadline, timeout_ms);
    if (st != VMMT_OK) goto out;
    st = client_recv(s, where, deadline, timeout_ms, &rp);
    if (st != VMMT_OK) goto out;
    st = reply_status(&rp, where, pool_id, want);
    if (st != VMMT_OK) goto out;
    /* Handed over: the caller owns them now, so the cleanup below must not close them. */
    memcpy(fds_out, rp.fds, sizeof(int) * (size_t)want);
    rp.nfds = 0;
out:
    for (int i = 0; i < rp.nfds; i++)
        close(rp.fds[i]);
    close_fd(&s);
    return st;
}

int vmmt__broker_fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                       int timeout_ms, int *fd_out)
{
    /* Checked here so that the message names this function's parameter. */
    if (fd_out == NULL)
        return vmmt__fail(VMMT_EINVAL, PREFIX "addr, pool_id and fd_out must not be NULL");
    return vmmt__broker_fetch_fds(addr, pool_id, timeout_ms, fd_out, 1);
}
