/*
 * The handle-type probe. Device attributes are not enough: the lent H200
 * reports FABRIC as supported while cuMemCreate with FABRIC is refused for
 * lack of an IMEX channel. So each candidate is tried by a real allocation of
 * one granularity unit, and its export, in the order FABRIC, POSIX_FD, NONE.
 * Results are cached per device because a probe costs milliseconds.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi.h"
#include "driver.h"
#include "status.h"
#include "vmm.h"

#define MAX_DEVICES 64

static const vmmt_handle_type k_order[3] = {VMMT_HANDLE_FABRIC, VMMT_HANDLE_POSIX_FD,
                                            VMMT_HANDLE_NONE};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static vmmt_device_probe g_cache[MAX_DEVICES];
static int g_cached[MAX_DEVICES];

const char *vmmt_handle_type_name(vmmt_handle_type type)
{
    switch (type) {
    case VMMT_HANDLE_FABRIC: return "fabric";
    case VMMT_HANDLE_POSIX_FD: return "posix_fd";
    case VMMT_HANDLE_NONE: return "none";
    case VMMT_HANDLE_AUTO: return "auto";
    }
    return "unknown";
}

int vmmt_handle_type_parse(const char *name, vmmt_handle_type *out)
{
    static const vmmt_handle_type all[] = {VMMT_HANDLE_AUTO, VMMT_HANDLE_FABRIC,
                                           VMMT_HANDLE_POSIX_FD, VMMT_HANDLE_NONE};
    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_handle_type_parse: out is NULL");
    for (size_t i = 0; name != NULL && i < sizeof all / sizeof all[0]; i++) {
        if (strcmp(name, vmmt_handle_type_name(all[i])) == 0) {
            *out = all[i];
            return VMMT_OK;
        }
    }
    return vmmt__fail(VMMT_EINVAL, "unknown handle type '%s'; use auto, fabric, posix_fd or none",
                      name ? name : "(null)");
}

static void try_export(const struct vmmt_drv *d, CUmemGenericAllocationHandle h,
                       vmmt_handle_probe *c)
{
    CUmemFabricHandle fabric;
    int fd = -1;
    void *out = c->type == VMMT_HANDLE_FABRIC ? (void *)&fabric : (void *)&fd;

    c->export_result =
        d->cuMemExportToShareableHandle(out, h, (CUmemAllocationHandleType)c->type, 0);
    if (fd >= 0) close(fd);
    if (c->export_result != CUDA_SUCCESS)
        snprintf(c->cause, sizeof c->cause, "cuMemExportToShareableHandle -> %s",
                 vmmt__cu_name(c->export_result));
}

static void probe_candidate(const struct vmmt_drv *d, int device, int imex, vmmt_handle_probe *c)
{
    CUmemAllocationProp prop;
    CUmemGenericAllocationHandle h;

    c->export_result = -1;
    if (vmmt__granularity(device, c->type, &c->granularity_minimum, &c->granularity_recommended) !=
        VMMT_OK) {
        c->create_result = vmmt_last_cuda_error();
        snprintf(c->cause, sizeof c->cause, "%s", vmmt_last_error());
        return;
    }
    vmmt__prop_init(&prop, device, c->type, 0);
    c->create_result = d->cuMemCreate(&h, c->granularity_minimum, &prop, 0);
    if (c->create_result != CUDA_SUCCESS) {
        snprintf(c->cause, sizeof c->cause, "cuMemCreate -> %s%s", vmmt__cu_name(c->create_result),
                 c->type != VMMT_HANDLE_FABRIC ? ""
                 : imex                        ? " (IMEX channel directory " VMMT__IMEX_CHANNELS
                          " exists; check that this process may open a channel and that the "
                          "IMEX daemon runs)"
                        : " (no IMEX channel at " VMMT__IMEX_CHANNELS ")");
        return;
    }
    if (c->type != VMMT_HANDLE_NONE) try_export(d, h, c);
    if (d->cuMemRelease(h) != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_ERROR, "probe: cuMemRelease of the test allocation failed; leaked");
    c->works = c->cause[0] == '\0';
    if (c->works && c->type == VMMT_HANDLE_NONE)
        snprintf(c->cause, sizeof c->cause,
                 "allocations work but cannot be shared between "
                 "processes");
}

static int attribute_of(vmmt_handle_type t)
{
    if (t == VMMT_HANDLE_FABRIC) return CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED;
    if (t == VMMT_HANDLE_POSIX_FD)
        return CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
    return -1;
}

static void describe_device(const struct vmmt_drv *d, int device, vmmt_device_probe *p)
{
    CUdevice dev = device;
    int v = 0;

    d->cuDeviceGet(&dev, device);
    if (d->cuDeviceGetName(p->name, sizeof p->name, dev) != CUDA_SUCCESS)
        snprintf(p->name, sizeof p->name, "device %d", device);
    d->cuDeviceTotalMem(&p->total_memory, dev);
    if (d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
        CUDA_SUCCESS)
        p->vmm_supported = v;
    v = 0;
    if (d->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                dev) == CUDA_SUCCESS)
        p->rdma_with_vmm_supported = v;
    p->imex_channels_present = access(VMMT__IMEX_CHANNELS, F_OK) == 0;
    for (int i = 0; i < 3; i++) {
        vmmt_handle_probe *c = &p->candidates[i];
        c->type = k_order[i];
        c->attribute = -1;
        if (attribute_of(c->type) >= 0 &&
            d->cuDeviceGetAttribute(&v, (CUdevice_attribute)attribute_of(c->type), dev) ==
                CUDA_SUCCESS)
            c->attribute = v;
    }
}

/* The "no supported handle type" message, each candidate with its own cause. */
static int fail_unsupported(const vmmt_device_probe *p)
{
    const vmmt_handle_probe *c = p->candidates;
    return vmmt__fail(VMMT_ENOTSUP,
                      "no supported CUDA VMM allocation handle type on device %d (%s): "
                      "FABRIC: %s; POSIX_FD: %s; NONE: %s. Cross-process sharing needs POSIX_FD "
                      "(same node) or FABRIC with an IMEX channel",
                      p->device, p->name, c[0].cause, c[1].cause, c[2].cause);
}

