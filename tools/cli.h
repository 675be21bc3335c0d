/* Shared pieces of the vmmt command-line tool: one file per subcommand. */
#ifndef VMMT_CLI_H
#define VMMT_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Exit codes shared by the subcommands. CLI_HELP: --help was printed (exit 0). */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_ERROR = 2, CLI_NO_SHAREABLE = 3, CLI_HELP = -1 };

int cmd_probe(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_group(int argc, char **argv);

/*
 * Options. Each subcommand describes its options once, in a table: the
 * parser checks every value against it (a message naming the option and
 * the accepted range), and the help of the subcommand and the tool's own
 * help are printed from it, so neither can forget an option.
 */
enum cli_kind {
    CLI_FLAG, /* no value; sets an int to 1 */
    CLI_INT,  /* a whole number in min..max, into an int */
    CLI_SIZE, /* bytes in min..max, with K, M, G or T (binary), into a uint64_t */
    CLI_REAL, /* a finite number in min..max, into a double */
    CLI_TEXT, /* a non-empty string, into a const char * (checked by `check` if set) */
};

struct cli_opt {
    const char *name; /* "--count" */
    enum cli_kind kind;
    const char *value; /* the value in the help: "N", "BYTES" */
    double min, max;   /* the accepted range of CLI_INT, CLI_SIZE and CLI_REAL */
    size_t offset;     /* where the value goes in the subcommand's options struct */
    const char *help;  /* what it does and its default, for the help */
    /* CLI_TEXT: 0 if the value is acceptable (NULL: any), and what is, for messages. */
    int (*check)(const char *value);
    const char *accepts;
    int internal; /* passed by the tool to its own child processes: not in the help */
};

struct cli_command {
    const char *name;    /* "demo" */
    const char *brief;   /* one line for the tool's help: what the subcommand is for */
    const char *summary; /* a paragraph for its own help */
    const struct cli_opt *opts;
    size_t nopts;
    const char *notes; /* printed after the options by `vmmt NAME --help`; may be NULL */
};

extern const struct cli_command cli_probe_command, cli_demo_command, cli_bench_command,
    cli_group_command;

/*
 * Parse argv[1..argc-1] into the struct at `out` (defaults already in it).
 * CLI_OK; CLI_HELP after printing the help for --help or -h; CLI_ERROR after
 * printing what is wrong (the option, the value, what is accepted) to stderr.
 * `--name value` and `--name=value` are both accepted.
 */
int cli_parse(const struct cli_command *c, int argc, char **argv, void *out);

/*
 * "<lead>vmmt NAME [...]" with every public option, wrapped; then, if full,
 * the summary, one line per option, the notes and the rule without a GPU.
 */
void cli_usage(FILE *f, const char *lead, const struct cli_command *c, int full);

/* The rule for a machine without a GPU, shared by every subcommand's help. */
extern const char cli_driver_rule[];

/* --driver's check: cuda, emu, auto, or the path of a driver library (CLI_DRIVER_ACCEPTS). */
int cli_driver_check(const char *value);
#define CLI_DRIVER_ACCEPTS "cuda, emu, auto, or the path of a driver library"
#define CLI_DRIVER_OPT(type)                                                                       \
    {                                                                                              \
        "--driver", CLI_TEXT, "cuda|emu|auto", 0, 0, offsetof(type, driver),                       \
            "the driver: cuda (default), emu, auto (see below), or a driver library's path",       \
            cli_driver_check, CLI_DRIVER_ACCEPTS, 0                                                \
    }

/*
 * Load the driver --driver names (NULL: VMMT_DRIVER, else cuda). "auto":
 * the GPU when its driver loads, else the emulated driver, saying so on
 * `say` first. When no driver loads, prints why and how to run without a
 * GPU to `say`, and returns CLI_ERROR; every subcommand follows this one rule.
 */
int cli_open_driver(const char *cmd, const char *driver, FILE *say);

/* Select a driver for the tool's own child processes; prints the error, CLI_ERROR. */
int cli_select_driver(const char *name);

/* Write s as a JSON string literal, quotes included. */
void cli_json_string(FILE *f, const char *s);

/* Bytes in words: "4 MiB", "1.5 GiB", "96 KiB", "100 bytes" (buf of 32 bytes at least). */
const char *cli_bytes(uint64_t n, char *buf, size_t cap);

/* s as an int from lo to hi (digits only, an optional minus); 0, or -1 when it is not. */
int cli_parse_int(const char *s, int lo, int hi, int *out);

#endif
