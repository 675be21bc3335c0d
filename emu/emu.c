/*
 * The emulated CUDA driver: settings, devices, primary contexts, error names
 * and injected failures. Memory lives in emu_mem.c, streams and events in
 * emu_stream.c. The emulator behaves like the driver, failures included, so
 * that the library's real code paths run on machines without a GPU.
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu.h"
#include "emu_internal.h"

#define DEFAULT_DEVICES         2
#define DEFAULT_GRANULARITY     ((size_t)2 << 20)
#define DEFAULT_WAIT_TIMEOUT_MS 10000
#define DEFAULT_TOTAL_MEM       (16ULL << 30)
#define DRIVER_VERSION          13000
#define CTX_DEPTH               32
#define MAX_RULES               32

struct CUctx_st {
    int device;
    atomic_int refs; /* primary context retains; 0: inactive */
};

struct fail_rule {
    enum emu_entry entry;
    long nth; /* 1-based call number; 0 fails every call */
    CUresult result;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct emu_cfg g_cfg;
static atomic_int g_configured;
static atomic_int g_initialized;
static struct CUctx_st g_ctx[EMU_MAX_DEVICES];
static struct fail_rule g_rules[MAX_RULES];
static int g_nrules;
static atomic_int g_have_rules;
static atomic_long g_calls[EMU_N_ENTRIES];
static char g_fail_reported[1024]; /* the VMMT_EMU_FAIL text already complained about */

static _Thread_local CUcontext t_stack[CTX_DEPTH];
static _Thread_local int t_depth;

static const char *const g_entry_names[EMU_N_ENTRIES] = {
#define EMU_ENTRY_NAME(fn, ver, params) #fn,
    VMMT_DRV_ENTRIES(EMU_ENTRY_NAME)
#undef EMU_ENTRY_NAME
};

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
     "too many resources requested for launch"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "timeout occurred"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
#define N_ERRORS (sizeof g_errors / sizeof g_errors[0])

void vmmt__emu_lock(void)
{
    pthread_mutex_lock(&g_mu);
}
void vmmt__emu_unlock(void)
{
    pthread_mutex_unlock(&g_mu);
}
const struct emu_cfg *vmmt__emu_cfg(void)
{
    return &g_cfg;
}

/* ------------------------------------------------------------- settings */

/* An unsigned setting; def when unset, empty or malformed (then said on stderr). */
static unsigned long long env_number(const char *name, unsigned long long def)
{
    const char *s = getenv(name);
    unsigned long long v;
    char *end;

    if (s == NULL || *s == '\0') return def;
    v = strtoull(s, &end, 0);
    if (*end != '\0' || *s == '-') {
        fprintf(stderr, "vmmt emu: %s=%s is not a number; using %llu\n", name, s, def);
        return def;
    }
    return v;
}

static size_t read_granularity(void)
{
    unsigned long long g = env_number("VMMT_EMU_GRANULARITY", DEFAULT_GRANULARITY);

    /* mmap places mappings at page granularity, so smaller units cannot work. */
    if (g < 4096 || (g & (g - 1)) != 0 || g > ((size_t)1 << 40)) {
        fprintf(stderr,
                "vmmt emu: VMMT_EMU_GRANULARITY=%llu is not a power of two >= 4096; "
                "using %zu\n",
                g, DEFAULT_GRANULARITY);
        return DEFAULT_GRANULARITY;
    }
    return (size_t)g;
}

static unsigned read_handles(void)
{
    const char *s = getenv("VMMT_EMU_HANDLES");
    unsigned bits = 0;
    char buf[256], *save = NULL;

    if (s == NULL || *s == '\0') return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    snprintf(buf, sizeof buf, "%s", s);
    for (char *t = strtok_r(buf, ", ", &save); t != NULL; t = strtok_r(NULL, ", ", &save)) {
        if (strcmp(t, "posix_fd") == 0)
            bits |= CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        else if (strcmp(t, "fabric") == 0)
            bits |= CU_MEM_HANDLE_TYPE_FABRIC;
        else if (strcmp(t, "none") != 0)
            fprintf(stderr,
                    "vmmt emu: VMMT_EMU_HANDLES: unknown handle type '%s' ignored; use "
                    "posix_fd, fabric or none\n",
                    t);
    }
    return bits;
}

static int parse_result(const char *s, CUresult *out)
{
    char *end;
    long v;

    for (size_t i = 0; i < N_ERRORS; i++)
        if (strcmp(s, g_errors[i].name) == 0) return *out = g_errors[i].code, 0;
    v = strtol(s, &end, 0);
    if (*s == '\0' || *end != '\0' || v < 0 || v > INT_MAX) return -1;
    *out = (CUresult)v;
    return 0;
}

static int parse_entry(const char *s, enum emu_entry *out)
{
    for (int i = 0; i < EMU_N_ENTRIES; i++)
        if (strcmp(s, g_entry_names[i]) == 0) return *out = (enum emu_entry)i, 0;
    return -1;
}

/* One "entry:N:result" item into a rule; a reason on failure. */
static const char *parse_rule(char *item, struct fail_rule *rule)
{
    char *save = NULL, *entry, *nth, *result, *end;

    entry = strtok_r(item, ":", &save);
    nth = strtok_r(NULL, ":", &save);
    result = strtok_r(NULL, "", &save);
    if (entry == NULL || nth == NULL || result == NULL) return "expected entry:N:result";
    if (parse_entry(entry, &rule->entry) != 0) return "unknown entry point";
    if (strcmp(nth, "*") == 0) {
        rule->nth = 0;
    } else {
        rule->nth = strtol(nth, &end, 10);
        if (*end != '\0' || rule->nth < 1) return "N must be a call number from 1, or *";
    }
    if (parse_result(result, &rule->result) != 0 || rule->result == CUDA_SUCCESS)
        return "unknown result; use a CUDA_ERROR_* name or a non-zero number";
    return NULL;
}

/* Parse VMMT_EMU_FAIL into g_rules; mutex held. Complains once per distinct text. */
static void read_fail_rules(void)
{
    const char *s = getenv("VMMT_EMU_FAIL");
    char buf[sizeof g_fail_reported], item[256], *save = NULL;
    int complained = 0;

    g_nrules = 0;
    if (s == NULL || *s == '\0') return;
    snprintf(buf, sizeof buf, "%s", s);
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        struct fail_rule rule;
        const char *why;

        snprintf(item, sizeof item, "%s", t);
        why = parse_rule(item, &rule);
        if (why == NULL && g_nrules < MAX_RULES) {
            g_rules[g_nrules++] = rule;
            continue;
        }
        if (why == NULL) why = "too many rules";
        if (strcmp(g_fail_reported, s) != 0)
            fprintf(stderr, "vmmt emu: VMMT_EMU_FAIL item '%s' ignored: %s\n", t, why);
        complained = 1;
    }
    if (complained) snprintf(g_fail_reported, sizeof g_fail_reported, "%s", s);
}

