/*
 * Helpers shared by the rdmabridge C examples: status reporting, the test
 * message pattern, a monotonic clock, waiting for completions with a timeout,
 * and percentiles.  Nothing here is part of the library's API.
 */
#ifndef RBR_EXAMPLES_COMMON_H
#define RBR_EXAMPLES_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "rdmabridge.h"

/* Default address of the demo pair, shared by server and client. */
#define EX_DEFAULT_ADDR "shm://rdmabridge-demo"
/* Private data the server answers with; the client checks it. */
#define EX_SERVER_HELLO "rbr-server"
#define EX_CLIENT_HELLO "rbr-client"

/*
 * If st is an error (negative), print "what: NAME (code): last error" to
 * stderr and return -1; otherwise return 0.  Use with a goto chain:
 *     if (ex_check(rbr_ctx_create(&ctx), "rbr_ctx_create")) goto out;
 */
int ex_check(rbr_status st, const char *what);

/* Like ex_check, but exits the process with status 1 on error. */
void ex_die_on_status(rbr_status st, const char *what);

/* Shorthand for ex_check(expr, #expr). */
#define EX_CHECK(expr) ex_check((expr), #expr)

/* Prints the message to stderr as one line, prefixed with the program name;
 * lines from different threads do not mix. */
void ex_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* Program name used as the prefix of every diagnostic; set from argv[0]. */
void ex_set_progname(const char *argv0);

/*
 * Message pattern: byte i of message number k (0-based, counted per
 * direction) is (uint8_t)(k * 131 + i * 7 + 1).
 */
void ex_fill_pattern(void *buf, size_t len, uint64_t k);

/*
 * Returns 0 if buf holds message k, else -1 after printing the first
 * mismatching byte.
 */
int ex_verify_pattern(const void *buf, size_t len, uint64_t k);

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t ex_now_ns(void);

/*
 * Waits up to timeout_ms (-1 = forever) for at least one completion on cq
 * with rbr_cq_poll_wait.  Returns RBR_OK with 1..max completions in out[] and
 * their number in *n, or RBR_ERR_TIMEOUT, or another error status.
 */
rbr_status ex_wait_completions(rbr_cq *cq, rbr_completion *out, size_t max,
                               size_t *n, int32_t timeout_ms);

/*
 * The same in two calls, the pattern for programs that also watch
 * rbr_cq_fd: rbr_cq_poll, and when it finds nothing, rbr_cq_wait, in a loop.
 */
rbr_status ex_poll_then_wait(rbr_cq *cq, rbr_completion *out, size_t max,
                             size_t *n, int32_t timeout_ms);

/* Waits up to timeout_ms for the next completion into *c, which must be a
 * success of `opcode`; returns 0, or -1 after saying what came instead. */
int ex_expect(rbr_cq *cq, int32_t timeout_ms, uint32_t opcode, rbr_completion *c);

/* ex_wait_completions for exactly one completion. */
rbr_status ex_wait_one(rbr_cq *cq, rbr_completion *out, int32_t timeout_ms);

/*
 * Busy-polls `cq` (never sleeping, as the stock benchmark tools poll) until at
 * least one completion is there: up to `max` into `out`, their number in *n.
 * RBR_OK, RBR_ERR_TIMEOUT after `timeout_ns` with nothing, or the status of a
 * failed poll.  The clock is read only now and then: it is not free.  Inline,
 * so that a program's busy loop pays no call of its own around each poll.
 */
static inline rbr_status ex_busy_poll(rbr_cq *cq, rbr_completion *out,
                                      size_t max, size_t *n, int64_t timeout_ns)
{
    uint64_t deadline = 0;
    uint32_t spins = 0;

    for (;;) {
        rbr_status st = rbr_cq_poll(cq, out, max, n);

        if (st != RBR_EMPTY)
            return st;
        if (++spins % 4096 == 0) {
            uint64_t now = ex_now_ns();

            if (deadline == 0)
                deadline = now + (uint64_t)timeout_ns;
            else if (now > deadline)
                return RBR_ERR_TIMEOUT;
        }
    }
}

/* Readable names for completion opcodes and statuses (never NULL). */
const char *ex_opcode_str(uint32_t opcode);
const char *ex_wc_status_str(int32_t status);

/*
 * Nearest-rank percentile p (0..100) of the n values in v; sorts v in place.
 * Returns 0 for n == 0.
 */
uint64_t ex_percentile(uint64_t *v, size_t n, double p);

/*
 * Distance between consecutive message slots of `size` bytes carved out of
 * one memory region: size rounded up to a cache line, and at least one line,
 * so that size 0 still gets a non-empty region.
 */
size_t ex_slot_stride(size_t size);

/* Prints "what: OPCODE completion wr_id=.. status NAME (n)" to stderr. */
void ex_report_completion(const char *what, const rbr_completion *c);

/*
 * Parses a non-negative decimal integer (optionally with a K/M/G binary
 * suffix) into *out.  Returns 0 on success, -1 on malformed input.
 */
int ex_parse_size(const char *s, uint64_t *out);

/*
 * Completion-queue options both examples take: -p MODE (progress: caller or
 * thread) and -S US (how long rbr_cq_wait polls before it sleeps).
 */
struct ex_cq_opts {
    uint32_t progress; /* RBR_PROGRESS_*; RBR_PROGRESS_DEFAULT unless -p */
    int64_t spin_us;   /* -1 (the library's default) unless -S */
};
#define EX_CQ_OPTS_USAGE                                                    \
    "  -p MODE    progress: caller (the library's default) or thread\n"    \
    "  -S US      rbr_cq_wait polls US microseconds before it sleeps\n"
void ex_cq_opts_init(struct ex_cq_opts *o);
/*
 * Parses the argument of option ch ('p' or 'S') into *o.  Returns 0, or -1
 * after a message when arg is bad.
 */
int ex_cq_opt(int ch, const char *arg, struct ex_cq_opts *o);
/* rbr_cq_create_ex with the options of *o. */
rbr_status ex_cq_create(const struct ex_cq_opts *o, rbr_cq **cq);

/*
 * One request taken from `listener` (waiting up to 10 s) and accepted onto
 * `cq` with default options, on a thread of its own: pass ex_accept_one and a
 * struct ex_acceptor to pthread_create, then read `status` and `conn` after
 * pthread_join (conn is NULL unless status is RBR_OK).
 */
struct ex_acceptor {
    rbr_listener *listener;
    rbr_cq *cq;
    rbr_conn *conn;
    rbr_status status;
};
void *ex_accept_one(void *acceptor);
/* Open descriptors of this process, from /proc/self/fd (-1 if unknown). */
long ex_count_fds(void);

#endif /* RBR_EXAMPLES_COMMON_H */
