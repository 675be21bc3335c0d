/*
 * Controls of the emulated driver for tests and the CLI. The settings come
 * from the environment (docs/emulator.md); vmmt__emu_configure re-reads them
 * and resets the failure counters, so one test process can run several
 * configurations in turn.
 */
#ifndef VMMT_EMU_H
#define VMMT_EMU_H

#include <stddef.h>

void vmmt__emu_configure(void);

#endif
