/*
 * rbr_bench: latency, bandwidth and message-rate benchmark for the
 * rdmabridge C API, written only against the public header.
 *
 * One program, two roles.  The server (-r server) listens on ADDR, takes one
 * client and serves the tests the client asks for until it disconnects.  The
 * client (-r client) connects and runs, for every size in the list, every
 * test in the list:
 *   lat   ping-pong: send one message, wait for the echo of the same size;
 *         WARMUP round trips first, then ITERS timed ones; prints the one-way
 *         latency (half the round trip), median and 99th percentile;
 *   bw    streaming: messages to the server with up to WINDOW outstanding;
 *         the server answers the last one with a short acknowledgement, and
 *         the time runs from the first post to that acknowledgement; a
 *         warm-up stream of a tenth of the messages comes first; prints MB/s
 *         (10^6 bytes per second, payload of one direction);
 *   rate  the same streaming, meant for small sizes; prints messages per
 *         second.  Both send BYTES / SIZE messages, at most MSGS and at
 *         least 100: they differ only in which figure leads the line.
 * Like the stock tools (ucx_perftest, fi_pingpong, perftest), both sides
 * busy-poll the completion queue with rbr_cq_poll; with -W they wait for
 * completions as a program would, with rbr_cq_poll_wait (which polls for a
 * while, then sleeps), with -Y with rbr_cq_poll and, when it finds
 * nothing, rbr_cq_wait (the two-call form), and with -E as an event loop
 * does: rbr_cq_poll until RBR_EMPTY, then epoll_wait on the queue's
 * descriptor (rbr_cq_fd), as ucx_perftest -E sleep and ib_send_lat -e sleep
 * on theirs.  Both send from one
 * buffer and receive into one buffer, and do not touch the payload.
 *
 * Before each test the client sends a small control message (inline) naming
 * the test and the message count; the server echoes it when it is ready.
 * The client's largest size and window travel in the private data of the
 * connect, so the server sizes its buffers and queues before it accepts.
 *
 * Output: one line per measurement, for scripts:
 *   RESULT lat SIZE p50_us=X p99_us=X avg_us=X iters=N
 *   RESULT bw SIZE mb_s=X msgs_s=X count=N window=W
 *   RESULT rate SIZE msgs_s=X mb_s=X count=N window=W
 *
 * Usage: rbr_bench -r server|client [-a ADDR] [-t TESTS] [-s SIZES]
 *                  [-n ITERS] [-m MSGS] [-b BYTES] [-w WINDOW] [-T SECS] [-W|-Y|-E]
 *   -r ROLE    server or client
 *   -a ADDR    address (default shm://rbr-bench)
 *   -t TESTS   comma list of lat, bw, rate (default lat,bw,rate)
 *   -s SIZES   comma list of sizes, or a range LO:HI (powers of two from
 *              LO to HI); K/M suffixes; 1 byte at least (default
 *              2,64,4096,65536,1048576)
 *   -n ITERS   timed round trips per lat measurement (default 10000);
 *              a tenth of that (at least 100) is the warm-up
 *   -m MSGS    most messages per bw or rate measurement (default 1000000)
 *   -b BYTES   bytes per bw measurement (default 1G); see above
 *   -w WINDOW  messages outstanding while streaming (default 64)
 *   -T SECS    give up (exit status 1) when a single wait for a completion,
 *              or the server's wait for a client, takes longer (default 30)
 *   -W         wait for completions with rbr_cq_poll_wait instead of
 *              busy-polling (each side has its own: give it to both)
 *   -Y         the same with rbr_cq_poll, then rbr_cq_wait
 *   -E         the same with rbr_cq_poll, then epoll_wait on rbr_cq_fd
 *   -p MODE, -S US: completion-queue options as in the C examples
 *
 * Exit status 0 only if every test ran to the end and the connection closed
 * in order.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "clock.h"
#include "common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#define DEFAULT_ADDR "shm://rbr-bench"
#define MAX_SIZES 64
#define POLL_BATCH 64
#define CTL_MAGIC 0x72627262656e6368ull /* "rbrbench" */
#define PDATA_MAGIC 0x52424231u         /* "RBB1" */

enum test_kind { TEST_LAT = 1, TEST_BW = 2, TEST_RATE = 4 };

