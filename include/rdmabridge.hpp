/*
 * rdmabridge.hpp: a header-only C++17 layer over rdmabridge.h.
 *
 * - Every handle has an owner: rbr::context, rbr::memory_region, rbr::completion_queue,
 *   rbr::listener, rbr::request, rbr::connection. They move, they do not copy, and their
 *   destructors call the matching rbr_*_destroy. A moved-from or default-constructed owner is
 *   empty (`!owner`) and destroys nothing. As in C, owners may go in any order: the library
 *   keeps alive what is still in use (a region posted on a connection, a queue with
 *   connections).
 * - Errors, by the caller's choice: every call that can fail comes twice. Without a trailing
 *   std::error_code& it throws rbr::error (a std::system_error whose code() is in
 *   rbr::category() and whose what() carries rbr_last_error()). With one it is noexcept, sets
 *   the code (cleared on success) and returns an empty owner, 0 or false on failure.
 *   Error codes compare equal to the RBR_ERR_* values: `ec.value() == RBR_ERR_TIMEOUT`.
 * - Buffers are rbr::bytes: a pointer and a length, made from any contiguous container of
 *   one-byte elements with data() and size() (std::string, std::string_view, std::vector,
 *   std::array, std::span).
 * - Thread safety is that of the C functions (see rdmabridge.h): a connection, queue, region
 *   and context may be used from several threads at once; an owner itself is not
 *   synchronized, so do not move or destroy it while another thread uses it.
 *
 * Link as for the C library (see the README); compile with -std=c++17 or later.
 */
#ifndef RDMABRIDGE_HPP
#define RDMABRIDGE_HPP

