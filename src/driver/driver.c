/*
 * Loading the driver library at run time: libcuda, or another library that
 * implements the same entry points (the emulated driver, libvmmt_emu.so).
 * Both are opened and resolved the same way, dlopen then cuGetProcAddress,
 * so this layer knows no driver but by the name of its library. libcuda is
 * never linked: the library and the tool must start on machines without a
 * driver and say so in words.
 */
#include "driver.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "status.h"

/* The oldest driver with every entry point above (stream memory operations v2). */
#define MIN_DRIVER_VERSION 11070
#define MAX_DEVICES        64
#define EMU_LIBRARY        "libvmmt_emu.so"

#ifndef VMMT_INSTALL_LIBDIR
#define VMMT_INSTALL_LIBDIR "lib"
#endif

typedef CUresult (*get_proc_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*get_proc_v1_fn)(const char *, void **, int, cuuint64_t);
typedef const char *(*driver_name_fn)(void);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmmt_drv g_table;
static int g_opened;               /* g_lib is open and g_table resolved, not yet initialised */
static int g_loaded;               /* g_table is valid and initialised */
static char g_choice[PATH_MAX];    /* from vmmt_driver_select; empty: VMMT_DRIVER */
static char g_opened_as[PATH_MAX]; /* the choice g_lib was opened for */
static void *g_lib;                /* kept open for the life of the process */
static CUcontext g_primary[MAX_DEVICES];
static int g_device_count; /* read once at load: the device set of a process is fixed */

static _Thread_local int t_depth;
/* Per nesting level: did enter push a context that leave must pop? */
static _Thread_local unsigned long long t_pushed;

/* Append "path (why)" to a list of tried paths for the error message. */
static void tried_add(char *tried, size_t cap, const char *path, const char *why)
{
    size_t n = strlen(tried), plen = strlen(path);

    /* dlerror starts with the path itself: say it once. */
    if (strncmp(why, path, plen) == 0 && strncmp(why + plen, ": ", 2) == 0) why += plen + 2;
    if (n < cap) snprintf(tried + n, cap - n, "%s%s (%s)", n ? "; " : "", path, why);
}

static void *try_open(const char *path, char *tried, size_t cap)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        tried_add(tried, cap, path, why ? why : "not loadable");
    }
    return lib;
}

/* One library the user named: loaded, or an error naming it and what to do. */
static void *open_exact(const char *name, char *path, size_t cap, const char *what,
                        const char *advice)
{
    char tried[PATH_MAX + 1024] = "";
    void *lib;

    snprintf(path, cap, "%s", name);
    lib = try_open(path, tried, sizeof tried);
    if (lib == NULL) vmmt__fail(VMMT_ENODRIVER, "%s %s; %s", what, tried, advice);
    return lib;
}

/*
 * The folder of the object that holds this code: the shared library, or the
 * program (or Python extension) it was linked into statically. For the main
 * program dladdr gives argv[0], which may be a bare name; /proc/self/exe does not.
 */
static int own_folder(char *buf, size_t cap)
{
    Dl_info info;
    char *slash;
    ssize_t n;

    if (dladdr(&g_lock, &info) == 0 || info.dli_fname == NULL) return -1;
    if (strcmp(info.dli_fname, program_invocation_name) == 0 ||
        strchr(info.dli_fname, '/') == NULL) {
        n = readlink("/proc/self/exe", buf, cap - 1);
        if (n <= 0) return -1;
        buf[n] = '\0';
    } else {
        snprintf(buf, cap, "%s", info.dli_fname);
    }
    slash = strrchr(buf, '/');
    if (slash == NULL) return -1;
    *slash = '\0';
    return 0;
}

/*
 * The emulated driver, found in order at $VMMT_EMU_LIBRARY (alone when set:
 * an explicit choice is not silently replaced), beside the object holding
 * libvmmt's code, in the install layout's library folder next to it (a
 * program in bin/), in the configured install folder, then by the dynamic
 * loader's own search.
 */