/* Control message, client to server and echoed back; sent inline. */
struct ctl_msg {
    uint64_t magic;
    uint32_t test;  /* TEST_LAT: echo COUNT messages; TEST_BW: absorb COUNT,
                       then acknowledge the last; 0: nothing */
    uint32_t reserved;
    uint64_t count;
};

/* Private data of the connect. */
struct hello {
    uint32_t magic;
    uint32_t window;
    uint64_t max_size;
};

struct bench_opts {
    int server;
    const char *addr;
    unsigned tests;
    uint64_t sizes[MAX_SIZES];
    size_t n_sizes;
    uint64_t iters;
    uint64_t msgs;
    uint64_t bytes;
    uint32_t window;
    int timeout_s;
    int wait; /* 0: busy-poll; 'W': rbr_cq_poll_wait; 'Y': poll, then wait;
                 'E': poll, then epoll_wait */
    struct ex_cq_opts cq;
};

/* One connection's buffers and queue bookkeeping, either role. */
struct peer {
    rbr_cq *cq;
    rbr_conn *conn;
    rbr_mr *send_mr;
    rbr_mr *recv_mr;
    size_t buf_size;       /* bytes of each region */
    uint32_t sq_depth;
    uint32_t rq_depth;
    uint64_t sends_posted;
    uint64_t sends_done;   /* sends known complete */
    uint32_t signal_every; /* a signaled send every this many */
    int64_t timeout_ns;
    int wait;              /* as bench_opts.wait */
    int ep;                /* -E: an epoll set holding the queue's descriptor */
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s -r server|client [-a ADDR] [-t TESTS] [-s SIZES] "
            "[-n ITERS] [-m MSGS]\n"
            "          [-b BYTES] [-w WINDOW] [-T SECS] [-W|-Y|-E] [-p MODE] [-S US]\n"
            "  -r ROLE    server or client\n"
            "  -a ADDR    address (default %s)\n"
            "  -t TESTS   comma list of lat, bw, rate (default all)\n"
            "  -s SIZES   comma list, or LO:HI for powers of two\n"
            "  -n ITERS   timed round trips per latency test (10000)\n"
            "  -m MSGS    messages per rate test (1000000)\n"
            "  -b BYTES   bytes per bandwidth test (1G)\n"
            "  -w WINDOW  messages outstanding while streaming (64)\n"
            "  -T SECS    longest wait for one completion (30)\n"
            "  -W         wait with rbr_cq_poll_wait (else busy-poll)\n"
            "  -Y         wait with rbr_cq_poll, then rbr_cq_wait\n"
            "  -E         wait with rbr_cq_poll, then epoll_wait on rbr_cq_fd\n"
            EX_CQ_OPTS_USAGE,
            argv0, DEFAULT_ADDR);
}

static int parse_tests(const char *arg, unsigned *out)
{
    char buf[128];
    char *save = NULL;
    char *tok;
    unsigned t = 0;

    if (strlen(arg) >= sizeof buf)
        return -1;
    strcpy(buf, arg);
    for (tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        if (strcmp(tok, "lat") == 0)
            t |= TEST_LAT;
        else if (strcmp(tok, "bw") == 0)
            t |= TEST_BW;
        else if (strcmp(tok, "rate") == 0)
            t |= TEST_RATE;
        else
            return -1;
    }
    if (t == 0)
        return -1;
    *out = t;
    return 0;
}

/* "A,B,C" or "LO:HI" (powers of two from LO, doubling, up to HI). */
static int parse_sizes(const char *arg, struct bench_opts *o)
{
    char buf[512];
    char *save = NULL;
    char *tok;
    char *colon;
    uint64_t lo;
    uint64_t hi;

    if (strlen(arg) >= sizeof buf)
        return -1;
    strcpy(buf, arg);
    o->n_sizes = 0;
    colon = strchr(buf, ':');
    if (colon != NULL) {
        *colon = '\0';
        if (ex_parse_size(buf, &lo) || ex_parse_size(colon + 1, &hi) ||
            lo == 0 || hi < lo || hi > UINT32_MAX)
            return -1;
        for (; lo <= hi && o->n_sizes < MAX_SIZES; lo *= 2)
            o->sizes[o->n_sizes++] = lo;
        return 0;
    }
    for (tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        if (o->n_sizes == MAX_SIZES || ex_parse_size(tok, &lo) || lo == 0 ||
            lo > UINT32_MAX)
            return -1;
        o->sizes[o->n_sizes++] = lo;
    }
    return o->n_sizes > 0 ? 0 : -1;
}

