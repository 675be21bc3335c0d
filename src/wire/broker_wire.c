/*
 * The checks the broker runs on what a peer sends: pure functions of the
 * bytes, so that they can be tested and fuzzed alone. Layouts:
 * src/wire/broker_wire.h and docs/broker.md.
 */
#include "broker_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *vmmt__breq_parse(const uint8_t *req, long n, uint16_t *flags, uint8_t pool_id[16],
                             char *why, size_t cap)
{
    if (n != VMMT__BREQ_SIZE) {
        snprintf(why, cap, "request of %ld bytes; version %d requests have %d", n,
                 VMMT__BROKER_PROTO, VMMT__BREQ_SIZE);
    } else if (memcmp(req, VMMT__BREQ_MAGIC, 4) != 0) {
        snprintf(why, cap, "request does not start with \"VMBQ\"; is the client a vmmt consumer?");
    } else if (vmmt__get_u16(req + 4) != VMMT__BROKER_PROTO) {
        snprintf(why, cap,
                 "request version %u is not supported; this broker speaks version %d: use the "
                 "same vmmt version on producer and consumers",
                 vmmt__get_u16(req + 4), VMMT__BROKER_PROTO);
    } else if ((vmmt__get_u16(req + 6) & ~VMMT__BREQ_FLAGS) != 0) {
        snprintf(why, cap, "request flags 0x%x has unknown bits; known: 0x%x",
                 vmmt__get_u16(req + 6), VMMT__BREQ_FLAGS);
    } else {
        *flags = vmmt__get_u16(req + 6);
        memcpy(pool_id, req + 8, 16);
        return NULL;
    }
    return why;
}

const char *vmmt__bmsg_parse(const uint8_t *buf, long n, int ranks, struct vmmt__bmsg *out,
                             char *why, size_t cap)
{
    if (n != VMMT__BMSG_SIZE) {
        snprintf(why, cap, "link message of %ld bytes; they have %d", n, VMMT__BMSG_SIZE);
        return why;
    }
    if (memcmp(buf, VMMT__BMSG_MAGIC, 4) != 0 || vmmt__get_u16(buf + 4) != VMMT__BROKER_PROTO) {
        snprintf(why, cap, "link message lacks the \"VMBM\" magic or version %d",
                 VMMT__BROKER_PROTO);
        return why;
    }
    out->type = vmmt__get_u16(buf + 6);
    out->first = vmmt__get_u32(buf + 8);
    out->count = vmmt__get_u32(buf + 12);
    if (out->type == VMMT__BMSG_BYE && out->first == 0 && out->count == 0) return NULL;
    if (out->type != VMMT__BMSG_HOLD) {
        snprintf(why, cap, "link message type %u (first %u, count %u) is unknown", out->type,
                 out->first, out->count);
        return why;
    }
    if (out->count == 0 || out->first >= (uint32_t)ranks ||
        out->count > (uint32_t)ranks - out->first) {
        snprintf(why, cap, "link message holds ranks [%u, +%u), outside the pool's %d", out->first,
                 out->count, ranks);
        return why;
    }
    return NULL;
}

/* The three numbers of one uid_map line ("inside outside count"); 0 if it has fewer. */
static int map_line(const char *line, size_t len, unsigned long long v[3])
{
    char buf[96], *p = buf, *end;

    if (len >= sizeof buf) return 0;
    memcpy(buf, line, len);
    buf[len] = '\0';
    for (int i = 0; i < 3; i++, p = end) {
        v[i] = strtoull(p, &end, 10);
        if (end == p) return 0;
    }
    return 1;
}

int vmmt__uid_map_find(const char *map, int outward, uint32_t uid, uint32_t *out)
{
    for (const char *line = map; line != NULL && *line != '\0';) {
        const char *nl = strchr(line, '\n');
        size_t len = nl != NULL ? (size_t)(nl - line) : strlen(line);
        unsigned long long v[3];

        if (map_line(line, len, v)) {
            unsigned long long from = outward ? v[0] : v[1], to = outward ? v[1] : v[0];
            if (uid >= from && uid - from < v[2] && to + (uid - from) <= UINT32_MAX) {
                *out = (uint32_t)(to + (uid - from));
                return 1;
            }
        }
        line = nl != NULL ? nl + 1 : NULL;
    }
    return 0;
}
