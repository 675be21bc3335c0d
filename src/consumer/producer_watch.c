/*
 * Dead producers, on the consumer's side. A producer that dies between
 * enqueuing its copy and its ready flag leaves every consumer stream that
 * waits on that flag wedged: on a GPU such a wait has no limit. The consumer
 * therefore holds a pidfd of each producer (taken on the broker connection,
 * whose SO_PEERCRED names the producer process) and a thread watches them
 * with epoll, and beside them the liveness links: a link hangs up when the
 * producer's end closes, and only the producer holds that end (its broker's
 * sockets are not kept by children it forks, fork_guard.c). A hang-up means
 * the producer exited or shut the pool down; where no pidfd can be had
 * (pidfd_open refused, a kernel before 6.5) it is all there is. Either way
 * the pool is over; then, under the consumer's lock:
 *
 *   - every descriptor this process consumed whose ready word had not
 *     reached its generation is marked failed: what was (or will be) copied
 *     is not the producer's buffer, and vmmt_consumer_check says so;
 *   - those ready words are set by the consumer itself, so the waits queued
 *     on its streams complete and the streams are not wedged (nobody else
 *     will ever write them: the producer's context went with its process);
 *   - new consumes of the pool fail with VMMT_ECLOSED;
 *   - the pool is let go once every copy out of it is done.
 *
 * Pools imported without a broker (FABRIC) have no pidfd: their producer may
 * live on another node, where a pid means nothing here. They are let go by
 * count only (max_pools), once idle.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "acker.h"
#include "broker.h"
#include "clock.h"
#include "consumer_internal.h"
#include "ctrl.h"
#include "driver.h"
#include "status.h"

struct vmmt__watch {
    int ep, wake; /* epoll set of pidfds; eventfd that wakes the thread */
    pthread_t thread;
    int stop;
};

/* How often a consume polls its producer's pidfd itself (the thread is the main path). */
#define CHECK_EVERY_US 1000
/* How often the thread retries letting go of dead producers' pools still busy. */
#define REAP_EVERY_MS 10

