//! Which transport an address opens: listening and connecting, dispatched on the endpoint the
//! address resolves to. The one place above the transports that names each of them; the core
//! (`conn`, `cq`, `mr`, `domain`, `ctx`) names none.

use std::sync::Arc;

use crate::addr::Endpoint;
use crate::conn::{ConnOptions, Connection, Listener, Setup, Started, Transport};
use crate::cq::CompletionQueue;
use crate::domain::ContextInner;
use crate::error::{Error, Result};
use crate::shm;

/// Listens on `ep` with a backlog of `backlog` requests.
pub(crate) fn listen(ctx: Arc<ContextInner>, ep: Endpoint, backlog: u32) -> Result<Listener> {
    match ep {
        Endpoint::Shm { name } => shm::Listener::bind(ctx, &name, backlog).map(Listener::new),
        Endpoint::Verbs { host, port } => verbs_listen(ctx, &host, port, backlog),
    }
}

/// Starts connecting to the listener at `ep` (`opts` were validated); completions go to `cq`,
/// and with them the outcome when `records`.
pub(crate) fn connect(
    ctx: Arc<ContextInner>,
    ep: Endpoint,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
    records: bool,
) -> Result<Connection> {
    let (transport, peer) = match &ep {
        Endpoint::Shm { name } => (Transport::Shm, format!("shm://{name}")),
        Endpoint::Verbs { host, port } => (Transport::Verbs, format!("rdma://{host}:{port}")),
    };
    let setup = Setup::new(&ctx, &cq, opts, transport, peer, records)?;
    let started = match ep {
        Endpoint::Shm { name } => shm::start_connect(&name, cq, opts)?,
        Endpoint::Verbs { host, port } => verbs_connect(ctx, &host, port, cq, opts)?,
    };
    Connection::start(setup, started)
}

#[cfg(feature = "verbs")]
fn verbs_listen(ctx: Arc<ContextInner>, host: &str, port: u16, backlog: u32) -> Result<Listener> {
    if !crate::verbs::device_present() {
        return Err(Error::NoDevice);
    }
    crate::verbs::Listener::bind(ctx, host, port, backlog).map(Listener::new)
}

#[cfg(feature = "verbs")]
fn verbs_connect(
    ctx: Arc<ContextInner>,
    host: &str,
    port: u16,
    cq: Arc<CompletionQueue>,
    opts: &ConnOptions,
) -> Result<Started> {
    if !crate::verbs::device_present() {
        return Err(Error::NoDevice);
    }
    crate::verbs::start_connect(ctx, host, port, cq, opts)
}

#[cfg(not(feature = "verbs"))]
fn verbs_listen(_: Arc<ContextInner>, _: &str, _: u16, _: u32) -> Result<Listener> {
    Err(Error::Unsupported("built without the verbs feature".into()))
}

#[cfg(not(feature = "verbs"))]
fn verbs_connect(
    _: Arc<ContextInner>,
    _: &str,
    _: u16,
    _: Arc<CompletionQueue>,
    _: &ConnOptions,
) -> Result<Started> {
    Err(Error::Unsupported("built without the verbs feature".into()))
}
