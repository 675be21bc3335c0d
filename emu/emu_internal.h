/*
 * Shared internals of the emulated driver (emu.c, emu_mem.c, emu_stream.c).
 *
 * Locking: one mutex (vmmt__emu_lock) guards the settings and every table.
 * Code that touches emulated device memory after enqueue (stream workers,
 * NULL-stream operations) also holds the memory lock for reading, so that
 * unmap, free and set-access, which take it for writing, never pull pages
 * from under a running copy. Order: memory lock, then the mutex. Nobody
 * holds either while a stream waits.
 */
#ifndef VMMT_EMU_INTERNAL_H
#define VMMT_EMU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "driver.h"

/* Devices beyond this are clamped: contexts and accounting are fixed arrays. */
#define EMU_MAX_DEVICES 64
#define EMU_META_SIZE   4096
/* Host NUMA nodes a host-NUMA allocation may name. */
#define EMU_NUMA_NODES 4

/* One value per entry point, for call counting and fault injection. */
enum emu_entry {
#define EMU_ENTRY_ENUM(fn, ver, params) EMU_E_##fn,
    VMMT_DRV_ENTRIES(EMU_ENTRY_ENUM)
#undef EMU_ENTRY_ENUM
        EMU_N_ENTRIES
};

/* The settings of docs/emulator.md, as read from the environment. */
struct emu_cfg {
    int devices;
    size_t granularity;
    unsigned handles; /* CU_MEM_HANDLE_TYPE_* bits cuMemCreate accepts */
    int wait_timeout_ms;
    int wait_imported;
    int wait_host; /* waits on registered host memory allowed */
    unsigned long long total_mem;
};

/* Access a device needs to a range: a bit set of these. */
enum { EMU_ACC_READ = 1, EMU_ACC_WRITE = 2 };

/* --- emu.c */
void vmmt__emu_lock(void);
void vmmt__emu_unlock(void);
/* The settings; read them with the mutex held. */
const struct emu_cfg *vmmt__emu_cfg(void);
/*
 * Prologue of every entry point: counts the call, applies injected failures
 * and, when need_init, refuses calls before cuInit. CUDA_SUCCESS to go on.
 */
CUresult vmmt__emu_enter(enum emu_entry e, int need_init);
/* Device of the calling thread's current (retained) context, -1 if none. */
int vmmt__emu_current_device(void);
/* Whether dev names an emulated device; takes the mutex. */
int vmmt__emu_device_ok(int dev);

CUresult vmmt__emu_cuGetErrorName(CUresult, const char **);
CUresult vmmt__emu_cuGetErrorString(CUresult, const char **);
CUresult vmmt__emu_cuInit(unsigned int);
CUresult vmmt__emu_cuDriverGetVersion(int *);
CUresult vmmt__emu_cuDeviceGetCount(int *);
CUresult vmmt__emu_cuDeviceGet(CUdevice *, int);
CUresult vmmt__emu_cuDeviceGetName(char *, int, CUdevice);
CUresult vmmt__emu_cuDeviceGetAttribute(int *, CUdevice_attribute, CUdevice);
CUresult vmmt__emu_cuDeviceTotalMem(size_t *, CUdevice);
CUresult vmmt__emu_cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult vmmt__emu_cuDevicePrimaryCtxRelease(CUdevice);
CUresult vmmt__emu_cuCtxPushCurrent(CUcontext);
CUresult vmmt__emu_cuCtxPopCurrent(CUcontext *);
CUresult vmmt__emu_cuCtxGetCurrent(CUcontext *);

/* --- emu_mem.c */
/*
 * Whether [p, p+n) lies inside one cuMemAlloc block, one host block, or
 * contiguous mappings granting `need` to device. Mutex held. CUDA_SUCCESS or
 * CUDA_ERROR_INVALID_VALUE.
 */
CUresult vmmt__emu_range_check(uintptr_t p, size_t n, int device, int need);
/* Whether any byte of [p, p+n) is mapped from an imported allocation. Mutex held. */
int vmmt__emu_range_imported(uintptr_t p, size_t n);
int vmmt__emu_range_registered(uintptr_t p, size_t n);
/*
 * Whether p lies in emulated device memory (a cuMemAlloc block or a mapping)
 * rather than host memory: unified addressing, as cuMemcpyAsync infers it.
 * Mutex held.
 */
int vmmt__emu_is_device_memory(uintptr_t p);
/* The memory lock, for reading, around every access to device memory. */
void vmmt__emu_mem_read_lock(void);
void vmmt__emu_mem_read_unlock(void);

