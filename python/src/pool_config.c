/*
 * Pool(...)'s arguments into a vmmt_pool_config: one keyword per config
 * field, defaults from vmmt_pool_config_init, names of choices checked here
 * (numbers by the library, whose messages name the field). A field the
 * library adds is a keyword, a format letter and an assignment here.
 */
#include <stdio.h>
#include <string.h>

#include "argconv.h"
#include "py_vmmt.h"

/*
 * The index of `value` among `names` (each ending in NUL, the list in an
 * empty one); ValueError naming the option and its choices otherwise.
 */
static int choice(const char *option, const char *value, const char *names, int *index)
{
    char list[128] = "";
    int i = 0;

    for (const char *n = names; *n != '\0'; n += strlen(n) + 1, i++) {
        if (strcmp(value, n) == 0) {
            *index = i;
            return 0;
        }
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s'%s'", i ? ", " : "", n);
    }
    PyErr_Format(PyExc_ValueError, "%s='%s'; use one of %s", option, value, list);
    return -1;
}

int vmmtpy_pool_config(PyObject *args, PyObject *kw, vmmt_pool_config *c)
{
    static char *kwlist[] = {
        "device",          "memory_size",          "consumer_count",    "max_slices",
        "handle_type",     "allow_posix_fallback", "round_up",          "broker_path",
        "timeout_ms",      "recycle_interval_us",  "handoff",           "device_control_table",
        "memory_location", "host_numa_node",       "elastic",           "chunk_size",
        "min_resident",    "idle_release_ms",      "consumer_lease_ms", NULL};
    const char *handle = "auto", *handoff = "auto", *broker = NULL, *location = "device";
    unsigned long long size = 0, chunk, min_resident;
    unsigned int max_slices, recycle, idle;
    int fallback, round_up, dct, elastic, loc, mode, st;
    vmmt_handle_type ht;

    vmmt_pool_config_init(c);
    max_slices = c->max_slices;
    recycle = c->recycle_interval_us;
    fallback = c->allow_posix_fallback;
    round_up = c->round_up;
    dct = c->device_control_table;
    elastic = c->elastic;
    chunk = c->chunk_size;
    min_resident = c->min_resident;
    idle = c->idle_release_ms;
    /* O& with checked converters (argconv.h): K and I wrap out-of-range ints silently. */
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "iO&i|O&sppziO&spsipO&O&O&i", kwlist, &c->device, vmmtpy_u64_arg, &size,
            &c->consumer_count, vmmtpy_u32_arg, &max_slices, &handle, &fallback, &round_up, &broker,
            &c->timeout_ms, vmmtpy_u32_arg, &recycle, &handoff, &dct, &location, &c->host_numa_node,
            &elastic, vmmtpy_u64_arg, &chunk, vmmtpy_u64_arg, &min_resident, vmmtpy_u32_arg, &idle,
            &c->consumer_lease_ms))
        return -1;
    if (choice("memory_location", location, "device\0host\0", &loc) != 0) return -1;
    c->memory_location = loc == 0 ? VMMT_MEMORY_DEVICE : VMMT_MEMORY_HOST;
    c->elastic = elastic;
    c->chunk_size = chunk;
    c->min_resident = min_resident;
    c->idle_release_ms = idle;
    if ((st = vmmt_handle_type_parse(handle, &ht)) != VMMT_OK) {
        vmmtpy_raise(st);
        return -1;
    }
    if (choice("handoff", handoff, "auto\0stream\0sync\0", &mode) != 0) return -1;
    c->handoff = mode == 0   ? VMMT_HANDOFF_AUTO
                 : mode == 1 ? VMMT_HANDOFF_STREAM
                             : VMMT_HANDOFF_SYNC;
    c->memory_size = size;
    c->max_slices = max_slices;
    c->recycle_interval_us = recycle;
    c->handle_type = ht;
    c->allow_posix_fallback = fallback;
    c->round_up = round_up;
    c->broker_path = broker;
    c->device_control_table = dct;
    return 0;
}
