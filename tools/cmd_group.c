/*
 * vmmt group-test: a job of N ranks (processes of this program, meeting
 * through the local adapter) registers buffers, some crossing several
 * allocations, and every rank reads every peer's through the group's
 * pointers. Prints the time of the first registration per rank.
 */
#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "group_check.h"
#include "vmmt.h"

#define MAX_RANKS 64

struct gopts {
    int ranks, rank, spread, timeout_ms;
    const char *driver, *job;
    struct gc_opts gc;
};

static const struct cli_opt group_opts_table[] = {
    {"--ranks", CLI_INT, "N", 1, MAX_RANKS, offsetof(struct gopts, ranks),
     "rank processes in the job (default 2)", NULL, NULL, 0},
    {"--buffers", CLI_INT, "K", 1, 4096, offsetof(struct gopts, gc.buffers),
     "buffers each rank registers (default 6)", NULL, NULL, 0},
    {"--chunks", CLI_INT, "C", 2, 64, offsetof(struct gopts, gc.chunks),
     "allocations a multi-allocation buffer crosses (default 3)", NULL, NULL, 0},
    {"--size", CLI_SIZE, "BYTES", 2, 1ull << 30, offsetof(struct gopts, gc.size),
     "bytes per allocation, rounded up to the granularity (default 2M)", NULL, NULL, 0},
    {"--spread", CLI_FLAG, NULL, 0, 0, offsetof(struct gopts, spread),
     "rank r on device r % devices (default: every rank on device 0)", NULL, NULL, 0},
    {"--timeout", CLI_INT, "MS", 1, 3600000, offsetof(struct gopts, timeout_ms),
     "bound of each exchange, in milliseconds (default 30000)", NULL, NULL, 0},
    CLI_DRIVER_OPT(struct gopts),
    /* How the job starts its ranks: this program again, one process per rank. */
    {"--rank", CLI_INT, "R", 0, MAX_RANKS - 1, offsetof(struct gopts, rank), "", NULL, NULL, 1},
    {"--job", CLI_TEXT, "NAME", 0, 0, offsetof(struct gopts, job), "", NULL, NULL, 1},
};

const struct cli_command cli_group_command = {
    "group-test",
    "N ranks map each other's buffers (some crossing C allocations) and read them",
    "N ranks (processes of this program, meeting through the local adapter) register buffers,\n"
    "every third crossing C allocations, with the group exchange, and every rank reads every\n"
    "peer's through the pointers the group returns (docs/group.md).",
    group_opts_table,
    sizeof group_opts_table / sizeof group_opts_table[0],
    "exit status: 0 when every rank read every peer's buffers, 1 on a mismatch, 2 on error.\n",
};

static int parse(int argc, char **argv, struct gopts *o)
{
    int rc;

    o->ranks = 2;
    o->rank = -1;
    o->timeout_ms = 30000;
    o->gc = (struct gc_opts){.buffers = 6, .chunks = 3, .size = 2u << 20, .again = 1};
    if ((rc = cli_parse(&cli_group_command, argc, argv, o)) != CLI_OK) return rc;
    if (o->rank >= o->ranks || (o->rank >= 0) != (o->job != NULL)) {
        fprintf(stderr,
                "vmmt group-test: --rank %d --job %s: the job's own rank processes "
                "pass both, with the rank below --ranks\n",
                o->rank, o->job ? o->job : "(none)");
        return CLI_ERROR;
    }
    return CLI_OK;
}

/* One rank: create the group, run the check, say what happened. */
static int run_rank(struct gopts *o)
{
    vmmt_group_config c;
    struct gc_result res;
    vmmt_group *g;
    int devices = 1, rc;

    if (cli_select_driver(o->driver) != CLI_OK) return CLI_ERROR;
    vmmt_device_count(&devices);
    vmmt_group_config_init(&c);
    c.rank = o->rank;
    c.world_size = o->ranks;
    c.device = o->spread && devices > 0 ? o->rank % devices : 0;
    c.timeout_ms = o->timeout_ms;
    if (vmmt_group_create_local(&c, o->job, &g) != VMMT_OK) {
        printf("rank %d: %s\n", o->rank, vmmt_last_error());
        return CLI_ERROR;
    }
    rc = gc_run(g, &o->gc, stdout, &res);
    if (rc == 0)
        printf("rank %d: ok on device %d (%s): read %llu bytes of %d peers' %d buffers; "
               "registered %d buffers (%zu peer allocations) in %.2f ms\n",
               o->rank, c.device, vmmt_handle_type_name(vmmt_group_handle_type(g)),
               (unsigned long long)res.checked, o->ranks - 1, o->gc.buffers, o->gc.buffers,
               res.peer_allocations, res.register_ms);
    vmmt_group_destroy(g);
    fflush(stdout);
    return rc == 0 ? CLI_OK : rc == 1 ? CLI_FAIL : CLI_ERROR;
}

