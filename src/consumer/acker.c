#include "acker.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "clock.h"
#include "ctrl.h"
#include "driver.h"
#include "status.h"

struct pending {
    struct pending *next;
    CUevent ev; /* owned for the life of the entry; reused */
    int device;
    int (*write)(void *); /* the acknowledgement; NULL: only the copy's end is waited for */
    void (*done)(void *, int);
    void *arg;
    int64_t query_failing_ms; /* when its event's query first failed; 0: it has not */
};

/* How long an event's query must keep failing to be taken as the copy's own
 * failure (the stream stopped there) rather than the query's. */
#define QUERY_FAIL_MS 1000

struct vmmt__acker {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t swept; /* a sweep in progress has finished */
    int sweeping;         /* entries are detached from `pending` while this is set */
    struct pending *pending, *spare;
    pthread_t thread;
    int started, stop;
};

/* How often the thread looks at pending events: well under the recycling target. */
#define POLL_NS 10000

int vmmt__acker_create(struct vmmt__acker **out)
{
    struct vmmt__acker *a = calloc(1, sizeof *a);

    if (a == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory for the acknowledgement writer");
    pthread_mutex_init(&a->lock, NULL);
    pthread_cond_init(&a->wake, NULL);
    pthread_cond_init(&a->swept, NULL);
    *out = a;
    return VMMT_OK;
}

/*
 * The copy has completed: acknowledge, then tell the caller whether it was
 * (VMMT__ACK_COPY_FAILED whatever was written, when the copy failed on its
 * stream). 0 when the writer asks to be called again later (a driver call
 * failed; the entry stays pending), 1 when done.
 */
static int write_words(struct pending *p, int copy_failed)
{
    int acked = p->write != NULL ? p->write(p->arg) : 1;

    if (acked == VMMT__ACK_AGAIN) return 0;
    p->done(p->arg, copy_failed ? VMMT__ACK_COPY_FAILED : acked);
    return 1;
}

/*
 * Query an entry's event in its device's context: 1 done, 0 pending, -1 the
 * copy failed on its stream. A query that fails says nothing of the copy,
 * which may still be queued: acknowledged then, its slice went to the next
 * publish and the copy read that buffer's bytes, with vmmt_consume and
 * vmmt_consumer_check both OK (an attacker's test_attack_flush,
 * event_query_fails). So the entry stays pending and is asked again. Only an
 * error that persists for QUERY_FAIL_MS is taken as the copy's own (a stream
 * that failed reports it at every query): its slice is given back and the
 * copy marked failed, so that vmmt_consumer_check says so.
 */
static int finished(struct pending *p)
{
    CUresult r;

    /* Without the device's context the event cannot be asked; the entry
     * stays pending (evict refuses, destroy waits) rather than freeing a
     * slice that may still be read. */
    if (vmmt__ctx_enter(p->device) != VMMT_OK) return 0;
    r = vmmt__drv()->cuEventQuery(p->ev);
    vmmt__ctx_leave();
    if (r == CUDA_SUCCESS) return 1;
    if (r == CUDA_ERROR_NOT_READY) {
        p->query_failing_ms = 0;
        return 0;
    }
    if (p->query_failing_ms == 0) {
        p->query_failing_ms = vmmt__now_ms();
        vmmt__log(VMMT_LOG_WARN,
                  "cannot learn whether a consume's copy has completed (cuEventQuery: %s): its "
                  "acknowledgement waits, and is given as a failed copy's if this lasts %d ms",
                  vmmt__cu_name(r), QUERY_FAIL_MS);
        return 0;
    }
    return vmmt__now_ms() - p->query_failing_ms >= QUERY_FAIL_MS ? -1 : 0;
}

/* One pass: acknowledge every finished entry; lock held on entry and exit. */
static void sweep(struct vmmt__acker *a)
{
    struct pending *todo = a->pending, *keep = NULL, *next;

    a->pending = NULL;
    a->sweeping++;
    pthread_mutex_unlock(&a->lock);
    for (struct pending *p = todo; p != NULL; p = next) {
        next = p->next;
        int f = finished(p);
        if (f != 0 && write_words(p, f < 0)) {
            pthread_mutex_lock(&a->lock);
            p->next = a->spare;
            a->spare = p;
            pthread_mutex_unlock(&a->lock);
        } else {
            p->next = keep;
            keep = p;
        }
    }
    pthread_mutex_lock(&a->lock);
    while (keep != NULL) {
        next = keep->next;
        keep->next = a->pending;
        a->pending = keep;
        keep = next;
    }
    a->sweeping--;
    pthread_cond_broadcast(&a->swept);
    /* A flush's sweep hid every entry from the thread, which may have gone to
     * sleep on an empty list meanwhile: wake it for those left (the model
     * test's lost wake-up, a slice never acknowledged, tests/model/FINDINGS.md). */
    if (a->pending != NULL) pthread_cond_signal(&a->wake);
}

static void *acker_main(void *arg)
{
    struct vmmt__acker *a = arg;
    struct timespec pause = {0, POLL_NS};

    pthread_mutex_lock(&a->lock);
    while (!a->stop) {
        if (a->pending == NULL) {
            pthread_cond_wait(&a->wake, &a->lock);
            continue;
        }
        sweep(a);
        if (a->pending == NULL) continue;
        pthread_mutex_unlock(&a->lock);
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&a->lock);
    }
    pthread_mutex_unlock(&a->lock);
    return NULL;
}

