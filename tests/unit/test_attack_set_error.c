/* Outside attacks on vmmt_set_error and the MPI adapter's refusal messages (public API only). */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "poolfix.h"
#include "testutil.h"

#define CAP 4096 /* "truncated at 4 KiB" */

/* NULL, empty, printf conversions as text; odd statuses kept as given, strerror non-empty. */
static void test_null_empty_and_conversions(void **state)
{
    (void)state;
    assert_int_equal(vmmt_set_error(VMMT_EINVAL, NULL), VMMT_EINVAL);
    assert_string_equal(vmmt_last_error(), "no message given");
    assert_int_equal(vmmt_set_error(VMMT_ESYS, ""), VMMT_ESYS);
    assert_int_equal(vmmt_last_status(), VMMT_ESYS);
    assert_string_equal(vmmt_last_error(), "no message given"); /* "" reads as nothing failed */
    assert_int_equal(vmmt_set_error(VMMT_EPROTO, "%s%s%s%n%n %x %p %%"), VMMT_EPROTO);
    assert_string_equal(vmmt_last_error(), "%s%s%s%n%n %x %p %%");
    int odd[] = {VMMT_OK, 1, 42, INT_MAX, INT_MIN, -16, -1000};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        assert_int_equal(vmmt_set_error(odd[i], "odd"), odd[i]);
        assert_int_equal(vmmt_last_status(), odd[i]);
        assert_true(vmmt_strerror(odd[i]) != NULL && vmmt_strerror(odd[i])[0] != '\0');
    }
}

/* Lengths around 4 KiB: a C string, a prefix of the input, whole when it fits with its NUL. */
static void test_boundary_lengths(void **state)
{
    static char m[100001];
    size_t lens[] = {1, 4094, 4095, 4096, 4097, 8191, 100000}; /* 0: "" reads as NULL */
    (void)state;
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        size_t n = lens[i];
        memset(m, 'a' + (int)i, n);
        m[n] = '\0';
        assert_int_equal(vmmt_set_error(VMMT_EINVAL, m), VMMT_EINVAL);
        size_t got = strlen(vmmt_last_error());
        assert_true(got <= CAP && got <= n && (n >= CAP || got == n));
        assert_memory_equal(vmmt_last_error(), m, got);
    }
}

static int utf8_valid(const unsigned char *s)
{
    for (; *s; s++) {
        int k = (*s >= 0xC0) + (*s >= 0xE0) + (*s >= 0xF0);
        if ((*s & 0xC0) == 0x80 || *s >= 0xF8) return 0;
        for (; k > 0; k--)
            if ((*++s & 0xC0) != 0x80) return 0; /* a NUL stops it too */
    }
    return 1;
}

/* 2-, 3- and 4-byte characters straddling the cut at every phase: none may be split. */
static void test_utf8_at_the_cut(void **state)
{
    static const char *chars[] = {"\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"};
    static char m[2 * CAP];
    (void)state;
    for (int c = 0; c < 3; c++) {
        size_t w = strlen(chars[c]), o;
        for (size_t pad = 0; pad < w; pad++) {
            memset(m, 'x', o = CAP - 8 + pad);
            for (; o + w < sizeof m; o += w)
                memcpy(m + o, chars[c], w);
            m[o] = '\0';
            vmmt_set_error(VMMT_EINVAL, m);
            const char *e = vmmt_last_error();
            assert_memory_equal(e, m, strlen(e));
            if (!utf8_valid((const unsigned char *)e))
                fail_msg("cut splits a UTF-8 character: width %zu, pad %zu", w, pad);
        }
    }
}

/* The message may be the library's own buffer, from its middle or whole. */
static void test_aliasing(void **state)
{
    static char big[CAP + 100];
    (void)state;
    vmmt_set_error(VMMT_ESYS, "outer: middle: inner");
    vmmt_set_error(VMMT_ESYS, vmmt_last_error() + 7);
    assert_string_equal(vmmt_last_error(), "middle: inner");
    memset(big, 'q', sizeof big - 1);
    memcpy(big, "head", 4);
    vmmt_set_error(VMMT_ESYS, big);
    size_t n = strlen(vmmt_last_error());
    vmmt_set_error(VMMT_ESYS, vmmt_last_error() + 4);
    assert_true(strlen(vmmt_last_error()) == n - 4 && strspn(vmmt_last_error(), "q") == n - 4);
    /* An adapter re-raising the message it found: vmmt_set_error(st, vmmt_last_error()). */
    vmmt_set_error(VMMT_ESYS, "outer: middle: inner");
    assert_int_equal(vmmt_set_error(VMMT_ESYS, vmmt_last_error()), VMMT_ESYS);
    assert_string_equal(vmmt_last_error(), "outer: middle: inner");
}

