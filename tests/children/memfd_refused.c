/*
 * A producer where memfd_create is refused, as a container's seccomp profile
 * may refuse it, for test_pool's memfd test. usage: memfd_refused
 * device|host|elastic. Installs a seccomp filter that makes memfd_create
 * fail with ENOSYS when vmmt calls it (the real syscall, refused by the
 * kernel), then creates a pool of that kind for one consumer; a device pool
 * that was made is round-tripped through a consumer in this process. Writes
 * to fd 3 one line "STATUS HOST_TABLE ROUNDTRIP WARNINGS" and then the
 * message: the memfd warning logged when the pool was made, else the
 * create's error. Exits 0 once the report is written, 77 when this kernel
 * takes no seccomp filter, else prints why and exits 1.
 */
#include <errno.h>
#include <link.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "driver.h"
#include "pattern.h"
#include "testutil.h"

#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#endif

#define NBYTES 4096

static struct {
    int warnings;
    char text[2048];
} g_log;

static void on_log(vmmt_log_level level, const char *msg, void *user)
{
    (void)user;
    if (level > VMMT_LOG_WARN || strstr(msg, "memfd_create") == NULL) return;
    g_log.warnings++;
    snprintf(g_log.text, sizeof g_log.text, "%s", msg);
}

struct image {
    uintptr_t want; /* an address inside the object sought */
    uintptr_t lo, hi;
};

static int find_image(struct dl_phdr_info *info, size_t size, void *arg)
{
    struct image *im = arg;
    uintptr_t lo = UINTPTR_MAX, hi = 0;

    (void)size;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        if (info->dlpi_addr + ph->p_vaddr < lo) lo = info->dlpi_addr + ph->p_vaddr;
        if (info->dlpi_addr + ph->p_vaddr + ph->p_memsz > hi)
            hi = info->dlpi_addr + ph->p_vaddr + ph->p_memsz;
    }
    if (im->want < lo || im->want >= hi) return 0;
    im->lo = lo;
    im->hi = hi;
    return 1;
}

#define LD(field) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (uint32_t)offsetof(struct seccomp_data, field))
#define ARG0_LO   BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (uint32_t)offsetof(struct seccomp_data, args[0]))
#define ARG0_HI                                                                                    \
    BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (uint32_t)offsetof(struct seccomp_data, args[0]) + 4)

/*
 * Refuse memfd_create (ENOSYS) to callers whose name argument lies in the
 * image holding vmmt: the emulated driver's allocations are memfds too,
 * standing in for device memory that a real driver makes through its own
 * ioctls, and must go on working. 0, -1 (the kernel refuses filters), or 1.
 */
static int refuse_memfd_to_vmmt(void)
{
#if defined(NATIVE_ARCH) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    struct image im = {.want = (uintptr_t)&vmmt_pool_create_size};
    uint64_t lo, last;

    if (dl_iterate_phdr(find_image, &im) != 1) return 1;
    lo = im.lo;
    last = im.hi - 1;
    /* The name pointer p is vmmt's when lo <= p <= last, compared as 32-bit halves. */
    struct sock_filter f[] = {
        /* 0 */ LD(arch),
        /* 1 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_ARCH, 0, 13),
        /* 2 */ LD(nr),
        /* 3 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_memfd_create, 0, 11),
        /* 4 */ ARG0_HI,
        /* 5 */ BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (uint32_t)(lo >> 32), 3, 0),
        /* 6 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)(lo >> 32), 0, 8),
        /* 7 */ ARG0_LO,
        /* 8 */ BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, (uint32_t)lo, 0, 6),
        /* 9 */ ARG0_HI,
        /* 10 */ BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (uint32_t)(last >> 32), 4, 0),
        /* 11 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (uint32_t)(last >> 32), 0, 2),
        /* 12 */ ARG0_LO,
        /* 13 */ BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (uint32_t)last, 1, 0),
        /* 14 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
        /* 15 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};

    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) return -1;
    return 0;
#else
    return -1;
#endif
}

/* Publish NBYTES of pattern 1 from host memory, consume them to the device and read them back. */
static int roundtrip(vmmt_pool *pool)
{
    const struct vmmt_drv *d = vmmt__drv();
    uint8_t src[NBYTES], back[NBYTES];
    vmmt_consumer *consumer = NULL;
    vmmt_buffer b;
    vmmt_desc desc;
    uint64_t dst = 0;
    int ok = 0;

    tu_pattern_fill(src, sizeof src, 1);
    memset(&b, 0, sizeof b);
    b.ptr = (uint64_t)(uintptr_t)src;
    b.nbytes = sizeof src;
    b.location = VMMT_LOC_HOST;
    if (vmmt_consumer_create(NULL, &consumer) != VMMT_OK ||
        vmmt_mem_alloc(0, sizeof back, &dst) != VMMT_OK ||
        vmmt_publish(pool, &b, NULL, &desc) != VMMT_OK ||
        vmmt_consume(consumer, &desc, 0, dst, sizeof back, NULL, VMMT_ALL_RANKS, 0) != VMMT_OK ||
        vmmt_mem_copy(0, (uint64_t)(uintptr_t)back, dst, sizeof back, NULL) != VMMT_OK ||
        vmmt__ctx_enter(0) != VMMT_OK)
        goto out;
    ok = d->cuStreamSynchronize(NULL) == CUDA_SUCCESS &&
         tu_pattern_check(back, sizeof back, 1) == sizeof back;
    vmmt__ctx_leave();
    ok = ok && vmmt_pool_drain(pool, 5000) == VMMT_OK;
out:
    if (!ok) fprintf(stderr, "memfd_refused: round trip failed: %s\n", vmmt_last_error());
    vmmt_mem_free(0, dst);
    vmmt_consumer_destroy(consumer);
    return ok;
}

int main(int argc, char **argv)
{
    vmmt_pool_config c;
    vmmt_pool_stats s;
    vmmt_pool *pool = NULL;
    int st, rt = 0, filter;
    FILE *out;

    if (argc < 2) return 2;
    tu_use_test_driver();
    vmmt_set_log(on_log, NULL);
    vmmt_pool_config_init(&c);
    c.memory_size = 8ull << 20;
    c.consumer_count = 1;
    c.max_slices = 16;
    c.memory_location = strcmp(argv[1], "host") == 0 ? VMMT_MEMORY_HOST : VMMT_MEMORY_DEVICE;
    c.elastic = strcmp(argv[1], "elastic") == 0;
    filter = refuse_memfd_to_vmmt();
    if (filter < 0) return 77;
    if (filter > 0) {
        fprintf(stderr, "memfd_refused: vmmt's image not found\n");
        return 1;
    }
    memset(&s, 0, sizeof s);
    st = vmmt_pool_create(&c, &pool);
    if (st == VMMT_OK && vmmt_pool_get_stats(pool, &s) == VMMT_OK) rt = roundtrip(pool);
    out = fdopen(3, "w");
    if (out == NULL) return 1;
    fprintf(out, "%d %d %d %d\n%s\n", st, s.host_control_table, rt, g_log.warnings,
            st == VMMT_OK ? g_log.text : vmmt_last_error());
    vmmt_pool_destroy(pool);
    return fclose(out) == 0 ? 0 : 1;
}
