/*
 * The fd broker: serving one or several fds in-process and to other
 * processes, path sockets, refusals, hostile and stalled clients, fake
 * servers, clients and servers of protocol version 1, and no leaks.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "broker.h"
#include "broker_wire.h"
#include "status.h"
#include "testutil.h"

static const uint8_t POOL[16] = {0xa1, 0xb2, 0xc3, 0xd4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t OTHER[16] = {0x11, 0x22, 0x33, 0x44, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
static const char POOL_HEX[] = "a1b2c3d405060708090a0b0c0d0e0f10";
/* The brokers of these tests run in this process: the server a client must find. */
static struct vmmt__broker_peer ME;

/* ----------------------------------------------------------------- helpers */

/*
 * A joined thread lingers in /proc for a moment; the tests run between
 * threads, so wait until only the main one is counted before the snapshot.
 */
static void take_resources(tu_resources *r)
{
    for (int i = 0; i < 200 && tu_count_threads() > 1; i++)
        usleep(1000);
    tu_resources_take(r);
}

/* tu_resources_check, saying first what changed. */
#define check_resources(before) check_resources_(before, __FILE__, __LINE__)
static void check_resources_(const tu_resources *before, const char *file, int line)
{
    tu_resources now;
    for (int i = 0; i < 200; i++) {
        tu_resources_take(&now);
        if (now.threads <= before->threads) break;
        usleep(1000);
    }
    if (now.fds != before->fds || now.maps != before->maps || now.threads != before->threads)
        print_error("%s:%d: fds %d -> %d, mappings %d -> %d, threads %d -> %d\n", file, line,
                    before->fds, now.fds, before->maps, now.maps, before->threads, now.threads);
    tu_resources_check_(before, file, line);
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int make_memfd(void)
{
    int fd = memfd_create("vmmt-test-pool", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 4096), 0);
    return fd;
}

static void assert_same_file(int a, int b)
{
    struct stat sa, sb;
    assert_int_equal(fstat(a, &sa), 0);
    assert_int_equal(fstat(b, &sb), 0);
    assert_int_equal(sa.st_ino, sb.st_ino);
    assert_int_equal(sa.st_dev, sb.st_dev);
}

static struct vmmt__broker *start_ok(int fd, const struct vmmt__broker_config *cfg)
{
    struct vmmt__broker *b = NULL;
    assert_vmmt_ok(vmmt__broker_start(fd, POOL, cfg, &b));
    assert_non_null(b);
    return b;
}

static void fetch_same(const struct vmmt__broker *b, int pool_fd)
{
    int fd = -1;
    assert_vmmt_ok(vmmt__broker_fetch(vmmt__broker_address(b), POOL, &ME, 2000, &fd));
    assert_same_file(fd, pool_fd);
    assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    close(fd);
}

static socklen_t sockaddr_of(const struct vmmt__broker_addr *a, struct sockaddr_un *sun)
{
    return vmmt__broker_sockaddr(a, sun);
}

/* A client that speaks no protocol: connected, blocking, sends only what a test says. */
static int raw_connect(const struct vmmt__broker_addr *a)
{
    struct sockaddr_un sun;
    socklen_t sl = sockaddr_of(a, &sun);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(s >= 0);
    assert_int_equal(connect(s, (struct sockaddr *)&sun, sl), 0);
    return s;
}

/* Read until the broker's reply and hang-up; returns the reply's status, or 1 for none. */
static int raw_read_reply(int s, int timeout_ms)
{
    uint8_t buf[256];
    struct pollfd p = {.fd = s, .events = POLLIN};
    int32_t st = 1;

    for (;;) {
        assert_int_equal(poll(&p, 1, timeout_ms), 1);
        ssize_t n = recv(s, buf, sizeof buf, 0);
        if (n < 0 && errno == ECONNRESET) return (int)st;
        assert_true(n >= 0);
        if (n == 0) return (int)st;
        assert_true(n >= 14);
        assert_memory_equal(buf, "VMBR", 4);
        memcpy(&st, buf + 8, 4); /* little-endian host */
    }
}

/* Abstract address unique to this process and call, for fake servers. */
static void test_addr(struct vmmt__broker_addr *a, const char *tag)
{
    static int seq;
    char text[100];
    snprintf(text, sizeof text, "@vmmt-test-%d-%s-%d", (int)getpid(), tag, seq++);
    assert_vmmt_ok(vmmt__broker_addr_parse(text, a));
}

static int fake_listen(const struct vmmt__broker_addr *a)
{
    struct sockaddr_un sun;
    socklen_t sl = sockaddr_of(a, &sun);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_true(s >= 0);
    assert_int_equal(bind(s, (struct sockaddr *)&sun, sl), 0);
    assert_int_equal(listen(s, 8), 0);
    return s;
}

typedef uint64_t (*stat_pick)(const struct vmmt__broker_stats *);
static uint64_t pick_served(const struct vmmt__broker_stats *s)
{
    return s->served;
}
static uint64_t pick_refused_peer(const struct vmmt__broker_stats *s)
{
    return s->refused_peer;
}
static uint64_t pick_refused_pool(const struct vmmt__broker_stats *s)
{
    return s->refused_pool;
}
static uint64_t pick_timed_out(const struct vmmt__broker_stats *s)
{
    return s->timed_out;
}
static uint64_t pick_malformed(const struct vmmt__broker_stats *s)
{
    return s->malformed;
}

/* The thread counts after it replies, so a client can be ahead of the counters: wait. */
static void wait_stat(const struct vmmt__broker *b, stat_pick pick, uint64_t want, int ms)
{
    struct vmmt__broker_stats s;
    int64_t end = now_ms() + ms;
    do {
        vmmt__broker_stats(b, &s);
        if (pick(&s) >= want) return;
        usleep(2000);
    } while (now_ms() < end);
    fail_msg("counter stayed at %llu, wanted %llu", (unsigned long long)pick(&s),
             (unsigned long long)want);
}

static char *make_tmpdir(char *buf, size_t cap)
{
    snprintf(buf, cap, "/tmp/vmmt-broker-XXXXXX");
    assert_non_null(mkdtemp(buf));
    return buf;
}

/* ------------------------------------------------------------------- tests */

static void test_same_process(void **state)
{
    tu_resources before;
    struct vmmt__broker_stats s;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);
    assert_int_equal(a->kind, VMMT_BROKER_ADDR_ABSTRACT);
    assert_int_equal(a->len, 37);
    assert_memory_equal(a->name, "vmmt-", 5);
    fetch_same(b, pool_fd);
    wait_stat(b, pick_served, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.served, 1);
    assert_int_equal(s.refused_peer + s.refused_pool + s.timed_out + s.malformed, 0);

    /* Two brokers never share a name. */
    struct vmmt__broker *b2 = start_ok(pool_fd, NULL);
    assert_memory_not_equal(vmmt__broker_address(b2)->name, a->name, 37);
    vmmt__broker_stop(b2);

    char text[300];
    vmmt__broker_addr_format(a, text, sizeof text);
    assert_int_equal(text[0], '@');
    assert_int_equal(strlen(text), 38);
    vmmt__broker_stop(b);
    vmmt__broker_stop(NULL);
    close(pool_fd);
    check_resources(&before);
}