#include "rdmabridge.h"

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace rbr {

/* ------------------------------------------------------------------------------ errors */

/** The category of rdmabridge status codes: value() is the rbr_status, message() its name. */
class status_category final : public std::error_category {
public:
    const char *name() const noexcept override { return "rdmabridge"; }
    std::string message(int status) const override { return rbr_status_str(status); }
};

/** The one instance of status_category. */
inline const std::error_category &category() noexcept
{
    static const status_category instance;
    return instance;
}

/** A std::error_code for an rbr_status. */
inline std::error_code make_error_code(rbr_status status) noexcept
{
    return std::error_code(static_cast<int>(status), category());
}

/** What the throwing calls throw: the status (code()) and the library's message (what()). */
class error : public std::system_error {
public:
    error(rbr_status status, const char *call)
        : std::system_error(make_error_code(status), std::string(call) + ": " + rbr_last_error())
    {
    }

    /** The RBR_ERR_* code. */
    rbr_status status() const noexcept { return static_cast<rbr_status>(code().value()); }
};

namespace detail {

/* Failure is a negative status; RBR_EMPTY (1) is not one. */
inline void check(rbr_status status, const char *call)
{
    if (status < 0)
        throw error(status, call);
}

inline bool check(rbr_status status, std::error_code &ec) noexcept
{
    if (status < 0) {
        ec = make_error_code(status);
        return false;
    }
    ec.clear();
    return true;
}

inline int32_t to_ms(std::chrono::milliseconds timeout) noexcept
{
    if (timeout.count() < 0)
        return -1;
    if (timeout.count() > INT32_MAX)
        return INT32_MAX;
    return static_cast<int32_t>(timeout.count());
}

/* Unique ownership of one C handle, released with Destroy. */
template <class T, void (*Destroy)(T *)> class owner {
public:
    owner() noexcept = default;
    explicit owner(T *raw) noexcept : raw_(raw) {}
    owner(const owner &) = delete;
    owner &operator=(const owner &) = delete;
    owner(owner &&other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
    owner &operator=(owner &&other) noexcept
    {
        if (this != &other)
            reset(std::exchange(other.raw_, nullptr));
        return *this;
    }
    ~owner() { reset(); }

    /** The C handle, still owned here. */
    T *get() const noexcept { return raw_; }
    /** Gives up ownership: the caller destroys the handle. */
    T *release() noexcept { return std::exchange(raw_, nullptr); }
    /** Destroys the handle held (if any) and takes `raw`. */
    void reset(T *raw = nullptr) noexcept
    {
        T *old = std::exchange(raw_, raw);
        if (old)
            Destroy(old);
    }
    explicit operator bool() const noexcept { return raw_ != nullptr; }

private:
    T *raw_ = nullptr;
};

template <class C, class = void> struct is_byte_range : std::false_type {
};
template <class C>
struct is_byte_range<C, std::void_t<decltype(std::declval<const C &>().data()),
                                    decltype(std::declval<const C &>().size())>>
    : std::bool_constant<sizeof(*std::declval<const C &>().data()) == 1> {
};

} // namespace detail

/* ------------------------------------------------------------------------------ buffers */

/** A read-only view of bytes: a pointer and a length. */
class bytes {
public:
    constexpr bytes() noexcept = default;
    constexpr bytes(const void *data, std::size_t size) noexcept : data_(data), size_(size) {}
    /** Any contiguous container of one-byte elements. */
    template <class C, class = std::enable_if_t<detail::is_byte_range<C>::value>>
    bytes(const C &c) noexcept : data_(c.data()), size_(c.size())
    {
    }
    constexpr const void *data() const noexcept { return data_; }
    constexpr std::size_t size() const noexcept { return size_; }

private:
    const void *data_ = nullptr;
    std::size_t size_ = 0;
};

/* ------------------------------------------------------------------------------ plain data */

/** One finished work request or connection event (see rbr_completion). */
using completion = rbr_completion;
/** What a connection was granted (see rbr_conn_info). */
using conn_info = rbr_conn_info;

/** Options of connect and accept, filled with the defaults; change fields as in C. */
struct conn_options : rbr_conn_options {
    conn_options() : rbr_conn_options() { rbr_conn_options_init(this); }
    conn_options(const conn_options &other) : rbr_conn_options(other), data_(other.data_)
    {
        if (other.owns_data())
            repoint();
    }
    conn_options &operator=(const conn_options &other)
    {
        static_cast<rbr_conn_options &>(*this) = other;
        data_ = other.data_;
        if (other.owns_data())
            repoint();
        return *this;
    }
    ~conn_options() = default;

    /** Private data for the peer (at most RBR_PRIVATE_DATA_MAX bytes), copied into the
     *  options: `data` need not outlive this call. */
    conn_options &with_private_data(bytes data)
    {
        const auto *p = static_cast<const unsigned char *>(data.data());
        data_.assign(p, p + data.size());
        repoint();
        return *this;
    }

private:
    /* The options' own copy of the private data, which `private_data` points into after
     * with_private_data (a caller may also set the C fields by hand). */
    std::vector<unsigned char> data_;
    bool owns_data() const noexcept
    {
        return !data_.empty() && private_data == data_.data();
    }
    void repoint() noexcept
    {
        private_data = data_.empty() ? nullptr : data_.data();
        private_data_len = data_.size();
    }
};

/** Options of a shared receive queue, filled with the defaults (see rbr_srq_options). */
struct srq_options : rbr_srq_options {
    srq_options() noexcept : rbr_srq_options() { rbr_srq_options_init(this); }
};

/** Options of a completion queue, filled with the defaults (see rbr_cq_options). */
struct cq_options : rbr_cq_options {
    cq_options() noexcept : rbr_cq_options() { rbr_cq_options_init(this); }
};

/** The name of a status, e.g. "RBR_ERR_TIMEOUT: timed out". */
inline const char *status_str(rbr_status status) noexcept { return rbr_status_str(status); }

/** The private data of the last rejection this thread saw (after RBR_ERR_REJECTED). */
inline std::vector<unsigned char> last_reject_data()
{
    std::size_t len = 0;
    if (rbr_last_reject_data(nullptr, 0, &len) != RBR_OK)
        return {};
    std::vector<unsigned char> out(len);
    if (len != 0 && rbr_last_reject_data(out.data(), out.size(), &len) != RBR_OK)
        return {};
    out.resize(len < out.size() ? len : out.size());
    return out;
}

namespace detail {
/* Reads private data through a C getter of the (handle, buf, cap, len) shape. */
template <class H, class F> std::vector<unsigned char> private_data(const H *h, F get)
{
    std::vector<unsigned char> out(RBR_PRIVATE_DATA_RECV_MAX);
    std::size_t len = 0;
    check(get(h, out.data(), out.size(), &len), "private data");
    out.resize(len < out.size() ? len : out.size());
    return out;
}
} // namespace detail

/* ------------------------------------------------------------------------------ handles */

/** A memory region (see rbr_mr_register / rbr_mr_alloc); made by rbr::context. */
class memory_region : public detail::owner<rbr_mr, rbr_mr_destroy> {
public:
    using owner::owner;
    /** The region's first byte. */
    void *data() const noexcept { return rbr_mr_addr(get()); }
    /** Its length in bytes. */
    std::size_t size() const noexcept { return rbr_mr_len(get()); }
};

/** A completion queue. */
class completion_queue : public detail::owner<rbr_cq, rbr_cq_destroy> {
public:
    using owner::owner;

    static completion_queue create(const cq_options &opts = cq_options())
    {
        rbr_cq *raw = nullptr;
        detail::check(rbr_cq_create_ex(&opts, &raw), "rbr_cq_create_ex");
        return completion_queue(raw);
    }
    static completion_queue create(std::error_code &ec, const cq_options &opts = cq_options()) noexcept
    {
        rbr_cq *raw = nullptr;
        return detail::check(rbr_cq_create_ex(&opts, &raw), ec) ? completion_queue(raw)
                                                                  : completion_queue();
    }

    /** Takes up to `max` completions into `out`, oldest first, without blocking; 0 when none
     *  is queued. */
    std::size_t poll(completion *out, std::size_t max)
    {
        std::size_t n = 0;
        detail::check(rbr_cq_poll(get(), out, max, &n), "rbr_cq_poll");
        return n;
    }
    std::size_t poll(completion *out, std::size_t max, std::error_code &ec) noexcept
    {
        std::size_t n = 0;
        return detail::check(rbr_cq_poll(get(), out, max, &n), ec) ? n : 0;
    }

    /** One completion, if one is queued. */
    std::optional<completion> poll_one()
    {
        completion c{};
        if (poll(&c, 1) == 0)
            return std::nullopt;
        return c;
    }

    /** Waits until a completion is queued (true) or `timeout` passes (false); a negative
     *  timeout waits without limit. Takes nothing from the queue. */
    bool wait(std::chrono::milliseconds timeout)
    {
        rbr_status s = rbr_cq_wait(get(), detail::to_ms(timeout));
        if (s == RBR_ERR_TIMEOUT)
            return false;
        detail::check(s, "rbr_cq_wait");
        return true;
    }
    bool wait(std::chrono::milliseconds timeout, std::error_code &ec) noexcept
    {
        rbr_status s = rbr_cq_wait(get(), detail::to_ms(timeout));
        if (s == RBR_ERR_TIMEOUT) {
            ec.clear();
            return false;
        }
        return detail::check(s, ec);
    }

    /** Takes up to `max` completions into `out`, oldest first, waiting up to `timeout` for
     *  the first when none is there (see rbr_cq_poll_wait); 0 when the timeout passed first.
     *  A negative timeout waits without limit. */
    std::size_t poll_wait(completion *out, std::size_t max, std::chrono::milliseconds timeout)
    {
        std::size_t n = 0;
        rbr_status s = rbr_cq_poll_wait(get(), out, max, &n, detail::to_ms(timeout));
        if (s == RBR_ERR_TIMEOUT)
            return 0;
        detail::check(s, "rbr_cq_poll_wait");
        return n;
    }
    std::size_t poll_wait(completion *out, std::size_t max, std::chrono::milliseconds timeout,
                          std::error_code &ec) noexcept
    {
        std::size_t n = 0;
        rbr_status s = rbr_cq_poll_wait(get(), out, max, &n, detail::to_ms(timeout));
        if (s == RBR_ERR_TIMEOUT) {
            ec.clear();
            return 0;
        }
        return detail::check(s, ec) ? n : 0;
    }

    /** The queue's level-triggered descriptor for epoll/poll/select (see rbr_cq_fd); owned
     *  by the queue. */
    int fd() const
    {
        int32_t fd = -1;
        detail::check(rbr_cq_fd(get(), &fd), "rbr_cq_fd");
        return fd;
    }
};

/** An established connection. */
class connection : public detail::owner<rbr_conn, rbr_conn_destroy> {
public:
    using owner::owner;

    /** The connection's id, as in its completions. */
    std::uint64_t id() const noexcept { return rbr_conn_id(get()); }

    /** Whether a connection made by context::connect_start or request::accept_start is
     *  established: true once it is, false while it connects; throws the status its set-up
     *  failed with (the one the blocking call throws). See rbr_conn_status. */
    bool established() const
    {
        rbr_status st = rbr_conn_status(get());
        detail::check(st, "rbr_conn_status");
        return st == RBR_OK;
    }
    /** As above; false with `ec` set when the set-up failed. */
    bool established(std::error_code &ec) const noexcept
    {
        rbr_status st = rbr_conn_status(get());
        return detail::check(st, ec) && st == RBR_OK;
    }

    /** What was granted. */
    conn_info info() const
    {
        conn_info i{};
        i.struct_size = sizeof i;
        detail::check(rbr_conn_get_info(get(), &i), "rbr_conn_get_info");
        return i;
    }

    /** The private data the peer sent. */
    std::vector<unsigned char> private_data() const
    {
        return detail::private_data(get(), rbr_conn_private_data);
    }

    /** Sends `len` bytes at `offset` of `mr`; they must not change until the send completes. */
    void post_send(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id, std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_send(get(), mr.get(), offset, len, wr_id, flags),
                      "rbr_conn_post_send");
    }
    bool post_send(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id, std::uint32_t flags, std::error_code &ec) noexcept
    {
        return detail::check(rbr_conn_post_send(get(), mr.get(), offset, len, wr_id, flags), ec);
    }

    /** Sends `data`, copied before this returns (at most the granted max_inline bytes). */
    void post_send_inline(bytes data, std::uint64_t wr_id, std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_send_inline(get(), data.data(), data.size(), wr_id, flags),
                      "rbr_conn_post_send_inline");
    }
    bool post_send_inline(bytes data, std::uint64_t wr_id, std::uint32_t flags,
                          std::error_code &ec) noexcept
    {
        return detail::check(
            rbr_conn_post_send_inline(get(), data.data(), data.size(), wr_id, flags), ec);
    }

    /** Posts a receive into `len` bytes at `offset` of `mr` (needs RBR_ACCESS_LOCAL_WRITE). */
    void post_recv(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id)
    {
        detail::check(rbr_conn_post_recv(get(), mr.get(), offset, len, wr_id),
                      "rbr_conn_post_recv");
    }
    bool post_recv(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id, std::error_code &ec) noexcept
    {
        return detail::check(rbr_conn_post_recv(get(), mr.get(), offset, len, wr_id), ec);
    }

    /** A descriptor that lets the peer reach `mr` with one-sided operations (send it). */
    std::array<std::uint8_t, RBR_REMOTE_DESC_LEN> pack_region(const memory_region &mr)
    {
        std::array<std::uint8_t, RBR_REMOTE_DESC_LEN> d{};
        detail::check(rbr_conn_pack_region(get(), mr.get(), d.data()), "rbr_conn_pack_region");
        return d;
    }

    /** The peer's region, from the descriptor it packed. */
    rbr_remote unpack_remote(bytes desc) const
    {
        rbr_remote r{};
        detail::check(rbr_conn_unpack_remote(get(), desc.data(), desc.size(), &r),
                      "rbr_conn_unpack_remote");
        return r;
    }

    /** RDMA-writes the local segments to `offset` of `remote`. */
    void post_write(const std::vector<rbr_sge> &sgl, const rbr_remote &remote,
                    std::uint64_t offset, std::uint64_t wr_id,
                    std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_write(get(), sgl.data(), sgl.size(), &remote, offset, wr_id,
                                          flags),
                      "rbr_conn_post_write");
    }

    /** As post_write, then completes a receive of the peer's with `imm`. */
    void post_write_imm(const std::vector<rbr_sge> &sgl, const rbr_remote &remote,
                        std::uint64_t offset, std::uint32_t imm, std::uint64_t wr_id,
                        std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_write_imm(get(), sgl.data(), sgl.size(), &remote, offset,
                                              imm, wr_id, flags),
                      "rbr_conn_post_write_imm");
    }

    /** RDMA-reads from `offset` of `remote` into the local segments. */
    void post_read(const std::vector<rbr_sge> &sgl, const rbr_remote &remote,
                   std::uint64_t offset, std::uint64_t wr_id,
                   std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_read(get(), sgl.data(), sgl.size(), &remote, offset, wr_id,
                                         flags),
                      "rbr_conn_post_read");
    }

    /** Adds `add` to the peer's word; its old value lands at `offset` of `result`. */
    void post_fetch_add(const memory_region &result, std::size_t offset,
                        const rbr_remote &remote, std::uint64_t remote_offset, std::uint64_t add,
                        std::uint64_t wr_id, std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_fetch_add(get(), result.get(), offset, &remote,
                                              remote_offset, add, wr_id, flags),
                      "rbr_conn_post_fetch_add");
    }

    /** Swaps in `swap` if the peer's word is `compare`; its old value lands in `result`. */
    void post_cmp_swap(const memory_region &result, std::size_t offset,
                       const rbr_remote &remote, std::uint64_t remote_offset,
                       std::uint64_t compare, std::uint64_t swap, std::uint64_t wr_id,
                       std::uint32_t flags = RBR_SEND_SIGNALED)
    {
        detail::check(rbr_conn_post_cmp_swap(get(), result.get(), offset, &remote,
                                             remote_offset, compare, swap, wr_id, flags),
                      "rbr_conn_post_cmp_swap");
    }

    /** Starts an orderly disconnect (see rbr_conn_disconnect); returns at once. */
    void disconnect() { detail::check(rbr_conn_disconnect(get()), "rbr_conn_disconnect"); }
};

