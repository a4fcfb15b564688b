/*
 * write_split: an LD_PRELOAD module that splits a request-response loop's
 * time at its write(2) calls.  On soft-RoCE a post ends in one write() to the
 * verbs device (the doorbell), and the kernel runs the whole exchange inside
 * it: requester, the peer's responder, completer.  So for a loop of "post,
 * poll until the completion" the time inside write() is the kernel's share of
 * a round trip, and the time from one write's return to the next write is
 * the program's own: the provider's poll and post, and whatever library sits
 * between the program and the provider.
 *
 * benchmarks/verbs-progress-guest.sh preloads it into ib_read_lat's client
 * and into rbr_rma_bench's (2 B reads), side by side.  At exit a process that
 * made at least 100 writes to descriptors above 2 prints, on stderr:
 *
 *   SPLIT writes=N in_write_p50_us=A outside_p50_us=B
 *
 * over its last 65,536 writes (both medians; "outside" is measured from the
 * previous such write's return).  Time comes from the time-stamp counter on
 * x86-64 (converted at the rate measured against CLOCK_MONOTONIC over the
 * process's life), else from CLOCK_MONOTONIC.  The two clock reads per write
 * cost the same for every program measured.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#define KEEP 65536u

static ssize_t (*real_write)(int, const void *, size_t);
static uint64_t inside[KEEP], outside[KEEP], last_end, start_ticks, start_ns;
static unsigned count;

static uint64_t mono_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static uint64_t ticks(void)
{
#if defined(__x86_64__)
    return __rdtsc();
#else
    return mono_ns();
#endif
}

__attribute__((constructor)) static void split_start(void)
{
    start_ns = mono_ns();
    start_ticks = ticks();
}

ssize_t write(int fd, const void *buf, size_t len)
{
    uint64_t t0, t1;
    ssize_t r;

    if (!real_write)
        *(void **)&real_write = dlsym(RTLD_NEXT, "write");
    t0 = ticks();
    r = real_write(fd, buf, len);
    t1 = ticks();
    if (fd > 2) {
        if (last_end) {
            inside[count % KEEP] = t1 - t0;
            outside[count % KEEP] = t0 - last_end;
            count++;
        }
        last_end = t1;
    }
    return r;
}

static int by_value(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return (x > y) - (x < y);
}

__attribute__((destructor)) static void split_report(void)
{
    unsigned n = count < KEEP ? count : KEEP;
    uint64_t dt = ticks() - start_ticks, dn = mono_ns() - start_ns;
    double us_per_tick = dt ? (double)dn / (double)dt / 1000.0 : 0.001;

    if (n < 100)
        return;
    qsort(inside, n, sizeof inside[0], by_value);
    qsort(outside, n, sizeof outside[0], by_value);
    fprintf(stderr, "SPLIT writes=%u in_write_p50_us=%.3f outside_p50_us=%.3f\n", count,
            (double)inside[n / 2] * us_per_tick, (double)outside[n / 2] * us_per_tick);
}