static void test_other_process(void **state)
{
    tu_resources before;
    char where[300], buf[32] = {0};
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    char *argv[] = {where, (char *)POOL_HEX, "-1", "write", NULL};
    pid_t pid = tu_spawn("broker_fetch", argv, -1);
    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 10000), 0);
    assert_int_equal(pread(pool_fd, buf, sizeof buf, 0), sizeof buf);
    assert_string_equal(buf, "written by child");
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_path_mode(void **state)
{
    tu_resources before;
    char dir[64], path[128];
    struct stat st;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/pool.sock", dir);
    struct vmmt__broker_config cfg = {.path = path};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);
    assert_int_equal(a->kind, VMMT_BROKER_ADDR_PATH);
    assert_int_equal(a->len, strlen(path));
    assert_memory_equal(a->name, path, a->len);
    assert_int_equal(lstat(path, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0600);
    fetch_same(b, pool_fd);
    /*
     * Caught (issue 16, defect 17): the file's mode (or the directory's) refused
     * another user at connect, and the client said VMMT_ESYS, which
     * docs/integration.md reads as "the producer died". A refusal is
     * VMMT_EPERM, as the broker's own is, and says to allow the uid.
     */
    if (geteuid() == 0) {
        char *argv[] = {path,    (char *)POOL_HEX,
                        "65534", "expect",
                        "-12",   "add this uid to the pool's allowed uids",
                        NULL};
        assert_int_equal(chmod(dir, 0711), 0); /* the file refuses */
        assert_int_equal(tu_wait(tu_spawn("broker_fetch", argv, -1), 10000), 0);
        assert_int_equal(chmod(dir, 0700), 0); /* mkdtemp's: the directory refuses */
        argv[5] = "its directory";
        assert_int_equal(tu_wait(tu_spawn("broker_fetch", argv, -1), 10000), 0);
    }
    vmmt__broker_stop(b);
    assert_int_equal(lstat(path, &st), -1);
    assert_int_equal(errno, ENOENT);

    /* Other users allowed: the file opens up and SO_PEERCRED does the checking. */
    uid_t others[] = {geteuid() == 65534 ? 65533 : 65534};
    cfg.allowed_uids = others;
    cfg.allowed_count = 1;
    b = start_ok(pool_fd, &cfg);
    assert_int_equal(lstat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0666);
    vmmt__broker_stop(b);

    assert_int_equal(rmdir(dir), 0);
    close(pool_fd);
    check_resources(&before);
}

static void test_path_stale_socket_replaced(void **state)
{
    tu_resources before;
    char dir[64], path[128];
    struct vmmt__broker_addr a = {.kind = VMMT_BROKER_ADDR_PATH};
    struct sockaddr_un sun;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/stale.sock", dir);
    a.len = (uint8_t)strlen(path);
    memcpy(a.name, path, a.len);
    /* A crashed producer leaves its socket file behind with nobody listening. */
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    assert_int_equal(bind(s, (struct sockaddr *)&sun, sockaddr_of(&a, &sun)), 0);
    close(s);

    struct vmmt__broker_config cfg = {.path = path};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    fetch_same(b, pool_fd);
    vmmt__broker_stop(b);
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(rmdir(dir), 0);
    close(pool_fd);
    check_resources(&before);
}

static void test_path_live_socket_refused(void **state)
{
    tu_resources before;
    char dir[64], path[128];
    struct vmmt__broker *b2 = (void *)1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/live.sock", dir);
    struct vmmt__broker_config cfg = {.path = path};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b2), VMMT_EINVAL);
    assert_null(b2);
    assert_error_contains("a live socket is already there");
    assert_error_contains(path);
    fetch_same(b, pool_fd); /* the first broker is untouched */
    vmmt__broker_stop(b);
    assert_int_equal(rmdir(dir), 0);
    close(pool_fd);
    check_resources(&before);
}

static void test_path_regular_file_refused(void **state)
{
    tu_resources before;
    char dir[64], path[128], buf[8] = {0};
    struct vmmt__broker *b = NULL;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/precious", dir);
    int f = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
    assert_int_equal(write(f, "keep", 4), 4);
    close(f);

    struct vmmt__broker_config cfg = {.path = path};
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b), VMMT_EINVAL);
    assert_null(b);
    assert_error_contains("exists and is not a socket");
    f = open(path, O_RDONLY | O_CLOEXEC);
    assert_true(f >= 0);
    assert_int_equal(read(f, buf, sizeof buf), 4);
    assert_string_equal(buf, "keep");
    close(f);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(rmdir(dir), 0);
    close(pool_fd);
    check_resources(&before);
}

