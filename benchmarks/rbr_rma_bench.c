/*
 * rbr_rma_bench: one-sided benchmark (RDMA write and read) for the
 * rdmabridge C API, written only against the public header, measured the way
 * perftest (ib_write_lat, ib_read_lat, ib_write_bw, ib_read_bw) and
 * ucx_perftest (ucp_put_lat, ucp_put_bw) measure.
 *
 * One program, two roles.  Each side allocates a region the peer may write
 * and read, and they exchange descriptors in messages.  Then, for every size
 * in the list, the client runs every test in the list:
 *   wlat  write ping-pong: the client writes SIZE bytes into the server's
 *         region; the server busy-reads the last byte of its region until
 *         the new value is there, then writes SIZE bytes back the same way;
 *         prints the one-way latency (half the round trip), p50 and p99;
 *   wbw   streaming writes with up to WINDOW outstanding, from the first
 *         post to the last completion; prints MB/s (10^6 B/s);
 *   rlat  one read of SIZE bytes at a time; prints its completion time (the
 *         full round trip, as ib_read_lat reports it), p50 and p99;
 *   rbw   streaming reads with up to WINDOW outstanding; MB/s.
 * Both sides busy-poll (rbr_cq_poll), as the stock tools do (perftest's
 * server, connected with -R, polls for the closing handshake all through the
 * client's run, even while the client reads or streams writes); with -P the
 * server waits for control messages in rbr_cq_poll_wait instead (it sleeps
 * while the client reads or streams writes, needing no CPU of its own; in
 * wlat it still busy-reads its memory).  Before each test the client sends a
 * control message; the server answers when ready.
 *
 * Output, one line per measurement:
 *   RESULT wlat SIZE p50_us=X p99_us=X avg_us=X iters=N
 *   RESULT wbw SIZE mb_s=X count=N window=W
 *   RESULT rlat SIZE p50_us=X p99_us=X avg_us=X iters=N
 *   RESULT rbw SIZE mb_s=X count=N window=W
 *
 * Usage: rbr_rma_bench -r server|client [-a ADDR] [-t TESTS] [-s SIZES]
 *                      [-n ITERS] [-b BYTES] [-w WINDOW] [-T SECS] [-P]
 *   -t TESTS   comma list of wlat, wbw, rlat, rbw (default all)
 *   -s SIZES   comma list (K/M suffixes), at most MAX_SIZE (default 8,4096,
 *              65536,1048576)
 *   -n ITERS   timed operations per latency test (default 10000; a tenth of
 *              that, at least 100, warms up first)
 *   -b BYTES   bytes per bandwidth test (default 1G; at least 100 ops)
 *   -w WINDOW  operations outstanding while streaming (default 64)
 *   -T SECS    give up when one wait takes longer (default 30)
 *   -P         passive server (see above; the client ignores it)
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "clock.h"
#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_ADDR "shm://rbr-rma-bench"
#define MAX_SIZES 32
#define REGION (8u << 20) /* the largest size; both regions are this big */
#define CTL_MAGIC 0x72626d6162656e63ull
#define BATCH 64

enum { T_WLAT = 1, T_WBW = 2, T_RLAT = 4, T_RBW = 8, T_DONE = 16 };

struct ctl {
    uint64_t magic;
    uint32_t test;
    uint32_t size;
    uint64_t count;
};

struct side {
    rbr_cq *cq;
    rbr_conn *conn;
    rbr_mr *region; /* the peer writes and reads it */
    rbr_mr *local;  /* our source and destination */
    rbr_mr *ctl_in;
    uint8_t *region_at; /* rbr_mr_addr of each, taken once (valid while they live), */
    uint8_t *local_at;  /* as the stock tools keep their buffers' addresses */
    rbr_remote peer;
    int64_t timeout_ns;
    uint64_t posted; /* one-sided operations posted */
    uint64_t done;   /* ... known complete */
    int ctl_waiting; /* a control message came in while polling for others */
    uint32_t ctl_len;
    int passive; /* -P: wait for control messages in rbr_cq_poll_wait */
    int sleepy;  /* ... and one is being waited for now */
};

