/*
 * Public structs that grow. vmmt.h passes the size a caller compiled each
 * struct with (sizeof, through static inline wrappers) to the exported
 * *_size functions; these helpers move a struct between the caller's size
 * and the library's, so that either side may be the newer one:
 *
 *   - the caller's struct is shorter (built against an older vmmt.h): the
 *     fields it lacks keep their defaults on the way in, and are not
 *     written on the way out;
 *   - the caller's struct is longer (built against a newer vmmt.h than this
 *     library): on the way out the extra bytes are zeroed; on the way in they
 *     must be zero, since a field this library does not know cannot be
 *     honoured silently.
 *
 * A size below the struct's first versioned layout (vmmt 0.1: every field
 * up to the one named in VMMT__SIZE_V1) is no vmmt struct at all.
 */
#ifndef VMMT_ABI_H
#define VMMT_ABI_H

#include <stddef.h>

/* The largest size a caller may pass for any struct: every version of every one is smaller. */
#define VMMT__STRUCT_MAX 65536

/* Bytes up to the end of `field`: the smallest size a caller's struct may have. */
#define VMMT__SIZE_V1(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

/* VMMT_EINVAL naming `what` for NULL, a size below min_size, or one above VMMT__STRUCT_MAX. */
int vmmt__struct_check(const void *p, size_t size, size_t min_size, const char *what);

/*
 * Read the caller's `theirs` (their_size bytes) into `ours` (ours_size
 * bytes, already holding the defaults): VMMT_EINVAL naming `what` for a size
 * below min_size or a non-zero byte past ours_size.
 */
int vmmt__struct_in(void *ours, size_t ours_size, const void *theirs, size_t their_size,
                    size_t min_size, const char *what);

/*
 * Write `ours` into the caller's `theirs` (their_size bytes), zeroing bytes
 * past ours_size: VMMT_EINVAL naming `what` for NULL or a size below
 * min_size (nothing written then).
 */
int vmmt__struct_out(void *theirs, size_t their_size, const void *ours, size_t ours_size,
                     size_t min_size, const char *what);

#endif
