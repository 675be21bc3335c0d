/*
 * Controls of the emulated driver for tests. The settings come from the
 * environment (docs/emulator.md); vmmt__emu_configure re-reads them and
 * resets the failure counters, so one test process can run several
 * configurations in turn. libvmmt_emu.so exports these; tests reach them in
 * the instance the driver layer loaded (tests/lib/emu_controls.c).
 */
#ifndef VMMT_EMU_H
#define VMMT_EMU_H

#include <stddef.h>

#if defined(__GNUC__)
#define VMMT_EMU_API __attribute__((visibility("default")))
#else
#define VMMT_EMU_API
#endif

VMMT_EMU_API void vmmt__emu_configure(void);

/*
 * What this process holds in the emulator now, for leak checks: physical
 * allocations still alive (by handle or mapping, imports included), address
 * reservations, mappings, streams, events, and cuMemAlloc/cuMemAllocHost
 * blocks.
 */
VMMT_EMU_API int vmmt__emu_live_allocations(void);
VMMT_EMU_API int vmmt__emu_live_reservations(void);
VMMT_EMU_API int vmmt__emu_live_mappings(void);
VMMT_EMU_API int vmmt__emu_live_streams(void);
VMMT_EMU_API int vmmt__emu_live_events(void);
VMMT_EMU_API int vmmt__emu_live_blocks(void);
/* Modules loaded (cuModuleLoadData) and not unloaded. */
VMMT_EMU_API int vmmt__emu_live_modules(void);

/*
 * Primary contexts this process holds retained now (one per device with a
 * retain not yet released), and bytes of device memory it holds: its
 * cuMemCreate allocations on devices and its cuMemAlloc blocks (imports
 * excluded; host-NUMA allocations are counted apart).
 */
VMMT_EMU_API int vmmt__emu_live_contexts(void);
VMMT_EMU_API unsigned long long vmmt__emu_device_bytes(void);
VMMT_EMU_API unsigned long long vmmt__emu_host_numa_bytes(void);

/* Bytes of address space this process holds reserved now (cuMemAddressReserve). */
VMMT_EMU_API unsigned long long vmmt__emu_reserved_bytes(void);

/*
 * Calls of the entry point named `entry` (e.g. "cuMemMap") since the last
 * configure, failed ones included; -1 for a name that is no entry point.
 */
VMMT_EMU_API long vmmt__emu_calls(const char *entry);

#endif
