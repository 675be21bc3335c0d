/*
 * vmmt_version() and vmmt_version_string() (issue 17: there was no run-time
 * version query): the library says the version it was built as, which a
 * program built against this vmmt.h must see as its own here.
 */
#include <stdio.h>
#include <string.h>

#include "testutil.h"

static void test_version_matches_header(void **state)
{
    char want[32];

    (void)state;
    assert_int_equal(vmmt_version(), VMMT_VERSION);
    assert_string_equal(vmmt_version_string(), VMMT_VERSION_STRING);
    snprintf(want, sizeof want, "%d.%d.%d", VMMT_VERSION_MAJOR, VMMT_VERSION_MINOR,
             VMMT_VERSION_PATCH);
    assert_string_equal(VMMT_VERSION_STRING, want);
    assert_int_equal(VMMT_VERSION >> 16, VMMT_VERSION_MAJOR);
    assert_int_equal((VMMT_VERSION >> 8) & 0xff, VMMT_VERSION_MINOR);
    assert_int_equal(VMMT_VERSION & 0xff, VMMT_VERSION_PATCH);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_version_matches_header),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
