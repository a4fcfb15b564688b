/*
 * Helpers shared by the rdmabridge C examples (see common.h).
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *ex_progname = "rbr-example";

void ex_set_progname(const char *argv0)
{
    const char *slash;

    if (argv0 == NULL || argv0[0] == '\0')
        return;
    slash = strrchr(argv0, '/');
    ex_progname = slash != NULL ? slash + 1 : argv0;
}

void ex_error(const char *fmt, ...)
{
    va_list ap;

    /* One line at a time, even from many threads. */
    flockfile(stderr);
    fprintf(stderr, "%s: ", ex_progname);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    funlockfile(stderr);
}

int ex_check(rbr_status st, const char *what)
{
    const char *name;
    const char *detail;

    if (st >= 0)
        return 0;
    name = rbr_status_str(st);
    detail = rbr_last_error();
    ex_error("%s failed: %s (%d): %s", what, name != NULL ? name : "?",
             (int)st, detail != NULL ? detail : "");
    return -1;
}

void ex_die_on_status(rbr_status st, const char *what)
{
    if (ex_check(st, what) != 0)
        exit(EXIT_FAILURE);
}

/*
 * The pattern repeats every 256 bytes (7 is odd, so i * 7 mod 256 has
 * period 256).  Fill and verify therefore build one block of up to
 * EX_BLOCK bytes (a multiple of 256) and then copy / compare whole blocks,
 * which stays fast for megabyte messages even in unoptimized sanitizer
 * builds.
 */
#define EX_BLOCK 4096u

static size_t ex_make_block(uint8_t *block, size_t len, uint64_t k)
{
    size_t n = len < EX_BLOCK ? len : EX_BLOCK;
    uint8_t v = (uint8_t)(k * 131u + 1u);
    size_t i;

    for (i = 0; i < n; i++) {
        block[i] = v;
        v = (uint8_t)(v + 7u);
    }
    return n;
}

void ex_fill_pattern(void *buf, size_t len, uint64_t k)
{
    uint8_t block[EX_BLOCK];
    uint8_t *p = buf;
    size_t n = ex_make_block(block, len, k);
    size_t off;

    for (off = 0; off < len; off += n) {
        size_t chunk = len - off < n ? len - off : n;

        memcpy(p + off, block, chunk);
    }
}

int ex_verify_pattern(const void *buf, size_t len, uint64_t k)
{
    uint8_t block[EX_BLOCK];
    const uint8_t *p = buf;
    size_t n = ex_make_block(block, len, k);
    size_t off;

    for (off = 0; off < len; off += n) {
        size_t chunk = len - off < n ? len - off : n;
        size_t i;

        if (memcmp(p + off, block, chunk) == 0)
            continue;
        for (i = 0; i < chunk; i++) {
            if (p[off + i] != block[i]) {
                ex_error("message %llu: byte %zu is 0x%02x, expected 0x%02x",
                         (unsigned long long)k, off + i,
                         (unsigned)p[off + i], (unsigned)block[i]);
                break;
            }
        }
        return -1;
    }
    return 0;
}

uint64_t ex_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A successful call's count must be 1..max. */
static rbr_status check_count(const char *call, size_t got, size_t max)
{
    if (got == 0 || got > max) {
        ex_error("%s returned RBR_OK with n = %zu (max %zu)", call, got, max);
        return RBR_ERR_PROTOCOL;
    }
    return RBR_OK;
}

rbr_status ex_wait_completions(rbr_cq *cq, rbr_completion *out, size_t max,
                               size_t *n, int32_t timeout_ms)
{
    size_t got = 0;
    rbr_status st = rbr_cq_poll_wait(cq, out, max, &got, timeout_ms);

    if (st != RBR_OK)
        return st;
    st = check_count("rbr_cq_poll_wait", got, max);
    if (st == RBR_OK)
        *n = got;
    return st;
}

rbr_status ex_poll_then_wait(rbr_cq *cq, rbr_completion *out, size_t max,
                             size_t *n, int32_t timeout_ms)
{
    uint64_t deadline = 0;
    rbr_status st;

    if (timeout_ms >= 0)
        deadline = ex_now_ns() + (uint64_t)timeout_ms * 1000000u;

    for (;;) {
        size_t got = 0;
        int32_t wait_ms = -1;

        st = rbr_cq_poll(cq, out, max, &got);
        if (st == RBR_OK) {
            st = check_count("rbr_cq_poll", got, max);
            if (st == RBR_OK)
                *n = got;
            return st;
        }
        if (st != RBR_EMPTY)
            return st;

        if (timeout_ms >= 0) {
            uint64_t now = ex_now_ns();
            uint64_t left;

            if (now >= deadline)
                return RBR_ERR_TIMEOUT;
            left = deadline - now;
            /* Round up so that a timed-out wait really passes the deadline. */
            wait_ms = (int32_t)((left + 999999u) / 1000000u);
        }
        st = rbr_cq_wait(cq, wait_ms);
        if (st != RBR_OK && st != RBR_ERR_TIMEOUT)
            return st;
        /* On RBR_OK or a timeout, poll again; the deadline check decides. */
    }
}

rbr_status ex_wait_one(rbr_cq *cq, rbr_completion *out, int32_t timeout_ms)
{
    size_t n = 0;

    return ex_wait_completions(cq, out, 1, &n, timeout_ms);
}