static void configure_locked(void)
{
    unsigned long long devices = env_number("VMMT_EMU_DEVICES", DEFAULT_DEVICES);
    unsigned long long timeout = env_number("VMMT_EMU_WAIT_TIMEOUT_MS", DEFAULT_WAIT_TIMEOUT_MS);

    g_cfg.devices = devices > EMU_MAX_DEVICES ? EMU_MAX_DEVICES : (int)devices;
    g_cfg.granularity = read_granularity();
    g_cfg.handles = read_handles();
    g_cfg.wait_timeout_ms = timeout > INT_MAX ? INT_MAX : (int)timeout;
    g_cfg.wait_imported = env_number("VMMT_EMU_WAIT_IMPORTED", 1) != 0;
    g_cfg.wait_host = env_number("VMMT_EMU_WAIT_HOST", 1) != 0;
    g_cfg.total_mem = env_number("VMMT_EMU_TOTAL_MEM", DEFAULT_TOTAL_MEM);
    read_fail_rules();
    for (int i = 0; i < EMU_MAX_DEVICES; i++)
        g_ctx[i].device = i;
    for (int i = 0; i < EMU_N_ENTRIES; i++)
        atomic_store(&g_calls[i], 0);
    atomic_store(&g_have_rules, g_nrules > 0);
    atomic_store(&g_configured, 1);
}

void vmmt__emu_configure(void)
{
    pthread_mutex_lock(&g_mu);
    configure_locked();
    pthread_mutex_unlock(&g_mu);
}

/* ------------------------------------------------------- entry prologue */

static CUresult injected(enum emu_entry e, long n)
{
    CUresult r = CUDA_SUCCESS;

    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nrules && r == CUDA_SUCCESS; i++)
        if (g_rules[i].entry == e && (g_rules[i].nth == 0 || g_rules[i].nth == n))
            r = g_rules[i].result;
    pthread_mutex_unlock(&g_mu);
    return r;
}

