/*
 * Second process of the import test: receives the producer's fd as fd 3 (or
 * a FABRIC handle as hex in argv[2]), imports and maps it, checks the
 * pattern the parent wrote, then writes its own for the parent to check.
 * usage: child_import posix_fd|fabric SIZE [HEX] ; exit 0 when all matched.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "driver.h"
#include "testutil.h"
#include "vmm.h"

static int check_and_write(struct vmmt__mapping *m)
{
    const struct vmmt_drv *d = vmmt__drv();
    size_t n = 4096;
    unsigned char *buf = malloc(n);
    int ok = 1;

    vmmt__ctx_enter(0);
    if (d->cuMemcpyDtoHAsync(buf, m->base, n, NULL) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(NULL) != CUDA_SUCCESS)
        ok = 0;
    for (size_t i = 0; ok && i < n; i++)
        if (buf[i] != (unsigned char)(i * 7 + 1)) {
            fprintf(stderr, "child: byte %zu is %u, expected %u\n", i, buf[i],
                    (unsigned char)(i * 7 + 1));
            ok = 0;
        }
    for (size_t i = 0; i < n; i++)
        buf[i] = (unsigned char)(i * 3 + 5);
    if (ok && (d->cuMemcpyHtoDAsync(m->base, buf, n, NULL) != CUDA_SUCCESS ||
               d->cuStreamSynchronize(NULL) != CUDA_SUCCESS))
        ok = 0;
    vmmt__ctx_leave();
    free(buf);
    return ok;
}

static int hex_to_fabric(const char *hex, CUmemFabricHandle *f)
{
    if (strlen(hex) != 2 * sizeof f->data) return 0;
    for (size_t i = 0; i < sizeof f->data; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return 0;
        f->data[i] = (unsigned char)v;
    }
    return 1;
}

int main(int argc, char **argv)
{
    struct vmmt__mapping m;
    CUmemFabricHandle fabric;
    uint64_t size;
    int st, ok;

    if (argc < 3) return 2;
    tu_use_test_driver();
    size = strtoull(argv[2], NULL, 10);
    if (strcmp(argv[1], "fabric") == 0) {
        if (argc < 4 || !hex_to_fabric(argv[3], &fabric)) return 2;
        st = vmmt__mapping_import_fabric(0, &fabric, size, &m);
    } else {
        st = vmmt__mapping_import_posix_fd(0, 3, size, &m);
        close(3);
    }
    if (st != VMMT_OK) {
        fprintf(stderr, "child: import failed: %s\n", vmmt_last_error());
        return 3;
    }
    ok = check_and_write(&m);
    if (vmmt__mapping_release(&m) != VMMT_OK) {
        fprintf(stderr, "child: release failed: %s\n", vmmt_last_error());
        return 4;
    }
    return ok ? 0 : 1;
}
