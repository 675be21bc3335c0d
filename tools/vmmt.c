/* The vmmt command-line tool: dispatch to one subcommand. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "vmmt.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: vmmt <command> [options]\n"
               "\n"
               "commands:\n"
               "  probe [--device N] [--json] [--driver cuda|emu]\n"
               "      driver, devices and which CUDA VMM handle types work\n"
               "  demo [--consumers N] [--size BYTES] [--count N] [--driver cuda|emu]\n"
               "      a producer and consumer processes moving buffers, checked byte for byte\n"
               "  bench [--driver cuda|emu] [--quick] [--json PATH] [--only S1,S3] [--reps N]\n"
               "        [--device N] [--peer-device N]\n"
               "      benchmark scenarios S1-S9, each against its floor measured in the same run\n"
               "  group-test [--ranks N] [--buffers K] [--chunks C] [--size BYTES] [--spread]\n"
               "             [--timeout MS] [--driver cuda|emu]\n"
               "      N ranks map each other's buffers (some crossing C allocations) and read them\n"
               "  version\n"
               "\n"
               "exit status: 0 success, 1 check failed, 2 error, 3 (probe) no shareable handle "
               "type\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return CLI_ERROR;
    }
    if (strcmp(argv[1], "probe") == 0) return cmd_probe(argc - 1, argv + 1);
    if (strcmp(argv[1], "demo") == 0 || strcmp(argv[1], "demo-consumer") == 0)
        return cmd_demo(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0 || strcmp(argv[1], "bench-peer") == 0)
        return cmd_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "group-test") == 0) return cmd_group(argc - 1, argv + 1);
    if (strcmp(argv[1], "version") == 0 || strcmp(argv[1], "--version") == 0) {
        printf("vmmt %s\n", VMMT_VERSION_STRING);
        return CLI_OK;
    }
    if (strcmp(argv[1], "help") == 0 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return CLI_OK;
    }
    fprintf(stderr, "vmmt: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return CLI_ERROR;
}
