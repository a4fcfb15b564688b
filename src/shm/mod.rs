//! The shared-memory transport, for peers on the same host.
//!
//! A connection is a Unix-socket handshake (credentials checked, private data both ways;
//! `handshake/`) that hands over a sealed memfd with two lock-free byte rings, one per
//! direction. Posting writes into the rings on the caller's thread, and polling the completion
//! queue takes from them (`flow.rs`). Each completion queue has a notice board on which peers
//! mark the connections with news (`cq/notice.rs`), so a poll looks at those only. One-sided
//! operations reach the peer's regions - mapped here, or through the kernel - on the poster's
//! thread (`onesided/`). The context's progress driver watches for the peer leaving and moves
//! data only while nobody else does (`engine.rs`), for all its connections on one thread.
//! Everything the socket carries, from the hello to the goodbye, is laid out in `wire.rs`.

mod bell;
mod conn;
mod copy;
mod direct;
mod engine;
mod flow;
#[cfg(feature = "fuzzing")]
pub(crate) mod fuzz;
mod handshake;
mod onesided;
mod peers;
mod ring;
mod segment;
mod socket;
mod wire;

pub(crate) use handshake::{Listener, start_connect};
