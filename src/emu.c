/* Placeholder: the emulated driver is being written. Every entry fails. */
#include "driver.h"
#include "emu.h"

#define STUB(fn, ver, params)                                                                      \
    static CUresult emu_##fn params                                                                \
    {                                                                                              \
        return CUDA_ERROR_NOT_SUPPORTED;                                                           \
    }
#pragma GCC diagnostic ignored "-Wunused-parameter"
VMMT_DRV_ENTRIES(STUB)

void vmmt__drv_load_emu(struct vmmt_drv *out)
{
    out->name = "emu";
#define FILL(fn, ver, params) out->fn = emu_##fn;
    VMMT_DRV_ENTRIES(FILL)
}
void vmmt__emu_configure(void) {}