CUresult vmmt__emu_cuMemGetAllocationGranularity(size_t *, const CUmemAllocationProp *,
                                                 CUmemAllocationGranularity_flags);
CUresult vmmt__emu_cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                               unsigned long long);
CUresult vmmt__emu_cuMemRelease(CUmemGenericAllocationHandle);
CUresult vmmt__emu_cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle,
                                                CUmemAllocationHandleType, unsigned long long);
CUresult vmmt__emu_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *,
                                                  CUmemAllocationHandleType);
CUresult vmmt__emu_cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                       unsigned long long);
CUresult vmmt__emu_cuMemAddressFree(CUdeviceptr, size_t);
CUresult vmmt__emu_cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                            unsigned long long);
CUresult vmmt__emu_cuMemUnmap(CUdeviceptr, size_t);
CUresult vmmt__emu_cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult vmmt__emu_cuMemGetAddressRange(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult vmmt__emu_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
CUresult vmmt__emu_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *,
                                                          CUmemGenericAllocationHandle);
CUresult vmmt__emu_cuMemAlloc(CUdeviceptr *, size_t);
CUresult vmmt__emu_cuMemFree(CUdeviceptr);
CUresult vmmt__emu_cuMemAllocHost(void **, size_t);
CUresult vmmt__emu_cuMemFreeHost(void *);
CUresult vmmt__emu_cuMemHostRegister(void *, size_t, unsigned int);
CUresult vmmt__emu_cuMemHostUnregister(void *);
CUresult vmmt__emu_cuMemHostGetDevicePointer(CUdeviceptr *, void *, unsigned int);
CUresult vmmt__emu_cuPointerGetAttribute(void *, CUpointer_attribute, CUdeviceptr);
CUresult vmmt__emu_cuPointerGetAttributes(unsigned int, CUpointer_attribute *, void **,
                                          CUdeviceptr);

/* --- emu_module.c */
CUresult vmmt__emu_cuModuleLoadData(CUmodule *, const void *);
CUresult vmmt__emu_cuModuleUnload(CUmodule);
CUresult vmmt__emu_cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult vmmt__emu_cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int,
                                  unsigned int, unsigned int, unsigned int, unsigned int, CUstream,
                                  void **, void **);

/* --- emu_stream.c */
CUresult vmmt__emu_cuMemcpyDtoDAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult vmmt__emu_cuMemcpyHtoDAsync(CUdeviceptr, const void *, size_t, CUstream);
CUresult vmmt__emu_cuMemcpyDtoHAsync(void *, CUdeviceptr, size_t, CUstream);
CUresult vmmt__emu_cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult vmmt__emu_cuStreamCreate(CUstream *, unsigned int);
CUresult vmmt__emu_cuStreamDestroy(CUstream);
CUresult vmmt__emu_cuStreamSynchronize(CUstream);
CUresult vmmt__emu_cuStreamQuery(CUstream);
CUresult vmmt__emu_cuStreamWaitEvent(CUstream, CUevent, unsigned int);
CUresult vmmt__emu_cuStreamWaitValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
CUresult vmmt__emu_cuStreamWriteValue32(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
CUresult vmmt__emu_cuEventCreate(CUevent *, unsigned int);
CUresult vmmt__emu_cuEventRecord(CUevent, CUstream);
CUresult vmmt__emu_cuEventQuery(CUevent);
CUresult vmmt__emu_cuEventSynchronize(CUevent);
CUresult vmmt__emu_cuEventElapsedTime(float *, CUevent, CUevent);
CUresult vmmt__emu_cuEventDestroy(CUevent);
CUresult vmmt__emu_cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
/*
 * The publish kernel's work on stream hs, for a module of `device`: n bytes
 * from src to dst, then value into the word, checked when it runs.
 * CUDA_ERROR_INVALID_HANDLE when the current context, or the stream's, is another device's.
 */
CUresult vmmt__emu_enqueue_kernel(CUstream hs, int device, uintptr_t dst, uintptr_t src, size_t n,
                                  uintptr_t word, uint32_t value);

/* Entry prologue: `return`s the injected or initialisation failure. */
#define EMU_ENTER(fn, need_init)                                                                   \
    do {                                                                                           \
        CUresult emu_r_ = vmmt__emu_enter(EMU_E_##fn, (need_init));                                \
        if (emu_r_ != CUDA_SUCCESS) return emu_r_;                                                 \
    } while (0)

#endif
