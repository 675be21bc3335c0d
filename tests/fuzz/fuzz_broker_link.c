/*
 * Fuzz target: the broker server's liveness-link message parser (protocol
 * version 3), on any packet a linked consumer could send. The first input
 * byte chooses the pool's rank count (1 to 256); the rest is the packet.
 * Invariants: accepted exactly when it is 16 bytes, "VMBM", the broker's
 * version, and either a goodbye (type 2, first = count = 0) or a hold (type
 * 1) of 1 or more ranks inside the pool; a refusal has a printable reason.
 */
#include <string.h>

#include "broker_proto.h"
#include "fuzz.h"

static uint32_t u32(const uint8_t *p)
{
    return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_bytes b = {data, size};
    int ranks = 1 + (int)fuzz_take(&b, 1);
    const uint8_t *m = b.p;
    struct vmmt__bmsg out;
    char why[201];
    const char *problem;
    int ok = 0;

    if (b.n == VMMT__BMSG_SIZE && memcmp(m, "VMBM", 4) == 0 && m[4] == VMMT__BROKER_PROTO &&
        m[5] == 0) {
        uint16_t type = (uint16_t)(m[6] | m[7] << 8);
        uint32_t first = u32(m + 8), count = u32(m + 12);
        ok = (type == VMMT__BMSG_BYE && first == 0 && count == 0) ||
             (type == VMMT__BMSG_HOLD && count >= 1 && first < (uint32_t)ranks &&
              count <= (uint32_t)ranks - first);
    }
    memset(why, 0, sizeof why);
    problem = vmmt__bmsg_parse(m, (long)b.n, ranks, &out, why, sizeof why);
    if (ok) {
        FUZZ_ASSERT(problem == NULL, "well-formed link message refused: %s", why);
        FUZZ_ASSERT(out.first == u32(m + 8) && out.count == u32(m + 12), "ranks not the message's");
        return 0;
    }
    FUZZ_ASSERT(problem == why, "malformed link message of %zu bytes accepted", b.n);
    FUZZ_ASSERT(why[0] != '\0' && strlen(why) < sizeof why, "reason empty or too long");
    FUZZ_ASSERT(fuzz_printable(why), "reason: %s", why);
    return 0;
}
