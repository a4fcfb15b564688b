/*
 * rbr_limits: what this machine can do at best, for reading the
 * benchmark's numbers against.  Nothing here uses rdmabridge.
 *
 * Measures:
 *   memcpy   single-thread memcpy bandwidth with source and destination of
 *            SIZE bytes each (1 MiB: cache-resident on most machines;
 *            64 MiB: from and to memory), GB/s (10^9 bytes copied per
 *            second); the best of REPS timed passes after one untimed pass;
 *   line_rtt the round trip of one cache line between two threads pinned
 *            to cpu A and cpu B: each waits for the other's increment of a
 *            shared counter and answers with its own; the median over REPS
 *            runs of ITERS round trips, in ns.
 *
 * Output, one line per measurement:
 *   RESULT limits memcpy SIZE gb_s=X
 *   RESULT limits line_rtt 64 ns=X cpus=A,B
 *
 * Usage: rbr_limits [-c A,B] [-n ITERS] [-r REPS]
 *   -c A,B     the two cpus of the round trip (default 0,1)
 *   -n ITERS   round trips per run (default 1000000)
 *   -r REPS    timed memcpy passes / round-trip runs (default 5)
 * Exit status 0 unless a thread could not be made or pinned.
 */
#define _GNU_SOURCE

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_REPS 101

struct line {
    _Alignas(64) atomic_uint_fast64_t counter;
    char pad[64 - sizeof(atomic_uint_fast64_t)];
};

struct pinger {
    struct line *line;
    uint64_t iters;
    int cpu;
    int parity; /* 0: starts the exchange; 1: answers */
    int pinned;
};

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;

    return (x > y) - (x < y);
}

static int pin_self(int cpu)
{
    cpu_set_t set;

    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* Best-of-reps memcpy bandwidth for size bytes; < 0 on allocation failure. */
static double memcpy_gbs(size_t size, int reps)
{
    char *src = malloc(size);
    char *dst = malloc(size);
    double best = 0;
    size_t passes;
    int r;

    if (src == NULL || dst == NULL) {
        free(src);
        free(dst);
        return -1;
    }
    memset(src, 1, size);
    memset(dst, 2, size);
    /* Enough passes for ~256 MiB per timing, so a run takes tens of ms. */
    passes = (256u << 20) / size;
    if (passes == 0)
        passes = 1;
    memcpy(dst, src, size);
    for (r = 0; r < reps; r++) {
        uint64_t t0 = now_ns();
        uint64_t t1;
        size_t i;
        double gbs;

        for (i = 0; i < passes; i++) {
            memcpy(dst, src, size);
            /* Keep the compiler from merging the copies. */
            __asm__ __volatile__("" : : "r"(dst) : "memory");
        }
        t1 = now_ns();
        gbs = (double)size * (double)passes / (double)(t1 - t0);
        if (gbs > best)
            best = gbs;
    }
    free(src);
    free(dst);
    return best;
}

static void *pinger_main(void *arg)
{
    struct pinger *p = arg;
    uint64_t i;

    p->pinned = pin_self(p->cpu) == 0;
    if (!p->pinned)
        return NULL;
    /* The counter goes 0,1,2,...; this side writes when it sees a value
     * of its parity, and moves it to the next. */
    for (i = 0; i < p->iters; i++) {
        uint64_t want = 2 * i + (uint64_t)p->parity;

        while (atomic_load_explicit(&p->line->counter, memory_order_acquire) !=
               want)
            ;
        atomic_store_explicit(&p->line->counter, want + 1,
                              memory_order_release);
    }
    return NULL;
}

/* One run of iters round trips; ns per round trip, or < 0 on failure. */
static double line_rtt(int cpu_a, int cpu_b, uint64_t iters)
{
    static struct line line;
    struct pinger a = { &line, iters, cpu_a, 0, 0 };
    struct pinger b = { &line, iters, cpu_b, 1, 0 };
    pthread_t ta;
    pthread_t tb;
    uint64_t t0;
    uint64_t t1;

    atomic_store(&line.counter, (uint_fast64_t)-1);
    if (pthread_create(&tb, NULL, pinger_main, &b) != 0)
        return -1;
    if (pthread_create(&ta, NULL, pinger_main, &a) != 0) {
        atomic_store(&line.counter, 0);
        b.iters = 0;
        pthread_join(tb, NULL);
        return -1;
    }
    /* Both threads spin on a value they do not expect until this store;
     * the time includes their start, which is small against iters. */
    t0 = now_ns();
    atomic_store(&line.counter, 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    t1 = now_ns();
    if (!a.pinned || !b.pinned)
        return -1;
    return (double)(t1 - t0) / (double)iters;
}

int main(int argc, char **argv)
{
    static const size_t sizes[] = { 1u << 20, 64u << 20 };
    double rtts[MAX_REPS];
    int cpu_a = 0;
    int cpu_b = 1;
    long iters = 1000000;
    int reps = 5;
    size_t i;
    int ch;

    setvbuf(stdout, NULL, _IOLBF, 0);
    while ((ch = getopt(argc, argv, "c:n:r:h")) != -1) {
        switch (ch) {
        case 'c':
            if (sscanf(optarg, "%d,%d", &cpu_a, &cpu_b) != 2 || cpu_a < 0 ||
                cpu_b < 0 || cpu_a == cpu_b) {
                fprintf(stderr, "rbr_limits: bad cpu pair '%s'\n", optarg);
                return EXIT_FAILURE;
            }
            break;
        case 'n':
            iters = atol(optarg);
            if (iters <= 0) {
                fprintf(stderr, "rbr_limits: bad iteration count '%s'\n", optarg);
                return EXIT_FAILURE;
            }
            break;
        case 'r':
            reps = atoi(optarg);
            if (reps <= 0 || reps > MAX_REPS) {
                fprintf(stderr, "rbr_limits: bad repetitions '%s' (1..%d)\n",
                        optarg, MAX_REPS);
                return EXIT_FAILURE;
            }
            break;
        default:
            fprintf(stderr, "usage: %s [-c A,B] [-n ITERS] [-r REPS]\n", argv[0]);
            return EXIT_FAILURE;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "usage: %s [-c A,B] [-n ITERS] [-r REPS]\n", argv[0]);
        return EXIT_FAILURE;
    }

    for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        double gbs = memcpy_gbs(sizes[i], reps);

        if (gbs < 0) {
            fprintf(stderr, "rbr_limits: out of memory\n");
            return EXIT_FAILURE;
        }
        printf("RESULT limits memcpy %zu gb_s=%.2f\n", sizes[i], gbs);
    }
    for (i = 0; i < (size_t)reps; i++) {
        rtts[i] = line_rtt(cpu_a, cpu_b, (uint64_t)iters);
        if (rtts[i] < 0) {
            fprintf(stderr, "rbr_limits: could not run threads on cpus %d,%d\n",
                    cpu_a, cpu_b);
            return EXIT_FAILURE;
        }
    }
    qsort(rtts, (size_t)reps, sizeof rtts[0], cmp_double);
    printf("RESULT limits line_rtt 64 ns=%.1f cpus=%d,%d\n", rtts[reps / 2],
           cpu_a, cpu_b);
    return EXIT_SUCCESS;
}