static void test_start_errors(void **state)
{
    tu_resources before;
    struct vmmt__broker *b = NULL;
    char longpath[200];
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    assert_int_equal(vmmt__broker_start(-1, POOL, NULL, &b), VMMT_EINVAL);
    assert_int_equal(vmmt__broker_start(pool_fd, NULL, NULL, &b), VMMT_EINVAL);
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, NULL, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt__broker_start(999, POOL, NULL, &b), VMMT_ESYS); /* not open */
    assert_error_contains("cannot start the CUDA VMM POSIX FD broker of pool a1b2c3d4");
    struct vmmt__broker_config cfg = {.allowed_count = 2};
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b), VMMT_EINVAL);
    cfg = (struct vmmt__broker_config){.timeout_ms = -5};
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b), VMMT_EINVAL);
    memset(longpath, 'x', sizeof longpath - 1);
    longpath[0] = '/';
    longpath[sizeof longpath - 1] = '\0';
    cfg = (struct vmmt__broker_config){.path = longpath};
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b), VMMT_EINVAL);
    assert_error_contains("choose a shorter path");
    cfg.path = "/nonexistent-vmmt-dir/pool.sock";
    assert_int_equal(vmmt__broker_start(pool_fd, POOL, &cfg, &b), VMMT_ESYS);
    assert_error_contains("No such file or directory");
    assert_null(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_wrong_pool_refused(void **state)
{
    tu_resources before;
    struct vmmt__broker_stats s;
    int fd = 7;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    assert_int_equal(vmmt__broker_fetch(vmmt__broker_address(b), OTHER, &ME, 2000, &fd),
                     VMMT_EINVAL);
    assert_int_equal(fd, -1);
    assert_error_contains("CUDA VMM POSIX FD broker failed: pool 11223344 is not served here");
    assert_error_contains("serves pool a1b2c3d4");
    wait_stat(b, pick_refused_pool, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.refused_pool, 1);
    assert_int_equal(s.served, 0);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_stalled_client_times_out(void **state)
{
    tu_resources before;
    struct vmmt__broker_stats s;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.timeout_ms = 300};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    int64_t t0 = now_ms();
    int stalled = raw_connect(vmmt__broker_address(b));

    /* The stalled client must not delay anyone else. */
    usleep(20000);
    int64_t t1 = now_ms();
    fetch_same(b, pool_fd);
    assert_true(now_ms() - t1 < 200);
    wait_stat(b, pick_served, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.timed_out, 0);

    wait_stat(b, pick_timed_out, 1, 3000);
    assert_true(now_ms() - t0 >= 290);
    assert_int_equal(raw_read_reply(stalled, 1000), 1); /* closed, no reply */
    close(stalled);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.served, 1);
    assert_int_equal(s.timed_out, 1);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_pending_limit(void **state)
{
    tu_resources before;
    int stalled[VMMT_BROKER_MAX_PENDING + 4];
    int n = VMMT_BROKER_MAX_PENDING + 4;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.timeout_ms = 200};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    for (int i = 0; i < n; i++)
        stalled[i] = raw_connect(vmmt__broker_address(b));
    /* Beyond the cap, the oldest of the peer holding the most is closed: the listener never
     * stops, and a client with a request is served at once. */
    int64_t t0 = now_ms();
    fetch_same(b, pool_fd);
    assert_true(now_ms() - t0 < 150);
    struct vmmt__broker_stats s;
    for (int i = 0; i < 300; i++) {
        vmmt__broker_stats(b, &s);
        if (s.evicted + s.timed_out == (uint64_t)n) break;
        usleep(10000);
    }
    /* One uid may keep VMMT_BROKER_PENDING_PER_UID waiting; the rest made room. */
    assert_int_equal(s.evicted + s.timed_out, (uint64_t)n);
    assert_true(s.evicted >= (uint64_t)(n - VMMT_BROKER_PENDING_PER_UID));
    assert_true(s.timed_out <= VMMT_BROKER_PENDING_PER_UID);
    for (int i = 0; i < n; i++)
        close(stalled[i]);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_other_user_refused(void **state)
{
    tu_resources before;
    struct vmmt__broker_stats s;
    char where[300];
    (void)state;
    if (geteuid() != 0) skip();
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    char *argv[] = {where,
                    (char *)POOL_HEX,
                    "65534",
                    "expect",
                    "-12",
                    "CUDA VMM POSIX FD broker failed: uid 65534 is not allowed by the vmmt "
                    "broker of pool a1b2c3d4; add it to the pool's allowed uids",
                    NULL};
    pid_t pid = tu_spawn("broker_fetch", argv, -1);
    assert_int_equal(tu_wait(pid, 10000), 0);
    wait_stat(b, pick_refused_peer, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.refused_peer, 1);
    assert_int_equal(s.served, 0);
    vmmt__broker_stop(b);

    /* Root is not implicitly allowed: an allow-list without 0 is what is served. */
    uid_t nobody[] = {65534};
    struct vmmt__broker_config cfg = {.allowed_uids = nobody, .allowed_count = 1};
    b = start_ok(pool_fd, &cfg);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    char *argv2[] = {where, (char *)POOL_HEX, "65534", "write", NULL};
    pid = tu_spawn("broker_fetch", argv2, -1);
    assert_int_equal(tu_wait(pid, 10000), 0);
    wait_stat(b, pick_served, 1, 2000);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/*
 * A producer in a user namespace of its own, where it is uid 1000 mapped to
 * this process's uid: a forked child that serves pool_fd until the pipe
 * `hold` reaches end-of-file, after writing its broker's address to the
 * pipe `addr` (or nothing, where user namespaces are refused). Returns its
 * pid.
 */
static pid_t producer_in_userns(int pool_fd, const int addr[2], const int hold[2])
{
    char map[32], where[300];
    pid_t pid;

    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid > 0) return pid;
    close(addr[0]);
    close(hold[1]); /* or no end-of-file would come */
    snprintf(map, sizeof map, "1000 %u 1\n", (unsigned)geteuid());
    int fd;
    if (unshare(CLONE_NEWUSER) != 0 || (fd = open("/proc/self/uid_map", O_WRONLY)) < 0) _exit(77);
    if (write(fd, map, strlen(map)) != (ssize_t)strlen(map)) _exit(77);
    close(fd);
    struct vmmt__broker *b = NULL;
    if (vmmt__broker_start(pool_fd, POOL, NULL, &b) != VMMT_OK) _exit(1);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    if (write(addr[1], where, strlen(where) + 1) <= 0) _exit(1);
    char c;
    while (read(hold[0], &c, 1) > 0)
        ;
    vmmt__broker_stop(b);
    _exit(0);
}

/*
 * Caught (issue 16, defect 17): producer and consumer in different user
 * namespaces, where the uids differ only by the namespace's mapping, were
 * told "another process holds the producer's address (has the producer
 * exited?)". The server is still refused (uids are compared as this process
 * sees them), but the message says it is the namespace and what to do.
 */
static void test_userns_mapping_named(void **state)
{
    char where[300] = "",
         text[] = "another user namespace, where uid 0 (the descriptor's) is uid 1000 here";
    int pool_fd = make_memfd(), addr[2], hold[2], code;
    (void)state;

    /* This process in the parent namespace; the consumer in a child namespace. */
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    if (geteuid() != 0) snprintf(text, sizeof text, "is uid 1000 here");
    char *argv[] = {where, (char *)POOL_HEX, "userns", "expect", "-12", text, NULL};
    code = tu_wait(tu_spawn("broker_fetch", argv, -1), 10000);
    vmmt__broker_stop(b);
    if (code == 77) {
        close(pool_fd);
        skip(); /* no user namespaces here */
    }
    assert_int_equal(code, 0);

    /* The producer in a child namespace, where it is uid 1000: the descriptor says so. */
    assert_int_equal(pipe2(addr, O_CLOEXEC), 0);
    assert_int_equal(pipe2(hold, O_CLOEXEC), 0);
    pid_t pid = producer_in_userns(pool_fd, addr, hold);
    close(addr[1]);
    close(hold[0]);
    ssize_t n = read(addr[0], where, sizeof where - 1);
    close(addr[0]);
    if (n > 0) {
        struct vmmt__broker_addr a;
        struct vmmt__broker_peer producer = {.uid = 1000, .pid = pid};
        int fd = -1;
        where[n] = '\0';
        assert_vmmt_ok(vmmt__broker_addr_parse(where, &a));
        assert_int_equal(vmmt__broker_fetch(&a, POOL, &producer, 2000, &fd), VMMT_EPERM);
        assert_int_equal(fd, -1);
        assert_error_contains("another user namespace, where uid 1000 (the descriptor's) is uid");
        assert_error_contains("run the producer and its consumers in one user namespace");
    }
    close(hold[1]);
    code = tu_wait(pid, 10000);
    close(pool_fd);
    if (n <= 0 && code == 77) skip();
    assert_int_equal(code, 0);
}

/* The uid_map reader behind the message above, where no namespace can be made. */
static void test_uid_map_find(void **state)
{
    const char *map = "         0       1000          1\n      1000     100000      65536\n";
    uint32_t m = 7;
    (void)state;

    assert_int_equal(vmmt__uid_map_find(map, 1, 0, &m), 1);
    assert_int_equal(m, 1000);
    assert_int_equal(vmmt__uid_map_find(map, 1, 1005, &m), 1);
    assert_int_equal(m, 100005);
    assert_int_equal(vmmt__uid_map_find(map, 0, 100005, &m), 1);
    assert_int_equal(m, 1005);
    assert_int_equal(vmmt__uid_map_find(map, 0, 1000, &m), 1);
    assert_int_equal(m, 0);
    m = 7;
    assert_int_equal(vmmt__uid_map_find(map, 1, 1, &m), 0);            /* unmapped */
    assert_int_equal(vmmt__uid_map_find(map, 1, 1000 + 65536, &m), 0); /* just past a range */
    assert_int_equal(vmmt__uid_map_find("0 0 4294967295", 1, 4294967294u, &m), 1);
    assert_int_equal(m, 4294967294u);
    assert_int_equal(vmmt__uid_map_find("", 1, 0, &m), 0);
    assert_int_equal(vmmt__uid_map_find("0 1000\n", 1, 0, &m), 0);       /* a line cut short */
    assert_int_equal(vmmt__uid_map_find("0 4294967295 2", 1, 1, &m), 0); /* past 32 bits */
    assert_int_equal(m, 4294967294u);
}

/*
 * A server that answers one request with a chosen version, status, number of
 * fds attached and number announced in the header.
 */
struct fake {
    int lfd;
    const uint8_t *pool; /* the pool its reply names (version 3); NULL: POOL */
    uint16_t version;
    int32_t status;
    int nfds;
    int announce;
    int fd; /* what it attaches */
};

static void *fake_server(void *arg)
{
    struct fake *f = arg;
    struct pollfd p = {.fd = f->lfd, .events = POLLIN};
    uint8_t buf[64 + 30] = "VMBR";
    size_t head = f->version >= 3 ? 30 : 14;
    int fds[4];
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof fds)];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = head + 4};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};

    if (poll(&p, 1, 3000) != 1) return NULL;
    int c = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) return NULL;
    p.fd = c;
    if (poll(&p, 1, 3000) == 1 && recv(c, buf + 30, 64, 0) == 24) {
        buf[4] = (uint8_t)f->version;
        buf[5] = (uint8_t)(f->version >> 8);
        /* Version 1 had a 2-byte reserved field here, always 0. */
        buf[6] = f->version == 1 ? 0 : (uint8_t)f->announce;
        buf[7] = 0;
        memcpy(buf + 8, &f->status, 4);
        buf[12] = 4;
        buf[13] = 0;
        /* Version 3 names the pool after the fixed 14 bytes. */
        if (head == 30) memcpy(buf + 14, f->pool ? f->pool : POOL, 16);
        memcpy(buf + head, "fake", 4);
        if (f->nfds > 0) {
            for (int i = 0; i < f->nfds; i++)
                fds[i] = f->fd;
            mh.msg_control = ctl.space;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)f->nfds);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)f->nfds);
            memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)f->nfds);
        }
        sendmsg(c, &mh, MSG_NOSIGNAL);
        /* Wait for the client to hang up so its reply is never cut short. */
        poll(&p, 1, 3000);
    }
    close(c);
    return NULL;
}