static void choose(vmmt_device_probe *p)
{
    char fabric_cause[sizeof p->candidates[0].cause];

    memcpy(fabric_cause, p->candidates[0].cause, sizeof fabric_cause);
    p->selected = VMMT_HANDLE_NONE;
    for (int i = 0; i < 3; i++) {
        if (p->candidates[i].works) {
            p->selected = p->candidates[i].type;
            break;
        }
    }
    if (p->selected == VMMT_HANDLE_FABRIC)
        snprintf(p->reason, sizeof p->reason,
                 "FABRIC allocation and export work: buffers can be shared across the NVLink "
                 "domain");
    else if (p->selected == VMMT_HANDLE_POSIX_FD)
        snprintf(p->reason, sizeof p->reason,
                 "POSIX_FD allocation and export work (FABRIC: %s): buffers can be shared "
                 "between processes of this node",
                 fabric_cause);
    else
        snprintf(p->reason, sizeof p->reason, "no shareable handle type works");
}

/* The probe's test mappings: a release that fails leaks, and says so. */
static void release_logged(struct vmmt__mapping *m)
{
    struct vmmt__saved_error e;

    vmmt__error_save(&e); /* the probe reports the cause it found, not this */
    if (vmmt__mapping_release(m) != VMMT_OK)
        vmmt__log(VMMT_LOG_ERROR, "probe: releasing a test mapping failed (%s); leaked",
                  vmmt_last_error());
    vmmt__error_restore(&e);
}

/*
 * Stream-ordered hand-off needs a consumer's stream to wait on a word of an
 * imported allocation. Try exactly that: export one unit of the selected
 * type, import it in this process, and wait on its first word (zero, so the
 * wait is already satisfied).
 */
static void probe_stream_wait(const struct vmmt_drv *d, vmmt_device_probe *p)
{
    struct vmmt__mapping src, imp;
    CUmemFabricHandle fabric;
    CUstream s = NULL;
    int fd = -1, st;

    p->stream_wait_imported = -1;
    if (p->selected == VMMT_HANDLE_NONE) return;
    st = vmmt__mapping_create(
        p->device, p->candidates[p->selected == VMMT_HANDLE_FABRIC ? 0 : 1].granularity_minimum,
        p->selected, 0, &src);
    if (st != VMMT_OK) goto out;
    if (p->selected == VMMT_HANDLE_FABRIC) {
        st = vmmt__export_fabric(src.handle, &fabric);
        if (st == VMMT_OK) st = vmmt__mapping_import_fabric(p->device, &fabric, src.size, &imp);
    } else {
        st = vmmt__export_posix_fd(src.handle, &fd);
        if (st == VMMT_OK) st = vmmt__mapping_import_posix_fd(p->device, fd, src.size, &imp);
        if (fd >= 0) close(fd);
    }
    if (st == VMMT_OK) {
        st = VMMT_CU(d, cuMemsetD8Async(src.base, 0, 4, NULL));
        if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(NULL));
        if (st == VMMT_OK) st = VMMT_CU(d, cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        if (st == VMMT_OK)
            st = VMMT_CU(d, cuStreamWaitValue32(s, imp.base, 0, CU_STREAM_WAIT_VALUE_GEQ));
        if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(s));
        if (s != NULL && d->cuStreamDestroy(s) != CUDA_SUCCESS)
            vmmt__log(VMMT_LOG_ERROR, "probe: cuStreamDestroy of the test stream failed; leaked");
        release_logged(&imp);
    }
    release_logged(&src);
