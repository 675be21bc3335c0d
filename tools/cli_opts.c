/*
 * The tool's option parser and help, both driven by each subcommand's
 * table (cli.h). A mistake is reported with the option, the value given and
 * what is accepted: "vmmt demo: --count -1: expected a whole number from 1
 * to 100000000". Before this, each subcommand parsed its own way: atoi and
 * strtoul took "-1" as 4294967295 buffers and "abc" as 0, and every mistake
 * got one line that never named the option.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

const char cli_driver_rule[] =
    "Without a GPU: --driver cuda (the default, unless VMMT_DRIVER says otherwise) stops with\n"
    "exit status 2 and says so; --driver emu runs on the emulated driver (host memory: the\n"
    "same library code and processes, timings that say nothing about a GPU); --driver auto\n"
    "uses the GPU when its driver loads, else the emulated driver, saying so first.\n"
    "The same for probe, demo, bench and group-test.\n";

static const struct cli_opt *find(const struct cli_command *c, const char *name, size_t len)
{
    for (size_t i = 0; i < c->nopts; i++)
        if (strlen(c->opts[i].name) == len && strncmp(c->opts[i].name, name, len) == 0)
            return &c->opts[i];
    return NULL;
}

/* What a value of this option must be, for messages: "a whole number from 1 to 64". */
static void accepted(const struct cli_opt *o, char *buf, size_t cap)
{
    char lo[32], hi[32];

    switch (o->kind) {
    case CLI_INT: snprintf(buf, cap, "a whole number from %.0f to %.0f", o->min, o->max); break;
    case CLI_SIZE:
        snprintf(buf, cap, "a size from %s to %s (bytes, or with K, M, G or T: 96K, 4M)",
                 cli_bytes((uint64_t)o->min, lo, sizeof lo),
                 cli_bytes((uint64_t)o->max, hi, sizeof hi));
        break;
    case CLI_REAL: snprintf(buf, cap, "a number from %.15g to %.15g", o->min, o->max); break;
    case CLI_TEXT: snprintf(buf, cap, "%s", o->accepts ? o->accepts : "a non-empty value"); break;
    case CLI_FLAG: snprintf(buf, cap, "no value"); break;
    }
}

/* Digits only, with an optional minus: strtoll alone takes " 5", "5 " and "0x5". */
static int parse_int(const char *s, double *out)
{
    char *end;
    long long v;

    if (!(*s == '-' || (*s >= '0' && *s <= '9'))) return -1;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE) return -1;
    *out = (double)v;
    return 0;
}

