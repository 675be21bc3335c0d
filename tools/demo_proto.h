/* What the demo's producer and consumer processes say to each other. */
#ifndef VMMT_DEMO_PROTO_H
#define VMMT_DEMO_PROTO_H

#include <stdint.h>

#include "vmmt.h"

#define DEMO_END      UINT32_MAX
#define DEMO_PATTERNS 4

struct demo_msg {
    uint32_t index;   /* buffer number, or DEMO_END */
    uint32_t pattern; /* which known content the bytes hold */
    vmmt_desc desc;
};

struct demo_reply {
    uint32_t index;
    int32_t status;     /* of the consume */
    uint64_t first_bad; /* == nbytes when every byte matched */
    char error[240];
};

static inline uint8_t demo_byte(uint32_t pattern, uint64_t j)
{
    return (uint8_t)(j * 131u + pattern * 29u + 7u);
}

int demo_consumer_main(int argc, char **argv);

#endif
