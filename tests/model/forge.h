/* Forged descriptors for the model test (tests/model/forge.c). */
#ifndef VMMT_MODEL_FORGE_H
#define VMMT_MODEL_FORGE_H

#include <stdint.h>

#include "proto.h"

/* What the model knows that a forgery may use: the pool's slots and the occupants. */
struct mt_forge_in {
    uint32_t slots;
    const uint32_t *slot_gen; /* the last generation handed out per slot */
    int live_ok;              /* live_slot/live_gen name another LIVE occupant */
    uint32_t live_slot, live_gen;
};

int mt_forge_count(void);
const char *mt_forge_name(int which);
/* The mutation that names the slot's next generation (costs a consumer's timeout on a host table).
 */
int mt_forge_is_one_ahead(int which);
/* Change field `which` of d; r picks the form (valid or not) and the value. */
void mt_forge(vmmt_desc *d, int which, uint64_t r, const struct mt_forge_in *in);

#endif
