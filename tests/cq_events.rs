//! The rest of the CQ surface on the device: solicited events (a CQ armed for solicited
//! completions only raises its event for a send with the solicited bit, and not for one
//! without), and CQ moderation (`ibv_modify_cq`), set or refused naming the capability.

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::{pair, DeviceTest, PairSpec, T};
use rdma_cm::{CompletionQueue, Error, QueuePair, SendWr, VerbsContext, WorkCompletion, WorkQueue};

/// Whether the CQ's channel descriptor becomes readable within `within`.
fn readable(cq: &CompletionQueue, within: Duration) -> bool {
    let mut p = libc::pollfd { fd: cq.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, for the call.
    let n = unsafe { libc::poll(&mut p, 1, within.as_millis() as libc::c_int) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1
}

/// Polls (never arming or reading the channel) until the receive `wr_id` is reaped.
fn reap_recv(qp: &mut QueuePair, wr_id: u64) -> WorkCompletion {
    let end = Instant::now() + T;
    let mut wcs = [WorkCompletion::default(); 4];
    loop {
        let n = qp.poll(&mut wcs).expect("poll");
        if let Some(wc) = wcs[..n].iter().find(|w| w.queue() == WorkQueue::Recv && w.wr_id() == wr_id) {
            return *wc;
        }
        assert!(Instant::now() < end, "receive {wr_id} did not complete within {T:?}");
        std::hint::spin_loop();
    }
}

#[test]
fn a_cq_armed_for_solicited_events_wakes_for_solicited_sends_only() {
    let t = DeviceTest::start();
    let server = PairSpec { mr_sizes: vec![64], pre_recv: vec![(1, 32), (2, 32)], ..PairSpec::default() };
    let (mut c, mut s) = pair(t.addr, PairSpec { mr_sizes: vec![64], ..PairSpec::default() }, server);
    let cq = std::sync::Arc::clone(s.conn.qp().recv_cq());
    assert!(!readable(&cq, Duration::ZERO), "no event before anything is armed");
    cq.req_notify(true).expect("arm for solicited completions only");
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).wr_id(10)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 10, T).unwrap();
    // The unsolicited message's completion is in the CQ (so the device decided about its event
    // already), and the channel stays quiet.
    reap_recv(s.conn.qp_mut(), 1);
    assert!(!readable(&cq, Duration::ZERO), "an unsolicited completion raised the solicited-only event");
    c.conn.qp_mut().post_send(&[SendWr::send(&c.mrs[0], 0..8).solicited().wr_id(11)]).unwrap();
    c.conn.qp_mut().wait_for(WorkQueue::Send, 11, T).unwrap();
    reap_recv(s.conn.qp_mut(), 2);
    assert!(readable(&cq, T), "the solicited completion raised no event");
    assert_eq!(cq.drain_events().unwrap(), 1, "one event for the one solicited completion");
    drop((c, s, cq));
    t.finish();
}

#[test]
fn cq_moderation_is_set_or_refused_naming_the_capability() {
    let t = DeviceTest::start();
    let ctx = VerbsContext::cm_for_addr(t.addr).unwrap();
    let cq = CompletionQueue::new(&ctx, 16).unwrap();
    match cq.set_moderation(4, 10) {
        Ok(()) => {
            // A moderated CQ still delivers everything to its polls.
            let mut wcs = [WorkCompletion::default(); 1];
            assert_eq!(cq.poll(&mut wcs).unwrap(), 0);
        }
        Err(e @ Error::Unsupported { what: "CQ moderation", .. }) => {
            assert!(e.to_string().contains(&ctx.device_name()), "{e}");
            common::skipped("CQ moderation", &e.to_string());
        }
        Err(e) => panic!("set_moderation: {e}"),
    }
    drop((cq, ctx));
    t.finish();
}
