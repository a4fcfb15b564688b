/*
 * rbr_burst_client: many clients connecting at once, each checking its
 * echoes - the load that rbr_epoll_server is built for.
 *
 * Shows how one process runs many connections from many threads: one
 * context shared by all (contexts are thread-safe), and per thread its own
 * completion queue, memory region and connection.  Every thread prepares
 * its queue and region, then waits at a start gate; once all are ready the
 * gate opens for all of them together, so that the connects really arrive
 * as a burst.  Each client then connects (with rbr_client's hello as
 * private data, checking the server's answer), sends MSGS messages of SIZE
 * bytes with up to WINDOW of them outstanding, checks every echo byte for
 * byte against the pattern from common.h, disconnects, waits for its
 * RBR_OP_DISCONNECTED record and destroys its connection.  Client i numbers
 * its messages from i * MSGS, so that clients send different bytes and an
 * echo delivered to the wrong client would most likely not verify (the
 * pattern has 256 forms).
 *
 * With -q N it first opens N silent peers, for shm:// addresses only: raw
 * AF_UNIX/SOCK_SEQPACKET sockets connected to the listener's abstract
 * address "\0rdmabridge/NAME" that then say nothing, held open until the
 * end, to show that peers which never finish a handshake do not hold the
 * server up.  (Over verbs the connection manager completes the transport
 * handshake itself, so there is no such peer to make.)
 *
 * Usage: rbr_burst_client [-a ADDR] [-n CLIENTS] [-m MSGS] [-s SIZE]
 *                         [-w WINDOW] [-q SILENT] [-C MS] [-t SECS] [-v]
 *   -a ADDR     server address (default shm://rdmabridge-demo)
 *   -n CLIENTS  connections started at once, one thread each (default 200)
 *   -m MSGS     messages per client (default 100)
 *   -s SIZE     message size in bytes, 0 allowed, K/M suffixes (default 64;
 *               at most the server's MAX_MSG)
 *   -w WINDOW   messages outstanding per client (default 4)
 *   -q SILENT   silent peers to hold open during the run (shm:// only)
 *   -C MS       fail if any client took longer than MS ms to connect
 *               (default 0: no bound beyond the time limit)
 *   -t SECS     give up after SECS seconds in all (default 60)
 *   -v          one line per client
 *
 * Prints a summary: clients connected and verified, echoes verified, time,
 * and the slowest connect.  Exit status 0 only if every client connected
 * (within MS ms, with -C), every echo verified and every connection ended in
 * order, all within the time limit.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define POLL_BATCH 16
#define SHM_PREFIX "shm://"

struct burst_opts {
    const char *addr;
    uint32_t clients;
    uint64_t msgs;
    size_t size;
    uint32_t window;
    uint32_t silent;
    uint64_t connect_ms; /* -C: 0 = no bound */
    uint64_t secs;
    int verbose;
};

/* Shared by all threads: read-only once the threads start, except the
 * gate, which its mutex guards. */
struct burst {
    const struct burst_opts *o;
    rbr_ctx *ctx;
    uint64_t deadline_ns;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    uint32_t ready; /* threads waiting at the gate */
    int open;       /* 1: go; -1: give up without connecting */
};

struct client {
    struct burst *b;
    pthread_t thread;
    uint32_t index;
    /* Written by the thread, read by main after pthread_join. */
    int connected;
    int ok;
    uint64_t verified;   /* echoes verified */
    uint64_t connect_ns; /* how long rbr_connect took */
};

