/*
 * An impostor broker: a process that binds the address a producer used (once
 * the producer is gone) and serves a pool of its own under the producer's
 * pool id, with every ready word set, so that a consumer that trusts any
 * server copies the impostor's bytes (0xEE).
 *
 *   impostor PATH POOL_HEX32 ALLOC_SIZE TABLE_BYTES STRIDE GENERATION UID
 *
 * UID -1 keeps the current user; otherwise the child drops to it (root
 * only). It writes one byte to fd 3 once it listens, then serves until fd 3
 * reaches end-of-file (the test is done) or 20 s pass.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "ctrl.h"
#include "driver.h"
#include "status.h"
#include "testutil.h"
#include "vmm.h"

int main(int argc, char **argv)
{
    struct vmmt__mapping m;
    struct vmmt__ctrl ctrl;
    struct vmmt__broker *b = NULL;
    uint8_t id[16], c;
    int fds[2] = {-1, -1};
    long uid;

    if (argc != 8 || tu_hex_decode(argv[2], id, 16) != 0) {
        fprintf(stderr, "usage: impostor PATH POOL_HEX32 ALLOC TABLE STRIDE GEN UID\n");
        return 2;
    }
    uint64_t alloc = strtoull(argv[3], NULL, 10), table = strtoull(argv[4], NULL, 10);
    uint32_t stride = (uint32_t)strtoul(argv[5], NULL, 10);
    uint32_t gen = (uint32_t)strtoul(argv[6], NULL, 10);
    uid = strtol(argv[7], NULL, 10);
    if (tu_drop_to(uid, "impostor") != 0) return 3;
    tu_use_test_driver();
    const struct vmmt_drv *d = vmmt__drv();
    if (vmmt__ctx_enter(0) != VMMT_OK ||
        vmmt__mapping_create(0, alloc, VMMT_HANDLE_POSIX_FD, 0, &m) != VMMT_OK ||
        d->cuMemsetD8Async(m.base, 0xEE, alloc, NULL) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(NULL) != CUDA_SUCCESS ||
        vmmt__export_posix_fd(m.handle, &fds[0]) != VMMT_OK ||
        vmmt__ctrl_create_shared(table, &ctrl) != VMMT_OK) {
        fprintf(stderr, "impostor: setup failed: %s\n", vmmt_last_error());
        return 4;
    }
    /* Every slot looks published: the consumer finds its ready word set. */
    for (uint64_t off = 0; off + stride <= table; off += stride)
        ctrl.host[off / 4] = gen;
    fds[1] = ctrl.fd;
    uid_t root[] = {0};
    struct vmmt__broker_config cfg = {.path = argv[1], .allowed_uids = root, .allowed_count = 1};
    if (vmmt__broker_start_fds(fds, 2, id, &cfg, &b) != VMMT_OK) {
        fprintf(stderr, "impostor: broker: %s\n", vmmt_last_error());
        return 5;
    }
    alarm(20);
    c = 1;
    if (write(3, &c, 1) != 1) return 6;
    while (read(3, &c, 1) > 0)
        ;
    vmmt__broker_stop(b);
    close(fds[0]);
    vmmt__ctrl_release(&ctrl);
    vmmt__mapping_release(&m);
    vmmt__ctx_leave();
    return 0;
}
