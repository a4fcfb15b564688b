/*
 * cxx_wrapper_test: checks rdmabridge.hpp against the library over shm (run under ASan and
 * UBSan by ctest's Debug build). Each CHECK reports the line that failed; the exit status is
 * the number of failures.
 *
 *   errors      - both forms of every failure path tried: the exception carries the status,
 *                 the category and the library's message; the error_code form sets the code,
 *                 returns an empty owner, and a later success clears it
 *   listener    - no request: get_request gives nothing (timeout 0 and 50 ms)
 *   reject      - the request's private data arrives; the rejection's data reaches the client
 *   exchange    - accept with private data both ways, granted info, 200 verified messages
 *                 (region and inline sends), then an orderly close seen on both sides
 *   one_sided   - a descriptor sent in a message; a two-segment write, a read back, a
 *                 fetch-and-add and a write with immediate, checked at both ends
 *   ownership   - moved-from owners are empty and destroy nothing; the context and queue
 *                 owners may go before the connection that uses them
 *
 * Usage: rbr_cxx_wrapper_test ADDRESS_PREFIX    (e.g. shm://rbr-cxx-test)
 */
#include "rdmabridge.hpp"

#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

int failures = 0;

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            std::fprintf(stderr, "line %d: CHECK(%s) failed\n", __LINE__, #cond);            \
            failures++;                                                                      \
        }                                                                                    \
    } while (0)

std::string text(const std::vector<unsigned char> &v) { return std::string(v.begin(), v.end()); }

/* The next completion, waiting up to 5 s (an empty optional if none came). */
std::optional<rbr::completion> next(rbr::completion_queue &cq)
{
    for (int i = 0; i < 2; i++) {
        if (auto c = cq.poll_one())
            return c;
        if (!cq.wait(5000ms))
            break;
    }
    return cq.poll_one();
}

void errors(const std::string &prefix)
{
    auto ctx = rbr::context::create();
    /* Thrown: a zero-length region is invalid. */
    bool thrown = false;
    try {
        ctx.alloc_mr(0, RBR_ACCESS_LOCAL_WRITE);
    } catch (const rbr::error &e) {
        thrown = true;
        CHECK(e.status() == RBR_ERR_INVALID);
        CHECK(e.code().category() == rbr::category());
        CHECK(std::string(e.what()).find("rbr_mr_alloc") != std::string::npos);
        CHECK(std::string(e.what()).find("length") != std::string::npos);
        CHECK(e.code().message().rfind("RBR_ERR_INVALID", 0) == 0);
    }
    CHECK(thrown);

    /* error_code: set on failure with an empty owner, cleared by a success. */
    std::error_code ec;
    auto bad = ctx.alloc_mr(0, RBR_ACCESS_LOCAL_WRITE, ec);
    CHECK(!bad);
    CHECK(ec.value() == RBR_ERR_INVALID);
    CHECK(ec == rbr::make_error_code(RBR_ERR_INVALID));
    auto good = ctx.alloc_mr(64, RBR_ACCESS_LOCAL_WRITE, ec);
    CHECK(good && !ec && good.size() == 64 && good.data() != nullptr);

    /* Nobody listens there: refused, both ways. */
    auto cq = rbr::completion_queue::create();
    auto none = ctx.connect(prefix + "-nobody", cq, rbr::conn_options(), ec);
    CHECK(!none && ec.value() == RBR_ERR_REFUSED);
    thrown = false;
    try {
        ctx.connect(prefix + "-nobody", cq);
    } catch (const rbr::error &e) {
        thrown = e.status() == RBR_ERR_REFUSED;
    }
    CHECK(thrown);

    /* The same without blocking: the refusal comes as a record, and established() throws it. */
    auto started = ctx.connect_start(prefix + "-nobody", cq);
    rbr::completion rec;
    CHECK(cq.poll_wait(&rec, 1, std::chrono::milliseconds(10000)) == 1);
    CHECK(rec.opcode == RBR_OP_CONNECTED && rec.status == RBR_WC_CONNECT_FAILED &&
          rec.conn_id == started.id());
    CHECK(!started.established(ec) && ec.value() == RBR_ERR_REFUSED);
    thrown = false;
    try {
        started.established();
    } catch (const rbr::error &e) {
        thrown = e.status() == RBR_ERR_REFUSED;
    }
    CHECK(thrown);

    /* A malformed address; unknown options; a post with an unknown flag. */
    auto l = ctx.listen("shm://", 4, ec);
    CHECK(!l && ec.value() == RBR_ERR_ADDRESS);
    rbr::conn_options opts;
    opts.send_queue_depth = 0;
    none = ctx.connect(prefix + "-nobody", cq, opts, ec);
    CHECK(!none && ec.value() == RBR_ERR_INVALID);

    /* Polling a queue with room for no record. */
    rbr::completion c;
    CHECK(cq.poll(&c, 0, ec) == 0 && ec.value() == RBR_ERR_INVALID);
    CHECK(cq.poll_wait(&c, 0, 0ms, ec) == 0 && ec.value() == RBR_ERR_INVALID);
    CHECK(cq.poll_wait(&c, 1, 10ms, ec) == 0 && !ec);
    CHECK(cq.poll_wait(&c, 1, 0ms) == 0);
    CHECK(cq.fd() >= 0);
    CHECK(!cq.wait(0ms));
}

