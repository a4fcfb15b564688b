// The C++ wrapper from a program outside the repository: the same checks as consumer.c.
#include <rdmabridge.hpp>

#include <cstdio>

int main(int argc, char **argv)
{
    const char *addr = argc > 1 ? argv[1] : "shm://rbr-consumer-nobody";
    auto ctx = rbr::context::create();
    auto cq = rbr::completion_queue::create();
    auto mr = ctx.alloc_mr(4096, RBR_ACCESS_LOCAL_WRITE);
    std::error_code ec;
    auto conn = ctx.connect(addr, cq, rbr::conn_options(), ec);
    if (conn || ec.value() != RBR_ERR_REFUSED) {
        std::fprintf(stderr, "consumer_cxx: connect gave %s\n", ec.message().c_str());
        return 1;
    }
    std::printf("rdmabridge %s from C++: region of %zu bytes; %s\n", rbr_version(), mr.size(),
                ec.message().c_str());
    return 0;
}
