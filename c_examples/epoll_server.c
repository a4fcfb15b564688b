/*
 * rbr_epoll_server: a single-threaded echo server for many clients, driven
 * by epoll.
 *
 * Shows how one thread serves any number of connections with exactly two
 * descriptors in its epoll set, both level-triggered:
 *   - the listener's (rbr_listener_fd), readable while a connection request
 *     may be ready.  The loop then takes requests with timeout 0 until
 *     RBR_EMPTY and accepts each.  A timeout of 0 never blocks, so a peer
 *     that connects and then says nothing cannot stall the loop; a readable
 *     descriptor may still give RBR_EMPTY (a request not yet complete), and
 *     the loop simply tries again at the next readiness.
 *   - the completion queue's (rbr_cq_fd), readable exactly while completions
 *     are queued.  All connections share this one queue; the loop polls it
 *     until RBR_EMPTY.
 * Each connection has a struct peer, given to the library as
 * rbr_conn_options.context, so every completion's conn_context leads
 * straight to its connection.  A peer owns one memory region of RECVS slots
 * of MAX_MSG bytes, all posted as receives when it is accepted.  A message
 * is echoed from the slot it arrived in (no copy), and the slot is posted as
 * a receive again once the echo's send has completed; asking for send and
 * receive queues of RECVS entries means a send never finds its queue full.
 * RBR_OP_DISCONNECTED is a connection's last record: the loop then destroys
 * the connection, its region and its struct peer.
 *
 * With -Q DEPTH the clients share one pool of receives instead (a shared
 * receive queue, rbr_srq): one region of DEPTH slots, all posted to the pool
 * at the start, named in every accept's rbr_conn_options.srq.  A message
 * takes the pool's oldest receive whichever client sent it; its completion
 * names the client as before, and its wr_id the pool's slot, from which it
 * is echoed; the slot goes back to the pool once the echo's send completes
 * (or is flushed).  The server's receive memory is then DEPTH slots whatever
 * the number of clients; a client whose message finds the pool empty waits,
 * in its library, until a slot comes back.
 *
 * Accepting never waits for the client: rbr_request_accept_start returns at
 * once, the receives are posted while the connection connects, and its
 * establishment (over verbs: the client's confirmation, one network round
 * trip later) comes on the queue as an RBR_OP_CONNECTED record - or its
 * failure, as that connection's last record.  No library call the loop makes
 * waits for a peer; the longest one is printed at the end.
 *
 * Either descriptor's work is done in bounded portions (at most
 * ACCEPT_BUDGET requests or POLL_BUDGET completions per readiness): what is
 * left keeps the descriptor readable, so epoll reports it again at once, and
 * a stream of completions cannot keep new clients waiting, nor a stream of
 * clients the echoes.
 *
 * SIGINT and SIGTERM are blocked except inside epoll_pwait, so they end the
 * loop cleanly (with the summary) and never interrupt the library's threads.
 *
 * Usage: rbr_epoll_server [-a ADDR] [-s MAX_MSG] [-r RECVS] [-Q DEPTH]
 *                         [-c N] [-t SECS] [-v]
 *   -a ADDR     address to listen on (default shm://rdmabridge-demo)
 *   -s MAX_MSG  largest message in bytes, K/M suffixes (default 4096)
 *   -r RECVS    receives posted per connection (default 16); with -Q, the
 *               send queue depth of each connection
 *   -Q DEPTH    one shared receive queue of DEPTH receives for all
 *               connections (default 0: receives per connection)
 *   -c N        exit once N clients have come and gone (default 0: serve
 *               until SIGINT or SIGTERM)
 *   -t SECS     give up with an error after SECS seconds (default 0: never)
 *   -v          one line per connection
 *
 * The line "listening on ADDR" is printed (and flushed) once both
 * descriptors are in the epoll set, so that scripts know when clients may
 * connect.  At the end it prints "served N clients, echoed M messages
 * (B bytes), F failed", the longest single library call the loop made, and
 * for each kind of call its longest and how many took over 1 ms.
 * A client failed if it was rejected (it did not
 * send rbr_client's hello as private data), its accept failed, one of its
 * work requests failed, or it went away without an orderly disconnect.
 * Exit status 0 only if the server stopped because N clients had come and
 * gone (-c) or because of a signal, and no client failed.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#define LISTEN_BACKLOG 128
#define ACCEPT_BUDGET 64   /* requests taken per listener readiness */
#define POLL_BATCH 64
#define POLL_BUDGET 1024   /* completions taken per queue readiness */
/* How long a client has to confirm an accept (over verbs, one round trip);
 * the loop does not wait for it. */
