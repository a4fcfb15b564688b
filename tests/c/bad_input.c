/*
 * bad_input: hostile lengths and sizes at the C surface, under ASan+UBSan.
 * Every length is checked before the library reads a byte: private data of
 * 49, 4096 and SIZE_MAX bytes over a 48-byte heap buffer on connect, accept
 * and reject; memory ranges that wrap past the end of the address space; a
 * struct_size no struct has.  Each call must return RBR_ERR_INVALID, leave
 * its out-parameter alone, answer nothing, and write nothing to stderr.  An
 * over-read shows up as an ASan report (the library's copies go through
 * the sanitizer's memcpy).
 *
 * usage: bad_input [-a ADDR]      (default shm://rbr-bad-input-PID)
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

static int failures;

static void expect(rbr_status got, rbr_status want, const char *what)
{
    if (got != want) {
        ex_error("%s: got %s (%d), want %s (%d)", what, rbr_status_str(got),
                 (int)got, rbr_status_str(want), (int)want);
        failures++;
    }
}

struct client_arg {
    rbr_ctx *ctx;
    const char *addr;
    rbr_status status;
};

/* A well-behaved client the server keeps waiting while it tries bad options. */
static void *client_main(void *p)
{
    struct client_arg *a = p;
    rbr_cq *cq = NULL;
    rbr_conn *conn = NULL;

    a->status = rbr_cq_create(&cq);
    if (a->status != RBR_OK)
        return NULL;
    a->status = rbr_connect(a->ctx, a->addr, cq, NULL, &conn);
    rbr_conn_destroy(conn);
    rbr_cq_destroy(cq);
    return NULL;
}

int main(int argc, char **argv)
{
    static const size_t lens[] = {49, 4096, SIZE_MAX};
    char addr[128];
    rbr_ctx *ctx = NULL;
    rbr_cq *cq = NULL;
    rbr_listener *listener = NULL;
    rbr_request *req = NULL;
    rbr_conn *conn = NULL;
    rbr_conn *const sentinel = (rbr_conn *)(uintptr_t)0x1000;
    rbr_mr *const mr_sentinel = (rbr_mr *)(uintptr_t)0x1000;
    rbr_conn_options opts, bad;
    struct client_arg carg;
    pthread_t client;
    int client_started = 0;
    unsigned char *pd = NULL;
    unsigned char small[32];
    FILE *errlog = NULL;
    int saved_stderr = -1;
    struct stat st;
    size_t i;
    int opt, rc = 1;

    ex_set_progname(argv[0]);
    snprintf(addr, sizeof addr, "shm://rbr-bad-input-%ld", (long)getpid());
    while ((opt = getopt(argc, argv, "a:")) != -1) {
        switch (opt) {
        case 'a':
            snprintf(addr, sizeof addr, "%s", optarg);
            break;
        default:
            fprintf(stderr, "usage: %s [-a ADDR]\n", argv[0]);
            return 2;
        }
    }

    /* Exactly 48 bytes on the heap: any read past them is an ASan error. */
    pd = malloc(RBR_PRIVATE_DATA_MAX);
    if (pd == NULL)
        goto out;
    memset(pd, 0x5a, RBR_PRIVATE_DATA_MAX);
    if (EX_CHECK(rbr_ctx_create(&ctx)))
        goto out_pd;
    if (EX_CHECK(rbr_cq_create(&cq)))
        goto out_ctx;
    if (EX_CHECK(rbr_listen(ctx, addr, 4, &listener)))
        goto out_cq;

    /* From here the library must print nothing: stderr goes to a file. */
    errlog = tmpfile();
    if (errlog == NULL)
        goto out_listener;
    fflush(stderr);
    saved_stderr = dup(STDERR_FILENO);
    if (saved_stderr < 0 || dup2(fileno(errlog), STDERR_FILENO) < 0)
        goto out_errlog;

    rbr_conn_options_init(&opts);
    for (i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        bad = opts;
        bad.private_data = pd;
        bad.private_data_len = lens[i];
        conn = sentinel;
        expect(rbr_connect(ctx, addr, cq, &bad, &conn), RBR_ERR_INVALID,
               "rbr_connect with long private data");
        if (conn != sentinel) {
            ex_error("rbr_connect wrote its out-parameter on failure");
            failures++;
        }
    }
    bad = opts;
    bad.struct_size = UINT32_MAX;
    conn = sentinel;
    expect(rbr_connect(ctx, addr, cq, &bad, &conn), RBR_ERR_INVALID,
           "rbr_connect with struct_size UINT32_MAX");

    carg.ctx = ctx;
    carg.addr = addr;
    carg.status = RBR_ERR_PANIC;
    if (pthread_create(&client, NULL, client_main, &carg) != 0)
        goto out_stderr;
    client_started = 1;
    if (EX_CHECK(rbr_listener_get_request(listener, 10000, &req)))
        goto out_client;
    for (i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        expect(rbr_request_reject(req, pd, lens[i]), RBR_ERR_INVALID,
               "rbr_request_reject with long private data");
        bad = opts;
        bad.private_data = pd;
        bad.private_data_len = lens[i];
        conn = sentinel;
        expect(rbr_request_accept(req, cq, &bad, &conn), RBR_ERR_INVALID,
               "rbr_request_accept with long private data");
    }
    /* Nothing was answered: the request is still there to accept. */
    conn = NULL;
    expect(rbr_request_accept(req, cq, &opts, &conn), RBR_OK,
           "rbr_request_accept after the bad attempts");

    {
        rbr_mr *mr = mr_sentinel;
        expect(rbr_mr_register(ctx, small, SIZE_MAX, RBR_ACCESS_LOCAL_WRITE,
                               &mr),
               RBR_ERR_INVALID, "rbr_mr_register of SIZE_MAX bytes");
        expect(rbr_mr_register(ctx, (void *)(UINTPTR_MAX - 15), 32,
                               RBR_ACCESS_LOCAL_WRITE, &mr),
               RBR_ERR_INVALID, "rbr_mr_register of a wrapping range");
        if (mr != mr_sentinel) {
            ex_error("rbr_mr_register wrote its out-parameter on failure");
            failures++;
        }
    }
    rc = 0;

    rbr_conn_destroy(conn);
    rbr_request_destroy(req);
out_client:
    if (client_started) {
        pthread_join(client, NULL);
        if (rc == 0)
            expect(carg.status, RBR_OK, "the waiting client's rbr_connect");
    }
out_stderr:
    fflush(stderr);
    dup2(saved_stderr, STDERR_FILENO);
    close(saved_stderr);
    if (fstat(fileno(errlog), &st) == 0 && st.st_size != 0) {
        ex_error("the library wrote %lld bytes to stderr:",
                 (long long)st.st_size);
        rewind(errlog);
        for (int c; (c = fgetc(errlog)) != EOF;)
            fputc(c, stderr);
        failures++;
    }
out_errlog:
    fclose(errlog);
out_listener:
    rbr_listener_destroy(listener);
out_cq:
    rbr_cq_destroy(cq);
out_ctx:
    rbr_ctx_destroy(ctx);
out_pd:
    free(pd);
out:
    if (rc == 0 && failures == 0) {
        printf("bad_input: every hostile call refused, nothing read past the buffer, stderr silent\n");
        return 0;
    }
    fprintf(stderr, "bad_input: %d failures\n", failures);
    return 1;
}