static void *open_emu(char *path, size_t cap)
{
    const char *env = getenv("VMMT_EMU_LIBRARY");
    char tried[3072] = "", dir[PATH_MAX];
    void *lib;

    if (env != NULL && *env != '\0')
        return open_exact(env, path, cap, "emulated driver not found: VMMT_EMU_LIBRARY names",
                          "set it to the path of libvmmt_emu.so, or unset it to search beside "
                          "libvmmt");
    if (own_folder(dir, sizeof dir) == 0) {
        snprintf(path, cap, "%s/%s", dir, EMU_LIBRARY);
        if ((lib = try_open(path, tried, sizeof tried)) != NULL) return lib;
        snprintf(path, cap, "%s/../%s/%s", dir, VMMT_INSTALL_LIBDIR, EMU_LIBRARY);
        if ((lib = try_open(path, tried, sizeof tried)) != NULL) return lib;
    }
#ifdef VMMT_INSTALL_FULL_LIBDIR
    snprintf(path, cap, "%s/%s", VMMT_INSTALL_FULL_LIBDIR, EMU_LIBRARY);
    if ((lib = try_open(path, tried, sizeof tried)) != NULL) return lib;
#endif
    snprintf(path, cap, "%s", EMU_LIBRARY);
    if ((lib = try_open(path, tried, sizeof tried)) != NULL) return lib;
    vmmt__fail(VMMT_ENODRIVER,
               "emulated driver not found: tried %s; install vmmt (make install) or set "
               "VMMT_EMU_LIBRARY to the path of libvmmt_emu.so",
               tried);
    return NULL;
}

/* Open the library `want` names: "cuda" (or empty), "emu", or a path. */
static void *open_library(const char *want, char *path, size_t cap)
{
    const char *env = getenv("VMMT_LIBCUDA");
    void *lib;

    if (strcmp(want, "emu") == 0) return open_emu(path, cap);
    if (strchr(want, '/') != NULL)
        return open_exact(want, path, cap, "driver library could not be loaded:",
                          "name an existing driver library in VMMT_DRIVER, or use 'cuda' or "
                          "'emu'");
    snprintf(path, cap, "%s", env != NULL && *env != '\0' ? env : "libcuda.so.1");
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        vmmt__fail(VMMT_ENODRIVER,
                   "no NVIDIA driver: %s could not be loaded: %s; install the NVIDIA "
                   "driver, or run with VMMT_DRIVER=emu to use the emulated driver",
                   path, dlerror());
    return lib;
}

static int valid_choice(const char *want)
{
    return want[0] == '\0' || strcmp(want, "cuda") == 0 || strcmp(want, "emu") == 0 ||
           strchr(want, '/') != NULL;
}

