//! The rest of the CQ surface on the device: solicited events (a CQ armed for solicited
//! completions only raises its event for a send with the solicited bit, and not for one
//! without), and CQ moderation (`ibv_modify_cq`), set or refused naming the capability. The
//! completions themselves are reaped through lanes (`rdma_cm::verbs::lane`), whose polls never
//! arm the CQ; the arming and the channel are the CQ's own.

mod common;

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::lane::{lane_on, reap};
use common::{pair, DeviceTest, PairSpec, T};
use rdma_cm::verbs::lane::{Completion, Lane, LaneQp, RecvWr, SendWr};
use rdma_cm::{ffi, AccessFlags, CompletionQueue, Error, MemoryRegion, ProtectionDomain, WorkQueue};

/// Whether the CQ's channel descriptor becomes readable within `within`.
fn readable(cq: &CompletionQueue, within: Duration) -> bool {
    let mut p = libc::pollfd { fd: cq.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, for the call.
    let n = unsafe { libc::poll(&mut p, 1, within.as_millis() as libc::c_int) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1
}

/// Reads and acknowledges every event pending on the channel of `cq` (a lane's, whose own
/// `drain_events` refuses it: the lane's waits are its readers, and none runs here); how many.
fn count_events(cq: &CompletionQueue) -> u32 {
    let raw = cq.as_raw();
    let fd = cq.as_raw_fd();
    // SAFETY: `fd` is the open descriptor of the CQ's channel (`cq` lives); F_GETFL and F_SETFL
    // change only its flags. The crate makes it non-blocking itself before its first read.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    assert!(flags >= 0 && unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } == 0, "fcntl");
    let mut n = 0;
    // SAFETY: `raw` is the live CQ `cq` holds, made with a completion channel (its descriptor is
    // the one `readable` polls), now non-blocking: `ibv_get_cq_event` fails with EAGAIN once
    // none is pending instead of blocking. Each event read names this CQ (the channel's only
    // one) and is acknowledged at once, so the CQ's destruction, which waits for every event
    // read to be acknowledged, never waits for these.
    unsafe {
        let channel = (*raw).channel;
        assert!(!channel.is_null(), "the CQ has a completion channel");
        let (mut got, mut ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        while ffi::ibv_get_cq_event(channel, &mut got, &mut ctx) == 0 {
            assert_eq!(got, raw, "an event of another CQ on this channel");
            ffi::ibv_ack_cq_events(got, 1);
            n += 1;
        }
    }
    n
}

/// Polls `lane` (never arming the CQ or reading its channel) until the receive `wr_id` is
/// reaped.
fn reap_recv(lane: &mut Lane, wr_id: u64) -> Completion {
    let end = Instant::now() + T;
    loop {
        if let Some(c) = lane.poll().expect("poll") {
            assert!(c.is_ok() && c.queue() == WorkQueue::Recv && c.wr_id() == wr_id, "{c:?}");
            return c;
        }
        assert!(Instant::now() < end, "receive {wr_id} did not complete within {T:?}");
        std::hint::spin_loop();
    }
}

/// One side of a connected pair: its lane, its QP there, its PD.
type LaneEnd = (Lane, LaneQp, Arc<ProtectionDomain>);

/// A connected pair whose QPs are attached to a lane each: (client, server, the server lane's
/// CQ).
fn lanes(t: &DeviceTest) -> (LaneEnd, LaneEnd, Arc<CompletionQueue>) {
    let (mut la, mut lb) = (lane_on(t.addr, 64), lane_on(t.addr, 64));
    let spec = PairSpec { mr_sizes: vec![], ..PairSpec::default() };
    let (c, s) = pair(t.addr, PairSpec { init: la.qp_init(), ..spec.clone() }, PairSpec { init: lb.qp_init(), ..spec });
    let cq = Arc::clone(s.conn.qp().recv_cq());
    let qa = la.attach(c.conn).map_err(|r| r.into_parts().0).expect("attach (client)");
    let qb = lb.attach(s.conn).map_err(|r| r.into_parts().0).expect("attach (server)");
    ((la, qa, c.pd), (lb, qb, s.pd), cq)
}

#[test]
fn a_cq_armed_for_solicited_events_wakes_for_solicited_sends_only() {
    let t = DeviceTest::start();
    {
        let ((mut la, qa, pda), (mut lb, qb, pdb), cq) = lanes(&t);
        for id in [1, 2] {
            lb.post_recv(qb, RecvWr::new(MemoryRegion::new(&pdb, 32, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(id))
                .unwrap();
        }
        assert!(!readable(&cq, Duration::ZERO), "no event before anything is armed");
        cq.req_notify(true).expect("arm for solicited completions only");
        let msg = MemoryRegion::new(&pda, 8, AccessFlags::empty()).unwrap();
        la.post_send(qa, SendWr::send(msg, 0..8).wr_id(10)).unwrap();
        let mut sent = reap(&mut la, 1).pop().unwrap();
        assert!(sent.is_ok() && sent.wr_id() == 10, "{sent:?}");
        // The unsolicited message's completion is in the CQ (so the device decided about its
        // event already), and the channel stays quiet.
        reap_recv(&mut lb, 1);
        assert!(!readable(&cq, Duration::ZERO), "an unsolicited completion raised the solicited-only event");
        la.post_send(qa, SendWr::send(sent.take_region().unwrap(), 0..8).solicited().wr_id(11)).unwrap();
        let sent = reap(&mut la, 1).pop().unwrap();
        assert!(sent.is_ok() && sent.wr_id() == 11, "{sent:?}");
        reap_recv(&mut lb, 2);
        assert!(readable(&cq, T), "the solicited completion raised no event");
        assert_eq!(count_events(&cq), 1, "one event for the one solicited completion");
        drop((la, lb, cq, pda, pdb));
    }
    t.finish();
}

#[test]
fn cq_moderation_is_set_or_refused_naming_the_capability() {
    let t = DeviceTest::start();
    {
        let ((mut la, qa, pda), (mut lb, qb, pdb), cq) = lanes(&t);
        match cq.set_moderation(4, 10) {
            Ok(()) => {
                // A moderated CQ still delivers everything to the lane's waits.
                lb.post_recv(qb, RecvWr::new(MemoryRegion::new(&pdb, 32, AccessFlags::LOCAL_WRITE).unwrap()).wr_id(1))
                    .unwrap();
                let msg = MemoryRegion::new(&pda, 8, AccessFlags::empty()).unwrap();
                la.post_send(qa, SendWr::send(msg, 0..8).wr_id(2)).unwrap();
                assert!(reap(&mut la, 1)[0].is_ok());
                let got = reap(&mut lb, 1).pop().unwrap();
                assert!(got.is_ok() && got.wr_id() == 1 && got.byte_len() == 8, "{got:?}");
            }
            Err(e @ Error::Unsupported { what: "CQ moderation", .. }) => {
                let name = rdma_cm::VerbsContext::cm_for_addr(t.addr).unwrap().device_name();
                assert!(e.to_string().contains(&name), "{e}");
                common::skipped("CQ moderation", &e.to_string());
            }
            Err(e) => panic!("set_moderation: {e}"),
        }
        drop((la, lb, cq, pda, pdb));
    }
    t.finish();
}
