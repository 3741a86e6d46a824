//! The data path on connected QPs, through the lane (`rdma_cm::verbs::lane`), each row beside
//! `raw` (ibv_post_* and ibv_poll_cq called directly). Both ends of a connection are driven
//! from one thread, so each figure is the full cost of the operation through the device, with
//! no thread hand-off.
//!
//! - `lane/{send,write,write_batch16}`: post plus poll of one signaled send/recv, of one RDMA
//!   WRITE, and of 16 WRITEs under one doorbell, as `lane` (one work request per post) and
//!   `prep` (prepared work requests, each completion re-arming its request), beside `raw`.
//! - `post_poll/write_4sge` (one RDMA WRITE gathered from four 16 B pieces) and
//!   `post_poll/fetch_add` (an atomic fetch-and-add on the peer's REMOTE_ATOMIC region), on a
//!   QP created with `max_send_sge` 4, and `post_poll/ud_send` (one 64-byte datagram, addressed
//!   through the UD connect's address handle, into a receive with room for the GRH), each as
//!   `prep` beside `raw`.
//! - `pingpong/{2B,4KiB}`: a round trip, `prep` beside `raw`.
//! - `shared_cq/write`: one RDMA WRITE on a lane whose CQ serves two QPs, `lane` beside
//!   `raw_on_lane`.
//!
//! `lane/send/raw_on_lane`, `pingpong/{2B,4KiB}/raw_on_lane` and `shared_cq/write/raw_on_lane`
//! make the raw calls on the lane row's own QPs, CQs and regions: the kernel's and the
//! provider's work are then that row's exactly, and the difference is the crate's code.
//!
//! ```text
//! cargo bench --bench datapath
//! cargo bench --bench datapath -- lane/     # the fast path only
//! ```

mod common;

use std::mem::MaybeUninit;

use common::{criterion, pair, raw_write_sg, zeroed, PairSpec, Side};
use criterion::{criterion_group, criterion_main, Criterion};
use rdma_cm::ffi;
use rdma_cm::verbs::lane::{Lane, RecvWr as LRecv, SendWr as LSend};
use rdma_cm::{AccessFlags, MemoryRegion, QueuePair, RemoteRegion};

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

/// Raw, on a QP the crate's lane owns (the `raw_on_lane` rows): posts one signaled send of
/// `len` bytes at `(addr, lkey)`. The caller reaps its completion behind the lane's back.
fn raw_send_on(qp: *mut ffi::ibv_qp, (addr, lkey): (u64, u32), len: u32) {
    let mut sge = ffi::ibv_sge { addr, length: len, lkey };
    // SAFETY: ibv_send_wr is plain old data.
    let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    let mut bad = std::ptr::null_mut();
    // SAFETY: the QP is alive (its lane outlives the group); wr and sge live for the call; the
    // region is held by a prepared request (armed, never posted) until after the group, and the
    // caller reaps the completion before the next post.
    assert_eq!(unsafe { ffi::ibv_post_send(qp, &mut wr, &mut bad) }, 0);
}

/// Raw, on a QP the crate's lane owns: posts one receive of `len` bytes at `(addr, lkey)`.
fn raw_recv_on(qp: *mut ffi::ibv_qp, (addr, lkey): (u64, u32), len: u32) {
    let mut sge = ffi::ibv_sge { addr, length: len, lkey };
    // SAFETY: ibv_recv_wr is plain old data.
    let mut wr: ffi::ibv_recv_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = std::ptr::null_mut();
    // SAFETY: as in raw_send_on.
    assert_eq!(unsafe { ffi::ibv_post_recv(qp, &mut wr, &mut bad) }, 0);
}

/// Raw: posts one signaled fetch-and-add of `add` on the 8 bytes at `remote`'s start, the
/// original value into `mr[at..at + 8]`.
fn raw_fetch_add(qp: &QueuePair, mr: &rdma_cm::MemoryRegion, at: u64, remote: RemoteRegion, add: u64) {
    let mut sge = ffi::ibv_sge { addr: mr.addr() + at, length: 8, lkey: mr.lkey() };
    // SAFETY: ibv_send_wr is plain old data.
    let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.wr.atomic = ffi::atomic_t { remote_addr: remote.addr, compare_add: add, swap: 0, rkey: remote.rkey };
    let mut bad = std::ptr::null_mut();
    // SAFETY: QP alive; wr and sge live for the call; the result range (8 bytes, 8-aligned,
    // inside the region) outlives the completion, which the caller reaps before the next post.
    assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), &mut wr, &mut bad) }, 0);
}

