#include <stdio.h>

#include "cli.h"

int cmd_demo(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "vmmt demo: not built yet\n");
    return CLI_ERROR;
}