static int parse_opts(int argc, char **argv, struct bench_opts *o)
{
    uint64_t v;
    int ch;
    int role = 0;

    memset(o, 0, sizeof *o);
    o->addr = DEFAULT_ADDR;
    o->tests = TEST_LAT | TEST_BW | TEST_RATE;
    o->iters = 10000;
    o->msgs = 1000000;
    o->bytes = 1024ull * 1024u * 1024u;
    o->window = 64;
    o->timeout_s = 30;
    ex_cq_opts_init(&o->cq);
    parse_sizes("2,64,4096,65536,1048576", o);
    while ((ch = getopt(argc, argv, "r:a:t:s:n:m:b:w:T:WYEp:S:h")) != -1) {
        switch (ch) {
        case 'r':
            if (strcmp(optarg, "server") == 0) {
                o->server = 1;
            } else if (strcmp(optarg, "client") != 0) {
                ex_error("bad role '%s' (server or client)", optarg);
                return -1;
            }
            role = 1;
            break;
        case 'a':
            o->addr = optarg;
            break;
        case 't':
            if (parse_tests(optarg, &o->tests)) {
                ex_error("bad test list '%s' (lat, bw, rate)", optarg);
                return -1;
            }
            break;
        case 's':
            if (parse_sizes(optarg, o)) {
                ex_error("bad size list '%s'", optarg);
                return -1;
            }
            break;
        case 'n':
        case 'm':
        case 'b':
            if (ex_parse_size(optarg, &v) || v == 0 || v > UINT64_MAX / 2) {
                ex_error("bad -%c '%s'", ch, optarg);
                return -1;
            }
            if (ch == 'n')
                o->iters = v;
            else if (ch == 'm')
                o->msgs = v;
            else
                o->bytes = v;
            break;
        case 'w':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 8192) {
                ex_error("bad window '%s' (1..8192)", optarg);
                return -1;
            }
            o->window = (uint32_t)v;
            break;
        case 'T':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 3600) {
                ex_error("bad time limit '%s' (1..3600 s)", optarg);
                return -1;
            }
            o->timeout_s = (int)v;
            break;
        case 'W':
        case 'Y':
        case 'E':
            o->wait = ch;
            break;
        case 'p':
        case 'S':
            if (ex_cq_opt(ch, optarg, &o->cq))
                return -1;
            break;
        default:
            usage(argv[0]);
            return -1;
        }
    }
    if (optind != argc || !role) {
        usage(argv[0]);
        return -1;
    }
    return 0;
}

/*
 * An event loop's wait: rbr_cq_poll until it finds something; on RBR_EMPTY,
 * sleep in epoll_wait on the queue's descriptor (at most timeout_ms).
 */
static rbr_status poll_then_epoll(struct peer *p, rbr_completion *out,
                                  size_t max, size_t *n, int32_t timeout_ms)
{
    for (;;) {
        struct epoll_event ev;
        size_t got = 0;
        rbr_status st = rbr_cq_poll(p->cq, out, max, &got);
        int r;

        if (st == RBR_OK) {
            *n = got;
            return RBR_OK;
        }
        if (st != RBR_EMPTY)
            return st;
        r = epoll_wait(p->ep, &ev, 1, timeout_ms);
        if (r == 0)
            return RBR_ERR_TIMEOUT;
        if (r < 0 && errno != EINTR) {
            ex_error("epoll_wait: %s", strerror(errno));
            return RBR_ERR_OS;
        }
    }
}

