#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static vmmt_log_fn g_fn;
static void *g_user;
static int g_level = -2; /* -2: not read from VMMT_LOG yet; -1: off */

static int level_from_env(void)
{
    const char *s = getenv("VMMT_LOG");
    if (s == NULL || *s == '\0' || strcmp(s, "warn") == 0) return VMMT_LOG_WARN;
    if (strcmp(s, "off") == 0) return -1;
    if (strcmp(s, "error") == 0) return VMMT_LOG_ERROR;
    if (strcmp(s, "info") == 0) return VMMT_LOG_INFO;
    if (strcmp(s, "debug") == 0) return VMMT_LOG_DEBUG;
    return VMMT_LOG_WARN;
}

void vmmt_set_log(vmmt_log_fn fn, void *user)
{
    pthread_mutex_lock(&g_lock);
    g_fn = fn;
    g_user = user;
    pthread_mutex_unlock(&g_lock);
}

void vmmt_set_log_level(vmmt_log_level level)
{
    /* A level no message has would silence or flood in ways nobody asked for. */
    if ((int)level < VMMT_LOG_ERROR || (int)level > VMMT_LOG_DEBUG) return;
    pthread_mutex_lock(&g_lock);
    g_level = (int)level;
    pthread_mutex_unlock(&g_lock);
}

void vmmt__log(vmmt_log_level level, const char *fmt, ...)
{
    static const char *const names[] = {"error", "warning", "info", "debug"};
    char msg[1024];
    vmmt_log_fn fn;
    void *user;
    int max;
    va_list ap;

    pthread_mutex_lock(&g_lock);
    if (g_level == -2) g_level = level_from_env();
    max = g_level;
    fn = g_fn;
    user = g_user;
    pthread_mutex_unlock(&g_lock);
    if ((int)level > max) return;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (fn != NULL)
        fn(level, msg, user);
    else
        fprintf(stderr, "vmmt %s: %s\n", names[level], msg);
}
