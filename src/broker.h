/*
 * The file-descriptor broker: a producer serves its pool's exported fds (the
 * device allocation's POSIX fd, the control table's memfd) to consumer processes over an AF_UNIX
 * SOCK_SEQPACKET socket (SCM_RIGHTS), after checking each peer's credentials. Protocol and security
 * model: docs/broker.md.
 */
#ifndef VMMT_BROKER_H
#define VMMT_BROKER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "broker_addr.h"

#define VMMT_BROKER_ADDR_ABSTRACT 0
#define VMMT_BROKER_ADDR_PATH     1

#define VMMT_BROKER_DEFAULT_TIMEOUT_MS 2000
#define VMMT_BROKER_MAX_PENDING        64
#define VMMT_BROKER_MAX_FDS            4

struct vmmt__broker_config {
    const char *path;          /* NULL: an unguessable abstract name; else a filesystem path */
    const uid_t *allowed_uids; /* NULL: only the producer's own effective uid (root is NOT
                                  implicitly allowed) */
    size_t allowed_count;
    int timeout_ms; /* per-connection deadline; 0 means default 2000 */
};

struct vmmt__broker;

/*
 * Serve fds[0..nfds) (each dup'ed; the broker owns its copies) in this order,
 * all in one reply, to clients that name `pool_id`. nfds is 1 to
 * VMMT_BROKER_MAX_FDS. cfg may be NULL for the defaults. Starts one thread.
 */
int vmmt__broker_start_fds(const int *fds, int nfds, const uint8_t pool_id[16],
                           const struct vmmt__broker_config *cfg, struct vmmt__broker **out);

/* vmmt__broker_start_fds with the one fd. */
int vmmt__broker_start(int fd, const uint8_t pool_id[16], const struct vmmt__broker_config *cfg,
                       struct vmmt__broker **out);

const struct vmmt__broker_addr *vmmt__broker_address(const struct vmmt__broker *b);

/* Stops the thread (bounded time), closes everything, unlinks a path socket. NULL is a no-op. */
void vmmt__broker_stop(struct vmmt__broker *b);

/*
 * Client: connect, ask for pool_id, receive exactly `want` fds (CLOEXEC, 1 to
 * VMMT_BROKER_MAX_FDS) into fds_out in the server's order. Never waits beyond
 * timeout_ms (0 means the default 2000). A reply with fewer or more fds than
 * `want` is VMMT_EPROTO, naming both counts. On any failure every fd received
 * is closed and fds_out[0..want) are -1 (at most VMMT_BROKER_MAX_FDS of them).
 */
int vmmt__broker_fetch_fds(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                           int timeout_ms, int *fds_out, int want);

/* vmmt__broker_fetch_fds for a broker that serves one fd. *fd_out is -1 on failure. */
int vmmt__broker_fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                       int timeout_ms, int *fd_out);

/*
 * The message parsers alone, for the fuzzers. Server side: why a request of n
 * bytes is malformed (text in why), or NULL for a well-formed request.
 * Client side: the status fetch would return for a reply of len bytes that
 * came with msg_flags (MSG_TRUNC, MSG_CTRUNC) and nfds attached fds, when it
 * wants `want` of them; the message is set on failure.
 */
const char *vmmt__broker_request_problem(const uint8_t *req, size_t n, char *why, size_t cap);
int vmmt__broker_parse_reply(const uint8_t *buf, size_t len, int msg_flags, int nfds,
                             const uint8_t pool_id[16], int want);

/* Counters for stats and tests. */
struct vmmt__broker_stats {
    uint64_t served, refused_peer, refused_pool, timed_out, malformed;
};
void vmmt__broker_stats(const struct vmmt__broker *b, struct vmmt__broker_stats *out);

/*
 * The address as people write it: "@name" for an abstract name, the path
 * otherwise; bytes that are not printable ASCII appear as \xNN. Returns buf.
 */
const char *vmmt__broker_addr_format(const struct vmmt__broker_addr *addr, char *buf, size_t cap);

/* The reverse of vmmt__broker_addr_format for printable names: "@name" or a path. */
int vmmt__broker_addr_parse(const char *text, struct vmmt__broker_addr *out);

#endif
