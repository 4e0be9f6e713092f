/*
 * td_log: the leveled stderr logger. Control characters in a message are escaped (\xNN),
 * so every event stays one line whatever a client sent.
 */
#include "td_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static td_log_level_t log_level = TD_LOG_WARN;

void td_log_set_level(td_log_level_t level)
{
    log_level = level;
}

td_log_level_t td_log_get_level(void)
{
    return log_level;
}

int td_log_parse_level(const char *s)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

void td_log(td_log_level_t level, const char *fmt, ...)
{
    static const char *const tags[] = {"error", "warn", "info", "debug"};
    if (level > log_level)
        return;
    char msg[2048], line[2048 + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* one event, one line: a client's bytes in a message (a request id, a model name, a
       stop string) cannot start a forged line or drive the terminal; control characters
       are written as \xNN */
    int n = snprintf(line, sizeof line, "tandem: %s: ", tags[level]);
    size_t o = (size_t)n;
    for (const unsigned char *p = (const unsigned char *)msg; *p && o + 5 < sizeof line; p++) {
        if (*p < 0x20 || *p == 0x7f)
            o += (size_t)snprintf(line + o, sizeof line - o, "\\x%02x", *p);
        else
            line[o++] = (char)*p;
    }
    line[o] = '\0';
    fprintf(stderr, "%s\n", line);
}