/* Fetch `want` fds from a fake server set up like f (lfd and fd are filled in here). */
static int fetch_fake(struct fake f, int *fds, int want)
{
    struct vmmt__broker_addr a;
    pthread_t t;

    f.fd = make_memfd();
    test_addr(&a, "fake");
    f.lfd = fake_listen(&a);
    assert_int_equal(pthread_create(&t, NULL, fake_server, &f), 0);
    int st = vmmt__broker_fetch_fds(&a, POOL, &ME, 2000, fds, want, NULL);
    /* The message is thread-local: keep it safe from close() and friends below. */
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", vmmt_last_error());
    for (int i = 0; i < want; i++) {
        if (st == VMMT_OK)
            close(fds[i]);
        else
            assert_int_equal(fds[i], -1);
    }
    pthread_join(t, NULL);
    close(f.lfd);
    close(f.fd);
    if (st != VMMT_OK) vmmt__fail(st, "%s", msg);
    return st;
}

/* A current server that attaches and announces nfds, through the one-fd wrapper's count. */
static int fetch_from_fake(int32_t status, int nfds, int *fd)
{
    struct fake f = {.version = 3, .status = status, .nfds = nfds, .announce = nfds};
    return fetch_fake(f, fd, 1);
}

static void test_fake_server_replies(void **state)
{
    tu_resources before;
    int fd = 5;
    (void)state;
    take_resources(&before);

    assert_int_equal(fetch_from_fake(VMMT_OK, 0, &fd), VMMT_EPROTO);
    assert_int_equal(fd, -1);
    assert_error_contains("CUDA VMM POSIX FD broker failed: broker returned no file descriptor");
    assert_error_contains("carried no SCM_RIGHTS");

    /* Extra fds are refused and closed; the resource check below proves it. */
    assert_int_equal(fetch_from_fake(VMMT_OK, 3, &fd), VMMT_EPROTO);
    assert_error_contains("broker returned 3 file descriptor(s), expected 1");
    assert_vmmt_ok(fetch_from_fake(VMMT_OK, 1, &fd));
    /* A refusal that carries an fd anyway: the fd is closed, the refusal passed on. */
    assert_int_equal(fetch_from_fake(VMMT_EPERM, 2, &fd), VMMT_EPERM);
    assert_int_equal(fd, -1);
    assert_error_contains("CUDA VMM POSIX FD broker failed: fake");
    /* Statuses we do not know are a protocol error. */
    assert_int_equal(fetch_from_fake(-99, 0, &fd), VMMT_EPROTO);
    assert_error_contains("unknown status -99");

    /* The header and the control data disagree: a broken or hostile server. */
    int fds[2] = {5, 5};
    struct fake f = {.version = 3, .status = VMMT_OK, .nfds = 1, .announce = 2};
    assert_int_equal(fetch_fake(f, fds, 2), VMMT_EPROTO);
    assert_error_contains("announced 2 file descriptor(s) but 1 arrived");
    f = (struct fake){.version = 3, .status = VMMT_OK, .nfds = 2, .announce = 5};
    assert_int_equal(fetch_fake(f, fds, 2), VMMT_EPROTO);
    assert_error_contains("it announces 5 file descriptors; a broker sends 1 to 4");
    /* More than asked for: refused, and every one that arrived is closed. */
    f = (struct fake){.version = 3, .status = VMMT_OK, .nfds = 4, .announce = 4};
    assert_int_equal(fetch_fake(f, fds, 2), VMMT_EPROTO);
    assert_error_contains("broker returned 4 file descriptor(s), expected 2");
    /* A server that answers for another pool (it ignored the pool id we asked for). */
    f = (struct fake){.version = 3, .pool = OTHER, .status = VMMT_OK, .nfds = 1, .announce = 1};
    assert_int_equal(fetch_fake(f, fds, 1), VMMT_EPROTO);
    assert_error_contains("serves pool 11223344, not pool a1b2c3d4 that the descriptor names");
    check_resources(&before);
}

/* A producer built before version 2: its success reply and its refusal of our request. */
static void test_v1_server(void **state)
{
    tu_resources before;
    int fd = 5;
    (void)state;
    take_resources(&before);

    struct fake f = {.version = 1, .status = VMMT_OK, .nfds = 1};
    assert_int_equal(fetch_fake(f, &fd, 1), VMMT_EPROTO);
    assert_error_contains("CUDA VMM POSIX FD broker failed: @vmmt-test-");
    assert_error_contains("speaks broker protocol version 1, this build speaks 3: use the same "
                          "vmmt version on producer and consumers (it said: \"fake\")");
    assert_int_equal(fd, -1);
    f.status = VMMT_EPROTO;
    f.nfds = 0;
    assert_int_equal(fetch_fake(f, &fd, 1), VMMT_EPROTO);
    assert_error_contains("speaks broker protocol version 1, this build speaks 3");
    /* Version 2 had the same 14-byte header as version 1, and no pool id in its reply. */
    f = (struct fake){.version = 2, .status = VMMT_OK, .nfds = 1, .announce = 1};
    assert_int_equal(fetch_fake(f, &fd, 1), VMMT_EPROTO);
    assert_error_contains("speaks broker protocol version 2, this build speaks 3: use the same "
                          "vmmt version on producer and consumers (it said: \"fake\")");
    check_resources(&before);
}

/* A consumer built before version 2: it must get a refusal it can read, at once. */
static void test_v1_client(void **state)
{
    tu_resources before;
    uint8_t req[24], buf[256];
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    int c = raw_connect(vmmt__broker_address(b));
    memcpy(req, "VMBQ\1\0\0\0", 8);
    memcpy(req + 8, POOL, 16);
    assert_int_equal(send(c, req, sizeof req, 0), (ssize_t)sizeof req);
    struct pollfd p = {.fd = c, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 2000), 1);
    /* A version-1 client reads with a control buffer; any fd here would be a leak in it. */
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * 8)];
    } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr mh = {.msg_iov = &iov,
                        .msg_iovlen = 1,
                        .msg_control = ctl.space,
                        .msg_controllen = sizeof ctl.space};
    ssize_t n = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);
    assert_int_equal(mh.msg_controllen, 0);
    /* What a version-1 client checks, in its order: size, magic, then the version it reports. */
    assert_true(n >= 14 && n <= 214);
    assert_memory_equal(buf, "VMBR", 4);
    assert_int_equal(buf[4] | buf[5] << 8, 3);
    assert_int_equal(buf[6], 0); /* no fds announced */
    int32_t st;
    memcpy(&st, buf + 8, 4);
    assert_int_equal(st, VMMT_EPROTO);
    int mlen = buf[12] | buf[13] << 8;
    assert_int_equal(n, 30 + mlen);
    const char want[] = "request version 1 is not supported; this broker speaks version 3";
    assert_true((size_t)mlen >= sizeof want - 1);
    assert_memory_equal(buf + 30, want, sizeof want - 1);
    close(c);
    wait_stat(b, pick_malformed, 1, 2000);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_client_timeout(void **state)
{
    tu_resources before;
    struct vmmt__broker_addr a;
    char want[300], where[300];
    int fd = 5;
    (void)state;
    take_resources(&before);

    /* Listening but never accepting: connect succeeds, no reply ever comes. */
    test_addr(&a, "mute");
    int lfd = fake_listen(&a);
    int64_t t0 = now_ms();
    assert_int_equal(vmmt__broker_fetch(&a, POOL, &ME, 200, &fd), VMMT_ETIMEDOUT);
    int64_t took = now_ms() - t0;
    assert_true(took >= 195 && took < 1500);
    assert_int_equal(fd, -1);
    snprintf(want, sizeof want,
             "CUDA VMM POSIX FD broker failed: no reply from %s within 200 ms; is the producer "
             "alive?",
             vmmt__broker_addr_format(&a, where, sizeof where));
    assert_string_equal(vmmt_last_error(), want);
    close(lfd);
    check_resources(&before);
}

