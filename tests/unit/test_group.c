/*
 * The group exchange: the handle-type vote on crafted hellos; the descriptor
 * exchange against a hostile peer (another process playing rank 1: extra,
 * missing and duplicate descriptors, a second connection, an impostor, a
 * stalled peer); and whole jobs of 2 and 3 ranks under the local adapter
 * (tests/group/group_rank.c: FABRIC and POSIX read-back with a buffer across
 * 3 allocations, every mismatch error, a rank that dies or stalls during the
 * exchange, nothing left open). The same jobs run under mpirun as CTest
 * tests group_mpi_*.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "group_internal.h"
#include "scm.h"
#include "status.h"
#include "testutil.h"

/* ------------------------------------------------------------------ vote */

static void hello(struct vmmt__group_hello *h, int rank, int world, int fabric, int posix,
                  const char *node)
{
    memset(h, 0, sizeof *h);
    memcpy(h->magic, "VMMTGRP1", 8);
    h->version = 1;
    h->rank = rank;
    h->world = world;
    h->requested = VMMT_HANDLE_AUTO;
    h->fabric_ok = fabric;
    h->posix_ok = posix;
    snprintf(h->node, sizeof h->node, "%s", node);
    snprintf(h->fabric_cause, sizeof h->fabric_cause, "%s", fabric ? "" : "fabric-cause-X");
    snprintf(h->posix_cause, sizeof h->posix_cause, "%s", posix ? "" : "posix-cause-Y");
}

static void test_vote(void **state)
{
    struct vmmt__group_hello h[3];
    vmmt_handle_type t;

    (void)state;
    for (int r = 0; r < 3; r++)
        hello(&h[r], r, 3, 1, 1, "n");
    assert_vmmt_ok(vmmt__group_vote(h, 3, &t));
    assert_int_equal(t, VMMT_HANDLE_FABRIC);

    /* One rank without FABRIC: POSIX descriptors everywhere. */
    hello(&h[1], 1, 3, 0, 1, "n");
    assert_vmmt_ok(vmmt__group_vote(h, 3, &t));
    assert_int_equal(t, VMMT_HANDLE_POSIX_FD);

    /* A rank insisting on FABRIC that does not work everywhere. */
    h[2].requested = VMMT_HANDLE_FABRIC;
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_ENOTSUP);
    assert_error_contains("rank 1: fabric-cause-X");
    /* Two ranks insisting on different types. */
    h[0].requested = VMMT_HANDLE_POSIX_FD;
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_EINVAL);
    assert_error_contains("rank 0 asks for handle type POSIX_FD and rank 2 for FABRIC");
    h[0].requested = h[2].requested = VMMT_HANDLE_AUTO;

    /* Neither type on rank 2: every cause named. */
    hello(&h[2], 2, 3, 0, 0, "n");
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_ENOTSUP);
    assert_error_contains("rank 2: POSIX_FD: posix-cause-Y");
    assert_error_contains("rank 2: FABRIC: fabric-cause-X");

    /* Different nodes without FABRIC: the IMEX channel. */
    hello(&h[2], 2, 3, 1, 1, "m");
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_ENOTSUP);
    assert_error_contains("different nodes (n, m)");
    assert_error_contains("IMEX channel");
    /* ... and with FABRIC everywhere, nodes do not matter. */
    hello(&h[1], 1, 3, 1, 0, "n");
    assert_vmmt_ok(vmmt__group_vote(h, 3, &t));
    assert_int_equal(t, VMMT_HANDLE_FABRIC);

    /* Two processes claiming one rank, and disagreeing world sizes. */
    h[2].rank = 1;
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_EINVAL);
    assert_error_contains("two processes claim one rank");
    h[2].rank = 2;
    h[1].world = 4;
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_EINVAL);
    assert_error_contains("rank 1 says world_size=4");
    h[1].world = 3;
    h[1].version = 2;
    assert_int_equal(vmmt__group_vote(h, 3, &t), VMMT_EPROTO);
}

/* The thread's error holds `n` copies of c followed by `after`. */
static void assert_error_has_run(char c, size_t n, const char *after)
{
    char *want = malloc(n + strlen(after) + 1);

    assert_non_null(want);
    memset(want, c, n);
    strcpy(want + n, after);
    assert_error_contains(want);
    free(want);
}

