//! A connection whose operations are futures.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::conn::{
    ConnOptions, ConnRequest, Connection, RemoteRegion, SendFlags, Sge, SharedRecvQueue,
};
use crate::cq::Completion;
use crate::ctx::Context;
use crate::error::Result;
use crate::ops::{Buf, Op, Router};

/// Atomics' result words allocated at a time (one region each batch).
const WORDS: usize = 64;

/// A place in the peer's memory: `offset` bytes into `region`.
#[derive(Debug, Clone, Copy)]
pub struct Remote {
    /// The peer's region ([`Connection::unpack_remote`]).
    pub region: RemoteRegion,
    /// Where in it, in bytes.
    pub offset: u64,
}

/// An atomic fetch-and-add on the peer's 8-byte word (8-byte aligned, in a region with
/// [`crate::Access::REMOTE_ATOMIC`]).
#[derive(Debug, Clone, Copy)]
pub struct FetchAdd {
    /// The peer's region.
    pub region: RemoteRegion,
    /// The word's offset in it.
    pub offset: u64,
    /// What to add.
    pub add: u64,
}

/// An atomic compare-and-swap on the peer's 8-byte word (as for [`FetchAdd`]): stores `swap`
/// if the word equals `compare`.
#[derive(Debug, Clone, Copy)]
pub struct CmpSwap {
    /// The peer's region.
    pub region: RemoteRegion,
    /// The word's offset in it.
    pub offset: u64,
    /// The value the word must hold for the swap to happen.
    pub compare: u64,
    /// The value stored when it does.
    pub swap: u64,
}

/// A [`Connection`] whose operations return futures ([`Op`]) that resolve to their outcome:
/// one call per operation, no `wr_id`, no `unsafe`. Its completion queue must be the one its
/// [`Router`] routes.
///
/// It dereferences to the [`Connection`], for its id, its one-sided descriptors
/// ([`Connection::pack_region`], [`Connection::unpack_remote`]) and the plain posts. Dropping
/// it disconnects; operations still in flight then complete (flushed) and release what they
/// hold.
#[derive(Debug)]
pub struct AsyncConnection {
    conn: Connection,
    router: Arc<Router>,
    ctx: Context,
    /// Result words of atomics, 8 bytes each, ready for reuse.
    words: Arc<Mutex<Vec<Buf>>>,
}

impl std::ops::Deref for AsyncConnection {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        &self.conn
    }
}

impl AsyncConnection {
    /// `conn`, whose completions go to `router`'s queue, with futures for its operations.
    pub fn new(conn: Connection, router: Arc<Router>) -> Self {
        let ctx = Context {
            inner: conn.context_inner().clone(),
        };
        AsyncConnection {
            conn,
            router,
            ctx,
            words: Arc::default(),
        }
    }

    /// Connects to a listener at `addr` without blocking the caller: starts the connection
    /// ([`Context::connect_start`]) when first polled, its completions going to `router`'s
    /// queue, and resolves once it is established, or to the error the blocking
    /// [`Context::connect`] would return ([`crate::Error::Refused`],
    /// [`crate::Error::Rejected`] with the listener's private data, [`crate::Error::Timeout`]
    /// after `opts.timeout`, ...). Dropping the future before then drops the connection,
    /// which releases everything it had.
    pub async fn connect(
        ctx: &Context,
        addr: &str,
        router: &Arc<Router>,
        opts: &ConnOptions,
    ) -> Result<AsyncConnection> {
        let conn = ctx.connect_start(addr, router.queue(), opts)?;
        Self::established(conn, router).await
    }

    /// Accepts `req` without blocking the caller ([`ConnRequest::accept_start`]), its
    /// completions going to `router`'s queue; resolves once the connection is established
    /// (over verbs: the peer confirmed), or to the error the blocking
    /// [`ConnRequest::accept`] would return. Dropping the future before then drops the
    /// connection.
    pub async fn accept(
        req: ConnRequest,
        router: &Arc<Router>,
        opts: &ConnOptions,
    ) -> Result<AsyncConnection> {
        let conn = req.accept_start(router.queue(), opts)?;
        Self::established(conn, router).await
    }