static void test_connect_refused(void **state)
{
    tu_resources before;
    struct vmmt__broker_addr a;
    int fd = 5;
    (void)state;
    take_resources(&before);

    test_addr(&a, "nobody");
    assert_int_equal(vmmt__broker_fetch(&a, POOL, &ME, 500, &fd), VMMT_ECLOSED);
    assert_error_contains("CUDA VMM POSIX FD broker failed: cannot connect to @vmmt-test-");
    assert_error_contains("Connection refused");
    assert_vmmt_ok(vmmt__broker_addr_parse("/nonexistent-vmmt-dir/x.sock", &a));
    assert_int_equal(vmmt__broker_fetch(&a, POOL, &ME, 500, &fd), VMMT_ECLOSED);
    assert_error_contains("cannot connect to /nonexistent-vmmt-dir/x.sock: No such file");
    a.kind = 7;
    assert_int_equal(vmmt__broker_fetch(&a, POOL, &ME, 500, &fd), VMMT_EINVAL);
    assert_int_equal(vmmt__broker_fetch(NULL, POOL, &ME, 500, &fd), VMMT_EINVAL);
    assert_int_equal(fd, -1);
    check_resources(&before);
}

static void test_malformed_requests(void **state)
{
    tu_resources before;
    uint8_t req[100];
    struct vmmt__broker_stats s;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);
    /* short, wrong magic, too long, a version from the future */
    memset(req, 0x5a, sizeof req);
    size_t lens[] = {5, 24, 100, 24};
    for (int i = 0; i < 4; i++) {
        int c = raw_connect(a);
        if (i == 3) {
            memcpy(req, "VMBQ\4\0\0\0", 8);
            memcpy(req + 8, POOL, 16);
        }
        assert_int_equal(send(c, req, lens[i], 0), (ssize_t)lens[i]);
        assert_int_equal(raw_read_reply(c, 2000), VMMT_EPROTO);
        close(c);
    }
    /* Hanging up without a word counts too. */
    close(raw_connect(a));
    wait_stat(b, pick_malformed, 5, 2000);
    fetch_same(b, pool_fd);
    wait_stat(b, pick_served, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.malformed, 5);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_stop_with_pending_clients(void **state)
{
    tu_resources before;
    int c[10];
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.timeout_ms = 10000};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    for (int i = 0; i < 10; i++)
        c[i] = raw_connect(vmmt__broker_address(b));
    assert_int_equal(send(c[0], "VMB", 3, MSG_DONTWAIT), 3);
    usleep(20000); /* let the thread accept them */
    int64_t t0 = now_ms();
    vmmt__broker_stop(b);
    assert_true(now_ms() - t0 < 500);
    for (int i = 1; i < 10; i++) {
        assert_int_equal(raw_read_reply(c[i], 1000), 1); /* hung up, no reply */
        close(c[i]);
    }
    close(c[0]);
    close(pool_fd);
    check_resources(&before);
}

static void test_many_sequential(void **state)
{
    tu_resources before;
    struct vmmt__broker_stats s;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = start_ok(pool_fd, NULL);
    for (int i = 0; i < 50; i++)
        fetch_same(b, pool_fd);
    wait_stat(b, pick_served, 50, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.served, 50);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* A memfd holding text, so that each of several fds can be told apart by content too. */
static int make_memfd_with(const char *text)
{
    int fd = make_memfd();
    assert_int_equal(pwrite(fd, text, strlen(text) + 1, 0), (ssize_t)strlen(text) + 1);
    return fd;
}

static void test_two_fds(void **state)
{
    tu_resources before;
    struct stat st[VMMT_BROKER_MAX_FDS];
    int got[VMMT_BROKER_MAX_FDS];
    char where[300], buf[32];
    (void)state;
    take_resources(&before);

    /* The device allocation's fd and the control table's memfd: two different files. */
    int mine[VMMT_BROKER_MAX_FDS] = {make_memfd_with("device"), make_memfd_with("control"),
                                     make_memfd(), make_memfd()};
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        assert_int_equal(fstat(mine[i], &st[i]), 0);
    assert_true(st[0].st_ino != st[1].st_ino);
    struct vmmt__broker *b = NULL;
    assert_vmmt_ok(vmmt__broker_start_fds(mine, 2, POOL, NULL, &b));
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, got, 2, NULL));
    for (int i = 0; i < 2; i++) {
        struct stat g;
        assert_int_equal(fstat(got[i], &g), 0);
        assert_int_equal(g.st_ino, st[i].st_ino);
        assert_int_equal(g.st_dev, st[i].st_dev);
        assert_true(fcntl(got[i], F_GETFD) & FD_CLOEXEC);
    }
    assert_int_equal(pread(got[1], buf, 8, 0), 8);
    assert_string_equal(buf, "control");
    close(got[0]);
    close(got[1]);

    /* In another process, and in the order given. */
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    char *argv[] = {where, (char *)POOL_HEX, "-1", "writen", "2", NULL};
    pid_t pid = tu_spawn("broker_fetch", argv, -1);
    assert_true(pid > 0);
    assert_int_equal(tu_wait(pid, 10000), 0);
    for (int i = 0; i < 2; i++) {
        char want[32];
        snprintf(want, sizeof want, "written by child %d", i);
        assert_int_equal(pread(mine[i], buf, sizeof buf, 0), sizeof buf);
        assert_string_equal(buf, want);
    }
    wait_stat(b, pick_served, 2, 2000);
    vmmt__broker_stop(b);

    /* The most a broker serves; the caller's fds may close once start returns. */
    int dups[VMMT_BROKER_MAX_FDS];
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        dups[i] = dup(mine[i]);
    assert_vmmt_ok(vmmt__broker_start_fds(dups, VMMT_BROKER_MAX_FDS, POOL, NULL, &b));
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        close(dups[i]);
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, got,
                                          VMMT_BROKER_MAX_FDS, NULL));
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++) {
        assert_same_file(got[i], mine[i]);
        close(got[i]);
    }
    vmmt__broker_stop(b);
    for (int i = 0; i < VMMT_BROKER_MAX_FDS; i++)
        close(mine[i]);
    check_resources(&before);
}

/* The single-fd functions are wrappers: each side may be the old or the new call. */
static void test_one_fd_wrappers(void **state)
{
    tu_resources before;
    int got = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker *b = NULL;
    assert_vmmt_ok(vmmt__broker_start_fds(&pool_fd, 1, POOL, NULL, &b));
    fetch_same(b, pool_fd);
    vmmt__broker_stop(b);
    b = start_ok(pool_fd, NULL);
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, &got, 1, NULL));
    assert_same_file(got, pool_fd);
    close(got);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

static void test_want_mismatch(void **state)
{
    tu_resources before;
    int got[VMMT_BROKER_MAX_FDS] = {7, 7, 7, 7};
    (void)state;
    take_resources(&before);

    int two[2] = {make_memfd(), make_memfd()};
    struct vmmt__broker *b = NULL;
    assert_vmmt_ok(vmmt__broker_start_fds(two, 2, POOL, NULL, &b));
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);
    assert_int_equal(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, got, 1, NULL), VMMT_EPROTO);
    assert_error_contains("CUDA VMM POSIX FD broker failed: broker returned 2 file descriptor(s), "
                          "expected 1");
    assert_int_equal(got[0], -1);
    got[0] = 7;
    assert_int_equal(vmmt__broker_fetch(a, POOL, &ME, 2000, got), VMMT_EPROTO);
    assert_error_contains("broker returned 2 file descriptor(s), expected 1");
    assert_int_equal(got[0], -1);
    /* Bad counts are the caller's mistake, refused before any connection. */
    assert_int_equal(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, got, 0, NULL), VMMT_EINVAL);
    assert_int_equal(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, got, 5, NULL), VMMT_EINVAL);
    assert_error_contains("want is 5; a broker serves 1 to 4 fds");
    assert_int_equal(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, NULL, 1, NULL), VMMT_EINVAL);
    vmmt__broker_stop(b);

    b = start_ok(two[0], NULL);
    got[0] = got[1] = 7;
    assert_int_equal(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, got, 2, NULL),
                     VMMT_EPROTO);
    assert_error_contains("CUDA VMM POSIX FD broker failed: broker returned 1 file descriptor(s), "
                          "expected 2");
    assert_int_equal(got[0], -1);
    assert_int_equal(got[1], -1);
    vmmt__broker_stop(b);
    close(two[0]);
    close(two[1]);
    check_resources(&before);
}

