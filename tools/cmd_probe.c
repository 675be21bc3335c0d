/* vmmt probe: what the driver and each device can do for CUDA VMM sharing. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "cli.h"
#include "vmm.h"
#include "vmmt.h"

struct probe_opts {
    int device; /* -1: all */
    int json;
    const char *driver;
};

static const struct cli_opt probe_opts_table[] = {
    {"--device", CLI_INT, "N", 0, 4095, offsetof(struct probe_opts, device),
     "probe device N only (default: every device)", NULL, NULL, 0},
    {"--json", CLI_FLAG, NULL, 0, 0, offsetof(struct probe_opts, json),
     "print JSON instead of text", NULL, NULL, 0},
    CLI_DRIVER_OPT(struct probe_opts),
};

const struct cli_command cli_probe_command = {
    "probe",
    "driver, devices and which CUDA VMM handle types work",
    "The driver, each device, and for every CUDA VMM handle type its device attribute,\n"
    "granularity and the result of a real allocation and export; then the type the library\n"
    "selects and why.",
    probe_opts_table,
    sizeof probe_opts_table / sizeof probe_opts_table[0],
    "exit status: 0 when a shareable handle type works, 3 when only NONE does, 2 on error\n"
    "(no driver among them).\n",
};

static void text_device(const vmmt_device_probe *p, int st)
{
    printf("device %d: %s, %.1f GiB, VMM %s, GPUDirect RDMA with VMM %s\n", p->device, p->name,
           (double)p->total_memory / (1 << 30), p->vmm_supported ? "yes" : "no",
           p->rdma_with_vmm_supported ? "yes" : "no");
    printf("  %-9s %-9s %-17s %-26s %-26s\n", "handle", "attribute", "granularity min/rec",
           "create", "export");
    for (int i = 0; i < 3; i++) {
        const vmmt_handle_probe *c = &p->candidates[i];
        char attr[16], gran[32], exp[40];
        snprintf(attr, sizeof attr, c->attribute < 0 ? "-" : "%d", c->attribute);
        snprintf(gran, sizeof gran, "%zu KiB / %zu KiB", c->granularity_minimum >> 10,
                 c->granularity_recommended >> 10);
        snprintf(exp, sizeof exp, "%s",
                 c->export_result < 0    ? "-"
                 : c->export_result == 0 ? "ok"
                                         : "failed");
        printf("  %-9s %-9s %-19s %-26s %-8s %s\n", vmmt__handle_type_upper(c->type), attr, gran,
               c->create_result == 0 ? "ok" : "failed", exp, c->works ? "" : c->cause);
    }
    printf("  IMEX channels (/dev/nvidia-caps-imex-channels): %s\n",
           p->imex_channels_present ? "present" : "absent");
    if (p->stream_wait_imported >= 0)
        printf("  stream wait on imported memory: %s%s%s\n",
               p->stream_wait_imported ? "works: pools hand off stream-ordered"
                                       : "refused: publishes synchronize (",
               p->stream_wait_imported ? "" : p->stream_wait_cause,
               p->stream_wait_imported ? "" : ")");
    if (st == VMMT_OK)
        printf("  selected: %s%s (%s)\n", vmmt_handle_type_name(p->selected),
               p->overridden ? " by VMMT_HANDLE_TYPE" : "", p->reason);
    else
        printf("  selected: none: %s\n", vmmt_last_error());
}

