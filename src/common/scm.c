/* See scm.h. Shared by the group exchange and its tests' hostile peers. */
#include "scm.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

ssize_t vmmt__scm_send(int sock, const void *buf, size_t len, const int *fds, int nfds,
                       int extra_flags)
{
    struct iovec iov = {(void *)buf, len};
    struct msghdr mh;
    size_t space = CMSG_SPACE(sizeof(int) * (size_t)(nfds > 0 ? nfds : 1));
    char *ctl = NULL;
    ssize_t n;

    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (nfds > 0) {
        struct cmsghdr *c;
        /* Heap, aligned for cmsghdr: the batch size is the caller's. */
        if ((ctl = calloc(1, space)) == NULL) {
            errno = ENOMEM;
            return -1;
        }
        mh.msg_control = ctl;
        mh.msg_controllen = space;
        c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)nfds);
    }
    n = sendmsg(sock, &mh, MSG_NOSIGNAL | extra_flags);
    free(ctl);
    return n;
}
