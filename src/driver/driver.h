/*
 * The table of CUDA driver entry points vmmt calls, filled from a driver
 * library loaded at run time: libcuda.so.1, or any library that exports the
 * same entry points through cuGetProcAddress (the emulated driver,
 * libvmmt_emu.so, built from emu/). Library code calls only through this
 * table, so the code tested on the emulator is the code that runs on a GPU.
 */
#ifndef VMMT_DRIVER_H
#define VMMT_DRIVER_H

#include "cuabi.h"
#include "status.h"

/*
 * X(name, cuda_version, parameters): cuda_version is the CUDA release whose
 * ABI of the symbol the prototype matches; cuGetProcAddress is asked for that
 * version so that a newer driver hands back the same signature.
 */
#define VMMT_DRV_ENTRIES(X)                                                                        \
    X(cuGetErrorName, 6000, (CUresult, const char **))                                             \
    X(cuGetErrorString, 6000, (CUresult, const char **))                                           \
    X(cuInit, 2000, (unsigned int))                                                                \
    X(cuDriverGetVersion, 2020, (int *))                                                           \
    X(cuDeviceGetCount, 2000, (int *))                                                             \
    X(cuDeviceGet, 2000, (CUdevice *, int))                                                        \
    X(cuDeviceGetName, 2000, (char *, int, CUdevice))                                              \
    X(cuDeviceGetAttribute, 2000, (int *, CUdevice_attribute, CUdevice))                           \
    X(cuDeviceTotalMem, 3020, (size_t *, CUdevice))                                                \
    X(cuDevicePrimaryCtxRetain, 7000, (CUcontext *, CUdevice))                                     \
    X(cuDevicePrimaryCtxRelease, 11000, (CUdevice))                                                \
    X(cuCtxPushCurrent, 4000, (CUcontext))                                                         \
    X(cuCtxPopCurrent, 4000, (CUcontext *))                                                        \
    X(cuCtxGetCurrent, 4000, (CUcontext *))                                                        \
    X(cuMemGetAllocationGranularity, 10020,                                                        \
      (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                   \
    X(cuMemCreate, 10020,                                                                          \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))   \
    X(cuMemRelease, 10020, (CUmemGenericAllocationHandle))                                         \
    X(cuMemExportToShareableHandle, 10020,                                                         \
      (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))       \
    X(cuMemImportFromShareableHandle, 10020,                                                       \
      (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType))                         \
    X(cuMemAddressReserve, 10020,                                                                  \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                            \
    X(cuMemAddressFree, 10020, (CUdeviceptr, size_t))                                              \
    X(cuMemMap, 10020,                                                                             \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))             \
    X(cuMemUnmap, 10020, (CUdeviceptr, size_t))                                                    \
    X(cuMemSetAccess, 10020, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))               \
    X(cuMemGetAddressRange, 3020, (CUdeviceptr *, size_t *, CUdeviceptr))                          \
    X(cuMemRetainAllocationHandle, 11000, (CUmemGenericAllocationHandle *, void *))                \
    X(cuMemGetAllocationPropertiesFromHandle, 10020,                                               \
      (CUmemAllocationProp *, CUmemGenericAllocationHandle))                                       \
    X(cuMemAlloc, 3020, (CUdeviceptr *, size_t))                                                   \
    X(cuMemFree, 3020, (CUdeviceptr))                                                              \
    X(cuMemAllocHost, 3020, (void **, size_t))                                                     \
    X(cuMemFreeHost, 2000, (void *))                                                               \
    X(cuMemHostRegister, 6050, (void *, size_t, unsigned int))                                     \
    X(cuMemHostUnregister, 4000, (void *))                                                         \
    X(cuMemHostGetDevicePointer, 3020, (CUdeviceptr *, void *, unsigned int))                      \
    X(cuMemcpyDtoDAsync, 3020, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                       \
    X(cuMemcpyHtoDAsync, 3020, (CUdeviceptr, const void *, size_t, CUstream))                      \
    X(cuMemcpyDtoHAsync, 3020, (void *, CUdeviceptr, size_t, CUstream))                            \
    X(cuMemsetD8Async, 3020, (CUdeviceptr, unsigned char, size_t, CUstream))                       \
    X(cuStreamCreate, 2000, (CUstream *, unsigned int))                                            \
    X(cuStreamDestroy, 4000, (CUstream))                                                           \
    X(cuStreamSynchronize, 2000, (CUstream))                                                       \
    X(cuStreamQuery, 2000, (CUstream))                                                             \
    X(cuStreamWaitEvent, 3020, (CUstream, CUevent, unsigned int))                                  \
    X(cuStreamWaitValue32, 11070, (CUstream, CUdeviceptr, cuuint32_t, unsigned int))               \
    X(cuStreamWriteValue32, 11070, (CUstream, CUdeviceptr, cuuint32_t, unsigned int))              \
    X(cuEventCreate, 2000, (CUevent *, unsigned int))                                              \
    X(cuEventRecord, 2000, (CUevent, CUstream))                                                    \
    X(cuEventQuery, 2000, (CUevent))                                                               \
    X(cuEventSynchronize, 2000, (CUevent))                                                         \
    X(cuEventElapsedTime, 2000, (float *, CUevent, CUevent))                                       \
    X(cuEventDestroy, 4000, (CUevent))                                                             \
    X(cuMemcpyAsync, 4000, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                           \
    X(cuPointerGetAttribute, 4000, (void *, CUpointer_attribute, CUdeviceptr))                     \
    X(cuPointerGetAttributes, 7000, (unsigned int, CUpointer_attribute *, void **, CUdeviceptr))   \
    X(cuModuleLoadData, 2000, (CUmodule *, const void *))                                          \
    X(cuModuleUnload, 2000, (CUmodule))                                                            \
    X(cuModuleGetFunction, 2000, (CUfunction *, CUmodule, const char *))                           \
    X(cuLaunchKernel, 4000,                                                                        \
      (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,           \
       unsigned int, unsigned int, CUstream, void **, void **))

struct vmmt_drv {
    const char *name; /* "cuda", or what the library's vmmt__driver_name() says ("emu") */
#define VMMT_DRV_FIELD(fn, ver, params) CUresult(*fn) params;
    VMMT_DRV_ENTRIES(VMMT_DRV_FIELD)
#undef VMMT_DRV_FIELD
};

/*
 * The table in use, loading it on first call (VMMT_DRIVER or the last
 * vmmt_driver_select). Returns NULL with the thread's error message set when
 * no driver could be loaded or initialised.
 */
const struct vmmt_drv *vmmt__drv(void);

/*
 * Open the driver library `want` names and fill `out` from it, without
 * initialising it (no cuInit): "cuda" or "" (libcuda.so.1, or $VMMT_LIBCUDA),
 * "emu" (libvmmt_emu.so, searched as docs/emulator.md says) or a path. The
 * library stays open; *handle (when not NULL) gets it. Status; message set.
 */
int vmmt__drv_open(const char *want, struct vmmt_drv *out, void **handle);

/*
 * The dlopen handle of the library the process uses (VMMT_DRIVER or the last
 * vmmt_driver_select), opened but not initialised if nothing has used it yet;
 * NULL with the message set when it cannot be opened. Tests reach the
 * emulator's controls through it, so they talk to the very instance in use.
 */
void *vmmt__drv_library(void);

/* "CUDA_ERROR_OUT_OF_MEMORY" for a result, whatever the driver in use. */
const char *vmmt__cu_name(CUresult r);

/*
 * Record a failed driver call: "<call> -> CUDA_ERROR_X". The status is
 * VMMT_ECUDA, or VMMT_ENOMEM/VMMT_ENODEV/VMMT_ENOTSUP/VMMT_ETIMEDOUT where
 * the result says so; vmmt_last_cuda_error() gives the result. (cuerr.c)
 */
int vmmt__cu_fail(CUresult r, const char *call_fmt, ...) VMMT_PRINTF(2, 3);

/* VMMT_OK for CUDA_SUCCESS, else vmmt__cu_fail naming `call`. */
int vmmt__cu_check(CUresult r, const char *call);

/* Run a driver call through the table; on failure the message names the call as written. */
#define VMMT_CU(drv, call) vmmt__cu_check((drv)->call, #call)

/*
 * Make the device's primary context current for the duration of a library
 * call and give the caller's back afterwards. enter retains the primary
 * context once per process and device; leave pops exactly what enter pushed.
 */
int vmmt__ctx_enter(int device);
void vmmt__ctx_leave(void);

#endif