/** A peer's request to connect; an unanswered one is rejected when its owner goes. */
class request : public detail::owner<rbr_request, rbr_request_destroy> {
public:
    using owner::owner;

    /** The private data the peer sent with its request. */
    std::vector<unsigned char> private_data() const
    {
        return detail::private_data(get(), rbr_request_private_data);
    }

    /** Accepts; the connection's completions go to `cq`. */
    connection accept(const completion_queue &cq, const conn_options &opts = conn_options())
    {
        rbr_conn *raw = nullptr;
        detail::check(rbr_request_accept(get(), cq.get(), &opts, &raw), "rbr_request_accept");
        return connection(raw);
    }
    connection accept(const completion_queue &cq, const conn_options &opts,
                      std::error_code &ec) noexcept
    {
        rbr_conn *raw = nullptr;
        return detail::check(rbr_request_accept(get(), cq.get(), &opts, &raw), ec)
                   ? connection(raw)
                   : connection();
    }

    /** Accepts without waiting: the connection is returned connecting, and its
     *  establishment or failure arrives on `cq` as an RBR_OP_CONNECTED record. */
    connection accept_start(const completion_queue &cq, const conn_options &opts = conn_options())
    {
        rbr_conn *raw = nullptr;
        detail::check(rbr_request_accept_start(get(), cq.get(), &opts, &raw),
                      "rbr_request_accept_start");
        return connection(raw);
    }
    connection accept_start(const completion_queue &cq, const conn_options &opts,
                            std::error_code &ec) noexcept
    {
        rbr_conn *raw = nullptr;
        return detail::check(rbr_request_accept_start(get(), cq.get(), &opts, &raw), ec)
                   ? connection(raw)
                   : connection();
    }