/* In line, as drain: the latency loops pay no call of their own around the
 * library's (perftest's loop is one function too). */
static inline __attribute__((always_inline)) int
poll_cq(struct side *s, rbr_completion *wc, size_t *n)
{
    rbr_status st =
        s->sleepy ? ex_wait_completions(s->cq, wc, BATCH, n,
                                        (int32_t)(s->timeout_ns / 1000000))
                  : ex_busy_poll(s->cq, wc, BATCH, n, s->timeout_ns);

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion in time (posted %llu, done %llu)",
                 (unsigned long long)s->posted, (unsigned long long)s->done);
        return -1;
    }
    if (st != RBR_OK)
        return ex_check(st, "rbr_cq_poll");
    for (size_t i = 0; i < *n; i++) {
        if (wc[i].status != RBR_WC_SUCCESS) {
            ex_report_completion("failed", &wc[i]);
            return -1;
        }
        if ((wc[i].opcode == RBR_OP_WRITE || wc[i].opcode == RBR_OP_READ) &&
            wc[i].wr_id + 1 > s->done)
            s->done = wc[i].wr_id + 1;
        if (wc[i].opcode == RBR_OP_RECV) {
            s->ctl_waiting = 1;
            s->ctl_len = wc[i].byte_len;
        }
    }
    return 0;
}

/* Posts a write (or read) of `size` bytes at offset 0 of both regions;
 * signaled every 16th and when asked: one-sided operations complete in
 * order, so a signaled one's number says how many are done. */
static int post_op(struct side *s, int read, uint32_t size, int signal)
{
    rbr_sge seg = {s->local, 0, size};
    uint32_t flags = signal || (s->posted + 1) % 16 == 0 ? RBR_SEND_SIGNALED : 0;
    rbr_status st = read ? rbr_conn_post_read(s->conn, &seg, 1, &s->peer, 0,
                                              s->posted, flags)
                         : rbr_conn_post_write(s->conn, &seg, 1, &s->peer, 0,
                                               s->posted, flags);

    if (ex_check(st, read ? "rbr_conn_post_read" : "rbr_conn_post_write"))
        return -1;
    s->posted++;
    return 0;
}

/* Waits until every posted operation is complete. */
static inline __attribute__((always_inline)) int drain(struct side *s)
{
    rbr_completion wc[BATCH];
    size_t n;

    while (s->done < s->posted)
        if (poll_cq(s, wc, &n))
            return -1;
    return 0;
}

/* Control messages go unsignaled: only the peer's answer is waited for. */
static int send_ctl(struct side *s, uint32_t test, uint32_t size, uint64_t count)
{
    struct ctl m = {CTL_MAGIC, test, size, count};

    return EX_CHECK(rbr_conn_post_send_inline(s->conn, &m, sizeof m, 1, 0));
}

/* Waits for the next message into ctl_in (its receive is reposted) and
 * returns its length in *len. */
static int await_msg(struct side *s, uint32_t *len)
{
    rbr_completion wc[BATCH];
    size_t n;

    s->sleepy = s->passive;
    while (!s->ctl_waiting)
        if (poll_cq(s, wc, &n)) {
            s->sleepy = 0;
            return -1;
        }
    s->sleepy = 0;
    s->ctl_waiting = 0;
    *len = s->ctl_len;
    return 0;
}

/* Waits for the next control message. */
static int recv_ctl(struct side *s, struct ctl *m)
{
    uint32_t len;

    if (await_msg(s, &len))
        return -1;
    if (len != sizeof *m) {
        ex_error("expected a control message, got %u bytes", len);
        return -1;
    }
    memcpy(m, rbr_mr_addr(s->ctl_in), sizeof *m);
    return EX_CHECK(rbr_conn_post_recv(s->conn, s->ctl_in, 0, 64, 0));
}

/* Busy-reads the last byte of our region until it is `v`. */
static int await_byte(struct side *s, uint32_t size, uint8_t v)
{
    volatile uint8_t *p = (volatile uint8_t *)s->region_at + size - 1;
    uint64_t spins = 0, t0 = 0;

    while (*p != v) {
        if (++spins % 65536 == 0) {
            if (t0 == 0)
                t0 = ex_now_ns();
            else if ((int64_t)(ex_now_ns() - t0) > s->timeout_ns) {
                ex_error("the peer's write never came");
                return -1;
            }
        }
    }
    return 0;
}

