//! Attempts to break the crate's promises with safe code, on the device, filed by what they
//! attack. Each test asserts the safe outcome (a clear error with nothing held, a region that
//! stays out of reach until its completion, every completion delivered once and in order), so it
//! fails if the promise breaks.
//!
//! One binary, so one guest boot for all of them, its modules named by what they attack. The
//! one attempt that needs a counting global allocator
//! (`waiting_through_the_peers_disconnect_allocates_nothing`) lives in `tests/alloc.rs`. See
//! `tests/README.md`.
//!
//! Attacks through a borrowed descriptor (reading a CQ's completion
//! channel into a `File`, clearing O_NONBLOCK on the event channel) cannot be written any
//! more: the crate implements `AsRawFd` only, and turning a raw descriptor into a `File` takes
//! `unsafe` (pinned by `tests/ui/`).

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "tokio")]
mod connect;
mod events;
mod lane_attach;
mod lane_drop;
mod lane_multicast;
mod lane_order;
mod lane_paths;
mod lane_poll;
mod lane_post;
mod lane_regions;
#[cfg(feature = "tokio")]
mod lane_runtime;
mod lane_srq;
mod lane_ud;
mod shared;