static pid_t spawn(const struct gopts *o, int rank, const char *job)
{
    char exe[4096], r[16], n[16], k[16], ch[16], sz[32], to[16];
    char *args[24];
    int a = 0;
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    pid_t pid;

    if (len <= 0) return -1;
    exe[len] = '\0';
    snprintf(r, sizeof r, "%d", rank);
    snprintf(n, sizeof n, "%d", o->ranks);
    snprintf(k, sizeof k, "%d", o->gc.buffers);
    snprintf(ch, sizeof ch, "%d", o->gc.chunks);
    snprintf(sz, sizeof sz, "%llu", (unsigned long long)o->gc.size);
    snprintf(to, sizeof to, "%d", o->timeout_ms);
    args[a++] = "vmmt";
    args[a++] = "group-test";
    args[a++] = "--rank", args[a++] = r;
    args[a++] = "--ranks", args[a++] = n;
    args[a++] = "--buffers", args[a++] = k;
    args[a++] = "--chunks", args[a++] = ch;
    args[a++] = "--size", args[a++] = sz;
    args[a++] = "--timeout", args[a++] = to;
    args[a++] = "--job", args[a++] = (char *)job;
    if (o->driver) args[a++] = "--driver", args[a++] = (char *)o->driver;
    if (o->spread) args[a++] = "--spread";
    args[a] = NULL;
    if ((pid = fork()) == 0) {
        execv(exe, args);
        _exit(127);
    }
    return pid;
}

/* Wait for every rank, at most timeout_ms in all; ranks still running then are killed. */
static int wait_ranks(pid_t *pids, int n, int timeout_ms, int *worst)
{
    struct timespec t0, now, nap = {0, 10 * 1000000L};
    int left = n;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (left > 0) {
        int status;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            for (int i = 0; i < n; i++)
                if (pids[i] == p) {
                    int code = WIFEXITED(status) ? WEXITSTATUS(status) : CLI_ERROR;
                    if (code > *worst) *worst = code;
                    pids[i] = -1;
                    left--;
                }
            continue;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000 > timeout_ms) {
            for (int i = 0; i < n; i++)
                if (pids[i] > 0) {
                    kill(pids[i], SIGKILL);
                    waitpid(pids[i], NULL, 0);
                    printf("rank %d: killed after %d ms\n", i, timeout_ms);
                }
            *worst = CLI_ERROR;
            return -1;
        }
        nanosleep(&nap, NULL);
    }
    return 0;
}

int cmd_group(int argc, char **argv)
{
    struct gopts o = {0};
    pid_t pids[MAX_RANKS];
    char job[64];
    int worst = 0;

    if ((worst = parse(argc, argv, &o)) != CLI_OK) return worst == CLI_HELP ? CLI_OK : CLI_ERROR;
    if (o.rank >= 0) return run_rank(&o);
    if (cli_open_driver("group-test", o.driver, stdout) != CLI_OK) return CLI_ERROR;
    /* The ranks load the driver this process found (auto resolved; a path kept). */
    if (o.driver == NULL || strchr(o.driver, '/') == NULL) o.driver = vmmt_driver_name();
    snprintf(job, sizeof job, "group-test-%d", (int)getpid());
    printf("vmmt group-test: %d ranks, %d buffers each (every third crosses %d allocations), "
           "%llu bytes per allocation\n",
           o.ranks, o.gc.buffers, o.gc.chunks, (unsigned long long)o.gc.size);
    fflush(stdout);
    for (int i = 0; i < o.ranks; i++)
        if ((pids[i] = spawn(&o, i, job)) < 0) {
            printf("vmmt group-test: cannot start rank %d: %s\n", i, strerror(errno));
            o.ranks = i;
            worst = CLI_ERROR;
            break;
        }
    wait_ranks(pids, o.ranks, 3 * o.timeout_ms + 30000, &worst);
    printf("vmmt group-test: %s\n",
           worst == 0 ? "every rank read every peer's buffers correctly" : "FAILED");
    return worst;
}
