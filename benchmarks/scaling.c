/*
 * rbr_scaling: what idle connections cost the busy one, over shm or verbs
 * (-a rdma://HOST:PORT), written only against the public header.  Over
 * verbs the idle connections' queue depth (IDLE_DEPTH) keeps 1,024 of them
 * within one device CQ of soft-RoCE (32,767 entries: each connection takes
 * its two depths plus 19 for the library's own work).
 *
 * The program forks: the child is the server, the parent the client.  Each
 * side puts all of its connections on one completion queue.  The client
 * opens connections until it has N of them (for each N in the list, in
 * increasing order, adding to the ones it has), every one with receives
 * posted on both sides, and then, with all N connected and all but the
 * first idle, measures:
 *   poll  the cost of one rbr_cq_poll on its queue that finds nothing
 *         (RBR_EMPTY): BATCHES batches of calls, each batch long enough to
 *         take about 2 ms; prints the median over batches of ns per call;
 *   lat   ping-pong of SIZE bytes on the first connection (the server
 *         busy-polls its own queue of N connections and echoes): WARMUP
 *         round trips, then ITERS timed ones; prints the one-way latency
 *         (half the round trip), median and 99th percentile.
 * With -r MSGS it then measures, at each N:
 *   rate  MSGS messages of RATE_SIZE bytes (-m, default 512) sent by the client
 *         round-robin over all N connections, the server (polling its one
 *         queue) taking each into one of RATE_DEPTH (16) receives posted per
 *         connection and posting it again at once; the client keeps at most
 *         RATE_DEPTH sends out per connection (every eighth signaled, and
 *         each connection's last), polling its queue once after each send.  A tenth of MSGS, and at least
 *         WARM (-w, default 4,096) per connection - every page of the
 *         rings touched - runs first as a warm-up.  The timed messages go
 *         in RATE_PASSES (5) passes, each from its first send to its last
 *         send's completion, and each right after a pass of as many
 *         messages over the first connection alone (the others idle): it
 *         prints the median over passes of the messages per second over N
 *         connections, the best pass, the ratio to the first N's median
 *         (N = 1 in the default list), and the ratio of the medians, N
 *         connections to one, measured side by side (other load on the
 *         machine hits both alike).  Every connection then has queue
 *         depths of RATE_DEPTH on both sides.
 *   mem   after the rate run, the resident memory of each process
 *         (VmRSS, which counts the shared memory a process has touched)
 *         and its pinned memory (VmPin: over verbs, what is registered
 *         with the device), and per connection: the growth since the first
 *         N over the connections added since.
 * How the server's connections (all but the first, which carries the
 * ping-pong and the control messages) receive: by default every receive goes
 * into one buffer all share (what a connection costs besides its buffers);
 * with -B each connection has buffers of its own, one per receive (what a
 * server that posts receives per connection pays); with -Q DEPTH they take
 * their receives from one shared receive queue of DEPTH, one buffer each
 * (the pool's memory, whatever N is).
 * Both sides busy-poll with rbr_cq_poll, never rbr_cq_wait, as rbr_bench
 * does.  It also prints the client process's threads and open descriptors
 * at N (from /proc/self), which show what each connection costs besides
 * polling.
 *
 * With 1,024 connections each side holds several descriptors per connection
 * (over shm the library's sockets, event descriptors and shared-memory
 * segments; over verbs the RDMA CM event channels): the
 * program raises its soft limit of open files (RLIMIT_NOFILE) up to the hard
 * limit before it forks, and says so when even that is too low.
 *
 * The client drives the server through small control messages on the first
 * connection (each echoed once the server has done what it asks): "accept K
 * more connections" before it opens them, "take K messages of the rate run
 * without echoing them" before that run, and "quit" at the end.
 *
 * Output, one line per N (and with -r a second one):
 *   RESULT scaling N poll_ns=X p50_us=X p99_us=X avg_us=X threads=T fds=F
 *   RESULT scaling-rate N msgs_per_s=X best_per_s=X ratio=Y side_ratio=Y
 *   RESULT scaling-mem N client_kib=X server_kib=X client_pin_kib=X
 *          server_pin_kib=X client_kib_per_conn=X server_kib_per_conn=X
 *          client_pin_kib_per_conn=X server_pin_kib_per_conn=X
 *          (the per-connection figures from the second N on)
 *
 * Usage: rbr_scaling [-a ADDR] [-N LIST] [-s SIZE] [-n ITERS] [-b BATCHES]
 *                    [-c A,B] [-T SECS] [-r MSGS] [-w WARM] [-p MODE]
 *                    [-S US] [-m SIZE] [-Q DEPTH] [-B]
 *   -a ADDR     address (default shm://rbr-scaling)
 *   -N LIST     comma list of connection counts, increasing (default
 *               1,16,256,1024)
 *   -s SIZE     ping-pong message size in bytes (default 64)
 *   -n ITERS    timed round trips per N (default 10000); a tenth of that
 *               (at least 100) is the warm-up
 *   -b BATCHES  timed batches of empty polls per N (default 11)
 *   -c A,B      pin the server to cpu A and the client to cpu B (with every
 *               thread the library starts in them); default: no pinning
 *   -T SECS     give up (exit status 1) when a single wait for a completion
 *               or a connection takes longer (default 30)
 *   -r MSGS     also measure the round-robin message rate, MSGS messages
 *               per N (default 0: not measured)
 *   -w WARM     warm-up messages per connection of the rate run, at least
 *               (default 4096)
 *   -m SIZE     message size of the rate run (default 512, at least 64)
 *   -Q DEPTH    the server's connections take their receives from one
 *               shared receive queue of DEPTH receives (1..16384)
 *   -B          each server connection receives into buffers of its own
 *   -p MODE, -S US: completion-queue options as in the C examples (both
 *               sides use them)
 *
 * Exit status 0 only if every measurement ran to the end and the server
 * exited cleanly.
 */
