/*
 * error.c -- every failure of the core sets errno (the nearest errno, see
 * docs/preload.md) and a per-thread message that names the key; with
 * INSTRIDE_DEBUG=1 the message is also printed to stderr.
 */
#include "ins_core.h"

#include <string.h>

static INS_TLS char ins_msg[512];

int ins_fail(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(ins_msg, sizeof ins_msg, "instride: ");
    if (n > 0 && (size_t)n < sizeof ins_msg)
        vsnprintf(ins_msg + n, sizeof ins_msg - (size_t)n, fmt, ap);
    va_end(ap);
    if (ins_cfg.debug) {
        char line[600];
        int len = snprintf(line, sizeof line, "%s (errno %d, %s)\n", ins_msg, err, strerror(err));
        if (len > 0)
            (void)!write(2, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
    }
    errno = err;
    return -1;
}

const char *ins_last_message(void) { return ins_msg; }

void ins_clear_message(void) { ins_msg[0] = '\0'; }
