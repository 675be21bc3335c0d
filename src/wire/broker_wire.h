/*
 * The broker's wire format, version 3 (docs/broker.md), shared by the server
 * (broker.c) and the client (broker_client.c). Every integer is
 * little-endian; every message is one SOCK_SEQPACKET packet.
 */
#ifndef VMMT_BROKER_WIRE_H
#define VMMT_BROKER_WIRE_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "broker_addr.h"

#define VMMT__BROKER_PROTO 3

/* Request: magic 4, version 2, flags 2, pool_id 16. Every version's request is 24 bytes. */
#define VMMT__BREQ_SIZE  24
#define VMMT__BREQ_HOLD  1u /* flags: keep this connection open as a liveness link */
#define VMMT__BREQ_FLAGS VMMT__BREQ_HOLD

/*
 * Reply: magic 4, version 2, nfds 1, flags 1, status 4, msg_len 2, pool_id 16,
 * message. msg_len stays at offset 12 in every version.
 */
#define VMMT__BREP_HEAD    30
#define VMMT__BREP_MSG_MAX 200
#define VMMT__BREP_MAX     (VMMT__BREP_HEAD + VMMT__BREP_MSG_MAX)
#define VMMT__BREP_HELD    1u /* flags: the broker keeps the connection as a liveness link */

/* Link message, client to broker: magic 4, version 2, type 2, first 4, count 4. */
#define VMMT__BMSG_SIZE 16
#define VMMT__BMSG_HOLD 1 /* this process consumes for ranks [first, first + count) */
#define VMMT__BMSG_BYE  2 /* this process lets go of the pool and stays alive; first = count = 0 */

static const char VMMT__BREQ_MAGIC[4] = {'V', 'M', 'B', 'Q'};
static const char VMMT__BREP_MAGIC[4] = {'V', 'M', 'B', 'R'};
static const char VMMT__BMSG_MAGIC[4] = {'V', 'M', 'B', 'M'};

static inline void vmmt__put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static inline uint16_t vmmt__get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static inline void vmmt__put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint32_t vmmt__get_u32(const uint8_t *p)
{
    uint32_t u = 0;
    for (int i = 0; i < 4; i++)
        u |= (uint32_t)p[i] << (8 * i);
    return u;
}

/* The first four bytes in hex: enough to tell pools apart in a message. */
static inline const char *vmmt__short_id(const uint8_t id[16], char buf[9])
{
    snprintf(buf, 9, "%02x%02x%02x%02x", id[0], id[1], id[2], id[3]);
    return buf;
}

/* A link message, parsed; the parsers are pure so that fuzzers can call them. */
struct vmmt__bmsg {
    uint16_t type;
    uint32_t first, count;
};

/*
 * Parse a link message of n bytes for a broker tracking `ranks` ranks: NULL
 * when valid, else why not (written to why).
 */
const char *vmmt__bmsg_parse(const uint8_t *buf, long n, int ranks, struct vmmt__bmsg *out,
                             char *why, size_t cap);

/*
 * The client's check of a reply of len bytes (docs/broker.md, "What a client
 * must do and check", step 6) that came with nfds fds and recvmsg's
 * msg_flags: VMMT_OK when it is a success reply for pool_id with exactly
 * `want` fds, else the status and message a fetch fails with. Pure but for
 * the thread's error message, so that fuzzers can call it.
 */
int vmmt__brep_check(const uint8_t *buf, long len, int msg_flags, int nfds,
                     const uint8_t pool_id[16], int want, const char *where);

/* Parse a request of n bytes: NULL when it is a valid request of this version, else why not. */
const char *vmmt__breq_parse(const uint8_t *buf, long n, uint16_t *flags, uint8_t pool_id[16],
                             char *why, size_t cap);

/*
 * A uid through a user namespace's map (the text of /proc/PID/uid_map: lines
 * "inside outside count"): inside to outside, or outside to inside when
 * `outward` is 0. 1 with *out set when a line covers uid, else 0.
 */
int vmmt__uid_map_find(const char *map, int outward, uint32_t uid, uint32_t *out);

/* The address checked for use by a client: kind known, length 1..107, no NUL in a path. */
int vmmt__broker_addr_check(const struct vmmt__broker_addr *addr);

/* The kernel's form of an address; returns its length. */
socklen_t vmmt__broker_sockaddr(const struct vmmt__broker_addr *addr, struct sockaddr_un *sun);

#endif
