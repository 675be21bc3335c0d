/*
 * The emulator's test controls (emu.h), reached in the library the driver
 * layer opened, so that a test configures and counts the very emulator
 * instance its pools run on. The test programs do not link libvmmt_emu.so:
 * its cu* symbols must never enter a process's global scope, where they could
 * shadow libcuda's when the same tests run on a GPU (VMMT_TEST_DRIVER=cuda).
 * With another driver in use the controls do nothing and count nothing; on
 * the emulator a control it does not export stops the test.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "driver.h"
#include "emu.h"
#include "vmmt.h"

static void *control(const char *name)
{
    void *lib = vmmt__drv_library();
    void *f = lib != NULL ? dlsym(lib, name) : NULL;

    /* On the emulator a missing control would let a leak check pass unchecked. */
    if (f == NULL && lib != NULL && dlsym(lib, "vmmt__driver_name") != NULL) {
        fprintf(stderr, "emulated driver in use but it exports no %s\n", name);
        abort();
    }
    return f;
}

void vmmt__emu_configure(void)
{
    void (*f)(void) = (void (*)(void))control("vmmt__emu_configure");
    if (f != NULL) f();
}

#define EMU_COUNTER(name)                                                                          \
    int name(void)                                                                                 \
    {                                                                                              \
        int (*f)(void) = (int (*)(void))control(#name);                                            \
        return f != NULL ? f() : 0;                                                                \
    }
EMU_COUNTER(vmmt__emu_live_allocations)
EMU_COUNTER(vmmt__emu_live_reservations)
EMU_COUNTER(vmmt__emu_live_mappings)
EMU_COUNTER(vmmt__emu_live_streams)
EMU_COUNTER(vmmt__emu_live_events)
EMU_COUNTER(vmmt__emu_live_blocks)
EMU_COUNTER(vmmt__emu_live_modules)
EMU_COUNTER(vmmt__emu_live_contexts)

#define EMU_BYTES(name)                                                                            \
    unsigned long long name(void)                                                                  \
    {                                                                                              \
        unsigned long long (*f)(void) = (unsigned long long (*)(void))control(#name);              \
        return f != NULL ? f() : 0;                                                                \
    }
EMU_BYTES(vmmt__emu_device_bytes)
EMU_BYTES(vmmt__emu_host_numa_bytes)
EMU_BYTES(vmmt__emu_reserved_bytes)

long vmmt__emu_calls(const char *entry)
{
    long (*f)(const char *) = (long (*)(const char *))control("vmmt__emu_calls");
    return f != NULL ? f(entry) : -1;
}