/* -E: the epoll set, holding the queue's descriptor level-triggered. */
static int open_epoll(struct peer *p)
{
    struct epoll_event ev;
    int fd;

    if (EX_CHECK(rbr_cq_fd(p->cq, &fd)))
        return -1;
    p->ep = epoll_create1(EPOLL_CLOEXEC);
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    if (p->ep < 0 || epoll_ctl(p->ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        ex_error("epoll: %s", strerror(errno));
        return -1;
    }
    return 0;
}

/*
 * Busy-polls until at least one completion is there; fails on an error
 * completion or an RBR_OP_DISCONNECTED, or after the time limit.  With disc
 * non-NULL the connection may close: flushed work is let through (callers
 * skip what did not succeed) and *disc says when RBR_OP_DISCONNECTED came.
 */
static int poll_some(struct peer *p, rbr_completion *wc, size_t *n, int *disc)
{
    int32_t ms = (int32_t)(p->timeout_ns / 1000000);
    rbr_status st =
        p->wait == 'W'   ? ex_wait_completions(p->cq, wc, POLL_BATCH, n, ms)
        : p->wait == 'Y' ? ex_poll_then_wait(p->cq, wc, POLL_BATCH, n, ms)
        : p->wait == 'E' ? poll_then_epoll(p, wc, POLL_BATCH, n, ms)
                         : ex_busy_poll(p->cq, wc, POLL_BATCH, n, p->timeout_ns);
    size_t i;

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion for %lld s (sends posted %llu, done %llu)",
                 (long long)(p->timeout_ns / 1000000000),
                 (unsigned long long)p->sends_posted,
                 (unsigned long long)p->sends_done);
        return -1;
    }
    if (st != RBR_OK)
        return ex_check(st, "rbr_cq_poll");
    for (i = 0; i < *n; i++) {
        if (wc[i].opcode == RBR_OP_DISCONNECTED && disc != NULL) {
            *disc = 1;
            if (wc[i].status != RBR_WC_SUCCESS) {
                ex_report_completion("disconnect that was not orderly", &wc[i]);
                return -1;
            }
            continue;
        }
        if (wc[i].status == RBR_WC_FLUSHED && disc != NULL)
            continue;
        if (wc[i].status != RBR_WC_SUCCESS ||
            (wc[i].opcode != RBR_OP_SEND && wc[i].opcode != RBR_OP_RECV)) {
            ex_report_completion("unexpected completion", &wc[i]);
            return -1;
        }
        if (wc[i].opcode == RBR_OP_SEND && wc[i].wr_id + 1 > p->sends_done)
            p->sends_done = wc[i].wr_id + 1;
    }
    return 0;
}

/* A signaled send completes every send before it (in-order queue), so its
 * wr_id (the send's number) tells how many are done. */
static int post_send(struct peer *p, size_t len, int force_signal)
{
    uint32_t flags = 0;

    if (force_signal || (p->sends_posted + 1) % p->signal_every == 0)
        flags = RBR_SEND_SIGNALED;
    if (ex_check(rbr_conn_post_send(p->conn, p->send_mr, 0, len,
                                    p->sends_posted, flags),
                 "rbr_conn_post_send"))
        return -1;
    p->sends_posted++;
    return 0;
}

static int post_recv(struct peer *p)
{
    return ex_check(rbr_conn_post_recv(p->conn, p->recv_mr, 0, p->buf_size, 0),
                    "rbr_conn_post_recv");
}

static int send_ctl(struct peer *p, uint32_t test, uint64_t count)
{
    struct ctl_msg m;

    memset(&m, 0, sizeof m);
    m.magic = CTL_MAGIC;
    m.test = test;
    m.count = count;
    if (ex_check(rbr_conn_post_send_inline(p->conn, &m, sizeof m,
                                           p->sends_posted, RBR_SEND_SIGNALED),
                 "rbr_conn_post_send_inline"))
        return -1;
    p->sends_posted++;
    return 0;
}

/* Room for one more send: waits while the send queue is full. */
static int send_room(struct peer *p, uint64_t *recvs)
{
    rbr_completion wc[POLL_BATCH];
    size_t n;
    size_t i;

    while (p->sends_posted - p->sends_done >= p->sq_depth) {
        if (poll_some(p, wc, &n, NULL))
            return -1;
        for (i = 0; i < n; i++)
            if (wc[i].opcode == RBR_OP_RECV) {
                if (recvs == NULL) {
                    ex_report_completion("receive while waiting for room", &wc[i]);
                    return -1;
                }
                (*recvs)++;
                if (post_recv(p))
                    return -1;
            }
    }
    return 0;
}

/* ------------------------------------------------------------- server */

