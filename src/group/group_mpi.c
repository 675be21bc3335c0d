/*
 * The MPI adapter of the group exchange, in its own library (libvmmt_mpi),
 * built only where CMake finds MPI, so that libvmmt itself never depends on
 * an MPI implementation. It uses the public API only.
 *
 * MPI_Allgather on a duplicate of the caller's communicator, so the group's
 * traffic never mixes with the application's. MPI has no timeout of its own:
 * a rank that dies makes the job's runtime (mpirun) end the job, which is the
 * bound here.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h" /* macros only: this library links libvmmt's public API alone */
#include "vmmt_mpi.h"

#define GROUP_CONFIG_V1 VMMT__SIZE_V1(vmmt_group_config, max_allocations)

struct mpi_ctx {
    MPI_Comm comm;
};

static void mpi_reason(int rc, const char *what, char *err, size_t cap)
{
    char text[MPI_MAX_ERROR_STRING] = "";
    int len = 0;

    MPI_Error_string(rc, text, &len);
    snprintf(err, cap, "%s -> MPI error %d: %s", what, rc, text);
}

static int mpi_allgather(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                         size_t cap)
{
    struct mpi_ctx *m = ctx;
    int rc;

    /* MPI counts are int: larger blocks go as multiples of a contiguous 1 KiB type. */
    if (bytes <= (size_t)0x7fffffff) {
        rc = MPI_Allgather(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, m->comm);
    } else {
        snprintf(err, cap, "MPI_Allgather: a block of %zu bytes is more than an int count", bytes);
        return -1;
    }
    if (rc != MPI_SUCCESS) {
        mpi_reason(rc, "MPI_Allgather", err, cap);
        return -1;
    }
    return 0;
}

static int mpi_barrier(void *ctx, char *err, size_t cap)
{
    struct mpi_ctx *m = ctx;
    int rc = MPI_Barrier(m->comm);

    if (rc != MPI_SUCCESS) {
        mpi_reason(rc, "MPI_Barrier", err, cap);
        return -1;
    }
    return 0;
}

static void mpi_close(void *ctx)
{
    struct mpi_ctx *m = ctx;
    int finalized = 0;

    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&m->comm);
    free(m);
}

VMMT_API int vmmt_group_mpi_collective(MPI_Comm comm, vmmt_group_collective *out, int *rank,
                                       int *world_size)
{
    struct mpi_ctx *m;
    int init = 0, rc;

    if (out != NULL) memset(out, 0, sizeof *out);
    if (out == NULL || rank == NULL || world_size == NULL)
        return vmmt_set_error(VMMT_EINVAL,
                              "vmmt_group_mpi_collective: out, rank and world_size are required");
    if (comm == MPI_COMM_NULL)
        return vmmt_set_error(VMMT_EINVAL, "vmmt_group_mpi_collective: the communicator is "
                                           "MPI_COMM_NULL: pass the job's (MPI_COMM_WORLD)");
    MPI_Initialized(&init);
    if (!init)
        return vmmt_set_error(VMMT_ESTATE, "vmmt_group_mpi_collective: MPI is not initialised: "
                                           "call MPI_Init first");
    if ((m = calloc(1, sizeof *m)) == NULL)
        return vmmt_set_error(VMMT_ENOMEM, "vmmt_group_mpi_collective: no memory");
    if ((rc = MPI_Comm_dup(comm, &m->comm)) != MPI_SUCCESS) {
        char why[MPI_MAX_ERROR_STRING + 64];
        free(m);
        mpi_reason(rc, "vmmt_group_mpi_collective: MPI_Comm_dup", why, sizeof why);
        return vmmt_set_error(VMMT_ESYS, why);
    }
    /* Errors come back as codes, so the group can say which collective failed. */
    MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(m->comm, rank);
    MPI_Comm_size(m->comm, world_size);
    *out = (vmmt_group_collective){mpi_allgather, mpi_barrier, mpi_close, m};
    return VMMT_OK;
}

/*
 * The caller's config, of the size it was built with, goes to
 * vmmt_group_create_size whole, with rank, world_size and the collective
 * (fields of every version) set from the communicator: that call checks the
 * size and any field this library does not know, with its messages.
 */
VMMT_API int vmmt_group_create_mpi_size(const vmmt_group_config *config, size_t size, MPI_Comm comm,
                                        vmmt_group **out)
{
    vmmt_group_config *c;
    int st;

    if (out != NULL) *out = NULL;
    /* Refused by vmmt_group_create_size, with its message, before any MPI call. */
    if (config == NULL || out == NULL || size < GROUP_CONFIG_V1 || size > VMMT__STRUCT_MAX)
        return vmmt_group_create_size(config, size, out);
    /* The caller's size, not ours: rank, world_size and collective are in every version. */
    if ((c = calloc(1, size)) == NULL)
        return vmmt_set_error(VMMT_ENOMEM, "vmmt_group_create_mpi: no memory");
    memcpy(c, config, size);
    c->collective.close = NULL;
    st = vmmt_group_mpi_collective(comm, &c->collective, &c->rank, &c->world_size);
    if (st == VMMT_OK) st = vmmt_group_create_size(c, size, out);
    free(c);
    return st;
}