/* One write of the ping-pong: our last byte carries `v`. Completions are
 * taken now and then so the send queue never fills; the last write of a run
 * (`last`) is signaled, so that draining afterwards has a completion to see. */
static int ping(struct side *s, uint32_t size, uint8_t v, int last)
{
    rbr_completion wc[BATCH];
    size_t n;

    s->local_at[size - 1] = v;
    if (post_op(s, 0, size, last))
        return -1;
    if (s->posted - s->done >= 32 && poll_cq(s, wc, &n))
        return -1;
    return 0;
}

/* Each side sends its region's descriptor; the client's goes first. */
static int exchange(struct side *s, int server)
{
    uint8_t desc[RBR_REMOTE_DESC_LEN];
    uint32_t len;

    if (EX_CHECK(rbr_conn_pack_region(s->conn, s->region, desc)))
        return -1;
    for (int step = 0; step < 2; step++) {
        if ((step == 0) != server) {
            if (EX_CHECK(rbr_conn_post_send_inline(s->conn, desc, sizeof desc,
                                                   1, 0)))
                return -1;
        } else if (await_msg(s, &len) ||
                   EX_CHECK(rbr_conn_unpack_remote(s->conn,
                                                   rbr_mr_addr(s->ctl_in), len,
                                                   &s->peer)) ||
                   EX_CHECK(rbr_conn_post_recv(s->conn, s->ctl_in, 0, 64, 0))) {
            return -1;
        }
    }
    return 0;
}

static int serve(struct side *s)
{
    struct ctl m;

    for (;;) {
        if (recv_ctl(s, &m))
            return -1;
        if (m.magic != CTL_MAGIC || m.size == 0 || m.size > REGION) {
            ex_error("bad control message");
            return -1;
        }
        if (m.test == T_DONE)
            return 0;
        memset(rbr_mr_addr(s->region), 0, m.size);
        if (send_ctl(s, m.test, m.size, m.count))
            return -1;
        if (m.test == T_WLAT) {
            for (uint64_t i = 0; i < m.count; i++)
                if (await_byte(s, m.size, (uint8_t)(i % 255 + 1)) ||
                    ping(s, m.size, (uint8_t)(i % 255 + 1), i + 1 == m.count))
                    return -1;
            if (drain(s))
                return -1;
        }
    }
}

static int run_wlat(struct side *s, uint32_t size, uint64_t total,
                    uint64_t *rtt)
{
    memset(rbr_mr_addr(s->region), 0, size);
    if (send_ctl(s, T_WLAT, size, total))
        return -1;
    {
        struct ctl m;
        if (recv_ctl(s, &m))
            return -1;
    }
    bench_span span;

    bench_span_start(&span);
    for (uint64_t i = 0; i < total; i++) {
        uint8_t v = (uint8_t)(i % 255 + 1);
        uint64_t t0 = bench_ticks();

        if (ping(s, size, v, i + 1 == total) || await_byte(s, size, v))
            return -1;
        rtt[i] = bench_ticks() - t0;
    }
    bench_span_to_ns(&span, rtt, total);
    return drain(s);
}

static int run_rlat(struct side *s, uint32_t size, uint64_t total,
                    uint64_t *rtt)
{
    bench_span span;

    bench_span_start(&span);
    for (uint64_t i = 0; i < total; i++) {
        uint64_t t0 = bench_ticks();

        if (post_op(s, 1, size, 1) || drain(s))
            return -1;
        rtt[i] = bench_ticks() - t0;
    }
    bench_span_to_ns(&span, rtt, total);
    return 0;
}