static void json_device(const vmmt_device_probe *p, int st, int first)
{
    printf("%s\n    {\"device\": %d, \"name\": ", first ? "" : ",", p->device);
    cli_json_string(stdout, p->name);
    printf(", \"total_memory\": %zu, \"vmm_supported\": %s, \"rdma_with_vmm_supported\": %s, "
           "\"imex_channels_present\": %s,\n     \"handle_types\": [",
           p->total_memory, p->vmm_supported ? "true" : "false",
           p->rdma_with_vmm_supported ? "true" : "false",
           p->imex_channels_present ? "true" : "false");
    for (int i = 0; i < 3; i++) {
        const vmmt_handle_probe *c = &p->candidates[i];
        printf("%s\n       {\"type\": \"%s\", \"attribute\": %d, \"granularity_minimum\": %zu, "
               "\"granularity_recommended\": %zu, \"create_result\": %d, \"export_result\": %d, "
               "\"works\": %s, \"cause\": ",
               i ? "," : "", vmmt_handle_type_name(c->type), c->attribute, c->granularity_minimum,
               c->granularity_recommended, c->create_result, c->export_result,
               c->works ? "true" : "false");
        cli_json_string(stdout, c->cause);
        printf("}");
    }
    printf("],\n     \"stream_wait_imported\": %d, \"handoff\": \"%s\", \"selected\": ",
           p->stream_wait_imported,
           p->stream_wait_imported == 1   ? "stream-ordered"
           : p->stream_wait_imported == 0 ? "synchronous"
                                          : "none");
    if (st == VMMT_OK)
        printf("\"%s\"", vmmt_handle_type_name(p->selected));
    else
        printf("null");
    printf(", \"reason\": ");
    cli_json_string(stdout, st == VMMT_OK ? p->reason : vmmt_last_error());
    printf("}");
}

static void print_no_driver(const struct probe_opts *o, int st)
{
    if (o->json) {
        printf("{\"driver\": null, \"status\": \"%s\", \"error\": ", vmmt_strerror(st));
        cli_json_string(stdout, vmmt_last_error());
        printf("}\n");
    } else {
        printf("vmmt probe: %s\n", vmmt_last_error());
    }
}

int cmd_probe(int argc, char **argv)
{
    struct probe_opts o;
    struct rlimit nofile = {0, 0};
    const char *driver;
    int version = 0, count = 0, rc = CLI_OK, first_dev, last_dev;

    o = (struct probe_opts){.device = -1};
    if ((rc = cli_parse(&cli_probe_command, argc, argv, &o)) != CLI_OK)
        return rc == CLI_HELP ? CLI_OK : CLI_ERROR;
    if (cli_open_driver("probe", o.driver, o.json ? stderr : stdout) != CLI_OK) {
        if (o.json) print_no_driver(&o, vmmt_last_status());
        return CLI_ERROR;
    }
    driver = vmmt_driver_name();
    if (vmmt_driver_version(&version) != VMMT_OK || vmmt_device_count(&count) != VMMT_OK) {
        print_no_driver(&o, vmmt_last_status());
        return CLI_ERROR;
    }
    if (o.device >= count) {
        fprintf(stderr,
                "vmmt probe: --device %d: no such device; the %s driver reports %d device(s), "
                "0 to %d\n",
                o.device, driver, count, count - 1);
        return CLI_ERROR;
    }
    getrlimit(RLIMIT_NOFILE, &nofile);
    first_dev = o.device < 0 ? 0 : o.device;
    last_dev = o.device < 0 ? count - 1 : o.device;
    if (o.json)
        printf("{\"driver\": \"%s\", \"driver_version\": %d, \"device_count\": %d, "
               "\"open_files_soft\": %llu, \"open_files_hard\": %llu, \"devices\": [",
               driver, version, count, (unsigned long long)nofile.rlim_cur,
               (unsigned long long)nofile.rlim_max);
    else
        printf("vmmt probe: driver %s%s, CUDA %d.%d (%d), %d device(s)\n", driver,
               strcmp(driver, "emu") == 0 ? " (emulated on host memory, no GPU in use)" : "",
               version / 1000, version % 1000 / 10, version, count);
    for (int dev = first_dev; dev <= last_dev; dev++) {
        vmmt_device_probe p;
        int st = vmmt__probe_report(dev, &p);
        if (st == VMMT_ENOTSUP && p.candidates[2].works) {
            if (rc == CLI_OK) rc = CLI_NO_SHAREABLE;
        } else if (st != VMMT_OK) {
            rc = CLI_ERROR;
        }
        if (o.json)
            json_device(&p, st, dev == first_dev);
        else
            text_device(&p, st);
    }
    if (o.json)
        printf("\n  ]}\n");
    else
        printf("open files: soft limit %llu, hard limit %llu (a broker holds two per pool and "
               "one per waiting client; an import needs two while it runs)\n",
               (unsigned long long)nofile.rlim_cur, (unsigned long long)nofile.rlim_max);
    return rc;
}
