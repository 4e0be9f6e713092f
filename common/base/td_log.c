/*
 * td_log: the leveled stderr logger.
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
    char line[2048];
    int n = snprintf(line, sizeof line, "tandem: %s: ", tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line);
}