    /** Rejects, sending `data` (at most RBR_PRIVATE_DATA_MAX bytes) to the peer. */
    void reject(bytes data = bytes())
    {
        detail::check(rbr_request_reject(get(), data.data(), data.size()), "rbr_request_reject");
    }
    bool reject(bytes data, std::error_code &ec) noexcept
    {
        return detail::check(rbr_request_reject(get(), data.data(), data.size()), ec);
    }
};

/** A listening endpoint; made by rbr::context::listen. */
class listener : public detail::owner<rbr_listener, rbr_listener_destroy> {
public:
    using owner::owner;

    /** The next connection request, waiting up to `timeout` (negative: without limit; 0:
     *  not at all). Empty when none came in time (RBR_EMPTY or RBR_ERR_TIMEOUT in C). */
    std::optional<request> get_request(std::chrono::milliseconds timeout)
    {
        rbr_request *raw = nullptr;
        rbr_status s = rbr_listener_get_request(get(), detail::to_ms(timeout), &raw);
        if (s == RBR_EMPTY || s == RBR_ERR_TIMEOUT)
            return std::nullopt;
        detail::check(s, "rbr_listener_get_request");
        return request(raw);
    }
    std::optional<request> get_request(std::chrono::milliseconds timeout,
                                       std::error_code &ec) noexcept
    {
        rbr_request *raw = nullptr;
        rbr_status s = rbr_listener_get_request(get(), detail::to_ms(timeout), &raw);
        if (s == RBR_EMPTY || s == RBR_ERR_TIMEOUT) {
            ec.clear();
            return std::nullopt;
        }
        if (!detail::check(s, ec))
            return std::nullopt;
        return request(raw);
    }