/* Per-thread state of one connection's exchange. */
struct flow {
    const struct burst_opts *o;
    rbr_cq *cq;
    rbr_conn *conn;
    const rbr_mr *mr; /* window send slots, then window receive slots */
    uint8_t *base;
    size_t stride;
    uint64_t first;     /* pattern number of message 0 */
    uint64_t sent;
    uint64_t echoed;
    uint64_t recv_posted;
    uint32_t *free_send; /* stack of free send slots */
    uint32_t n_free_send;
};

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR] [-n CLIENTS] [-m MSGS] [-s SIZE] [-w WINDOW] "
            "[-q SILENT] [-C MS] [-t SECS] [-v]\n"
            "  -a ADDR     server address (default %s)\n"
            "  -n CLIENTS  connections started at once (default 200)\n"
            "  -m MSGS     messages per client (default 100)\n"
            "  -s SIZE     message size in bytes (default 64)\n"
            "  -w WINDOW   messages outstanding per client (default 4)\n"
            "  -q SILENT   silent peers held open during the run: raw\n"
            "              sockets that connect and say nothing (shm://\n"
            "              addresses only; over verbs there is no such peer)\n"
            "  -C MS       fail if a connect takes longer than MS ms\n"
            "  -t SECS     time limit for the whole run (default 60)\n"
            "  -v          one line per client\n",
            argv0, EX_DEFAULT_ADDR);
}

static int parse_opts(int argc, char **argv, struct burst_opts *o)
{
    uint64_t v;
    int ch;

    o->addr = EX_DEFAULT_ADDR;
    o->clients = 200;
    o->msgs = 100;
    o->size = 64;
    o->window = 4;
    o->silent = 0;
    o->connect_ms = 0;
    o->secs = 60;
    o->verbose = 0;
    while ((ch = getopt(argc, argv, "a:n:m:s:w:q:C:t:vh")) != -1) {
        switch (ch) {
        case 'a':
            o->addr = optarg;
            break;
        case 'n':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > 10000) {
                ex_error("bad client count '%s' (1..10000)", optarg);
                return -1;
            }
            o->clients = (uint32_t)v;
            break;
        case 'm':
            if (ex_parse_size(optarg, &v) != 0 || v > UINT32_MAX) {
                ex_error("bad message count '%s'", optarg);
                return -1;
            }
            o->msgs = v;
            break;
        case 's':
            if (ex_parse_size(optarg, &v) != 0 || v > UINT32_MAX) {
                ex_error("bad size '%s'", optarg);
                return -1;
            }
            o->size = (size_t)v;
            break;
        case 'w':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > 16384) {
                ex_error("bad window '%s' (1..16384)", optarg);
                return -1;
            }
            o->window = (uint32_t)v;
            break;
        case 'q':
            if (ex_parse_size(optarg, &v) != 0 || v > 10000) {
                ex_error("bad silent peer count '%s' (0..10000)", optarg);
                return -1;
            }
            o->silent = (uint32_t)v;
            break;
        case 'C':
            if (ex_parse_size(optarg, &v) != 0 || v > 86400000u) {
                ex_error("bad connect bound '%s' (ms)", optarg);
                return -1;
            }
            o->connect_ms = v;
            break;
        case 't':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > 86400) {
                ex_error("bad time limit '%s' (1..86400 s)", optarg);
                return -1;
            }
            o->secs = v;
            break;
        case 'v':
            o->verbose = 1;
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
    if (o->silent > 0 && strncmp(o->addr, SHM_PREFIX, strlen(SHM_PREFIX)) != 0) {
        ex_error("-q needs a shm:// address: over verbs the connection "
                 "manager does the transport handshake, so there is no "
                 "silent peer to open");
        return -1;
    }
    return 0;
}

/* Milliseconds left until the deadline, at least 1 (the callers check the
 * deadline themselves). */
static int32_t ms_left(const struct burst *b)
{
    uint64_t now = ex_now_ns();
    uint64_t ms;

    if (now >= b->deadline_ns)
        return 1;
    ms = (b->deadline_ns - now + 999999u) / 1000000u;
    return ms > INT32_MAX ? INT32_MAX : (int32_t)ms;
}

/* Waits for at least one completion, within the run's deadline. */
static int wait_batch(const struct burst *b, struct flow *f,
                      rbr_completion *wc, size_t *n, const char *what)
{
    rbr_status st;

    if (ex_now_ns() >= b->deadline_ns) {
        st = RBR_ERR_TIMEOUT;
    } else {
        st = ex_wait_completions(f->cq, wc, POLL_BATCH, n, ms_left(b));
    }
    if (st == RBR_ERR_TIMEOUT) {
        ex_error("connection %llu: out of time %s: sent %llu, echoes %llu",
                 (unsigned long long)rbr_conn_id(f->conn), what,
                 (unsigned long long)f->sent, (unsigned long long)f->echoed);
        return -1;
    }
    return ex_check(st, what);
}