static int run_stream(struct side *s, int read, uint32_t size, uint64_t count,
                      uint32_t window, uint64_t *ns)
{
    rbr_completion wc[BATCH];
    uint64_t first = s->posted, t0 = ex_now_ns();
    size_t n;

    while (s->posted - first < count) {
        while (s->posted - first < count && s->posted - s->done < window)
            if (post_op(s, read, size, s->posted - first + 1 == count))
                return -1;
        if (poll_cq(s, wc, &n))
            return -1;
    }
    if (drain(s))
        return -1;
    *ns = ex_now_ns() - t0;
    return 0;
}

static void print_lat(const char *name, uint32_t size, uint64_t *v,
                      uint64_t n, double div)
{
    double sum = 0;

    for (uint64_t i = 0; i < n; i++)
        sum += (double)v[i];
    printf("RESULT %s %u p50_us=%.3f p99_us=%.3f avg_us=%.3f iters=%llu\n",
           name, size, (double)ex_percentile(v, n, 50.0) / div,
           (double)ex_percentile(v, n, 99.0) / div, sum / (double)n / div,
           (unsigned long long)n);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    const char *addr = DEFAULT_ADDR;
    int server = -1, ch, rc = 1;
    unsigned tests = T_WLAT | T_WBW | T_RLAT | T_RBW;
    uint64_t sizes[MAX_SIZES] = {8, 4096, 65536, 1048576};
    size_t n_sizes = 4;
    uint64_t iters = 10000, bytes = 1ull << 30, window = 64, secs = 30;
    rbr_ctx *ctx = NULL;
    rbr_listener *l = NULL;
    rbr_request *req = NULL;
    uint64_t *rtt = NULL;
    struct side s;
    rbr_conn_options copts;

    memset(&s, 0, sizeof s);
    ex_set_progname(argv[0]);
    while ((ch = getopt(argc, argv, "r:a:t:s:n:b:w:T:P")) != -1) {
        char buf[256], *save = NULL, *tok;

        switch (ch) {
        case 'r':
            server = strcmp(optarg, "server") == 0   ? 1
                     : strcmp(optarg, "client") == 0 ? 0
                                                     : -2;
            break;
        case 'a': addr = optarg; break;
        case 't':
        case 's':
            if (strlen(optarg) >= sizeof buf)
                goto usage;
            strcpy(buf, optarg);
            if (ch == 't')
                tests = 0;
            else
                n_sizes = 0;
            for (tok = strtok_r(buf, ",", &save); tok != NULL;
                 tok = strtok_r(NULL, ",", &save)) {
                if (ch == 't') {
                    unsigned t = strcmp(tok, "wlat") == 0  ? T_WLAT
                                 : strcmp(tok, "wbw") == 0  ? T_WBW
                                 : strcmp(tok, "rlat") == 0 ? T_RLAT
                                 : strcmp(tok, "rbw") == 0  ? T_RBW
                                                            : 0;
                    if (t == 0)
                        goto usage;
                    tests |= t;
                } else if (n_sizes == MAX_SIZES ||
                           ex_parse_size(tok, &sizes[n_sizes]) ||
                           sizes[n_sizes] == 0 || sizes[n_sizes] > REGION) {
                    goto usage;
                } else {
                    n_sizes++;
                }
            }
            if ((ch == 't' && tests == 0) || (ch == 's' && n_sizes == 0))
                goto usage;
            break;
        case 'n':
            if (ex_parse_size(optarg, &iters) || iters == 0) goto usage;
            break;
        case 'b':
            if (ex_parse_size(optarg, &bytes)) goto usage;
            break;
        case 'w':
            if (ex_parse_size(optarg, &window) || window == 0 || window > 1024)
                goto usage;
            break;
        case 'T':
            if (ex_parse_size(optarg, &secs) || secs == 0 || secs > 2000000)
                goto usage;
            break;
        case 'P': s.passive = 1; break;
        default: goto usage;
        }
    }
    if (server < 0)
        goto usage;
    if (!server)
        s.passive = 0;
    s.timeout_ns = (int64_t)secs * 1000000000;
    rbr_conn_options_init(&copts);
    copts.send_queue_depth = 1024;
    if (EX_CHECK(rbr_ctx_create(&ctx)) || EX_CHECK(rbr_cq_create(&s.cq)) ||
        EX_CHECK(rbr_mr_alloc(ctx, REGION,
                              RBR_ACCESS_LOCAL_WRITE | RBR_ACCESS_REMOTE_WRITE |
                                  RBR_ACCESS_REMOTE_READ,
                              &s.region)) ||
        EX_CHECK(rbr_mr_alloc(ctx, REGION, RBR_ACCESS_LOCAL_WRITE, &s.local)) ||
        EX_CHECK(rbr_mr_alloc(ctx, 64, RBR_ACCESS_LOCAL_WRITE, &s.ctl_in)))
        goto out;
    s.region_at = rbr_mr_addr(s.region);
    s.local_at = rbr_mr_addr(s.local);
    if (server) {
        if (EX_CHECK(rbr_listen(ctx, addr, 1, &l)))
            goto out;
        printf("listening on %s\n", addr);
        fflush(stdout);
        if (EX_CHECK(rbr_listener_get_request(l, (int32_t)secs * 1000, &req)) ||
            EX_CHECK(rbr_request_accept(req, s.cq, &copts, &s.conn)))
            goto out;
    } else if (EX_CHECK(rbr_connect(ctx, addr, s.cq, &copts, &s.conn))) {
        goto out;
    }
    if (EX_CHECK(rbr_conn_post_recv(s.conn, s.ctl_in, 0, 64, 0)) ||
        exchange(&s, server))
        goto out;
    if (server) {
        rc = serve(&s) ? 1 : 0;
        goto out;
    }
    rtt = calloc(iters + iters / 10 + 100, sizeof *rtt);
    if (rtt == NULL)
        goto out;
    for (size_t k = 0; k < n_sizes; k++) {
        uint32_t size = (uint32_t)sizes[k];
        uint64_t warm = iters / 10 < 100 ? 100 : iters / 10;
        uint64_t count = bytes / size < 100 ? 100 : bytes / size;
        uint64_t ns;

        if (tests & T_WLAT) {
            if (run_wlat(&s, size, warm + iters, rtt))
                goto out;
            for (uint64_t i = 0; i < iters; i++)
                rtt[i] = rtt[warm + i];
            print_lat("wlat", size, rtt, iters, 2000.0);
        }
        if (tests & T_RLAT) {
            if (run_rlat(&s, size, warm, rtt) || run_rlat(&s, size, iters, rtt))
                goto out;
            print_lat("rlat", size, rtt, iters, 1000.0);
        }
        for (int read = 0; read < 2; read++) {
            if (!(tests & (read ? T_RBW : T_WBW)))
                continue;
            if (run_stream(&s, read, size, count / 10 + 1, (uint32_t)window, &ns) ||
                run_stream(&s, read, size, count, (uint32_t)window, &ns))
                goto out;
            printf("RESULT %s %u mb_s=%.1f count=%llu window=%u\n",
                   read ? "rbw" : "wbw", size,
                   (double)count * size / ((double)ns / 1e9) / 1e6,
                   (unsigned long long)count, (unsigned)window);
            fflush(stdout);
        }
    }
    rc = send_ctl(&s, T_DONE, 1, 0) ? 1 : 0;
    if (rc == 0) {
        /* The server closes after T_DONE: wait for its disconnect, so the
         * unsignaled control send is known to have arrived. */
        rbr_completion c;
        while (ex_wait_one(s.cq, &c, (int32_t)secs * 1000) == RBR_OK)
            if (c.opcode == RBR_OP_DISCONNECTED)
                break;
    }
out:
    free(rtt);
    rbr_conn_destroy(s.conn);
    rbr_mr_destroy(s.region);
    rbr_mr_destroy(s.local);
    rbr_mr_destroy(s.ctl_in);
    rbr_cq_destroy(s.cq);
    rbr_request_destroy(req);
    rbr_listener_destroy(l);
    rbr_ctx_destroy(ctx);
    return rc;
usage:
    fprintf(stderr,
            "usage: %s -r server|client [-a ADDR] [-t wlat,wbw,rlat,rbw] "
            "[-s SIZES] [-n ITERS] [-b BYTES] [-w WINDOW] [-T SECS] [-P]\n",
            argv[0]);
    return 2;
}
