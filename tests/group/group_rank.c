/*
 * One rank of a group test job, under the local adapter or under mpirun
 * (built as group_rank_mpi where MPI is found). Each scenario sets this
 * rank's emulated driver (handle types, node name) from its rank before the
 * driver loads, runs the group, and exits 0 only when this rank saw what the
 * scenario expects, with nothing left open: descriptors (/proc/self/fd) and
 * the emulator's live allocations, reservations and mappings are compared
 * with their counts before the group was created.
 *
 *   group_rank local SCENARIO RANK WORLD JOB
 *   mpirun -np N group_rank_mpi mpi SCENARIO
 *
 * Scenarios: fabric, posix, posixdir (sockets in /tmp) (read-back of buffers, one crossing 3
 * allocations), none, nodes, count, notvmm (errors on every rank), mapfail
 * (one rank's span mapping fails: all undo, then succeed), die
 * (the last rank exits after the allocation tables; local only), stall (the
 * last rank sleeps past the exchange bound).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef GROUP_RANK_MPI
#include "vmmt_mpi.h"
#endif

#include "driver.h"
#include "emu.h"
#include "group_check.h"
#include "vmmt.h"

#define EXCHANGE_MS 1500

static int g_rank, g_world, g_calls, g_die_at;
static const char *g_scenario;
static vmmt_group_collective g_inner;

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;

    if (d == NULL) return -1;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

static double now_ms(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/*
 * The job's collective, with a fault: in "die" and "stall" the last rank
 * takes part in the all-gather of allocation tables (the third collective),
 * so the others go on to the descriptor exchange, then dies or stalls.
 */
static int faulty_allgather(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                            size_t cap)
{
    int rc = g_inner.allgather(ctx, send, recv, bytes, err, cap);

    if (++g_calls == g_die_at && g_rank == g_world - 1) {
        if (strcmp(g_scenario, "die") == 0) {
            printf("rank %d: dying during the exchange, as the scenario says\n", g_rank);
            fflush(stdout);
            _exit(0);
        }
        if (strcmp(g_scenario, "stall") != 0) return rc;
        struct timespec t = {(EXCHANGE_MS + 1000) / 1000, ((EXCHANGE_MS + 1000) % 1000) * 1000000L};
        nanosleep(&t, NULL);
    }
    return rc;
}

static void setup_driver(void)
{
    const char *handles = "posix_fd,fabric";
    const char *driver = getenv("VMMT_TEST_DRIVER");

    if (strncmp(g_scenario, "posix", 5) == 0 && g_rank == 1) handles = "posix_fd";
    if (strcmp(g_scenario, "none") == 0 && g_rank == g_world - 1) handles = "none";
    if (strcmp(g_scenario, "nodes") == 0) {
        handles = "posix_fd";
        setenv("VMMT_GROUP_NODE", g_rank % 2 ? "node-b" : "node-a", 1);
    }
    if (strcmp(g_scenario, "die") == 0 || strcmp(g_scenario, "stall") == 0 ||
        strcmp(g_scenario, "count") == 0 || strcmp(g_scenario, "notvmm") == 0 ||
        strcmp(g_scenario, "mapfail") == 0)
        handles = "posix_fd";
    setenv("VMMT_EMU_HANDLES", handles, 1);
    setenv("VMMT_EMU_GRANULARITY", "65536", 1);
    if (driver == NULL || *driver == '\0') driver = "emu";
    /* The emulator this build made (the rank lives in tests/, not beside the library). */
    setenv("VMMT_EMU_LIBRARY", VMMT_TEST_EMU_LIBRARY, 0);
    if (vmmt_driver_select(driver) != VMMT_OK) {
        printf("rank %d: %s\n", g_rank, vmmt_last_error());
        exit(2);
    }
    if (strcmp(driver, "emu") == 0) vmmt__emu_configure();
}

struct counts {
    int fds, allocs, resvs, maps;
};

static void take(struct counts *c)
{
    c->fds = count_fds();
    c->allocs = vmmt__emu_live_allocations();
    c->resvs = vmmt__emu_live_reservations();
    c->maps = vmmt__emu_live_mappings();
}

static int expect_error(int st, const char *what, const char *text)
{
    if (st == VMMT_OK) {
        printf("rank %d: %s succeeded; the scenario expects it to fail\n", g_rank, what);
        return 1;
    }
    if (strstr(vmmt_last_error(), text) == NULL) {
        printf("rank %d: %s failed without \"%s\": %s\n", g_rank, what, text, vmmt_last_error());
        return 1;
    }
    printf("rank %d: %s failed as expected: %s\n", g_rank, what, vmmt_last_error());
    return 0;
}

