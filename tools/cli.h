/* Shared pieces of the vmmt command-line tool: one file per subcommand. */
#ifndef VMMT_CLI_H
#define VMMT_CLI_H

#include <stdio.h>

/* Exit codes shared by the subcommands. */
enum { CLI_OK = 0, CLI_FAIL = 1, CLI_ERROR = 2, CLI_NO_SHAREABLE = 3 };

int cmd_probe(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_group(int argc, char **argv);

/* Write s as a JSON string literal, quotes included. */
void cli_json_string(FILE *f, const char *s);

/* Apply --driver NAME; prints the error and returns CLI_ERROR if it fails. */
int cli_select_driver(const char *name);

#endif
