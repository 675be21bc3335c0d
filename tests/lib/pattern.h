/* Known buffer contents for transport tests: byte j of buffer i. */
#ifndef VMMT_PATTERN_H
#define VMMT_PATTERN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static inline uint8_t tu_pattern_byte(uint32_t buffer, size_t j)
{
    return (uint8_t)(j * 13u + buffer * 7u + 3u);
}

static inline void tu_pattern_fill(uint8_t *p, size_t n, uint32_t buffer)
{
    for (size_t j = 0; j < n; j++)
        p[j] = tu_pattern_byte(buffer, j);
}

/* Index of the first wrong byte, or n when all match. */
static inline size_t tu_pattern_check(const uint8_t *p, size_t n, uint32_t buffer)
{
    for (size_t j = 0; j < n; j++)
        if (p[j] != tu_pattern_byte(buffer, j)) return j;
    return n;
}

/* One message on the test's descriptor socket. */
struct tu_msg {
    uint32_t index; /* UINT32_MAX: no more buffers */
    uint32_t pad;   /* what consumer_child does with it: 0 consume, else TU_MSG_* */
    uint8_t desc[512];
};

#define TU_MSG_KEEP    1u /* keep the descriptor unconsumed (a slow rank); status 1 */
#define TU_MSG_LINGER  2u /* fork a worker that keeps what it inherited; its pid in first_bad */
#define TU_MSG_RANK(r) (0x100u + (uint32_t)(r)) /* consume for rank r alone */

/* Send message `index` (with `pad`, and the descriptor's bytes unless d is NULL) on fd;
 * 0, or -1 where the write fell short. */
static inline int tu_send_msg(int fd, uint32_t index, uint32_t pad, const uint8_t d[512])
{
    struct tu_msg m;

    memset(&m, 0, sizeof m);
    m.index = index;
    m.pad = pad;
    if (d != NULL) memcpy(m.desc, d, sizeof m.desc);
    return write(fd, &m, sizeof m) == (ssize_t)sizeof m ? 0 : -1;
}

/* The consumer's answer for one buffer. */
struct tu_reply {
    uint32_t index;
    int32_t status;     /* vmmt status of the consume */
    uint64_t first_bad; /* == nbytes when every byte matched */
};

#endif
