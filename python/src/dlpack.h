/*
 * The DLPack ABI (version 1.0), written from the specification
 * (dmlc.github.io/dlpack): the binding both takes tensors through it
 * (__dlpack__ of the source array) and hands consumed buffers out through it.
 * Only what the binding reads or fills is declared.
 */
#ifndef VMMT_PY_DLPACK_H
#define VMMT_PY_DLPACK_H

#include <stdint.h>

#define VMMT_DLPACK_MAJOR 1
#define VMMT_DLPACK_MINOR 0

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/* A C enum in the specification: int-sized. */
typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3, /* page-locked host memory */
    kDLCUDAManaged = 13
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6
};

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL: compact row-major */
    uint64_t byte_offset;
} DLTensor;

/* The legacy (unversioned) managed tensor: capsule name "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1ULL << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1ULL << 1)

/* The versioned managed tensor: capsule name "dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif
