/*
 * A consumer's reads and writes of a device control table (FABRIC pools,
 * and POSIX_FD pools made with device_control_table=1): through a stream and
 * pinned words of the import's own, never the legacy stream, which would
 * queue behind the application's work, and polled within a deadline, so
 * that a stalled device fails the call instead of hanging it. Used for a
 * slot's row (consume.c), the pool record at import (import_cache.c), a
 * slot's ready word in vmmt_consumer_check (producer_watch.c) and the
 * acknowledgements (consume.c, from the acker's thread after the copy).
 */
#include <time.h>

#include "clock.h"
#include "consumer_internal.h"
#include "driver.h"
#include "status.h"

/*
 * Each is made only if missing: a failed cuMemAllocHost after the stream was
 * created must not leave a pool that later reads think ready (the fault
 * sweep caught reads into a NULL word).
 */
int vmmt__table_open_poll(struct imported *ip)
{
    const struct vmmt_drv *d = vmmt__drv();
    int st = VMMT_OK;

    if (ip->host_table) return VMMT_OK;
    if (ip->poll_stream == NULL)
        st = VMMT_CU(d, cuStreamCreate(&ip->poll_stream, CU_STREAM_NON_BLOCKING));
    if (st == VMMT_OK && ip->poll_word == NULL)
        st = VMMT_CU(d, cuMemAllocHost((void **)&ip->poll_word, 4u * VMMT__POLL_WORDS));
    return st;
}

/* Wait within `until` for what is queued on the import's polling stream; `what` names it. */
static int poll_stream_done(const struct imported *ip, const struct timespec *until, int timeout_ms,
                            const char *what)
{
    struct timespec pause = {0, 10000};
    CUresult r;

    for (;;) {
        r = vmmt__drv()->cuStreamQuery(ip->poll_stream);
        if (r != CUDA_ERROR_NOT_READY) break;
        if (vmmt__deadline_passed(until))
            return vmmt__fail(VMMT_ETIMEDOUT,
                              "%s the producer's control table took more than %d ms; the device "
                              "is busy or stalled",
                              what, timeout_ms);
        nanosleep(&pause, NULL);
    }
    return r == CUDA_SUCCESS ? VMMT_OK : vmmt__cu_fail(r, "%s the control table", what);
}

int vmmt__table_read_words(const struct imported *ip, CUdeviceptr word, uint32_t words,
                           const struct timespec *until, int timeout_ms)
{
    CUresult r;

    if (words > VMMT__POLL_WORDS)
        return vmmt__fail(VMMT_EINVAL, "%u control table words asked at once, at most %d", words,
                          VMMT__POLL_WORDS);
    r = vmmt__drv()->cuMemcpyDtoHAsync(ip->poll_word, word, 4u * words, ip->poll_stream);
    if (r != CUDA_SUCCESS) return vmmt__cu_fail(r, "reading the control table");
    return poll_stream_done(ip, until, timeout_ms, "reading");
}

/* The slot's ready word into *out; context current, poll_lock held. */
static int read_ready_locked(struct imported *ip, uint32_t slot, uint32_t stride,
                             const struct timespec *until, int timeout_ms, uint32_t *out)
{
    int st = vmmt__table_open_poll(ip);

    if (st == VMMT_OK)
        st = vmmt__table_read_words(ip, ip->table + vmmt__ctrl_ready(0, stride, slot), 1, until,
                                    timeout_ms);
    if (st == VMMT_OK) *out = ip->poll_word[0];
    return st;
}

int vmmt__table_read_ready(struct imported *ip, uint32_t slot, uint32_t stride, int timeout_ms,
                           uint32_t *out)
{
    struct timespec until;
    int st;

    vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
    st = vmmt__ctx_enter(ip->device);
    if (st != VMMT_OK) return st;
    pthread_mutex_lock(&ip->poll_lock);
    st = read_ready_locked(ip, slot, stride, &until, timeout_ms, out);
    pthread_mutex_unlock(&ip->poll_lock);
    vmmt__ctx_leave();
    return st;
}

/*
 * A stream write cannot compare first, so the acknowledgement is written
 * only after a read of the ready word has shown the occupant still there:
 * written unconditionally after the copy, on the caller's stream, an
 * acknowledgement that came late (its occupant taken back meanwhile: a
 * cancel, a rank's release) landed over the next occupant's word and lost
 * that one's acknowledgement, so its slice stayed in flight for good (an
 * outside attacker's test_attack_outside2, cancel_late_device_ack). What is
 * left is the time between this read and the write landing, microseconds,
 * in which the occupant would have to be taken back, recycled, given out
 * again and acknowledged by another process.
 */
int vmmt__table_write_acks(struct imported *ip, uint32_t slot, uint32_t stride,
                           const struct vmmt__ranks *ranks, uint32_t gen, int timeout_ms,
                           int *written)
{
    const struct vmmt_drv *d = vmmt__drv();
    struct timespec until;
    uint32_t ready = 0;
    int st;

    *written = 0;
    vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
    st = vmmt__ctx_enter(ip->device);
    if (st != VMMT_OK) return st;
    pthread_mutex_lock(&ip->poll_lock);
    st = read_ready_locked(ip, slot, stride, &until, timeout_ms, &ready);
    if (st == VMMT_OK && ready == gen) {
        for (uint32_t r = ranks->lo; r < ranks->hi && st == VMMT_OK;
             r = vmmt__ranks_after(ranks, r))
            st = VMMT_CU(d, cuStreamWriteValue32(ip->poll_stream,
                                                 ip->table + vmmt__ctrl_ack(0, stride, slot, r),
                                                 gen, CU_STREAM_WRITE_VALUE_DEFAULT));
        /* Queued ones land whatever failed after them: wait for them either way. */
        int landed = poll_stream_done(ip, &until, timeout_ms, "writing acknowledgements into");
        if (st == VMMT_OK) st = landed;
        if (st == VMMT_OK) *written = 1;
    }
    pthread_mutex_unlock(&ip->poll_lock);
    vmmt__ctx_leave();
    return st;
}
