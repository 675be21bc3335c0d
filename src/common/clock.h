/*
 * Monotonic deadlines, shared by every bounded wait in the library (and by
 * pthread_cond_timedwait on condition variables set to CLOCK_MONOTONIC).
 */
#ifndef VMMT_CLOCK_H
#define VMMT_CLOCK_H

#include <stdint.h>
#include <time.h>

/* The CLOCK_MONOTONIC time `us` microseconds from now. */
static inline void vmmt__deadline(struct timespec *t, int64_t us)
{
    clock_gettime(CLOCK_MONOTONIC, t);
    t->tv_sec += (time_t)(us / 1000000);
    t->tv_nsec += (long)(us % 1000000) * 1000L;
    if (t->tv_nsec >= 1000000000L) t->tv_sec++, t->tv_nsec -= 1000000000L;
}

static inline int vmmt__deadline_passed(const struct timespec *t)
{
    struct timespec now;

    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > t->tv_sec || (now.tv_sec == t->tv_sec && now.tv_nsec >= t->tv_nsec);
}

static inline double vmmt__now_us(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* CLOCK_MONOTONIC in milliseconds, for deadlines kept as integers (poll timeouts). */
static inline int64_t vmmt__now_ms(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

#endif
