/*
 * What libvmmt_emu.so exports, the way libcuda does: cuGetProcAddress (both
 * ABIs), through which libvmmt resolves its table exactly as it does from
 * libcuda, and every entry point under its driver name. Plus
 * vmmt__driver_name, by which the driver layer tells this library from
 * libcuda without knowing anything else of it.
 */
#include <string.h>

#include "emu_internal.h"

#define EMU_API __attribute__((visibility("default")))

/* cuGetProcAddress's symbolStatus values (CUdriverProcAddressQueryResult). */
enum { PROC_FOUND = 0, PROC_NOT_FOUND = 1 };

EMU_API const char *vmmt__driver_name(void);
EMU_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
EMU_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                     int *status);

const char *vmmt__driver_name(void)
{
    return "emu";
}

/* Function pointers travel as void *, as cuGetProcAddress hands them out. */
static const struct {
    const char *name;
    void *fn;
} g_procs[] = {
#define EMU_PROC(fn, ver, params) {#fn, (void *)vmmt__emu_##fn},
    VMMT_DRV_ENTRIES(EMU_PROC)
#undef EMU_PROC
};

/* Every version is served the one ABI the emulator has: the one driver.h asks for. */
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             int *status)
{
    (void)version;
    (void)flags;
    if (status != NULL) *status = PROC_NOT_FOUND;
    if (symbol == NULL || pfn == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++)
        if (strcmp(symbol, g_procs[i].name) == 0) {
            *pfn = g_procs[i].fn;
            if (status != NULL) *status = PROC_FOUND;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/*
 * The entry points under the driver's own names, for programs that dlsym
 * them as they would from libcuda. The parameter lists of driver.h carry
 * types only; these macros name them a1..a5 (a1..a11 for cuLaunchKernel).
 */
#define EMU_NARGS(...)                                      EMU_NARGS_(__VA_ARGS__, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define EMU_NARGS_(a, b, c, d, e, f, g, h, i, j, k, n, ...) n
#define EMU_CAT(a, b)                                       EMU_CAT_(a, b)
#define EMU_CAT_(a, b)                                      a##b
#define EMU_P1(t1)                                          t1 a1
#define EMU_P2(t1, t2)                                      t1 a1, t2 a2
#define EMU_P3(t1, t2, t3)                                  t1 a1, t2 a2, t3 a3
#define EMU_P4(t1, t2, t3, t4)                              t1 a1, t2 a2, t3 a3, t4 a4
#define EMU_P5(t1, t2, t3, t4, t5)                          t1 a1, t2 a2, t3 a3, t4 a4, t5 a5
#define EMU_P11(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11)                                      \
    t1 a1, t2 a2, t3 a3, t4 a4, t5 a5, t6 a6, t7 a7, t8 a8, t9 a9, t10 a10, t11 a11
#define EMU_A1          a1
#define EMU_A2          a1, a2
#define EMU_A3          a1, a2, a3
#define EMU_A4          a1, a2, a3, a4
#define EMU_A5          a1, a2, a3, a4, a5
#define EMU_A11         a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11
#define EMU_PARAMS(...) EMU_CAT(EMU_P, EMU_NARGS(__VA_ARGS__))(__VA_ARGS__)
#define EMU_ARGS(...)   EMU_CAT(EMU_A, EMU_NARGS(__VA_ARGS__))

#define EMU_DECLARE(fn, ver, params) EMU_API CUresult fn params;
VMMT_DRV_ENTRIES(EMU_DECLARE)
#undef EMU_DECLARE

#define EMU_DEFINE(fn, ver, params)                                                                \
    CUresult fn(EMU_PARAMS params)                                                                 \
    {                                                                                              \
        return vmmt__emu_##fn(EMU_ARGS params);                                                    \
    }
VMMT_DRV_ENTRIES(EMU_DEFINE)
#undef EMU_DEFINE