/* Echoes count messages (lat) or takes count and acknowledges (bw). */
static int serve_test(struct peer *p, const struct ctl_msg *m)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t got = 0;
    size_t n;
    size_t i;

    /* Ready: echo the control message. */
    if (send_room(p, NULL) || send_ctl(p, m->test, m->count))
        return -1;
    while (got < m->count) {
        if (poll_some(p, wc, &n, NULL))
            return -1;
        for (i = 0; i < n; i++) {
            if (wc[i].opcode != RBR_OP_RECV)
                continue;
            got++;
            if (post_recv(p))
                return -1;
            if (m->test == TEST_LAT) {
                if (send_room(p, NULL) ||
                    post_send(p, wc[i].byte_len, 0))
                    return -1;
            } else if (got == m->count) {
                if (send_room(p, NULL) || send_ctl(p, 0, got))
                    return -1;
            }
        }
    }
    return 0;
}

static int serve(struct peer *p)
{
    rbr_completion wc[POLL_BATCH];
    size_t n;
    size_t i;
    int disc = 0;

    for (;;) {
        if (poll_some(p, wc, &n, &disc))
            return -1;
        for (i = 0; i < n; i++) {
            struct ctl_msg m;

            if (wc[i].opcode != RBR_OP_RECV || wc[i].status != RBR_WC_SUCCESS)
                continue;
            if (wc[i].byte_len != sizeof m) {
                ex_error("expected a control message, got %u bytes",
                         (unsigned)wc[i].byte_len);
                return -1;
            }
            memcpy(&m, rbr_mr_addr(p->recv_mr), sizeof m);
            if (m.magic != CTL_MAGIC ||
                (m.test != TEST_LAT && m.test != TEST_BW)) {
                ex_error("bad control message");
                return -1;
            }
            if (post_recv(p) || serve_test(p, &m))
                return -1;
        }
        if (disc)
            return 0;
    }
}

/* ------------------------------------------------------------- client */

/* Sends a control message and waits for its echo (and the send's own
 * completion): the server is then idle and has all receives posted. */
static int ctl_round(struct peer *p, uint32_t test, uint64_t count)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t want = p->sends_posted + 1;
    int echoed = 0;
    size_t n;
    size_t i;

    if (send_room(p, NULL) || send_ctl(p, test, count))
        return -1;
    while (!echoed || p->sends_done < want) {
        if (poll_some(p, wc, &n, NULL))
            return -1;
        for (i = 0; i < n; i++) {
            if (wc[i].opcode != RBR_OP_RECV)
                continue;
            if (echoed || wc[i].byte_len != sizeof(struct ctl_msg)) {
                ex_report_completion("unexpected receive", &wc[i]);
                return -1;
            }
            echoed = 1;
            if (post_recv(p))
                return -1;
        }
    }
    return 0;
}

/* total round trips, the last `timed` of them into rtt[]. */
static int run_lat(struct peer *p, size_t size, uint64_t total,
                   uint64_t timed, uint64_t *rtt)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t i;
    size_t n;
    size_t j;
    bench_span span;

    if (ctl_round(p, TEST_LAT, total))
        return -1;
    bench_span_start(&span);
    for (i = 0; i < total; i++) {
        int echoed = 0;
        uint64_t t0;
        uint64_t t1 = 0;

        if (send_room(p, NULL))
            return -1;
        t0 = bench_ticks();
        if (post_send(p, size, 0))
            return -1;
        while (!echoed) {
            if (poll_some(p, wc, &n, NULL))
                return -1;
            for (j = 0; j < n; j++) {
                if (wc[j].opcode != RBR_OP_RECV)
                    continue;
                t1 = bench_ticks();
                if (echoed || wc[j].byte_len != size) {
                    ex_report_completion("unexpected echo", &wc[j]);
                    return -1;
                }
                echoed = 1;
                if (post_recv(p))
                    return -1;
            }
        }
        if (i >= total - timed)
            rtt[i - (total - timed)] = t1 - t0;
    }
    bench_span_to_ns(&span, rtt, timed);
    return 0;
}

/* Streams count messages; *ns is the time from the first post to the
 * server's acknowledgement. */