    /// `conn` once [`Connection::poll_established`] says it is established.
    async fn established(conn: Connection, router: &Arc<Router>) -> Result<AsyncConnection> {
        std::future::poll_fn(|cx| conn.poll_established(cx)).await?;
        Ok(AsyncConnection::new(conn, router.clone()))
    }

    /// The router of its queue.
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// The plain connection.
    pub fn into_inner(self) -> Connection {
        self.conn
    }

    /// Sends the buffer's contents; resolves, with the buffer, once the peer has taken the
    /// message.
    pub fn send(&self, buf: Buf) -> Op<(Result<()>, Buf)> {
        Op::post(&self.router, Some(buf), with_buf, |token, b| {
            let b = b.expect("the buffer");
            let (mr, off) = b.region();
            self.conn
                .post_send(mr, off, b.len(), token, SendFlags::SIGNALED)
        })
    }

    /// Sends a copy of `data` (at most the connection's granted `max_inline` bytes, 64 by
    /// default), taken before this returns.
    pub fn send_copy(&self, data: &[u8]) -> Op<Result<()>> {
        Op::post(
            &self.router,
            None,
            |r, _| r.map(drop),
            |token, _| self.conn.post_send_inline(data, token, SendFlags::SIGNALED),
        )
    }

    /// Receives the next message into the buffer (up to its capacity); resolves with the
    /// buffer, its length set to the message's. The record tells a message
    /// ([`crate::Opcode::Recv`]) from a write with immediate ([`crate::Opcode::RecvWriteImm`],
    /// which leaves the buffer empty), and carries the immediate data. Messages fill
    /// receives in the order they were posted: post several to keep messages flowing.
    pub fn recv(&self, buf: Buf) -> Op<(Result<Completion>, Buf)> {
        Op::post(&self.router, Some(buf), received, |token, b| {
            let b = b.expect("the buffer");
            let (mr, off) = b.region();
            self.conn.post_recv(mr, off, b.capacity(), token)
        })
    }

    /// Writes the buffer's contents into the peer's memory at `to` (a region with
    /// [`crate::Access::REMOTE_WRITE`]); resolves, with the buffer, once they are there.
    pub fn write(&self, buf: Buf, to: Remote) -> Op<(Result<()>, Buf)> {
        self.one_sided(buf, |local, token, flags| {
            self.conn
                .post_write(local, &to.region, to.offset, token, flags)
        })
    }

    /// As [`write`](Self::write), then consumes a receive posted at the peer, whose record
    /// carries `imm`.
    pub fn write_imm(&self, buf: Buf, to: Remote, imm: u32) -> Op<(Result<()>, Buf)> {
        self.one_sided(buf, |local, token, flags| {
            self.conn
                .post_write_imm(local, &to.region, to.offset, imm, token, flags)
        })
    }

    /// Reads `buf.len()` bytes of the peer's memory at `from` (a region with
    /// [`crate::Access::REMOTE_READ`]) into the buffer; resolves with it once they are there.
    pub fn read(&self, buf: Buf, from: Remote) -> Op<(Result<()>, Buf)> {
        self.one_sided(buf, |local, token, flags| {
            self.conn
                .post_read(local, &from.region, from.offset, token, flags)
        })
    }

