/*
 * The handle-type vote of a group. Every rank runs it on the same
 * all-gathered bytes, so every rank reaches the same answer, and on failure
 * prints the same message: nobody is left guessing which rank broke the job.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "group_internal.h"
#include "status.h"
#include "vmm.h"

void vmmt__group_node_name(char *buf, size_t cap)
{
    const char *env = getenv("VMMT_GROUP_NODE");
    char host[64] = "?", boot[40] = "";
    FILE *f;

    if (env != NULL && *env != '\0') {
        snprintf(buf, cap, "%s", env);
        return;
    }
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    /*
     * Containers on different machines may share a host name; the boot id
     * tells machines apart, and is the same for every container of one.
     */
    if ((f = fopen("/proc/sys/kernel/random/boot_id", "r")) != NULL) {
        if (fgets(boot, sizeof boot, f) == NULL) boot[0] = '\0';
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    snprintf(buf, cap, "%s/%.8s", host, boot);
}

static int check_hellos(const struct vmmt__group_hello *h, int world)
{
    for (int r = 0; r < world; r++) {
        if (memcmp(h[r].magic, "VMMTGRP1", 8) != 0 || h[r].version != 1)
            return vmmt__fail(VMMT_EPROTO,
                              "rank %d's group hello is not a vmmt version-1 hello; run the same "
                              "vmmt build on every rank",
                              r);
        if (h[r].rank != r)
            return vmmt__fail(VMMT_EINVAL,
                              "the collective put rank %d's hello in slot %d; two processes "
                              "claim one rank, or the ranks given do not match the collective's",
                              (int)h[r].rank, r);
        if (h[r].world != world)
            return vmmt__fail(VMMT_EINVAL,
                              "rank %d says world_size=%d, rank 0 says %d; give every rank the "
                              "same world size",
                              r, (int)h[r].world, world);
    }
    return VMMT_OK;
}

/*
 * Append " rank r: <what><cause>;" to msg (cap bytes) without overflowing.
 * A cause is a peer's bytes: printed up to its field's end, NUL or not.
 */
static void add(char *msg, size_t cap, int r, const char *what, const char *cause)
{
    size_t n = strlen(msg);

    if (n + 1 < cap)
        snprintf(msg + n, cap - n, " rank %d: %s%.*s;", r, what, VMMT__GROUP_CAUSE_LEN, cause);
}

/* A peer's node name for "%.*s": its field's bytes up to a NUL or the field's end. */
#define NODE(field) VMMT__GROUP_NODE_LEN, (field)

static int all_one_node(const struct vmmt__group_hello *h, int world, int *other)
{
    for (int r = 1; r < world; r++)
        if (strncmp(h[r].node, h[0].node, sizeof h[0].node) != 0) return *other = r, 0;
    return 1;
}

/* Every rank must agree with an insisted type; a rank that insists binds everyone. */
static int requested_type(const struct vmmt__group_hello *h, int world, vmmt_handle_type *out)
{
    int who = -1;

    *out = VMMT_HANDLE_AUTO;
    for (int r = 0; r < world; r++) {
        if (h[r].requested == VMMT_HANDLE_AUTO) continue;
        if (who >= 0 && h[r].requested != h[who].requested)
            return vmmt__fail(VMMT_EINVAL,
                              "rank %d asks for handle type %s and rank %d for %s; ask for the "
                              "same type on every rank, or for auto",
                              who, vmmt__handle_type_upper((vmmt_handle_type)h[who].requested), r,
                              vmmt__handle_type_upper((vmmt_handle_type)h[r].requested));
        who = r;
        *out = (vmmt_handle_type)h[r].requested;
    }
    return VMMT_OK;
}

int vmmt__group_vote(const struct vmmt__group_hello *h, int world, vmmt_handle_type *out)
{
    char msg[900] = "";
    int st, other = 0, fabric_all = 1, posix_all = 1, one_node;
    vmmt_handle_type want;

    if ((st = check_hellos(h, world)) != VMMT_OK) return st;
    if ((st = requested_type(h, world, &want)) != VMMT_OK) return st;
    for (int r = 0; r < world; r++) {
        fabric_all &= h[r].fabric_ok != 0;
        posix_all &= h[r].posix_ok != 0;
    }
    one_node = all_one_node(h, world, &other);
    if (fabric_all && want != VMMT_HANDLE_POSIX_FD) return *out = VMMT_HANDLE_FABRIC, VMMT_OK;
    if (!one_node && want != VMMT_HANDLE_POSIX_FD) {
        snprintf(
            msg, sizeof msg,
            "ranks 0 and %d are on different nodes (%.*s, %.*s) and FABRIC handles do not work "
            "on every rank; POSIX descriptors cannot cross nodes. Give every rank an IMEX "
            "channel (" VMMT__IMEX_CHANNELS "/channelN, from the nvidia-imex service) so "
            "that FABRIC works.",
            other, NODE(h[0].node), NODE(h[other].node));
        for (int r = 0; r < world; r++)
            if (!h[r].fabric_ok) add(msg, sizeof msg, r, "FABRIC: ", h[r].fabric_cause);
        return vmmt__fail(VMMT_ENOTSUP, "%s", msg);
    }
    if (!one_node)
        return vmmt__fail(VMMT_ENOTSUP,
                          "POSIX_FD was asked for, but ranks 0 and %d are on different nodes "
                          "(%.*s, %.*s) and descriptors cannot cross nodes; use FABRIC (an IMEX "
                          "channel on every rank) or auto",
                          other, NODE(h[0].node), NODE(h[other].node));
    if (want == VMMT_HANDLE_FABRIC) {
        snprintf(msg, sizeof msg, "FABRIC was asked for but does not work on every rank:");
        for (int r = 0; r < world; r++)
            if (!h[r].fabric_ok) add(msg, sizeof msg, r, "", h[r].fabric_cause);
        return vmmt__fail(VMMT_ENOTSUP, "%s use auto to fall back to POSIX_FD", msg);
    }
    if (posix_all) return *out = VMMT_HANDLE_POSIX_FD, VMMT_OK;
    snprintf(msg, sizeof msg,
             "no shareable CUDA VMM handle type works on every rank (FABRIC on all, or POSIX_FD "
             "on all):");
    for (int r = 0; r < world; r++) {
        if (h[r].posix_ok) continue;
        add(msg, sizeof msg, r, "POSIX_FD: ", h[r].posix_cause);
        if (!h[r].fabric_ok) add(msg, sizeof msg, r, "FABRIC: ", h[r].fabric_cause);
    }
    return vmmt__fail(VMMT_ENOTSUP, "%s", msg);
}
