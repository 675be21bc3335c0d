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
};

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

/* The copy has completed: acknowledge, then tell the caller whether it was. */
static void write_words(struct pending *p)
{
    int acked = p->write != NULL ? p->write(p->arg) : 1;
    p->done(p->arg, acked);
}

/* Query an entry's event in its device's context: 1 done, 0 pending. */
static int finished(struct pending *p)
{
    CUresult r;

    /* Without the device's context the event cannot be asked; the entry
     * stays pending (evict refuses, destroy waits) rather than freeing a
     * slice that may still be read. */
    if (vmmt__ctx_enter(p->device) != VMMT_OK) return 0;
    r = vmmt__drv()->cuEventQuery(p->ev);
    vmmt__ctx_leave();
    if (r == CUDA_ERROR_NOT_READY) return 0;
    /* A failed copy still gives the slice back: the consume already reported it. */
    if (r != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_WARN, "acknowledgement event failed (%s); acknowledging anyway",
                  vmmt__cu_name(r));
    return 1;
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
        if (finished(p)) {
            write_words(p);
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
        write_words(&now);
        return r == CUDA_SUCCESS ? VMMT_OK
                                 : vmmt__cu_fail(r, "cuStreamSynchronize before acknowledging");
    }
    p->write = write;
    p->done = done;
    p->arg = arg;
    r = vmmt__drv()->cuEventRecord(p->ev, stream);
    /* Nothing queued before it (a dropped descriptor): acknowledge right here. */
    if (r == CUDA_SUCCESS) r = vmmt__drv()->cuEventQuery(p->ev);
    if (r == CUDA_ERROR_NOT_READY) {
        pthread_mutex_lock(&a->lock);
        st = start_thread(a);
        if (st == VMMT_OK) {
            p->next = a->pending;
            a->pending = p;
            pthread_cond_signal(&a->wake);
        }
        pthread_mutex_unlock(&a->lock);
        if (st == VMMT_OK) return VMMT_OK;
        /* No thread to finish it later: wait for the copy here. */
        r = vmmt__drv()->cuEventSynchronize(p->ev);
    } else if (r != CUDA_SUCCESS) {
        /* The event says nothing: the copy may still be queued, so the slice
         * must not be given back before the stream has drained. */
        st = vmmt__cu_fail(r, "cuEventRecord after the copy");
        vmmt__drv()->cuStreamSynchronize(stream);
    }
    write_words(p);
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
    /* Whatever is still pending: its copy ends, then the slice is given back. */
    while (a->pending != NULL) {
        struct pending *p = a->pending;
        a->pending = p->next;
        if (vmmt__ctx_enter(p->device) == VMMT_OK) {
            d->cuEventSynchronize(p->ev);
            vmmt__ctx_leave();
        }
        write_words(p);
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
