/*
 * Loading the CUDA driver at run time and choosing between it and the
 * emulator. libcuda is never linked: the library and the tool must start on
 * machines without a driver and say so in words.
 */
#include "driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

/* The oldest driver with every entry point above (stream memory operations v2). */
#define MIN_DRIVER_VERSION 11070
#define MAX_DEVICES        64

typedef CUresult (*get_proc_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*get_proc_v1_fn)(const char *, void **, int, cuuint64_t);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmmt_drv g_table;
static int g_loaded;     /* g_table is valid */
static char g_choice[8]; /* from vmmt_driver_select; empty: VMMT_DRIVER */
static void *g_libcuda;  /* kept open for the life of the process */
static CUcontext g_primary[MAX_DEVICES];
static int g_device_count; /* read once at load: the device set of a process is fixed */

static _Thread_local int t_depth;
/* Per nesting level: did enter push a context that leave must pop? */
static _Thread_local unsigned long long t_pushed;

int vmmt__drv_load_cuda(struct vmmt_drv *out)
{
    const char *path = getenv("VMMT_LIBCUDA");
    get_proc_v2_fn get_v2;
    get_proc_v1_fn get_v1;
    struct vmmt_drv t;
    int version = 0;
    CUresult r;

    if (path == NULL || *path == '\0') path = "libcuda.so.1";
    memset(&t, 0, sizeof t);
    t.name = "cuda";
    if (g_libcuda == NULL) g_libcuda = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (g_libcuda == NULL)
        return vmmt__fail(VMMT_ENODRIVER,
                          "no NVIDIA driver: %s could not be loaded: %s; install the NVIDIA "
                          "driver, or run with VMMT_DRIVER=emu to use the emulated driver",
                          path, dlerror());
    get_v2 = (get_proc_v2_fn)dlsym(g_libcuda, "cuGetProcAddress_v2");
    get_v1 = (get_proc_v1_fn)dlsym(g_libcuda, "cuGetProcAddress");
    if (get_v2 == NULL && get_v1 == NULL)
        return vmmt__fail(VMMT_ENODRIVER,
                          "NVIDIA driver too old: %s has no cuGetProcAddress; vmmt needs a "
                          "driver for CUDA 11.7 or newer",
                          path);

#define VMMT_DRV_RESOLVE(fn, ver, params)                                                          \
    {                                                                                              \
        void *p = NULL;                                                                            \
        int found = 0;                                                                             \
        r = get_v2 ? get_v2(#fn, &p, ver, 0, &found) : get_v1(#fn, &p, ver, 0);                    \
        if (r != CUDA_SUCCESS || p == NULL)                                                        \
            return vmmt__fail(VMMT_ENODRIVER,                                                      \
                              "NVIDIA driver %s lacks %s (asked for the CUDA %d.%d ABI, "          \
                              "result %d); update the driver",                                     \
                              path, #fn, (ver) / 1000, (ver) % 1000 / 10, (int)r);                 \
        t.fn = (CUresult(*) params)p;                                                              \
    }
    VMMT_DRV_ENTRIES(VMMT_DRV_RESOLVE)
#undef VMMT_DRV_RESOLVE

    r = t.cuInit(0);
    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        t.cuGetErrorName(r, &name);
        if (r == CUDA_ERROR_NO_DEVICE)
            return vmmt__fail(VMMT_ENODEV,
                              "no GPU: cuInit -> %s; the NVIDIA driver is installed but sees "
                              "no device (check CUDA_VISIBLE_DEVICES and nvidia-smi)",
                              name);
        return vmmt__fail(VMMT_ENODRIVER,
                          "NVIDIA driver failed to initialise: cuInit -> %s; check nvidia-smi",
                          name);
    }
    r = t.cuDriverGetVersion(&version);
    if (r == CUDA_SUCCESS && version < MIN_DRIVER_VERSION)
        return vmmt__fail(VMMT_ENODRIVER,
                          "NVIDIA driver too old: it supports CUDA %d.%d, vmmt needs %d.%d or "
                          "newer; update the driver",
                          version / 1000, version % 1000 / 10, MIN_DRIVER_VERSION / 1000,
                          MIN_DRIVER_VERSION % 1000 / 10);
    *out = t;
    return VMMT_OK;
}

static int load_locked(void)
{
    const char *want = g_choice[0] ? g_choice : getenv("VMMT_DRIVER");
    int st;

    if (g_loaded) return VMMT_OK;
    if (want == NULL || *want == '\0' || strcmp(want, "cuda") == 0) {
        st = vmmt__drv_load_cuda(&g_table);
        if (st != VMMT_OK) return st;
    } else if (strcmp(want, "emu") == 0) {
        vmmt__drv_load_emu(&g_table);
        if (g_table.cuInit(0) != CUDA_SUCCESS)
            return vmmt__fail(VMMT_ENODRIVER, "emulated driver failed to initialise");
    } else {
        return vmmt__fail(VMMT_EINVAL,
                          "unknown driver '%s' (from VMMT_DRIVER or vmmt_driver_select); use "
                          "'cuda' or 'emu'",
                          want);
    }
    if (g_table.cuDeviceGetCount(&g_device_count) != CUDA_SUCCESS) g_device_count = 0;
    __atomic_store_n(&g_loaded, 1, __ATOMIC_RELEASE);
    return VMMT_OK;
}

const struct vmmt_drv *vmmt__drv(void)
{
    int st;

    /* Every driver call goes through here: no lock once the table is loaded. */
    if (__atomic_load_n(&g_loaded, __ATOMIC_ACQUIRE)) return &g_table;
    pthread_mutex_lock(&g_lock);
    st = load_locked();
    pthread_mutex_unlock(&g_lock);
    return st == VMMT_OK ? &g_table : NULL;
}

int vmmt_driver_select(const char *name)
{
    int st = VMMT_OK;

    if (name == NULL || (strcmp(name, "cuda") != 0 && strcmp(name, "emu") != 0))
        return vmmt__fail(VMMT_EINVAL, "unknown driver '%s'; use 'cuda' or 'emu'",
                          name ? name : "(null)");
    pthread_mutex_lock(&g_lock);
    if (g_loaded && strcmp(g_table.name, name) != 0)
        st = vmmt__fail(VMMT_ESTATE,
                        "cannot select driver '%s': driver '%s' is already in use in this "
                        "process; select the driver before any other vmmt call",
                        name, g_table.name);
    else
        snprintf(g_choice, sizeof g_choice, "%s", name);
    pthread_mutex_unlock(&g_lock);
    return st;
}

const char *vmmt_driver_name(void)
{
    const struct vmmt_drv *d = vmmt__drv();
    return d ? d->name : NULL;
}

int vmmt_driver_version(int *version)
{
    const struct vmmt_drv *d = vmmt__drv();
    if (d == NULL) return vmmt_last_status();
    if (version == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_driver_version: version is NULL");
    return VMMT_CU(d, cuDriverGetVersion(version));
}

int vmmt_device_count(int *count)
{
    const struct vmmt_drv *d = vmmt__drv();
    if (d == NULL) return vmmt_last_status();
    if (count == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_device_count: count is NULL");
    return VMMT_CU(d, cuDeviceGetCount(count));
}

const char *vmmt__cu_name(CUresult r)
{
    static _Thread_local char buf[32];
    const char *name = NULL;

    if (__atomic_load_n(&g_loaded, __ATOMIC_ACQUIRE) &&
        g_table.cuGetErrorName(r, &name) == CUDA_SUCCESS && name != NULL)
        return name;
    snprintf(buf, sizeof buf, "CUDA error %d", (int)r);
    return buf;
}

int vmmt__ctx_enter(int device)
{
    const struct vmmt_drv *d = vmmt__drv();
    CUcontext ctx, cur = NULL;
    CUdevice dev;
    int st = VMMT_OK;

    if (d == NULL) return vmmt_last_status();
    if (device < 0 || device >= MAX_DEVICES || device >= g_device_count)
        return vmmt__fail(VMMT_ENODEV,
                          "device %d does not exist: the %s driver reports %d device(s); use "
                          "a device from 0 to %d",
                          device, d->name, g_device_count, g_device_count - 1);
    ctx = __atomic_load_n(&g_primary[device], __ATOMIC_ACQUIRE);
    if (ctx == NULL) {
        pthread_mutex_lock(&g_lock);
        ctx = g_primary[device];
        if (ctx == NULL) {
            st = VMMT_CU(d, cuDeviceGet(&dev, device));
            if (st == VMMT_OK) st = VMMT_CU(d, cuDevicePrimaryCtxRetain(&ctx, dev));
            if (st == VMMT_OK) __atomic_store_n(&g_primary[device], ctx, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&g_lock);
        if (st != VMMT_OK)
            return vmmt__wrap(st, "making device %d's primary context current", device);
    }
    if (t_depth >= 64) return vmmt__fail(VMMT_ESTATE, "vmmt calls nested too deeply");
    /* Applications (PyTorch, CuPy) usually have the primary context current
     * already; then there is nothing to push, and nothing to restore. */
    if (d->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx) {
        t_pushed &= ~(1ull << t_depth);
        t_depth++;
        return VMMT_OK;
    }
    st = VMMT_CU(d, cuCtxPushCurrent(ctx));
    if (st != VMMT_OK) return st;
    t_pushed |= 1ull << t_depth;
    t_depth++;
    return VMMT_OK;
}

void vmmt__ctx_leave(void)
{
    CUcontext popped;

    if (t_depth == 0) return;
    t_depth--;
    if (t_pushed & (1ull << t_depth)) (void)g_table.cuCtxPopCurrent(&popped);
}