static int post_recv(struct flow *f, uint32_t slot)
{
    size_t off = (size_t)(f->o->window + slot) * f->stride;

    if (ex_check(rbr_conn_post_recv(f->conn, f->mr, off, f->o->size, slot),
                 "rbr_conn_post_recv"))
        return -1;
    f->recv_posted++;
    return 0;
}

static int send_next(struct flow *f)
{
    uint32_t slot = f->free_send[--f->n_free_send];
    size_t off = (size_t)slot * f->stride;

    ex_fill_pattern(f->base + off, f->o->size, f->first + f->sent);
    if (ex_check(rbr_conn_post_send(f->conn, f->mr, off, f->o->size, slot,
                                    RBR_SEND_SIGNALED),
                 "rbr_conn_post_send"))
        return -1;
    f->sent++;
    return 0;
}

static int handle(struct flow *f, const rbr_completion *c, void *context)
{
    uint32_t slot = (uint32_t)c->wr_id;

    if (c->opcode == RBR_OP_DISCONNECTED) {
        ex_error("connection %llu: server disconnected after %llu echoes",
                 (unsigned long long)c->conn_id,
                 (unsigned long long)f->echoed);
        return -1;
    }
    if (c->status == RBR_WC_FLUSHED) {
        ex_error("connection %llu went down after %llu of %llu echoes",
                 (unsigned long long)c->conn_id,
                 (unsigned long long)f->echoed,
                 (unsigned long long)f->o->msgs);
        return -1;
    }
    if (c->conn_context != context || c->status != RBR_WC_SUCCESS ||
        (c->opcode != RBR_OP_SEND && c->opcode != RBR_OP_RECV) ||
        c->wr_id >= f->o->window) {
        ex_report_completion("unexpected completion", c);
        return -1;
    }
    if (c->opcode == RBR_OP_SEND) {
        f->free_send[f->n_free_send++] = slot;
        return 0;
    }
    if (f->echoed >= f->sent) {
        ex_report_completion("echo of a message never sent", c);
        return -1;
    }
    if (c->byte_len != f->o->size) {
        ex_error("connection %llu: echo %llu has %u bytes, expected %zu",
                 (unsigned long long)c->conn_id,
                 (unsigned long long)f->echoed, (unsigned)c->byte_len,
                 f->o->size);
        return -1;
    }
    if (ex_verify_pattern(f->base + (size_t)(f->o->window + slot) * f->stride,
                          f->o->size, f->first + f->echoed))
        return -1;
    f->echoed++;
    /* Keep a receive posted for every echo still to come. */
    if (f->recv_posted < f->o->msgs)
        return post_recv(f, slot);
    return 0;
}

/* Sends every message and verifies every echo, WINDOW outstanding at most. */
static int exchange(const struct burst *b, struct flow *f, void *context)
{
    rbr_completion wc[POLL_BATCH];
    uint32_t i;

    for (i = 0; i < f->o->window && f->recv_posted < f->o->msgs; i++)
        if (post_recv(f, i))
            return -1;
    while (f->echoed < f->o->msgs || f->n_free_send < f->o->window) {
        size_t n = 0;
        size_t j;

        while (f->sent < f->o->msgs && f->n_free_send > 0 &&
               f->sent - f->echoed < f->o->window)
            if (send_next(f))
                return -1;
        if (wait_batch(b, f, wc, &n, "waiting for echoes"))
            return -1;
        for (j = 0; j < n; j++)
            if (handle(f, &wc[j], context))
                return -1;
    }
    return 0;
}

/* Disconnects; then only RBR_OP_DISCONNECTED, with RBR_WC_SUCCESS, may
 * come (every receive posted has been filled). */