#define _GNU_SOURCE

#include "clock.h"
#include "common.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define DEFAULT_ADDR "shm://rbr-scaling"
#define MAX_COUNTS 16
#define MAX_CONNS 65536
#define POLL_BATCH 64
#define CTL_MAGIC 0x7262727363616c65ull /* "rbrscale" */
/* Queue depths: the first connection carries the ping-pong and the
 * control messages; the others only hold receives. */
#define MAIN_DEPTH 16
#define IDLE_DEPTH 4
/* The rate run: message size, and receives posted (and sends out) per
 * connection. */
#define RATE_SIZE 512
#define RATE_DEPTH 16
#define RATE_SIGNAL_EVERY 8
/* Warm-up messages per connection, at least, by default: enough to touch
 * every page of a ring of up to 2 MiB (the default is 32 KiB), whose first
 * use costs page faults (memory, not the poll cost this measures). */
#define RATE_WARM_PER_CONN 4096
#define RATE_PASSES 5
/* Descriptors per connection and side, generously, and a reserve. */
#define FDS_PER_CONN 8
#define FDS_RESERVE 256

enum ctl_op { CTL_ADD = 1, CTL_QUIT = 2, CTL_RATE = 3, CTL_MEM = 4 };

/* Control message on the first connection, client to server and echoed. */
struct ctl_msg {
    uint64_t magic;
    uint32_t op;
    uint32_t reserved;
    /* CTL_ADD: connections to accept; CTL_RATE: messages; CTL_MEM: the
     * server's resident KiB in the echo */
    uint64_t count;
    /* CTL_MEM: the server's pinned KiB in the echo */
    uint64_t pinned;
};

struct opts {
    const char *addr;
    uint64_t counts[MAX_COUNTS];
    size_t n_counts;
    size_t size;
    uint64_t iters;
    uint32_t batches;
    int cpu_server;
    int cpu_client;
    int timeout_s;
    uint64_t rate_msgs;
    uint64_t rate_warm;
    size_t rate_size;
    uint32_t pool;   /* -Q: the server's shared receive queue, 0: none */
    int own_bufs;    /* -B: each connection's receives into buffers of its own */
    struct ex_cq_opts cq;
};

/* One side: its queue, connections and buffers. */
struct side {
    rbr_ctx *ctx;
    rbr_cq *cq;
    rbr_conn **conns;
    size_t n_conns;
    rbr_mr *send_mr;
    rbr_mr *recv_mr;
    size_t buf_size;
    size_t rate_size;
    uint64_t sends_posted;
    uint64_t sends_done; /* signaled sends completed */
    int64_t timeout_ns;
    int rate; /* -r given: every connection has RATE_DEPTH */
    /* The server's connections but the first: with -Q their receives come from one pool
     * (`srq`, slots of `pool_mr`); with -B each has buffers of its own (`conn_mrs`, one
     * slot per receive); else all share `recv_mr`. */
    rbr_srq *srq;
    rbr_mr *pool_mr;
    rbr_mr **conn_mrs;
    int own_bufs;
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR] [-N LIST] [-s SIZE] [-n ITERS] [-b BATCHES]"
            " [-c A,B] [-T SECS]\n"
            "          [-r MSGS] [-w WARM] [-p MODE] [-S US] [-m SIZE] [-Q DEPTH] [-B]\n"
            "  -a ADDR     address (default %s)\n"
            "  -N LIST     connection counts, increasing (1,16,256,1024)\n"
            "  -s SIZE     ping-pong message size (64)\n"
            "  -n ITERS    timed round trips per count (10000)\n"
            "  -b BATCHES  timed batches of empty polls per count (11)\n"
            "  -c A,B      pin the server to cpu A, the client to cpu B\n"
            "  -T SECS     longest wait for one completion (30)\n"
            "  -r MSGS     round-robin rate run of MSGS messages per count (0)\n"
            "  -w WARM     its warm-up messages per connection, at least (4096)\n"
            "  -m SIZE     its message size (512, at least 64)\n"
            "  -Q DEPTH    the server's connections take their receives from one\n"
            "              shared receive queue of DEPTH receives (the first aside)\n"
            "  -B          each server connection receives into buffers of its own\n"
            EX_CQ_OPTS_USAGE,
            argv0, DEFAULT_ADDR);
}

static int parse_counts(const char *arg, struct opts *o)
{
    char buf[256];
    char *save = NULL;
    char *tok;
    uint64_t v;

    if (strlen(arg) >= sizeof buf)
        return -1;
    strcpy(buf, arg);
    o->n_counts = 0;
    for (tok = strtok_r(buf, ",", &save); tok != NULL;
         tok = strtok_r(NULL, ",", &save)) {
        if (o->n_counts == MAX_COUNTS || ex_parse_size(tok, &v) || v == 0 ||
            v > MAX_CONNS ||
            (o->n_counts > 0 && v <= o->counts[o->n_counts - 1]))
            return -1;
        o->counts[o->n_counts++] = v;
    }
    return o->n_counts > 0 ? 0 : -1;
}

