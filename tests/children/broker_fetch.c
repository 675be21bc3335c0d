/*
 * Fetches a pool's fd from a broker in a process of its own, optionally as
 * another user, so tests see what a real consumer sees.
 *
 *   broker_fetch ADDRESS POOL_HEX32 UID write
 *       fetch, then write "written by child" at offset 0 of the fd
 *   broker_fetch ADDRESS POOL_HEX32 UID writen N
 *       fetch N fds at once, then write "written by child I" at offset 0 of fd I
 *   broker_fetch ADDRESS POOL_HEX32 UID hold FIRST COUNT [bye|stay]
 *       fetch with a liveness link, hold ranks [FIRST, FIRST+COUNT), and exit:
 *       without a goodbye (a death), after one with "bye", or with "stay"
 *       only when killed (or after 30 s, so that nothing waits for ever)
 *   broker_fetch ADDRESS POOL_HEX32 UID truncate
 *       fetch the allocation and the control table; resizing the table must
 *       fail (it is sealed): exit 0 when both a shrink and a grow were refused
 *   broker_fetch ADDRESS POOL_HEX32 UID expect STATUS TEXT
 *       the fetch must fail with STATUS and a message containing TEXT
 *
 * UID is -1 to keep the current user; "userns" to enter a user namespace of
 * its own where it is uid 1000, mapped to the current user (exit 77 where
 * user namespaces are refused); otherwise the child drops to it first
 * (which needs root). The broker must be the parent process, running as the
 * child's user before any drop. Exit status 0 means the expectation held.
 */
#include <errno.h>
#include <sched.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "status.h"
#include "testutil.h"

/* The server every fetch must find: the parent, as the user we started as. */
static struct vmmt__broker_peer parent;

static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    int ok = f != NULL && fputs(text, f) >= 0;

    if (f != NULL && fclose(f) != 0) ok = 0;
    if (!ok) perror(path);
    return ok ? 0 : -1;
}

/* Be uid and gid 1000 in a new user namespace, mapped to our own outside it. */
static int enter_userns(void)
{
    char uid_map[32], gid_map[32];

    snprintf(uid_map, sizeof uid_map, "1000 %u 1\n", (unsigned)geteuid());
    snprintf(gid_map, sizeof gid_map, "1000 %u 1\n", (unsigned)getegid());
    if (unshare(CLONE_NEWUSER) != 0) {
        perror("broker_fetch: unshare(CLONE_NEWUSER)");
        return 77;
    }
    if (write_file("/proc/self/setgroups", "deny") != 0 ||
        write_file("/proc/self/uid_map", uid_map) != 0 ||
        write_file("/proc/self/gid_map", gid_map) != 0)
        return 77;
    return 0;
}

static int do_write(const struct vmmt__broker_addr *addr, const uint8_t id[16])
{
    static const char text[] = "written by child";
    int fd = -1;
    int st = vmmt__broker_fetch(addr, id, &parent, 3000, &fd);

    if (st != VMMT_OK) {
        fprintf(stderr, "broker_fetch: %d: %s\n", st, vmmt_last_error());
        return 1;
    }
    if (pwrite(fd, text, sizeof text, 0) != (ssize_t)sizeof text) {
        perror("broker_fetch: pwrite");
        return 1;
    }
    close(fd);
    return 0;
}

static int do_writen(const struct vmmt__broker_addr *addr, const uint8_t id[16], int n)
{
    int fds[VMMT_BROKER_MAX_FDS];
    char text[32];
    int st = vmmt__broker_fetch_fds(addr, id, &parent, 3000, fds, n, NULL), rc = 0;

    if (st != VMMT_OK) {
        fprintf(stderr, "broker_fetch: %d: %s\n", st, vmmt_last_error());
        return 1;
    }
    for (int i = 0; i < n; i++) {
        int len = snprintf(text, sizeof text, "written by child %d", i) + 1;
        if (pwrite(fds[i], text, (size_t)len, 0) != len) {
            perror("broker_fetch: pwrite");
            rc = 1;
        }
        close(fds[i]);
    }
    return rc;
}

enum hold_end { HOLD_DIE, HOLD_BYE, HOLD_STAY };

static int do_hold(const struct vmmt__broker_addr *addr, const uint8_t id[16], int first, int count,
                   enum hold_end end)
{
    struct vmmt__broker_link *link = NULL;
    int fd = -1;
    int st = vmmt__broker_fetch_fds(addr, id, &parent, 3000, &fd, 1, &link);