static int pidfd_exited(int pidfd)
{
    struct pollfd p = {.fd = pidfd, .events = POLLIN};

    return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

/*
 * Is ip's producer gone? Its pidfd says it exited; its liveness link hangs
 * up when it exited or shut the pool down (the broker stops only once every
 * publish copy has landed, so nothing is lost either way): the pool is over.
 */
static int gone_now(const struct imported *ip)
{
    return (ip->pidfd >= 0 && pidfd_exited(ip->pidfd)) || vmmt__broker_link_peer_gone(ip->link);
}

void vmmt__consumer_remember_failed(struct vmmt_consumer *c, const struct imported *ip,
                                    uint32_t slot, uint32_t gen, int why)
{
    struct failed_desc *f;

    pthread_mutex_lock(&c->failed_lock);
    f = &c->failed[c->failed_next];
    memcpy(f->pool_id, ip->geometry.pool_id, 16);
    f->slot = slot;
    f->generation = gen;
    f->why = why;
    c->failed_next = (c->failed_next + 1) % FAILED_KEPT;
    if (c->failed_count < FAILED_KEPT) c->failed_count++;
    pthread_mutex_unlock(&c->failed_lock);
}

static void remember_failed(struct vmmt_consumer *c, const struct imported *ip, uint32_t slot,
                            uint32_t gen)
{
    vmmt__consumer_remember_failed(c, ip, slot, gen, VMMT__FAILED_DEAD);
}

/* Ready words of a device table: read all at once, set the failed ones; on a stream of our own. */
static int release_device_words(struct imported *ip, uint32_t *failed_count)
{
    const struct vmmt_drv *d = vmmt__drv();
    const struct vmmt__desc *g = &ip->geometry;
    size_t bytes = (size_t)g->table_slots * g->slot_stride;
    uint32_t *copy = malloc(bytes);
    CUstream s = NULL;
    int st;

    if (copy == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory to read a control table");
    st = vmmt__ctx_enter(ip->device);
    if (st != VMMT_OK) goto out;
    st = VMMT_CU(d, cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    if (st == VMMT_OK) st = VMMT_CU(d, cuMemcpyDtoHAsync(copy, ip->table, bytes, s));
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(s));
    for (uint32_t i = 0; st == VMMT_OK && i < g->table_slots; i++) {
        struct slot_state *ss = &ip->slots[i];
        uint32_t ready = copy[vmmt__ctrl_ready(0, g->slot_stride, i) / 4];
        enum vmmt__occupant occ = vmmt__occupant_of(ready, ss->generation);
        if (ss->generation == 0 || (occ != VMMT__OCC_COPYING && occ != VMMT__OCC_ABANDONED))
            continue;
        ss->failed = 1;
        remember_failed(ip->owner, ip, i, ss->generation);
        (*failed_count)++;
        if (occ == VMMT__OCC_ABANDONED) continue; /* another consumer repaired it */
        st = VMMT_CU(d, cuStreamWriteValue32(s, vmmt__ctrl_ready(ip->table, g->slot_stride, i),
                                             vmmt__gen_abandoned(ss->generation),
                                             CU_STREAM_WRITE_VALUE_DEFAULT));
    }
    if (st == VMMT_OK) st = VMMT_CU(d, cuStreamSynchronize(s));
    if (s != NULL && d->cuStreamDestroy(s) != CUDA_SUCCESS)
        vmmt__log(VMMT_LOG_ERROR, "destroying a stream failed; it is leaked");
    vmmt__ctx_leave();
out:
    free(copy);
    return st;
}

/* A dying process's files close before its exit is reported: a hang-up alone may be either. */
static const char *how_gone(const struct imported *ip)
{
    if (ip->pidfd >= 0 && pidfd_exited(ip->pidfd)) return "has exited";
    return "has exited or shut its pool down (its liveness link hung up)";
}

void vmmt__cache_producer_died(struct vmmt_consumer *c, struct imported *ip)
{
    const struct vmmt__desc *g = &ip->geometry;
    uint32_t failed = 0;

    if (ip->dead) return;
    __atomic_store_n(&ip->dead, 1, __ATOMIC_RELEASE);
    memcpy(c->dead_ids[c->dead_next], g->pool_id, 16);
    c->dead_next = (c->dead_next + 1) % DEAD_KEPT;
    if (c->dead_count < DEAD_KEPT) c->dead_count++;
    if (ip->host_table) {
        for (uint32_t i = 0; i < g->table_slots; i++) {
            struct slot_state *ss = &ip->slots[i];
            uint32_t *word = ip->ctrl.host + vmmt__ctrl_ready(0, g->slot_stride, i) / 4;
            uint32_t ready = vmmt__ctrl_load(word);
            enum vmmt__occupant occ = vmmt__occupant_of(ready, ss->generation);
            /* Only an occupant whose copy may still run (PENDING) is waited on,
             * or one another consumer found so and marked ABANDONED already;
             * any other word is another occupant's. */
            if (ss->generation == 0 || (occ != VMMT__OCC_COPYING && occ != VMMT__OCC_ABANDONED))
                continue;
            /* Marked before the word is set: a stream released by it finds the mark. */
            ss->failed = 1;
            remember_failed(c, ip, i, ss->generation);
            failed++;
            /* ABANDONED, not LIVE: it releases stream waits (>=) as LIVE would,
             * and every other consumer can tell that the bytes never came.
             * Only from the value just read: another consumer may set it too. */
            if (occ == VMMT__OCC_COPYING)
                __atomic_compare_exchange_n(word, &ready, vmmt__gen_abandoned(ss->generation), 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        }
    } else {
        struct vmmt__saved_error e;
        vmmt__error_save(&e);
        if (release_device_words(ip, &failed) != VMMT_OK)
            vmmt__log(VMMT_LOG_ERROR,
                      "the producer (pid %d) of a pool died, and setting its ready words "
                      "failed (%s): streams of this process waiting on them may stay blocked",
                      g->producer_pid, vmmt_last_error());
        vmmt__error_restore(&e);
    }
    /* A producer that ends after every buffer it handed out landed is the
     * normal end of a pool: worth a notice, not a warning. */
    vmmt__log(failed ? VMMT_LOG_WARN : VMMT_LOG_INFO,
              "the producer (pid %d) of an imported pool %s: %" PRIu32
              " descriptor(s) consumed here before their bytes were ready are marked failed "
              "(vmmt_consumer_check), new consumes fail, and the pool is let go once its "
              "copies are done",
              g->producer_pid, how_gone(ip), failed);
}

int vmmt__cache_producer_gone(struct vmmt_consumer *c, struct imported *ip, int force)
{
    if (ip->dead) return 1;
    if (ip->pidfd < 0 && ip->link == NULL) return 0;
    if (!force) {
        uint64_t now = (uint64_t)vmmt__now_us();
        if (now - ip->checked_us < CHECK_EVERY_US) return 0;
        ip->checked_us = now;
    }
    if (!gone_now(ip)) return 0;
    vmmt__cache_producer_died(c, ip);
    return 1;
}

int vmmt__cache_pidfd_exited(const struct imported *ip)
{
    return __atomic_load_n(&ip->dead, __ATOMIC_ACQUIRE) || gone_now(ip);
}

int vmmt__cache_known_dead(const struct vmmt_consumer *c, const uint8_t pool_id[16])
{
    for (uint32_t i = 0; i < c->dead_count; i++)
        if (memcmp(c->dead_ids[i], pool_id, 16) == 0) return 1;
    return 0;
}

static int any_dead(const struct vmmt_consumer *c)
{
    for (const struct imported *ip = c->pools; ip != NULL; ip = ip->next)
        if (ip->dead) return 1;
    return c->retired != NULL;
}

static void *watch_main(void *arg)
{
    struct vmmt_consumer *c = arg;
    struct vmmt__watch *w = c->watch;
    struct epoll_event ev[16];
    int timeout = -1;

    for (;;) {
        int n = epoll_wait(w->ep, ev, 16, timeout);
        pthread_mutex_lock(&c->lock);
        if (w->stop) {
            pthread_mutex_unlock(&c->lock);
            break;
        }
        for (int i = 0; i < n; i++) {
            if (ev[i].data.u64 == 0) {
                uint64_t v;
                if (read(w->wake, &v, sizeof v) < 0) { /* a wake-up only */
                }
                continue;
            }
            /* By serial, not pointer: the import may have been let go meanwhile. */
            for (struct imported *ip = c->pools; ip != NULL; ip = ip->next)
                if (ip->serial == ev[i].data.u64) vmmt__cache_producer_died(c, ip);
        }
        vmmt__cache_reap(c);
        timeout = any_dead(c) ? REAP_EVERY_MS : -1;
        pthread_mutex_unlock(&c->lock);
    }
    return NULL;
}

static int watch_start(struct vmmt_consumer *c)
{
    struct vmmt__watch *w = calloc(1, sizeof *w);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 0};
    int err;

    if (w == NULL) return vmmt__fail(VMMT_ENOMEM, "no host memory for the producer watch");
    w->ep = epoll_create1(EPOLL_CLOEXEC);
    w->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (w->ep < 0 || w->wake < 0 || epoll_ctl(w->ep, EPOLL_CTL_ADD, w->wake, &ev) != 0) {
        err = vmmt__sys_fail("setting up the producer watch (epoll, eventfd)");
        goto fail;
    }
    c->watch = w;
    err = pthread_create(&w->thread, NULL, watch_main, c);
    if (err == 0) return VMMT_OK;
    c->watch = NULL;
    errno = err;
    err = vmmt__sys_fail("starting the producer watch thread");
fail:
    if (w->ep >= 0) close(w->ep);
    if (w->wake >= 0) close(w->wake);
    free(w);
    return err;
}

int vmmt__watch_add(struct vmmt_consumer *c, struct imported *ip)
{
    /* EPOLLRDHUP: a link's hang-up (the broker never sends on it). */
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT, .data.u64 = ip->serial};
    int link = vmmt__broker_link_fd(ip->link);

    if (ip->pidfd < 0 && link < 0) return VMMT_OK; /* FABRIC, or served without a link */
    if (c->watch == NULL) {
        int st = watch_start(c);
        if (st != VMMT_OK) return st;
    }
    if (ip->pidfd >= 0 && epoll_ctl(c->watch->ep, EPOLL_CTL_ADD, ip->pidfd, &ev) != 0)
        return vmmt__sys_fail("watching the producer's pidfd");
    if (link >= 0 && epoll_ctl(c->watch->ep, EPOLL_CTL_ADD, link, &ev) != 0)
        return vmmt__sys_fail("watching the producer's liveness link");
    return VMMT_OK;
}

void vmmt__watch_remove(struct vmmt_consumer *c, struct imported *ip)
{
    int link = vmmt__broker_link_fd(ip->link);

    /* ENOENT (never added, or the watch failed to start) is fine. */
    if (c->watch == NULL) return;
    if (ip->pidfd >= 0) epoll_ctl(c->watch->ep, EPOLL_CTL_DEL, ip->pidfd, NULL);
    if (link >= 0) epoll_ctl(c->watch->ep, EPOLL_CTL_DEL, link, NULL);
}

void vmmt__watch_stop(struct vmmt_consumer *c)
{
    struct vmmt__watch *w = c->watch;
    uint64_t one = 1;

    if (w == NULL) return;
    pthread_mutex_lock(&c->lock);
    w->stop = 1;
    pthread_mutex_unlock(&c->lock);
    if (write(w->wake, &one, sizeof one) < 0)
        vmmt__log(VMMT_LOG_WARN, "waking the producer watch failed; it stops within its tick");
    pthread_join(w->thread, NULL);
    close(w->ep);
    close(w->wake);
    free(w);
    c->watch = NULL;
}

/* Whether d is a member this process consumed of a packed group it has not completed. */
static int open_member(const struct slot_state *s, const struct vmmt__desc *d)
{
    if (d->pack_count <= 1 || s->generation != d->generation) return 0;
    for (int i = 0; i < PACK_GROUPS; i++)
        if (s->groups[i].members & (1ull << d->pack_index)) return 1;
    return 0;
}

int vmmt_consumer_check(vmmt_consumer *c, const vmmt_desc *desc)
{
    struct vmmt__desc d;
    int st, failed = 0, why = VMMT__FAILED_DEAD, pid = 0;

    if (c == NULL || desc == NULL)
        return vmmt__fail(VMMT_EINVAL, "vmmt_consumer_check: consumer and descriptor are required");
    st = vmmt__desc_decode(desc->bytes, &d);
    if (st != VMMT_OK) return vmmt__wrap(st, "vmmt_consumer_check");
    /* Copies whose events completed may still wait for the acker's thread to judge them
     * (overtaken, or after an ABANDONED word): judged now, in this thread, so that a check
     * after the stream's synchronize sees them (the model test: OK for such a copy). */
    vmmt__acker_flush(c->acker);
    pthread_mutex_lock(&c->lock);
    for (struct imported *ip = c->pools; ip != NULL && !failed; ip = ip->next) {
        if (memcmp(ip->geometry.pool_id, d.pool_id, 16) != 0) continue;
        /* A record that is not the producer's says nothing about the pool's slots. */
        if (vmmt__desc_check_seal(desc->bytes, ip->seal_key) != VMMT_OK) {
            pthread_mutex_unlock(&c->lock);
            return vmmt__wrap(VMMT_EPROTO, "vmmt_consumer_check");
        }
        vmmt__cache_producer_gone(c, ip, 0);
        if (d.slot < ip->geometry.table_slots && ip->slots[d.slot].generation == d.generation &&
            ip->slots[d.slot].failed)
            failed = 1;
        /* ABANDONED in a shared table: another consumer found the producer dead before the
         * bytes landed, whatever this process has seen of the death yet (a device table's
         * word, below, is read only for an occupant this process consumed: the model test
         * found check OK there, seed 3006 of 2026-12-02). */
        if (d.slot < ip->geometry.table_slots && ip->host_table &&
            vmmt__occupant_of(
                vmmt__ctrl_load(ip->ctrl.host + vmmt__ctrl_ready(0, d.slot_stride, d.slot) / 4),
                d.generation) == VMMT__OCC_ABANDONED)
            failed = 1;
        /* The slot's word, read once where this process has something to judge by it: a
         * device table's ABANDONED (above for a shared table) for an occupant consumed here,
         * and for a member of a packed group still open here, a slot that moved on (no
         * acknowledgement will look at the slot after its copy, so check does: the copy may
         * have read the slice's next buffer; test_attack_outside3,
         * packed_*_under_queued_copy_check). */
        int open = d.slot < ip->geometry.table_slots && open_member(&ip->slots[d.slot], &d);
        if (d.slot < ip->geometry.table_slots && !failed &&
            (open || (!ip->host_table && ip->slots[d.slot].generation == d.generation))) {
            uint32_t ready = 0;
            if (ip->host_table)
                ready =
                    vmmt__ctrl_load(ip->ctrl.host + vmmt__ctrl_ready(0, d.slot_stride, d.slot) / 4);
            else
                st = vmmt__table_read_ready(ip, d.slot, d.slot_stride, c->cfg.timeout_ms, &ready);
            if (st != VMMT_OK) {
                pthread_mutex_unlock(&c->lock);
                return vmmt__wrap(st, "vmmt_consumer_check: reading the slot's ready word");
            }
            enum vmmt__occupant occ = vmmt__occupant_of(ready, d.generation);
            if (occ == VMMT__OCC_ABANDONED) failed = 1;
            if (open && occ == VMMT__OCC_GONE) {
                failed = 1;
                why = VMMT__FAILED_OVERTAKEN;
            }
        }
    }
    pthread_mutex_lock(&c->failed_lock);
    for (uint32_t i = 0; i < c->failed_count && !failed; i++)
        if (memcmp(c->failed[i].pool_id, d.pool_id, 16) == 0 && c->failed[i].slot == d.slot &&
            c->failed[i].generation == d.generation) {
            failed = 1;
            why = c->failed[i].why;
        }
    pthread_mutex_unlock(&c->failed_lock);
    pid = d.producer_pid;
    pthread_mutex_unlock(&c->lock);
    if (!failed) return VMMT_OK;
    if (why == VMMT__FAILED_COPY)
        return vmmt__fail(VMMT_EFAILED,
                          "vmmt_consumer_check: this process's copy of descriptor (slot %u, "
                          "generation %u) failed on its stream (the stream's synchronize says "
                          "why): what landed is not the buffer: drop the request",
                          d.slot, d.generation);
    if (why == VMMT__FAILED_UNCONFIRMED)
        return vmmt__fail(VMMT_EFAILED,
                          "vmmt_consumer_check: after this process's copy of descriptor (slot %u, "
                          "generation %u) the driver kept failing, so whether its occupant stayed "
                          "in the slot throughout was never learned (and its acknowledgement not "
                          "written: its slice waits for vmmt_pool_release_rank): drop the request",
                          d.slot, d.generation);
    if (why == VMMT__FAILED_OVERTAKEN)
        return vmmt__fail(VMMT_EFAILED,
                          "vmmt_consumer_check: descriptor (slot %u, generation %u) left its slot "
                          "while this process's copy ran (the producer cancelled it, or released "
                          "its rank): what was copied may be another buffer's: drop the request",
                          d.slot, d.generation);
    return vmmt__fail(VMMT_EFAILED,
                      "vmmt_consumer_check: the producer (pid %d) exited before the bytes of "
                      "this descriptor (slot %u, generation %u) were ready; what was copied is "
                      "not its buffer: drop the request",
                      pid, d.slot, d.generation);
}
