/*
 * A hostile or broken peer of a broker, in a process of its own (as another
 * user when asked), for the tests that check that legitimate consumers are
 * still served meanwhile.
 *
 *   hostile ADDRESS POOL_HEX32 UID MODE N MS
 *
 * Modes (N: connections or rounds; MS: how long to keep at it):
 *   idle       open N connections, send nothing, keep them MS (or until the
 *              test closes fd 3; likewise noread)
 *   closed     open one connection, send nothing; exit 0 if the broker
 *              closes it (or replies) within MS, 1 if not
 *   garbage    N rounds within MS: connect, send 1..100 random bytes, close
 *   truncated  N rounds within MS: connect, send 1..23 bytes of a request
 *   forged     N rounds within MS: well-formed requests for another pool,
 *              another version, unknown flags
 *   noread     N connections each sending a valid request asking for a
 *              link, never reading the reply; keep them MS
 *   replay     N rounds within MS: a valid request for a link, then on the
 *              link the request again, garbage, ranks out of range
 *
 * UID -1 keeps the current user; otherwise the child drops to it (root
 * only). Except in mode closed, once at work it writes one byte to fd 3,
 * which the test must provide. Exit 0 when it did what it was told.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "broker_wire.h"
#include "status.h"
#include "testutil.h"

static struct sockaddr_un sun;
static socklen_t sl;
static uint8_t pool[16];

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A connected socket, or -1 once `until` has passed. */
static int dial(long until)
{
    while (now_ms() < until) {
        int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (s < 0) return -1;
        if (connect(s, (struct sockaddr *)&sun, sl) == 0) return s;
        close(s);
        if (errno != EAGAIN) return -1;
        poll(NULL, 0, 1);
    }
    return -1;
}

static void request(uint8_t *req, uint16_t version, uint16_t flags, const uint8_t *id)
{
    memcpy(req, "VMBQ", 4);
    vmmt__put_u16(req + 4, version);
    vmmt__put_u16(req + 6, flags);
    memcpy(req + 8, id, 16);
}

static void ready(void)
{
    char c = 1;
    if (write(3, &c, 1) != 1) perror("hostile: ready");
}

/* Read a reply and close every fd it carries. */
static void drain_reply(int s, int ms)
{
    uint8_t buf[512];
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * 8)];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    struct pollfd p = {.fd = s, .events = POLLIN};

    if (poll(&p, 1, ms) != 1) return;
    mh.msg_control = ctl.space;
    mh.msg_controllen = sizeof ctl.space;
    if (recvmsg(s, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0) return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            close(fd);
        }
    }
}

static int hold_open(int n, int ms, int send_request)
{
    int *s = calloc((size_t)n, sizeof *s), opened = 0;
    long until = now_ms() + ms;
    uint8_t req[VMMT__BREQ_SIZE];

    request(req, VMMT__BROKER_PROTO, VMMT__BREQ_HOLD, pool);
    /* A broker that stops accepting must not keep us from starting the test: half a second
     * without progress, and we hold what we have. */
    for (int i = 0; i < n; i++) {
        s[i] = dial(now_ms() + 500 < until ? now_ms() + 500 : until);
        if (s[i] < 0) break;
        opened++;
        if (send_request && send(s[i], req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req) break;
    }
    fprintf(stderr, "hostile: %d connection(s) open\n", opened);
    ready();
    /* Until MS pass, or the test closes its end of fd 3 (it is done with us). */
    while (now_ms() < until) {
        struct pollfd p = {.fd = 3, .events = POLLIN};
        if (poll(&p, 1, 10) > 0) break;
    }
    for (int i = 0; i < opened; i++)
        close(s[i]);
    free(s);
    return opened == n ? 0 : 1;
}

static int wait_closed(int ms)
{
    int s = dial(now_ms() + ms);
    struct pollfd p = {.fd = s, .events = POLLIN};

    if (s < 0) return 1;
    /* A reply (the refusal) or end-of-file both show that the broker let go. */
    int r = poll(&p, 1, ms);
    close(s);
    return r == 1 ? 0 : 1;
}

static int rounds(const char *mode, int n, int ms)
{
    long until = now_ms() + ms;
    uint8_t buf[128];
    int done = 0;

    ready();
    srand((unsigned)getpid());
    for (; done < n && now_ms() < until; done++) {
        int s = dial(until);
        if (s < 0) break;
        size_t len;
        if (strcmp(mode, "garbage") == 0) {
            len = 1 + (size_t)(rand() % 100);
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rand();
        } else if (strcmp(mode, "truncated") == 0) {
            request(buf, VMMT__BROKER_PROTO, 0, pool);
            len = 1 + (size_t)(rand() % 23);
        } else if (strcmp(mode, "forged") == 0) {
            uint8_t other[16];
            memcpy(other, pool, 16);
            other[done % 16] ^= 0x5a;
            int k = done % 3;
            request(buf, k == 1 ? 2 : VMMT__BROKER_PROTO, k == 2 ? 0x80 : 0, k == 0 ? other : pool);
            len = VMMT__BREQ_SIZE;
        } else { /* replay */
            request(buf, VMMT__BROKER_PROTO, VMMT__BREQ_HOLD, pool);
            len = VMMT__BREQ_SIZE;
        }
        send(s, buf, len, MSG_NOSIGNAL);
        if (strcmp(mode, "replay") == 0) {
            drain_reply(s, 500);
            uint8_t m[VMMT__BMSG_SIZE];
            memcpy(m, "VMBM", 4);
            vmmt__put_u16(m + 4, VMMT__BROKER_PROTO);
            vmmt__put_u16(m + 6, VMMT__BMSG_HOLD);
            vmmt__put_u32(m + 8, 1000);
            vmmt__put_u32(m + 12, 5);
            int k = done % 3;
            if (k == 0) send(s, buf, len, MSG_NOSIGNAL);          /* the request, replayed */
            if (k == 1) send(s, m, sizeof m, MSG_NOSIGNAL);       /* ranks out of range */
            if (k == 2) send(s, "VMBMgarbage", 11, MSG_NOSIGNAL); /* a broken message */
            drain_reply(s, 50);
        } else {
            drain_reply(s, 50);
        }
        close(s);
    }
    fprintf(stderr, "hostile: %s: %d round(s)\n", mode, done);
    return done > 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    struct vmmt__broker_addr addr;
    struct rlimit rl;

    if (argc != 7 || vmmt__broker_addr_parse(argv[1], &addr) != VMMT_OK ||
        tu_hex_decode(argv[2], pool, 16) != 0) {
        fprintf(stderr, "usage: hostile ADDRESS POOL_HEX32 UID MODE N MS\n");
        return 2;
    }
    long uid = strtol(argv[3], NULL, 10);
    int n = atoi(argv[5]), ms = atoi(argv[6]);
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (tu_drop_to(uid, "hostile") != 0) return 3;
    sl = vmmt__broker_sockaddr(&addr, &sun);
    if (strcmp(argv[4], "idle") == 0) return hold_open(n, ms, 0);
    if (strcmp(argv[4], "noread") == 0) return hold_open(n, ms, 1);
    if (strcmp(argv[4], "closed") == 0) return wait_closed(ms);
    return rounds(argv[4], n, ms);
}
