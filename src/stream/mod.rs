//! A byte stream that speaks librdmacm's rsocket protocol (feature `stream`).
//!
//! The goal is a stream over one RC connection that interoperates with rdma-core's rsockets:
//! `rstream`, `rcopy` and programs run under `LD_PRELOAD=librspreload.so`. What exists so far
//! is only the wire format, in [`wire`]: the 40-byte connection data exchanged in the connect
//! request and reply, the 32-bit message carried as immediate data (or as a 4-byte SEND on
//! iWARP), and the 16-byte buffer grant written into the peer's target SGL, each with a
//! decoder that refuses what a peer must not be trusted with. It touches no device. The
//! protocol itself, with references to the rsocket source, is described in
//! `docs/rsocket-protocol.md`.

pub mod wire;
