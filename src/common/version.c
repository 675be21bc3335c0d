/*
 * The library's version at run time: a program built against one vmmt.h may
 * load another libvmmt.so, and only the library can say which it is.
 */
#include "vmmt.h"

unsigned int vmmt_version(void)
{
    return VMMT_VERSION;
}

const char *vmmt_version_string(void)
{
    return VMMT_VERSION_STRING;
}