/* Each thread sees its own message only; a fresh thread starts clean. */
static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg, st = -1 - (id % 15);
    char want[64];
    intptr_t bad = *vmmt_last_error() || vmmt_last_status() || vmmt_last_cuda_error();
    for (int i = 0; i < 2000; i++) {
        snprintf(want, sizeof want, "thread %d round %d %%n", id, i);
        bad |= vmmt_set_error(st, want) != st || strcmp(vmmt_last_error(), want);
        bad |= vmmt_last_status() != st;
    }
    return (void *)bad;
}

static void test_threads(void **state)
{
    pthread_t t[16];
    void *r;
    (void)state;
    vmmt_set_error(VMMT_ENOTSUP, "main's own");
    for (int i = 0; i < 16; i++)
        assert_int_equal(pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i), 0);
    for (int i = 0; i < 16; i++)
        assert_true(pthread_join(t[i], &r) == 0 && r == NULL);
    assert_string_equal(vmmt_last_error(), "main's own");
    assert_int_equal(vmmt_last_status(), VMMT_ENOTSUP);
}

/* An adapter's failure has no CUresult behind it; its text never leaks into a later failure. */
static void test_cuda_error_and_stale_message(void **state)
{
    uint64_t p = 1;
    (void)state;
    if (!on_emu()) skip();
    emu_fail("cuMemAlloc:1:CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_mem_alloc(0, 4096, &p), VMMT_ENOMEM);
    assert_int_not_equal(vmmt_last_cuda_error(), 0);
    vmmt_set_error(VMMT_ESYS, "stale adapter message");
    assert_int_equal(vmmt_last_cuda_error(), 0);
    assert_int_equal(vmmt_mem_copy(0, 0, 4096, 16, NULL), VMMT_EINVAL);
    assert_null(strstr(vmmt_last_error(), "stale"));
    vmmt_set_error(VMMT_ESYS, "stale adapter message");
    emu_fail("cuMemAlloc:1:CUDA_ERROR_OUT_OF_MEMORY");
    assert_int_equal(vmmt_mem_alloc(0, 4096, &p), VMMT_ENOMEM); /* wraps a CUDA cause */
    emu_reset();
    assert_null(strstr(vmmt_last_error(), "stale"));
}

/* libvmmt_mpi.so, loaded as a user would, with MPI never initialised: refusals with messages. */
typedef int (*coll_fn)(void *, vmmt_group_collective *, int *, int *);
typedef int (*create_fn)(const vmmt_group_config *, size_t, void *, vmmt_group **);
#define REFUSED(call, want)                                                                        \
    do {                                                                                           \
        int st_ = (call);                                                                          \
        assert_true(st_ < 0 && (want == 0 || st_ == want) && last_status() == st_);                \
        assert_true(strlen(last_error()) > 0);                                                     \
    } while (0)
static void test_mpi_refusals(void **state)
{
    char path[4096];
    const char *emu = VMMT_TEST_EMU_LIBRARY;
    vmmt_group_collective c;
    vmmt_group *g = (vmmt_group *)&c;
    int rank = -7, ws = -7;
    (void)state;
    snprintf(path, sizeof path, "%.*s/libvmmt_mpi.so", (int)(strrchr(emu, '/') - emu), emu);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) skip(); /* built without MPI */
    coll_fn coll = (coll_fn)dlsym(h, "vmmt_group_mpi_collective");
    create_fn create = (create_fn)dlsym(h, "vmmt_group_create_mpi_size");
    const char *(*last_error)(void) = (const char *(*)(void))dlsym(h, "vmmt_last_error");
    int (*last_status)(void) = (int (*)(void))dlsym(h, "vmmt_last_status");
    void *comms[] = {dlsym(h, "ompi_mpi_comm_null"), NULL, (void *)&c};
    assert_true(coll && create && last_error && last_status);
    for (size_t i = 0; i < 3; i++) {
        REFUSED(coll(comms[i], &c, &rank, &ws), 0);
        REFUSED(create(NULL, sizeof(vmmt_group_config), comms[i], &g), 0);
        assert_null(g);
    }
    REFUSED(coll(comms[0], NULL, &rank, &ws), VMMT_EINVAL);
    REFUSED(coll(comms[0], &c, NULL, NULL), VMMT_EINVAL);
    REFUSED(create(NULL, sizeof(vmmt_group_config), comms[0], NULL), VMMT_EINVAL);
    dlclose(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_null_empty_and_conversions),
        cmocka_unit_test(test_boundary_lengths),
        cmocka_unit_test(test_utf8_at_the_cut),
        cmocka_unit_test(test_aliasing),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_cuda_error_and_stale_message),
        cmocka_unit_test(test_mpi_refusals),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
