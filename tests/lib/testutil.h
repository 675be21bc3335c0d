/*
 * Helpers shared by the tests: resource counters for leak checks, and
 * starting helper programs as separate processes (fork, then exec).
 */
#ifndef VMMT_TESTUTIL_H
#define VMMT_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <cmocka.h>

#include "vmmt.h"

/* Open file descriptors of this process (entries of /proc/self/fd). */
int tu_count_fds(void);

/* Lines of /proc/self/maps: every mapping the process holds. */
int tu_count_maps(void);

/* Threads of this process (Threads: in /proc/self/status). */
int tu_count_threads(void);

/* A snapshot of the three counters, and a check that they are back. */
typedef struct {
    int fds, maps, threads;
} tu_resources;
void tu_resources_take(tu_resources *r);
#define tu_resources_check(before) tu_resources_check_(before, __FILE__, __LINE__)
void tu_resources_check_(const tu_resources *before, const char *file, int line);

/*
 * Select the driver for the test process from VMMT_TEST_DRIVER (default emu)
 * and reset the emulator's settings from the environment. Call in group setup.
 */
void tu_use_test_driver(void);

/*
 * A child started as root becomes uid (uid < 0: stays as it is), first
 * opening the emulated driver so that it can still load it as the other
 * uid: the build may sit under a directory only root can enter (a private
 * 0700 checkout), where the other uid could not open libvmmt_emu.so by its
 * path. The process loads the same file through its own descriptor
 * (VMMT_EMU_LIBRARY=/proc/self/fd/N); what it makes with the driver
 * (allocations, exported fds, a broker) it still makes as the other uid.
 * who names the child in the message. 0, or -1 with the reason printed.
 */
int tu_drop_to(long uid, const char *who);

/* n bytes from 2n hex digits (a pool id on a child's command line); 0 on success, -1 if not. */
int tu_hex_decode(const char *hex, uint8_t *out, size_t n);

/* Path of a helper program built from tests/children/<name>.c. */
const char *tu_child_path(const char *name, char *buf, size_t cap);

/*
 * Start tests/children/<name> with argv (NULL-terminated, without argv[0]);
 * extra_fd, if >= 0, is passed on as fd 3. Returns the pid.
 */
pid_t tu_spawn(const char *name, char *const argv[], int extra_fd);

/*
 * Refuse pidfds to this process and the processes it starts from now on
 * (seccomp, irrevocable): pidfd_open fails with EPERM, as under a container
 * profile that does not know it, and with also_peerpidfd getsockopt
 * SO_PEERPIDFD fails with ENOPROTOOPT, as before Linux 6.5. 0 on success,
 * -1 with errno.
 */
int tu_refuse_pidfds(int also_peerpidfd);

/* Wait for pid at most timeout_ms; returns its exit status, or -1 on a
 * signal or timeout (the child is killed then). */
int tu_wait(pid_t pid, int timeout_ms);

/*
 * Run the vmmt tool ($VMMT_TEST_TOOL) with args (NULL-terminated) and extra
 * "K=V" environment entries (NULL or NULL-terminated), in a clean emulator
 * environment; its stdout and stderr go to out (cap bytes, NUL-terminated).
 * Returns its exit code, or -1 if it died.
 */
int tu_run_tool(const char *const env[], const char *const args[], char *out, size_t cap);

/*
 * A small deterministic generator (xorshift64) for property tests, so that a
 * failing sequence replays from its seed. The seed must not be 0.
 */
void tu_rand_seed(uint64_t seed);
uint64_t tu_rand(void);

/* assert_int_equal with the library's message printed when it fails. */
#define assert_vmmt_ok(expr)                                                                       \
    do {                                                                                           \
        int tu_st_ = (expr);                                                                       \
        if (tu_st_ != VMMT_OK)                                                                     \
            print_error("%s -> %d (%s): %s\n", #expr, tu_st_, vmmt_strerror(tu_st_),               \
                        vmmt_last_error());                                                        \
        assert_int_equal(tu_st_, VMMT_OK);                                                         \
    } while (0)

/* Check that the thread's last message contains text. */
#define assert_error_contains(text)                                                                \
    do {                                                                                           \
        if (strstr(vmmt_last_error(), (text)) == NULL)                                             \
            fail_msg("message lacks \"%s\": %s", (text), vmmt_last_error());                       \
    } while (0)

#endif
