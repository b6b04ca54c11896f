/*
 * config.c -- every INSTRIDE_* environment variable the C side reads is parsed
 * here and only here, once per process, with the names and meanings of the
 * Python package's Settings (src/instride/config.py):
 *
 *   INSTRIDE_DIR        managed directory (default /dev/shm/instride-<uid>, else
 *                       ${TMPDIR:-/tmp}/instride-<uid>)
 *   INSTRIDE_TIMEOUT    seconds a consume waits, the meaning of Python's
 *                       parse_timeout and `--timeout`: unset, empty, inf:
 *                       forever; 0: do not wait (a key not yet published fails
 *                       at once with ETIMEDOUT); negative or not a number:
 *                       refused (every consume fails with EINVAL)
 *   INSTRIDE_FSYNC      1/true/yes/on: fsync before publishing (default 0 here)
 *   INSTRIDE_OVERWRITE  1/true/yes/on: publishing replaces an existing key
 *   INSTRIDE_CONNECT_TIMEOUT  seconds (> 0, default 5); a publication's answer from the
 *                       node server is awaited at most 12 times as long
 *   INSTRIDE_REDIS_URL  non-empty: cluster mode (talk to the node server)
 *   INSTRIDE_SOCKET     the node server's Unix socket
 *                       (default $INSTRIDE_DIR/.instride/node.sock)
 *   INSTRIDE_DEBUG      1/true/yes/on: print one line to stderr per failure
 *
 * One grammar with Python's: every value is read without the ASCII whitespace
 * (space, \t, \n, \r, \v, \f) at either end, and an empty value is unset.
 * On/off settings take 1/true/yes/on or 0/false/no/off (any case); numbers are
 * ASCII decimal ([+-]digits[.digits][e[+-]digits], no '_', no hexadecimal),
 * parsed in the "C" locale whatever the program's. A value Python refuses with
 * a ConfigError is refused here too: a library cannot exit its host program, so
 * every consume and publication then fails with EINVAL and a message naming the
 * setting (printed with INSTRIDE_DEBUG=1; a refused INSTRIDE_DEBUG itself turns
 * the diagnostics on, so that its refusal is seen).
 */
#include "ins_core.h"

#include <locale.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

INS_HIDDEN struct ins_config ins_cfg;

static pthread_once_t ins_config_once = PTHREAD_ONCE_INIT;

/* The whitespace stripped from both ends of every value (config.WHITESPACE). */
static int ins_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f';
}

/* *s without the whitespace at either end; *n its length. NULL stays NULL. */
static const char *ins_strip(const char *s, size_t *n)
{
    *n = 0;
    if (s == NULL)
        return NULL;
    while (ins_space(*s))
        s++;
    size_t len = strlen(s);
    while (len > 0 && ins_space(s[len - 1]))
        len--;
    *n = len;
    return s;
}

/* Remember the first refused setting: consumes and publications fail naming it. */
static void ins_refuse(struct ins_config *c, const char *fmt, const char *name, const char *raw)
{
    if (!c->timeout_bad)
        snprintf(c->bad_msg, sizeof c->bad_msg, fmt, name, raw);
    c->timeout_bad = 1;
}

/* Whether t[0, n) is a number of the one grammar: [+-]digits[.digits][e[+-]digits]
 * (or [+-].digits...), ASCII only (config._NUMBER). */
static int ins_number_syntax(const char *t, size_t n)
{
    size_t i = 0, digits = 0;
    if (i < n && (t[i] == '+' || t[i] == '-'))
        i++;
    while (i < n && t[i] >= '0' && t[i] <= '9')
        i++, digits++;
    if (i < n && t[i] == '.') {
        i++;
        while (i < n && t[i] >= '0' && t[i] <= '9')
            i++, digits++;
    }
    if (digits == 0)
        return 0;
    if (i < n && (t[i] == 'e' || t[i] == 'E')) {
        i++;
        if (i < n && (t[i] == '+' || t[i] == '-'))
            i++;
        size_t exp = 0;
        while (i < n && t[i] >= '0' && t[i] <= '9')
            i++, exp++;
        if (exp == 0)
            return 0;
    }
    return i == n;
}