/// A gathered RDMA WRITE (4 x 16 B from one region, 1 KiB apart) and an atomic fetch-and-add,
/// raw beside the crate, on a QP with `max_send_sge` 4 whose peer region allows atomics.
fn post_poll_sg_atomic(c: &mut Criterion) {
    const PIECES: [std::ops::Range<usize>; 4] = [0..16, 1024..1040, 2048..2064, 3072..3088];
    let spec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC,
        init: rdma_cm::QpInit::new().max_send_sge(4),
        ..PairSpec::default()
    };
    let (a, mut b) = pair(common::device_addr(), spec.clone(), spec.clone());
    assert!(a.conn.qp().max_send_sge() >= 4, "QP granted {} send pieces", a.conn.qp().max_send_sge());
    let remote = b.mrs[0].remote();
    // The atomic's target: the peer's first 8 bytes (its region is page-aligned).
    let counter = RemoteRegion { len: 8, ..remote };
    b.mrs[0].write_at(0, &0u64.to_ne_bytes()).unwrap();
    let mut adds = 0u64;
    let mut g = c.benchmark_group("post_poll");
    g.bench_function("write_4sge/raw", |bn| {
        let mr = &a.mrs[0];
        let mut sges = PIECES.map(|r| ffi::ibv_sge { addr: mr.addr() + r.start as u64, length: 16, lkey: mr.lkey() });
        bn.iter(|| {
            raw_write_sg(a.conn.qp(), &mut sges, RemoteRegion { addr: remote.addr + 4096, ..remote });
            raw_poll1(a.conn.qp().send_cq().as_raw());
        })
    });
    g.bench_function("fetch_add/raw", |bn| {
        bn.iter(|| {
            raw_fetch_add(a.conn.qp(), &a.mrs[0], 4096, counter, 1);
            raw_poll1(a.conn.qp().send_cq().as_raw());
            adds += 1;
        })
    });
    // The fast path's twins: the same two through prepared work requests on lanes (each
    // checked and lowered once; each completion's region re-arms its request).
    let (mut la, mut lb) = common::lane::lane_pair(common::device_addr(), spec.clone(), spec, 64);
    let lremote = lb.mrs[0].remote();
    lb.mrs[0].write_at(0, &0u64.to_ne_bytes()).unwrap();
    let mut two = la.mrs.remove(0).split(4096).unwrap().into_iter();
    let mut pieces =
        la.lane.prepare_send(la.qp, LSend::write_sg(two.next().unwrap(), &PIECES, &lremote, 4096)).unwrap();
    let lcounter = RemoteRegion { len: 8, ..lremote };
    let mut fadd = la.lane.prepare_send(la.qp, LSend::fetch_add(two.next().unwrap(), 0, &lcounter, 0, 1)).unwrap();
    let mut ladds = 0u64;
    g.bench_function("write_4sge/prep", |bn| {
        bn.iter(|| {
            la.lane.post_prepared(&mut pieces).unwrap();
            reap_prep(&mut la.lane, 1, |_, r| pieces.rearm(r).unwrap());
        })
    });
    g.bench_function("fetch_add/prep", |bn| {
        bn.iter(|| {
            la.lane.post_prepared(&mut fadd).unwrap();
            reap_prep(&mut la.lane, 1, |_, r| fadd.rearm(r).unwrap());
            ladds += 1;
        })
    });
    g.finish();
    // Every add landed: the peer's counter is the number of iterations run, on both paths.
    let mut v = [0u8; 8];
    b.mrs[0].read_at(0, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), adds, "fetch-and-add count on the peer");
    lb.mrs[0].read_at(0, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), ladds, "fetch-and-add count on the lane's peer");
}

/// Busy-polls a lane until `n` completions came back, each successful, each region re-arming
/// `rearm`'s pick (by `wr_id`). It asks for one completion per poll and checks only the
/// status, as `raw_poll1` does: the raw twin's own loop, so the rows differ by the crate alone
/// (a check that formats the whole completion keeps it in memory, which cost 0.13 µs of
/// `lane/send` in instruction-counted time). Inlined into the row, as `raw_poll1` is into the
/// raw rows: out of line, its calls (a frame, six saved registers) cost the ping-pong about 50
/// instructions per round trip that are the bench's, not the crate's.
#[inline(always)]
fn reap_prep(lane: &mut Lane, n: usize, mut rearm: impl FnMut(u64, MemoryRegion)) {
    let mut got = 0;
    while got < n {
        got += lane
            .poll_with(1, |c, region| {
                assert!(c.is_ok(), "completion failed: {:?}", c.status());
                if let Some(r) = region {
                    rearm(c.wr_id(), r);
                }
            })
            .unwrap();
    }
}

