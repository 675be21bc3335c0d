#include <string.h>

#include "status.h"
#include "testutil.h"

static void test_wrap_keeps_cause(void **state)
{
    (void)state;
    vmmt__fail(VMMT_ENOTSUP, "inner cause");
    assert_int_equal(vmmt__wrap(VMMT_EINVAL, "outer %d", 7), VMMT_EINVAL);
    assert_string_equal(vmmt_last_error(), "outer 7: inner cause");
    assert_int_equal(vmmt_last_status(), VMMT_EINVAL);
}

static void test_strerror_never_null(void **state)
{
    (void)state;
    for (int s = -20; s <= 0; s++)
        assert_non_null(vmmt_strerror(s));
    assert_string_equal(vmmt_strerror(VMMT_EFULL), "pool is full");
}

/* An adapter's message: copied, with a % taken as text, and wrapped like vmmt's own. */
static void test_set_error_from_an_adapter(void **state)
{
    char long_msg[8192];

    (void)state;
    char text[] = "adapter: 100% of the ranks answered";
    assert_int_equal(vmmt_set_error(VMMT_ESYS, text), VMMT_ESYS);
    text[0] = 'X';
    assert_string_equal(vmmt_last_error(), "adapter: 100% of the ranks answered");
    assert_int_equal(vmmt_last_status(), VMMT_ESYS);
    vmmt__wrap(VMMT_ESYS, "group");
    assert_string_equal(vmmt_last_error(), "group: adapter: 100% of the ranks answered");
    memset(long_msg, 'a', sizeof long_msg - 1);
    long_msg[sizeof long_msg - 1] = '\0';
    assert_int_equal(vmmt_set_error(VMMT_EINVAL, long_msg), VMMT_EINVAL);
    assert_true(strlen(vmmt_last_error()) < sizeof long_msg - 1);
    assert_int_equal(vmmt_set_error(VMMT_EINVAL, NULL), VMMT_EINVAL);
    assert_string_equal(vmmt_last_error(), "no message given");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrap_keeps_cause),
        cmocka_unit_test(test_strerror_never_null),
        cmocka_unit_test(test_set_error_from_an_adapter),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