static int run_stream(struct peer *p, size_t size, uint64_t count,
                      uint32_t window, uint64_t *ns)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t first;
    uint64_t sent = 0;
    uint64_t t0;
    int acked = 0;
    size_t n;
    size_t j;

    if (ctl_round(p, TEST_BW, count))
        return -1;
    first = p->sends_posted;
    t0 = ex_now_ns();
    while (!acked) {
        while (sent < count && p->sends_posted - p->sends_done < window) {
            if (post_send(p, size, sent + 1 == count))
                return -1;
            sent++;
        }
        if (poll_some(p, wc, &n, NULL))
            return -1;
        for (j = 0; j < n; j++) {
            if (wc[j].opcode != RBR_OP_RECV)
                continue;
            if (acked || sent < count ||
                wc[j].byte_len != sizeof(struct ctl_msg)) {
                ex_report_completion("unexpected receive", &wc[j]);
                return -1;
            }
            acked = 1;
            if (post_recv(p))
                return -1;
        }
    }
    *ns = ex_now_ns() - t0;
    /* The last send was signaled; wait for it before the next test. */
    while (p->sends_done < first + count)
        if (poll_some(p, wc, &n, NULL))
            return -1;
    return 0;
}

static int client_tests(struct peer *p, const struct bench_opts *o,
                        uint64_t *rtt)
{
    size_t k;

    for (k = 0; k < o->n_sizes; k++) {
        size_t size = (size_t)o->sizes[k];

        if (o->tests & TEST_LAT) {
            uint64_t warm = o->iters / 10 < 100 ? 100 : o->iters / 10;

            double sum = 0;
            uint64_t i;

            if (run_lat(p, size, warm + o->iters, o->iters, rtt))
                return -1;
            for (i = 0; i < o->iters; i++)
                sum += (double)rtt[i];
            printf("RESULT lat %zu p50_us=%.3f p99_us=%.3f avg_us=%.3f "
                   "iters=%llu\n",
                   size, (double)ex_percentile(rtt, o->iters, 50.0) / 2000.0,
                   (double)ex_percentile(rtt, o->iters, 99.0) / 2000.0,
                   sum / (double)o->iters / 2000.0,
                   (unsigned long long)o->iters);
        }
        if (o->tests & (TEST_BW | TEST_RATE)) {
            int which;

            for (which = TEST_BW; which <= TEST_RATE; which *= 2) {
                uint64_t count;
                uint64_t ns;
                double secs;

                if (!(o->tests & (unsigned)which))
                    continue;
                /* BYTES worth, at most MSGS, at least 100. */
                count = o->bytes / size;
                if (count > o->msgs)
                    count = o->msgs;
                if (count < 100)
                    count = 100;
                if (run_stream(p, size, count / 10 + 1, o->window, &ns) ||
                    run_stream(p, size, count, o->window, &ns))
                    return -1;
                secs = (double)ns / 1e9;
                printf("RESULT %s %zu %s=%.1f %s=%.1f count=%llu window=%u\n",
                       which == TEST_BW ? "bw" : "rate", size,
                       which == TEST_BW ? "mb_s" : "msgs_s",
                       which == TEST_BW ? (double)count * size / secs / 1e6
                                        : (double)count / secs,
                       which == TEST_BW ? "msgs_s" : "mb_s",
                       which == TEST_BW ? (double)count / secs
                                        : (double)count * size / secs / 1e6,
                       (unsigned long long)count, (unsigned)o->window);
            }
        }
    }
    return 0;
}

/* Disconnects and waits for RBR_OP_DISCONNECTED (receives come back
 * flushed before it). */
static int close_conn(struct peer *p)
{
    rbr_completion wc[POLL_BATCH];
    size_t n;
    int disc = 0;

    if (EX_CHECK(rbr_conn_disconnect(p->conn)))
        return -1;
    while (!disc)
        if (poll_some(p, wc, &n, &disc))
            return -1;
    return 0;
}

/* ------------------------------------------------------------- main */

/* The server's side of the connect: one client, whose hello sizes the
 * buffers; *h receives it. */
