/*
 * agent.c -- cluster mode: the Unix-socket client of the node server
 * (`instride serve`). One connection per request, one line each way (a CONSUME's answer may
 * come after progress lines, see below):
 *
 *     CONSUME <timeout_ms|-1> <key>\n  ->  [WAIT <ms>\n ...] OK <path>\n | ERR <errno> <msg>\n
 *     PUBLISH <key>\n                  ->  OK <path>\n | ERR <errno> <msg>\n
 *     OVERWRITE <key>\n                ->  OK <path>\n | ERR <errno> <msg>\n
 *     DELETE <key>\n                   ->  OK <path>\n | ERR <errno> <msg>\n
 *     LOOKUP <key>\n                   ->  OK 1\n (published) | OK 0\n | ERR <errno> <msg>\n
 *
 * A CONSUME's timeout bounds the wait for the key's publication, not the fetch of its bytes
 * from its owner node that follows (a large file on a slow link may take longer). While such a
 * fetch runs past the timeout (and a second after the request at the earliest: never on the
 * fast path), the server sends a progress line "WAIT <ms since the request>" about every
 * second; the answer line follows them. We wait for the answer INSTRIDE_TIMEOUT + INS_GRACE_MS,
 * and each progress line re-arms INS_GRACE_MS: a transfer that goes on is waited for, a server
 * that stops reporting (hung mid-fetch) still ends the wait, ETIMEDOUT.
 *
 * CONSUME -1 means "no timeout was set": the server applies its own INSTRIDE_TIMEOUT. An
 * explicit INSTRIDE_TIMEOUT=inf (or 1e9 s and more) is sent as INS_FOREVER_MS, the longest
 * timeout the server accepts (src/instride/agent.py MAX_TIMEOUT_MS, ~31 years): forever,
 * whatever the server's own setting.
 *
 * PUBLISH records the key write-once (ERR 17 and the local file removed when
 * another node published it first); OVERWRITE (INSTRIDE_OVERWRITE=1) records a
 * new version replacing any earlier one. DELETE tells that the key's file on this node was
 * removed (the preload library's unlink/remove of a key, or its rename away): where it was the
 * node's original, the server deletes the key's record, only while it is the one it looked
 * up (a publication made meanwhile stays; other nodes no longer see the key; it may be
 * published again); a fetched copy removed is
 * that node's cache only, and its record stays. Its answer is waited for as a publication's.
 */
#include "ins_core.h"

#include <limits.h>
#include <math.h>
#include <poll.h>
#include <sys/time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

/* The longest CONSUME timeout the node server accepts (agent.py MAX_TIMEOUT_MS). */
#define INS_FOREVER_MS 1000000000000LL

/* What we allow the node server on top of a CONSUME's timeout for its answer, and after each of
 * its progress lines (it sends one about every second while a fetch runs past the timeout). */
#define INS_GRACE_MS 5000

/* Connect to the node server's socket, within deadline (ins_now() seconds; < 0: no bound):
 * a connect to a server that does not accept (stopped, hung: its backlog full) fails with
 * ETIMEDOUT then, never blocks past it. Returns the socket (blocking) or -1 with errno. */
static int ins_agent_connect(double deadline)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    size_t plen = strlen(ins_cfg.socket_path);
    if (plen == 0 || plen >= sizeof sa.sun_path)
        return ins_fail(ENAMETOOLONG, "node server socket path is too long: %.200s",
                        ins_cfg.socket_path);
    memcpy(sa.sun_path, ins_cfg.socket_path, plen + 1);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return ins_fail(EIO, "cannot make a socket: %s", strerror(errno));
    /* A Unix socket's connect blocks while the server's queue of connections is full, woken
     * as soon as there is room, for at most the socket's send timeout (then EAGAIN). */
    int rc;
    for (;;) {
        if (deadline >= 0) {
            int ms = ins_remaining_ms(deadline);
            struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
            if (ms == 0 || setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
                errno = EAGAIN;
                rc = -1;
                break;
            }
        }
        rc = connect(s, (struct sockaddr *)&sa, sizeof sa);
        if (rc == 0 || errno != EINTR)
            break;
    }
    if (rc != 0 && errno == EAGAIN) {
        ins_sys.close(s);
        return ins_fail(ETIMEDOUT, "the node server at %.200s did not accept a connection in "
                        "time (stopped or overloaded?)", ins_cfg.socket_path);
    }
    if (rc == 0 && deadline >= 0) { /* (the request's own sends: no timeout) */
        struct timeval none = {0, 0};
        (void)setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
    }
    if (rc != 0) {
        int e = errno;
        ins_sys.close(s);
        if (e == ENOENT || e == ECONNREFUSED)
            return ins_fail(ECONNREFUSED, "no node server listens on %.200s (is `instride serve` running?)",
                            ins_cfg.socket_path);
        return ins_fail(EIO, "cannot reach the node server at %.200s: %s", ins_cfg.socket_path,
                        strerror(e));
    }
    return s;
}

