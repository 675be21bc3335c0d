/*
 * vmmt's group exchange over MPI: libvmmt_mpi, built where CMake finds MPI
 * (pkg-config vmmt_mpi; CMake find_package(vmmt COMPONENTS mpi), target
 * vmmt::vmmt_mpi). Apart from vmmt.h so that programs which never use MPI
 * need neither mpi.h nor MPI's libraries; docs/group.md has the protocol.
 */
#ifndef VMMT_MPI_H
#define VMMT_MPI_H

#include <mpi.h>

#include "vmmt.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A group over MPI_Allgather on a duplicate of `comm` (errors are returned,
 * not fatal); rank and world_size come from it, whatever config says. MPI
 * must be initialised, and stay so until vmmt_group_destroy. MPI has no
 * timeout: a dead rank is bounded by the job's runtime (mpirun ends the job).
 */
VMMT_API int vmmt_group_create_mpi_size(const vmmt_group_config *config, size_t size, MPI_Comm comm,
                                        vmmt_group **out);
static inline int vmmt_group_create_mpi(const vmmt_group_config *config, MPI_Comm comm,
                                        vmmt_group **out)
{
    return vmmt_group_create_mpi_size(config, sizeof(vmmt_group_config), comm, out);
}

/* The MPI collective alone, on a duplicate of comm, with this rank and the world size. */
VMMT_API int vmmt_group_mpi_collective(MPI_Comm comm, vmmt_group_collective *out, int *rank,
                                       int *world_size);

#ifdef __cplusplus
}
#endif

#endif
