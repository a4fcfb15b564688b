/*
 * The latency benchmarks' clock.  A latency run reads the clock twice per
 * round trip, so its cost is part of every figure: clock_gettime costs some
 * 20-25 ns here, as much as a third of a shared-memory round trip.  The
 * stock tools we compare against read the CPU's time-stamp counter instead
 * (ucx_perftest's ucs_get_time, perftest's get_cycles), so that is what these
 * benchmarks read too, where it runs at a constant rate: on x86-64 with the
 * invariant-TSC CPUID bit, or where the kernel keeps its own clock on it
 * (clocksource "tsc": it does so only for a counter it found stable and in
 * step across CPUs; a VM's CPU often lacks the CPUID bit, and there
 * clock_gettime costs some 75 ns).  A run is timed in ticks, and its ticks
 * are converted to nanoseconds with the rate measured against
 * CLOCK_MONOTONIC over the same run.  Elsewhere ticks are nanoseconds of
 * CLOCK_MONOTONIC.
 *
 *   bench_span span;
 *   bench_span_start(&span);
 *   ... t0 = bench_ticks(); ...; rtt[i] = bench_ticks() - t0; ...
 *   bench_span_to_ns(&span, rtt, n);   (converts rtt[] in place)
 */
#ifndef RBR_BENCH_CLOCK_H
#define RBR_BENCH_CLOCK_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common.h" /* ex_now_ns: CLOCK_MONOTONIC in nanoseconds */

#if defined(__x86_64__)
#include <cpuid.h>
#include <x86intrin.h>
#endif

/* 1 when ticks come from the time-stamp counter (checked once). */
static inline int bench_uses_tsc(void)
{
    static int known = -1;

    if (known < 0) {
        known = 0;
#if defined(__x86_64__)
        {
            unsigned a, b, c, d;

            /* CPUID 0x80000007, EDX bit 8: the counter runs at a constant
             * rate in every power state. */
            if (__get_cpuid(0x80000000u, &a, &b, &c, &d) && a >= 0x80000007u &&
                __get_cpuid(0x80000007u, &a, &b, &c, &d) && (d & (1u << 8)))
                known = 1;
        }
        if (!known) {
            FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/"
                            "current_clocksource", "r");
            char name[16] = "";

            if (f) {
                if (fgets(name, sizeof name, f) && strcmp(name, "tsc\n") == 0)
                    known = 1;
                fclose(f);
            }
        }
#endif
    }
    return known;
}

static inline uint64_t bench_ticks(void)
{
#if defined(__x86_64__)
    if (bench_uses_tsc())
        return __rdtsc();
#endif
    return ex_now_ns();
}

/* A stretch of time whose ticks are converted with the rate it measured. */
typedef struct {
    uint64_t ticks;
    uint64_t ns;
} bench_span;

static inline void bench_span_start(bench_span *s)
{
    (void)bench_uses_tsc();
    s->ns = ex_now_ns();
    s->ticks = bench_ticks();
}

/* Nanoseconds per tick from the span's start to now (1 without the TSC, or
 * if no time passed). */
static inline double bench_span_rate(const bench_span *s)
{
    uint64_t ticks = bench_ticks();
    uint64_t ns = ex_now_ns();

    if (!bench_uses_tsc() || ticks <= s->ticks || ns <= s->ns)
        return 1.0;
    return (double)(ns - s->ns) / (double)(ticks - s->ticks);
}

/* Converts v[0..n) from ticks to nanoseconds, at the span's rate. */
static inline void bench_span_to_ns(const bench_span *s, uint64_t *v, size_t n)
{
    double rate = bench_span_rate(s);

    for (size_t i = 0; i < n; i++)
        v[i] = (uint64_t)((double)v[i] * rate + 0.5);
}

#endif