#define ACCEPT_TIMEOUT_MS 2000
#define EX_REJECT_REASON "rbr-epoll-server: unknown client"

struct server_opts {
    const char *addr;
    size_t max_msg;
    uint32_t recvs;
    uint32_t pool;    /* -Q: 0 = receives per connection */
    uint64_t clients; /* -c: 0 = forever */
    uint64_t secs;    /* -t: 0 = no limit */
    int verbose;
};

/* One accepted connection; the library hands it back as conn_context. */
struct peer {
    rbr_conn *conn;
    rbr_mr *mr;        /* `slots` receive slots of `stride` bytes (NULL with -Q) */
    uint8_t *base;
    uint64_t id;       /* rbr_conn_id, for messages */
    uint32_t slots;    /* receives posted at accept, as granted */
    uint64_t echoed;
    int down;          /* a post said RBR_ERR_DISCONNECTED: stop posting */
    int failed;
    struct peer *prev; /* list of live peers, for teardown */
    struct peer *next;
};

struct server {
    const struct server_opts *o;
    rbr_ctx *ctx;
    rbr_cq *cq;
    rbr_listener *listener;
    rbr_srq *srq;      /* -Q: the clients' one pool of receives */
    rbr_mr *pool_mr;   /* -Q: its `o->pool` slots */
    size_t stride;
    struct peer *peers;
    uint64_t requests; /* requests taken */
    uint64_t served;   /* clients that came and went in order */
    uint64_t failed;   /* clients that came and went otherwise */
    uint64_t echoed;
    uint64_t bytes;
};

static volatile sig_atomic_t stop_signal;
static int pool_lost; /* -Q: a slot could not go back to the pool */

/* The longest single library call the loop made, and which; and per kind of
 * call, the longest and how many took over 1 ms. */
static uint64_t longest_ns;
static const char *longest_call = "none";
static uint64_t call_started;

#define CALL_KINDS 12
static struct call_kind {
    const char *name;
    uint64_t longest_ns;
    uint64_t over_1ms;
} call_kinds[CALL_KINDS];

static void call_start(void)
{
    call_started = ex_now_ns();
}

static rbr_status call_end(const char *name, rbr_status st)
{
    uint64_t took = ex_now_ns() - call_started;
    int i;

    if (took > longest_ns) {
        longest_ns = took;
        longest_call = name;
    }
    for (i = 0; i < CALL_KINDS; i++) {
        struct call_kind *k = &call_kinds[i];

        if (k->name != NULL && k->name != name)
            continue;
        k->name = name;
        if (took > k->longest_ns)
            k->longest_ns = took;
        if (took > 1000000)
            k->over_1ms++;
        break;
    }
    return st;
}

/* A library call, timed (the comma puts the start before the call). */
#define TIMED(name, call) (call_start(), call_end((name), (call)))

static void on_signal(int sig)
{
    stop_signal = sig;
}

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-a ADDR] [-s MAX_MSG] [-r RECVS] [-Q DEPTH] [-c N] "
            "[-t SECS] [-v]\n"
            "  -a ADDR     listen address (default %s)\n"
            "  -s MAX_MSG  largest message in bytes (default 4096)\n"
            "  -r RECVS    receives posted per connection (default 16)\n"
            "  -Q DEPTH    one shared receive queue of DEPTH receives for all\n"
            "              connections (default 0: receives per connection)\n"
            "  -c N        exit after N clients have come and gone (default\n"
            "              0: until SIGINT or SIGTERM)\n"
            "  -t SECS     give up with an error after SECS seconds\n"
            "              (default 0: never)\n"
            "  -v          one line per connection\n",
            argv0, EX_DEFAULT_ADDR);
}

