/*
 * Fuzz target: the broker server's request parser, on any packet a client
 * could send. Invariants: a request is accepted exactly when it is 24 bytes
 * with the "VMBQ" magic, version 2 and a zero reserved field; a refusal has
 * a printable reason that fits the reply (200 bytes).
 */
#include <string.h>

#include "broker.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char why[201];
    const char *problem;
    int well_formed = size == 24 && memcmp(data, "VMBQ", 4) == 0 && data[4] == 2 && data[5] == 0 &&
                      data[6] == 0 && data[7] == 0;

    memset(why, 0, sizeof why);
    problem = vmmt__broker_request_problem(data, size, why, sizeof why);
    if (well_formed) {
        FUZZ_ASSERT(problem == NULL, "well-formed request refused: %s", why);
        return 0;
    }
    FUZZ_ASSERT(problem == why, "malformed request of %zu bytes accepted", size);
    FUZZ_ASSERT(why[0] != '\0' && strlen(why) < sizeof why, "reason empty or too long");
    FUZZ_ASSERT(fuzz_printable(why), "reason: %s", why);
    return 0;
}