/*
 * A peer's hello is bytes off the wire: a string field that fills its array
 * without a NUL is printed up to the field's end and no further (not into the
 * next field, nor past the last hello: AddressSanitizer's heap-buffer-overflow
 * before the bound).
 */
static void test_vote_unterminated_strings(void **state)
{
    struct vmmt__group_hello *h = calloc(2, sizeof *h);
    vmmt_handle_type t;

    (void)state;
    assert_non_null(h);
    hello(&h[0], 0, 2, 0, 0, "n");
    hello(&h[1], 1, 2, 0, 0, "n");
    memset(h[1].fabric_cause, 'F', sizeof h[1].fabric_cause);
    /* The last field of the last hello: the allocation ends right after it. */
    memset(h[1].posix_cause, 'P', sizeof h[1].posix_cause);
    assert_int_equal(vmmt__group_vote(h, 2, &t), VMMT_ENOTSUP);
    assert_error_has_run('F', sizeof h[1].fabric_cause, ";");
    assert_error_has_run('P', sizeof h[1].posix_cause, ";");

    /* Node names, in the message about ranks on different nodes. */
    h[1].posix_ok = 1;
    memset(h[0].node, 'M', sizeof h[0].node);
    memset(h[1].node, 'N', sizeof h[1].node);
    assert_int_equal(vmmt__group_vote(h, 2, &t), VMMT_ENOTSUP);
    assert_error_has_run('N', sizeof h[1].node, ") and FABRIC");
    assert_error_has_run('M', sizeof h[0].node, ", N");
    h[0].requested = VMMT_HANDLE_POSIX_FD;
    assert_int_equal(vmmt__group_vote(h, 2, &t), VMMT_ENOTSUP);
    assert_error_has_run('N', sizeof h[1].node, ") and descriptors");
    free(h);
}

/* ------------------------------------------------ exchange, hostile peer */

enum peer_act {
    ACT_GOOD,      /* 3 descriptors in one batch */
    ACT_EXTRA,     /* 4 descriptors, announced as 4 in the batch */
    ACT_MISSING,   /* 2 of 3, then close */
    ACT_DUP_BATCH, /* batch 0 twice */
    ACT_DUP_CONN,  /* a second connection */
    ACT_MORE,      /* all 3, then one more batch */
    ACT_STALL,     /* connect, send nothing */
    ACT_UNTRUNC,   /* header says 2, carries 3 */
};

static void send_batch(int s, uint32_t batch, int nfds, uint32_t nfds_said, uint32_t total)
{
    struct vmmt__gx_head h = {VMMT__GX_MAGIC, VMMT__GX_VERSION, 7, 1, 0, batch, nfds_said, total};
    int fds[8];

    for (int k = 0; k < nfds; k++)
        fds[k] = open("/dev/null", O_RDONLY);
    vmmt__scm_send(s, &h, sizeof h, fds, nfds, 0);
    for (int k = 0; k < nfds; k++)
        close(fds[k]);
}

static int connect_to(const struct vmmt__broker_addr *a)
{
    struct sockaddr_un sun;
    int s = socket(AF_UNIX, SOCK_SEQPACKET, 0);

    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    memcpy(sun.sun_path + 1, a->name, a->len);
    if (connect(s, (struct sockaddr *)&sun,
                (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + a->len)) != 0)
        _exit(3);
    return s;
}

static void play_peer(const struct vmmt__broker_addr *a, enum peer_act act)
{
    int s = connect_to(a), s2;

    switch (act) {
    case ACT_GOOD: send_batch(s, 0, 3, 3, 3); break;
    case ACT_EXTRA: send_batch(s, 0, 4, 4, 4); break;
    case ACT_MISSING: send_batch(s, 0, 2, 2, 3); break;
    case ACT_DUP_BATCH:
        send_batch(s, 0, 2, 2, 3);
        send_batch(s, 0, 1, 1, 3);
        break;
    case ACT_DUP_CONN:
        send_batch(s, 0, 1, 1, 3);
        s2 = connect_to(a);
        send_batch(s2, 1, 2, 2, 3);
        usleep(300000);
        close(s2);
        break;
    case ACT_MORE:
        send_batch(s, 0, 3, 3, 3);
        send_batch(s, 1, 1, 1, 3);
        break;
    case ACT_STALL: usleep(1500000); break;
    case ACT_UNTRUNC: send_batch(s, 0, 3, 2, 3); break;
    }
    usleep(100000);
    close(s);
    _exit(0);
}