static int parse_cpus(const char *arg, struct opts *o)
{
    char *end;
    long a;
    long b;

    errno = 0;
    a = strtol(arg, &end, 10);
    if (errno || end == arg || *end != ',' || a < 0 || a >= CPU_SETSIZE)
        return -1;
    arg = end + 1;
    b = strtol(arg, &end, 10);
    if (errno || end == arg || *end != '\0' || b < 0 || b >= CPU_SETSIZE)
        return -1;
    o->cpu_server = (int)a;
    o->cpu_client = (int)b;
    return 0;
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
    uint64_t v;
    int ch;

    memset(o, 0, sizeof *o);
    o->addr = DEFAULT_ADDR;
    o->size = 64;
    o->iters = 10000;
    o->batches = 11;
    o->cpu_server = -1;
    o->cpu_client = -1;
    o->timeout_s = 30;
    o->rate_warm = RATE_WARM_PER_CONN;
    o->rate_size = RATE_SIZE;
    ex_cq_opts_init(&o->cq);
    parse_counts("1,16,256,1024", o);
    while ((ch = getopt(argc, argv, "a:N:s:n:b:c:T:r:w:m:p:S:Q:Bh")) != -1) {
        switch (ch) {
        case 'a':
            o->addr = optarg;
            break;
        case 'N':
            if (parse_counts(optarg, o)) {
                ex_error("bad connection counts '%s' (increasing, 1..%d)",
                         optarg, MAX_CONNS);
                return -1;
            }
            break;
        case 's':
            if (ex_parse_size(optarg, &v) || v == 0 || v > (1u << 30)) {
                ex_error("bad size '%s' (1 byte .. 1 GiB)", optarg);
                return -1;
            }
            o->size = (size_t)v;
            break;
        case 'n':
            if (ex_parse_size(optarg, &v) || v == 0 || v > (1ull << 32)) {
                ex_error("bad -n '%s'", optarg);
                return -1;
            }
            o->iters = v;
            break;
        case 'b':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 1001) {
                ex_error("bad -b '%s' (1..1001)", optarg);
                return -1;
            }
            o->batches = (uint32_t)v;
            break;
        case 'c':
            if (parse_cpus(optarg, o)) {
                ex_error("bad cpus '%s' (A,B)", optarg);
                return -1;
            }
            break;
        case 'T':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 3600) {
                ex_error("bad time limit '%s' (1..3600 s)", optarg);
                return -1;
            }
            o->timeout_s = (int)v;
            break;
        case 'r':
            if (ex_parse_size(optarg, &v) || v > (1ull << 40)) {
                ex_error("bad -r '%s'", optarg);
                return -1;
            }
            o->rate_msgs = v;
            break;
        case 'w':
            if (ex_parse_size(optarg, &v) || v > (1ull << 32)) {
                ex_error("bad -w '%s'", optarg);
                return -1;
            }
            o->rate_warm = v;
            break;
        case 'm':
            /* Above a control message's size, so the two never mix. */
            if (ex_parse_size(optarg, &v) || v < 64 || v > (1u << 30)) {
                ex_error("bad -m '%s' (64 bytes .. 1 GiB)", optarg);
                return -1;
            }
            o->rate_size = (size_t)v;
            break;
        case 'Q':
            if (ex_parse_size(optarg, &v) || v == 0 || v > 16384) {
                ex_error("bad -Q '%s' (1..16384)", optarg);
                return -1;
            }
            o->pool = (uint32_t)v;
            break;
        case 'B':
            o->own_bufs = 1;
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
    if (optind != argc) {
        usage(argv[0]);
        return -1;
    }
    if (o->pool != 0 && o->own_bufs) {
        ex_error("-Q and -B exclude each other");
        return -1;
    }
    return 0;
}

static int pin(int cpu)
{
    cpu_set_t set;

    if (cpu < 0)
        return 0;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
        ex_error("cannot pin to cpu %d: %s", cpu, strerror(errno));
        return -1;
    }
    return 0;
}

/* Raises the soft limit of open files far enough for `conns` connections
 * per side (the hard limit permitting).  Both sides inherit it. */
static int raise_fd_limit(uint64_t conns)
{
    struct rlimit rl;
    rlim_t want = (rlim_t)(conns * FDS_PER_CONN + FDS_RESERVE);

    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        ex_error("getrlimit(RLIMIT_NOFILE): %s", strerror(errno));
        return -1;
    }
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        rlim_t old = rl.rlim_cur;

        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= want
                          ? want
                          : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
            ex_error("setrlimit(RLIMIT_NOFILE): %s", strerror(errno));
            return -1;
        }
        fprintf(stderr, "open-file limit raised from %llu to %llu\n",
                (unsigned long long)old, (unsigned long long)rl.rlim_cur);
        if (rl.rlim_cur < want)
            fprintf(stderr,
                    "warning: the hard limit (%llu) is below the %llu "
                    "descriptors %llu connections may need (ulimit -Hn)\n",
                    (unsigned long long)rl.rlim_max,
                    (unsigned long long)want, (unsigned long long)conns);
    }
    return 0;
}

/* A number of /proc/self/status: `fmt` is its line's scanf format ("Threads:
 * %ld"); -1 if unknown. */
static long proc_status(const char *fmt)
{
    char line[256];
    long n = -1;
    FILE *f = fopen("/proc/self/status", "r");

    if (f == NULL)
        return -1;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, fmt, &n) == 1)
            break;
    fclose(f);
    return n;
}

/* Threads of this process (-1 if unknown). */
static long count_threads(void)
{
    return proc_status("Threads: %ld");
}

/* Resident memory of this process in KiB, the shared memory it touched
 * included (-1 if unknown). */
static long resident_kib(void)
{
    return proc_status("VmRSS: %ld kB");
}