/* Register what the scenario says; 0 when the outcome is the expected one. */
static int run_group(vmmt_group *g)
{
    struct gc_opts o = {.buffers = 6, .chunks = 3, .size = 65536, .again = 1};
    struct gc_result res;
    uint64_t p = 0, ptrs[2 * 64];
    vmmt_group_buffer b[2];
    double t0;
    int st, rc;

    if (strcmp(g_scenario, "fabric") == 0 || strcmp(g_scenario, "posix") == 0 ||
        strcmp(g_scenario, "posixdir") == 0) {
        vmmt_handle_type want =
            strcmp(g_scenario, "fabric") == 0 ? VMMT_HANDLE_FABRIC : VMMT_HANDLE_POSIX_FD;
        if (vmmt_group_handle_type(g) != want) {
            printf("rank %d: the group chose %s, expected %s\n", g_rank,
                   vmmt_handle_type_name(vmmt_group_handle_type(g)), vmmt_handle_type_name(want));
            return 1;
        }
        rc = gc_run(g, &o, stdout, &res);
        if (rc == 0)
            printf("rank %d: %s: read %llu peer bytes through %zu peer allocations\n", g_rank,
                   g_scenario, (unsigned long long)res.checked, res.peer_allocations);
        return rc;
    }
    if (strcmp(g_scenario, "notvmm") == 0) {
        /* The last rank offers cuMemAlloc memory: not VMM, cannot be shared. */
        const struct vmmt_drv *d = vmmt__drv();
        if (g_rank == g_world - 1) {
            vmmt__ctx_enter(0);
            CUdeviceptr dp = 0;
            d->cuMemAlloc(&dp, 65536);
            p = dp;
            vmmt__ctx_leave();
        } else {
            vmmt_group_alloc(g, 65536, 1, &p);
        }
        b[0] = (vmmt_group_buffer){p, 65536};
        st = vmmt_group_register(g, b, 1, ptrs);
        if (g_rank == g_world - 1) {
            vmmt__ctx_enter(0);
            d->cuMemFree(p);
            vmmt__ctx_leave();
        } else {
            vmmt_group_free(g, p);
        }
        return expect_error(st, "register", "not CUDA VMM memory");
    }
    if (vmmt_group_alloc(g, 2 * 65536, 2, &p) != VMMT_OK) {
        printf("rank %d: %s\n", g_rank, vmmt_last_error());
        return 2;
    }
    b[0] = (vmmt_group_buffer){p, 65536};
    b[1] = (vmmt_group_buffer){p + 65536, 65536};
    t0 = now_ms();
    if (strcmp(g_scenario, "mapfail") == 0) {
        size_t nb = 1, na = 1;
        /* The last rank's first span mapping fails: every rank must undo everything. */
        if (g_rank == g_world - 1) {
            setenv("VMMT_EMU_FAIL", "cuMemMap:1:CUDA_ERROR_OUT_OF_MEMORY", 1);
            vmmt__emu_configure();
        }
        st = vmmt_group_register(g, b, 2, ptrs);
        rc = expect_error(st, "register", "cuMemMap");
        vmmt_group_get_counts(g, &nb, &na);
        if (rc == 0 && (nb != 0 || na != 0)) {
            printf("rank %d: after the failure %zu buffers, %zu peer allocations remain\n", g_rank,
                   nb, na);
            rc = 1;
        }
        /* The failure was one call: the group is usable, and the next try succeeds. */
        if (rc == 0 && (st = vmmt_group_register(g, b, 2, ptrs)) != VMMT_OK) {
            printf("rank %d: register after the failure: %s\n", g_rank, vmmt_last_error());
            rc = 1;
        }
        for (int k = 0; rc == 0 && k < 2 * g_world; k++)
            if (ptrs[k] == 0) rc = 1;
        if (rc == 0) printf("rank %d: registered after the undone failure\n", g_rank);
    } else if (strcmp(g_scenario, "count") == 0) {
        st = vmmt_group_register(g, b, g_rank == 1 ? 2 : 1, ptrs);
        rc = expect_error(st, "register", "registers");
    } else {
        st = vmmt_group_register(g, b, 2, ptrs);
        /* A dead rank: the exchange fails on a refused or closed socket, then the collective. */
        rc = expect_error(st, "register", "group exchange");
        /*
         * The bound: the exchange's timeout, plus the collective noticing a dead rank (and
         * for the stalled rank its 2.5 s nap), with room for a loaded machine.
         */
        double bound = EXCHANGE_MS + (strcmp(g_scenario, "stall") == 0 ? 4000 : 2000);
        /*
         * A dead rank's sockets close, which the others notice at once: well before the
         * exchange's own bound (they used to wait it out).
         */
        if (strcmp(g_scenario, "die") == 0) bound = EXCHANGE_MS - 500;
        if (rc == 0 && now_ms() - t0 > bound) {
            printf("rank %d: failing took %.0f ms, beyond the bound\n", g_rank, now_ms() - t0);
            rc = 1;
        }
    }
    vmmt_group_free(g, p);
    return rc;
}

