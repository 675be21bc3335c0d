/*
 * Internal error reporting. A failing function records its status and a
 * message on the calling thread and returns the status; its callers add
 * context in front with vmmt__wrap, so the final text reads from the user's
 * request down to the root cause.
 */
#ifndef VMMT_STATUS_H
#define VMMT_STATUS_H

#include "vmmt.h"

#if defined(__GNUC__)
#define VMMT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define VMMT_PRINTF(a, b)
#endif

/* Replace the thread's error with status and message; returns status. */
int vmmt__fail(int status, const char *fmt, ...) VMMT_PRINTF(2, 3);

/* Prefix the thread's message with "context: "; returns status. */
int vmmt__wrap(int status, const char *fmt, ...) VMMT_PRINTF(2, 3);

/*
 * vmmt__fail that also records a driver result for vmmt_last_cuda_error().
 * Naming the result is the driver layer's job (vmmt__cu_fail in driver.h):
 * this layer stores the number and knows nothing of CUDA.
 */
int vmmt__fail_cuda(int status, int cuda_result, const char *fmt, ...) VMMT_PRINTF(3, 4);

/* Record a failed system call using errno: "<what>: strerror(errno)". */
int vmmt__sys_fail(const char *fmt, ...) VMMT_PRINTF(1, 2);

/*
 * Cleanup after a failure may call functions that fail too; save the error
 * that explains the original failure first and restore it afterwards.
 */
struct vmmt__saved_error {
    int status, cuda;
    char msg[1024];
};
void vmmt__error_save(struct vmmt__saved_error *e);
int vmmt__error_restore(const struct vmmt__saved_error *e); /* returns the saved status */

/* Clear the thread's error. */
void vmmt__clear(void);

/* Log through the application's callback (or stderr), filtered by level. */
void vmmt__log(vmmt_log_level level, const char *fmt, ...) VMMT_PRINTF(2, 3);

#endif