fn pingpong(c: &mut Criterion) {
    let (a, b) = connected();
    // The fast path's twin: each side's QP on a lane of its own, a prepared receive and send
    // per side (wr_id 0 the receive, 1 the send), each completion re-arming its request.
    let spec = PairSpec { mr_sizes: vec![], ..PairSpec::default() };
    let (mut la, mut lb) = common::lane::lane_pair(common::device_addr(), spec.clone(), spec, 64);
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
        let (pa, pb) = (la.pd.clone(), lb.pd.clone());
        let region = |pd| MemoryRegion::new(pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut arecv = la.lane.prepare_recv(la.qp, LRecv::range(region(&pa), 0..len).wr_id(0)).unwrap();
        let mut asend = la.lane.prepare_send(la.qp, LSend::send(region(&pa), 0..len).wr_id(1)).unwrap();
        let mut brecv = lb.lane.prepare_recv(lb.qp, LRecv::range(region(&pb), 0..len).wr_id(0)).unwrap();
        let mut bsend = lb.lane.prepare_send(lb.qp, LSend::send(region(&pb), 0..len).wr_id(1)).unwrap();
        g.bench_function("prep", |bn| {
            bn.iter(|| {
                lb.lane.post_prepared_recv(&mut brecv).unwrap();
                la.lane.post_prepared_recv(&mut arecv).unwrap();
                la.lane.post_prepared(&mut asend).unwrap(); // ping
                reap_prep(&mut lb.lane, 1, |_, r| brecv.rearm(r).unwrap());
                // The pong; then the ping's send and the pong's receive, in either order.
                lb.lane.post_prepared(&mut bsend).unwrap();
                reap_prep(&mut la.lane, 2, |k, r| if k == 0 { arecv.rearm(r) } else { asend.rearm(r) }.unwrap());
                reap_prep(&mut lb.lane, 1, |_, r| bsend.rearm(r).unwrap());
            })
        });
        // The raw calls on the prep row's own QPs, CQs (one per lane) and regions, the lanes
        // never seeing these completions: the kernel's and the provider's work as in `prep`.
        let (qa, qb) = (la.lane.qp_as_raw(la.qp).unwrap(), lb.lane.qp_as_raw(lb.qp).unwrap());
        // SAFETY: both QPs are alive (owned by their lanes, which outlive this group); an
        // `ibv_qp`'s CQ fields are set by the provider at creation and never change.
        let (cqa, cqb) = unsafe { ((*qa).send_cq, (*qb).send_cq) };
        let at = |r: Option<&MemoryRegion>| r.map(|r| (r.addr(), r.lkey())).unwrap();
        let (ar, as_, br, bs) = (at(arecv.region()), at(asend.region()), at(brecv.region()), at(bsend.region()));
        let n = len as u32;
        g.bench_function("raw_on_lane", |bn| {
            bn.iter(|| {
                raw_recv_on(qb, br, n);
                raw_recv_on(qa, ar, n);
                raw_send_on(qa, as_, n); // ping
                raw_poll1(cqb);
                raw_send_on(qb, bs, n); // pong
                raw_poll1(cqa); // the ping's send and the pong's receive, in either order
                raw_poll1(cqa);
                raw_poll1(cqb);
            })
        });
        g.finish();
    }
}

