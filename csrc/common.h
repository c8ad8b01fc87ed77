// Internal helpers shared by the C core.
#pragma once

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

// Write a one-line message into a caller's buffer (may be NULL).
static inline void dflash_seterr(char * err, size_t err_len, const char * fmt, ...) {
    if (!err || err_len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

static inline double dflash_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