static int disconnect(const struct burst *b, struct flow *f)
{
    rbr_completion wc[POLL_BATCH];
    size_t n = 0;
    size_t i;

    if (EX_CHECK(rbr_conn_disconnect(f->conn)))
        return -1;
    if (wait_batch(b, f, wc, &n, "waiting for the disconnect"))
        return -1;
    for (i = 0; i < n; i++) {
        if (wc[i].opcode != RBR_OP_DISCONNECTED ||
            wc[i].status != RBR_WC_SUCCESS || i + 1 != n) {
            ex_report_completion("unexpected completion at the disconnect",
                                 &wc[i]);
            return -1;
        }
    }
    return 0;
}

/* Waits at the start gate; returns 0 to go on, -1 to give up. */
static int wait_at_gate(struct burst *b)
{
    int open;

    pthread_mutex_lock(&b->lock);
    b->ready++;
    pthread_cond_broadcast(&b->cond);
    while (b->open == 0)
        pthread_cond_wait(&b->cond, &b->lock);
    open = b->open;
    pthread_mutex_unlock(&b->lock);
    return open > 0 ? 0 : -1;
}

/* Fails if anything is still queued once the connection is destroyed:
 * RBR_OP_DISCONNECTED was its last record. */
static int expect_no_more(rbr_cq *cq)
{
    rbr_completion wc[POLL_BATCH];
    size_t n = 0;
    size_t i;
    rbr_status st = rbr_cq_poll(cq, wc, POLL_BATCH, &n);

    if (st == RBR_EMPTY)
        return 0;
    if (ex_check(st, "rbr_cq_poll"))
        return -1;
    for (i = 0; i < n; i++)
        ex_report_completion("completion after RBR_OP_DISCONNECTED", &wc[i]);
    return -1;
}

/* Everything a client needs before it connects: its send-slot stack, its
 * completion queue and its memory region.  On failure the caller frees what
 * was made. */
static int prepare(const struct client *cl, struct flow *f, rbr_cq **cq,
                   rbr_mr **mr)
{
    const struct burst_opts *o = cl->b->o;
    uint32_t i;

    f->o = o;
    f->stride = ex_slot_stride(o->size);
    f->first = (uint64_t)cl->index * o->msgs;
    f->free_send = calloc(o->window, sizeof *f->free_send);
    if (f->free_send == NULL) {
        ex_error("client %u: out of memory", (unsigned)cl->index);
        return -1;
    }
    for (i = 0; i < o->window; i++)
        f->free_send[i] = o->window - 1 - i;
    f->n_free_send = o->window;
    if (EX_CHECK(rbr_cq_create(cq)))
        return -1;
    f->cq = *cq;
    if (ex_check(rbr_mr_alloc(cl->b->ctx, 2 * o->window * f->stride,
                              RBR_ACCESS_LOCAL_WRITE, mr),
                 "rbr_mr_alloc"))
        return -1;
    f->mr = *mr;
    f->base = rbr_mr_addr(*mr);
    if (f->base == NULL) {
        ex_error("rbr_mr_addr returned NULL");
        return -1;
    }
    return 0;
}

