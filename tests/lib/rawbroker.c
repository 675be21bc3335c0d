/* See rawbroker.h: written from docs/descriptor.md and docs/broker.md. */
#include "rawbroker.h"

#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "testutil.h"

/* Offsets of docs/descriptor.md, "Layout". */
#define OFF_POOL_ID     24
#define OFF_BROKER_KIND 104
#define OFF_BROKER_LEN  105
#define OFF_BROKER_NAME 106

uint32_t tu_get32(const vmmt_desc *d, size_t off)
{
    const uint8_t *p = d->bytes + off;
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

uint64_t tu_get64(const vmmt_desc *d, size_t off)
{
    return (uint64_t)tu_get32(d, off) | (uint64_t)tu_get32(d, off + 4) << 32;
}

void tu_put32(vmmt_desc *d, size_t off, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        d->bytes[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

void tu_put64(vmmt_desc *d, size_t off, uint64_t v)
{
    tu_put32(d, off, (uint32_t)v);
    tu_put32(d, off + 4, (uint32_t)(v >> 32));
}

int tu_raw_fetch(const vmmt_desc *d, int fds[2], int *n)
{
    struct sockaddr_un sa;
    uint8_t req[24] = {'V', 'M', 'B', 'Q', 3, 0, 0, 0}, rep[256];
    char cbuf[CMSG_SPACE(8 * sizeof(int))];
    struct iovec iov = {rep, sizeof rep};
    struct msghdr mh = {0};
    struct cmsghdr *cm;
    uint8_t len = d->bytes[OFF_BROKER_LEN];
    socklen_t sl;
    ssize_t got;
    int s, st;

    *n = 0;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    assert_int_equal(d->bytes[OFF_BROKER_KIND], 0);
    memcpy(sa.sun_path + 1, d->bytes + OFF_BROKER_NAME, len);
    sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
    memcpy(req + 8, d->bytes + OFF_POOL_ID, 16);
    s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(s >= 0);
    assert_int_equal(connect(s, (struct sockaddr *)&sa, sl), 0);
    assert_int_equal(send(s, req, sizeof req, MSG_NOSIGNAL), (ssize_t)sizeof req);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    got = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    close(s);
    assert_true(got >= 30);
    for (cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
            if (*n < 2)
                fds[(*n)++] = fd;
            else
                close(fd);
        }
    }
    memcpy(&st, rep + 8, 4);
    return st;
}