static int parse_opts(int argc, char **argv, struct server_opts *o)
{
    uint64_t v;
    int ch;

    o->addr = EX_DEFAULT_ADDR;
    o->max_msg = 4096;
    o->recvs = 16;
    o->pool = 0;
    o->clients = 0;
    o->secs = 0;
    o->verbose = 0;
    while ((ch = getopt(argc, argv, "a:s:r:Q:c:t:vh")) != -1) {
        switch (ch) {
        case 'a':
            o->addr = optarg;
            break;
        case 's':
            /* byte_len in a completion is 32 bits wide. */
            if (ex_parse_size(optarg, &v) != 0 || v > UINT32_MAX) {
                ex_error("bad message size '%s'", optarg);
                return -1;
            }
            o->max_msg = (size_t)v;
            break;
        case 'r':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > 16384) {
                ex_error("bad receive count '%s' (1..16384)", optarg);
                return -1;
            }
            o->recvs = (uint32_t)v;
            break;
        case 'Q':
            if (ex_parse_size(optarg, &v) != 0 || v == 0 || v > 16384) {
                ex_error("bad pool depth '%s' (1..16384)", optarg);
                return -1;
            }
            o->pool = (uint32_t)v;
            break;
        case 'c':
            if (ex_parse_size(optarg, &v) != 0) {
                ex_error("bad client count '%s'", optarg);
                return -1;
            }
            o->clients = v;
            break;
        case 't':
            if (ex_parse_size(optarg, &v) != 0 || v > 86400u * 365u) {
                ex_error("bad time limit '%s'", optarg);
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
    return 0;
}

/* Marks the peer failed and starts its disconnect; its RBR_OP_DISCONNECTED
 * record, which always comes, frees it. */
static void peer_fail(struct peer *p)
{
    p->failed = 1;
    ex_check(rbr_conn_disconnect(p->conn), "rbr_conn_disconnect");
}

/*
 * A post that returns RBR_ERR_DISCONNECTED means the client is leaving (for
 * instance, it disconnected as soon as it had its last echo while this
 * side's send completion was still on its way): not a failure; the
 * RBR_OP_DISCONNECTED record says how the connection ended.
 */
static void check_post(struct peer *p, rbr_status st, const char *what)
{
    if (st == RBR_ERR_DISCONNECTED)
        p->down = 1;
    else if (ex_check(st, what))
        peer_fail(p);
}

/* -Q: a slot of the pool is free again. */
static void pool_post(const struct server *s, uint32_t slot)
{
    if (ex_check(TIMED("rbr_srq_post_recv",
                       rbr_srq_post_recv(s->srq, s->pool_mr, (size_t)slot * s->stride,
                                         s->o->max_msg, slot)),
                 "rbr_srq_post_recv")) {
        ex_error("slot %u of the pool is lost", (unsigned)slot);
        pool_lost = 1;
    }
}

static void post_recv(const struct server *s, struct peer *p, uint32_t slot)
{
    if (s->srq != NULL) {
        pool_post(s, slot);
        return;
    }
    if (p->down || p->failed)
        return;
    check_post(p, TIMED("rbr_conn_post_recv",
                        rbr_conn_post_recv(p->conn, p->mr, (size_t)slot * s->stride,
                                           s->o->max_msg, slot)),
               "rbr_conn_post_recv");
}

/* The connection is accepted (connecting) and owns p: from now on only its
 * last record (RBR_OP_DISCONNECTED, or a failed RBR_OP_CONNECTED) frees p.
 * Its receives are posted at once: the library hands them to the connection
 * once it is up, so the client's first message finds one. */
static void peer_start(struct server *s, struct peer *p)
{
    uint32_t i;

    p->next = s->peers;
    if (s->peers != NULL)
        s->peers->prev = p;
    s->peers = p;
    p->id = rbr_conn_id(p->conn);
    p->slots = s->o->recvs;
    if (s->srq != NULL) {
        p->slots = s->o->pool; /* the pool's slots, by wr_id */
        return;
    }
    for (i = 0; i < p->slots; i++)
        post_recv(s, p, i);
}

/* RBR_OP_CONNECTED with success: the connection is up; checks what was
 * granted against the receives already posted. */
static void peer_up(struct server *s, struct peer *p)
{
    rbr_conn_info info;

    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (EX_CHECK(TIMED("rbr_conn_get_info", rbr_conn_get_info(p->conn, &info)))) {
        peer_fail(p);
        return;
    }
    /* The library may grant less than asked: then the receives posted
     * beyond it failed (each has its record), and so does this client. */
    if (info.send_queue_depth < s->o->recvs ||
        (s->srq == NULL && info.recv_queue_depth < p->slots)) {
        ex_error("connection %llu: granted queue depths %u/%u, asked for %u",
                 (unsigned long long)p->id, (unsigned)info.send_queue_depth,
                 (unsigned)info.recv_queue_depth, (unsigned)s->o->recvs);
        peer_fail(p);
        return;
    }
    if (s->o->verbose)
        printf("client %llu connected over %s, %u receives posted\n",
               (unsigned long long)p->id,
               info.transport == RBR_TRANSPORT_SHM ? "shm" : "verbs",
               (unsigned)p->slots);
}

/* Answers one request; a client that cannot be served is counted as
 * failed, and the server goes on. */
static void accept_peer(struct server *s, rbr_request *req)
{
    char hello[RBR_PRIVATE_DATA_RECV_MAX];
    size_t hello_len = 0;
    rbr_conn_options copts;
    struct peer *p;

    if (EX_CHECK(rbr_request_private_data(req, hello, sizeof hello,
                                          &hello_len)))
        goto out_request;
    if (hello_len != strlen(EX_CLIENT_HELLO) ||
        memcmp(hello, EX_CLIENT_HELLO, hello_len) != 0) {
        ex_error("request with %zu bytes of private data that are not "
                 "\"%s\": rejected", hello_len, EX_CLIENT_HELLO);
        EX_CHECK(rbr_request_reject(req, EX_REJECT_REASON,
                                    strlen(EX_REJECT_REASON)));
        goto out_request;
    }

    p = calloc(1, sizeof *p);
    if (p == NULL) {
        ex_error("out of memory");
        goto out_request;
    }
    if (s->srq == NULL) {
        if (ex_check(TIMED("rbr_mr_alloc",
                           rbr_mr_alloc(s->ctx, s->stride * s->o->recvs,
                                        RBR_ACCESS_LOCAL_WRITE, &p->mr)),
                     "rbr_mr_alloc"))
            goto out_peer;
        p->base = rbr_mr_addr(p->mr);
        if (p->base == NULL) {
            ex_error("rbr_mr_addr returned NULL");
            goto out_mr;
        }
    }

    rbr_conn_options_init(&copts);
    copts.send_queue_depth = s->o->recvs;
    copts.recv_queue_depth = s->o->recvs;
    copts.private_data = EX_SERVER_HELLO;
    copts.private_data_len = strlen(EX_SERVER_HELLO);
    copts.timeout_ms = ACCEPT_TIMEOUT_MS;
    copts.context = p;
    copts.srq = s->srq;
    if (ex_check(TIMED("rbr_request_accept_start",
                       rbr_request_accept_start(req, s->cq, &copts, &p->conn)),
                 "rbr_request_accept_start"))
        goto out_mr;
    rbr_request_destroy(req);
    peer_start(s, p);
    return;

out_mr:
    rbr_mr_destroy(p->mr);
out_peer:
    free(p);
out_request:
    rbr_request_destroy(req);
    s->failed++;
}

/* Listener readiness: takes requests with timeout 0 until RBR_EMPTY (or
 * the budget is spent).  Returns -1 only if the listener itself fails. */
static int take_requests(struct server *s)
{
    int i;

    for (i = 0; i < ACCEPT_BUDGET; i++) {
        rbr_request *req = NULL;
        rbr_status st = TIMED("rbr_listener_get_request",
                              rbr_listener_get_request(s->listener, 0, &req));

        if (st == RBR_EMPTY)
            return 0;
        if (ex_check(st, "rbr_listener_get_request"))
            return -1;
        s->requests++;
        accept_peer(s, req);
    }
    return 0;
}

/* RBR_OP_DISCONNECTED, or RBR_OP_CONNECTED with a failure: nothing of the
 * connection follows; free it all. */
static void peer_end(struct server *s, struct peer *p, const rbr_completion *c)
{
    if (c->opcode == RBR_OP_CONNECTED) {
        rbr_status why = rbr_conn_status(p->conn);
        ex_error("client %llu: the connection was not established: %s (%s)",
                 (unsigned long long)p->id, rbr_status_str(why), rbr_last_error());
        p->failed = 1;
    } else if (c->status != RBR_WC_SUCCESS) {
        ex_error("client %llu: connection ended with status %s (%d)",
                 (unsigned long long)p->id, ex_wc_status_str(c->status),
                 (int)c->status);
        p->failed = 1;
    }
    if (p->failed)
        s->failed++;
    else
        s->served++;
    if (s->o->verbose)
        printf("client %llu gone after %llu echoes%s\n",
               (unsigned long long)p->id, (unsigned long long)p->echoed,
               p->failed ? ", FAILED" : "");

    if (p->prev != NULL)
        p->prev->next = p->next;
    else
        s->peers = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    call_start();
    rbr_conn_destroy(p->conn);
    call_end("rbr_conn_destroy", RBR_OK);
    call_start();
    rbr_mr_destroy(p->mr);
    call_end("rbr_mr_destroy", RBR_OK);
    free(p);
}

static void handle_completion(struct server *s, const rbr_completion *c)
{
    struct peer *p = c->conn_context;
    uint32_t slot = (uint32_t)c->wr_id;

    if (c->opcode == RBR_OP_DISCONNECTED) {
        peer_end(s, p, c);
        return;
    }
    if (c->opcode == RBR_OP_CONNECTED) {
        if (c->status == RBR_WC_SUCCESS)
            peer_up(s, p);
        else
            peer_end(s, p, c);
        return;
    }
    if (c->status == RBR_WC_FLUSHED) {
        /* The connection is going down; its record follows.  A pool's slot
         * it held (a flushed echo, a receive taken for a message that never
         * came whole) goes back to the pool. */
        if (s->srq != NULL && c->wr_id < p->slots)
            pool_post(s, slot);
        return;
    }
    if (c->status != RBR_WC_SUCCESS ||
        (c->opcode != RBR_OP_RECV && c->opcode != RBR_OP_SEND) ||
        c->wr_id >= p->slots) {
        ex_report_completion("unexpected completion", c);
        peer_fail(p);
        return;
    }
    if (c->opcode == RBR_OP_RECV) {
        /* Echo from the slot it arrived in; the slot is posted again once
         * the send completes. */
        if (p->down || p->failed) {
            if (s->srq != NULL)
                pool_post(s, slot);
            return;
        }
        check_post(p, TIMED("rbr_conn_post_send",
                            rbr_conn_post_send(p->conn, s->srq != NULL ? s->pool_mr : p->mr,
                                               (size_t)slot * s->stride, c->byte_len,
                                               slot, RBR_SEND_SIGNALED)),
                   "rbr_conn_post_send");
        if ((p->down || p->failed) && s->srq != NULL)
            pool_post(s, slot); /* not sent: the slot is free */
        if (!p->down && !p->failed) {
            p->echoed++;
            s->echoed++;
            s->bytes += c->byte_len;
        }
    } else {
        post_recv(s, p, slot);
    }
}

/* Queue readiness: polls until RBR_EMPTY (or the budget is spent).
 * Returns -1 only if the queue itself fails. */
static int take_completions(struct server *s)
{
    rbr_completion wc[POLL_BATCH];
    size_t taken = 0;

    while (taken < POLL_BUDGET) {
        size_t n = 0;
        size_t i;
        rbr_status st = TIMED("rbr_cq_poll", rbr_cq_poll(s->cq, wc, POLL_BATCH, &n));

        if (st == RBR_EMPTY)
            return 0;
        if (ex_check(st, "rbr_cq_poll"))
            return -1;
        for (i = 0; i < n; i++) {
            if (wc[i].conn_context == NULL) {
                ex_report_completion("completion without a context", &wc[i]);
                return -1;
            }
            handle_completion(s, &wc[i]);
        }
        taken += n;
    }
    return 0;
}

/* At shutdown: takes whatever is queued, without looking at it. */
static void discard_completions(rbr_cq *cq)
{
    rbr_completion wc[POLL_BATCH];
    size_t n = 0;

    while (rbr_cq_poll(cq, wc, POLL_BATCH, &n) == RBR_OK)
        ;
}

/* Milliseconds until the deadline (0 = none) for epoll_pwait: -1 for no
 * deadline, rounded up so that a wait really passes it. */
static int wait_ms(uint64_t deadline)
{
    uint64_t now;
    uint64_t ms;

    if (deadline == 0)
        return -1;
    now = ex_now_ns();
    if (now >= deadline)
        return 0;
    ms = (deadline - now + 999999u) / 1000000u;
    return ms > 60000 ? 60000 : (int)ms;
}

static int event_loop(struct server *s, int ep, int listener_fd,
                      const sigset_t *unblocked)
{
    uint64_t deadline = 0;

    if (s->o->secs > 0)
        deadline = ex_now_ns() + s->o->secs * 1000000000u;
    for (;;) {
        struct epoll_event ev[2];
        int n;
        int i;

        if (s->o->clients > 0 && s->served + s->failed >= s->o->clients)
            return 0;
        if (stop_signal != 0) {
            printf("stopping on signal %d\n", (int)stop_signal);
            return 0;
        }
        if (deadline != 0 && ex_now_ns() >= deadline) {
            if (s->o->clients > 0)
                ex_error("gave up after %llu s: %llu of %llu clients came "
                         "and went (%llu requests taken)",
                         (unsigned long long)s->o->secs,
                         (unsigned long long)(s->served + s->failed),
                         (unsigned long long)s->o->clients,
                         (unsigned long long)s->requests);
            else
                ex_error("time limit of %llu s reached (%llu requests "
                         "taken)", (unsigned long long)s->o->secs,
                         (unsigned long long)s->requests);
            return -1;
        }
        n = epoll_pwait(ep, ev, 2, wait_ms(deadline), unblocked);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            ex_error("epoll_pwait: %s", strerror(errno));
            return -1;
        }
        /* EPOLLERR or EPOLLHUP too: the call below reports what is wrong. */
        for (i = 0; i < n; i++) {
            if (ev[i].data.fd == listener_fd) {
                if (take_requests(s))
                    return -1;
            } else if (take_completions(s)) {
                return -1;
            }
        }
    }
}

static int epoll_add(int ep, int fd)
{
    struct epoll_event ev;

    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN; /* level-triggered */
    ev.data.fd = fd;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        ex_error("epoll_ctl(EPOLL_CTL_ADD, %d): %s", fd, strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct server_opts o;
    struct server s;
    struct sigaction sa;
    struct peer *p;
    sigset_t stop_set;
    sigset_t old_mask;
    int listener_fd = -1;
    int cq_fd = -1;
    int ep = -1;
    int rc = EXIT_FAILURE;

    ex_set_progname(argv[0]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (parse_opts(argc, argv, &o))
        return EXIT_FAILURE;
    memset(&s, 0, sizeof s);
    s.o = &o;
    s.stride = ex_slot_stride(o.max_msg);
    if (s.stride > SIZE_MAX / o.recvs || (o.pool != 0 && s.stride > SIZE_MAX / o.pool)) {
        ex_error("%u receives of %zu bytes do not fit in memory",
                 (unsigned)(o.pool != 0 ? o.pool : o.recvs), o.max_msg);
        return EXIT_FAILURE;
    }

    /* Block the stop signals before the library starts any thread (its
     * threads inherit the mask); epoll_pwait unblocks them while it sleeps. */
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGINT);
    sigaddset(&stop_set, SIGTERM);
    if (sigprocmask(SIG_BLOCK, &stop_set, &old_mask) != 0) {
        ex_error("sigprocmask: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGINT, &sa, NULL) != 0 ||
        sigaction(SIGTERM, &sa, NULL) != 0) {
        ex_error("sigaction: %s", strerror(errno));
        goto out_signals;
    }

    if (EX_CHECK(rbr_ctx_create(&s.ctx)))
        goto out_signals;
    if (EX_CHECK(rbr_cq_create(&s.cq)))
        goto out_ctx;
    if (o.pool != 0) {
        rbr_srq_options qopts;
        uint32_t i;

        rbr_srq_options_init(&qopts);
        qopts.depth = o.pool;
        if (EX_CHECK(rbr_srq_create(s.ctx, &qopts, &s.srq)))
            goto out_cq;
        if (EX_CHECK(rbr_mr_alloc(s.ctx, s.stride * o.pool, RBR_ACCESS_LOCAL_WRITE,
                                  &s.pool_mr)))
            goto out_srq;
        for (i = 0; i < o.pool; i++)
            if (EX_CHECK(rbr_srq_post_recv(s.srq, s.pool_mr, (size_t)i * s.stride,
                                           o.max_msg, i)))
                goto out_srq;
    }
    if (ex_check(rbr_listen(s.ctx, o.addr, LISTEN_BACKLOG, &s.listener),
                 "rbr_listen"))
        goto out_srq;
    if (EX_CHECK(rbr_listener_fd(s.listener, &listener_fd)) ||
        EX_CHECK(rbr_cq_fd(s.cq, &cq_fd)))
        goto out_listener;
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) {
        ex_error("epoll_create1: %s", strerror(errno));
        goto out_listener;
    }
    if (epoll_add(ep, listener_fd) || epoll_add(ep, cq_fd))
        goto out_epoll;
    printf("listening on %s\n", o.addr);
    fflush(stdout);

    if (event_loop(&s, ep, listener_fd, &old_mask) == 0 && s.failed == 0 && !pool_lost)
        rc = EXIT_SUCCESS;
    /* Every client gone: every slot is back in the pool. */
    if (o.pool != 0 && s.peers == NULL && rbr_srq_len(s.srq) != o.pool) {
        ex_error("%zu of the pool's %u slots came back", rbr_srq_len(s.srq),
                 (unsigned)o.pool);
        rc = EXIT_FAILURE;
    }
    if (o.pool != 0)
        printf("one pool of %u receives for all clients\n", (unsigned)o.pool);
    printf("served %llu clients, echoed %llu messages (%llu bytes), "
           "%llu failed\n",
           (unsigned long long)s.served, (unsigned long long)s.echoed,
           (unsigned long long)s.bytes, (unsigned long long)s.failed);
    printf("longest library call in the loop: %.1f us (%s)\n", longest_ns / 1000.0,
           longest_call);
    for (int i = 0; i < CALL_KINDS && call_kinds[i].name != NULL; i++)
        printf("  slowest %s: %.1f us, %llu over 1 ms\n", call_kinds[i].name,
               call_kinds[i].longest_ns / 1000.0,
               (unsigned long long)call_kinds[i].over_1ms);

    /* Connections still up (after a signal, the time limit or an error):
     * every record of a connection is queued by the time rbr_conn_destroy
     * returns, so destroy them all, take their records unread, and only
     * then free the peers those records point to. */
    for (p = s.peers; p != NULL; p = p->next)
        rbr_conn_destroy(p->conn);
    discard_completions(s.cq);
    while (s.peers != NULL) {
        p = s.peers;
        s.peers = p->next;
        rbr_mr_destroy(p->mr);
        free(p);
    }
out_epoll:
    close(ep);
out_listener:
    rbr_listener_destroy(s.listener);
out_srq:
    /* Destroyed after the connections that used it; NULL is ignored. */
    rbr_srq_destroy(s.srq);
    rbr_mr_destroy(s.pool_mr);
out_cq:
    rbr_cq_destroy(s.cq);
out_ctx:
    rbr_ctx_destroy(s.ctx);
out_signals:
    sigprocmask(SIG_SETMASK, &old_mask, NULL);
    return rc;
}