    /// Posts a write or read of the buffer's contents with `post` (given the buffer as one
    /// segment, the token and the flags).
    fn one_sided(
        &self,
        buf: Buf,
        post: impl FnOnce(&[Sge<'_>], u64, SendFlags) -> Result<()>,
    ) -> Op<(Result<()>, Buf)> {
        Op::post(&self.router, Some(buf), with_buf, |token, b| {
            let b = b.expect("the buffer");
            let (mr, offset) = b.region();
            let local = [Sge {
                mr,
                offset,
                len: b.len(),
            }];
            post(&local, token, SendFlags::SIGNALED)
        })
    }

    /// Runs `op` on the peer's word; resolves to the word as it was.
    pub fn fetch_add(&self, op: FetchAdd) -> Op<Result<u64>> {
        self.atomic(|token, mr, off| {
            let flags = SendFlags::SIGNALED;
            self.conn
                .post_fetch_add(mr, off, &op.region, op.offset, op.add, token, flags)
        })
    }

    /// Runs `op` on the peer's word; resolves to the word as it was (the swap happened when
    /// it equals `op.compare`).
    pub fn cmp_swap(&self, op: CmpSwap) -> Op<Result<u64>> {
        self.atomic(|token, mr, off| {
            let flags = SendFlags::SIGNALED;
            let (c, s) = (op.compare, op.swap);
            self.conn
                .post_cmp_swap(mr, off, &op.region, op.offset, c, s, token, flags)
        })
    }

    /// Posts an atomic with `post` (given its token and where the old word lands) into a
    /// result word of the connection's.
    fn atomic(
        &self,
        post: impl FnOnce(u64, &Arc<crate::MemoryRegion>, usize) -> Result<()>,
    ) -> Op<Result<u64>> {
        let word = match self.word() {
            Ok(w) => w,
            Err(e) => return Op::post(&self.router, None, |r, _| r.map(|_| 0), |_, _| Err(e)),
        };
        let mut op = Op::post(&self.router, Some(word), old_word, |token, b| {
            let (mr, off) = b.expect("the word").region();
            post(token, mr, off)
        });
        op.spare = Some(self.words.clone());
        op
    }

    /// A free result word, allocating a batch when none is.
    fn word(&self) -> Result<Buf> {
        let mut words = self.words.lock();
        if words.is_empty() {
            *words = Buf::alloc_many(&self.ctx, WORDS, 8)?;
        }
        Ok(words.pop().expect("a word, just made if there was none"))
    }
}

/// A [`SharedRecvQueue`] whose receives are futures: [`recv`](Self::recv) posts a buffer to
/// the pool and resolves, with the buffer, once a message of any of the pool's connections
/// filled it; the record's `conn_id` (and `context`) says which connection. Its connections
/// must complete on `router`'s queue.
///
/// Dropping a receive's future keeps its buffer with the router until a message fills it:
/// unlike a connection's, a pool's receive is not flushed when a connection ends, so that may
/// be as late as the router's end (receives still in the pool then complete nowhere).
#[derive(Debug, Clone)]
pub struct AsyncRecvQueue {
    pool: SharedRecvQueue,
    router: Arc<Router>,
}

impl AsyncRecvQueue {
    /// `pool`, whose connections complete on `router`'s queue, with futures for its receives.
    pub fn new(pool: SharedRecvQueue, router: Arc<Router>) -> Self {
        AsyncRecvQueue { pool, router }
    }

    /// The pool.
    pub fn pool(&self) -> &SharedRecvQueue {
        &self.pool
    }

    /// Posts the buffer to the pool; resolves, with the buffer (its length set to the
    /// message's), once a message filled it. As [`AsyncConnection::recv`] but for any of the
    /// pool's connections: the messages take the pool's receives in the order they were
    /// posted.
    pub fn recv(&self, buf: Buf) -> Op<(Result<Completion>, Buf)> {
        Op::post(&self.router, Some(buf), received, |token, b| {
            let b = b.expect("the buffer");
            let (mr, off) = b.region();
            self.pool.post_recv(mr, off, b.capacity(), token)
        })
    }
}

/// An operation's outcome with its buffer.
fn with_buf(r: Result<Completion>, buf: &mut Option<Buf>) -> (Result<()>, Buf) {
    (r.map(drop), buf.take().expect("the operation's buffer"))
}

/// A receive's outcome with its buffer, its length set to the message's.
fn received(r: Result<Completion>, buf: &mut Option<Buf>) -> (Result<Completion>, Buf) {
    let mut b = buf.take().expect("the receive's buffer");
    let len = match &r {
        Ok(c) if c.opcode == crate::Opcode::Recv => c.byte_len as usize,
        _ => 0,
    };
    // A message fits its receive (a larger one fails it), so the length is in range.
    let _ = b.set_len(len.min(b.capacity()));
    (r, b)
}

/// An atomic's outcome: the word as it was, from its result word.
fn old_word(r: Result<Completion>, buf: &mut Option<Buf>) -> Result<u64> {
    r?;
    let b = buf.as_ref().expect("the result word");
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    Ok(u64::from_ne_bytes(w))
}