/* Pinned memory of this process in KiB (-1 if unknown): over verbs, the
 * memory registered with the device (the kernel counts it in VmPin). */
static long pinned_kib(void)
{
    return proc_status("VmPin: %ld kB");
}

/*
 * Busy-polls until at least one completion is there; fails on an error
 * completion, a connection event, or after the time limit.
 */
static int poll_some(struct side *s, rbr_completion *wc, size_t *n)
{
    rbr_status st = ex_busy_poll(s->cq, wc, POLL_BATCH, n, s->timeout_ns);
    size_t i;

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion for %lld s",
                 (long long)(s->timeout_ns / 1000000000));
        return -1;
    }
    if (st != RBR_OK)
        return ex_check(st, "rbr_cq_poll");
    for (i = 0; i < *n; i++) {
        if (wc[i].status != RBR_WC_SUCCESS ||
            (wc[i].opcode != RBR_OP_SEND && wc[i].opcode != RBR_OP_RECV)) {
            ex_report_completion("unexpected completion", &wc[i]);
            return -1;
        }
        if (wc[i].opcode == RBR_OP_SEND)
            s->sends_done++;
    }
    return 0;
}

/* Every send is signaled (there are few and the queue is shallow). */
static int send_buf(struct side *s, size_t len)
{
    if (ex_check(rbr_conn_post_send(s->conns[0], s->send_mr, 0, len,
                                    s->sends_posted, RBR_SEND_SIGNALED),
                 "rbr_conn_post_send"))
        return -1;
    s->sends_posted++;
    return 0;
}

/* Control messages go inline, so the send buffer stays all zeros: a
 * message of the ping-pong never looks like one. */
static int send_ctl_msg(struct side *s, const struct ctl_msg *m)
{
    if (ex_check(rbr_conn_post_send_inline(s->conns[0], m, sizeof *m,
                                           s->sends_posted, RBR_SEND_SIGNALED),
                 "rbr_conn_post_send_inline"))
        return -1;
    s->sends_posted++;
    return 0;
}

static int send_ctl(struct side *s, uint32_t op, uint64_t count)
{
    struct ctl_msg m;

    memset(&m, 0, sizeof m);
    m.magic = CTL_MAGIC;
    m.op = op;
    m.count = count;
    return send_ctl_msg(s, &m);
}

/* Waits until every send posted so far has completed (taking receives,
 * which must not come: the caller knows none is due). */
static int drain_sends(struct side *s)
{
    rbr_completion wc[POLL_BATCH];
    size_t n;
    size_t i;

    while (s->sends_done < s->sends_posted) {
        if (poll_some(s, wc, &n))
            return -1;
        for (i = 0; i < n; i++)
            if (wc[i].opcode == RBR_OP_RECV) {
                ex_report_completion("receive nobody sent", &wc[i]);
                return -1;
            }
    }
    return 0;
}

static int post_recv(struct side *s, rbr_conn *c)
{
    return ex_check(rbr_conn_post_recv(c, s->recv_mr, 0, s->buf_size, 0),
                    "rbr_conn_post_recv");
}

/* Posts receive `slot` of the connection in place `k`: to the pool (-Q), into the
 * connection's own buffers (-B), or into the buffer all share. */
static int post_recv_at(struct side *s, size_t k, uint32_t slot)
{
    if (k > 0 && s->srq != NULL)
        return ex_check(rbr_srq_post_recv(s->srq, s->pool_mr, (size_t)slot * s->buf_size,
                                          s->buf_size, slot),
                        "rbr_srq_post_recv");
    if (k > 0 && s->own_bufs)
        return ex_check(rbr_conn_post_recv(s->conns[k], s->conn_mrs[k],
                                           (size_t)slot * s->buf_size, s->buf_size, slot),
                        "rbr_conn_post_recv");
    return post_recv(s, s->conns[k]);
}

static uint32_t conn_depth(const struct side *s)
{
    return s->rate ? RATE_DEPTH : s->n_conns == 0 ? MAIN_DEPTH : IDLE_DEPTH;
}

/* Posts the receives of a new connection and adds it to the side. */
static int add_conn(struct side *s, rbr_conn *c)
{
    uint32_t depth = conn_depth(s);
    size_t k = s->n_conns;
    uint32_t i;

    s->conns[s->n_conns++] = c;
    if (k > 0 && s->srq != NULL)
        return 0; /* the pool's receives are posted once, at the start */
    if (k > 0 && s->own_bufs &&
        EX_CHECK(rbr_mr_alloc(s->ctx, depth * s->buf_size, RBR_ACCESS_LOCAL_WRITE,
                              &s->conn_mrs[k])))
        return -1;
    for (i = 0; i < depth; i++)
        if (post_recv_at(s, k, i))
            return -1;
    return 0;
}

static void conn_opts(const struct side *s, rbr_conn_options *co)
{
    uint32_t depth = conn_depth(s);

    rbr_conn_options_init(co);
    co->send_queue_depth = depth;
    co->recv_queue_depth = depth;
    co->timeout_ms = 10000;
    /* Every connection but the first is idle: a non-NULL context marks it
     * in its completions, and names its place in `conns` (which it is about
     * to take) for the rate run. */
    co->context = s->n_conns == 0 ? NULL : (void *)&s->conns[s->n_conns];
    if (s->n_conns > 0)
        co->srq = s->srq;
}