/* strtod in the "C" locale (a program in a decimal-comma locale reads "2.5" too). */
static double ins_strtod_c(const char *t, char **end)
{
    locale_t c = newlocale(LC_ALL_MASK, "C", (locale_t)0);
    if (c == (locale_t)0) /* out of memory: the program's locale, "C" unless it chose one */
        return strtod(t, end);
    double v = strtod_l(t, end, c);
    freelocale(c);
    return v;
}

/* INSTRIDE_TIMEOUT: -1 (forever) when unset, empty or inf/infinity/forever/none;
 * 0 or more seconds otherwise (1e9 and more: forever, like Python's parse_timeout);
 * negative, NaN or not a number: refused. */
static void ins_parse_timeout(const char *raw, struct ins_config *c)
{
    size_t n;
    const char *t = ins_strip(raw, &n);
    c->timeout = -1.0;
    c->timeout_forever = 0;
    if (n == 0)
        return;
    static const char *const forever[] = {"inf", "infinity", "forever", "none"};
    for (size_t i = 0; i < sizeof forever / sizeof forever[0]; i++)
        if (strlen(forever[i]) == n && strncasecmp(t, forever[i], n) == 0) {
            c->timeout_forever = 1;
            return;
        }
    char *end = NULL;
    double v = ins_number_syntax(t, n) ? ins_strtod_c(t, &end) : -1.0;
    if (end != t + n || v != v || v < 0.0) { /* "-1", "nan", "soon", "1_0": refused */
        ins_refuse(c, "%s must be >= 0 seconds (0: do not wait; unset or inf: forever), "
                      "not \"%.40s\"", "INSTRIDE_TIMEOUT", raw);
        return;
    }
    if (v < 1e9) /* longer than ~31 years (and inf): forever */
        c->timeout = v;
    else
        c->timeout_forever = 1;
}

/* INSTRIDE_CONNECT_TIMEOUT: seconds above 0, at most 2147483 (Python's parse_seconds);
 * unset or empty: 5; anything else refused (and 5). */
static void ins_parse_connect_timeout(const char *raw, struct ins_config *c)
{
    size_t n;
    const char *t = ins_strip(raw, &n);
    c->connect_timeout = 5.0;
    if (n == 0)
        return;
    char *end = NULL;
    double v = ins_number_syntax(t, n) ? ins_strtod_c(t, &end) : -1.0;
    if (end != t + n || v != v || v <= 0.0 || v > 2147483.0) {
        ins_refuse(c, "%s must be a number of seconds above 0 and at most 2147483, "
                      "not \"%.40s\"", "INSTRIDE_CONNECT_TIMEOUT", raw);
        return;
    }
    c->connect_timeout = v;
}

/* An on/off setting: 1/true/yes/on or 0/false/no/off (any case); unset or empty:
 * dflt; anything else refused (and dflt). */
static int ins_env_bool(struct ins_config *c, const char *name, int dflt)
{
    const char *raw = getenv(name);
    size_t n;
    const char *v = ins_strip(raw, &n);
    if (n == 0)
        return dflt;
    static const char *const on[] = {"1", "true", "yes", "on"};
    static const char *const off[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (strlen(on[i]) == n && strncasecmp(v, on[i], n) == 0)
            return 1;
        if (strlen(off[i]) == n && strncasecmp(v, off[i], n) == 0)
            return 0;
    }
    ins_refuse(c, "%s must be 0/1/true/false (or yes/no, on/off), not \"%.40s\"", name, raw);
    return dflt;
}

/* A text setting without its surrounding whitespace into buf; 0 when unset or empty. */
static int ins_env_text(const char *name, char *buf, size_t cap)
{
    size_t n;
    const char *v = ins_strip(getenv(name), &n);
    if (n == 0)
        return 0;
    snprintf(buf, cap, "%.*s", (int)(n < cap ? n : cap - 1), v);
    return 1;
}