static void test_start_fds_errors(void **state)
{
    tu_resources before;
    struct vmmt__broker *b = (void *)1;
    (void)state;
    take_resources(&before);

    int fds[VMMT_BROKER_MAX_FDS + 1];
    for (int i = 0; i < VMMT_BROKER_MAX_FDS + 1; i++)
        fds[i] = make_memfd();
    assert_int_equal(vmmt__broker_start_fds(fds, 0, POOL, NULL, &b), VMMT_EINVAL);
    assert_null(b);
    assert_error_contains("nfds is 0; a broker serves 1 to 4 fds");
    b = (void *)1;
    assert_int_equal(vmmt__broker_start_fds(fds, 5, POOL, NULL, &b), VMMT_EINVAL);
    assert_null(b);
    assert_error_contains("nfds is 5; a broker serves 1 to 4 fds");
    assert_int_equal(vmmt__broker_start_fds(NULL, 1, POOL, NULL, &b), VMMT_EINVAL);
    int bad[2] = {fds[0], -1};
    assert_int_equal(vmmt__broker_start_fds(bad, 2, POOL, NULL, &b), VMMT_EINVAL);
    assert_error_contains("fds[1] is -1, not a file descriptor");
    /* The second dup fails after the first succeeded: the first must not leak. */
    bad[1] = 999;
    assert_int_equal(vmmt__broker_start_fds(bad, 2, POOL, NULL, &b), VMMT_ESYS);
    assert_error_contains("cannot start the CUDA VMM POSIX FD broker of pool a1b2c3d4");
    assert_error_contains("fds[1] 999");
    assert_null(b);
    for (int i = 0; i < VMMT_BROKER_MAX_FDS + 1; i++)
        close(fds[i]);
    check_resources(&before);
}

static void test_addr_format_parse(void **state)
{
    struct vmmt__broker_addr a = {.kind = VMMT_BROKER_ADDR_ABSTRACT, .len = 3};
    char text[64];
    (void)state;
    memcpy(a.name, "a\x01z", 3);
    assert_string_equal(vmmt__broker_addr_format(&a, text, sizeof text), "@a\\x01z");
    assert_vmmt_ok(vmmt__broker_addr_parse("/run/x.sock", &a));
    assert_int_equal(a.kind, VMMT_BROKER_ADDR_PATH);
    assert_string_equal(vmmt__broker_addr_format(&a, text, sizeof text), "/run/x.sock");
    assert_int_equal(vmmt__broker_addr_parse("@", &a), VMMT_EINVAL);
}

/*
 * glibc keeps the stacks of joined threads, and the allocators (ASan's
 * especially) map a region the first time a size is asked for; run each kind
 * of thread and allocation once up front so the leak checks compare like with
 * like.
 */
/* ---------------------------------------------------------- liveness links */

struct deaths {
    pthread_mutex_t lock;
    int calls;
    uint64_t ranks[VMMT_BROKER_RANK_WORDS];
    pid_t pid;
};

static void on_dead(void *user, const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid, uid_t uid,
                    const uint64_t held[VMMT_BROKER_MAX_RANKS])
{
    struct deaths *d = user;
    (void)uid;
    (void)held;
    pthread_mutex_lock(&d->lock);
    d->calls++;
    memcpy(d->ranks, ranks, sizeof d->ranks);
    d->pid = pid;
    pthread_mutex_unlock(&d->lock);
}

static int death_calls(struct deaths *d)
{
    pthread_mutex_lock(&d->lock);
    int n = d->calls;
    pthread_mutex_unlock(&d->lock);
    return n;
}

static uint64_t pick_held(const struct vmmt__broker_stats *s)
{
    return s->held;
}
static uint64_t pick_goodbyes(const struct vmmt__broker_stats *s)
{
    return s->goodbyes;
}
static uint64_t pick_deaths(const struct vmmt__broker_stats *s)
{
    return s->deaths;
}

/* In one process: holding ranks, a goodbye, a close without one (we are alive), peer gone. */
static void test_link_in_process(void **state)
{
    tu_resources before;
    struct deaths dd = {.lock = PTHREAD_MUTEX_INITIALIZER};
    struct vmmt__broker_link *l = NULL;
    struct vmmt__broker_stats s;
    int fd = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.ranks = 4, .on_dead = on_dead, .user = &dd};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);
    assert_vmmt_ok(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, &fd, 1, &l));
    assert_non_null(l);
    close(fd);
    assert_int_equal(vmmt__broker_link_peer_pid(l), getpid());
    assert_true(vmmt__broker_link_fd(l) >= 0);
    assert_int_equal(vmmt__broker_link_peer_gone(l), 0);
    assert_vmmt_ok(vmmt__broker_link_hold(l, 0, 2));
    assert_vmmt_ok(vmmt__broker_link_hold(l, 1, 1)); /* known already: nothing sent */
    assert_vmmt_ok(vmmt__broker_link_hold(l, 3, 1));
    assert_int_equal(vmmt__broker_link_hold(l, 300, 1), VMMT_EINVAL);
    wait_stat(b, pick_held, 1, 2000);
    vmmt__broker_link_close(l, 1);
    wait_stat(b, pick_goodbyes, 1, 2000);

    /* Closed without a goodbye while this process lives: not a death. */
    assert_vmmt_ok(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, &fd, 1, &l));
    close(fd);
    assert_vmmt_ok(vmmt__broker_link_hold(l, 2, 1));
    vmmt__broker_link_close(l, 0);
    usleep(50000);
    assert_int_equal(death_calls(&dd), 0);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.deaths, 0);

    /* The producer stops: the link says so. */
    assert_vmmt_ok(vmmt__broker_fetch_fds(a, POOL, &ME, 2000, &fd, 1, &l));
    close(fd);
    vmmt__broker_stop(b);
    assert_int_equal(vmmt__broker_link_peer_gone(l), 1);
    assert_int_equal(vmmt__broker_link_hold(l, 0, 1), VMMT_ECLOSED);
    vmmt__broker_link_close(l, 1);
    vmmt__broker_link_close(NULL, 1);

    /* A broker without liveness keeps no link. */
    struct vmmt__broker_config none = {0};
    b = start_ok(pool_fd, &none);
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, &fd, 1, &l));
    assert_null(l);
    close(fd);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* A resolver for test_link_pidfd_and_resolver: one fd for OTHER, nothing for anything else. */
static int resolve_other(void *user, const uint8_t id[16], int fds[VMMT_BROKER_MAX_FDS])
{
    if (memcmp(id, OTHER, 16) != 0) return 0;
    fds[0] = dup(*(const int *)user);
    return fds[0] >= 0 ? 1 : 0;
}

/*
 * One connection gives both the liveness link and the producer's pidfd (the
 * consumer's death watch); a failed fetch leaves neither. A resolver's id is
 * served in a reply naming that id (the client checks it) and never held.
 */
static void test_link_pidfd_and_resolver(void **state)
{
    tu_resources before;
    struct vmmt__broker_link *l = NULL;
    struct vmmt__broker_stats s;
    int fd = -1, pidfd = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {
        .ranks = 4, .resolve = resolve_other, .resolve_user = &pool_fd};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    const struct vmmt__broker_addr *a = vmmt__broker_address(b);

    assert_vmmt_ok(vmmt__broker_fetch_fds_pidfd(a, POOL, &ME, 2000, &fd, 1, &l, &pidfd));
    assert_non_null(l);
    assert_true(pidfd >= 0);
    close(fd);
    /* The pidfd is this process (the broker is our thread): alive, so not readable. */
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 0), 0);
    /* One connection served both (the counter moves just after the reply). */
    wait_stat(b, pick_served, 1, 2000);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.served, 1);
    assert_int_equal(s.held, 1);
    vmmt__broker_link_close(l, 1);
    close(pidfd);

    /* Without a link the pidfd still comes; a failed fetch gives no pidfd and no link. */
    assert_vmmt_ok(vmmt__broker_fetch_fds_pidfd(a, POOL, &ME, 2000, &fd, 1, NULL, &pidfd));
    assert_true(pidfd >= 0);
    close(fd);
    close(pidfd);
    uint8_t none[16];
    memcpy(none, POOL, 16);
    none[15] ^= 0x80;
    assert_int_equal(vmmt__broker_fetch_fds_pidfd(a, none, &ME, 2000, &fd, 1, &l, &pidfd),
                     VMMT_EINVAL);
    assert_int_equal(pidfd, -1);
    assert_null(l);
    assert_int_equal(fd, -1);

    /* The resolver's id: served, its reply names OTHER, and the connection is not held. */
    assert_vmmt_ok(vmmt__broker_fetch_fds(a, OTHER, &ME, 2000, &fd, 1, &l));
    assert_null(l);
    assert_true(fd >= 0);
    close(fd);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* A child holds ranks and dies; another link holding one of them keeps that one alive. */