static int side_init(struct side *s, const struct opts *o)
{
    memset(s, 0, sizeof *s);
    s->timeout_ns = (int64_t)o->timeout_s * 1000000000;
    s->rate = o->rate_msgs > 0;
    s->buf_size = o->size > sizeof(struct ctl_msg) ? o->size
                                                   : sizeof(struct ctl_msg);
    s->rate_size = o->rate_size;
    if (s->rate && s->buf_size < s->rate_size)
        s->buf_size = s->rate_size;
    s->conns = calloc((size_t)o->counts[o->n_counts - 1], sizeof *s->conns);
    s->conn_mrs = calloc((size_t)o->counts[o->n_counts - 1], sizeof *s->conn_mrs);
    if (s->conns == NULL || s->conn_mrs == NULL) {
        ex_error("out of memory");
        return -1;
    }
    if (EX_CHECK(rbr_ctx_create(&s->ctx)) ||
        EX_CHECK(ex_cq_create(&o->cq, &s->cq)) ||
        EX_CHECK(rbr_mr_alloc(s->ctx, s->buf_size, 0, &s->send_mr)) ||
        EX_CHECK(rbr_mr_alloc(s->ctx, s->buf_size, RBR_ACCESS_LOCAL_WRITE,
                              &s->recv_mr)))
        return -1;
    memset(rbr_mr_addr(s->send_mr), 0, s->buf_size);
    return 0;
}

/* Connections first (each ends with its connection's thread), then what
 * they used. */
static void side_fini(struct side *s)
{
    size_t i;

    for (i = s->n_conns; i > 0; i--) {
        rbr_conn_destroy(s->conns[i - 1]);
        rbr_mr_destroy(s->conn_mrs[i - 1]);
    }
    rbr_srq_destroy(s->srq);
    rbr_mr_destroy(s->pool_mr);
    rbr_mr_destroy(s->recv_mr);
    rbr_mr_destroy(s->send_mr);
    rbr_cq_destroy(s->cq);
    rbr_ctx_destroy(s->ctx);
    free(s->conns);
    free(s->conn_mrs);
}

/* ------------------------------------------------------------- server */

static int accept_some(struct side *s, rbr_listener *l, uint64_t count,
                       int timeout_s)
{
    uint64_t i;

    for (i = 0; i < count; i++) {
        rbr_request *req = NULL;
        rbr_conn_options co;
        rbr_conn *c = NULL;
        int rc;

        if (ex_check(rbr_listener_get_request(l, timeout_s * 1000, &req),
                     "waiting for a connection"))
            return -1;
        conn_opts(s, &co);
        rc = ex_check(rbr_request_accept(req, s->cq, &co, &c),
                      "rbr_request_accept");
        rbr_request_destroy(req);
        if (rc || add_conn(s, c))
            return -1;
    }
    return 0;
}

/* Echoes every message on the first connection; carries out and echoes
 * control messages; returns at "quit". */
static int serve(struct side *s, rbr_listener *l, const struct opts *o)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t rate_left = 0; /* messages of the rate run still to come */
    size_t n;
    size_t i;

    for (;;) {
        if (poll_some(s, wc, &n))
            return -1;
        for (i = 0; i < n; i++) {
            struct ctl_msg m;
            uint32_t len = wc[i].byte_len;

            if (wc[i].opcode != RBR_OP_RECV)
                continue;
            if (rate_left > 0 && len == s->rate_size) {
                rbr_conn **c = wc[i].conn_context;

                rate_left--;
                if (post_recv_at(s, c == NULL ? 0 : (size_t)(c - s->conns),
                                 (uint32_t)wc[i].wr_id))
                    return -1;
                continue;
            }
            if (wc[i].conn_context != NULL) {
                ex_error("message on an idle connection");
                return -1;
            }
            memset(&m, 0, sizeof m);
            if (len == sizeof m)
                memcpy(&m, rbr_mr_addr(s->recv_mr), sizeof m);
            if (post_recv(s, s->conns[0]))
                return -1;
            /* The client has one message out at a time and takes each
             * echo (completing its send) before it sends again, so a few
             * sends at most are outstanding here. */
            if (m.magic != CTL_MAGIC) {
                if (send_buf(s, len))
                    return -1;
                continue;
            }
            if (m.op == CTL_ADD &&
                (m.count > MAX_CONNS - s->n_conns ||
                 accept_some(s, l, m.count, o->timeout_s)))
                return -1;
            if (m.op == CTL_RATE)
                rate_left = m.count;
            if (m.op == CTL_MEM) {
                m.count = (uint64_t)resident_kib();
                m.pinned = (uint64_t)pinned_kib();
            }
            if (send_ctl_msg(s, &m))
                return -1;
            if (m.op == CTL_QUIT)
                return 0;
        }
    }
}

/* After "quit": the client closes every connection; waits for each
 * RBR_OP_DISCONNECTED (work still outstanding comes back flushed). */
static int wait_closed(struct side *s)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t deadline = ex_now_ns() + (uint64_t)s->timeout_ns;
    size_t closed = 0;
    rbr_status st;
    size_t n;
    size_t i;

    while (closed < s->n_conns) {
        if (ex_now_ns() > deadline) {
            ex_error("%zu of %zu connections closed after %lld s", closed,
                     s->n_conns, (long long)(s->timeout_ns / 1000000000));
            return -1;
        }
        st = ex_wait_completions(s->cq, wc, POLL_BATCH, &n, 1000);
        if (st == RBR_ERR_TIMEOUT)
            continue;
        if (ex_check(st, "waiting for the client to close"))
            return -1;
        for (i = 0; i < n; i++) {
            if (wc[i].opcode == RBR_OP_DISCONNECTED) {
                closed++;
                continue;
            }
            if (wc[i].status != RBR_WC_SUCCESS &&
                wc[i].status != RBR_WC_FLUSHED) {
                ex_report_completion("failed completion at close", &wc[i]);
                return -1;
            }
        }
    }
    return 0;
}