/* Run an exchange as rank 0 that expects 3 descriptors from a forked rank 1 acting `act`. */
static int exchange_with(enum peer_act act, int announce_pid, int timeout_ms, double *ms)
{
    struct vmmt__gx x;
    struct vmmt__gx_peer p;
    struct timespec t0, t1;
    int fds[3], st;
    pid_t pid;

    assert_vmmt_ok(vmmt__gx_listen(NULL, &x));
    if ((pid = fork()) == 0) play_peer(&x.addr, act);
    memset(&p, 0, sizeof p);
    p.rank = 1;
    p.pid = announce_pid ? pid : pid + 100000;
    p.uid = geteuid();
    p.recv_count = 3;
    p.recv_fds = fds;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    st = vmmt__gx_run(&x, 0, 7, &p, 1, timeout_ms);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    if (st == VMMT_OK)
        for (int k = 0; k < 3; k++) {
            assert_true(fds[k] >= 0);
            close(fds[k]);
        }
    else
        for (int k = 0; k < 3; k++)
            assert_int_equal(fds[k], -1);
    vmmt__gx_close(&x);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return st;
}

static void test_exchange_hostile_peer(void **state)
{
    static const struct {
        enum peer_act act;
        int announce, status;
        const char *text;
    } cases[] = {
        {ACT_GOOD, 1, VMMT_OK, NULL},
        {ACT_EXTRA, 1, VMMT_EPROTO, "extra descriptors: rank 1 sends 4"},
        {ACT_MISSING, 1, VMMT_EPROTO,
         "missing descriptors: rank 1 closed its connection after 2 of 3"},
        {ACT_DUP_BATCH, 1, VMMT_EPROTO, "duplicate: rank 1 sent batch 0 again"},
        {ACT_DUP_CONN, 1, VMMT_EPROTO, "duplicate: rank 1"},
        {ACT_MORE, 1, VMMT_EPROTO, "extra descriptors: rank 1 sent more after all 3"},
        {ACT_UNTRUNC, 1, VMMT_EPROTO, "says 2 descriptors and carries 3"},
        {ACT_STALL, 1, VMMT_ETIMEDOUT, "rank 1 sent 0 of 3 descriptors"},
        /* Not the announced pid: refused, so nothing ever arrives. */
        {ACT_GOOD, 0, VMMT_ETIMEDOUT, "(never connected)"},
    };
    tu_resources before;
    double ms;

    (void)state;
    tu_resources_take(&before);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int st = exchange_with(cases[i].act, cases[i].announce, 800, &ms);
        if (st != cases[i].status)
            fail_msg("case %zu: status %d, expected %d: %s", i, st, cases[i].status,
                     vmmt_last_error());
        if (cases[i].text != NULL) assert_error_contains(cases[i].text);
        /* Every wait is bounded by the exchange's timeout. */
        assert_true(ms < 800 + 500);
    }
    tu_resources_check(&before);
}

/* A listener that is not the rank it claims to be gets nothing. */
static void test_exchange_refuses_impostor_listener(void **state)
{
    struct vmmt__gx x, self;
    struct vmmt__gx_peer p;
    int fd = open("/dev/null", O_RDONLY), st;

    (void)state;
    assert_vmmt_ok(vmmt__gx_listen(NULL, &x));
    assert_vmmt_ok(vmmt__gx_listen(NULL, &self));
    memset(&p, 0, sizeof p);
    p.rank = 1;
    p.pid = getpid() + 1; /* the listener is ours, not rank 1's */
    p.uid = geteuid();
    p.addr = x.addr;
    p.send_count = 1;
    p.send_fds = &fd;
    st = vmmt__gx_run(&self, 0, 1, &p, 1, 500);
    assert_int_equal(st, VMMT_EPERM);
    assert_error_contains("refusing to send it descriptors");
    close(fd);
    vmmt__gx_close(&x);
    vmmt__gx_close(&self);
}

