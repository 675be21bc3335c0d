/*
 * vmmt bench: the timer, samples and their percentiles, table rows, and the
 * two outputs (the table printed last, the JSON file).
 */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "cli.h"

double bench_now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

struct bench_series *bench_series_new(struct bench_report *r, const char *unit, const char *fmt,
                                      ...)
{
    struct bench_series *s;
    va_list ap;

    if (r->nseries == BENCH_MAX_SERIES) return NULL;
    s = &r->series[r->nseries++];
    memset(s, 0, sizeof *s);
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    s->unit = unit;
    return s;
}

int bench_series_add(struct bench_series *s, double v)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        double *nv = realloc(s->v, cap * sizeof *nv);
        if (nv == NULL) return -1;
        s->v = nv;
        s->cap = cap;
    }
    s->v[s->n++] = v;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest rank: p99 of 20 samples is the largest, never an interpolation. */
static double rank(const double *sorted, size_t n, double q)
{
    double want = q * (double)n;
    size_t k = (size_t)want;

    if ((double)k < want) k++; /* ceil without libm: the tool links no -lm */
    return sorted[k == 0 ? 0 : k - 1];
}

void bench_summarize(const struct bench_series *s, struct bench_summary *out)
{
    double *v, sum = 0;

    memset(out, 0, sizeof *out);
    out->p50 = out->p99 = out->mean = out->min = out->max = NAN;
    if (s == NULL || s->n == 0 || (v = malloc(s->n * sizeof *v)) == NULL) return;
    memcpy(v, s->v, s->n * sizeof *v);
    qsort(v, s->n, sizeof *v, cmp_double);
    for (size_t i = 0; i < s->n; i++)
        sum += v[i];
    out->n = s->n;
    out->p50 = rank(v, s->n, 0.5);
    out->p99 = rank(v, s->n, 0.99);
    out->mean = sum / (double)s->n;
    out->min = v[0];
    out->max = v[s->n - 1];
    free(v);
}

struct bench_row *bench_row_add(struct bench_report *r, const char *id, const char *unit,
                                const char *fmt, ...)
{
    struct bench_row *row;
    va_list ap;

    if (r->nrows == BENCH_MAX_ROWS) return NULL;
    row = &r->rows[r->nrows++];
    memset(row, 0, sizeof *row);
    snprintf(row->id, sizeof row->id, "%s", id);
    va_start(ap, fmt);
    vsnprintf(row->label, sizeof row->label, fmt, ap);
    va_end(ap);
    row->unit = unit;
    row->p50 = row->p99 = row->floor_p50 = row->ratio = NAN;
    row->met = -1;
    return row;
}

void bench_row_values(struct bench_row *row, double p50, double p99, double floor_p50, double ratio)
{
    if (row == NULL) return;
    row->p50 = p50;
    row->p99 = p99;
    row->floor_p50 = floor_p50;
    row->ratio = ratio;
}

void bench_row_goal(struct bench_row *row, enum bench_goal goal, double limit, double abs_limit)
{
    if (row == NULL) return;
    row->goal = goal;
    row->limit = limit;
    row->abs_limit = abs_limit;
    switch (goal) {
    case BENCH_GOAL_NONE: row->met = -1; return;
    case BENCH_GOAL_RATIO_MAX:
        snprintf(row->target, sizeof row->target, "<= %gx", limit);
        row->met = row->ratio <= limit;
        break;
    case BENCH_GOAL_RATIO_MIN:
        snprintf(row->target, sizeof row->target, ">= %gx", limit);
        row->met = row->ratio >= limit;
        break;
    case BENCH_GOAL_ABS_MAX:
        snprintf(row->target, sizeof row->target, "<= %g %s", abs_limit, row->unit);
        row->met = row->p50 <= abs_limit;
        break;
    case BENCH_GOAL_BOTH_MAX:
        snprintf(row->target, sizeof row->target, "<= %g %s, <= %gx", abs_limit, row->unit, limit);
        row->met = row->p50 <= abs_limit && row->ratio <= limit;
        break;
    }
    /* A NAN value compares false: an unmeasured row never counts as met. */
    if (isnan(row->p50)) row->met = 0;
}

void bench_row_note(struct bench_row *row, const char *fmt, ...)
{
    va_list ap;

    if (row == NULL) return;
    va_start(ap, fmt);
    vsnprintf(row->note, sizeof row->note, fmt, ap);
    va_end(ap);
}

void bench_info_add(struct bench_report *r, const char *key, double value, const char *unit)
{
    struct bench_info *i;

    if (r->ninfo == BENCH_MAX_INFO) return;
    i = &r->info[r->ninfo++];
    snprintf(i->key, sizeof i->key, "%s", key);
    i->value = value;
    i->unit = unit;
}

const char *bench_size_name(uint64_t bytes, char *buf, size_t cap)
{
    if (bytes >= BENCH_MIB && bytes % BENCH_MIB == 0)
        snprintf(buf, cap, "%llu MiB", (unsigned long long)(bytes / BENCH_MIB));
    else if (bytes >= BENCH_KIB && bytes % BENCH_KIB == 0)
        snprintf(buf, cap, "%llu KiB", (unsigned long long)(bytes / BENCH_KIB));
    else
        snprintf(buf, cap, "%llu B", (unsigned long long)bytes);
    return buf;
}

/* ------------------------------------------------------------------ table */

static void cell(FILE *f, double v, int width)
{
    double mag = v < 0 ? -v : v;

    if (isnan(v))
        fprintf(f, " %*s", width, "-");
    else if (mag >= 1e5)
        fprintf(f, " %*.3g", width, v);
    else
        fprintf(f, " %*.*f", width, mag >= 100 ? 1 : 2, v);
}