static int run(const char *adapter, const char *job, void *comm)
{
    vmmt_group_config c;
    struct counts before, after;
    vmmt_device_probe probe;
    vmmt_group *g = NULL;
    int st, rc;

    setup_driver();
    vmmt_probe_device(0, &probe); /* cached from here on: not counted as a leak */
    take(&before);
    vmmt_group_config_init(&c);
    c.rank = g_rank;
    c.world_size = g_world;
    c.timeout_ms = EXCHANGE_MS;
    /* posixdir: filesystem sockets, for ranks in containers without a shared network namespace. */
    if (strcmp(g_scenario, "posixdir") == 0) c.socket_dir = "/tmp";
    if (strcmp(adapter, "local") == 0) {
        st = vmmt_group_local_collective(job, g_rank, g_world, 10000, &c.collective);
    } else {
#ifdef GROUP_RANK_MPI
        /* A refused call leaves its message, as every vmmt call does. */
        vmmt_group_collective none;
        st = vmmt_group_mpi_collective(MPI_COMM_NULL, &none, &c.rank, &c.world_size);
        if (st != VMMT_EINVAL || strstr(vmmt_last_error(), "MPI_COMM_NULL") == NULL) {
            printf("rank %d: the collective of MPI_COMM_NULL: %d, \"%s\"\n", g_rank, st,
                   vmmt_last_error());
            return 2;
        }
        st = vmmt_group_mpi_collective(*(MPI_Comm *)comm, &c.collective, &c.rank, &c.world_size);
#else
        (void)comm;
        st = VMMT_ENOTSUP;
#endif
    }
    if (st != VMMT_OK) {
        printf("rank %d: adapter %s: %s\n", g_rank, adapter, vmmt_last_error());
        return 2;
    }
    g_inner = c.collective;
    c.collective.allgather = faulty_allgather;
    g_die_at = 3;
    st = vmmt_group_create(&c, &g);
    if (strcmp(g_scenario, "none") == 0) {
        char want[64];
        snprintf(want, sizeof want, "rank %d: POSIX_FD:", g_world - 1);
        rc = expect_error(st, "create", want);
    } else if (strcmp(g_scenario, "nodes") == 0) {
        rc = expect_error(st, "create", "IMEX channel");
    } else if (st != VMMT_OK) {
        printf("rank %d: create: %s\n", g_rank, vmmt_last_error());
        rc = 2;
    } else {
        rc = run_group(g);
    }
    vmmt_group_destroy(g);
    take(&after);
    if (memcmp(&before, &after, sizeof before) != 0) {
        printf("rank %d: left open: fds %d -> %d, allocations %d -> %d, reservations %d -> %d, "
               "mappings %d -> %d\n",
               g_rank, before.fds, after.fds, before.allocs, after.allocs, before.resvs,
               after.resvs, before.maps, after.maps);
        rc = rc ? rc : 1;
    }
    printf("rank %d: %s %s: %s\n", g_rank, adapter, g_scenario, rc == 0 ? "ok" : "FAILED");
    fflush(stdout);
    return rc;
}

int main(int argc, char **argv)
{
    int rc;

    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 6 && strcmp(argv[1], "local") == 0) {
        g_scenario = argv[2];
        g_rank = atoi(argv[3]);
        g_world = atoi(argv[4]);
        return run("local", argv[5], NULL);
    }
#ifdef GROUP_RANK_MPI
    if (argc >= 3 && strcmp(argv[1], "mpi") == 0) {
        MPI_Comm comm = MPI_COMM_WORLD;
        MPI_Init(&argc, &argv);
        MPI_Comm_rank(comm, &g_rank);
        MPI_Comm_size(comm, &g_world);
        g_scenario = argv[2];
        rc = run("mpi", NULL, &comm);
        /* Every rank's verdict decides the job's exit status. */
        int worst = 0;
        MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, comm);
        MPI_Finalize();
        return worst;
    }
#endif
    (void)rc;
    fprintf(stderr,
            "usage: group_rank local SCENARIO RANK WORLD JOB | group_rank_mpi mpi SCENARIO\n");
    return 2;
}