int vmmt__drv_open(const char *want, struct vmmt_drv *out, void **handle)
{
    char path[PATH_MAX];
    get_proc_v2_fn get_v2;
    get_proc_v1_fn get_v1;
    driver_name_fn name_of;
    struct vmmt_drv t;
    void *lib;
    CUresult r;

    if (want == NULL) want = "";
    if (!valid_choice(want))
        return vmmt__fail(VMMT_EINVAL,
                          "unknown driver '%s' (from VMMT_DRIVER or vmmt_driver_select); use "
                          "'cuda', 'emu' or the path of a driver library",
                          want);
    lib = open_library(want, path, sizeof path);
    if (lib == NULL) return vmmt_last_status();
    memset(&t, 0, sizeof t);
    /* A driver library other than libcuda names itself; libvmmt_emu.so says "emu". */
    name_of = (driver_name_fn)dlsym(lib, "vmmt__driver_name");
    t.name = name_of != NULL && name_of() != NULL ? name_of() : "cuda";
    get_v2 = (get_proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    get_v1 = (get_proc_v1_fn)dlsym(lib, "cuGetProcAddress");
    if (get_v2 == NULL && get_v1 == NULL)
        return vmmt__fail(VMMT_ENODRIVER,
                          "driver too old: %s has no cuGetProcAddress; vmmt needs a driver "
                          "for CUDA 11.7 or newer",
                          path);

#define VMMT_DRV_RESOLVE(fn, ver, params)                                                          \
    {                                                                                              \
        void *p = NULL;                                                                            \
        int found = 0;                                                                             \
        r = get_v2 ? get_v2(#fn, &p, ver, 0, &found) : get_v1(#fn, &p, ver, 0);                    \
        if (r != CUDA_SUCCESS || p == NULL)                                                        \
            return vmmt__fail(VMMT_ENODRIVER,                                                      \
                              "driver %s lacks %s (asked for the CUDA %d.%d ABI, result %d); "     \
                              "update the driver",                                                 \
                              path, #fn, (ver) / 1000, (ver) % 1000 / 10, (int)r);                 \
        t.fn = (CUresult(*) params)p;                                                              \
    }
    VMMT_DRV_ENTRIES(VMMT_DRV_RESOLVE)
#undef VMMT_DRV_RESOLVE

    *out = t;
    if (handle != NULL) *handle = lib;
    return VMMT_OK;
}

static int init_table(struct vmmt_drv *t)
{
    int version = 0;
    CUresult r = t->cuInit(0);

    if (r != CUDA_SUCCESS) {
        const char *name = "?";
        t->cuGetErrorName(r, &name);
        if (r == CUDA_ERROR_NO_DEVICE)
            return vmmt__fail(VMMT_ENODEV,
                              "no GPU: cuInit -> %s; the %s driver is loaded but sees no device "
                              "(check CUDA_VISIBLE_DEVICES and nvidia-smi)",
                              name, t->name);
        return vmmt__fail(VMMT_ENODRIVER, "%s driver failed to initialise: cuInit -> %s%s", t->name,
                          name, strcmp(t->name, "cuda") == 0 ? "; check nvidia-smi" : "");
    }
    r = t->cuDriverGetVersion(&version);
    if (r == CUDA_SUCCESS && version < MIN_DRIVER_VERSION)
        return vmmt__fail(VMMT_ENODRIVER,
                          "NVIDIA driver too old: it supports CUDA %d.%d, vmmt needs %d.%d or "
                          "newer; update the driver",
                          version / 1000, version % 1000 / 10, MIN_DRIVER_VERSION / 1000,
                          MIN_DRIVER_VERSION % 1000 / 10);
    return VMMT_OK;
}

static const char *choice_locked(void)
{
    const char *want = g_choice[0] ? g_choice : getenv("VMMT_DRIVER");
    return want != NULL ? want : "";
}

static int open_locked(void)
{
    const char *want = choice_locked();
    int st;

    if (g_opened) return VMMT_OK;
    st = vmmt__drv_open(want, &g_table, &g_lib);
    if (st != VMMT_OK) return st;
    snprintf(g_opened_as, sizeof g_opened_as, "%s", want);
    g_opened = 1;
    return VMMT_OK;
}

static int load_locked(void)
{
    int st;

    if (g_loaded) return VMMT_OK;
    st = open_locked();
    if (st == VMMT_OK) st = init_table(&g_table);
    if (st != VMMT_OK) return st;
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

void *vmmt__drv_library(void)
{
    int st;

    pthread_mutex_lock(&g_lock);
    st = open_locked();
    pthread_mutex_unlock(&g_lock);
    return st == VMMT_OK ? g_lib : NULL;
}

int vmmt_driver_select(const char *name)
{
    int st = VMMT_OK;

    if (name == NULL || name[0] == '\0' || !valid_choice(name) || strlen(name) >= sizeof g_choice)
        return vmmt__fail(VMMT_EINVAL,
                          "unknown driver '%s'; use 'cuda', 'emu' or the path of a driver "
                          "library",
                          name ? name : "(null)");
    pthread_mutex_lock(&g_lock);
    if (g_loaded && strcmp(g_opened_as, name) != 0 && strcmp(g_table.name, name) != 0) {
        st = vmmt__fail(VMMT_ESTATE,
                        "cannot select driver '%s': driver '%s' is already in use in this "
                        "process; select the driver before any other vmmt call",
                        name, g_table.name);
    } else if (!g_loaded) {
        /* A library opened but never initialised (cuInit failed) is left open, unused. */
        if (g_opened && strcmp(g_opened_as, name) != 0) g_opened = 0;
        snprintf(g_choice, sizeof g_choice, "%s", name);
    }
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
