/* Helpers shared by the outside attackers' tests: see attack_helpers.h. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "attack_helpers.h"
#include "pattern.h"
#include "rawbroker.h"

const struct vmmt_drv *drv(void)
{
    return vmmt__drv();
}

void sync_s(CUstream s)
{
    sync_on(s);
}

void free_stream(CUstream s)
{
    assert_int_equal(drv()->cuStreamDestroy(s), CUDA_SUCCESS);
}

void put_on(CUstream s, CUdeviceptr at, size_t n, uint32_t i)
{
    uint8_t *h = malloc(n);

    assert_non_null(h);
    tu_pattern_fill(h, n, i);
    assert_int_equal(drv()->cuMemcpyHtoDAsync(at, h, n, s), CUDA_SUCCESS);
    sync_s(s);
    free(h);
}

vmmt_desc publish_from(vmmt_pool *p, CUstream s, CUdeviceptr src, uint32_t i)
{
    vmmt_buffer b = bytes(src, N);
    vmmt_desc d;
    int st;

    put_on(s, src, N, i);
    for (int k = 0; (st = vmmt_publish(p, &b, s, &d)) == VMMT_EFULL && k < 5000; k++)
        sleep_ms(1);
    assert_vmmt_ok(st);
    return d;
}

vmmt_desc publish(struct fixture *f, uint32_t i)
{
    return publish_from(f->pool, f->stream, f->src, i);
}

int consume_at(vmmt_consumer *c, const vmmt_desc *d, CUdeviceptr dst, CUstream s, int first,
               int count)
{
    return vmmt_consume(c, d, 0, dst, N, s, first, count);
}

int holds(CUstream s, CUdeviceptr at, uint32_t i)
{
    uint8_t *h = malloc(N);
    int ok;

    assert_non_null(h);
    assert_int_equal(drv()->cuMemcpyDtoHAsync(h, at, N, s), CUDA_SUCCESS);
    sync_s(s);
    ok = tu_pattern_check(h, N, i) == N;
    free(h);
    return ok;
}

int which(CUstream s, CUdeviceptr at)
{
    for (uint32_t i = 0; i < 64; i++)
        if (holds(s, at, i)) return (int)i;
    return -1;
}

uint32_t gen(const vmmt_desc *d)
{
    return tu_get32(d, OFF_GENERATION);
}

uint32_t in_flight_settled(struct fixture *f)
{
    sleep_ms(30);
    assert_vmmt_ok(vmmt_pool_reclaim(f->pool, NULL));
    return stats(f->pool).in_flight;
}

void rawtab_open(const vmmt_desc *d, struct rawtab *t)
{
    struct stat sb;
    int fds[2], n;

    assert_int_equal(tu_raw_fetch(d, fds, &n), VMMT_OK);
    assert_int_equal(n, 2);
    close(fds[0]);
    assert_int_equal(fstat(fds[1], &sb), 0);
    t->len = (size_t)sb.st_size;
    t->m = mmap(NULL, t->len, PROT_READ, MAP_SHARED, fds[1], 0);
    assert_true(t->m != MAP_FAILED);
    close(fds[1]);
    t->stride = tu_get32(d, OFF_SLOT_STRIDE);
}

uint32_t rawtab_word(const struct rawtab *t, const vmmt_desc *d, int idx)
{
    const uint32_t *w =
        (const uint32_t *)(t->m + 64 + (size_t)tu_get32(d, OFF_SLOT) * t->stride + 4u * idx);
    return __atomic_load_n(w, __ATOMIC_ACQUIRE);
}

void rawtab_close(struct rawtab *t)
{
    munmap(t->m, t->len);
}

int wait_word(const struct rawtab *t, const vmmt_desc *d, int idx, uint32_t want, int ms)
{
    for (int i = 0; i < ms; i++) {
        if (rawtab_word(t, d, idx) == want) return 1;
        sleep_ms(1);
    }
    return rawtab_word(t, d, idx) == want;
}

pid_t spawn_rank(int first, int count, int *sock)
{
    char a[16], b[16];
    char *argv[] = {"0", a, b, NULL};
    int sv[2];
    pid_t pid;

    snprintf(a, sizeof a, "%d", first);
    snprintf(b, sizeof b, "%d", count);
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    pid = tu_spawn("consumer_child", argv, sv[1]);
    assert_true(pid > 0);
    close(sv[1]);
    *sock = sv[0];
    return pid;
}

void send_msg(int sock, uint32_t i, const vmmt_desc *d, uint32_t pad)
{
    struct tu_msg m;

    memset(&m, 0, sizeof m);
    m.index = i;
    m.pad = pad;
    if (d) memcpy(m.desc, d->bytes, sizeof m.desc);
    assert_int_equal(write(sock, &m, sizeof m), sizeof m);
}

int32_t reply(int sock, uint32_t i)
{
    struct tu_reply r;
    struct timeval tv = {20, 0};

    assert_int_equal(setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv), 0);
    assert_int_equal(read(sock, &r, sizeof r), sizeof r);
    assert_int_equal(r.index, i);
    return r.status;
}

void kill_reap(pid_t pid)
{
    int status;

    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
}

void end_child(int sock, pid_t pid)
{
    send_msg(sock, UINT32_MAX, NULL, 0);
    tu_wait(pid, 10000);
    close(sock);
}

int wait_links(struct fixture *f, uint32_t links, int ms)
{
    for (int i = 0; i < ms / 2 && stats(f->pool).consumer_links != links; i++)
        sleep_ms(2);
    return stats(f->pool).consumer_links == links;
}