/// Post plus poll of one RDMA WRITE on a lane whose CQ serves two QPs (both queues of each):
/// the lane's lookup of the completion's QP beside the raw calls on the same QP and CQ.
fn shared_cq(c: &mut Criterion) {
    let spec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let mut lane = common::lane::lane_on(common::device_addr(), 128);
    let (qp, pd, b) = common::lane::attached_pair(&mut lane, common::device_addr(), spec.clone());
    let (_other, _other_pd, _other_peer) = common::lane::attached_pair(&mut lane, common::device_addr(), spec);
    let remote = b.mrs[0].remote();
    let mut mr = [Some(MemoryRegion::new(&pd, 8192, AccessFlags::LOCAL_WRITE).unwrap())];
    let mut g = c.benchmark_group("shared_cq");
    g.bench_function("write/lane", |bn| {
        bn.iter(|| {
            lane.post_send(qp, LSend::write(mr[0].take().unwrap(), 0..64, &remote, 0)).unwrap();
            reap_prep(&mut lane, 1, |_, r| mr[0] = Some(r));
        })
    });
    // The raw calls on the lane's QP and CQ (polled behind the lane, which never sees these
    // completions), from the same region.
    let qp_raw = lane.qp_as_raw(qp).unwrap();
    // SAFETY: the QP is alive (owned by the lane, which outlives this group); an `ibv_qp`'s CQ
    // fields are set by the provider at creation and never change.
    let cq = unsafe { (*qp_raw).send_cq };
    let (addr, lkey) = mr[0].as_ref().map(|m| (m.addr(), m.lkey())).unwrap();
    g.bench_function("write/raw_on_lane", |bn| {
        bn.iter(|| {
            let mut sge = ffi::ibv_sge { addr, length: 64, lkey };
            // SAFETY: ibv_send_wr is plain old data.
            let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr, rkey: remote.rkey };
            let mut bad = std::ptr::null_mut();
            // SAFETY: the QP is alive; wr and sge live for the call; the region is held in
            // `mr` until after the group, and the completion is reaped before the next post.
            assert_eq!(unsafe { ffi::ibv_post_send(qp_raw, &mut wr, &mut bad) }, 0);
            raw_poll1(cq);
        })
    });
    g.finish();
}

