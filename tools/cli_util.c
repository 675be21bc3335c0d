#include <stdio.h>

#include "cli.h"
#include "vmmt.h"

void cli_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

int cli_select_driver(const char *name)
{
    if (name == NULL) return CLI_OK;
    if (vmmt_driver_select(name) != VMMT_OK) {
        fprintf(stderr, "vmmt: %s\n", vmmt_last_error());
        return CLI_ERROR;
    }
    return CLI_OK;
}
