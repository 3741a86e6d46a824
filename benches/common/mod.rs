//! What both bench binaries share: the device's address, a route-resolved id, raw CM event
//! handling for the `raw` baselines, and criterion settings sized for a TCG guest.
#![allow(dead_code)] // each bench uses part of this module

// The device suite's helpers: device discovery and the loopback `pair`.
#[path = "../../tests/common/mod.rs"]
mod shared;

use std::net::SocketAddr;
use std::time::Duration;

use criterion::Criterion;
use rdma_cm::{ffi, Client, RouteResolved};

#[allow(unused_imports)] // each bench binary uses part of it
pub use shared::{device_addr, lane, pair, sockaddr_v4, ud, PairSpec, Side};

pub const T: Duration = Duration::from_secs(10);

/// Criterion settings: short enough to run every group in a guest under emulation.
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
        .without_plots()
}

/// A client id with a resolved route to the device's own address (no listener needed).
pub fn route(port: u16) -> RouteResolved {
    let dst = SocketAddr::new(device_addr(), port);
    Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap()
}

/// Waits on a raw channel for `expected` and acks it; returns the event's id.
///
/// # Safety
/// `ch` must be a valid channel.
pub unsafe fn raw_expect(ch: *mut ffi::rdma_event_channel, expected: u32) -> *mut ffi::rdma_cm_id {
    let mut ev = std::ptr::null_mut();
    // SAFETY: caller guarantees `ch`; `ev` is a valid out-pointer. The channel is blocking.
    assert_eq!(unsafe { ffi::rdma_get_cm_event(ch, &mut ev) }, 0, "rdma_get_cm_event");
    // SAFETY: a successful get returned a valid event, acked once below.
    let (kind, id, status) = unsafe { ((*ev).event, (*ev).id, (*ev).status) };
    // SAFETY: as above.
    unsafe { ffi::rdma_ack_cm_event(ev) };
    assert_eq!(kind, expected, "raw: expected event {expected}, got {kind} (status {status})");
    id
}

/// A zeroed C struct.
///
/// # Safety
/// `T` must be plain old data for which all-zero bytes are a valid value (the verbs structs).
pub unsafe fn zeroed<T>() -> T {
    // SAFETY: the caller guarantees all-zero is a valid T.
    unsafe { std::mem::zeroed() }
}

/// Raw: posts one signaled RDMA WRITE gathered from `sges` on `qp`.
pub fn raw_write_sg(qp: &rdma_cm::QueuePair, sges: &mut [ffi::ibv_sge], remote: rdma_cm::RemoteRegion) {
    // SAFETY: ibv_send_wr is plain old data.
    let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
    wr.sg_list = sges.as_mut_ptr();
    wr.num_sge = sges.len() as i32;
    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr, rkey: remote.rkey };
    let mut bad = std::ptr::null_mut();
    // SAFETY: QP alive (created with max_send_sge >= sges.len()); wr and the sges live for the
    // call; the regions outlive the completion, which the caller reaps before the next post.
    assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), &mut wr, &mut bad) }, 0);
}