void listener_without_requests(const std::string &prefix)
{
    auto ctx = rbr::context::create();
    auto l = ctx.listen(prefix + "-quiet");
    CHECK(l.fd() >= 0);
    CHECK(!l.get_request(0ms));
    std::error_code ec = rbr::make_error_code(RBR_ERR_STATE);
    CHECK(!l.get_request(50ms, ec));
    CHECK(!ec);
}

void reject(const std::string &prefix)
{
    auto sctx = rbr::context::create();
    auto l = sctx.listen(prefix + "-reject");
    std::string seen;
    std::thread server([&] {
        if (auto req = l.get_request(5000ms)) {
            seen = text(req->private_data());
            req->reject(std::string("busy"));
        }
    });
    auto ctx = rbr::context::create();
    auto cq = rbr::completion_queue::create();
    std::string hello = "hello";
    rbr::conn_options opts;
    opts.with_private_data(hello);
    std::error_code ec;
    auto conn = ctx.connect(prefix + "-reject", cq, opts, ec);
    server.join();
    CHECK(!conn && ec.value() == RBR_ERR_REJECTED);
    CHECK(text(rbr::last_reject_data()) == "busy");
    CHECK(seen == "hello");
}

void exchange(const std::string &prefix)
{
    const std::size_t count = 200, size = 512;
    auto sctx = rbr::context::create();
    auto l = sctx.listen(prefix + "-exchange");
    int server_errors = 0;
    std::thread server([&] {
        try {
            auto cq = rbr::completion_queue::create();
            auto req = l.get_request(5000ms);
            if (!req || text(req->private_data()) != "from client")
                throw std::runtime_error("request");
            rbr::conn_options first;
            first.with_private_data(std::string("from server")); /* a temporary: copied */
            rbr::conn_options opts = first;                       /* copies carry their own */
            first.with_private_data(std::string("overwritten"));
            auto conn = req->accept(cq, opts);
            auto mr = sctx.alloc_mr(size, RBR_ACCESS_LOCAL_WRITE);
            for (std::size_t i = 0; i < count; i++) {
                conn.post_recv(mr, 0, size, i);
                auto r = next(cq);
                if (!r || r->opcode != RBR_OP_RECV || r->status != RBR_WC_SUCCESS)
                    throw std::runtime_error("receive");
                conn.post_send(mr, 0, r->byte_len, i);
                auto s = next(cq);
                if (!s || s->opcode != RBR_OP_SEND || s->status != RBR_WC_SUCCESS)
                    throw std::runtime_error("send");
            }
            auto bye = next(cq);
            if (!bye || bye->opcode != RBR_OP_DISCONNECTED || bye->status != RBR_WC_SUCCESS)
                throw std::runtime_error("disconnect");
        } catch (const std::exception &e) {
            std::fprintf(stderr, "server: %s\n", e.what());
            server_errors++;
        }
    });

    auto ctx = rbr::context::create();
    auto cq = rbr::completion_queue::create();
    rbr::conn_options opts;
    std::string hello = "from client";
    opts.with_private_data(hello);
    auto conn = ctx.connect(prefix + "-exchange", cq, opts);
    CHECK(text(conn.private_data()) == "from server");
    rbr::conn_info info = conn.info();
    CHECK(info.transport == RBR_TRANSPORT_SHM);
    CHECK(info.id == conn.id() && info.id != 0);
    CHECK(info.max_inline == 64);

    auto mr = ctx.alloc_mr(2 * size, RBR_ACCESS_LOCAL_WRITE);
    auto *out = static_cast<unsigned char *>(mr.data());
    auto *in = out + size;
    std::size_t verified = 0;
    for (std::size_t i = 0; i < count; i++) {
        /* Every fourth message goes inline (at most max_inline bytes), the rest from the region. */
        const bool inline_send = i % 4 == 0;
        const std::size_t len = inline_send ? 64 : size - i % 7;
        std::vector<unsigned char> msg(len);
        for (std::size_t j = 0; j < len; j++)
            msg[j] = static_cast<unsigned char>(i + 3 * j);
        conn.post_recv(mr, size, size, 1000 + i);
        if (inline_send) {
            conn.post_send_inline(msg, i);
        } else {
            std::memcpy(out, msg.data(), len);
            conn.post_send(mr, 0, len, i);
        }
        bool sent = false, echoed = false;
        while (!sent || !echoed) {
            auto c = next(cq);
            if (!c || c->status != RBR_WC_SUCCESS)
                break;
            if (c->opcode == RBR_OP_SEND) {
                sent = c->wr_id == i;
            } else if (c->opcode == RBR_OP_RECV) {
                echoed = c->wr_id == 1000 + i && c->byte_len == len &&
                         std::memcmp(in, msg.data(), len) == 0;
            }
        }
        verified += sent && echoed;
    }
    CHECK(verified == count);

    /* Too long for inline: refused, nothing posted. */
    std::vector<unsigned char> big(65);
    std::error_code ec;
    CHECK(!conn.post_send_inline(big, 1, RBR_SEND_SIGNALED, ec) && ec.value() == RBR_ERR_INVALID);

    conn.disconnect();
    auto bye = next(cq);
    CHECK(bye && bye->opcode == RBR_OP_DISCONNECTED && bye->status == RBR_WC_SUCCESS);
    server.join();
    CHECK(server_errors == 0);
}