/* An entry with an event of this device, reused if one is spare; lock held. */
static int take_entry(struct vmmt__acker *a, int device, struct pending **out)
{
    for (struct pending **pp = &a->spare; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->device == device) {
            *out = *pp;
            *pp = (*pp)->next;
            return VMMT_OK;
        }
    }
    *out = calloc(1, sizeof **out);
    if (*out == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory for an acknowledgement");
    (*out)->device = device;
    if (vmmt__drv()->cuEventCreate(&(*out)->ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS)
        return VMMT_OK;
    free(*out);
    *out = NULL;
    return vmmt__fail(VMMT_ECUDA, "cuEventCreate for an acknowledgement failed");
}

static int start_thread(struct vmmt__acker *a)
{
    int err;

    if (a->started) return VMMT_OK;
    err = pthread_create(&a->thread, NULL, acker_main, a);
    if (err != 0) {
        errno = err;
        return vmmt__sys_fail("starting the consumer's acknowledgement thread");
    }
    a->started = 1;
    return VMMT_OK;
}

/* Where no thread can finish it later: the writer called until it is done
 * (it gives up on its own once its failures outlast the consumer's timeout). */
static void write_words_here(struct pending *p, int copy_failed)
{
    struct timespec pause = {0, 1000000};

    while (!write_words(p, copy_failed))
        nanosleep(&pause, NULL);
}

/* Into the list the thread sweeps; 0 when there is no thread to sweep it. */
static int queue(struct vmmt__acker *a, struct pending *p)
{
    int st;

    pthread_mutex_lock(&a->lock);
    st = start_thread(a);
    if (st == VMMT_OK) {
        p->next = a->pending;
        a->pending = p;
        pthread_cond_signal(&a->wake);
    }
    pthread_mutex_unlock(&a->lock);
    return st == VMMT_OK;
}

int vmmt__acker_defer(struct vmmt__acker *a, int device, CUstream stream, int (*write)(void *),
                      void (*done)(void *, int), void *arg)
{
    struct pending *p;
    CUresult r;
    int st;

    pthread_mutex_lock(&a->lock);
    st = take_entry(a, device, &p);
    pthread_mutex_unlock(&a->lock);
    if (st != VMMT_OK) {
        /* No event to wait with: wait for the stream instead, then acknowledge. */
        struct pending now = {.write = write, .done = done, .arg = arg};
        vmmt__log(VMMT_LOG_WARN, "%s; acknowledging after a stream synchronize", vmmt_last_error());
        r = vmmt__drv()->cuStreamSynchronize(stream);
        /* Drained, or failed (the stream stops at its error): nothing of it runs later. */
        write_words_here(&now, r != CUDA_SUCCESS);
        return r == CUDA_SUCCESS ? VMMT_OK
                                 : vmmt__cu_fail(r, "cuStreamSynchronize before acknowledging");
    }
    p->write = write;
    p->done = done;
    p->arg = arg;
    p->query_failing_ms = 0;
    r = vmmt__drv()->cuEventRecord(p->ev, stream);
    if (r == CUDA_SUCCESS) {
        /* Nothing queued before it (a dropped descriptor): acknowledged right
         * here. Not yet done, or the query failed: the thread asks again. */
        if (vmmt__drv()->cuEventQuery(p->ev) == CUDA_SUCCESS && write_words(p, 0)) goto spare;
        if (queue(a, p)) return VMMT_OK;
        /* No thread to finish it later: wait for the copy here. */
        /* (An error: the copy failed, and the stream stopped there.) */
        r = vmmt__drv()->cuEventSynchronize(p->ev);
        write_words_here(p, r != CUDA_SUCCESS);
        goto spare;
    }
    /* The event was not recorded and says nothing: only a drained stream does
     * (or a failed one, which stops at its error). */
    st = vmmt__cu_fail(r, "cuEventRecord after the copy");
    r = vmmt__drv()->cuStreamSynchronize(stream);
    /* A writer that asks to be called again is called by the thread (an event
     * never recorded reads complete), or here where there is none. */
    if (r == CUDA_SUCCESS && write_words(p, 0)) goto spare;
    if (r == CUDA_SUCCESS && queue(a, p)) return st;
    write_words_here(p, r != CUDA_SUCCESS);
spare:
    pthread_mutex_lock(&a->lock);
    p->next = a->spare;
    a->spare = p;
    pthread_mutex_unlock(&a->lock);
    return st;
}

void vmmt__acker_flush(struct vmmt__acker *a)
{
    pthread_mutex_lock(&a->lock);
    /* Entries the thread is looking at are invisible until it is done. */
    while (a->sweeping > 0)
        pthread_cond_wait(&a->swept, &a->lock);
    sweep(a);
    pthread_mutex_unlock(&a->lock);
}

int vmmt__acker_finish(struct vmmt__acker *a, int timeout_ms)
{
    struct timespec until, pause = {0, 100000};
    int abandoned = 0;

    pthread_mutex_lock(&a->lock);
    a->stop = 1;
    pthread_cond_broadcast(&a->wake);
    pthread_mutex_unlock(&a->lock);
    if (a->started) pthread_join(a->thread, NULL);
    a->started = 0;
    /* Polled, not synchronized: an event behind a wedged stream must not hold us. */
    vmmt__deadline(&until, (int64_t)timeout_ms * 1000);
    pthread_mutex_lock(&a->lock);
    while (a->pending != NULL) {
        sweep(a);
        if (a->pending == NULL || vmmt__deadline_passed(&until)) break;
        pthread_mutex_unlock(&a->lock);
        nanosleep(&pause, NULL);
        pthread_mutex_lock(&a->lock);
    }
    while (a->pending != NULL) {
        struct pending *p = a->pending;
        a->pending = p->next;
        p->next = a->spare;
        a->spare = p;
        abandoned++;
    }
    pthread_mutex_unlock(&a->lock);
    return abandoned;
}

void vmmt__acker_destroy(struct vmmt__acker *a)
{
    const struct vmmt_drv *d = vmmt__drv();

    if (a == NULL) return;
    pthread_mutex_lock(&a->lock);
    a->stop = 1;
    pthread_cond_broadcast(&a->wake);
    pthread_mutex_unlock(&a->lock);
    if (a->started) pthread_join(a->thread, NULL);
    /* Whatever is still pending: its copy ends, then the slice is given back;
     * one whose end cannot be waited for is not. */
    while (a->pending != NULL) {
        struct pending *p = a->pending;
        int ended = vmmt__ctx_enter(p->device) == VMMT_OK;
        a->pending = p->next;
        CUresult r = CUDA_SUCCESS;
        if (ended) {
            r = d->cuEventSynchronize(p->ev);
            vmmt__ctx_leave();
        }
        /* An error: the copy failed, and its stream stopped there. */
        if (ended)
            write_words_here(p, r != CUDA_SUCCESS);
        else
            p->done(p->arg, VMMT__ACK_LOST);
        p->next = a->spare;
        a->spare = p;
    }
    while (a->spare != NULL) {
        struct pending *p = a->spare;
        a->spare = p->next;
        if (vmmt__ctx_enter(p->device) == VMMT_OK) {
            CUresult r = d->cuEventDestroy(p->ev);
            if (r != CUDA_SUCCESS)
                vmmt__log(VMMT_LOG_ERROR,
                          "cuEventDestroy of an acknowledgement event failed (%s); leaked",
                          vmmt__cu_name(r));
            vmmt__ctx_leave();
        } else {
            vmmt__log(VMMT_LOG_ERROR, "no context to destroy an acknowledgement event in; leaked");
        }
        free(p);
    }
    pthread_cond_destroy(&a->swept);
    pthread_cond_destroy(&a->wake);
    pthread_mutex_destroy(&a->lock);
    free(a);
}