    if (st == VMMT_OK && link == NULL) st = vmmt__fail(VMMT_ESTATE, "the broker kept no link");
    if (st == VMMT_OK) st = vmmt__broker_link_hold(link, (uint32_t)first, (uint32_t)count);
    if (st != VMMT_OK) {
        fprintf(stderr, "broker_fetch: %d: %s\n", st, vmmt_last_error());
        return 1;
    }
    close(fd);
    /* The parent kills it when it wants the death (a test ordering it against other links). */
    if (end == HOLD_STAY) sleep(30);
    /* Without a goodbye, the link closes when this process exits: a death (and _exit, as
     * abrupt as one, without the leak check of the link left open on purpose). */
    if (end != HOLD_BYE) _exit(0);
    vmmt__broker_link_close(link, 1);
    return 0;
}

static int do_truncate(const struct vmmt__broker_addr *addr, const uint8_t id[16])
{
    int fds[2] = {-1, -1}, rc = 0;
    struct stat st;
    int s = vmmt__broker_fetch_fds(addr, id, &parent, 3000, fds, 2, NULL);

    if (s != VMMT_OK) {
        fprintf(stderr, "broker_fetch: %d: %s\n", s, vmmt_last_error());
        return 1;
    }
    if (fstat(fds[1], &st) != 0) return 1;
    if (ftruncate(fds[1], 0) == 0 || errno != EPERM) {
        fprintf(stderr, "broker_fetch: the control table could be shrunk\n");
        rc = 1;
    }
    if (ftruncate(fds[1], st.st_size * 2) == 0 || errno != EPERM) {
        fprintf(stderr, "broker_fetch: the control table could be grown\n");
        rc = 1;
    }
    /* Put it back as it was, should it have been shrunk, so the parent survives to report. */
    if (rc != 0 && ftruncate(fds[1], st.st_size) != 0) perror("broker_fetch: restoring");
    close(fds[0]);
    close(fds[1]);
    return rc;
}

static int do_expect(const struct vmmt__broker_addr *addr, const uint8_t id[16], int want,
                     const char *text)
{
    int fd = -1;
    int st = vmmt__broker_fetch(addr, id, &parent, 3000, &fd);

    if (st != want || fd != -1 || strstr(vmmt_last_error(), text) == NULL) {
        fprintf(stderr, "broker_fetch: want %d with \"%s\", got %d fd %d: %s\n", want, text, st, fd,
                vmmt_last_error());
        if (fd >= 0) close(fd);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct vmmt__broker_addr addr;
    uint8_t id[16];

    if (argc < 5 || vmmt__broker_addr_parse(argv[1], &addr) != VMMT_OK ||
        tu_hex_decode(argv[2], id, 16) != 0) {
        fprintf(stderr,
                "usage: broker_fetch ADDRESS POOL_HEX32 UID write|writen N|expect STATUS TEXT\n");
        return 2;
    }
    parent.uid = geteuid();
    parent.pid = getppid();
    if (strcmp(argv[3], "userns") == 0) {
        int rc = enter_userns();
        if (rc != 0) return rc;
    } else if (tu_drop_to(strtol(argv[3], NULL, 10), "broker_fetch") != 0) {
        return 3;
    }
    if (strcmp(argv[4], "write") == 0) return do_write(&addr, id);
    if (strcmp(argv[4], "truncate") == 0) return do_truncate(&addr, id);
    if (strcmp(argv[4], "hold") == 0 && (argc == 7 || argc == 8))
        return do_hold(&addr, id, atoi(argv[5]), atoi(argv[6]),
                       argc == 7                      ? HOLD_DIE
                       : strcmp(argv[7], "bye") == 0  ? HOLD_BYE
                       : strcmp(argv[7], "stay") == 0 ? HOLD_STAY
                                                      : HOLD_DIE);
    if (strcmp(argv[4], "writen") == 0 && argc == 6) {
        int n = atoi(argv[5]);
        if (n < 1 || n > VMMT_BROKER_MAX_FDS) {
            fprintf(stderr, "broker_fetch: writen takes 1 to %d\n", VMMT_BROKER_MAX_FDS);
            return 2;
        }
        return do_writen(&addr, id, n);
    }
    if (strcmp(argv[4], "expect") == 0 && argc == 7)
        return do_expect(&addr, id, atoi(argv[5]), argv[6]);
    fprintf(stderr, "broker_fetch: unknown mode %s\n", argv[4]);
    return 2;
}