/* The child: listens, tells the parent through `ready`, takes the first
 * connection and serves. */
static int server_main(const struct opts *o, int ready)
{
    struct side s;
    rbr_listener *l = NULL;
    int rc = -1;
    char b = 1;

    memset(&s, 0, sizeof s);
    if (pin(o->cpu_server) || side_init(&s, o))
        goto out;
    s.own_bufs = o->own_bufs;
    if (o->pool != 0) {
        rbr_srq_options qo;
        uint32_t i;

        rbr_srq_options_init(&qo);
        qo.depth = o->pool;
        if (EX_CHECK(rbr_srq_create(s.ctx, &qo, &s.srq)) ||
            EX_CHECK(rbr_mr_alloc(s.ctx, o->pool * s.buf_size, RBR_ACCESS_LOCAL_WRITE,
                                  &s.pool_mr)))
            goto out;
        for (i = 0; i < o->pool; i++)
            if (post_recv_at(&s, 1, i))
                goto out;
    }
    if (EX_CHECK(rbr_listen(s.ctx, o->addr, 64, &l)))
        goto out;
    if (write(ready, &b, 1) != 1) {
        ex_error("cannot tell the client: %s", strerror(errno));
        goto out;
    }
    if (accept_some(&s, l, 1, o->timeout_s) || serve(&s, l, o) ||
        wait_closed(&s))
        goto out;
    rc = 0;
out:
    rbr_listener_destroy(l);
    side_fini(&s);
    return rc;
}

/* ------------------------------------------------------------- client */

/* Sends a control message and waits for its echo and its own completion. */
static int ctl_round(struct side *s, uint32_t op, uint64_t count,
                     int (*meanwhile)(struct side *, uint64_t, const void *),
                     const void *arg)
{
    rbr_completion wc[POLL_BATCH];
    int echoed = 0;
    size_t n;
    size_t i;

    if (send_ctl(s, op, count) || (meanwhile != NULL && meanwhile(s, count, arg)))
        return -1;
    while (!echoed || s->sends_done < s->sends_posted) {
        if (poll_some(s, wc, &n))
            return -1;
        for (i = 0; i < n; i++) {
            if (wc[i].opcode != RBR_OP_RECV)
                continue;
            if (echoed || wc[i].conn_context != NULL ||
                wc[i].byte_len != sizeof(struct ctl_msg)) {
                ex_report_completion("unexpected receive", &wc[i]);
                return -1;
            }
            echoed = 1;
            if (post_recv(s, s->conns[0]))
                return -1;
        }
    }
    return 0;
}

/* Opens `count` more connections; the server is accepting them. */
static int connect_some(struct side *s, uint64_t count, const void *arg)
{
    const struct opts *o = arg;
    uint64_t i;

    for (i = 0; i < count; i++) {
        rbr_conn_options co;
        rbr_conn *c = NULL;

        conn_opts(s, &co);
        if (ex_check(rbr_connect(s->ctx, o->addr, s->cq, &co, &c),
                     "rbr_connect") ||
            add_conn(s, c))
            return -1;
    }
    return 0;
}

/* Median over batches of the ns per empty rbr_cq_poll; *out. */
static int time_empty_polls(struct side *s, uint32_t batches, double *out)
{
    rbr_completion wc[POLL_BATCH];
    double per_call[1001];
    uint64_t calls = 16;
    uint64_t t0;
    uint64_t dt;
    uint64_t i;
    uint32_t b;
    size_t n;

    /* Calibrate: double the batch until one takes 2 ms or more. */
    for (;;) {
        t0 = ex_now_ns();
        for (i = 0; i < calls; i++)
            if (rbr_cq_poll(s->cq, wc, POLL_BATCH, &n) != RBR_EMPTY)
                goto not_empty;
        dt = ex_now_ns() - t0;
        if (dt >= 2000000 || calls >= (1ull << 30))
            break;
        calls *= 2;
    }
    for (b = 0; b < batches; b++) {
        t0 = ex_now_ns();
        for (i = 0; i < calls; i++)
            if (rbr_cq_poll(s->cq, wc, POLL_BATCH, &n) != RBR_EMPTY)
                goto not_empty;
        dt = ex_now_ns() - t0;
        per_call[b] = (double)dt / (double)calls;
    }
    /* Insertion sort; batches is small. */
    for (b = 1; b < batches; b++) {
        double v = per_call[b];
        uint32_t j = b;

        for (; j > 0 && per_call[j - 1] > v; j--)
            per_call[j] = per_call[j - 1];
        per_call[j] = v;
    }
    *out = per_call[batches / 2];
    return 0;
not_empty:
    ex_error("rbr_cq_poll on idle connections did not return RBR_EMPTY "
             "(a completion nobody expected, or an error: %s)",
             rbr_last_error());
    return -1;
}

