/*
 * The file-descriptor broker: a producer serves its pool's exported fds (the
 * device allocation's POSIX fd, the control table's memfd) to consumer
 * processes over an AF_UNIX SOCK_SEQPACKET socket (SCM_RIGHTS), after
 * checking each peer's credentials; consumers check the server's credentials
 * in turn. A consumer may keep its connection open as a liveness link: the
 * producer learns of the consumer process's death when the link closes (or
 * its pidfd fires), and the consumer learns of the producer's when the
 * producer's end closes. Protocol and security model: docs/broker.md.
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
#define VMMT_BROKER_MAX_PENDING        64  /* connections awaiting their request, all peers */
#define VMMT_BROKER_PENDING_PER_UID    32  /* ... of one uid */
#define VMMT_BROKER_MAX_HELD           512 /* liveness links, all peers */
#define VMMT_BROKER_HELD_PER_UID       256 /* ... of one uid */
#define VMMT_BROKER_HELD_PER_PID       32  /* ... of one process */
#define VMMT_BROKER_MAX_FDS            4
#define VMMT_BROKER_MAX_RANKS          256
#define VMMT_BROKER_RANK_WORDS         (VMMT_BROKER_MAX_RANKS / 64)

/*
 * A process-wide count that only grows (never 0): the order of liveness
 * events, strictly, where clock readings could tie. Thread-safe.
 */
uint64_t vmmt__liveness_tick(void);

/*
 * Called on the broker thread when ranks lose their last live holder (see
 * ranks). held[r]: when (vmmt__liveness_tick) the dead process's link first
 * said it holds rank r, for each rank in `ranks`, so that the pool can tell
 * whether an engine's own release of that rank came after that process took
 * it (release.c). Per rank: a process may take a rank over long after its
 * first.
 */
typedef void (*vmmt__broker_dead_fn)(void *user, const uint64_t ranks[VMMT_BROKER_RANK_WORDS],
                                     pid_t pid, uid_t uid,
                                     const uint64_t held[VMMT_BROKER_MAX_RANKS]);

/*
 * Called on the broker thread when a dead process held ranks that other
 * live links hold too (`ranks`): those are not released, but the words it
 * took for them (a shared table's TAKEN, docs/descriptor.md) are its own
 * and will never be acknowledged; the pool gives them back.
 */
typedef void (*vmmt__broker_shared_dead_fn)(void *user,
                                            const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid,
                                            uid_t uid);

struct vmmt__broker_config {
    const char *path;          /* NULL: an unguessable abstract name; else a filesystem path */
    const uid_t *allowed_uids; /* NULL: only the producer's own effective uid (root is NOT
                                  implicitly allowed) */
    size_t allowed_count;
    int timeout_ms; /* per-connection deadline for the request; 0 means default 2000 */
    /*
     * Liveness: consumer ranks 0..ranks-1 that links may hold (1..256); 0
     * serves fds only and closes every connection after its reply. When a
     * consumer process dies (its link closes without a goodbye, or its pidfd
     * reports the exit), on_dead gets the ranks it held that no other live
     * link holds.
     */
    int ranks;
    vmmt__broker_dead_fn on_dead;
    vmmt__broker_shared_dead_fn on_dead_shared; /* optional */
    void *user;
    /*
     * Optional: fds for ids other than the pool's own (an elastic pool's
     * chunks, vmmt__chunk_id). Called on the broker thread, after the peer's
     * credentials passed; returns how many new fds it put in fds (the broker
     * sends and closes them, in a reply that names the id asked for, never
     * kept as a liveness link), or 0 when it serves no such id.
     */
    int (*resolve)(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS]);
    void *resolve_user;
};

/*
 * The id under which a broker with a resolver serves chunk `chunk` of pool_id:
 * bytes 12..15 XORed with chunk + 1 as a little-endian u32 (byte 12 with its
 * low byte), so that chunk 0 differs from the pool id itself.
 */
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

/* Counters for stats and tests. */
struct vmmt__broker_stats {
    uint64_t served, refused_peer, refused_pool, timed_out, malformed;
    uint64_t evicted;  /* connections awaiting a request closed to make room for newer ones */
    uint64_t held;     /* liveness links open now (orphans included) */
    uint64_t deaths;   /* links whose process died, once on_dead has returned */
    uint64_t goodbyes; /* links closed by a consumer that stays alive */
};
void vmmt__broker_stats(const struct vmmt__broker *b, struct vmmt__broker_stats *out);

/*
 * Have the broker's thread read every announcement its links sent before
 * this call, waiting at most timeout_ms (VMMT_ETIMEDOUT then). After an OK,
 * a rank some consumer announced before the call shows in
 * vmmt__broker_live_ranks, stamped (vmmt__broker_dead_fn's held) before the
 * vmmt__liveness_tick taken next. NULL: nothing to do. Never call it from
 * the broker's thread (an on_dead callback).
 */