    /** The listener's level-triggered descriptor (see rbr_listener_fd); owned by it. */
    int fd() const
    {
        int32_t fd = -1;
        detail::check(rbr_listener_fd(get(), &fd), "rbr_listener_fd");
        return fd;
    }
};

/** A shared receive queue: one pool of receives for the connections whose options name it
 *  (conn_options::srq = pool.get()); see rbr_srq. Made by rbr::context. */
class shared_recv_queue : public detail::owner<rbr_srq, rbr_srq_destroy> {
public:
    using owner::owner;

    /** Posts a receive into `mr` at `offset`, up to `len` bytes, to the pool. */
    void post_recv(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id)
    {
        detail::check(rbr_srq_post_recv(get(), mr.get(), offset, len, wr_id),
                      "rbr_srq_post_recv");
    }
    bool post_recv(const memory_region &mr, std::size_t offset, std::size_t len,
                   std::uint64_t wr_id, std::error_code &ec) noexcept
    {
        return detail::check(rbr_srq_post_recv(get(), mr.get(), offset, len, wr_id), ec);
    }

    /** Arms the limit event (RBR_OP_SRQ_LIMIT on the pool's queue); 0 disarms it. */
    void set_limit(std::uint32_t limit)
    {
        detail::check(rbr_srq_set_limit(get(), limit), "rbr_srq_set_limit");
    }
    bool set_limit(std::uint32_t limit, std::error_code &ec) noexcept
    {
        return detail::check(rbr_srq_set_limit(get(), limit), ec);
    }