static void test_link_death_across_processes(void **state)
{
    tu_resources before;
    struct deaths dd = {.lock = PTHREAD_MUTEX_INITIALIZER};
    struct vmmt__broker_link *mine = NULL;
    char where[300];
    int fd = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.ranks = 8, .on_dead = on_dead, .user = &dd};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, &fd, 1, &mine));
    close(fd);
    assert_vmmt_ok(vmmt__broker_link_hold(mine, 1, 1));

    /* A goodbye, then exit: alive as far as the pool is concerned. */
    char *bye[] = {where, (char *)POOL_HEX, "-1", "hold", "0", "3", "bye", NULL};
    assert_int_equal(tu_wait(tu_spawn("broker_fetch", bye, -1), 10000), 0);
    wait_stat(b, pick_goodbyes, 1, 2000);
    assert_int_equal(death_calls(&dd), 0);

    /* Exit without one: a death; rank 1 is still held here, so ranks 0 and 2 are released. */
    char *die[] = {where, (char *)POOL_HEX, "-1", "hold", "0", "3", NULL};
    pid_t pid = tu_spawn("broker_fetch", die, -1);
    assert_int_equal(tu_wait(pid, 10000), 0);
    wait_stat(b, pick_deaths, 1, 2000);
    assert_int_equal(death_calls(&dd), 1);
    assert_int_equal(dd.ranks[0], 0x5);
    assert_int_equal(dd.pid, pid);
    vmmt__broker_link_close(mine, 1);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* An on_dead slow to return, as a pool's release of many slices can be. */
static void on_dead_slow(void *user, const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid,
                         uid_t uid, const uint64_t held[VMMT_BROKER_MAX_RANKS])
{
    usleep(100 * 1000);
    on_dead(user, ranks, pid, uid, held);
}

/*
 * A death shows in the broker's counters only once its ranks were handed on:
 * a reader who sees the count may rely on the release. (Found on a loaded
 * machine under TSan: test_link_death_across_processes saw the count and
 * not yet the call.)
 */
static void test_death_counted_once_handed_on(void **state)
{
    tu_resources before;
    struct deaths dd = {.lock = PTHREAD_MUTEX_INITIALIZER};
    char where[300];
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.ranks = 4, .on_dead = on_dead_slow, .user = &dd};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    char *die[] = {where, (char *)POOL_HEX, "-1", "hold", "0", "1", NULL};
    assert_int_equal(tu_wait(tu_spawn("broker_fetch", die, -1), 10000), 0);
    wait_stat(b, pick_deaths, 1, 5000);
    assert_int_equal(death_calls(&dd), 1);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* An on_dead that holds the broker's thread inside its first call until told to go on. */
struct gate {
    struct deaths d;
    pthread_cond_t cond;
    int entered, go;
};

static void on_dead_gated(void *user, const uint64_t ranks[VMMT_BROKER_RANK_WORDS], pid_t pid,
                          uid_t uid, const uint64_t held[VMMT_BROKER_MAX_RANKS])
{
    struct gate *g = user;
    on_dead(&g->d, ranks, pid, uid, held);
    pthread_mutex_lock(&g->d.lock);
    g->entered++;
    pthread_cond_broadcast(&g->cond);
    while (!g->go)
        pthread_cond_wait(&g->cond, &g->d.lock);
    pthread_mutex_unlock(&g->d.lock);
}

/* Until the broker's thread is inside the gated callback. */
static void gate_wait_entered(struct gate *g)
{
    pthread_mutex_lock(&g->d.lock);
    while (g->entered == 0)
        pthread_cond_wait(&g->cond, &g->d.lock);
    pthread_mutex_unlock(&g->d.lock);
}

/* Let the broker's thread out of the callback. */
static void gate_go(struct gate *g)
{
    pthread_mutex_lock(&g->d.lock);
    g->go = 1;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->d.lock);
}

static void wait_live(const struct vmmt__broker *b, int rank)
{
    uint64_t live[VMMT_BROKER_RANK_WORDS];
    int64_t end = now_ms() + 5000;
    do {
        vmmt__broker_live_ranks(b, live);
        if (live[rank / 64] & (1ull << (rank % 64))) return;
        usleep(2000);
    } while (now_ms() < end);
    fail_msg("rank %d never showed as held", rank);
}

/*
 * A rank announced by a live link before another holder of it died is not
 * released with the death, whatever order the broker's poll reports the two
 * in: the death is judged only after every other link's announcements are
 * read. (The model test found the slot of a rank a live process was reading
 * recycled under it, when the broker saw the death ahead of that process's
 * announcement in one round.) Made deterministic by holding the broker's
 * thread in the callback of a first death while the announcement and the
 * second death both arrive, so that the next round sees both, the dead link
 * ahead of the announcing one in the table.
 */
static void test_link_death_after_others_announcements(void **state)
{
    tu_resources before;
    struct gate g = {.d = {.lock = PTHREAD_MUTEX_INITIALIZER}, .cond = PTHREAD_COND_INITIALIZER};
    struct vmmt__broker_link *mine = NULL;
    struct vmmt__broker_stats s;
    uint64_t live[VMMT_BROKER_RANK_WORDS];
    char where[300];
    int fd = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.ranks = 4, .on_dead = on_dead_gated, .user = &g};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);

    /* First in the broker's table: a process holding rank 0, alive until killed. */
    char *stay[] = {where, (char *)POOL_HEX, "-1", "hold", "0", "1", "stay", NULL};
    pid_t first = tu_spawn("broker_fetch", stay, -1);
    wait_live(b, 0);
    /* Second: this process's link, holding nothing yet. */
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, &fd, 1, &mine));
    close(fd);
    /* Third: a process holding rank 1 that dies; its release holds the broker's thread. */
    char *die[] = {where, (char *)POOL_HEX, "-1", "hold", "1", "1", NULL};
    assert_int_equal(tu_wait(tu_spawn("broker_fetch", die, -1), 10000), 0);
    gate_wait_entered(&g);
    assert_int_equal(g.d.ranks[0], 0x2);

    /* While it is held: this process announces rank 0, then the first process dies. */
    assert_vmmt_ok(vmmt__broker_link_hold(mine, 0, 1));
    assert_int_equal(kill(first, SIGKILL), 0);
    assert_int_equal(tu_wait(first, 10000), -1);
    gate_go(&g);

    wait_stat(b, pick_deaths, 2, 5000);
    /* Rank 0 had a live holder when its other holder died: nothing to release. */
    assert_int_equal(death_calls(&g.d), 1);
    vmmt__broker_live_ranks(b, live);
    assert_int_equal(live[0], 0x1);
    vmmt__broker_stats(b, &s);
    assert_int_equal(s.deaths, 2);
    vmmt__broker_link_close(mine, 1);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

struct sync_call {
    struct vmmt__broker *b;
    int st;
    uint64_t live[VMMT_BROKER_RANK_WORDS];
};

static void *sync_thread(void *arg)
{
    struct sync_call *c = arg;
    c->st = vmmt__broker_sync(c->b, 5000);
    vmmt__broker_live_ranks(c->b, c->live);
    return NULL;
}