/* A socket directory instead of abstract names: the file is removed on close. */
static void test_exchange_path_socket(void **state)
{
    char dir[] = "/tmp/vmmt-gx-XXXXXX";
    struct vmmt__gx x;

    (void)state;
    assert_non_null(mkdtemp(dir));
    assert_vmmt_ok(vmmt__gx_listen(dir, &x));
    char path[sizeof x.path];
    snprintf(path, sizeof path, "%s", x.path);
    assert_int_equal(access(path, F_OK), 0);
    vmmt__gx_close(&x);
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(rmdir(dir), 0); /* empty again */
}

/* ---------------------------------------------------------- whole jobs */

static void run_job(const char *scenario, int world)
{
    char job[64], r[8], n[8];
    pid_t pids[3];

    snprintf(job, sizeof job, "test-%s-%d-%d", scenario, world, (int)getpid());
    snprintf(n, sizeof n, "%d", world);
    for (int k = 0; k < world; k++) {
        snprintf(r, sizeof r, "%d", k);
        char *argv[] = {"local", (char *)scenario, r, n, job, NULL};
        pids[k] = tu_spawn("group_rank", argv, -1);
    }
    for (int k = 0; k < world; k++) {
        int code = tu_wait(pids[k], 30000);
        if (code != 0) fail_msg("%s, %d ranks: rank %d exited %d", scenario, world, k, code);
    }
}

#define JOB_TEST(sc)                                                                               \
    static void test_job_##sc(void **state)                                                        \
    {                                                                                              \
        (void)state;                                                                               \
        run_job(#sc, 2);                                                                           \
        run_job(#sc, 3);                                                                           \
    }
JOB_TEST(fabric)
JOB_TEST(posix)
JOB_TEST(posixdir)
JOB_TEST(none)
JOB_TEST(nodes)
JOB_TEST(count)
JOB_TEST(notvmm)
JOB_TEST(mapfail)
JOB_TEST(die)
JOB_TEST(stall)

/* The CLI's job: 3 ranks read every peer's buffers. */
static void test_cli_group_test(void **state)
{
    static const char *const env[] = {"VMMT_EMU_GRANULARITY=65536", NULL};
    /* 5 buffers: 7 allocation ids, an odd chain that once misaligned the tables (UBSan). */
    static const char *const args[] = {"group-test", "--driver",  "emu",  "--ranks",
                                       "3",          "--buffers", "5",    "--size",
                                       "65536",      "--timeout", "5000", NULL};
    char out[8192];

    (void)state;
    int rc = tu_run_tool(env, args, out, sizeof out);
    if (rc != 0) fail_msg("vmmt group-test exited %d:\n%s", rc, out);
    assert_non_null(strstr(out, "every rank read every peer's buffers correctly"));
}

/* Arguments refused before any collective, with messages. */
static void test_create_errors(void **state)
{
    vmmt_group_config c;
    vmmt_group *g = (vmmt_group *)&c;

    (void)state;
    vmmt_group_config_init(&c);
    c.world_size = 2;
    c.rank = 2;
    assert_int_equal(vmmt_group_create(&c, &g), VMMT_EINVAL);
    assert_null(g);
    assert_error_contains("rank=2 is outside 0..1");
    c.rank = 0;
    assert_int_equal(vmmt_group_create(&c, &g), VMMT_EINVAL);
    assert_error_contains("collective.allgather is NULL");
    assert_int_equal(vmmt_group_create_local(&c, "", &g), VMMT_EINVAL);
    assert_int_equal(vmmt_group_register(NULL, NULL, 0, NULL), VMMT_EINVAL);
    vmmt_group_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vote),
        cmocka_unit_test(test_vote_unterminated_strings),
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_exchange_hostile_peer),
        cmocka_unit_test(test_exchange_refuses_impostor_listener),
        cmocka_unit_test(test_exchange_path_socket),
        cmocka_unit_test(test_job_fabric),
        cmocka_unit_test(test_job_posix),
        cmocka_unit_test(test_job_posixdir),
        cmocka_unit_test(test_job_none),
        cmocka_unit_test(test_job_nodes),
        cmocka_unit_test(test_job_count),
        cmocka_unit_test(test_job_notvmm),
        cmocka_unit_test(test_job_mapfail),
        cmocka_unit_test(test_job_die),
        cmocka_unit_test(test_job_stall),
        cmocka_unit_test(test_cli_group_test),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
