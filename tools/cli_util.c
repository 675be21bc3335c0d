#include <stdio.h>
#include <string.h>

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

const char *cli_bytes(uint64_t n, char *buf, size_t cap)
{
    static const char *const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)n;
    int u = 0;

    while (v >= 1024 && u < 6)
        v /= 1024, u++;
    if (u == 0)
        snprintf(buf, cap, "%llu %s", (unsigned long long)n, n == 1 ? "byte" : "bytes");
    else if (v == (double)(uint64_t)v)
        snprintf(buf, cap, "%.0f %s", v, unit[u]);
    else
        snprintf(buf, cap, "%.1f %s", v, unit[u]);
    return buf;
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

int cli_driver_check(const char *value)
{
    return strcmp(value, "cuda") == 0 || strcmp(value, "emu") == 0 || strcmp(value, "auto") == 0 ||
                   strchr(value, '/') != NULL
               ? 0
               : -1;
}

/*
 * One rule for every subcommand (cli_driver_rule): without a GPU nothing
 * falls back unless asked. A probe or a benchmark that quietly measured the
 * emulator would report a machine that is not there, and a demo that did
 * would hide that the GPU's driver is missing; "auto" is there for
 * `make run`, whose job is to show the library working on any machine.
 */
int cli_open_driver(const char *cmd, const char *driver, FILE *say)
{
    int is_auto = driver != NULL && strcmp(driver, "auto") == 0;

    if (driver != NULL && !is_auto && vmmt_driver_select(driver) != VMMT_OK) {
        fprintf(say, "vmmt %s: --driver %s: %s\n", cmd, driver, vmmt_last_error());
        return CLI_ERROR;
    }
    if (is_auto && vmmt_driver_select("cuda") != VMMT_OK) {
        fprintf(say, "vmmt %s: %s\n", cmd, vmmt_last_error());
        return CLI_ERROR;
    }
    if (vmmt_driver_name() != NULL) return CLI_OK;
    if (!is_auto) {
        fprintf(say,
                "vmmt %s: %s\n"
                "vmmt %s: to run without a GPU: --driver emu (the emulated driver), or --driver "
                "auto (the GPU when there is one, else the emulated driver)\n",
                cmd, vmmt_last_error(), cmd);
        return CLI_ERROR;
    }
    fprintf(say,
            "vmmt %s: no GPU here (%s)\n"
            "vmmt %s: --driver auto: running on the emulated driver (host memory): the same "
            "library code and processes, but the timings say nothing about a GPU\n",
            cmd, vmmt_last_error(), cmd);
    if (vmmt_driver_select("emu") != VMMT_OK || vmmt_driver_name() == NULL) {
        fprintf(say, "vmmt %s: %s\n", cmd, vmmt_last_error());
        return CLI_ERROR;
    }
    return CLI_OK;
}
