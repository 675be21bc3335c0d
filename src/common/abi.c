/* Moving growable public structs between the caller's size and ours (abi.h). */
#include "abi.h"

#include <string.h>

#include "status.h"

int vmmt__struct_check(const void *p, size_t size, size_t min_size, const char *what)
{
    if (p == NULL) return vmmt__fail(VMMT_EINVAL, "%s is NULL", what);
    if (size < min_size)
        return vmmt__fail(VMMT_EINVAL,
                          "%s is %zu bytes, less than any vmmt version's (%zu); pass "
                          "sizeof of the struct as vmmt.h declares it",
                          what, size, min_size);
    /* Structs grow by a field or two a version: a size this far beyond is no struct's
     * (a length or count passed by mistake), and trusting it would write or read that much. */
    if (size > VMMT__STRUCT_MAX)
        return vmmt__fail(VMMT_EINVAL,
                          "%s is %zu bytes, more than any vmmt struct can have (at most %d); pass "
                          "sizeof of the struct as vmmt.h declares it",
                          what, size, VMMT__STRUCT_MAX);
    return VMMT_OK;
}

int vmmt__struct_in(void *ours, size_t ours_size, const void *theirs, size_t their_size,
                    size_t min_size, const char *what)
{
    const unsigned char *extra = (const unsigned char *)theirs + ours_size;
    int st = vmmt__struct_check(theirs, their_size, min_size, what);

    if (st != VMMT_OK) return st;
    for (size_t i = ours_size; i < their_size; i++)
        if (extra[i - ours_size] != 0)
            return vmmt__fail(VMMT_EINVAL,
                              "%s sets byte %zu of %zu, a field this vmmt library (%zu bytes "
                              "of it) does not know; the program was built against a newer "
                              "vmmt.h: use a matching library, or leave the field 0",
                              what, i, their_size, ours_size);
    memcpy(ours, theirs, their_size < ours_size ? their_size : ours_size);
    return VMMT_OK;
}

int vmmt__struct_out(void *theirs, size_t their_size, const void *ours, size_t ours_size,
                     size_t min_size, const char *what)
{
    int st = vmmt__struct_check(theirs, their_size, min_size, what);

    if (st != VMMT_OK) return st;
    memcpy(theirs, ours, their_size < ours_size ? their_size : ours_size);
    if (their_size > ours_size)
        memset((unsigned char *)theirs + ours_size, 0, their_size - ours_size);
    return VMMT_OK;
}
