//! Attempts to break the crate's promises with safe code, on the device, filed by what they
//! attack. Each test asserts the safe outcome (a clear error with nothing held, a region that
//! stays out of reach until its completion, every completion delivered once and in order), so it
//! fails if the promise breaks; each test's doc comment says which review found it.
//!
//! One binary, so one guest boot for all of them. The older attempt suites keep their own
//! binaries: `tests/soundness.rs` (the second outside audit's findings) and
//! `tests/adversarial.rs` (an outside reviewer's first pass, with its counting allocator and
//! child processes). See `tests/README.md`.

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "tokio")]
mod asynchronous;
mod drop;
mod multicast;
mod poll;
mod post;
mod regions;
mod srq;
mod support;
mod ud;
