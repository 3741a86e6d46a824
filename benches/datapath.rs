//! The data path on a connected QP: post plus poll of one signaled send/recv and of one RDMA
//! WRITE, and a ping-pong round trip at 2 B and 4 KiB, each measured as `raw` (ibv_post_* and
//! ibv_poll_cq called directly on the same QP and CQs) beside `rdma_cm` (through the crate).
//! Both ends of the connection are driven from one thread, so each figure is the full cost of
//! the operation through the device, with no thread hand-off.
//!
//! ```text
//! cargo bench --bench datapath
//! ```

mod common;

use std::mem::MaybeUninit;

use common::{criterion, pair, zeroed, PairSpec, Side};
use criterion::{criterion_group, criterion_main, Criterion};
use rdma_cm::ffi;
use rdma_cm::{AccessFlags, QueuePair, RecvWr, RemoteRegion, SendWr, WorkCompletion};

fn connected() -> (Side, Side) {
    let spec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    pair(common::device_addr(), spec.clone(), spec)
}

/// Raw: busy-polls `cq` until one completion arrives.
fn raw_poll1(cq: *mut ffi::ibv_cq) {
    let mut wc = MaybeUninit::<ffi::ibv_wc>::uninit();
    loop {
        // SAFETY: the CQ is alive (held by the QP); `wc` has room for one entry.
        let n = unsafe { ffi::ibv_poll_cq(cq, 1, wc.as_mut_ptr()) };
        if n > 0 {
            // SAFETY: ibv_poll_cq filled the entry.
            assert_eq!(unsafe { wc.assume_init_ref() }.status, ffi::ibv_wc_status::IBV_WC_SUCCESS);
            return;
        }
        assert!(n == 0, "ibv_poll_cq failed");
    }
}

/// Raw: posts one work request on `qp`.
fn raw_send(qp: &QueuePair, mr: &rdma_cm::MemoryRegion, len: u32, op: u32, remote: Option<RemoteRegion>) {
    let mut sge = ffi::ibv_sge { addr: mr.addr(), length: len, lkey: mr.lkey() };
    // SAFETY: ibv_send_wr is plain old data.
    let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    if let Some(r) = remote {
        wr.wr.rdma = ffi::rdma_t { remote_addr: r.addr, rkey: r.rkey };
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: QP alive; wr and sge live for the call; the region outlives the completion,
    // which the caller reaps before the next post.
    assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), &mut wr, &mut bad) }, 0);
}

fn raw_recv(qp: &QueuePair, mr: &rdma_cm::MemoryRegion, len: u32) {
    let mut sge = ffi::ibv_sge { addr: mr.addr(), length: len, lkey: mr.lkey() };
    // SAFETY: ibv_recv_wr is plain old data.
    let mut wr: ffi::ibv_recv_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = std::ptr::null_mut();
    // SAFETY: as in raw_send.
    assert_eq!(unsafe { ffi::ibv_post_recv(qp.as_raw(), &mut wr, &mut bad) }, 0);
}

fn post_poll(c: &mut Criterion) {
    let (mut a, mut b) = connected();
    let remote = b.mrs[0].remote();
    let mut wcs = [WorkCompletion::default(); 1];
    let mut g = c.benchmark_group("post_poll");
    g.bench_function("send/raw", |bn| {
        bn.iter(|| {
            raw_recv(b.conn.qp(), &b.mrs[0], 64);
            raw_send(a.conn.qp(), &a.mrs[0], 64, ffi::ibv_wr_opcode::IBV_WR_SEND, None);
            raw_poll1(a.conn.qp().send_cq().as_raw());
            raw_poll1(b.conn.qp().recv_cq().as_raw());
        })
    });
    g.bench_function("send/rdma_cm", |bn| {
        bn.iter(|| {
            b.conn.qp_mut().post_recv(&[RecvWr::new(&b.mrs[0], 0..64)]).unwrap();
            a.conn.qp_mut().post_send(&[SendWr::send(&a.mrs[0], 0..64)]).unwrap();
            poll_queue(a.conn.qp_mut(), true, &mut wcs);
            poll_queue(b.conn.qp_mut(), false, &mut wcs);
        })
    });
    g.bench_function("write/raw", |bn| {
        bn.iter(|| {
            raw_send(a.conn.qp(), &a.mrs[0], 64, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some(remote));
            raw_poll1(a.conn.qp().send_cq().as_raw());
        })
    });
    g.bench_function("write/rdma_cm", |bn| {
        bn.iter(|| {
            a.conn.qp_mut().post_send(&[SendWr::write(&a.mrs[0], 0..64, &remote, 0).unwrap()]).unwrap();
            poll_queue(a.conn.qp_mut(), true, &mut wcs);
        })
    });
    g.finish();
}