/// UD: post a receive (room for the GRH) on one end, a 64-byte datagram to it from the other
/// (raw: the work request's `ud` fields from the UD connect's destination), poll both.
fn ud_post_poll(c: &mut Criterion) {
    use rdma_cm::verbs::ah::GRH_LEN;
    use rdma_cm::QpInit;
    let common::ud::UdPair { client, to_server, server } =
        common::ud::ud_pair(common::device_addr(), 7490, QpInit::new());
    let sbuf = rdma_cm::MemoryRegion::new(client.qp().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
    let rbuf = rdma_cm::MemoryRegion::new(server.qp().pd(), GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut g = c.benchmark_group("post_poll");
    g.bench_function("ud_send/raw", |bn| {
        let (cqp, sqp) = (client.qp().as_raw(), server.qp().as_raw());
        let (scq, rcq) = (client.qp().send_cq().as_raw(), server.qp().recv_cq().as_raw());
        bn.iter(|| {
            let mut rsge = ffi::ibv_sge { addr: rbuf.addr(), length: (GRH_LEN + 64) as u32, lkey: rbuf.lkey() };
            // SAFETY: ibv_recv_wr is plain old data.
            let mut rwr: ffi::ibv_recv_wr = unsafe { zeroed() };
            rwr.sg_list = &mut rsge;
            rwr.num_sge = 1;
            let mut bad_r = std::ptr::null_mut();
            // SAFETY: the server's QP is alive; rwr and rsge live for the call; the region
            // outlives the completion, which this iteration reaps.
            assert_eq!(unsafe { ffi::ibv_post_recv(sqp, &mut rwr, &mut bad_r) }, 0);
            let mut sge = ffi::ibv_sge { addr: sbuf.addr(), length: 64, lkey: sbuf.lkey() };
            // SAFETY: ibv_send_wr is plain old data.
            let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.wr.ud =
                ffi::ud_t { ah: to_server.ah().as_raw(), remote_qpn: to_server.qpn(), remote_qkey: to_server.qkey() };
            let mut bad = std::ptr::null_mut();
            // SAFETY: as above, for the client's QP; the address handle is held by `to_server`,
            // which outlives the group.
            assert_eq!(unsafe { ffi::ibv_post_send(cqp, &mut wr, &mut bad) }, 0);
            raw_poll1(scq);
            raw_poll1(rcq);
        })
    });
    // The fast path's twin: a UD pair on lanes, through prepared work requests.
    let common::lane::LaneUdPair { client: mut lc, to_server: lto, server_dest: _d, server: mut ls } =
        common::lane::lane_ud_pair(common::device_addr(), 7495, QpInit::new(), 64);
    let lsbuf = MemoryRegion::new(&lc.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    let lrbuf = MemoryRegion::new(&ls.pd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut send = lc.lane.prepare_send(lc.qp, LSend::send(lsbuf, 0..64).to(lto)).unwrap();
    let mut recv = ls.lane.prepare_recv(ls.qp, LRecv::range(lrbuf, 0..GRH_LEN + 64)).unwrap();
    g.bench_function("ud_send/prep", |bn| {
        bn.iter(|| {
            ls.lane.post_prepared_recv(&mut recv).unwrap();
            lc.lane.post_prepared(&mut send).unwrap();
            reap_prep(&mut lc.lane, 1, |_, r| send.rearm(r).unwrap());
            reap_prep(&mut ls.lane, 1, |_, r| recv.rearm(r).unwrap());
        })
    });
    g.finish();
}

/// The fast path (`rdma_cm::verbs::lane`): post plus poll of one send/recv and of one RDMA WRITE, and
/// a batch of 16 WRITEs under one doorbell (the last one signaled, one poll reaping them), each
/// beside the raw calls on the same lane's QPs and CQs.
fn lane_post_poll(c: &mut Criterion) {
    use common::lane::lane_pair;
    const BATCH: usize = 16;
    let spec = PairSpec {
        mr_sizes: vec![8192, 8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ..PairSpec::default()
    };
    let (mut a, mut b) = lane_pair(common::device_addr(), spec.clone(), spec, 64);
    let remote = b.mrs[0].remote();
    // Busy-polls a lane until `n` completions came back, each region into its place.
    fn reap(lane: &mut Lane, mrs: &mut [Option<MemoryRegion>], n: usize) {
        let mut got = 0;
        while got < n {
            got += lane
                .poll_with(n - got, |c, region| {
                    assert!(c.is_ok(), "{c:?}");
                    let k = c.wr_id() as usize;
                    mrs[k] = region;
                })
                .unwrap();
        }
    }
    // Raw calls on the lane's QPs: the raw QP and CQ handles are the lane's.
    let (qa, qb) = (a.lane.qp_num(a.qp).unwrap(), b.lane.qp_num(b.qp).unwrap());
    assert_ne!(qa, qb);
    let mut sa: Vec<Option<MemoryRegion>> =
        a.mrs.remove(1).split(8192 / BATCH).unwrap().into_iter().map(Some).collect();
    let mut rb: Vec<Option<MemoryRegion>> = vec![Some(b.mrs.remove(1))];
    let mut g = c.benchmark_group("lane");
    g.bench_function("send/lane", |bn| {
        bn.iter(|| {
            b.lane.post_recv(b.qp, LRecv::range(rb[0].take().unwrap(), 0..64)).unwrap();
            a.lane.post_send(a.qp, LSend::send(sa[0].take().unwrap(), 0..64)).unwrap();
            reap(&mut a.lane, &mut sa, 1);
            reap(&mut b.lane, &mut rb, 1);
        })
    });
    g.bench_function("write/lane", |bn| {
        bn.iter(|| {
            a.lane.post_send(a.qp, LSend::write(sa[0].take().unwrap(), 0..64, &remote, 0)).unwrap();
            reap(&mut a.lane, &mut sa, 1);
        })
    });
    g.bench_function("write_batch16/lane", |bn| {
        bn.iter(|| {
            let wrs = sa.iter_mut().enumerate().filter_map(|(k, m)| {
                let w = LSend::write(m.take()?, 0..64, &remote, 0).wr_id(k as u64);
                Some(if k + 1 < BATCH { w.unsignaled() } else { w })
            });
            assert_eq!(a.lane.post_send_iter(a.qp, wrs).unwrap(), BATCH);
            reap(&mut a.lane, &mut sa, BATCH);
        })
    });
    // The same three through prepared work requests (checked and lowered once, before the
    // loop; each completion's region re-arms its request): the lane's fastest path.
    let mut two = a.mrs.remove(0).split(4096).unwrap().into_iter();
    let mut psend = a.lane.prepare_send(a.qp, LSend::send(two.next().unwrap(), 0..64)).unwrap();
    let mut pwrite = a.lane.prepare_send(a.qp, LSend::write(two.next().unwrap(), 0..64, &remote, 0)).unwrap();
    // The batch: the sixteen WRITEs over one region (a `PreparedBatch`), one completion.
    let whole = MemoryRegion::new(&a.pd, 8192, AccessFlags::LOCAL_WRITE).unwrap();
    let mut pbatch = a.lane.prepare_batch(a.qp, whole, BATCH, |_, mr| LSend::write(mr, 0..64, &remote, 0)).unwrap();
    let mut precv = b.lane.prepare_recv(b.qp, LRecv::range(rb[0].take().unwrap(), 0..64)).unwrap();
    g.bench_function("send/prep", |bn| {
        bn.iter(|| {
            b.lane.post_prepared_recv(&mut precv).unwrap();
            a.lane.post_prepared(&mut psend).unwrap();
            reap_prep(&mut a.lane, 1, |_, r| psend.rearm(r).unwrap());
            reap_prep(&mut b.lane, 1, |_, r| precv.rearm(r).unwrap());
        })
    });
    g.bench_function("write/prep", |bn| {
        bn.iter(|| {
            a.lane.post_prepared(&mut pwrite).unwrap();
            reap_prep(&mut a.lane, 1, |_, r| pwrite.rearm(r).unwrap());
        })
    });
    g.bench_function("write_batch16/prep", |bn| {
        bn.iter(|| {
            a.lane.post_batch(&mut pbatch).unwrap();
            reap_prep(&mut a.lane, 1, |_, r| pbatch.rearm(r).unwrap());
        })
    });
    // The raw calls on the lane's own QPs, CQ and the prepared send/recv's regions (polled
    // here, behind the lane, which never sees these completions): the kernel's and the
    // provider's work exactly as in `send/prep`, so what that row costs beyond this one is
    // the crate's user-space code.
    let (qa_raw, qb_raw) = (a.lane.qp_as_raw(a.qp).unwrap(), b.lane.qp_as_raw(b.qp).unwrap());
    // SAFETY: both QPs are alive (owned by their lanes, which outlive this group); an
    // `ibv_qp`'s CQ fields are set by the provider at creation and never change.
    let (scq, rcq) = unsafe { ((*qa_raw).send_cq, (*qb_raw).recv_cq) };
    let (sreg, rreg) = (psend.region().unwrap(), precv.region().unwrap());
    let (ssge, rsge) = ((sreg.addr(), sreg.lkey()), (rreg.addr(), rreg.lkey()));
    g.bench_function("send/raw_on_lane", |bn| {
        bn.iter(|| {
            raw_recv_on(qb_raw, rsge, 64);
            raw_send_on(qa_raw, ssge, 64);
            raw_poll1(scq);
            raw_poll1(rcq);
        })
    });
    g.finish();
    // The raw twins run on QPs of the convenient path (a lane's CQ is polled by the lane only).
    let (ra, rb2) = connected();
    let remote2 = rb2.mrs[0].remote();
    let mut g = c.benchmark_group("lane");
    g.bench_function("write/raw", |bn| {
        bn.iter(|| {
            raw_send(ra.conn.qp(), &ra.mrs[0], 64, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some(remote2));
            raw_poll1(ra.conn.qp().send_cq().as_raw());
        })
    });
    g.bench_function("write_batch16/raw", |bn| {
        bn.iter(|| {
            let mr = &ra.mrs[0];
            let mut sge = ffi::ibv_sge { addr: mr.addr(), length: 64, lkey: mr.lkey() };
            // SAFETY: ibv_send_wr is plain old data.
            let mut wrs: [ffi::ibv_send_wr; BATCH] = unsafe { zeroed() };
            let base = wrs.as_mut_ptr();
            for (k, wr) in wrs.iter_mut().enumerate() {
                wr.wr_id = k as u64;
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.send_flags = if k + 1 == BATCH { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
                wr.wr.rdma = ffi::rdma_t { remote_addr: remote2.addr, rkey: remote2.rkey };
                wr.next = if k + 1 < BATCH { base.wrapping_add(k + 1) } else { std::ptr::null_mut() };
            }
            let mut bad = std::ptr::null_mut();
            // SAFETY: QP alive (16 deep); the list and sge live for the call; the region
            // outlives the completions, reaped below.
            assert_eq!(unsafe { ffi::ibv_post_send(ra.conn.qp().as_raw(), base, &mut bad) }, 0);
            raw_poll1(ra.conn.qp().send_cq().as_raw());
        })
    });
    g.bench_function("send/raw", |bn| {
        bn.iter(|| {
            raw_recv(rb2.conn.qp(), &rb2.mrs[0], 64);
            raw_send(ra.conn.qp(), &ra.mrs[0], 64, ffi::ibv_wr_opcode::IBV_WR_SEND, None);
            raw_poll1(ra.conn.qp().send_cq().as_raw());
            raw_poll1(rb2.conn.qp().recv_cq().as_raw());
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    // The data path's ratios are a few percent: sample longer than the setup groups.
    config = criterion().measurement_time(std::time::Duration::from_secs(6)).sample_size(40);
    targets = post_poll_sg_atomic, ud_post_poll, pingpong, shared_cq, lane_post_poll
}
criterion_main!(benches);
