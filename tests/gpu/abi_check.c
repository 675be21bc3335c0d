/*
 * Prints the layout and constants of the CUDA ABI slice vmmt declares. Built
 * twice by tests/gpu/run, once against the real cuda.h (-DUSE_CUDA_H) and
 * once against src/driver/cuabi.h; the two outputs must be identical.
 */
#include <stddef.h>
#include <stdio.h>

#ifdef USE_CUDA_H
#include <cuda.h>
#else
#include "cuabi.h"
#endif

#define SIZE(t)   printf("sizeof(%s) = %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("offsetof(%s, %s) = %zu\n", #t, #f, offsetof(t, f))
/* Prototypes: each entry point's type must be ours, checked at compile time (no link to libcuda).
 */
#define PROTO(fn, params)                                                                          \
    _Static_assert(__builtin_types_compatible_p(__typeof__(&fn), CUresult(*) params),              \
                   #fn " differs from cuda.h")
#define VAL(c) printf("%s = %lld\n", #c, (long long)(c))

int main(void)
{
#ifdef USE_CUDA_H
    PROTO(cuMemGetAddressRange, (CUdeviceptr *, size_t *, CUdeviceptr));
    PROTO(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *, void *));
    PROTO(cuMemGetAllocationPropertiesFromHandle,
          (CUmemAllocationProp *, CUmemGenericAllocationHandle));
    PROTO(cuPointerGetAttributes, (unsigned int, CUpointer_attribute *, void **, CUdeviceptr));
    PROTO(cuModuleLoadData, (CUmodule *, const void *));
    PROTO(cuModuleUnload, (CUmodule));
    PROTO(cuModuleGetFunction, (CUfunction *, CUmodule, const char *));
    PROTO(cuLaunchKernel, (CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                           unsigned int, unsigned int, unsigned int, CUstream, void **, void **));
#endif
    SIZE(CUresult);
    SIZE(CUdevice);
    SIZE(CUdeviceptr);
    SIZE(CUmemGenericAllocationHandle);
    SIZE(CUmemAllocationProp);
    OFF(CUmemAllocationProp, type);
    OFF(CUmemAllocationProp, requestedHandleTypes);
    OFF(CUmemAllocationProp, location);
    OFF(CUmemAllocationProp, win32HandleMetaData);
    OFF(CUmemAllocationProp, allocFlags.compressionType);
    OFF(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
    OFF(CUmemAllocationProp, allocFlags.usage);
    SIZE(CUmemLocation);
    SIZE(CUmemAccessDesc);
    OFF(CUmemAccessDesc, flags);
    SIZE(CUmemFabricHandle);
    VAL(CUDA_ERROR_INVALID_VALUE);
    VAL(CUDA_ERROR_OUT_OF_MEMORY);
    VAL(CUDA_ERROR_NOT_INITIALIZED);
    VAL(CUDA_ERROR_NO_DEVICE);
    VAL(CUDA_ERROR_INVALID_DEVICE);
    VAL(CUDA_ERROR_INVALID_CONTEXT);
    VAL(CUDA_ERROR_ALREADY_MAPPED);
    VAL(CUDA_ERROR_NOT_MAPPED);
    VAL(CUDA_ERROR_INVALID_HANDLE);
    VAL(CUDA_ERROR_NOT_FOUND);
    VAL(CUDA_ERROR_NOT_READY);
    VAL(CUDA_ERROR_ILLEGAL_ADDRESS);
    VAL(CUDA_ERROR_NOT_PERMITTED);
    VAL(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    VAL(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
    VAL(CUDA_ERROR_NOT_SUPPORTED);
    VAL(CUDA_ERROR_TIMEOUT);
    VAL(CUDA_ERROR_UNKNOWN);
    VAL(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
    VAL(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
    VAL(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED);
    VAL(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED);
    VAL(CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID);
    VAL(CU_MEM_LOCATION_TYPE_HOST);
    VAL(CU_MEM_LOCATION_TYPE_HOST_NUMA);
    VAL(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
    VAL(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID);
    VAL(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID);
    VAL(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    VAL(CU_MEM_HANDLE_TYPE_FABRIC);
    VAL(CU_MEM_ALLOCATION_TYPE_PINNED);
    VAL(CU_MEM_LOCATION_TYPE_DEVICE);
    VAL(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    VAL(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    VAL(CU_STREAM_NON_BLOCKING);
    VAL(CU_EVENT_DISABLE_TIMING);
    VAL(CU_STREAM_WAIT_VALUE_GEQ);
    VAL(CU_STREAM_WAIT_VALUE_EQ);
    VAL(CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER);
    VAL(CU_IPC_HANDLE_SIZE);
    VAL(CU_MEMHOSTREGISTER_PORTABLE);
    VAL(CU_MEMHOSTREGISTER_DEVICEMAP);
    VAL(CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
    VAL(CU_MEMORYTYPE_HOST);
    VAL(CU_MEMORYTYPE_DEVICE);
    VAL(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
    VAL(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR);
    VAL(CU_POINTER_ATTRIBUTE_RANGE_SIZE);
    VAL(CU_POINTER_ATTRIBUTE_ACCESS_FLAGS);
    VAL(CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READ);
    VAL(CU_POINTER_ATTRIBUTE_ACCESS_FLAG_READWRITE);
    VAL(CUDA_ERROR_INVALID_PTX);
    VAL(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
    VAL(CUDA_ERROR_LAUNCH_FAILED);
    return 0;
}
