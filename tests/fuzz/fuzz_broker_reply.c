/*
 * Fuzz target: the broker client's reply parser. The first three input bytes
 * choose what came with the packet (the MSG_TRUNC and MSG_CTRUNC flags, how
 * many fds the kernel attached, how many the caller wants); the rest is the
 * packet. Invariants: success only for a reply that is exactly well formed
 * (length header + msg_len, "VMBR", the client's version, status 0, the
 * pool id asked for, as many fds announced, attached and
 * wanted, no truncation); any other reply fails with a known negative status
 * and a printable message, whatever text the peer sent.
 */
#include <string.h>
#include <sys/socket.h>

#include "broker_proto.h"
#include "fuzz.h"
#include "vmmt.h"

static const uint8_t pool_id[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fuzz_bytes b = {data, size};
    uint8_t sel = (uint8_t)fuzz_take(&b, 1);
    int flags = ((sel & 1) ? MSG_TRUNC : 0) | ((sel & 2) ? MSG_CTRUNC : 0);
    int nfds = (int)fuzz_take(&b, 1) % 9;
    int want = 1 + (int)fuzz_take(&b, 1) % VMMT_BROKER_MAX_FDS;
    const uint8_t *pkt = b.p;
    size_t len = b.n;
    int st = vmmt__brep_check(pkt, (long)len, flags, nfds, pool_id, want, "@fuzz");

    if (st == VMMT_OK) {
        FUZZ_ASSERT(!(flags & MSG_TRUNC), "truncated reply accepted");
        FUZZ_ASSERT(len >= 14 && memcmp(pkt, "VMBR", 4) == 0, "no header");
        FUZZ_ASSERT(len >= FUZZ_REPLY_HEAD, "short reply");
        FUZZ_ASSERT(pkt[4] == FUZZ_PROTO && pkt[5] == 0, "version %u", pkt[4] | pkt[5] << 8);
        FUZZ_ASSERT(len == FUZZ_REPLY_HEAD + (pkt[12] | (unsigned)pkt[13] << 8), "length %zu", len);
        FUZZ_ASSERT(memcmp(pkt + 14, pool_id, 16) == 0, "another pool's reply");
        FUZZ_ASSERT(pkt[8] == 0 && pkt[9] == 0 && pkt[10] == 0 && pkt[11] == 0, "status");
        FUZZ_ASSERT(pkt[6] == nfds && nfds == want, "announced %u, attached %d, wanted %d", pkt[6],
                    nfds, want);
        return 0;
    }
    FUZZ_ASSERT(st < 0 && st >= VMMT_ETOOBIG, "status %d", st);
    FUZZ_ASSERT(vmmt_last_error()[0] != '\0', "failure without a message");
    FUZZ_ASSERT(fuzz_printable(vmmt_last_error()), "message: %s", vmmt_last_error());
    return 0;
}