static void ins_default_dir(char *buf, size_t cap)
{
    struct stat st;
    unsigned uid = (unsigned)getuid();
    if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK | X_OK) == 0) {
        snprintf(buf, cap, "/dev/shm/instride-%u", uid);
        return;
    }
    const char *t = getenv("TMPDIR");
    if (t == NULL || t[0] == '\0')
        t = "/tmp";
    snprintf(buf, cap, "%s/instride-%u", t, uid);
}

/* The kernel hands back physical paths for dirfds, and keys are resolved beneath
 * the real path with no symbolic link followed: know the real one. When the
 * directory does not exist yet, its longest existing ancestor is resolved and
 * the rest appended. */
static void ins_real_dir(struct ins_config *c)
{
    char probe[PATH_MAX], real[PATH_MAX];
    memcpy(probe, c->dir, c->dir_len + 1);
    size_t cut = c->dir_len; /* probe = dir[0, cut) */
    while (realpath(probe, real) == NULL) {
        char *slash = strrchr(probe, '/');
        if (slash == NULL || slash == probe) { /* nothing exists but "/" */
            memcpy(real, "/", 2);
            cut = 0;
            break;
        }
        *slash = '\0';
        cut = (size_t)(slash - probe);
    }
    const char *rest = c->dir + cut; /* "" or "/a/b" */
    size_t rlen = strlen(real);
    if (rlen == 1 && rest[0] == '/') /* real is "/" */
        rlen = 0;
    if (rlen + strlen(rest) + 1 > sizeof real)
        return;
    memcpy(real + rlen, rest, strlen(rest) + 1);
    if (real[0] == '/' && strcmp(real, c->dir) != 0) {
        memcpy(c->dir_real, real, strlen(real) + 1);
        c->dir_real_len = strlen(real);
    }
}

static void ins_read_config(void)
{
    struct ins_config *c = &ins_cfg;
    char buf[PATH_MAX];
    memset(c, 0, sizeof *c);

    if (!ins_env_text("INSTRIDE_DIR", buf, sizeof buf))
        ins_default_dir(buf, sizeof buf);
    if (ins_absolute(AT_FDCWD, buf, c->dir) == 0 && ins_normalize(c->dir) == 0)
        c->dir_len = strlen(c->dir);
    if (c->dir_len > 0)
        ins_real_dir(c);

    if (!ins_env_text("INSTRIDE_SOCKET", c->socket_path, sizeof c->socket_path) &&
        c->dir_len > 0 && c->dir_len + 20 < sizeof c->socket_path)
        snprintf(c->socket_path, sizeof c->socket_path, "%s/.instride/node.sock", c->dir);

    ins_parse_timeout(getenv("INSTRIDE_TIMEOUT"), c);
    ins_parse_connect_timeout(getenv("INSTRIDE_CONNECT_TIMEOUT"), c);
    c->fsync = ins_env_bool(c, "INSTRIDE_FSYNC", 0);
    c->overwrite = ins_env_bool(c, "INSTRIDE_OVERWRITE", 0);
    size_t n;
    c->cluster = ins_strip(getenv("INSTRIDE_REDIS_URL"), &n) != NULL && n > 0;
    int bad = c->timeout_bad;
    c->debug = ins_env_bool(c, "INSTRIDE_DEBUG", 0);
    if (c->timeout_bad && !bad) /* INSTRIDE_DEBUG itself refused: show the refusal */
        c->debug = 1;
}

void ins_config_load(void)
{
    int saved = errno;
    pthread_once(&ins_config_once, ins_read_config);
    errno = saved;
}

const char *ins_root(size_t *len)
{
    if (ins_cfg.dir_real_len > 0) {
        *len = ins_cfg.dir_real_len;
        return ins_cfg.dir_real;
    }
    *len = ins_cfg.dir_len;
    return ins_cfg.dir;
}
