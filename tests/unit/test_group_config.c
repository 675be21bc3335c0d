/*
 * vmmt_group_config follows the header's rule for structs that grow
 * (issue 17): it is passed with the size the caller compiled it with, an
 * older (shorter) struct gets defaults for what it lacks, a newer one is
 * refused only when it sets a field this library does not know, and a size
 * no version has is refused with a message. Before, vmmt_group_config_init
 * and vmmt_group_create took no size: a program built against a newer
 * vmmt.h would have had its larger struct written past, or read short.
 */
#include <stddef.h>
#include <string.h>

#include "testutil.h"

static int g_closed;

static int copy_allgather(void *ctx, const void *send, void *recv, size_t bytes, char *err,
                          size_t cap)
{
    (void)ctx, (void)err, (void)cap;
    memcpy(recv, send, bytes); /* a world of one */
    return 0;
}

static void count_close(void *ctx)
{
    (void)ctx;
    g_closed++;
}

/* A caller built against a vmmt.h whose config has one more field. */
struct newer_config {
    vmmt_group_config c;
    uint64_t field_we_lack;
};

static void one_rank(vmmt_group_config *c)
{
    c->rank = 0;
    c->world_size = 1;
    c->collective.allgather = copy_allgather;
    c->collective.close = count_close;
}

static void test_init_writes_defaults_and_zeroes_what_it_lacks(void **state)
{
    struct newer_config n;
    vmmt_group_config small;

    (void)state;
    memset(&n, 0xab, sizeof n);
    vmmt_group_config_init_size(&n.c, sizeof n);
    assert_int_equal(n.c.handle_type, VMMT_HANDLE_AUTO);
    assert_int_equal(n.c.timeout_ms, 120000);
    assert_int_equal(n.c.max_allocations, 4096);
    assert_int_equal(n.c.rank, 0);
    assert_null(n.c.collective.allgather);
    assert_int_equal(n.field_we_lack, 0);
    /* A size no vmmt_group_config has: nothing written, a message left. */
    memset(&small, 0xab, sizeof small);
    vmmt_group_config_init_size(&small, 6);
    assert_int_equal(small.rank, (int)0xabababab);
    assert_error_contains("vmmt_group_config_init: config is 6 bytes, less than any vmmt "
                          "version's");
    vmmt_group_config_init_size(NULL, sizeof small); /* ignored, as documented */
}

static void test_create_takes_a_newer_struct_left_zero(void **state)
{
    struct newer_config n;
    vmmt_group *g = NULL;

    (void)state;
    vmmt_group_config_init_size(&n.c, sizeof n);
    one_rank(&n.c);
    g_closed = 0;
    assert_vmmt_ok(vmmt_group_create_size(&n.c, sizeof n, &g));
    assert_non_null(g);
    assert_int_equal(vmmt_group_world_size(g), 1);
    vmmt_group_destroy(g);
    assert_int_equal(g_closed, 1);
}

static void test_create_refuses_a_field_it_does_not_know(void **state)
{
    struct newer_config n;
    vmmt_group *g = (vmmt_group *)&n;

    (void)state;
    vmmt_group_config_init_size(&n.c, sizeof n);
    one_rank(&n.c);
    n.field_we_lack = 1;
    g_closed = 0;
    assert_int_equal(vmmt_group_create_size(&n.c, sizeof n, &g), VMMT_EINVAL);
    assert_null(g);
    assert_error_contains("vmmt_group_create: config sets byte");
    assert_error_contains("built against a newer vmmt.h");
    /* The group owned the adapter from the call on: closed once, not leaked. */
    assert_int_equal(g_closed, 1);
    assert_int_equal(vmmt_group_create_local_size(&n.c, sizeof n, "job", &g), VMMT_EINVAL);
    assert_error_contains("vmmt_group_create_local: config sets byte");
}

static void test_create_refuses_sizes_no_version_has(void **state)
{
    vmmt_group_config c;
    vmmt_group *g = (vmmt_group *)&c;
    /* One byte short of version 0.1's last field, and sizes no struct has. */
    const size_t sizes[] = {0, 4, offsetof(vmmt_group_config, max_allocations) + 3, 65537,
                            (size_t)-1};

    (void)state;
    vmmt_group_config_init(&c);
    one_rank(&c);
    g_closed = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        g = (vmmt_group *)&c;
        assert_int_equal(vmmt_group_create_size(&c, sizes[i], &g), VMMT_EINVAL);
        assert_null(g);
        assert_error_contains("pass sizeof of the struct as vmmt.h declares it");
        g = (vmmt_group *)&c;
        assert_int_equal(vmmt_group_create_local_size(&c, sizes[i], "job", &g), VMMT_EINVAL);
        assert_null(g);
    }
    /* A struct it cannot read has no collective it could close. */
    assert_int_equal(g_closed, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_init_writes_defaults_and_zeroes_what_it_lacks),
        cmocka_unit_test(test_create_takes_a_newer_struct_left_zero),
        cmocka_unit_test(test_create_refuses_a_field_it_does_not_know),
        cmocka_unit_test(test_create_refuses_sizes_no_version_has),
    };
    tu_use_test_driver();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