/* `total` round trips on the first connection, the last `timed` into rtt. */
static int ping_pong(struct side *s, size_t size, uint64_t total,
                     uint64_t timed, uint64_t *rtt)
{
    rbr_completion wc[POLL_BATCH];
    uint64_t i;
    size_t n;
    size_t j;
    bench_span span;

    bench_span_start(&span);
    for (i = 0; i < total; i++) {
        int echoed = 0;
        uint64_t t0;
        uint64_t t1 = 0;

        t0 = bench_ticks();
        if (send_buf(s, size))
            return -1;
        while (!echoed) {
            if (poll_some(s, wc, &n))
                return -1;
            for (j = 0; j < n; j++) {
                if (wc[j].opcode != RBR_OP_RECV)
                    continue;
                t1 = bench_ticks();
                if (echoed || wc[j].conn_context != NULL ||
                    wc[j].byte_len != size) {
                    ex_report_completion("unexpected echo", &wc[j]);
                    return -1;
                }
                echoed = 1;
                if (post_recv(s, s->conns[0]))
                    return -1;
            }
        }
        /* Keep the send queue from filling: its completions come
         * with or soon after the echo. */
        while (s->sends_posted - s->sends_done >= MAIN_DEPTH / 2)
            if (drain_sends(s))
                return -1;
        if (i >= total - timed)
            rtt[i - (total - timed)] = t1 - t0;
    }
    bench_span_to_ns(&span, rtt, timed);
    return drain_sends(s);
}

/* Per connection of the rate run: sends posted and completed. */
struct rate_conn {
    uint64_t posted;
    uint64_t done;
};

/* Takes completions of the rate run's sends (a signaled one completes the
 * unsignaled ones before it): one rbr_cq_poll, or with `wait` as many as it
 * takes to find some; *out is the number of sends still out. */
static int rate_poll(struct side *s, struct rate_conn *rc, int wait,
                     uint64_t *out)
{
    rbr_completion wc[POLL_BATCH];
    size_t n = 0;
    size_t i;
    rbr_status st = wait ? ex_busy_poll(s->cq, wc, POLL_BATCH, &n, s->timeout_ns)
                         : rbr_cq_poll(s->cq, wc, POLL_BATCH, &n);

    if (st == RBR_ERR_TIMEOUT) {
        ex_error("no completion for %lld s in the rate run",
                 (long long)(s->timeout_ns / 1000000000));
        return -1;
    }
    if (st == RBR_EMPTY)
        return 0;
    if (st != RBR_OK)
        return ex_check(st, "rbr_cq_poll");
    for (i = 0; i < n; i++) {
        rbr_conn **c = wc[i].conn_context;
        struct rate_conn *r = &rc[c == NULL ? 0 : (size_t)(c - s->conns)];

        if (wc[i].status != RBR_WC_SUCCESS || wc[i].opcode != RBR_OP_SEND ||
            wc[i].wr_id < r->done || wc[i].wr_id >= r->posted) {
            ex_report_completion("unexpected completion in the rate run",
                                 &wc[i]);
            return -1;
        }
        *out -= wc[i].wr_id + 1 - r->done;
        r->done = wc[i].wr_id + 1;
    }
    return 0;
}

/* `msgs` messages of the rate size round-robin over the first `conns`
 * connections, at most RATE_DEPTH out on each, the queue polled once after
 * each send (as an event loop does) and until there is room when the next
 * connection has none; returns once all have completed, with the messages
 * per second in *rate. */
static int rate_pass(struct side *s, struct rate_conn *rc, size_t conns,
                     uint64_t msgs, double *rate)
{
    uint64_t t0 = ex_now_ns();
    uint64_t out = 0;
    uint64_t i;

    for (i = 0; i < msgs; i++) {
        size_t k = (size_t)(i % conns);
        struct rate_conn *r = &rc[k];
        int last = i + conns >= msgs;
        uint32_t flags =
            last || r->posted % RATE_SIGNAL_EVERY == RATE_SIGNAL_EVERY - 1
                ? RBR_SEND_SIGNALED
                : 0;

        while (r->posted - r->done >= RATE_DEPTH)
            if (rate_poll(s, rc, 1, &out))
                return -1;
        if (ex_check(rbr_conn_post_send(s->conns[k], s->send_mr, 0, s->rate_size,
                                        r->posted, flags),
                     "rbr_conn_post_send"))
            return -1;
        r->posted++;
        out++;
        if (rate_poll(s, rc, 0, &out))
            return -1;
    }
    while (out > 0)
        if (rate_poll(s, rc, 1, &out))
            return -1;
    *rate = (double)msgs * 1e9 / (double)(ex_now_ns() - t0);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a;
    double y = *(const double *)b;

    return (x > y) - (x < y);
}

/* The rate run at the current N (see the header): the median and best
 * messages per second over N connections, and the median over one. */
static int rate_run(struct side *s, uint64_t msgs, uint64_t warm_per_conn,
                    double *rate, double *best, double *one)
{
    uint64_t warm = msgs / 10;
    uint64_t per_pass = (msgs + RATE_PASSES - 1) / RATE_PASSES;
    struct rate_conn *rc = calloc(s->n_conns, sizeof *rc);
    double all_n[RATE_PASSES];
    double one_n[RATE_PASSES];
    double ignored;
    int ret = -1;
    int p;

    if (rc == NULL) {
        ex_error("out of memory");
        return -1;
    }
    if (warm < warm_per_conn * s->n_conns)
        warm = warm_per_conn * s->n_conns;
    if (ctl_round(s, CTL_RATE, warm + 2 * RATE_PASSES * per_pass, NULL,
                  NULL) ||
        rate_pass(s, rc, s->n_conns, warm, &ignored))
        goto out;
    for (p = 0; p < RATE_PASSES; p++)
        if (rate_pass(s, rc, 1, per_pass, &one_n[p]) ||
            rate_pass(s, rc, s->n_conns, per_pass, &all_n[p]))
            goto out;
    qsort(all_n, RATE_PASSES, sizeof *all_n, cmp_double);
    qsort(one_n, RATE_PASSES, sizeof *one_n, cmp_double);
    *rate = all_n[RATE_PASSES / 2];
    *best = all_n[RATE_PASSES - 1];
    *one = one_n[RATE_PASSES / 2];
    ret = 0;
out:
    free(rc);
    return ret;
}

