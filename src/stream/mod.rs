//! A byte stream that speaks librdmacm's rsocket protocol (feature `stream`).
//!
//! [`Stream`] is a blocking byte stream over one RC connection that interoperates with
//! rdma-core's rsockets (`rstream`, `rcopy`, programs under `LD_PRELOAD=librspreload.so`):
//! [`Stream::connect`] connects to an rsocket listener, [`StreamListener::accept`] takes an
//! rsocket's connect, and both exchange the 40-byte connection data of [`wire::ConnData`] in
//! the CM's private data. The stream implements [`std::io::Read`] and [`std::io::Write`];
//! [`Stream::shutdown`] sends rsocket's SHUTDOWN (half-close) or DISCONNECT; every blocking
//! call is bounded ([`Stream::set_read_timeout`], [`Stream::set_write_timeout`]).
//! [`StreamConfig`] sets the sizes of the buffers and the credits (the defaults suit bulk
//! transfer; many small streams take less).
//!
//! **Under tokio** (feature `tokio`): the stream is also `tokio::io::AsyncRead` and
//! `AsyncWrite`, so tokio's utilities (`tokio::io::copy`, `split`, `AsyncReadExt`) and codecs
//! work on it unchanged; `Stream::connect_async` and `StreamListener::accept_async` set it up
//! off the runtime's threads. A pending read or write sleeps on tokio's reactor, woken by the
//! CQ's completion channel or the connection's CM events, so a thousand idle streams on one
//! runtime thread cost nothing until one of them is written to (`tests/stream_tokio.rs`).
//! Async shutdown is `AsyncWriteExt::shutdown(&mut s)` (a half-close) or
//! `Stream::shutdown_async`: the stream's own blocking `shutdown(how)` takes the method
//! name first. The async calls have no timeouts of their own, as tokio's sockets have none.
//!
//! ```no_run
//! use std::io::{Read, Write};
//! use std::time::Duration;
//! use rdma_cm::stream::{Stream, StreamListener};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let t = Duration::from_secs(5);
//! let listener = StreamListener::bind("10.77.0.1:7471".parse()?)?;
//! let server = std::thread::spawn(move || -> std::io::Result<()> {
//!     let mut s = listener.accept(t).map_err(std::io::Error::other)?;
//!     let mut got = Vec::new();
//!     s.read_to_end(&mut got)?;                // until the client's shutdown(Write)
//!     s.write_all(&got)?;                      // then echo it back
//!     s.shutdown(std::net::Shutdown::Both)
//! });
//! let mut c = Stream::connect("10.77.0.1:7471".parse()?, t)?;
//! c.write_all(b"hello")?;
//! c.shutdown(std::net::Shutdown::Write)?;      // rsocket's SHUTDOWN: a half-close
//! let mut back = Vec::new();
//! c.read_to_end(&mut back)?;
//! assert_eq!(back, b"hello");
//! server.join().unwrap()?;
//! # Ok(()) }
//! ```
//!
//! **What happens on the wire** (`docs/rsocket-protocol.md` has the whole protocol): data is
//! copied into a registered 256 KiB send buffer, used as a ring, and RDMA-WRITTEN with
//! immediate data (`DATA | len`, up to 64 KiB a message) into the half of the peer's receive
//! buffer it granted, consecutively, never past the grant, and never more messages than the
//! peer's credits; writes of up to 64 bytes go inline, from the caller's buffer. A blocking
//! call that must wait polls for 10 µs before it sleeps on the completion channel, as
//! rsocket does. Received data is
//! copied out of this side's 256 KiB receive buffer with volatile reads (the peer can write
//! there at any moment), receives are posted again as they are reaped, and a credit update
//! goes back as rsocket sends it: a grant of the next free half written into the peer's
//! target SGL, or a bare update once half the credits were used. Nothing is allocated per
//! message. The peer's messages are checked: a grant outside what it can be, data beyond the
//! granted half or beyond the credits, an unknown or reserved operation, a credit update for
//! more than the peer's receives, an iomap update (this side advertises none): each is a
//! protocol violation that closes the stream with an [`std::io::ErrorKind::InvalidData`]
//! error naming it, never a panic.
//!
//! **Zero-copy writes.** [`Stream::write_region`] sends a range of a region registered on
//! [`Stream::pd`] without copying it: each data WRITE goes from the region straight into the
//! peer's granted space (the peer, rsocket or not, sees the same messages). The region moves
//! into the call and comes back once its last WRITE has completed, so nothing can change it
//! while the device reads it. Nothing is allocated per WRITE.
//!
//! ```no_run
//! use rdma_cm::{stream::Stream, AccessFlags, MemoryRegion};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut s = Stream::connect("10.77.0.1:7471".parse()?, std::time::Duration::from_secs(5))?;
//! let mr = MemoryRegion::register(s.pd(), vec![7u8; 1 << 20], AccessFlags::empty())?;
//! let len = mr.len();
//! let mut mr = s.write_region(mr, 0..len)?; // back once the peer's device has every byte
//! mr.as_mut_slice()?.fill(8);
//! # Ok(()) }
//! ```
//!
//! **Flow control.** The protocol counts data messages only; the peer's grants and credit
//! updates ride on receives it does not count, and rsocket leans on RNR retries for those.
//! This side advertises 128 credits and posts 16 receives beyond them, and keeps 4 of the
//! peer's credits unused (when it has more than 8) for its own control messages, so in
//! practice no message of either side waits on an RNR retry; the connection still asks for
//! infinite RNR retries, as rsocket does.
//!
//! **Tested** (`tests/stream.rs`, Soft-RoCE): against rdma-core 44's `rstream` as its server
//! and as its client, its data verified both ways; between two of these streams, echoes and a
//! half-close larger than every buffer; a killed peer; hostile peers breaking each rule above.
//! `tests/stream_interop.rs`: against `rcopy` as its client and as its server (a file of a few
//! MiB copied byte-identical each way), and against a plain TCP program under
//! `LD_PRELOAD=librspreload.so` as its client and as its server. `tests/stream_region.rs`:
//! zero-copy writes in order with copied ones and flushes, through grants smaller than a
//! WRITE, refused for a foreign region or range, after a shutdown or the peer's departure,
//! and a WRITE the peer never takes: each error gives the region back, unchanged.
//!
//! **Limits of this version.** iWARP devices are refused with
//! [`Error::Unsupported`](crate::Error::Unsupported): iWARP has no immediate data and rsocket
//! sends every message there as a 4-byte SEND, which is not implemented. No iomap
//! (`riomap`/`riowrite`), no keepalive; `AF_IB` addresses are not supported. A drop
//! blocks briefly, as rsocket's `rclose` does, for its DISCONNECT to complete (normally one
//! round trip, at most 2 s): async code that minds calls `shutdown_async(Shutdown::Both)`
//! first.

#[cfg(feature = "tokio")]
mod async_io;
mod buffers;
mod config;
mod conn;
mod engine;
mod io;
mod region;
pub mod wire;

pub use config::StreamConfig;
pub use conn::StreamListener;
pub use engine::Stream;
pub use region::WriteRegionError;