fn pingpong(c: &mut Criterion) {
    let (mut a, mut b) = connected();
    let mut wcs = [WorkCompletion::default(); 1];
    for (name, len) in [("2B", 2usize), ("4KiB", 4096)] {
        let mut g = c.benchmark_group(format!("pingpong/{name}"));
        let send = ffi::ibv_wr_opcode::IBV_WR_SEND;
        g.bench_function("raw", |bn| {
            bn.iter(|| {
                raw_recv(b.conn.qp(), &b.mrs[0], len as u32);
                raw_recv(a.conn.qp(), &a.mrs[0], len as u32);
                raw_send(a.conn.qp(), &a.mrs[0], len as u32, send, None); // ping
                raw_poll1(b.conn.qp().recv_cq().as_raw());
                raw_send(b.conn.qp(), &b.mrs[0], len as u32, send, None); // pong
                raw_poll1(a.conn.qp().recv_cq().as_raw());
                raw_poll1(a.conn.qp().send_cq().as_raw());
                raw_poll1(b.conn.qp().send_cq().as_raw());
            })
        });
        g.bench_function("rdma_cm", |bn| {
            bn.iter(|| {
                b.conn.qp_mut().post_recv(&[RecvWr::new(&b.mrs[0], 0..len)]).unwrap();
                a.conn.qp_mut().post_recv(&[RecvWr::new(&a.mrs[0], 4096..4096 + len)]).unwrap();
                a.conn.qp_mut().post_send(&[SendWr::send(&a.mrs[0], 0..len)]).unwrap(); // ping
                poll_queue(b.conn.qp_mut(), false, &mut wcs);
                b.conn.qp_mut().post_send(&[SendWr::send(&b.mrs[0], 4096..4096 + len)]).unwrap(); // pong
                poll_queue(a.conn.qp_mut(), false, &mut wcs);
                poll_queue(a.conn.qp_mut(), true, &mut wcs);
                poll_queue(b.conn.qp_mut(), true, &mut wcs);
            })
        });
        g.finish();
    }
}

/// Post plus poll on a CQ shared by two QPs (both queues of each on it), through the CQ's own
/// poll: the routing table's cost beside the raw calls on the same QP and CQ.
fn shared_cq(c: &mut Criterion) {
    use rdma_cm::{CompletionQueue, QpInit};
    use std::sync::Arc;
    let ctx = common::route(7909).context().unwrap();
    let cq = CompletionQueue::new(&ctx, 128).unwrap();
    let spec = |init: QpInit| PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        init,
        ..PairSpec::default()
    };
    let shared = || QpInit::new().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
    let (mut a, b) = pair(common::device_addr(), spec(shared()), spec(QpInit::new()));
    let (_other, _other_peer) = pair(common::device_addr(), spec(shared()), spec(QpInit::new()));
    let remote = b.mrs[0].remote();
    let mut wcs = [WorkCompletion::default(); 1];
    let mut g = c.benchmark_group("shared_cq");
    g.bench_function("write/raw", |bn| {
        bn.iter(|| {
            raw_send(a.conn.qp(), &a.mrs[0], 64, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some(remote));
            raw_poll1(cq.as_raw());
        })
    });
    g.bench_function("write/rdma_cm", |bn| {
        bn.iter(|| {
            a.conn.qp_mut().post_send(&[SendWr::write(&a.mrs[0], 0..64, &remote, 0).unwrap()]).unwrap();
            while cq.poll(&mut wcs).unwrap() == 0 {}
            assert!(wcs[0].is_ok(), "{:?}", wcs[0]);
        })
    });
    g.finish();
}

/// Busy-polls one queue of the crate's QP (as the raw version polls one CQ).
fn poll_queue(qp: &mut QueuePair, send: bool, wcs: &mut [WorkCompletion; 1]) {
    let q = if send { rdma_cm::WorkQueue::Send } else { rdma_cm::WorkQueue::Recv };
    while qp.poll_queue(q, wcs).unwrap() == 0 {}
    assert!(wcs[0].is_ok(), "{:?}", wcs[0]);
}

criterion_group! {
    name = benches;
    // The data path's ratios are a few percent: sample longer than the setup groups.
    config = criterion().measurement_time(std::time::Duration::from_secs(6)).sample_size(40);
    targets = post_poll, pingpong, shared_cq
}
criterion_main!(benches);
