/*
 * A host pool's producer copies host memory into the pool with the CPU, and
 * one thread's memcpy is slow beside the copy engines: on the H200's host a
 * 64 MiB feature took 11.8 ms (5.7 GB/s) of a 13.4 ms round trip
 * (BENCHMARKS.md, 2026-12-02 16:28Z). So a copy of at least PART_MIN bytes
 * is cut into parts of at least PART_MIN, at most MAX_PARTS, and all but the
 * first go to threads made for this copy and joined before it returns: no
 * thread or stack outlives the call (nothing to leak, nothing a fork can inherit),
 * and making one costs tens of microseconds against the milliseconds the
 * split saves. A thread that cannot be made leaves its part to the caller's
 * thread, so the copy cannot fail. The threads block every signal: the
 * application's handlers run only on its own threads.
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_copy.h"

#define PART_MIN  ((size_t)2 << 20)
#define MAX_PARTS 4
#define STACK     ((size_t)256 << 10) /* memcpy needs little; static TLS sits here too */

struct part {
    unsigned char *dst;
    const unsigned char *src;
    size_t n;
    pthread_t thread;
    void *stack;
    int started;
};

int vmmt__cpu_copy_parts(size_t n)
{
    size_t parts = n / PART_MIN;

    if (parts < 1) return 1;
    return parts > MAX_PARTS ? MAX_PARTS : (int)parts;
}

static void *copy_part(void *arg)
{
    struct part *p = arg;

    memcpy(p->dst, p->src, p->n);
    return NULL;
}

/*
 * Start part p on a thread with a stack of its own, mapped here and unmapped
 * by the caller after the join: glibc keeps the stacks it made itself for
 * later threads, mappings that would outlive the call. 0 if none could be
 * made (the caller then copies the part).
 */
static int start(struct part *p)
{
    pthread_attr_t attr;
    int ok = 0;

    p->stack =
        mmap(NULL, STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (p->stack == MAP_FAILED) return 0;
    if (pthread_attr_init(&attr) == 0) {
        ok = pthread_attr_setstack(&attr, p->stack, STACK) == 0 &&
             pthread_create(&p->thread, &attr, copy_part, p) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!ok) munmap(p->stack, STACK);
    return ok;
}

void vmmt__cpu_copy(void *dst, const void *src, size_t n)
{
    struct part part[MAX_PARTS];
    int parts = vmmt__cpu_copy_parts(n);
    /* Whole 4 KiB multiples: parts meet on page-sized steps of dst. */
    size_t each = (n / (size_t)parts + 4095) & ~(size_t)4095, at = 0;
    sigset_t all, old;

    if (parts == 1) {
        memcpy(dst, src, n);
        return;
    }
    for (int i = 0; i < parts; i++) {
        size_t len = i == parts - 1 || each > n - at ? n - at : each;
        part[i] = (struct part){
            .dst = (unsigned char *)dst + at, .src = (const unsigned char *)src + at, .n = len};
        at += len;
    }
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* inherited by the threads made now */
    for (int i = 1; i < parts; i++)
        part[i].started = start(&part[i]);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    for (int i = 0; i < parts; i++)
        if (i == 0 || !part[i].started) copy_part(&part[i]);
    for (int i = 1; i < parts; i++) {
        if (!part[i].started) continue;
        pthread_join(part[i].thread, NULL);
        munmap(part[i].stack, STACK);
    }
}
