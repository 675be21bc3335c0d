/*
 * Internals of the group exchange (docs/group.md): the group object shared
 * by group.c (create, vote, destroy), group_reg.c, group_prepare.c and
 * group_map.c (registration, group_reg.h) and group_alloc.c (the allocation
 * helper), the vote (group_vote.c) and the descriptor exchange over AF_UNIX
 * sockets (group_xchg.c).
 */
#ifndef VMMT_GROUP_INTERNAL_H
#define VMMT_GROUP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "abi.h"
#include "broker_addr.h"
#include "cuabi.h"
#include "vmmt.h"

#define VMMT__GROUP_MAX_WORLD   4096
#define VMMT__GROUP_DEF_TIMEOUT 120000
#define VMMT__GROUP_DEF_ALLOCS  4096
#define VMMT__GROUP_NODE_LEN    64
#define VMMT__GROUP_CAUSE_LEN   320

/* vmmt_group_config up to its last field of vmmt 0.1: the smallest size a caller may pass. */
#define VMMT__GROUP_CONFIG_V1 VMMT__SIZE_V1(vmmt_group_config, max_allocations)

/*
 * The caller's config (size bytes, as it was compiled) as this library's,
 * defaults in the fields it lacks; VMMT_EINVAL naming fn for a size no
 * version has, or a field set that this library does not know (abi.h).
 */
int vmmt__group_config_in(const vmmt_group_config *theirs, size_t size, const char *fn,
                          vmmt_group_config *ours);

/*
 * What each rank says about itself when the group is created (all-gathered
 * once, fixed size). Fixed-width fields, native byte order: ranks that
 * exchange it run the same vmmt build on the same kind of host.
 */
struct vmmt__group_hello {
    char magic[8]; /* "VMMTGRP1" */
    uint32_t version;
    int32_t rank;
    int32_t world;
    int32_t pid;
    uint32_t uid;
    int32_t device;
    int32_t requested; /* vmmt_handle_type the rank's config asks for */
    int32_t fabric_ok;
    int32_t posix_ok;
    char node[VMMT__GROUP_NODE_LEN];
    char fabric_cause[VMMT__GROUP_CAUSE_LEN];
    char posix_cause[VMMT__GROUP_CAUSE_LEN];
};

/*
 * The vote over every rank's hello (validated first: magic, version, ranks in
 * their slots, one world size). VMMT_OK with *out set, or a failure whose
 * message is the same on every rank, because every rank computes it from
 * the same bytes.
 */
int vmmt__group_vote(const struct vmmt__group_hello *hellos, int world, vmmt_handle_type *out);

/* This machine's node name: VMMT_GROUP_NODE, else host name + boot id. */
void vmmt__group_node_name(char *buf, size_t cap);

/* One of this rank's allocations, shared with the group (retained handle). */
struct vmmt__group_local {
    CUdeviceptr base;
    uint64_t size;
    CUmemGenericAllocationHandle handle;
};

/* A peer rank's allocation as imported here; id = its index in the owner's locals. */
struct vmmt__group_import {
    uint64_t size;
    CUmemGenericAllocationHandle handle;
    int have_handle;
};

/* A peer's buffer span mapped here: consecutive allocations of one peer. */
struct vmmt__group_span {
    int rank;
    uint32_t first; /* index into the span chain of that rank (see group_reg.c) */
    uint32_t count;
    uint32_t *ids; /* the peer's allocation ids, in address order */
    CUdeviceptr base;
    uint64_t size;
    uint32_t mapped; /* allocations mapped so far, from the start */
    int reserved;
};

/* An allocation made by vmmt_group_alloc. */
struct vmmt__group_own {
    CUdeviceptr base;
    uint64_t size;
    int chunks;
    int mapped; /* chunks mapped so far */
    CUmemGenericAllocationHandle *handles;
};

struct vmmt_group {
    int rank, world, device;
    vmmt_handle_type type;
    vmmt_group_collective coll;
    int timeout_ms;
    char socket_dir[96];
    uint32_t max_allocs;
    int broken; /* a collective failed: ranks may be out of step */
    uint32_t seq;
    struct vmmt__group_hello *hellos; /* every rank's, from create */

    struct vmmt__group_local *locals;
    size_t nlocals, caplocals;
    struct vmmt__group_import **imports; /* per rank, indexed by the owner's id */
    size_t *nimports, *capimports;
    size_t nimported; /* total imports with a handle */
    struct vmmt__group_span *spans;
    size_t nspans, capspans;
    size_t nbuffers;

    struct vmmt__group_own *owns;
    size_t nowns, capowns;
};

/* Run the collective; on failure the group is broken and the message names `what`. */
int vmmt__group_allgather(vmmt_group *g, const void *send, void *recv, size_t bytes,
                          const char *what);

/* Grow *arr (elements of size elem) to hold at least need; VMMT_ENOMEM with a message. */
int vmmt__group_grow(void **arr, size_t *cap, size_t need, size_t elem);

/* Undo a span's mapping steps in reverse order; safe on a partial span. */
void vmmt__group_span_release(vmmt_group *g, struct vmmt__group_span *s);

/* ------------------------------------------------------------ fd exchange */

/*
 * One exchange of POSIX descriptors between the ranks of one node. Each rank
 * listens on its own socket, whose address travels through the collective;
 * it connects to every peer it sends to and accepts a connection from every
 * peer it receives from. Peers are authenticated by SO_PEERCRED (the pid and
 * uid they announced at group creation).
 */
struct vmmt__gx {
    int listen_fd;
    struct vmmt__broker_addr addr;
    char path[108]; /* a filesystem socket to unlink on close; empty if abstract */
};

/* A fresh listener: an abstract random name, or a random file in dir. */
int vmmt__gx_listen(const char *dir, struct vmmt__gx *x);
void vmmt__gx_close(struct vmmt__gx *x);

struct vmmt__gx_peer {
    int rank;
    pid_t pid;
    uid_t uid;
    struct vmmt__broker_addr addr;
    int send_count; /* descriptors to send it (send_fds stay ours) */
    const int *send_fds;
    int recv_count; /* descriptors it must send us */
    int *recv_fds;  /* out: recv_count received descriptors, in the sender's order */
};

/*
 * Send and receive everything, within timeout_ms in all. On failure every
 * descriptor received is closed (recv_fds all -1) and the message names the
 * peer, what arrived and what was expected: missing (fewer than announced,
 * or none before the deadline), extra (more than announced), duplicate (a
 * batch or connection seen twice), or a peer whose credentials do not match.
 */
int vmmt__gx_run(struct vmmt__gx *x, int self_rank, uint32_t seq, struct vmmt__gx_peer *peers,
                 int npeers, int timeout_ms);

/* Wire constants, for tests that play a hostile peer. */
#define VMMT__GX_MAGIC     0x58474d56u /* "VMGX" little-endian */
#define VMMT__GX_VERSION   1
#define VMMT__GX_BATCH_MAX 64

struct vmmt__gx_head {
    uint32_t magic;
    uint32_t version;
    uint32_t seq;
    int32_t from;
    int32_t to;
    uint32_t batch; /* 0, 1, ... */
    uint32_t nfds;  /* descriptors attached to this message */
    uint32_t total; /* descriptors the sender sends in all */
};

#endif