/* The resident and pinned memory of both processes now (the server's in the
 * echo of CTL_MEM, which lands at the start of the receive buffer), and
 * their growth per connection since the `first` call, whose figures it
 * keeps in first_mem and first_n: client resident, server resident, client
 * pinned, server pinned. */
static int report_memory(struct side *s, int first, long first_mem[4],
                         uint64_t *first_n)
{
    static const char *const names[4] = {"client_kib", "server_kib",
                                         "client_pin_kib", "server_pin_kib"};
    struct ctl_msg m;
    long mem[4];
    int i;

    if (ctl_round(s, CTL_MEM, 0, NULL, NULL))
        return -1;
    memcpy(&m, rbr_mr_addr(s->recv_mr), sizeof m);
    mem[0] = resident_kib();
    mem[1] = (long)m.count;
    mem[2] = pinned_kib();
    mem[3] = (long)m.pinned;
    printf("RESULT scaling-mem %llu", (unsigned long long)s->n_conns);
    for (i = 0; i < 4; i++)
        printf(" %s=%ld", names[i], mem[i]);
    if (first) {
        memcpy(first_mem, mem, sizeof mem);
        *first_n = s->n_conns;
    } else if (s->n_conns > *first_n) {
        for (i = 0; i < 4; i++)
            printf(" %s_per_conn=%.1f", names[i],
                   (double)(mem[i] - first_mem[i]) /
                       (double)(s->n_conns - *first_n));
    }
    printf("\n");
    return 0;
}

static int client_main(const struct opts *o, int ready)
{
    struct side s;
    uint64_t *rtt = NULL;
    uint64_t warm = o->iters / 10 < 100 ? 100 : o->iters / 10;
    double first_rate = 0;
    long first_mem[4] = {-1, -1, -1, -1}; /* see report_memory */
    uint64_t first_n = 0;
    size_t k;
    int rc = -1;
    char b;

    memset(&s, 0, sizeof s);
    if (pin(o->cpu_client) || side_init(&s, o))
        goto out;
    rtt = calloc((size_t)o->iters, sizeof *rtt);
    if (rtt == NULL) {
        ex_error("out of memory");
        goto out;
    }
    if (read(ready, &b, 1) != 1) {
        ex_error("the server did not start (see its messages above)");
        goto out;
    }
    if (connect_some(&s, 1, o))
        goto out;
    for (k = 0; k < o->n_counts; k++) {
        uint64_t want = o->counts[k];
        double poll_ns;
        double sum = 0;
        uint64_t i;

        if (want > s.n_conns &&
            ctl_round(&s, CTL_ADD, want - s.n_conns, connect_some, o))
            goto out;
        if (time_empty_polls(&s, o->batches, &poll_ns) ||
            ping_pong(&s, o->size, warm + o->iters, o->iters, rtt))
            goto out;
        for (i = 0; i < o->iters; i++)
            sum += (double)rtt[i];
        printf("RESULT scaling %llu poll_ns=%.2f p50_us=%.3f p99_us=%.3f "
               "avg_us=%.3f threads=%ld fds=%ld\n",
               (unsigned long long)s.n_conns, poll_ns,
               (double)ex_percentile(rtt, o->iters, 50.0) / 2000.0,
               (double)ex_percentile(rtt, o->iters, 99.0) / 2000.0,
               sum / (double)o->iters / 2000.0, count_threads(), ex_count_fds());
        if (o->rate_msgs > 0) {
            double rate;
            double best;
            double one;

            if (rate_run(&s, o->rate_msgs, o->rate_warm, &rate, &best, &one))
                goto out;
            if (k == 0)
                first_rate = rate;
            printf("RESULT scaling-rate %llu msgs_per_s=%.0f best_per_s=%.0f "
                   "ratio=%.3f side_ratio=%.3f\n",
                   (unsigned long long)s.n_conns, rate, best,
                   rate / first_rate, rate / one);
            if (report_memory(&s, k == 0, first_mem, &first_n))
                goto out;
        }
    }
    if (ctl_round(&s, CTL_QUIT, 0, NULL, NULL))
        goto out;
    rc = 0;
out:
    free(rtt);
    side_fini(&s);
    return rc;
}

int main(int argc, char **argv)
{
    struct opts o;
    int pipefd[2];
    int status = 0;
    int rc;
    pid_t pid;

    ex_set_progname(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o) ||
        raise_fd_limit(o.counts[o.n_counts - 1]))
        return EXIT_FAILURE;
    if (pipe(pipefd) != 0) {
        ex_error("pipe: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    fflush(NULL);
    pid = fork();
    if (pid < 0) {
        ex_error("fork: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    if (pid == 0) {
        close(pipefd[0]);
        rc = server_main(&o, pipefd[1]);
        close(pipefd[1]);
        fflush(NULL);
        _exit(rc == 0 ? EXIT_SUCCESS : EXIT_FAILURE);
    }
    close(pipefd[1]);
    rc = client_main(&o, pipefd[0]);
    close(pipefd[0]);
    if (rc != 0)
        kill(pid, SIGTERM);
    if (waitpid(pid, &status, 0) != pid) {
        ex_error("waitpid: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        if (rc == 0)
            ex_error("the server failed");
        return EXIT_FAILURE;
    }
    return rc == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
