#include "testutil.h"

#include <dirent.h>
#include <malloc.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "emu.h"

int tu_count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    int n = 0;

    if (d == NULL) return -1;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory stream's own descriptor */
}

#if defined(__SANITIZE_ADDRESS__)
/*
 * AddressSanitizer's allocator maps a region per size class on first use and
 * keeps it: that is no leak of the code under test, so its space is not counted
 * (x86-64 layout of compiler-rt's primary allocator).
 */
static int sanitizer_region(unsigned long start)
{
    return start >= 0x600000000000UL && start < 0x640000000000UL;
}
#else
static int sanitizer_region(unsigned long start)
{
    (void)start;
    return 0;
}
#endif

int tu_count_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;

    if (f == NULL) return -1;
    while (fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        if (!sanitizer_region(strtoul(line, NULL, 16))) n++;
        /* A line longer than the buffer (a long path) is still one mapping. */
        while (len > 0 && line[len - 1] != '\n' && fgets(line, sizeof line, f))
            len = strlen(line);
    }
    fclose(f);
    return n;
}

int tu_count_threads(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;

    if (f == NULL) return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    fclose(f);
    return n;
}

void tu_resources_take(tu_resources *r)
{
    r->fds = tu_count_fds();
    r->maps = tu_count_maps();
    r->threads = tu_count_threads();
}

/*
 * The real driver maps memory of its own lazily (first stream wait, new
 * stream pools), so host mapping counts are exact only on the emulator, or
 * in tests that use no driver at all.
 */
static int g_maps_exact = 1;

void tu_resources_check_(const tu_resources *before, const char *file, int line)
{
    tu_resources now;
    int maps_differ;

    /* Threads being joined may take a moment to leave /proc. */
    for (int i = 0; i < 200; i++) {
        tu_resources_take(&now);
        if (now.threads <= before->threads) break;
        usleep(1000);
    }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    /* ASan keeps freed large blocks mapped in its quarantine, and TSan maps
     * shadow memory as it goes, so mapping counts mean nothing there; the
     * ordinary build checks them, and the emulator's own counters check
     * device mappings in every build. */
    maps_differ = 0;
#else
    maps_differ = now.maps != before->maps && g_maps_exact;
#endif
    /* Print first: _fail does not return. Fewer threads than before is no leak: a
     * thread of an earlier test (an acknowledgement thread being joined) that was
     * still leaving /proc when `before` was taken (clang's CI build: 2 -> 1). */
    if (now.fds != before->fds || maps_differ || now.threads > before->threads) {
        print_error("leak: fds %d -> %d, mappings %d -> %d, threads %d -> %d\n", before->fds,
                    now.fds, before->maps, now.maps, before->threads, now.threads);
        _fail(file, line);
    }
}

static void *idle(void *arg)
{
    return arg;
}

/*
 * glibc keeps the stacks of finished threads and gives each new thread its
 * own malloc arena; neither is a leak, but both add mappings the first time.
 * One arena, and eight stacks cached up front, keep the leak counts exact.
 */
static void steady_process_state(void)
{
    pthread_t t[8];

    mallopt(M_ARENA_MAX, 1);
    for (int i = 0; i < 8; i++)
        pthread_create(&t[i], NULL, idle, NULL);
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
}

void tu_use_test_driver(void)
{
    /* VMMT_TEST_FILTER=pattern runs only the matching tests (cmocka's glob). */
    if (getenv("VMMT_TEST_FILTER") != NULL) cmocka_set_test_filter(getenv("VMMT_TEST_FILTER"));
    steady_process_state();
    const char *d = getenv("VMMT_TEST_DRIVER");
    if (d == NULL || *d == '\0') d = "emu";
    /* The emulator this build made, for this process and the children it starts
     * (they live in tests/, not beside the library); tu_run_tool unsets it for
     * the tool, which must find it on its own. */
    setenv("VMMT_EMU_LIBRARY", VMMT_TEST_EMU_LIBRARY, 0);
    if (vmmt_driver_select(d) != VMMT_OK) {
        fprintf(stderr, "cannot select driver %s: %s\n", d, vmmt_last_error());
        exit(1);
    }
    if (strcmp(d, "emu") == 0) vmmt__emu_configure();
    g_maps_exact = strcmp(d, "emu") == 0;
}

const char *tu_child_path(const char *name, char *buf, size_t cap)
{
    const char *dir = getenv("VMMT_TEST_CHILD_DIR");
    if (dir == NULL) dir = VMMT_TEST_CHILD_DIR;
    snprintf(buf, cap, "%s/%s", dir, name);
    return buf;
}

