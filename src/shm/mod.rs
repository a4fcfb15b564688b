//! The shared-memory transport, for peers on the same host.
//!
//! A connection is a Unix-socket handshake (credentials checked, private data both ways) that
//! hands over a sealed memfd with two lock-free byte rings, one per direction, plus a progress
//! thread per connection that moves messages between posted buffers and the rings.

mod conn;
mod engine;
mod handshake;
mod ring;
mod segment;

pub(crate) use conn::Conn;
pub(crate) use handshake::{Listener, Request, connect};
