/*
 * td_log: leveled logging to stderr, one line per event: "tandem: LEVEL: message".
 *
 * Style: lowercase, `noun value`, the request id when there is one. The level is the one
 * piece of global mutable state besides signal flags; set it once at startup.
 */
#ifndef TD_LOG_H
#define TD_LOG_H

typedef enum td_log_level {
    TD_LOG_OFF = -1, /* nothing at all (the fuzz harnesses, whose inputs are mostly errors) */
    TD_LOG_ERROR = 0,
    TD_LOG_WARN = 1,
    TD_LOG_INFO = 2,
    TD_LOG_DEBUG = 3,
} td_log_level_t;

/* Sets the level below which messages are dropped. Call before starting threads. */
void td_log_set_level(td_log_level_t level);

td_log_level_t td_log_get_level(void);

/* Parses "error|warn|info|debug"; returns -1 for anything else. */
int td_log_parse_level(const char *s);

/* Writes one line to stderr if `level` is enabled. Thread-safe (one fprintf per line). */
void td_log(td_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));


#define td_warn(...) td_log(TD_LOG_WARN, __VA_ARGS__)
#define td_info(...) td_log(TD_LOG_INFO, __VA_ARGS__)
#define td_debug(...) td_log(TD_LOG_DEBUG, __VA_ARGS__)

#endif /* TD_LOG_H */