int tu_drop_to(long uid, const char *who)
{
    const char *lib = getenv("VMMT_EMU_LIBRARY");
    char fd_path[32];
    int fd;

    if (uid < 0) return 0;
    if (lib == NULL || *lib == '\0') lib = VMMT_TEST_EMU_LIBRARY;
    /* Kept open for the process's life: the driver is loaded at its first use. A file
     * that does not open is left to fail, with the loader's message, where it is loaded. */
    fd = open(lib, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        snprintf(fd_path, sizeof fd_path, "/proc/self/fd/%d", fd);
        setenv("VMMT_EMU_LIBRARY", fd_path, 1);
    }
    if (setgroups(0, NULL) != 0 || setgid((gid_t)uid) != 0 || setuid((uid_t)uid) != 0) {
        fprintf(stderr, "%s: dropping privileges to uid %ld: %s\n", who, uid, strerror(errno));
        return -1;
    }
    return 0;
}

int tu_hex_decode(const char *hex, uint8_t *out, size_t n)
{
    if (hex == NULL || strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        out[i] = (uint8_t)v;
    }
    return 0;
}

pid_t tu_spawn(const char *name, char *const argv[], int extra_fd)
{
    char path[4096];
    char *args[32];
    int n = 0;
    pid_t pid;

    tu_child_path(name, path, sizeof path);
    args[n++] = path;
    for (int i = 0; argv != NULL && argv[i] != NULL && n < 31; i++)
        args[n++] = argv[i];
    args[n] = NULL;
    pid = fork();
    if (pid == 0) {
        if (extra_fd >= 0 && extra_fd != 3) {
            if (dup2(extra_fd, 3) < 0) _exit(126);
        }
        if (extra_fd == 3) fcntl(3, F_SETFD, 0);
        execv(path, args);
        _exit(127);
    }
    return pid;
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#if defined(__x86_64__)
#define TU_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define TU_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

int tu_refuse_pidfds(int also_peerpidfd)
{
#ifdef TU_AUDIT_ARCH
    /* Another architecture's calls are let through: its numbers mean other calls. */
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TU_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_pidfd_open, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_getsockopt, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SO_PEERPIDFD, 0, 1),
        BPF_STMT(BPF_RET | BPF_K,
                 also_peerpidfd ? SECCOMP_RET_ERRNO | ENOPROTOOPT : SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};

    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
#else
    (void)also_peerpidfd;
    errno = ENOSYS;
    return -1;
#endif
}

int tu_wait(pid_t pid, int timeout_ms)
{
    struct timespec ts = {0, 1000000};
    int status;

    for (int waited = 0; waited < timeout_ms; waited++) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        if (r < 0 && errno != EINTR) return -1;
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

int tu_run_tool(const char *const env[], const char *const args[], char *out, size_t cap)
{
    const char *tool = getenv("VMMT_TEST_TOOL");
    char *argv[24];
    int pipefd[2], status, n = 0;
    size_t len = 0;
    ssize_t got;
    pid_t pid;

    assert_non_null(tool);
    argv[n++] = (char *)tool;
    for (int i = 0; args[i] != NULL && n < 23; i++)
        argv[n++] = (char *)args[i];
    argv[n] = NULL;
    assert_int_equal(pipe(pipefd), 0);
    pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 1);
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        /* The checks expect the emulator's defaults unless env says otherwise. */
        unsetenv("VMMT_DRIVER");
        unsetenv("VMMT_EMU_HANDLES");
        unsetenv("VMMT_HANDLE_TYPE");
        unsetenv("VMMT_EMU_DEVICES");
        /* The tool finds libvmmt_emu.so beside itself, as an installed one must. */
        unsetenv("VMMT_EMU_LIBRARY");
        for (int i = 0; env != NULL && env[i] != NULL; i++)
            putenv((char *)env[i]);
        execv(tool, argv);
        _exit(127);
    }
    close(pipefd[1]);
    while (len + 1 < cap && (got = read(pipefd[0], out + len, cap - 1 - len)) > 0)
        len += (size_t)got;
    out[len] = '\0';
    close(pipefd[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static _Thread_local uint64_t tu_rng = 0x9e3779b97f4a7c15ull;

void tu_rand_seed(uint64_t seed)
{
    tu_rng = seed != 0 ? seed : 0x9e3779b97f4a7c15ull;
}

uint64_t tu_rand(void)
{
    tu_rng ^= tu_rng << 13;
    tu_rng ^= tu_rng >> 7;
    tu_rng ^= tu_rng << 17;
    return tu_rng;
}
