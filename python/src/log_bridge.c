/*
 * The library's log lines into Python's `logging` (vmmt/_logging.py).
 *
 * The library logs from any thread, its own among them, often with its
 * locks held, so the callback never takes the GIL: a Python thread holding
 * the GIL may be waiting for one of those locks (Pool.stats() for the
 * pool's), and the two would wait on each other for ever. The callback
 * queues the line in a bounded ring instead and asks the interpreter, with
 * Py_AddPendingCall (made for callers without a thread state), to run the
 * drain on its main thread, which hands each line to the Python dispatcher.
 * A line that finds the ring full goes to stderr as the library's default
 * writer would print it: nothing is dropped. A line names the Python
 * methods where the library's names its C functions (errors.c).
 *
 * The package turns routing off at exit (atexit), draining what is queued
 * first; from then on lines go to stderr again. `routing` is read and
 * Py_AddPendingCall made under one mutex, so after route(None) returns no
 * thread of the library can schedule a call into a finalizing interpreter.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "py_vmmt.h"

#define RING 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    int level;
    char msg[1024];
} ring[RING];
static int head, count, scheduled, routing;
static PyObject *dispatch; /* (level, message) -> None; GIL held to use */
static int atfork_done;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

static int drain(void *unused);

static void on_log(vmmt_log_level level, const char *message, void *user)
{
    (void)user;
    pthread_mutex_lock(&lock);
    if (!routing || count == RING) {
        pthread_mutex_unlock(&lock);
        fprintf(stderr, "vmmt %s: %s\n", level_names[level], message);
        return;
    }
    ring[(head + count) % RING].level = (int)level;
    snprintf(ring[(head + count) % RING].msg, sizeof ring[0].msg, "%s", message);
    count++;
    /* Failed (the interpreter's queue is full): the next line, or a drain, tries again. */
    if (!scheduled) scheduled = Py_AddPendingCall(drain, NULL) == 0;
    pthread_mutex_unlock(&lock);
}

/* Hand every queued line to the dispatcher; GIL held. Always 0 (a pending call's success). */
static int drain(void *unused)
{
    (void)unused;
    for (;;) {
        int level;
        char msg[sizeof ring[0].msg];
        PyObject *r, *text;

        pthread_mutex_lock(&lock);
        scheduled = 0;
        if (count == 0) {
            pthread_mutex_unlock(&lock);
            return 0;
        }
        level = ring[head].level;
        memcpy(msg, ring[head].msg, sizeof msg);
        head = (head + 1) % RING;
        count--;
        pthread_mutex_unlock(&lock);
        if (dispatch == NULL) {
            fprintf(stderr, "vmmt %s: %s\n", level_names[level], msg);
            continue;
        }
        text = vmmtpy_python_message(msg);
        r = text == NULL ? NULL : PyObject_CallFunction(dispatch, "iO", level, text);
        Py_XDECREF(text);
        /* A handler that raises must not stop the others' lines, nor the code it interrupted. */
        if (r == NULL) PyErr_Print();
        Py_XDECREF(r);
    }
}

/* A child forked while another thread held the lock would wait for it for ever. */
static void after_fork_child(void)
{
    pthread_mutex_init(&lock, NULL);
    scheduled = 0;
}

/* _log_route(dispatch or None): route the library's lines to dispatch, or back to stderr. */
PyObject *vmmtpy_log_route(PyObject *self, PyObject *fn)
{
    (void)self;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "_log_route takes a callable (level, message) or None");
        return NULL;
    }
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork_done = 1;
    }
    if (fn == Py_None) {
        pthread_mutex_lock(&lock);
        routing = 0;
        pthread_mutex_unlock(&lock);
        vmmt_set_log(NULL, NULL);
        drain(NULL);
        Py_CLEAR(dispatch);
        Py_RETURN_NONE;
    }
    {
        PyObject *old = dispatch;
        Py_INCREF(fn);
        dispatch = fn;
        Py_XDECREF(old);
    }
    pthread_mutex_lock(&lock);
    routing = 1;
    pthread_mutex_unlock(&lock);
    vmmt_set_log(on_log, NULL);
    Py_RETURN_NONE;
}

/* _log_drain(): deliver what is queued now, on this thread (tests, and before reading stats). */
PyObject *vmmtpy_log_drain(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    drain(NULL);
    Py_RETURN_NONE;
}