int cli_parse_int(const char *s, int lo, int hi, int *out)
{
    double v;

    if (s == NULL || parse_int(s, &v) != 0 || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

/* A size: digits, then K, M, G or T (binary), then an optional "iB" or "B". */
static int parse_size(const char *s, double *out)
{
    char *end;
    unsigned long long v;
    double mul = 1;

    /* strtoull takes "-1" as 2^64 - 1 and saturates past 2^64: digits first, then ERANGE. */
    if (*s < '0' || *s > '9') return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno == ERANGE) return -1;
    switch (*end) {
    case 'K':
    case 'k': mul = 1024.0, end++; break;
    case 'M':
    case 'm': mul = 1024.0 * 1024, end++; break;
    case 'G':
    case 'g': mul = 1024.0 * 1024 * 1024, end++; break;
    case 'T':
    case 't': mul = 1024.0 * 1024 * 1024 * 1024, end++; break;
    default: break;
    }
    if (mul > 1 && end[0] == 'i' && end[1] == 'B')
        end += 2;
    else if (end[0] == 'B')
        end++;
    if (*end != '\0') return -1;
    /* In double: a product past 2^64 stays comparable with the maximum instead of wrapping. */
    *out = (double)v * mul;
    return 0;
}

static int parse_real(const char *s, double *out)
{
    char *end;

    errno = 0;
    *out = strtod(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(*out) || *s == ' ') return -1;
    return 0;
}

static int bad_value(const struct cli_command *c, const struct cli_opt *o, const char *v)
{
    char acc[200];

    accepted(o, acc, sizeof acc);
    fprintf(stderr, "vmmt %s: %s %s: expected %s\n", c->name, o->name, *v ? v : "''", acc);
    return CLI_ERROR;
}

static int store(const struct cli_command *c, const struct cli_opt *o, const char *v, void *out)
{
    char *field = (char *)out + o->offset;
    double x = 0;
    int r = -1;

    switch (o->kind) {
    case CLI_INT: r = parse_int(v, &x); break;
    case CLI_SIZE: r = parse_size(v, &x); break;
    case CLI_REAL: r = parse_real(v, &x); break;
    case CLI_TEXT:
        if (*v == '\0' || (o->check != NULL && o->check(v) != 0)) return bad_value(c, o, v);
        *(const char **)field = v;
        return CLI_OK;
    case CLI_FLAG: break;
    }
    if (r != 0 || x < o->min || x > o->max) return bad_value(c, o, v);
    if (o->kind == CLI_INT)
        *(int *)field = (int)x;
    else if (o->kind == CLI_SIZE)
        *(uint64_t *)field = (uint64_t)x;
    else
        *(double *)field = x;
    return CLI_OK;
}

int cli_parse(const struct cli_command *c, int argc, char **argv, void *out)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '='), *v;
        const struct cli_opt *o;
        char acc[200];

        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            cli_usage(stdout, "usage: ", c, 1);
            return CLI_HELP;
        }
        o = strncmp(a, "--", 2) == 0 ? find(c, a, eq ? (size_t)(eq - a) : strlen(a)) : NULL;
        if (o == NULL) {
            fprintf(stderr, "vmmt %s: %s '%s'; `vmmt %s --help` lists the options\n", c->name,
                    strncmp(a, "-", 1) == 0 ? "unknown option" : "unexpected argument", a, c->name);
            return CLI_ERROR;
        }
        if (o->kind == CLI_FLAG) {
            if (eq != NULL) {
                fprintf(stderr, "vmmt %s: %s takes no value (got '%s')\n", c->name, o->name, a);
                return CLI_ERROR;
            }
            *(int *)((char *)out + o->offset) = 1;
            continue;
        }
        if (eq != NULL) {
            v = eq + 1;
        } else if (i + 1 < argc) {
            v = argv[++i];
        } else {
            accepted(o, acc, sizeof acc);
            fprintf(stderr, "vmmt %s: %s needs a value: %s\n", c->name, o->name, acc);
            return CLI_ERROR;
        }
        if (store(c, o, v, out) != CLI_OK) return CLI_ERROR;
    }
    return CLI_OK;
}

void cli_usage(FILE *f, const char *lead, const struct cli_command *c, int full)
{
    int col = fprintf(f, "%svmmt %s", lead, c->name);
    int indent = (int)(strlen(lead) + strlen("vmmt ") + strlen(c->name));

    for (size_t i = 0; i < c->nopts; i++) {
        const struct cli_opt *o = &c->opts[i];
        char item[80];
        int n;
        if (o->internal) continue;
        n = snprintf(item, sizeof item, " [%s%s%s]", o->name, o->value ? " " : "",
                     o->value ? o->value : "");
        if (col + n > 96) col = fprintf(f, "\n%*s", indent, "") - 1;
        col += fprintf(f, "%s", item);
    }
    fprintf(f, "\n");
    if (!full) return;
    fprintf(f, "%s\n\noptions:\n", c->summary);
    for (size_t i = 0; i < c->nopts; i++) {
        const struct cli_opt *o = &c->opts[i];
        char head[48];
        if (o->internal) continue;
        snprintf(head, sizeof head, "%s%s%s", o->name, o->value ? " " : "",
                 o->value ? o->value : "");
        fprintf(f, "  %-24s %s\n", head, o->help);
    }
    fprintf(f, "  %-24s %s\n", "--help, -h", "this help");
    if (c->notes != NULL) fprintf(f, "\n%s", c->notes);
    fprintf(f, "\n%s", cli_driver_rule);
}