/*
 * vmmt__broker_sync returns once every announcement sent before it was read
 * (vmmt_pool_release_rank stamps its release after it, so a process that
 * announced a rank before the call is known to be covered by it), and says
 * VMMT_ETIMEDOUT when the broker's thread cannot answer in time.
 */
static void test_sync_reads_announcements(void **state)
{
    tu_resources before;
    struct gate g = {.d = {.lock = PTHREAD_MUTEX_INITIALIZER}, .cond = PTHREAD_COND_INITIALIZER};
    struct vmmt__broker_link *mine = NULL;
    struct sync_call call = {0};
    pthread_t t;
    char where[300];
    int fd = -1;
    (void)state;
    take_resources(&before);

    int pool_fd = make_memfd();
    struct vmmt__broker_config cfg = {.ranks = 4, .on_dead = on_dead_gated, .user = &g};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    vmmt__broker_addr_format(vmmt__broker_address(b), where, sizeof where);
    assert_vmmt_ok(vmmt__broker_sync(b, 5000)); /* nothing to read */
    assert_vmmt_ok(vmmt__broker_sync(NULL, 5000));
    assert_vmmt_ok(vmmt__broker_fetch_fds(vmmt__broker_address(b), POOL, &ME, 2000, &fd, 1, &mine));
    close(fd);
    /* A death holds the broker's thread in its callback. */
    char *die[] = {where, (char *)POOL_HEX, "-1", "hold", "1", "1", NULL};
    assert_int_equal(tu_wait(tu_spawn("broker_fetch", die, -1), 10000), 0);
    gate_wait_entered(&g);

    assert_vmmt_ok(vmmt__broker_link_hold(mine, 0, 1));
    assert_int_equal(vmmt__broker_sync(b, 50), VMMT_ETIMEDOUT);
    assert_error_contains("did not read its liveness links within 50 ms");
    call.b = b;
    assert_int_equal(pthread_create(&t, NULL, sync_thread, &call), 0);
    usleep(20000);
    gate_go(&g);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_vmmt_ok(call.st);
    assert_int_equal(call.live[0], 0x1);
    vmmt__broker_link_close(mine, 1);
    vmmt__broker_stop(b);
    close(pool_fd);
    check_resources(&before);
}

/* The pure parsers the server runs on what peers send (and fuzzers call). */
static void test_wire_parsers(void **state)
{
    uint8_t req[VMMT__BREQ_SIZE], m[VMMT__BMSG_SIZE], id[16];
    uint16_t flags = 0;
    struct vmmt__bmsg msg;
    char why[200];
    (void)state;

    memcpy(req, "VMBQ\3\0\1\0", 8);
    memcpy(req + 8, POOL, 16);
    assert_null(vmmt__breq_parse(req, sizeof req, &flags, id, why, sizeof why));
    assert_int_equal(flags, VMMT__BREQ_HOLD);
    assert_memory_equal(id, POOL, 16);
    assert_non_null(vmmt__breq_parse(req, 23, &flags, id, why, sizeof why));
    req[6] = 2; /* an unknown flag */
    assert_non_null(vmmt__breq_parse(req, sizeof req, &flags, id, why, sizeof why));
    assert_non_null(strstr(why, "unknown bits"));

    memcpy(m, "VMBM\3\0\1\0", 8);
    vmmt__put_u32(m + 8, 2);
    vmmt__put_u32(m + 12, 2);
    assert_null(vmmt__bmsg_parse(m, sizeof m, 4, &msg, why, sizeof why));
    assert_int_equal(msg.first, 2);
    assert_non_null(vmmt__bmsg_parse(m, sizeof m, 3, &msg, why, sizeof why)); /* past the end */
    vmmt__put_u32(m + 8, 0xffffffffu); /* first + count wraps */
    assert_non_null(vmmt__bmsg_parse(m, sizeof m, 4, &msg, why, sizeof why));
    vmmt__put_u32(m + 8, 0);
    vmmt__put_u32(m + 12, 0);
    assert_non_null(vmmt__bmsg_parse(m, sizeof m, 4, &msg, why, sizeof why)); /* no rank */
    m[6] = VMMT__BMSG_BYE;
    assert_null(vmmt__bmsg_parse(m, sizeof m, 4, &msg, why, sizeof why));
    vmmt__put_u32(m + 12, 1); /* a goodbye carries nothing */
    assert_non_null(vmmt__bmsg_parse(m, sizeof m, 4, &msg, why, sizeof why));
    assert_non_null(vmmt__bmsg_parse(m, 15, 4, &msg, why, sizeof why));

    /* The client's side: a success reply for POOL with one fd, then what breaks it. */
    uint8_t rep[VMMT__BREP_MAX + 8] = "VMBR\3\0\1\0";
    memcpy(rep + 14, POOL, 16);
    assert_vmmt_ok(vmmt__brep_check(rep, 30, 0, 1, POOL, 1, "@x"));
    assert_int_equal(vmmt__brep_check(rep, 30, 0, 1, OTHER, 1, "@x"), VMMT_EPROTO);
    assert_int_equal(vmmt__brep_check(rep, 30, 0, 2, POOL, 1, "@x"), VMMT_EPROTO);
    assert_int_equal(vmmt__brep_check(rep, 31, 0, 1, POOL, 1, "@x"), VMMT_EPROTO);
    assert_int_equal(vmmt__brep_check(rep, sizeof rep, 0, 1, POOL, 1, "@x"), VMMT_EPROTO);
    assert_int_equal(vmmt__brep_check(rep, 0, 0, 0, POOL, 1, "@x"), VMMT_ECLOSED);
    rep[12] = 201; /* msg_len past its bound */
    assert_int_equal(vmmt__brep_check(rep, 30 + 201, 0, 1, POOL, 1, "@x"), VMMT_EPROTO);
}

static int warm_up(void **state)
{
    ME.uid = geteuid();
    ME.pid = getpid();
    int fd = -1;
    (void)state;
    int pool_fd = make_memfd();
    uid_t someone[] = {65534};
    struct vmmt__broker_config cfg = {.allowed_uids = someone, .allowed_count = 1};
    struct vmmt__broker *b = start_ok(pool_fd, &cfg);
    fetch_from_fake(VMMT_OK, 1, &fd);
    vmmt__broker_stop(b);
    close(pool_fd);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_process),
        cmocka_unit_test(test_other_process),
        cmocka_unit_test(test_path_mode),
        cmocka_unit_test(test_path_stale_socket_replaced),
        cmocka_unit_test(test_path_live_socket_refused),
        cmocka_unit_test(test_path_regular_file_refused),
        cmocka_unit_test(test_start_errors),
        cmocka_unit_test(test_wrong_pool_refused),
        cmocka_unit_test(test_stalled_client_times_out),
        cmocka_unit_test(test_pending_limit),
        cmocka_unit_test(test_other_user_refused),
        cmocka_unit_test(test_userns_mapping_named),
        cmocka_unit_test(test_uid_map_find),
        cmocka_unit_test(test_fake_server_replies),
        cmocka_unit_test(test_client_timeout),
        cmocka_unit_test(test_connect_refused),
        cmocka_unit_test(test_malformed_requests),
        cmocka_unit_test(test_stop_with_pending_clients),
        cmocka_unit_test(test_many_sequential),
        cmocka_unit_test(test_addr_format_parse),
        cmocka_unit_test(test_two_fds),
        cmocka_unit_test(test_one_fd_wrappers),
        cmocka_unit_test(test_want_mismatch),
        cmocka_unit_test(test_start_fds_errors),
        cmocka_unit_test(test_v1_server),
        cmocka_unit_test(test_v1_client),
        cmocka_unit_test(test_link_in_process),
        cmocka_unit_test(test_link_pidfd_and_resolver),
        cmocka_unit_test(test_link_death_across_processes),
        cmocka_unit_test(test_death_counted_once_handed_on),
        cmocka_unit_test(test_link_death_after_others_announcements),
        cmocka_unit_test(test_sync_reads_announcements),
        cmocka_unit_test(test_wire_parsers),
    };
    return cmocka_run_group_tests(tests, warm_up, NULL);
}
