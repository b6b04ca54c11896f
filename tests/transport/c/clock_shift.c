/*
 * clock_shift.c -- an LD_PRELOAD library for a data server under test: the wall clock
 * (CLOCK_REALTIME) reads $CLOCK_SHIFT_S seconds ahead of the kernel's, as a clock that jumps
 * back by that much just after it is read would look to a wait bounded on it (a deadline
 * computed from the clock read, the kernel's futex waiting on the real one). The monotonic
 * clock is left alone.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

int clock_gettime(clockid_t clk, struct timespec *ts)
{
    static int (*real)(clockid_t, struct timespec *);
    if (real == NULL)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    const char *shift = getenv("CLOCK_SHIFT_S");
    if (rc == 0 && clk == CLOCK_REALTIME && shift != NULL)
        ts->tv_sec += atol(shift);
    return rc;
}