    /** Receives in the pool that no connection has taken yet. */
    std::size_t size() const noexcept { return rbr_srq_len(get()); }
};

/** The parent of listeners, connections and regions. */
class context : public detail::owner<rbr_ctx, rbr_ctx_destroy> {
public:
    using owner::owner;

    /** A context; `flags` are RBR_CTX_* flags. */
    static context create(std::uint32_t flags = 0)
    {
        rbr_ctx_options opts{sizeof(rbr_ctx_options), flags};
        rbr_ctx *raw = nullptr;
        detail::check(rbr_ctx_create_ex(&opts, &raw), "rbr_ctx_create_ex");
        return context(raw);
    }
    static context create(std::error_code &ec, std::uint32_t flags = 0) noexcept
    {
        rbr_ctx_options opts{sizeof(rbr_ctx_options), flags};
        rbr_ctx *raw = nullptr;
        return detail::check(rbr_ctx_create_ex(&opts, &raw), ec) ? context(raw) : context();
    }

    /** `len` zeroed bytes the library owns, as a region with `access` (RBR_ACCESS_*). */
    memory_region alloc_mr(std::size_t len, std::uint32_t access)
    {
        rbr_mr *raw = nullptr;
        detail::check(rbr_mr_alloc(get(), len, access, &raw), "rbr_mr_alloc");
        return memory_region(raw);
    }
    memory_region alloc_mr(std::size_t len, std::uint32_t access, std::error_code &ec) noexcept
    {
        rbr_mr *raw = nullptr;
        return detail::check(rbr_mr_alloc(get(), len, access, &raw), ec) ? memory_region(raw)
                                                                         : memory_region();
    }