/* Whether the line (its newline cut) is a CONSUME's progress line: "WAIT" and what follows. */
static int ins_progress_line(const char *line)
{
    return strncmp(line, "WAIT", 4) == 0 && (line[4] == ' ' || line[4] == '\0');
}

/* One request, one reply line (without its newline) in reply. wait_ms < 0: no bound.
 * progress: progress lines may come before the answer (CONSUME): each is dropped, and the
 * deadline pushed to INS_GRACE_MS from its arrival where that is later. */
static int ins_agent_request(const char *req, char *reply, size_t cap, int wait_ms, int progress)
{
    int rc = -1, rearmed = 0;
    double deadline = wait_ms < 0 ? -1.0 : ins_now() + wait_ms / 1000.0;
    int s = ins_agent_connect(deadline);
    if (s < 0)
        return -1;
    size_t len = strlen(req), off = 0;
    while (off < len) {
        ssize_t n = send(s, req + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ins_fail(EIO, "lost the connection to the node server while sending");
            goto cleanup;
        }
        off += (size_t)n;
    }
    size_t got = 0; /* bytes in reply: never a whole line */
    for (;;) {
        struct pollfd pfd = {.fd = s, .events = POLLIN};
        int prc = poll(&pfd, 1, ins_remaining_ms(deadline));
        if (prc < 0 && errno == EINTR)
            continue;
        if (prc == 0) {
            if (rearmed)
                ins_fail(ETIMEDOUT, "the node server reported progress fetching the key, then "
                         "fell silent (%d ms and more: hung?)", INS_GRACE_MS);
            else
                ins_fail(ETIMEDOUT, "the node server did not answer within %d ms", wait_ms);
            goto cleanup;
        }
        if (prc < 0 || got + 1 >= cap) {
            ins_fail(EIO, "bad reply from the node server (too long or poll failed)");
            goto cleanup;
        }
        ssize_t n = recv(s, reply + got, cap - 1 - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            ins_fail(EIO, "the node server closed the connection without an answer");
            goto cleanup;
        }
        got += (size_t)n;
        reply[got] = '\0';
        char *nl;
        while ((nl = memchr(reply, '\n', got)) != NULL) {
            *nl = '\0';
            if (!progress || !ins_progress_line(reply))
                goto answered;
            /* a progress line: dropped (what came after it moves up), the deadline re-armed */
            size_t line = (size_t)(nl + 1 - reply);
            memmove(reply, nl + 1, got - line + 1);
            got -= line;
            double later = ins_now() + INS_GRACE_MS / 1000.0;
            if (deadline >= 0 && later > deadline)
                deadline = later;
            rearmed = 1;
        }
    }
answered:
    rc = 0;
cleanup:
    {
        int e = errno;
        ins_sys.close(s);
        errno = e;
    }
    return rc;
}

/* Parse "OK <path>" (path copied to out, may be NULL) or "ERR <n> <msg>". */
static int ins_agent_reply(const char *key, const char *reply, char *out)
{
    if (strncmp(reply, "OK", 2) == 0 && (reply[2] == ' ' || reply[2] == '\0')) {
        const char *path = reply[2] ? reply + 3 : "";
        if (out != NULL) {
            size_t n = strlen(path);
            if (n == 0 || path[0] != '/' || n >= PATH_MAX)
                return ins_fail(EIO, "node server answered %.40s for key %.200s: not a path",
                                reply, key);
            memcpy(out, path, n + 1);
        }
        return 0;
    }
    if (strncmp(reply, "ERR ", 4) == 0) {
        char *end = NULL;
        long e = strtol(reply + 4, &end, 10);
        int err = (end != reply + 4 && e > 0 && e < 4096) ? (int)e : EIO;
        const char *msg = (end != NULL && *end == ' ') ? end + 1 : "";
        return ins_fail(err, "node server: %.300s (key %.150s)", msg, key);
    }
    return ins_fail(EIO, "malformed reply from the node server: %.100s", reply);
}