void one_sided(const std::string &prefix)
{
    const std::uint32_t remote_access =
        RBR_ACCESS_LOCAL_WRITE | RBR_ACCESS_REMOTE_WRITE | RBR_ACCESS_REMOTE_READ |
        RBR_ACCESS_REMOTE_ATOMIC;
    auto sctx = rbr::context::create();
    auto l = sctx.listen(prefix + "-one-sided");
    int server_errors = 0;
    std::thread server([&] {
        try {
            auto cq = rbr::completion_queue::create();
            auto req = l.get_request(5000ms);
            if (!req)
                throw std::runtime_error("request");
            auto conn = req->accept(cq, rbr::conn_options());
            auto board = sctx.alloc_mr(4096, remote_access);
            auto sig = sctx.alloc_mr(64, RBR_ACCESS_LOCAL_WRITE);
            conn.post_recv(sig, 0, 64, 1);
            conn.post_send_inline(conn.pack_region(board), 2);
            auto s = next(cq);
            if (!s || s->opcode != RBR_OP_SEND || s->status != RBR_WC_SUCCESS)
                throw std::runtime_error("descriptor send");
            auto c = next(cq);
            if (!c || c->opcode != RBR_OP_RECV_WRITE_IMM || c->imm_data != 77 ||
                !(c->flags & RBR_WC_WITH_IMM))
                throw std::runtime_error("signal");
            const auto *b = static_cast<const unsigned char *>(board.data());
            std::uint64_t word;
            std::memcpy(&word, b + 256, 8);
            if (std::memcmp(b, "hello, one-sided", 16) != 0 || word != 5)
                throw std::runtime_error("board contents");
            auto bye = next(cq);
            if (!bye || bye->opcode != RBR_OP_DISCONNECTED)
                throw std::runtime_error("disconnect");
        } catch (const std::exception &e) {
            std::fprintf(stderr, "one-sided server: %s\n", e.what());
            server_errors++;
        }
    });

    auto ctx = rbr::context::create();
    auto cq = rbr::completion_queue::create();
    auto conn = ctx.connect(prefix + "-one-sided", cq);
    auto mr = ctx.alloc_mr(4096, RBR_ACCESS_LOCAL_WRITE);
    conn.post_recv(mr, 0, 64, 1);
    auto d = next(cq);
    CHECK(d && d->opcode == RBR_OP_RECV && d->byte_len == RBR_REMOTE_DESC_LEN);
    std::vector<unsigned char> desc(static_cast<unsigned char *>(mr.data()),
                                    static_cast<unsigned char *>(mr.data()) + RBR_REMOTE_DESC_LEN);
    rbr_remote board = conn.unpack_remote(desc);
    auto *p = static_cast<unsigned char *>(mr.data());
    std::memcpy(p + 100, "hello, ", 7);
    std::memcpy(p + 200, "one-sided", 9);
    conn.post_write({{mr.get(), 100, 7}, {mr.get(), 200, 9}}, board, 0, 10);
    auto w = next(cq);
    CHECK(w && w->opcode == RBR_OP_WRITE && w->status == RBR_WC_SUCCESS && w->wr_id == 10);
    conn.post_read({{mr.get(), 1000, 16}}, board, 0, 11);
    auto r = next(cq);
    CHECK(r && r->opcode == RBR_OP_READ && r->status == RBR_WC_SUCCESS);
    CHECK(std::memcmp(p + 1000, "hello, one-sided", 16) == 0);
    conn.post_fetch_add(mr, 2048, board, 256, 5, 12);
    auto f = next(cq);
    CHECK(f && f->opcode == RBR_OP_FETCH_ADD && f->status == RBR_WC_SUCCESS);
    std::uint64_t old = 1;
    std::memcpy(&old, p + 2048, 8);
    CHECK(old == 0);
    conn.post_write_imm({}, board, 0, 77, 13);
    auto i = next(cq);
    CHECK(i && i->opcode == RBR_OP_WRITE && i->status == RBR_WC_SUCCESS && i->wr_id == 13);
    /* A malformed descriptor is refused. */
    try {
        conn.unpack_remote(std::vector<unsigned char>(RBR_REMOTE_DESC_LEN, 0));
        CHECK(false);
    } catch (const rbr::error &e) {
        CHECK(e.code().value() == RBR_ERR_INVALID);
    }
    conn.disconnect();
    auto bye = next(cq);
    CHECK(bye && bye->opcode == RBR_OP_DISCONNECTED);
    server.join();
    CHECK(server_errors == 0);
}

