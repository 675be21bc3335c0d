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
    /*
     * Optional: fds for ids other than the pool's own (an elastic pool's
     * chunks, vmmt__chunk_id). Called on the broker thread, after the peer's
     * credentials passed; returns how many new fds it put in fds (the broker
     * sends and closes them), or 0 when it serves no such id.
     */
    int (*resolve)(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS]);
    void *resolve_user;
};

/* The id under which a broker with a resolver serves chunk `chunk` of pool_id. */
static inline void vmmt__chunk_id(const uint8_t pool_id[16], uint32_t chunk, uint8_t out[16])
{
    uint32_t tag = chunk + 1;

    for (int i = 0; i < 16; i++)
        out[i] = pool_id[i];
    for (int i = 0; i < 4; i++)
        out[12 + i] ^= (uint8_t)(tag >> (8 * i));
}

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

/*
 * vmmt__broker_fetch_fds that also gives, in *pidfd_out, a pidfd of the
 * serving process (the producer: the broker is its thread), or -1 where none
 * can be had. The consumer watches it to learn of the producer's death.
 */
int vmmt__broker_fetch_fds_pidfd(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                                 int timeout_ms, int *fds_out, int want, int *pidfd_out);

/* The process at the other end of a connected AF_UNIX socket as a pidfd (CLOEXEC), or -1. */
int vmmt__broker_peer_pidfd(int sock);

/* vmmt__broker_fetch_fds for a broker that serves one fd. *fd_out is -1 on failure. */
int vmmt__broker_fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                       int timeout_ms, int *fd_out);

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
