/*
 * main() for the fuzz targets where libFuzzer is not linked (gcc, the
 * ordinary build): replays every file named, or every file in the
 * directories named, through LLVMFuzzerTestOneInput. CTest runs it on the
 * committed corpus (tests/fuzz/corpus/<target>/), so every input that once
 * mattered is checked on every build.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

#define FUZZ_MAX_INPUT (1u << 20)

static int replay_file(const char *path, unsigned long *count)
{
    FILE *f = fopen(path, "rb");
    uint8_t *buf;
    size_t n;

    if (f == NULL) {
        perror(path);
        return 1;
    }
    buf = malloc(FUZZ_MAX_INPUT);
    if (buf == NULL) {
        fclose(f);
        return 1;
    }
    n = fread(buf, 1, FUZZ_MAX_INPUT, f);
    fclose(f);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    (*count)++;
    return 0;
}

static int replay(const char *path, unsigned long *count)
{
    struct stat st;
    struct dirent *e;
    DIR *d;
    int bad = 0;

    if (stat(path, &st) != 0) {
        perror(path);
        return 1;
    }
    if (!S_ISDIR(st.st_mode)) return replay_file(path, count);
    d = opendir(path);
    if (d == NULL) {
        perror(path);
        return 1;
    }
    while ((e = readdir(d)) != NULL) {
        char sub[4096];
        if (e->d_name[0] == '.') continue;
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        bad |= replay(sub, count);
    }
    closedir(d);
    return bad;
}

int main(int argc, char **argv)
{
    unsigned long count = 0;
    int bad = 0;

    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++)
        bad |= replay(argv[i], &count);
    printf("%s: %lu inputs replayed\n", argv[0], count);
    /* An empty corpus proves nothing: fail rather than pass silently. */
    return bad || count == 0;
}