static int ins_key_ok(const char *key)
{
    if (strchr(key, '\n') == NULL && strchr(key, '\r') == NULL)
        return 1;
    ins_fail(EINVAL, "a key containing a newline cannot be sent to the node server");
    return 0;
}

/* How long to wait for the server's reply: it bounds a CONSUME's wait for the publication by
 * the timeout we send; we allow it INS_GRACE_MS on top (re-armed by its progress lines while it
 * fetches the key). No INSTRIDE_TIMEOUT: no bound. */
static int ins_reply_wait_ms(void)
{
    if (ins_cfg.timeout >= 0) /* (at most INT_MAX ms: ~24 days) */
        return ins_cfg.timeout * 1000.0 < INT_MAX - (double)INS_GRACE_MS
                   ? (int)(ins_cfg.timeout * 1000.0) + INS_GRACE_MS
                   : INT_MAX;
    return -1;
}

/* How long to wait for a publication's answer: bounded even without INSTRIDE_TIMEOUT (a node
 * server that accepted the connection and hangs must not hold close() for ever): at most 12
 * times INSTRIDE_CONNECT_TIMEOUT (60 s by default), which bounds each of the server's own
 * round trips to Redis. */
static int ins_publish_wait_ms(void)
{
    double cap = 12.0 * ins_cfg.connect_timeout * 1000.0;
    int bound = cap < INT_MAX ? (int)cap : INT_MAX, ms = ins_reply_wait_ms();
    return ms >= 0 && ms < bound ? ms : bound;
}

int ins_agent_publish(const char *key, int overwrite)
{
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 32], reply[PATH_MAX + 128];
    snprintf(req, sizeof req, "%s %s\n", overwrite ? "OVERWRITE" : "PUBLISH", key);
    if (ins_agent_request(req, reply, sizeof reply, ins_publish_wait_ms(), 0) != 0)
        return -1;
    return ins_agent_reply(key, reply, NULL);
}

int ins_agent_delete(const char *key)
{
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 32], reply[PATH_MAX + 128];
    snprintf(req, sizeof req, "DELETE %s\n", key);
    if (ins_agent_request(req, reply, sizeof reply, ins_publish_wait_ms(), 0) != 0)
        return -1;
    return ins_agent_reply(key, reply, NULL);
}

/* The timeout a CONSUME carries: 0 or more ms; INS_FOREVER_MS for an explicit forever; -1 when
 * none was set (the server's own). */
static long long ins_consume_timeout_ms(void)
{
    if (ins_cfg.timeout >= 0) /* (below 1e9 s: at most 1e12 ms) */
        return (long long)ceil(ins_cfg.timeout * 1000.0);
    return ins_cfg.timeout_forever ? INS_FOREVER_MS : -1; /* (config.c tells which forever) */
}

static int ins_agent_consume_ms(const char *key, char open_path[PATH_MAX], long long tms,
                                int wait_ms)
{
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 64], reply[PATH_MAX + 128];
    snprintf(req, sizeof req, "CONSUME %lld %s\n", tms, key);
    if (ins_agent_request(req, reply, sizeof reply, wait_ms, 1) != 0)
        return -1;
    return ins_agent_reply(key, reply, open_path);
}

int ins_agent_consume(const char *key, char open_path[PATH_MAX])
{
    return ins_agent_consume_ms(key, open_path, ins_consume_timeout_ms(), ins_reply_wait_ms());
}

int ins_agent_consume_within(const char *key, char open_path[PATH_MAX], int ms)
{
    return ins_agent_consume_ms(key, open_path, ms, ms + INS_GRACE_MS);
}

int ins_agent_lookup(const char *key)
{
    if (!ins_key_ok(key))
        return -1;
    char req[PATH_MAX + 64], reply[PATH_MAX + 128];
    snprintf(req, sizeof req, "LOOKUP %s\n", key);
    if (ins_agent_request(req, reply, sizeof reply, INS_GRACE_MS, 0) != 0)
        return -1;
    if (strcmp(reply, "OK 1") == 0 || strcmp(reply, "OK 0") == 0)
        return reply[3] == '1';
    if (ins_agent_reply(key, reply, NULL) != 0)
        return -1;
    return ins_fail(EIO, "malformed reply from the node server: %.100s", reply);
}
