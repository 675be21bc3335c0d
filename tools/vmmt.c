/* The vmmt command-line tool: dispatch to one subcommand. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "vmmt.h"

static const struct {
    const struct cli_command *c;
    int (*run)(int argc, char **argv);
} commands[] = {
    {&cli_probe_command, cmd_probe},
    {&cli_demo_command, cmd_demo},
    {&cli_bench_command, cmd_bench},
    {&cli_group_command, cmd_group},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

/* Every subcommand with every option, from the same tables their own help prints. */
static void usage(FILE *f)
{
    fprintf(f, "usage: vmmt <command> [options]   (vmmt <command> --help: each option, its "
               "range and default)\n\ncommands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++) {
        cli_usage(f, "  ", commands[i].c, 0);
        fprintf(f, "      %s\n", commands[i].c->brief);
    }
    fprintf(f,
            "  vmmt version\n      the library's version\n\n%s\n"
            "exit status: 0 success, 1 check failed, 2 error, 3 (probe) no shareable handle "
            "type\n",
            cli_driver_rule);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return CLI_ERROR;
    }
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (strcmp(argv[1], commands[i].c->name) == 0) return commands[i].run(argc - 1, argv + 1);
    /* The tool's own child processes (the demo's consumers, the benchmark's peers). */
    if (strcmp(argv[1], "demo-consumer") == 0) return cmd_demo(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench-peer") == 0) return cmd_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "version") == 0 || strcmp(argv[1], "--version") == 0) {
        printf("vmmt %s\n", vmmt_version_string());
        return CLI_OK;
    }
    if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "-h") == 0) {
        for (size_t i = 0; argc > 2 && i < NCOMMANDS; i++)
            if (strcmp(argv[2], commands[i].c->name) == 0) {
                cli_usage(stdout, "usage: ", commands[i].c, 1);
                return CLI_OK;
            }
        usage(stdout);
        return CLI_OK;
    }
    fprintf(stderr, "vmmt: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return CLI_ERROR;
}
