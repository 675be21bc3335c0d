/*
 * Sending descriptors over an AF_UNIX socket: one message, its bytes and up
 * to SCM_MAX_FD descriptors in one SCM_RIGHTS control message, in order.
 */
#ifndef VMMT_SCM_H
#define VMMT_SCM_H

#include <stddef.h>
#include <sys/types.h>

/* sendmsg with MSG_NOSIGNAL | extra_flags; its result (errno set on -1). nfds may be 0. */
ssize_t vmmt__scm_send(int sock, const void *buf, size_t len, const int *fds, int nfds,
                       int extra_flags);

#endif