int vmmt__broker_sync(struct vmmt__broker *b, int timeout_ms);

/* The ranks some live link (or orphan) holds now; thread-safe. All zero for NULL. */
void vmmt__broker_live_ranks(const struct vmmt__broker *b, uint64_t out[VMMT_BROKER_RANK_WORDS]);

/* ------------------------------------------------------------------ client */

/*
 * Who the consumer expects at the broker's address, from the descriptor: the
 * producer's effective uid, and its pid where both processes share a pid
 * namespace (0: do not check the pid). An impostor bound at the address is
 * refused before anything is sent to it.
 */
struct vmmt__broker_peer {
    uid_t uid;
    pid_t pid;
};

/*
 * The expectation for a producer that wrote (uid, pid, pidns) into its
 * descriptors: the pid is checked only when pidns is this process's pid
 * namespace.
 */
void vmmt__broker_expect(uid_t uid, pid_t pid, uint64_t pidns, struct vmmt__broker_peer *out);

/* Inode of this process's pid namespace (/proc/self/ns/pid); 0 when unknown. */
uint64_t vmmt__pidns_id(void);

/*
 * A consumer's open connection to the producer's broker (liveness link).
 * While it is open the producer counts the ranks it holds as alive; it closes
 * when this process dies. Its fd reports the producer's death: POLLHUP or
 * end-of-file (the broker never sends anything on it).
 */
struct vmmt__broker_link;

/*
 * Client: connect, check the server's credentials against `expect`, ask for
 * pool_id, receive exactly `want` fds (CLOEXEC, 1 to VMMT_BROKER_MAX_FDS)
 * into fds_out in the server's order, and check that the reply names pool_id.
 * Never waits beyond timeout_ms (0 means the default 2000). A reply with
 * fewer or more fds than `want` is VMMT_EPROTO, naming both counts. On any
 * failure every fd received is closed and fds_out[0..want) are -1.
 *
 * link: NULL closes the connection after the reply. Otherwise the connection
 * is kept as a liveness link when the broker agrees (*link set), and *link
 * is NULL when it does not (no liveness service, or its bounds reached).
 */
int vmmt__broker_fetch_fds(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                           const struct vmmt__broker_peer *expect, int timeout_ms, int *fds_out,
                           int want, struct vmmt__broker_link **link);

/*
 * vmmt__broker_fetch_fds that also gives, in *pidfd_out, a pidfd of the
 * serving process (the producer: the broker is its thread), taken on the same
 * connection once the server's credentials passed, or -1 where none can be
 * had. The consumer watches it to learn of the producer's death; the link, if
 * any, stays open beside it (our liveness, for the producer).
 */
int vmmt__broker_fetch_fds_pidfd(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                                 const struct vmmt__broker_peer *expect, int timeout_ms,
                                 int *fds_out, int want, struct vmmt__broker_link **link,
                                 int *pidfd_out);

/* The process at the other end of a connected AF_UNIX socket as a pidfd (CLOEXEC), or -1. */
int vmmt__broker_peer_pidfd(int sock);

/* vmmt__broker_fetch_fds for a broker that serves one fd, without a link. */
int vmmt__broker_fetch(const struct vmmt__broker_addr *addr, const uint8_t pool_id[16],
                       const struct vmmt__broker_peer *expect, int timeout_ms, int *fd_out);

/*
 * Tell the producer that this process consumes for ranks [first,
 * first+count); sends only ranks not announced before (so it costs one
 * non-blocking send per rank range, once). Thread-safe. VMMT_ECLOSED when
 * the producer's end is closed.
 */
int vmmt__broker_link_hold(struct vmmt__broker_link *l, uint32_t first, uint32_t count);

/* The socket, for poll(): POLLIN or POLLHUP means the producer is gone. Owned by the link. */
int vmmt__broker_link_fd(const struct vmmt__broker_link *l);

/* The producer's pid as SO_PEERCRED gave it (0 when it is in a pid namespace we cannot see). */
pid_t vmmt__broker_link_peer_pid(const struct vmmt__broker_link *l);

/* 1 when the producer's end of the link has closed (it exited or stopped its broker). */
int vmmt__broker_link_peer_gone(const struct vmmt__broker_link *l);

/*
 * Close the link. goodbye: this process stays alive and merely lets go of
 * the pool (eviction, destroy), so the producer must not treat it as dead.
 * NULL is a no-op.
 */
void vmmt__broker_link_close(struct vmmt__broker_link *l, int goodbye);

/*
 * The address as people write it: "@name" for an abstract name, the path
 * otherwise; bytes that are not printable ASCII appear as \xNN. Returns buf.
 */
const char *vmmt__broker_addr_format(const struct vmmt__broker_addr *addr, char *buf, size_t cap);

/* The reverse of vmmt__broker_addr_format for printable names: "@name" or a path. */
int vmmt__broker_addr_parse(const char *text, struct vmmt__broker_addr *out);

#endif