void ownership(const std::string &prefix)
{
    auto sctx = rbr::context::create();
    auto l = sctx.listen(prefix + "-own");
    rbr::connection accepted;
    auto scq = rbr::completion_queue::create();
    std::thread server([&] {
        if (auto req = l.get_request(5000ms))
            accepted = req->accept(scq);
    });
    auto ctx = rbr::context::create();
    auto cq = rbr::completion_queue::create();
    auto conn = ctx.connect(prefix + "-own", cq);
    server.join();
    CHECK(accepted);

    /* Moves leave the source empty; destroying an empty owner does nothing. */
    rbr::connection moved = std::move(conn);
    CHECK(!conn && moved);
    conn.reset();
    rbr::completion_queue cq2 = std::move(cq);
    CHECK(!cq && cq2);

    /* The context and the queue go first; the connection still works through them. */
    auto mr = ctx.alloc_mr(64, RBR_ACCESS_LOCAL_WRITE);
    ctx.reset();
    auto smr = sctx.alloc_mr(64, RBR_ACCESS_LOCAL_WRITE);
    accepted.post_recv(smr, 0, 64, 7);
    std::memcpy(mr.data(), "still here", 11);
    moved.post_send(mr, 0, 11, 8);
    auto got = next(scq);
    CHECK(got && got->opcode == RBR_OP_RECV && got->wr_id == 7 && got->byte_len == 11 &&
          std::memcmp(smr.data(), "still here", 11) == 0);
    rbr_cq *raw = cq2.release();
    CHECK(!cq2 && raw != nullptr);
    rbr_cq_destroy(raw); /* the queue goes while its connection lives */
    moved.reset();
    auto bye = next(scq);
    CHECK(bye && bye->opcode == RBR_OP_DISCONNECTED);
}

} // namespace