const char *ex_opcode_str(uint32_t opcode)
{
    switch (opcode) {
    case RBR_OP_SEND:
        return "SEND";
    case RBR_OP_RECV:
        return "RECV";
    case RBR_OP_WRITE:
        return "WRITE";
    case RBR_OP_READ:
        return "READ";
    case RBR_OP_FETCH_ADD:
        return "FETCH_ADD";
    case RBR_OP_CMP_SWAP:
        return "CMP_SWAP";
    case RBR_OP_RECV_WRITE_IMM:
        return "RECV_WRITE_IMM";
    case RBR_OP_DISCONNECTED:
        return "DISCONNECTED";
    default:
        return "OTHER";
    }
}

const char *ex_wc_status_str(int32_t status)
{
    switch (status) {
    case RBR_WC_SUCCESS:
        return "SUCCESS";
    case RBR_WC_FLUSHED:
        return "FLUSHED";
    case RBR_WC_LOCAL_LENGTH:
        return "LOCAL_LENGTH";
    case RBR_WC_REMOTE_ERROR:
        return "REMOTE_ERROR";
    case RBR_WC_TRANSPORT:
        return "TRANSPORT";
    case RBR_WC_LOCAL_PROTECTION:
        return "LOCAL_PROTECTION";
    case RBR_WC_REMOTE_ACCESS:
        return "REMOTE_ACCESS";
    case RBR_WC_GENERAL:
        return "GENERAL";
    case RBR_WC_PEER_ACCESS:
        return "PEER_ACCESS";
    default:
        return "UNKNOWN";
    }
}

size_t ex_slot_stride(size_t size)
{
    const size_t line = 64;

    if (size == 0)
        return line;
    return (size + line - 1) / line * line;
}

void ex_report_completion(const char *what, const rbr_completion *c)
{
    ex_error("%s: %s completion (opcode %u) wr_id=%llu byte_len=%u "
             "status %s (%d)",
             what, ex_opcode_str(c->opcode), (unsigned)c->opcode,
             (unsigned long long)c->wr_id, (unsigned)c->byte_len,
             ex_wc_status_str(c->status), (int)c->status);
}

static int ex_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a;
    uint64_t y = *(const uint64_t *)b;

    return (x > y) - (x < y);
}

uint64_t ex_percentile(uint64_t *v, size_t n, double p)
{
    size_t rank;

    if (n == 0)
        return 0;
    qsort(v, n, sizeof v[0], ex_cmp_u64);
    if (p <= 0.0)
        return v[0];
    if (p >= 100.0)
        return v[n - 1];
    /* Nearest rank: the smallest value with at least p% of values <= it. */
    rank = (size_t)((p / 100.0) * (double)n);
    if ((double)rank < (p / 100.0) * (double)n)
        rank++;
    if (rank == 0)
        rank = 1;
    return v[rank - 1];
}

int ex_parse_size(const char *s, uint64_t *out)
{
    char *end = NULL;
    unsigned long long v;
    uint64_t mult = 1;

    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (end == s || errno == ERANGE)
        return -1;
    switch (*end) {
    case '\0':
        break;
    case 'k':
    case 'K':
        mult = 1024u;
        end++;
        break;
    case 'm':
    case 'M':
        mult = 1024u * 1024u;
        end++;
        break;
    case 'g':
    case 'G':
        mult = 1024u * 1024u * 1024u;
        end++;
        break;
    default:
        return -1;
    }
    if (*end != '\0')
        return -1;
    if (v > UINT64_MAX / mult)
        return -1;
    *out = (uint64_t)v * mult;
    return 0;
}

void ex_cq_opts_init(struct ex_cq_opts *o)
{
    o->progress = RBR_PROGRESS_DEFAULT;
    o->spin_us = -1;
}

int ex_cq_opt(int ch, const char *arg, struct ex_cq_opts *o)
{
    uint64_t v;

    switch (ch) {
    case 'p':
        if (strcmp(arg, "caller") == 0) {
            o->progress = RBR_PROGRESS_CALLER;
        } else if (strcmp(arg, "thread") == 0) {
            o->progress = RBR_PROGRESS_THREAD;
        } else {
            ex_error("bad progress mode '%s' (caller or thread)", arg);
            return -1;
        }
        return 0;
    case 'S':
        if (ex_parse_size(arg, &v) != 0 || v > 1000000) {
            ex_error("bad spin '%s' (0..1000000 us)", arg);
            return -1;
        }
        o->spin_us = (int64_t)v;
        return 0;
    default:
        ex_error("-%c is not a completion-queue option", ch);
        return -1;
    }
}

rbr_status ex_cq_create(const struct ex_cq_opts *o, rbr_cq **cq)
{
    rbr_cq_options opts;

    rbr_cq_options_init(&opts);
    opts.progress = o->progress;
    if (o->spin_us >= 0)
        opts.spin_us = (uint32_t)o->spin_us;
    return rbr_cq_create_ex(&opts, cq);
}

int ex_expect(rbr_cq *cq, int32_t timeout_ms, uint32_t opcode, rbr_completion *c)
{
    if (ex_check(ex_wait_one(cq, c, timeout_ms), "waiting for a completion"))
        return -1;
    if (c->opcode != opcode || c->status != RBR_WC_SUCCESS) {
        ex_report_completion("unexpected", c);
        return -1;
    }
    return 0;
}

void *ex_accept_one(void *p)
{
    struct ex_acceptor *a = p;
    rbr_request *req = NULL;

    a->conn = NULL;
    a->status = rbr_listener_get_request(a->listener, 10000, &req);
    if (a->status == RBR_OK)
        a->status = rbr_request_accept(req, a->cq, NULL, &a->conn);
    rbr_request_destroy(req);
    return NULL;
}

long ex_count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    long n = 0;

    if (d == NULL)
        return -1;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own descriptor */
}
