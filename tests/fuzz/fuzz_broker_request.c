/*
 * Fuzz target: the broker server's request parser, on any packet a client
 * could send. Invariants: a request is accepted exactly when it is 24 bytes
 * with the "VMBQ" magic, the broker's version and no unknown flag bits; an accepted request yields
 * the pool id and flags it carries; a refusal has a printable reason that fits a reply (200 bytes).
 */
#include <string.h>

#include "broker_proto.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char why[201];
    uint8_t id[16];
    uint16_t flags = 0xffff;
    const char *problem;
    int well_formed = size == 24 && memcmp(data, "VMBQ", 4) == 0 && data[4] == FUZZ_PROTO &&
                      data[5] == 0 && ((data[6] | data[7] << 8) & ~FUZZ_REQ_FLAGS) == 0;

    memset(why, 0, sizeof why);
    problem = vmmt__breq_parse(data, (long)size, &flags, id, why, sizeof why);
    if (well_formed) {
        FUZZ_ASSERT(problem == NULL, "well-formed request refused: %s", why);
        FUZZ_ASSERT(memcmp(id, data + 8, 16) == 0, "pool id not the request's");
        FUZZ_ASSERT(flags == (data[6] | data[7] << 8), "flags 0x%x", flags);
        return 0;
    }
    FUZZ_ASSERT(problem == why, "malformed request of %zu bytes accepted", size);
    FUZZ_ASSERT(why[0] != '\0' && strlen(why) < sizeof why, "reason empty or too long");
    FUZZ_ASSERT(fuzz_printable(why), "reason: %s", why);
    return 0;
}
