/*
 * Where a pool's fd broker listens. Shared by the broker and the descriptor
 * codec, which carries it to consumers, so it lives alone in this header.
 */
#ifndef VMMT_BROKER_ADDR_H
#define VMMT_BROKER_ADDR_H

#include <stdint.h>

/*
 * kind 0: an abstract AF_UNIX name; `name` holds it WITHOUT the leading NUL
 * byte. kind 1: a filesystem path. `len` is the name's length (at most 107),
 * and `name` need not be NUL-terminated.
 */
struct vmmt__broker_addr {
    uint8_t kind;
    uint8_t len;
    char name[108];
};

#endif
