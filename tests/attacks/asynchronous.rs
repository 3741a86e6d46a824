//! Async waits (feature `tokio`) beside blocking ones on one CQ.

use crate::support::{shared_cq_stress, Mode};

/// Review of debafe3, promises 1 and 5: blocking and async waits on one CQ from six threads,
/// each async one on a runtime of its own (so the CQ's channel gets a lasting registration with
/// three runtimes at once), one of them cancelling its wait every 2 ms.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
#[cfg(feature = "tokio")]
#[test]
fn async_waits_on_three_runtimes_and_blocking_waits_share_a_cq() {
    shared_cq_stress(
        &[Mode::AsyncWait, Mode::AsyncWaitFor, Mode::AsyncCancelled, Mode::Wait, Mode::WaitFor, Mode::BusyWait],
        None,
    );
}

/// Review of debafe3, promises 1, 3 and 5: the same with the receives from one SRQ.
///
/// Origin: the outside-style review of issue 20 ("no completion lost, no wait blind"), formerly in `tests/attack_waits.rs`.
#[cfg(feature = "tokio")]
#[test]
fn async_and_blocking_waits_of_srq_qps_share_a_cq() {
    shared_cq_stress(&[Mode::AsyncWait, Mode::AsyncCancelled, Mode::Wait, Mode::AsyncWait], Some(16));
}