    /** Registers caller memory (see rbr_mr_register for how long it must stay valid). */
    memory_region register_mr(void *addr, std::size_t len, std::uint32_t access)
    {
        rbr_mr *raw = nullptr;
        detail::check(rbr_mr_register(get(), addr, len, access, &raw), "rbr_mr_register");
        return memory_region(raw);
    }
    memory_region register_mr(void *addr, std::size_t len, std::uint32_t access,
                              std::error_code &ec) noexcept
    {
        rbr_mr *raw = nullptr;
        return detail::check(rbr_mr_register(get(), addr, len, access, &raw), ec)
                   ? memory_region(raw)
                   : memory_region();
    }

    /** A shared receive queue of this context. */
    shared_recv_queue create_srq(const srq_options &opts = srq_options())
    {
        rbr_srq *raw = nullptr;
        detail::check(rbr_srq_create(get(), &opts, &raw), "rbr_srq_create");
        return shared_recv_queue(raw);
    }
    shared_recv_queue create_srq(const srq_options &opts, std::error_code &ec) noexcept
    {
        rbr_srq *raw = nullptr;
        return detail::check(rbr_srq_create(get(), &opts, &raw), ec) ? shared_recv_queue(raw)
                                                                    : shared_recv_queue();
    }

    /** Listens on `addr` with room for `backlog` requests not yet taken. */
    listener listen(const std::string &addr, std::uint32_t backlog = 16)
    {
        rbr_listener *raw = nullptr;
        detail::check(rbr_listen(get(), addr.c_str(), backlog, &raw), "rbr_listen");
        return listener(raw);
    }
    listener listen(const std::string &addr, std::uint32_t backlog, std::error_code &ec) noexcept
    {
        rbr_listener *raw = nullptr;
        return detail::check(rbr_listen(get(), addr.c_str(), backlog, &raw), ec) ? listener(raw)
                                                                                 : listener();
    }

    /** Connects to the listener at `addr`; completions go to `cq`. A rejection throws
     *  RBR_ERR_REJECTED; rbr::last_reject_data() then has the listener's private data. */
    connection connect(const std::string &addr, const completion_queue &cq,
                       const conn_options &opts = conn_options())
    {
        rbr_conn *raw = nullptr;
        detail::check(rbr_connect(get(), addr.c_str(), cq.get(), &opts, &raw), "rbr_connect");
        return connection(raw);
    }
    connection connect(const std::string &addr, const completion_queue &cq,
                       const conn_options &opts, std::error_code &ec) noexcept
    {
        rbr_conn *raw = nullptr;
        return detail::check(rbr_connect(get(), addr.c_str(), cq.get(), &opts, &raw), ec)
                   ? connection(raw)
                   : connection();
    }

    /** Starts connecting and returns at once, the connection connecting: its outcome arrives
     *  on `cq` as an RBR_OP_CONNECTED record (then connection::established() says why a
     *  failed one failed). Throws only for bad arguments. */
    connection connect_start(const std::string &addr, const completion_queue &cq,
                             const conn_options &opts = conn_options())
    {
        rbr_conn *raw = nullptr;
        detail::check(rbr_connect_start(get(), addr.c_str(), cq.get(), &opts, &raw),
                      "rbr_connect_start");
        return connection(raw);
    }
    connection connect_start(const std::string &addr, const completion_queue &cq,
                             const conn_options &opts, std::error_code &ec) noexcept
    {
        rbr_conn *raw = nullptr;
        return detail::check(rbr_connect_start(get(), addr.c_str(), cq.get(), &opts, &raw), ec)
                   ? connection(raw)
                   : connection();
    }
};

} // namespace rbr

#endif /* RDMABRIDGE_HPP */
