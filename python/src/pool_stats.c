/*
 * Pool.stats(): every field of vmmt_pool_stats as a dict, from one table.
 */
#include <stddef.h>
#include <string.h>

#include "py_vmmt.h"

/*
 * Every field of vmmt_pool_stats, in one table: a field the library adds is
 * one line here (and one in the .pyi stub).
 */
enum stat_kind { ST_U32, ST_U64, ST_BOOL, ST_HANDLE, ST_HANDOFF, ST_LOCATION };
#define STAT(field, kind)                                                                          \
    {                                                                                              \
#field, offsetof(vmmt_pool_stats, field), kind                                             \
    }
static const struct {
    const char *name;
    size_t offset;
    enum stat_kind kind;
} stat_fields[] = {
    STAT(handle_type, ST_HANDLE),
    STAT(handoff, ST_HANDOFF),
    STAT(fell_back_to_posix, ST_BOOL),
    STAT(host_control_table, ST_BOOL),
    STAT(allocation_size, ST_U64),
    STAT(table_bytes, ST_U64),
    STAT(data_bytes, ST_U64),
    STAT(slots, ST_U32),
    STAT(in_flight, ST_U32),
    STAT(in_flight_bytes, ST_U64),
    STAT(published, ST_U64),
    STAT(recycled, ST_U64),
    STAT(cancelled, ST_U64),
    STAT(full, ST_U64),
    STAT(reclaims, ST_U64),
    STAT(broker_served, ST_U64),
    STAT(broker_refused, ST_U64),
    STAT(memory_location, ST_LOCATION),
    STAT(device_bytes, ST_U64),
    STAT(host_bytes, ST_U64),
    STAT(resident_bytes, ST_U64),
    STAT(peak_bytes, ST_U64),
    STAT(max_bytes, ST_U64),
    STAT(chunk_bytes, ST_U64),
    STAT(chunks_made, ST_U64),
    STAT(chunks_released, ST_U64),
    STAT(rank_releases, ST_U64),
    STAT(released_slices, ST_U64),
    STAT(consumer_links, ST_U32),
    STAT(kernel_publishes, ST_U64),
};
#undef STAT

static PyObject *stat_value(const vmmt_pool_stats *s, size_t i)
{
    const char *p = (const char *)s + stat_fields[i].offset;
    int v;

    switch (stat_fields[i].kind) {
    case ST_U32: return PyLong_FromUnsignedLong(*(const uint32_t *)p);
    case ST_U64: return PyLong_FromUnsignedLongLong(*(const uint64_t *)p);
    case ST_BOOL: return PyBool_FromLong(*(const int *)p);
    case ST_HANDLE:
        return PyUnicode_FromString(vmmt_handle_type_name(*(const vmmt_handle_type *)p));
    case ST_HANDOFF: return PyUnicode_FromString(vmmt_handoff_name(*(const vmmt_handoff *)p));
    case ST_LOCATION:
        memcpy(&v, p, sizeof v);
        return PyUnicode_FromString(vmmt_memory_location_name((vmmt_memory_location)v));
    }
    return NULL;
}

PyObject *vmmtpy_pool_stats_dict(const vmmt_pool_stats *s)
{
    PyObject *out = PyDict_New();

    if (out == NULL) return NULL;
    for (size_t i = 0; i < sizeof stat_fields / sizeof stat_fields[0]; i++) {
        PyObject *v = stat_value(s, i);
        if (v == NULL || PyDict_SetItemString(out, stat_fields[i].name, v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}