static int server_accept(rbr_ctx *ctx, const struct bench_opts *o,
                         rbr_cq *cq, struct hello *h,
                         const rbr_conn_options *copts_in, rbr_conn **out)
{
    rbr_listener *l = NULL;
    rbr_request *req = NULL;
    rbr_conn_options copts = *copts_in;
    size_t len = 0;
    int rc = -1;

    if (EX_CHECK(rbr_listen(ctx, o->addr, 4, &l)))
        return -1;
    printf("listening on %s\n", o->addr);
    if (ex_check(rbr_listener_get_request(l, o->timeout_s * 1000, &req),
                 "waiting for a client"))
        goto out_listener;
    if (EX_CHECK(rbr_request_private_data(req, h, sizeof *h, &len)))
        goto out_request;
    if (len != sizeof *h || h->magic != PDATA_MAGIC || h->window == 0 ||
        h->window > 8192 || h->max_size == 0 || h->max_size > UINT32_MAX) {
        ex_error("the client is not an rbr_bench client");
        goto out_request;
    }
    copts.send_queue_depth = h->window + 16;
    copts.recv_queue_depth = h->window + 16;
    if (EX_CHECK(rbr_request_accept(req, cq, &copts, out)))
        goto out_request;
    rc = 0;
out_request:
    rbr_request_destroy(req);
out_listener:
    rbr_listener_destroy(l);
    return rc;
}

int main(int argc, char **argv)
{
    struct bench_opts o;
    struct peer p;
    struct hello h;
    rbr_ctx *ctx = NULL;
    rbr_conn_options copts;
    uint64_t *rtt = NULL;
    uint32_t i;
    int rc = EXIT_FAILURE;

    ex_set_progname(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o))
        return EXIT_FAILURE;

    memset(&p, 0, sizeof p);
    p.timeout_ns = (int64_t)o.timeout_s * 1000000000;
    p.wait = o.wait;
    p.ep = -1;
    memset(&h, 0, sizeof h);
    h.magic = PDATA_MAGIC;
    h.window = o.window;
    for (i = 0; i < o.n_sizes; i++)
        if (o.sizes[i] > h.max_size)
            h.max_size = o.sizes[i];
    rbr_conn_options_init(&copts);
    copts.timeout_ms = 5000;

    if (!o.server) {
        rtt = calloc(o.iters, sizeof *rtt);
        if (rtt == NULL) {
            ex_error("out of memory");
            return EXIT_FAILURE;
        }
    }
    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out_rtt;
    if (EX_CHECK(ex_cq_create(&o.cq, &p.cq)))
        goto out_ctx;
    if (o.wait == 'E' && open_epoll(&p))
        goto out_cq;
    if (o.server) {
        if (server_accept(ctx, &o, p.cq, &h, &copts, &p.conn))
            goto out_cq;
    } else {
        copts.send_queue_depth = o.window + 16;
        copts.recv_queue_depth = o.window + 16;
        copts.private_data = &h;
        copts.private_data_len = sizeof h;
        if (ex_check(rbr_connect(ctx, o.addr, p.cq, &copts, &p.conn),
                     "rbr_connect"))
            goto out_cq;
    }
    p.sq_depth = h.window + 16;
    p.rq_depth = h.window + 16;
    p.signal_every = h.window / 8 > 0 ? h.window / 8 : 1;
    p.buf_size = (size_t)(h.max_size < sizeof(struct ctl_msg)
                              ? sizeof(struct ctl_msg) : h.max_size);
    if (EX_CHECK(rbr_mr_alloc(ctx, p.buf_size, 0, &p.send_mr)))
        goto out_conn;
    if (EX_CHECK(rbr_mr_alloc(ctx, p.buf_size, RBR_ACCESS_LOCAL_WRITE,
                              &p.recv_mr)))
        goto out_send_mr;
    /* Every receive lands in the same buffer, as in the stock tools. */
    for (i = 0; i < p.rq_depth; i++)
        if (post_recv(&p))
            goto out_recv_mr;

    if (o.server) {
        if (serve(&p))
            goto out_recv_mr;
    } else {
        if (client_tests(&p, &o, rtt) || close_conn(&p))
            goto out_recv_mr;
    }
    rc = EXIT_SUCCESS;

out_recv_mr:
    rbr_mr_destroy(p.recv_mr);
out_send_mr:
    rbr_mr_destroy(p.send_mr);
out_conn:
    rbr_conn_destroy(p.conn);
out_cq:
    if (p.ep >= 0)
        close(p.ep);
    rbr_cq_destroy(p.cq);
out_ctx:
    rbr_ctx_destroy(ctx);
out_rtt:
    free(rtt);
    return rc;
}