static void *client_main(void *arg)
{
    struct client *cl = arg;
    struct burst *b = cl->b;
    const struct burst_opts *o = b->o;
    struct flow f;
    rbr_cq *cq = NULL;
    rbr_mr *mr = NULL;
    rbr_conn *conn = NULL;
    rbr_conn_options copts;
    char hello[RBR_PRIVATE_DATA_RECV_MAX];
    size_t hello_len = 0;
    int prepared;
    uint64_t t0;

    memset(&f, 0, sizeof f);
    prepared = prepare(cl, &f, &cq, &mr) == 0;
    /* Every thread comes to the gate, prepared or not, so that main never
     * waits for one that is not coming. */
    if (wait_at_gate(b) != 0 || !prepared)
        goto out_prepared;

    rbr_conn_options_init(&copts);
    copts.timeout_ms = ms_left(b);
    copts.send_queue_depth = o->window;
    copts.recv_queue_depth = o->window;
    copts.private_data = EX_CLIENT_HELLO;
    copts.private_data_len = strlen(EX_CLIENT_HELLO);
    copts.context = cl;
    t0 = ex_now_ns();
    if (ex_check(rbr_connect(b->ctx, o->addr, cq, &copts, &conn),
                 "rbr_connect"))
        goto out_prepared;
    cl->connect_ns = ex_now_ns() - t0;
    cl->connected = 1;
    f.conn = conn;

    if (EX_CHECK(rbr_conn_private_data(conn, hello, sizeof hello,
                                       &hello_len)))
        goto out_conn;
    if (hello_len != strlen(EX_SERVER_HELLO) ||
        memcmp(hello, EX_SERVER_HELLO, hello_len) != 0) {
        ex_error("connection %llu: server answered with %zu bytes of "
                 "private data, expected \"%s\"",
                 (unsigned long long)rbr_conn_id(conn), hello_len,
                 EX_SERVER_HELLO);
        goto out_conn;
    }
    if (exchange(b, &f, cl))
        goto out_conn;
    cl->verified = f.echoed;
    if (disconnect(b, &f))
        goto out_conn;
    if (o->verbose)
        printf("client %u: connection %llu, connected in %.1f ms, %llu "
               "echoes verified\n",
               (unsigned)cl->index, (unsigned long long)rbr_conn_id(conn),
               (double)cl->connect_ns / 1e6, (unsigned long long)f.echoed);
    /* Destroying waits for the connection to finish: whatever it would
     * still queue is queued now. */
    rbr_conn_destroy(conn);
    conn = NULL;
    if (expect_no_more(cq))
        goto out_conn;
    cl->ok = 1;

out_conn:
    rbr_conn_destroy(conn);
out_prepared:
    rbr_mr_destroy(mr);
    rbr_cq_destroy(cq);
    free(f.free_send);
    return NULL;
}

/*
 * Opens one silent peer: a seqpacket socket connected to the listener's
 * abstract address, "\0rdmabridge/" NAME (see src/shm/handshake.rs).  A
 * full listen backlog makes connect fail with EAGAIN: try again until the
 * deadline.  Returns the descriptor, or -1.
 */
static int open_silent_peer(const char *name, uint64_t deadline_ns)
{
    struct sockaddr_un sa;
    size_t name_len = strlen(name);
    const char prefix[] = "rdmabridge/";
    socklen_t len;
    int fd;

    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    /* sun_path[0] stays 0: the abstract namespace. */
    if (1 + strlen(prefix) + name_len > sizeof sa.sun_path) {
        ex_error("shm name '%s' too long", name);
        return -1;
    }
    memcpy(sa.sun_path + 1, prefix, strlen(prefix));
    memcpy(sa.sun_path + 1 + strlen(prefix), name, name_len);
    len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 +
                      strlen(prefix) + name_len);

    fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        ex_error("socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
        return -1;
    }
    for (;;) {
        struct timespec ms = {0, 1000000};

        if (connect(fd, (const struct sockaddr *)&sa, len) == 0)
            return fd;
        if (errno != EAGAIN && errno != EINTR) {
            ex_error("silent peer: connect to shm://%s: %s", name,
                     strerror(errno));
            break;
        }
        if (ex_now_ns() >= deadline_ns) {
            ex_error("silent peer: listen backlog still full at the "
                     "deadline");
            break;
        }
        nanosleep(&ms, NULL);
    }
    close(fd);
    return -1;
}

