#include "status.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Long enough for the probe's message, which lists three candidates with causes. */
#define MSG_CAP 4096

static _Thread_local char t_msg[MSG_CAP];
static _Thread_local int t_status;
static _Thread_local int t_cuda;

const char *vmmt_strerror(int status)
{
    switch (status) {
    case VMMT_OK: return "success";
    case VMMT_EINVAL: return "invalid argument";
    case VMMT_ENODRIVER: return "no NVIDIA driver";
    case VMMT_ENODEV: return "no such device";
    case VMMT_ENOTSUP: return "not supported";
    case VMMT_ECUDA: return "CUDA driver call failed";
    case VMMT_ENOMEM: return "out of memory";
    case VMMT_EFULL: return "pool is full";
    case VMMT_ETIMEDOUT: return "timed out";
    case VMMT_EFAILED: return "pool failed";
    case VMMT_ECLOSED: return "shut down";
    case VMMT_EPROTO: return "malformed descriptor or message";
    case VMMT_EPERM: return "permission denied";
    case VMMT_ESYS: return "system call failed";
    case VMMT_ESTATE: return "invalid state";
    case VMMT_ETOOBIG: return "request too large";
    }
    return "unknown status";
}

const char *vmmt_last_error(void)
{
    return t_msg;
}
int vmmt_last_status(void)
{
    return t_status;
}
int vmmt_last_cuda_error(void)
{
    return t_cuda;
}

int vmmt_set_error(int status, const char *message)
{
    /* An empty message would read as "nothing failed yet". */
    const char *m = message != NULL && message[0] != '\0' ? message : "no message given";
    size_t n = strnlen(m, MSG_CAP - 1);

    /* memmove: the message may be vmmt_last_error() itself, or a part of it
     * (an adapter passing on what it found), which vsnprintf may not read.
     * A cut never splits a UTF-8 character: back to its first byte. */
    if (n == MSG_CAP - 1 && ((unsigned char)m[n] & 0xC0) == 0x80)
        while (n > 0 && ((unsigned char)m[n] & 0xC0) == 0x80)
            n--;
    memmove(t_msg, m, n);
    t_msg[n] = '\0';
    t_status = status;
    t_cuda = 0;
    return status;
}

void vmmt__clear(void)
{
    t_msg[0] = '\0';
    t_status = VMMT_OK;
    t_cuda = 0;
}

static int vfail(int status, const char *fmt, va_list ap)
{
    vsnprintf(t_msg, sizeof t_msg, fmt, ap);
    t_status = status;
    t_cuda = 0;
    return status;
}

int vmmt__fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfail(status, fmt, ap);
    va_end(ap);
    return status;
}

int vmmt__wrap(int status, const char *fmt, ...)
{
    char inner[MSG_CAP];
    char outer[MSG_CAP];
    va_list ap;

    memcpy(inner, t_msg, sizeof inner);
    va_start(ap, fmt);
    vsnprintf(outer, sizeof outer, fmt, ap);
    va_end(ap);
    if (inner[0] != '\0')
        snprintf(t_msg, sizeof t_msg, "%s: %s", outer, inner);
    else
        snprintf(t_msg, sizeof t_msg, "%s", outer);
    t_status = status;
    return status;
}

int vmmt__fail_cuda(int status, int cuda_result, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfail(status, fmt, ap);
    va_end(ap);
    t_cuda = cuda_result;
    return status;
}

int vmmt__sys_fail(const char *fmt, ...)
{
    char what[512];
    int err = errno;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return vmmt__fail(err == ENOMEM ? VMMT_ENOMEM : VMMT_ESYS, "%s: %s", what, strerror(err));
}

void vmmt__error_save(struct vmmt__saved_error *e)
{
    e->status = t_status;
    e->cuda = t_cuda;
    snprintf(e->msg, sizeof e->msg, "%s", t_msg);
}

int vmmt__error_restore(const struct vmmt__saved_error *e)
{
    snprintf(t_msg, sizeof t_msg, "%s", e->msg);
    t_status = e->status;
    t_cuda = e->cuda;
    return e->status;
}
