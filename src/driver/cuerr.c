/*
 * Driver results as vmmt statuses and messages. This belongs to the driver
 * layer, above status.c: status records numbers and text, the driver layer
 * knows what a CUresult means and what the driver in use calls it.
 */
#include <stdarg.h>
#include <stdio.h>

#include "driver.h"

static int status_of_cu(CUresult r)
{
    switch (r) {
    case CUDA_ERROR_OUT_OF_MEMORY: return VMMT_ENOMEM;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE: return VMMT_ENODEV;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED: return VMMT_ENOTSUP;
    case CUDA_ERROR_TIMEOUT: return VMMT_ETIMEDOUT;
    default: return VMMT_ECUDA;
    }
}

int vmmt__cu_fail(CUresult r, const char *call_fmt, ...)
{
    char call[512];
    va_list ap;

    va_start(ap, call_fmt);
    vsnprintf(call, sizeof call, call_fmt, ap);
    va_end(ap);
    return vmmt__fail_cuda(status_of_cu(r), r, "%s -> %s", call, vmmt__cu_name(r));
}

int vmmt__cu_check(CUresult r, const char *call)
{
    return r == CUDA_SUCCESS ? VMMT_OK : vmmt__cu_fail(r, "%s", call);
}