int main(int argc, char **argv)
{
    struct burst_opts o;
    struct burst b;
    struct client *clients = NULL;
    int *silent = NULL;
    uint32_t n_silent = 0;
    uint32_t started = 0;
    uint32_t connected = 0;
    uint32_t ok = 0;
    uint64_t verified = 0;
    uint64_t slowest = 0;
    uint64_t t0;
    uint64_t t1;
    uint32_t i;
    int err;
    int rc = EXIT_FAILURE;

    ex_set_progname(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o))
        return EXIT_FAILURE;
    memset(&b, 0, sizeof b);
    b.o = &o;
    b.deadline_ns = ex_now_ns() + o.secs * 1000000000u;
    if (ex_slot_stride(o.size) > SIZE_MAX / 2 / o.window) {
        ex_error("window of %u messages of %zu bytes does not fit in memory",
                 (unsigned)o.window, o.size);
        return EXIT_FAILURE;
    }

    clients = calloc(o.clients, sizeof *clients);
    silent = calloc(o.silent > 0 ? o.silent : 1, sizeof *silent);
    if (clients == NULL || silent == NULL) {
        ex_error("out of memory");
        goto out_memory;
    }
    if ((err = pthread_mutex_init(&b.lock, NULL)) != 0) {
        ex_error("pthread_mutex_init: %s", strerror(err));
        goto out_memory;
    }
    if ((err = pthread_cond_init(&b.cond, NULL)) != 0) {
        ex_error("pthread_cond_init: %s", strerror(err));
        goto out_mutex;
    }
    if (EX_CHECK(rbr_ctx_create(&b.ctx)))
        goto out_cond;

    for (n_silent = 0; n_silent < o.silent; n_silent++) {
        int fd = open_silent_peer(o.addr + strlen(SHM_PREFIX), b.deadline_ns);

        if (fd < 0)
            goto out_silent;
        silent[n_silent] = fd;
    }
    if (o.silent > 0)
        printf("%u silent peers connected\n", (unsigned)n_silent);

    for (started = 0; started < o.clients; started++) {
        clients[started].b = &b;
        clients[started].index = started;
        err = pthread_create(&clients[started].thread, NULL, client_main,
                             &clients[started]);
        if (err != 0) {
            ex_error("pthread_create (client %u): %s", (unsigned)started,
                     strerror(err));
            break;
        }
    }
    /* Open the gate once every thread started is waiting at it (or give
     * up, if not all could start). */
    pthread_mutex_lock(&b.lock);
    while (b.ready < started)
        pthread_cond_wait(&b.cond, &b.lock);
    b.open = started == o.clients ? 1 : -1;
    pthread_cond_broadcast(&b.cond);
    pthread_mutex_unlock(&b.lock);
    t0 = ex_now_ns();

    for (i = 0; i < started; i++) {
        err = pthread_join(clients[i].thread, NULL);
        if (err != 0) {
            /* Cannot happen for a joinable thread of ours; its results
             * stay unset, so it counts as failed. */
            ex_error("pthread_join (client %u): %s", (unsigned)i,
                     strerror(err));
            continue;
        }
        connected += (uint32_t)clients[i].connected;
        ok += (uint32_t)clients[i].ok;
        verified += clients[i].verified;
        if (clients[i].connect_ns > slowest)
            slowest = clients[i].connect_ns;
    }
    t1 = ex_now_ns();

    printf("%u of %u clients connected, %u of %u verified all %llu echoes "
           "(%llu echoes of %zu bytes verified in all) in %.2f s; slowest "
           "connect %.1f ms\n",
           (unsigned)connected, (unsigned)o.clients, (unsigned)ok,
           (unsigned)o.clients, (unsigned long long)o.msgs,
           (unsigned long long)verified, o.size, (double)(t1 - t0) / 1e9,
           (double)slowest / 1e6);
    if (n_silent > 0)
        printf("%u silent peers held open throughout\n", (unsigned)n_silent);
    if (o.connect_ms > 0 && slowest > o.connect_ms * 1000000u)
        ex_error("the slowest connect took %.1f ms, more than the %llu ms "
                 "allowed by -C", (double)slowest / 1e6,
                 (unsigned long long)o.connect_ms);
    else if (ok == o.clients)
        rc = EXIT_SUCCESS;

out_silent:
    while (n_silent > 0)
        close(silent[--n_silent]);
    rbr_ctx_destroy(b.ctx);
out_cond:
    pthread_cond_destroy(&b.cond);
out_mutex:
    pthread_mutex_destroy(&b.lock);
out_memory:
    free(silent);
    free(clients);
    return rc;
}