CUresult vmmt__emu_enter(enum emu_entry e, int need_init)
{
    long n = atomic_fetch_add(&g_calls[e], 1) + 1;

    if (atomic_load_explicit(&g_have_rules, memory_order_relaxed)) {
        CUresult r = injected(e, n);
        if (r != CUDA_SUCCESS) return r;
    }
    if (need_init && !atomic_load_explicit(&g_initialized, memory_order_acquire))
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

long vmmt__emu_calls(const char *entry)
{
    enum emu_entry e;

    if (entry == NULL || parse_entry(entry, &e) != 0) return -1;
    return atomic_load(&g_calls[e]);
}

/* ------------------------------------------------------ errors, version */

CUresult vmmt__emu_cuGetErrorName(CUresult error, const char **str)
{
    EMU_ENTER(cuGetErrorName, 0);
    if (str == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < N_ERRORS; i++)
        if (g_errors[i].code == error) return *str = g_errors[i].name, CUDA_SUCCESS;
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult vmmt__emu_cuGetErrorString(CUresult error, const char **str)
{
    EMU_ENTER(cuGetErrorString, 0);
    if (str == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < N_ERRORS; i++)
        if (g_errors[i].code == error) return *str = g_errors[i].text, CUDA_SUCCESS;
    *str = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult vmmt__emu_cuInit(unsigned int flags)
{
    int devices;

    /* Settings first, so that an injected cuInit failure is already known. */
    if (!atomic_load_explicit(&g_configured, memory_order_acquire)) {
        pthread_mutex_lock(&g_mu);
        if (!atomic_load(&g_configured)) configure_locked();
        pthread_mutex_unlock(&g_mu);
    }
    EMU_ENTER(cuInit, 0);
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    devices = g_cfg.devices;
    pthread_mutex_unlock(&g_mu);
    if (devices == 0) return CUDA_ERROR_NO_DEVICE;
    atomic_store_explicit(&g_initialized, 1, memory_order_release);
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDriverGetVersion(int *version)
{
    EMU_ENTER(cuDriverGetVersion, 0);
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* -------------------------------------------------------------- devices */

int vmmt__emu_device_ok(int dev)
{
    int ok;

    pthread_mutex_lock(&g_mu);
    ok = dev >= 0 && dev < g_cfg.devices;
    pthread_mutex_unlock(&g_mu);
    return ok;
}

CUresult vmmt__emu_cuDeviceGetCount(int *count)
{
    EMU_ENTER(cuDeviceGetCount, 1);
    if (count == NULL) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_mu);
    *count = g_cfg.devices;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDeviceGet(CUdevice *device, int ordinal)
{
    EMU_ENTER(cuDeviceGet, 1);
    if (device == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDeviceGetName(char *name, int len, CUdevice dev)
{
    EMU_ENTER(cuDeviceGetName, 1);
    if (name == NULL || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "vmmt emulated device %d", dev);
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDeviceGetAttribute(int *value, CUdevice_attribute attr, CUdevice dev)
{
    unsigned handles;

    EMU_ENTER(cuDeviceGetAttribute, 1);
    if (value == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    handles = g_cfg.handles;
    pthread_mutex_unlock(&g_mu);
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
        *value = (handles & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
        break;
    /* Reads 1 whatever the setting, as on the lent H200 without an IMEX channel. */
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: *value = dev + 1; break;
    /* One host NUMA node, as on a single-socket machine. */
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *value = 0; break;
    default: *value = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDeviceTotalMem(size_t *bytes, CUdevice dev)
{
    EMU_ENTER(cuDeviceTotalMem, 1);
    if (bytes == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_mu);
    *bytes = (size_t)g_cfg.total_mem;
    pthread_mutex_unlock(&g_mu);
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------- contexts */

static int ctx_known(CUcontext ctx)
{
    uintptr_t p = (uintptr_t)ctx, base = (uintptr_t)g_ctx;

    return p >= base && p < base + sizeof g_ctx && (p - base) % sizeof g_ctx[0] == 0;
}

int vmmt__emu_live_contexts(void)
{
    int n = 0;

    for (int i = 0; i < EMU_MAX_DEVICES; i++)
        n += atomic_load(&g_ctx[i].refs) > 0;
    return n;
}

CUresult vmmt__emu_cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    EMU_ENTER(cuDevicePrimaryCtxRetain, 1);
    if (ctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (!vmmt__emu_device_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    atomic_fetch_add(&g_ctx[dev].refs, 1);
    *ctx = &g_ctx[dev];
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuDevicePrimaryCtxRelease(CUdevice dev)
{
    int refs;

    EMU_ENTER(cuDevicePrimaryCtxRelease, 1);
    if (!vmmt__emu_device_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
    refs = atomic_load(&g_ctx[dev].refs);
    do {
        if (refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
    } while (!atomic_compare_exchange_weak(&g_ctx[dev].refs, &refs, refs - 1));
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuCtxPushCurrent(CUcontext ctx)
{
    EMU_ENTER(cuCtxPushCurrent, 1);
    if (ctx == NULL || !ctx_known(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_depth == CTX_DEPTH) return CUDA_ERROR_OUT_OF_MEMORY;
    t_stack[t_depth++] = ctx;
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuCtxPopCurrent(CUcontext *ctx)
{
    EMU_ENTER(cuCtxPopCurrent, 1);
    if (t_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    t_depth--;
    if (ctx != NULL) *ctx = t_stack[t_depth];
    return CUDA_SUCCESS;
}

CUresult vmmt__emu_cuCtxGetCurrent(CUcontext *ctx)
{
    EMU_ENTER(cuCtxGetCurrent, 1);
    if (ctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *ctx = t_depth > 0 ? t_stack[t_depth - 1] : NULL;
    return CUDA_SUCCESS;
}

int vmmt__emu_current_device(void)
{
    CUcontext c;

    if (t_depth == 0) return -1;
    c = t_stack[t_depth - 1];
    /* A released primary context is inactive: the driver refuses work in it. */
    if (atomic_load(&c->refs) == 0 || !vmmt__emu_device_ok(c->device)) return -1;
    return c->device;
}