out:
    p->stream_wait_imported = st == VMMT_OK;
    if (st != VMMT_OK)
        snprintf(p->stream_wait_cause, sizeof p->stream_wait_cause, "%s", vmmt_last_error());
}

static int run_probe(int device, vmmt_device_probe *p)
{
    const struct vmmt_drv *d;
    int st;

    memset(p, 0, sizeof *p);
    p->device = device;
    st = vmmt__ctx_enter(device);
    if (st != VMMT_OK) return vmmt__wrap(st, "probing CUDA VMM handle types on device %d", device);
    d = vmmt__drv();
    describe_device(d, device, p);
    if (!p->vmm_supported) {
        vmmt__ctx_leave();
        return vmmt__fail(VMMT_ENOTSUP,
                          "device %d (%s) does not support CUDA virtual memory management "
                          "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=0); use a "
                          "GPU of compute capability 6.0 or newer with a Linux driver",
                          device, p->name);
    }
    for (int i = 0; i < 3; i++)
        probe_candidate(d, device, p->imex_channels_present, &p->candidates[i]);
    choose(p);
    probe_stream_wait(d, p);
    vmmt__ctx_leave();
    vmmt__clear();
    return VMMT_OK;
}

#define DEVICE_PROBE_V1 VMMT__SIZE_V1(vmmt_device_probe, stream_wait_cause)

int vmmt_probe_device_size(int device, vmmt_device_probe *theirs, size_t size)
{
    vmmt_device_probe report, *out = &report;
    int st = VMMT_OK;

    st = vmmt__struct_check(theirs, size, DEVICE_PROBE_V1, "vmmt_probe_device: out");
    if (st != VMMT_OK) return st;
    if (device < 0 || device >= MAX_DEVICES)
        return vmmt__fail(VMMT_ENODEV, "device %d is out of range", device);
    pthread_mutex_lock(&g_lock);
    if (!g_cached[device]) {
        st = run_probe(device, &g_cache[device]);
        g_cached[device] = st == VMMT_OK;
    }
    *out = g_cache[device];
    pthread_mutex_unlock(&g_lock);
    vmmt__struct_out(theirs, size, &report, sizeof report, DEVICE_PROBE_V1,
                     "vmmt_probe_device: out");
    if (st != VMMT_OK) return st;
    return out->selected == VMMT_HANDLE_NONE ? fail_unsupported(out) : VMMT_OK;
}

int vmmt_select_handle_type(int device, vmmt_handle_type *out)
{
    vmmt_device_probe p;
    vmmt_handle_type want = VMMT_HANDLE_AUTO;
    const char *env = getenv("VMMT_HANDLE_TYPE");
    int st;

    if (out == NULL) return vmmt__fail(VMMT_EINVAL, "vmmt_select_handle_type: out is NULL");
    if (env != NULL && *env != '\0' && vmmt_handle_type_parse(env, &want) != VMMT_OK)
        return vmmt__wrap(VMMT_EINVAL, "VMMT_HANDLE_TYPE");
    st = vmmt_probe_device(device, &p);
    if (want == VMMT_HANDLE_AUTO) {
        if (st == VMMT_OK) *out = p.selected;
        return st;
    }
    if (st != VMMT_OK && st != VMMT_ENOTSUP) return st;
    for (int i = 0; i < 3; i++) {
        if (p.candidates[i].type != want) continue;
        if (!p.candidates[i].works)
            return vmmt__fail(VMMT_ENOTSUP,
                              "VMMT_HANDLE_TYPE=%s, but %s does not work on device %d: %s; "
                              "unset VMMT_HANDLE_TYPE to let the probe choose",
                              env, vmmt__handle_type_upper(want), device, p.candidates[i].cause);
        *out = want;
        vmmt__clear();
        return VMMT_OK;
    }
    return vmmt__fail(VMMT_EINVAL, "VMMT_HANDLE_TYPE=%s is not a handle type", env);
}

void vmmt_probe_reset(void)
{
    pthread_mutex_lock(&g_lock);
    memset(g_cached, 0, sizeof g_cached);
    pthread_mutex_unlock(&g_lock);
}

int vmmt__probe_report(int device, vmmt_device_probe *out)
{
    vmmt_handle_type sel;
    int st;

    memset(out, 0, sizeof *out);
    st = vmmt_probe_device(device, out);
    if (st != VMMT_OK) return st;
    st = vmmt_select_handle_type(device, &sel);
    if (st == VMMT_OK && sel != out->selected) {
        out->selected = sel;
        out->overridden = 1;
    }
    return st;
}
