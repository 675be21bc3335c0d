/* Rank sets of consumes and acknowledgements (rank_set.h). */
#include "rank_set.h"

#include <stdio.h>
#include <string.h>

#include "status.h"
#include "vmmt.h"

int vmmt__ranks_run(struct vmmt__ranks *s, int first, int count, uint32_t total)
{
    memset(s, 0, sizeof *s);
    if (first == VMMT_ALL_RANKS) {
        first = 0;
        count = (int)total;
    } else if (first < 0 || count <= 0 || (uint64_t)first + (uint64_t)count > total) {
        return vmmt__fail(VMMT_EINVAL,
                          "ranks [%d, %d+%d) are outside the pool's %u consumer ranks; use "
                          "0..%u or VMMT_ALL_RANKS",
                          first, first, count, total, total - 1);
    }
    for (int r = first; r < first + count; r++)
        s->bits[r / 64] |= 1ull << (r % 64);
    s->lo = (uint32_t)first;
    s->hi = (uint32_t)(first + count);
    return VMMT_OK;
}

int vmmt__ranks_list(struct vmmt__ranks *s, const int *ranks, int n, uint32_t total)
{
    memset(s, 0, sizeof *s);
    if (ranks == NULL || n <= 0)
        return vmmt__fail(VMMT_EINVAL, "a rank list needs at least one rank (got %d%s)", n,
                          ranks == NULL ? ", and a NULL list" : "");
    s->lo = UINT32_MAX;
    for (int i = 0; i < n; i++) {
        int r = ranks[i];
        if (r < 0 || (uint32_t)r >= total) {
            memset(s, 0, sizeof *s);
            return vmmt__fail(VMMT_EINVAL,
                              "rank %d (entry %d of the list) is outside the pool's %u consumer "
                              "ranks; use 0..%u",
                              r, i, total, total - 1);
        }
        if (vmmt__ranks_has(s, (uint32_t)r)) {
            memset(s, 0, sizeof *s);
            return vmmt__fail(VMMT_EINVAL,
                              "rank %d is listed twice (entry %d); list each rank once", r, i);
        }
        s->bits[r / 64] |= 1ull << (r % 64);
        if ((uint32_t)r < s->lo) s->lo = (uint32_t)r;
        if ((uint32_t)r + 1 > s->hi) s->hi = (uint32_t)r + 1;
    }
    return VMMT_OK;
}

int vmmt__ranks_next_run(const struct vmmt__ranks *s, uint32_t *r, uint32_t *count)
{
    uint32_t a = *r < s->lo ? s->lo : *r, b;

    while (a < s->hi && !vmmt__ranks_has(s, a))
        a++;
    if (a >= s->hi) return 0;
    for (b = a; b < s->hi && vmmt__ranks_has(s, b); b++)
        continue;
    *r = a;
    *count = b - a;
    return 1;
}

const char *vmmt__ranks_name(const struct vmmt__ranks *s, char *buf, size_t size)
{
    uint32_t r = 0, count = 0;
    size_t used = 0;

    buf[0] = '\0';
    while (vmmt__ranks_next_run(s, &r, &count)) {
        int n = snprintf(buf + used, size - used, "%s[%u, %u)", used ? " and " : "", r, r + count);
        if (n < 0 || (size_t)n >= size - used) break; /* cut short: a message, not a record */
        used += (size_t)n;
        r += count;
    }
    return buf;
}