/* Two clients to one server whose connections take their receives from one pool; the
 * pool's limit event comes on its queue; the C++ pool refuses bad input with error codes. */
void shared_pool(const std::string &prefix)
{
    auto sctx = rbr::context::create();
    auto scq = rbr::completion_queue::create();
    auto events = rbr::completion_queue::create();
    rbr::srq_options qo;
    qo.depth = 4;
    qo.cq = events.get();
    auto pool = sctx.create_srq(qo);
    auto rmr = sctx.alloc_mr(4 * 64, RBR_ACCESS_LOCAL_WRITE);
    for (std::uint64_t i = 0; i < 4; i++)
        pool.post_recv(rmr, i * 64, 64, i);
    CHECK(pool.size() == 4);
    std::error_code ec;
    CHECK(!pool.post_recv(rmr, 0, 64, 9, ec) && ec.value() == RBR_ERR_QUEUE_FULL);
    CHECK(!pool.set_limit(5, ec) && ec.value() == RBR_ERR_INVALID);
    pool.set_limit(3);

    auto l = sctx.listen(prefix + "-pool");
    auto ctx = rbr::context::create();
    auto ccq = rbr::completion_queue::create();
    std::vector<rbr::connection> servers, clients;
    for (int k = 0; k < 2; k++) {
        std::thread t([&] {
            rbr::conn_options so;
            so.srq = pool.get();
            auto req = l.get_request(5000ms);
            if (req)
                servers.push_back(req->accept(scq, so));
        });
        clients.push_back(ctx.connect(prefix + "-pool", ccq));
        t.join();
    }
    CHECK(servers.size() == 2);
    if (servers.size() != 2)
        return;
    CHECK(!servers[0].post_recv(rmr, 0, 64, 9, ec) && ec.value() == RBR_ERR_INVALID);
    clients[0].post_send_inline(std::string("zero"), 0, 0);
    clients[1].post_send_inline(std::string("one"), 1, 0);
    for (int k = 0; k < 2; k++) {
        auto r = next(scq);
        CHECK(r && r->opcode == RBR_OP_RECV && r->status == RBR_WC_SUCCESS);
        if (!r)
            continue;
        /* The pool's receives are taken oldest first, and the record names the connection. */
        CHECK(r->wr_id == static_cast<std::uint64_t>(k));
        const bool first = r->conn_id == servers[0].id();
        CHECK(first || r->conn_id == servers[1].id());
        const char *want = first ? "zero" : "one";
        CHECK(r->byte_len == std::strlen(want) &&
              std::memcmp(static_cast<unsigned char *>(rmr.data()) + r->wr_id * 64, want,
                          r->byte_len) == 0);
    }
    CHECK(pool.size() == 2);
    auto e = events.poll_one();
    CHECK(e && e->opcode == RBR_OP_SRQ_LIMIT && e->wr_id == 2 && e->conn_id == 0);
}

int main(int argc, char **argv)
{
    const std::string prefix = argc > 1 ? argv[1] : "shm://rbr-cxx-test";
    try {
        errors(prefix);
        listener_without_requests(prefix);
        reject(prefix);
        exchange(prefix);
        one_sided(prefix);
        ownership(prefix);
        shared_pool(prefix);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "unexpected exception: %s\n", e.what());
        failures++;
    }
    if (failures == 0)
        std::printf("rdmabridge.hpp: every check passed\n");
    return failures;
}
