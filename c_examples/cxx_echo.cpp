/*
 * cxx_echo: the C++ wrapper (rdmabridge.hpp) as a program uses it. One process, two roles:
 * a server thread accepts one connection and echoes every message back; the main thread
 * connects, sends COUNT messages of SIZE bytes, and checks every echo byte for byte.
 * Errors are exceptions here; tests/c/cxx_wrapper_test.cpp also shows the std::error_code
 * form.
 *
 * Usage: rbr_cxx_echo [ADDRESS [COUNT [SIZE]]]   (default shm://rbr-cxx-echo 1000 256)
 */
#include "rdmabridge.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

using namespace std::chrono_literals;

namespace {

/* The next completion of `cq`, waiting up to 5 s; throws if none comes or it failed. */
rbr::completion next(rbr::completion_queue &cq)
{
    rbr::completion c{};
    if (cq.poll_wait(&c, 1, 5000ms) == 0)
        throw std::runtime_error("no completion within 5 s");
    if (c.status != RBR_WC_SUCCESS)
        throw std::runtime_error("completion of opcode " + std::to_string(c.opcode) +
                                 " failed: status " + std::to_string(c.status));
    return c;
}

/* Accepts one connection on `l` (a listener of `ctx`) and echoes `count` messages. */
void serve(rbr::context &ctx, rbr::listener &l, std::size_t count, std::size_t size)
{
    auto cq = rbr::completion_queue::create();
    auto req = l.get_request(5000ms);
    if (!req)
        throw std::runtime_error("no client within 5 s");
    auto conn = req->accept(cq);
    /* A region belongs to its context: the listener's, for the connections it accepts. */
    auto mr = ctx.alloc_mr(size == 0 ? 1 : size, RBR_ACCESS_LOCAL_WRITE);
    for (std::size_t i = 0; i < count; i++) {
        conn.post_recv(mr, 0, size, i);
        rbr::completion r = next(cq);
        conn.post_send(mr, 0, r.byte_len, i);
        next(cq);
    }
    /* The client disconnects first; its goodbye arrives as our last record. */
    rbr::completion bye = next(cq);
    if (bye.opcode != RBR_OP_DISCONNECTED)
        throw std::runtime_error("expected the client's disconnect");
}

} // namespace

int main(int argc, char **argv)
{
    const std::string addr = argc > 1 ? argv[1] : "shm://rbr-cxx-echo";
    const std::size_t count = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 1000;
    const std::size_t size = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 256;
    try {
        auto server_ctx = rbr::context::create();
        auto l = server_ctx.listen(addr);
        std::exception_ptr server_failed;
        std::thread server([&] {
            try {
                serve(server_ctx, l, count, size);
            } catch (...) {
                server_failed = std::current_exception();
            }
        });
        /* Joined on every way out of this block, a throw included. */
        struct joiner {
            std::thread &t;
            ~joiner()
            {
                if (t.joinable())
                    t.join();
            }
        } join_server{server};

        auto ctx = rbr::context::create();
        auto cq = rbr::completion_queue::create();
        auto conn = ctx.connect(addr, cq);
        auto mr = ctx.alloc_mr(2 * (size == 0 ? 1 : size), RBR_ACCESS_LOCAL_WRITE);
        auto *out = static_cast<unsigned char *>(mr.data());
        auto *in = out + (size == 0 ? 1 : size);
        std::size_t verified = 0;
        for (std::size_t i = 0; i < count; i++) {
            for (std::size_t j = 0; j < size; j++)
                out[j] = static_cast<unsigned char>(i * 31 + j);
            conn.post_recv(mr, size == 0 ? 1 : size, size, i);
            conn.post_send(mr, 0, size, i);
            /* The send and the echo complete in either order. */
            bool sent = false, echoed = false;
            while (!sent || !echoed) {
                rbr::completion c = next(cq);
                if (c.opcode == RBR_OP_SEND) {
                    sent = true;
                } else if (c.opcode == RBR_OP_RECV) {
                    if (c.byte_len != size || std::memcmp(in, out, size) != 0)
                        throw std::runtime_error("echo " + std::to_string(i) + " differs");
                    echoed = true;
                }
            }
            verified++;
        }
        conn.reset(); /* disconnects; the server sees it */
        server.join();
        if (server_failed)
            std::rethrow_exception(server_failed);
        std::printf("%zu echoes of %zu bytes received, all verified\n", verified, size);
    } catch (const rbr::error &e) {
        std::fprintf(stderr, "rbr_cxx_echo: %s (status %d)\n", e.what(), e.status());
        return 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "rbr_cxx_echo: %s\n", e.what());
        return 1;
    }
    return 0;
}
