/*
 * VMM primitives: allocation properties, granularity, alignment, the sizing
 * rule, and the mapping object that owns one allocation mapped into one
 * reserved address range. Every function reports driver failures naming the
 * call and its CUresult; every acquisition is undone in reverse order when a
 * later step fails.
 */
#ifndef VMMT_VMM_H
#define VMMT_VMM_H

#include <stdint.h>

#include "cuabi.h"
#include "vmmt.h"

/* The driver's spelling of a handle type in messages: "FABRIC", "POSIX_FD", "NONE", "AUTO". */
const char *vmmt__handle_type_upper(vmmt_handle_type type);

/*
 * A device's probe as `vmmt probe` reports it: vmmt_probe_device, with
 * `selected` and `overridden` reflecting VMMT_HANDLE_TYPE. The status of
 * the probe, or of the override when it fails.
 */
int vmmt__probe_report(int device, vmmt_device_probe *out);

void vmmt__prop_init(CUmemAllocationProp *prop, int device, vmmt_handle_type type, int rdma);

/* Minimum and recommended granularity for allocations of `type` on `device`. */
int vmmt__granularity(int device, vmmt_handle_type type, size_t *minimum, size_t *recommended);

/* Round up to a power-of-two alignment; VMMT_EINVAL when it would overflow. */
int vmmt__align_up(uint64_t value, uint64_t align, uint64_t *out);
uint64_t vmmt__align_down(uint64_t value, uint64_t align);

/*
 * The pool-size rule: a request below one granularity unit is refused (or
 * rounded up to one unit when round_up is set); a request between units is
 * rounded down to a unit, and a notice says by how much.
 */
int vmmt__size_policy(uint64_t requested, uint64_t granularity, int round_up, uint64_t *out);

/*
 * One allocation mapped at a reserved range, readable and writable by one
 * device. The flags record how far setup went so that release undoes exactly
 * that, and can be retried after a partial failure.
 */
struct vmmt__mapping {
    CUdeviceptr base;
    uint64_t size;
    CUmemGenericAllocationHandle handle;
    int device; /* the device granted access */
    unsigned have_handle : 1;
    unsigned reserved : 1;
    unsigned mapped : 1;
};

/* Create an allocation of `size` on `device` and map it: create, reserve, map, set access. */
int vmmt__mapping_create(int device, uint64_t size, vmmt_handle_type type, int rdma,
                         struct vmmt__mapping *m);

/*
 * Map an allocation this process holds a handle to (from an import) at a
 * fresh range, accessible to `device`. On success the mapping owns the
 * handle; on failure the handle is released too.
 */
int vmmt__mapping_adopt(int device, CUmemGenericAllocationHandle handle, uint64_t size,
                        struct vmmt__mapping *m);

/* Grant `device` read-write access to the mapped range [base, base + size). */
int vmmt__grant_device(CUdeviceptr base, uint64_t size, int device);

/* Unmap, release the handle, free the range: in that order, each at most once. */
int vmmt__mapping_release(struct vmmt__mapping *m);

/* Export: a new fd owned by the caller, or the 64-byte FABRIC handle. */
int vmmt__export_posix_fd(CUmemGenericAllocationHandle handle, int *fd);
int vmmt__export_fabric(CUmemGenericAllocationHandle handle, CUmemFabricHandle *out);

/* Import a shared allocation; the caller keeps ownership of fd. */
int vmmt__import_posix_fd(int fd, CUmemGenericAllocationHandle *handle);
int vmmt__import_fabric(const CUmemFabricHandle *fabric, CUmemGenericAllocationHandle *handle);

/* Import and map at a fresh address in one step, rolling back on failure. */
int vmmt__mapping_import_posix_fd(int device, int fd, uint64_t size, struct vmmt__mapping *m);
int vmmt__mapping_import_fabric(int device, const CUmemFabricHandle *fabric, uint64_t size,
                                struct vmmt__mapping *m);

/* Read-write access for one device to [base, base+size), a run of whole mappings. */
int vmmt__grant_rw(CUdeviceptr base, uint64_t size, int device);

#define VMMT__IMEX_CHANNELS "/dev/nvidia-caps-imex-channels"

#endif
