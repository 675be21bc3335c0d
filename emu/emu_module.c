/*
 * Modules and kernel launches. The emulator runs no GPU code: it knows one
 * program, the library's publish kernel (src/driver/kernel_ptx.h), by its
 * exact text, and runs that kernel's work (copy the words, then store the
 * word) as one stream operation (emu_stream.c). Any other image is refused
 * as a driver refuses PTX it cannot compile, so a library that sent
 * something else would fall back, and its tests would say so.
 *
 * A module belongs to the device of the context current when it was loaded;
 * its function launches only there, as a module of one context is unknown
 * in another.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "emu_internal.h"
#include "kernel_ptx.h"

struct CUfunc_st {
    struct CUmod_st *mod;
};

struct CUmod_st {
    struct CUmod_st *next; /* live list, under the emulator mutex */
    int device;
    struct CUfunc_st fn;
};

static struct CUmod_st *g_mods;
static int g_n_mods;

int vmmt__emu_live_modules(void)
{
    int n;

    vmmt__emu_lock();
    n = g_n_mods;
    vmmt__emu_unlock();
    return n;
}

/* Whether m is a loaded module; mutex held. */
static int mod_live(const struct CUmod_st *m)
{
    for (const struct CUmod_st *x = g_mods; x != NULL; x = x->next)
        if (x == m) return 1;
    return 0;
}

CUresult vmmt__emu_cuModuleLoadData(CUmodule *out, const void *image)
{
    struct CUmod_st *m;
    int device;

    EMU_ENTER(cuModuleLoadData, 1);
    if (out == NULL || image == NULL) return CUDA_ERROR_INVALID_VALUE;
    if ((device = vmmt__emu_current_device()) < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (strcmp((const char *)image, VMMT__KERNEL_PTX) != 0) return CUDA_ERROR_INVALID_PTX;
    if ((m = calloc(1, sizeof *m)) == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    m->device = device;
    m->fn.mod = m;
    vmmt__emu_lock();
    m->next = g_mods;
    g_mods = m;
    g_n_mods++;
    vmmt__emu_unlock();
    *out = m;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuModuleUnload(CUmodule m)
{
    struct CUmod_st **at;

    EMU_ENTER(cuModuleUnload, 1);
    vmmt__emu_lock();
    for (at = &g_mods; *at != NULL && *at != m; at = &(*at)->next)
        ;
    if (*at == NULL) {
        vmmt__emu_unlock();
        return CUDA_ERROR_INVALID_HANDLE;
    }
    *at = m->next;
    g_n_mods--;
    vmmt__emu_unlock();
    free(m);
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuModuleGetFunction(CUfunction *out, CUmodule m, const char *name)
{
    CUresult r = CUDA_SUCCESS;

    EMU_ENTER(cuModuleGetFunction, 1);
    if (out == NULL || name == NULL) return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    if (!mod_live(m))
        r = CUDA_ERROR_INVALID_HANDLE;
    else if (strcmp(name, VMMT__KERNEL_NAME) != 0)
        r = CUDA_ERROR_NOT_FOUND;
    else
        *out = &m->fn;
    vmmt__emu_unlock();
    return r;
}

/*
 * The kernel's parameters are read at launch, as a driver copies them; its
 * addresses are not checked until it runs. One block of at most 1024
 * threads, as the kernel is written for, and at least one 16-byte word.
 */
CUresult vmmt__emu_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                  unsigned by, unsigned bz, unsigned shared, CUstream s,
                                  void **params, void **extra)
{
    uint64_t dst, src, words, word;
    uint32_t value;
    int device = -1;

    EMU_ENTER(cuLaunchKernel, 1);
    if (params == NULL || extra != NULL || shared != 0) return CUDA_ERROR_INVALID_VALUE;
    if (gx != 1 || gy != 1 || gz != 1 || bx == 0 || bx > 1024 || by != 1 || bz != 1)
        return CUDA_ERROR_INVALID_VALUE;
    vmmt__emu_lock();
    if (f != NULL && mod_live(f->mod)) device = f->mod->device;
    vmmt__emu_unlock();
    if (device < 0) return CUDA_ERROR_INVALID_HANDLE;
    memcpy(&dst, params[0], sizeof dst);
    memcpy(&src, params[1], sizeof src);
    memcpy(&words, params[2], sizeof words);
    memcpy(&word, params[3], sizeof word);
    memcpy(&value, params[4], sizeof value);
    if (words == 0 || words > SIZE_MAX / 16) return CUDA_ERROR_INVALID_VALUE;
    return vmmt__emu_enqueue_kernel(s, device, (uintptr_t)dst, (uintptr_t)src, (size_t)words * 16,
                                    (uintptr_t)word, value);
}
