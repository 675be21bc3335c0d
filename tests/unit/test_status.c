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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrap_keeps_cause),
        cmocka_unit_test(test_strerror_never_null),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
