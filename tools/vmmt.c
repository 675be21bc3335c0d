#include <stdio.h>
#include "vmmt.h"
int main(void) { printf("vmmt %s\n", VMMT_VERSION_STRING); return 0; }