static const char *verdict(const struct bench_row *row)
{
    if (row->failed) return "ERROR";
    if (row->skipped) return "skipped";
    if (row->met < 0) return "-";
    return row->met ? "yes" : "NO";
}

void bench_print_table(FILE *f, const struct bench_report *r)
{
    fprintf(f, "\n%-3s %-38s %-5s %10s %10s %10s %8s %-22s %s\n", "id", "scenario", "unit", "p50",
            "p99", "floor p50", "ratio", "target", "met");
    for (size_t i = 0; i < r->nrows; i++) {
        const struct bench_row *row = &r->rows[i];
        fprintf(f, "%-3s %-38s %-5s", row->id, row->label, row->unit ? row->unit : "");
        cell(f, row->p50, 10);
        cell(f, row->p99, 10);
        cell(f, row->floor_p50, 10);
        cell(f, row->ratio, 8);
        fprintf(f, " %-22s %s\n", row->target[0] ? row->target : "-", verdict(row));
        if (row->note[0]) fprintf(f, "    %s\n", row->note);
    }
}

/* ------------------------------------------------------------------- JSON */

static void json_num(FILE *f, double v)
{
    if (isnan(v) || isinf(v))
        fputs("null", f);
    else
        fprintf(f, "%.6g", v);
}

static void json_row(FILE *f, const struct bench_row *row)
{
    fprintf(f, "    {\"id\": \"%s\", \"case\": ", row->id);
    cli_json_string(f, row->label);
    fprintf(f, ", \"unit\": \"%s\", \"p50\": ", row->unit ? row->unit : "");
    json_num(f, row->p50);
    fputs(", \"p99\": ", f);
    json_num(f, row->p99);
    fputs(", \"floor_p50\": ", f);
    json_num(f, row->floor_p50);
    fputs(", \"ratio\": ", f);
    json_num(f, row->ratio);
    fputs(", \"target\": ", f);
    cli_json_string(f, row->target);
    fprintf(f, ", \"met\": %s, \"skipped\": %s, \"failed\": %s, \"note\": ",
            row->met < 0 ? "null"
            : row->met   ? "true"
                         : "false",
            row->skipped ? "true" : "false", row->failed ? "true" : "false");
    cli_json_string(f, row->note);
    fputc('}', f);
}

static void json_series(FILE *f, const struct bench_series *s)
{
    struct bench_summary m;

    bench_summarize(s, &m);
    fputs("    {\"name\": ", f);
    cli_json_string(f, s->name);
    fprintf(f, ", \"unit\": \"%s\", \"n\": %zu, \"p50\": ", s->unit, m.n);
    json_num(f, m.p50);
    fputs(", \"p99\": ", f);
    json_num(f, m.p99);
    fputs(", \"mean\": ", f);
    json_num(f, m.mean);
    fputs(", \"min\": ", f);
    json_num(f, m.min);
    fputs(", \"max\": ", f);
    json_num(f, m.max);
    fputs(", \"samples\": [", f);
    for (size_t i = 0; i < s->n; i++) {
        if (i) fputs(", ", f);
        json_num(f, s->v[i]);
    }
    fputs("]}", f);
}

static void json_head(FILE *f, const struct bench_report *r, const struct bench_opts *o)
{
    fprintf(f, "{\n  \"tool\": \"vmmt bench\",\n  \"version\": \"%s\",\n  \"date\": \"%s\",\n",
            VMMT_VERSION_STRING, r->date);
    fprintf(f, "  \"driver\": \"%s\",\n  \"driver_version\": %d,\n  \"device\": ", r->driver,
            r->driver_version);
    cli_json_string(f, r->device_name);
    fprintf(f, ",\n  \"device_index\": %d,\n  \"handle_type\": \"%s\",\n  \"handoff\": \"%s\",\n",
            o->device, r->handle_type, r->handoff);
    fprintf(f, "  \"device_count\": %d,\n  \"peer_device\": %d,\n", r->device_count,
            o->peer_device);
    fprintf(f, "  \"quick\": %s,\n  \"reps\": %d,\n  \"timer\": \"CLOCK_MONOTONIC, us\",\n",
            o->quick ? "true" : "false", o->reps);
}

int bench_write_json(const char *path, const struct bench_report *r, const struct bench_opts *o)
{
    FILE *f = fopen(path, "w");

    if (f == NULL) return -1;
    json_head(f, r, o);
    fputs("  \"info\": {", f);
    for (size_t i = 0; i < r->ninfo; i++) {
        fprintf(f, "%s\n    ", i ? "," : "");
        cli_json_string(f, r->info[i].key);
        fputs(": {\"value\": ", f);
        json_num(f, r->info[i].value);
        fprintf(f, ", \"unit\": \"%s\"}", r->info[i].unit);
    }
    fputs("\n  },\n  \"results\": [\n", f);
    for (size_t i = 0; i < r->nrows; i++) {
        json_row(f, &r->rows[i]);
        fputs(i + 1 < r->nrows ? ",\n" : "\n", f);
    }
    fputs("  ],\n  \"series\": [\n", f);
    for (size_t i = 0; i < r->nseries; i++) {
        json_series(f, &r->series[i]);
        fputs(i + 1 < r->nseries ? ",\n" : "\n", f);
    }
    fputs("  ]\n}\n", f);
    return fclose(f) == 0 ? 0 : -1;
}

void bench_report_free(struct bench_report *r)
{
    for (size_t i = 0; i < r->nseries; i++)
        free(r->series[i].v);
    r->nseries = 0;
}
