//! The extended verbs on the device: batches posted through
//! `ibv_wr_start … ibv_wr_complete` on a QP made with `ibv_create_qp_ex`, and completions read
//! through `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` on a CQ made with
//! `ibv_create_cq_ex`. Every operation byte-exact, several work requests under one doorbell,
//! abort on drop, refused work requests, and the attempts to break the soundness model with
//! safe code (reading a region the device may still write, dropping a region mid-batch,
//! forgetting a batch, a shared CQ, a bad rkey), each kept as a test. Every test name contains
//! `extended`.
//!
//! Most pairs are verbs-only (`UnconnectedQp`), so that their CQs can be made extended before
//! the QPs; one pair goes through the connection manager (`rdma_create_qp_ex`).

mod common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use common::{out_of_reach, pair, pattern, DeviceTest, PairSpec, T};
use rdma_cm::{
    devices, AccessFlags, CompletionQueue, Error, ExtendedCompletion, GidType, MemoryRegion, ProtectionDomain, QpInit,
    QueuePair, RcParams, RecvWr, SendOps, SendWr, UnconnectedQp, VerbsContext, WcOpcode, WcStatus, WorkQueue,
};

/// The device's context and the index of the RoCE v2 GID of its IPv4 address; `None` after a
/// `skipped:` line where the device has no extended CQ (Soft-iWARP: asked before the GID, which
/// an iWARP device does not address its QPs by).
fn open(addr: IpAddr) -> Option<(VerbsContext, u8)> {
    let name =
        devices().expect("ibv_get_device_list").into_iter().next().expect("a device (this is a device test)").name;
    let ctx = VerbsContext::open(&name).expect("ibv_open_device");
    drop(extended_cq(&ctx, 1)?);
    let entry = ctx
        .gid_table(1)
        .expect("gid table")
        .into_iter()
        .find(|e| e.gid.ipv4().map(IpAddr::V4) == Some(addr) && e.gid_type == GidType::RoceV2)
        .unwrap_or_else(|| panic!("no RoCE v2 GID of {addr} on port 1"));
    Some((ctx, u8::try_from(entry.index).expect("a GID index under 256")))
}

/// An extended CQ, or `None` after a `skipped:` line where the provider has none.
fn extended_cq(ctx: &VerbsContext, depth: u32) -> Option<Arc<CompletionQueue>> {
    match CompletionQueue::new_extended(ctx, depth, false) {
        Ok(cq) => Some(cq),
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped("extended CQs", &e.to_string());
            None
        }
        Err(e) => panic!("ibv_create_cq_ex: {e}"),
    }
}

/// Two verbs-only QPs made with `init` on `pd` and connected to each other; `None` after a
/// `skipped:` line where the provider has no extended QP.
fn connected(pd: &Arc<ProtectionDomain>, gidx: u8, init: QpInit) -> Option<(QueuePair, QueuePair)> {
    let params = RcParams::new().gid_index(gidx).access(
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
    );
    let a = match UnconnectedQp::new(pd, init.clone(), params.clone()) {
        Ok(a) => a,
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped("extended QPs", &e.to_string());
            return None;
        }
        Err(e) => panic!("create extended QP: {e}"),
    };
    let b = UnconnectedQp::new(pd, init, params).expect("the second extended QP");
    let (ia, ib) = (a.local(), b.local());
    Some((a.connect(&ib).expect("connect a"), b.connect(&ia).expect("connect b")))
}

/// A pair on one private extended CQ per QP (send and receive share it).
fn private_pair(pd: &Arc<ProtectionDomain>, gidx: u8, ops: SendOps) -> Option<(QueuePair, QueuePair)> {
    let ctx = pd.context();
    let (ca, cb) = (extended_cq(ctx, 64)?, extended_cq(ctx, 64)?);
    let a = QpInit::new().extended_ops(ops).max_send_sge(2).send_cq(Arc::clone(&ca)).recv_cq(ca);
    let b_init = QpInit::new().extended_ops(ops).max_send_sge(2).send_cq(Arc::clone(&cb)).recv_cq(cb);
    // Both QPs of `connected` take one init: make b's by hand when they differ.
    let params = RcParams::new().gid_index(gidx).access(
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC,
    );
    let ua = match UnconnectedQp::new(pd, a, params.clone()) {
        Ok(q) => q,
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped("extended QPs", &e.to_string());
            return None;
        }
        Err(e) => panic!("create extended QP: {e}"),
    };
    let ub = UnconnectedQp::new(pd, b_init, params).expect("the second extended QP");
    let (ia, ib) = (ua.local(), ub.local());
    Some((ua.connect(&ib).expect("connect a"), ub.connect(&ia).expect("connect b")))
}

/// Whether the device makes extended QPs (prints the `skipped:` line when not).
fn extended_qps_offered(addr: IpAddr) -> bool {
    let Some((ctx, gidx)) = open(addr) else { return false };
    let pd = ProtectionDomain::new(&ctx).unwrap();
    match UnconnectedQp::new(&pd, QpInit::new().extended_ops(SendOps::STANDARD), RcParams::new().gid_index(gidx)) {
        Ok(_) => true,
        Err(e @ Error::Unsupported { .. }) => {
            common::skipped("extended QPs", &e.to_string());
            false
        }
        Err(e) => panic!("create an extended QP: {e}"),
    }
}

/// Polls `cq` with the extended poll until `n` completions came (or fails after `T`).
fn reap(cq: &CompletionQueue, n: usize) -> Vec<ExtendedCompletion> {
    let deadline = Instant::now() + T;
    let mut got = Vec::new();
    let mut out = [ExtendedCompletion::default(); 4];
    while got.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n} completions within {T:?}: {got:?}", got.len());
        let k = cq.poll_extended(&mut out).expect("poll_extended");
        got.extend_from_slice(&out[..k]);
    }
    got
}

/// A region only this side's device writes (a READ target): readable from Rust whenever no
/// work request holds it.
fn local(pd: &Arc<ProtectionDomain>, len: usize) -> MemoryRegion {
    MemoryRegion::new(pd, len, AccessFlags::LOCAL_WRITE).expect("register")
}

/// A region the peer may write, read and update atomically.
/// One extended CQ of 256 on the device at `addr`, its PD, and QP capabilities that put both
/// queues of a QP on it (`None`, with the `skipped:` line, where the device lacks something).
fn on_one_extended_cq(addr: IpAddr) -> Option<(Arc<ProtectionDomain>, u8, Arc<CompletionQueue>, QpInit)> {
    let (ctx, gidx) = open(addr)?;
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let shared = extended_cq(&ctx, 256)?;
    let init = QpInit::new().extended().send_cq(Arc::clone(&shared)).recv_cq(Arc::clone(&shared));
    Some((pd, gidx, shared, init))
}

fn regions(pd: &Arc<ProtectionDomain>, len: usize) -> MemoryRegion {
    let all =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    MemoryRegion::new(pd, len, all).expect("register")
}

/// One batch of every operation but the atomics, under one doorbell: WRITE (unsignaled),
/// WRITE with immediate data, a send, an inline send, a send with immediate data, a gathered
/// send and a READ; every byte lands where it should and every completion comes through the
/// extended poll, with its opcode, length and immediate data.
#[test]
fn extended_batch_of_every_operation_is_byte_exact() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, mut b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        assert_eq!(a.send_ops(), SendOps::all());
        let mut src = regions(&pd, 4096);
        let mut dst = regions(&pd, 4096);
        let mut rx = regions(&pd, 4096);
        rx.write_at(0, &[0; 4096]).unwrap();
        let mut back = local(&pd, 4096);
        let data = pattern(4096, 1);
        src.write_at(0, &data).unwrap();
        let peer = pattern(4096, 2);
        dst.write_at(0, &peer).unwrap();
        // Five receives at b: the WRITE with immediate data, the send, the inline send, the
        // send with immediate data, the gathered send.
        for i in 0..5u64 {
            let at = i as usize * 512;
            b.post_recv(&[RecvWr::new(&rx, at..at + 512).wr_id(100 + i)]).unwrap();
        }
        let remote = dst.remote();
        // Pieces of equal length: rxe's ibv_wr_set_sge_list (rdma-core up to its fix in PR 1744)
        // counts a list's length as the first piece's times their number.
        let gather = [(&src, 3000..3015), (&src, 3500..3515)];
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::write(&src, 0..256, &remote, 0).unwrap().wr_id(1).unsignaled()).unwrap();
        batch.add(&SendWr::write(&src, 256..512, &remote, 256).unwrap().imm(0xfeed).wr_id(2)).unwrap();
        batch.add(&SendWr::send(&src, 512..576).wr_id(3)).unwrap();
        batch.add(&SendWr::send_inline(b"inline bytes").wr_id(4)).unwrap();
        batch.add(&SendWr::send(&src, 600..700).imm(0xbeef).wr_id(5)).unwrap();
        batch.add(&SendWr::send_sg(&gather).unwrap().wr_id(6)).unwrap();
        batch.add(&SendWr::read(&back, 0..1024, &remote, 1024).unwrap().wr_id(7)).unwrap();
        assert_eq!(batch.len(), 7);
        batch.complete().expect("ibv_wr_complete");
        // Six signaled send completions on a's CQ, in order; the unsignaled WRITE retired
        // with the first.
        let sends = reap(a.send_cq(), 6);
        let ids: Vec<u64> = sends.iter().map(|c| c.wr_id()).collect();
        assert_eq!(ids, [2, 3, 4, 5, 6, 7]);
        assert!(sends.iter().all(|c| c.is_ok() && c.qp_num() == a.qp_num()), "{sends:?}");
        assert_eq!(sends[5].opcode(), Some(WcOpcode::RdmaRead));
        assert_eq!(sends[5].byte_len(), 1024);
        assert_eq!(a.outstanding_sends(), 0, "every slot retired, the unsignaled WRITE's too");
        let recvs = reap(b.recv_cq(), 5);
        let by_id = |id: u64| recvs.iter().find(|c| c.wr_id() == id).unwrap_or_else(|| panic!("receive {id}"));
        assert_eq!(by_id(100).opcode(), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(by_id(100).imm_data(), Some(0xfeed));
        assert_eq!(by_id(101).byte_len(), 64);
        assert_eq!(by_id(102).byte_len(), 12);
        assert_eq!(by_id(103).imm_data(), Some(0xbeef));
        assert_eq!(by_id(103).byte_len(), 100);
        assert_eq!(by_id(104).byte_len(), 30);
        let mut got = vec![0; 4096];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..512], &data[..512], "both WRITEs landed byte for byte");
        assert_eq!(&got[512..], &peer[512..], "nothing else of the peer's region changed");
        rx.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..256], &[0u8; 256][..], "a WRITE with immediate data puts nothing in the receive buffer");
        assert_eq!(&got[512..576], &data[512..576]);
        assert_eq!(&got[1024..1036], b"inline bytes");
        assert_eq!(&got[1536..1636], &data[600..700]);
        assert_eq!(&got[2048..2063], &data[3000..3015]);
        assert_eq!(&got[2063..2078], &data[3500..3515]);
        back.read_at(0, &mut got[..1024]).unwrap();
        assert_eq!(&got[..1024], &peer[1024..2048], "the READ brought the peer's bytes");
        drop((a, b));
    })();
    t.finish();
}

/// Fetch-and-add and compare-and-swap through a batch: the peer's integers change as asked,
/// and the original values land in the local 8-byte ranges.
#[test]
fn extended_atomics_are_exact() {
    if !common::require(common::Cap::Atomics) {
        return;
    }
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut target = regions(&pd, 64);
        target.write_at(0, &40u64.to_ne_bytes()).unwrap();
        target.write_at(8, &7u64.to_ne_bytes()).unwrap();
        let mut old = local(&pd, 64);
        let remote = target.remote();
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::fetch_add(&old, 0..8, &remote, 0, 2).unwrap().wr_id(1)).unwrap();
        batch.add(&SendWr::compare_swap(&old, 8..16, &remote, 8, 7, 99).unwrap().wr_id(2)).unwrap();
        batch.add(&SendWr::compare_swap(&old, 16..24, &remote, 8, 7, 5).unwrap().wr_id(3)).unwrap();
        batch.complete().unwrap();
        let wcs = reap(a.send_cq(), 3);
        assert!(wcs.iter().all(|c| c.is_ok()), "{wcs:?}");
        assert_eq!(wcs[0].opcode(), Some(WcOpcode::FetchAdd));
        assert_eq!(wcs[1].opcode(), Some(WcOpcode::CompSwap));
        let mut w = [0u8; 8];
        let mut at = |mr: &mut MemoryRegion, off| {
            mr.read_at(off, &mut w).unwrap();
            u64::from_ne_bytes(w)
        };
        assert_eq!(at(&mut old, 0), 40, "fetch-and-add returns the value before");
        assert_eq!(at(&mut target, 0), 42);
        assert_eq!(at(&mut old, 8), 7, "the first swap matched");
        assert_eq!(at(&mut old, 16), 99, "the second did not, and returned the swapped value");
        assert_eq!(at(&mut target, 8), 99);
        drop((a, b));
    })();
    t.finish();
}

/// Through the connection manager: a QP made by `rdma_create_qp_ex` takes a batch of sends and
/// WRITEs under one doorbell; the classic waits reap its completions (its CQs are classic).
#[test]
fn extended_batch_through_the_connection_manager() {
    let t = DeviceTest::start();
    (|| {
        let spec = PairSpec {
            mr_sizes: vec![8192],
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            init: QpInit::new().extended_ops(SendOps::STANDARD),
            pre_recv: vec![(10, 1024), (11, 1024)],
            ..PairSpec::default()
        };
        let client = PairSpec { pre_recv: vec![], ..spec.clone() };
        if !extended_qps_offered(t.addr) {
            return;
        }
        let (mut c, mut s) = pair(t.addr, client, spec);
        assert_eq!(c.conn.qp().send_ops(), SendOps::STANDARD);
        let data = pattern(8192, 5);
        c.mrs[0].write_at(0, &data).unwrap();
        let remote = s.mrs[0].remote();
        let qp = c.conn.qp_mut();
        let mut batch = qp.start_batch().unwrap();
        for i in 0..4u64 {
            let at = 2048 + i as usize * 1024;
            batch.add(&SendWr::write(&c.mrs[0], at..at + 1024, &remote, at as u64).unwrap().unsignaled()).unwrap();
        }
        batch.add(&SendWr::send(&c.mrs[0], 0..1000).wr_id(20)).unwrap();
        batch.add(&SendWr::send(&c.mrs[0], 1000..2000).wr_id(21)).unwrap();
        batch.complete().unwrap();
        qp.wait_for(WorkQueue::Send, 21, T).expect("the batch's last send completes").ok().unwrap();
        assert_eq!(qp.outstanding_sends(), 0);
        let sq = s.conn.qp_mut();
        assert_eq!(sq.wait_for(WorkQueue::Recv, 10, T).unwrap().byte_len(), 1000);
        assert_eq!(sq.wait_for(WorkQueue::Recv, 11, T).unwrap().byte_len(), 1000);
        let mut got = vec![0; 8192];
        s.mrs[0].read_at(0, &mut got).unwrap();
        // Both receives were posted at offset 0 (PairSpec::pre_recv): the second send is there.
        assert_eq!(&got[..1000], &data[1000..2000]);
        assert_eq!(&got[2048..6144], &data[2048..6144], "the four WRITEs landed byte for byte");
        assert!(got[6144..].iter().all(|&x| x == 0), "and nothing after them");
        drop((c, s));
    })();
    t.finish();
}

/// A batch dropped without `complete` is aborted: nothing reaches the device, the regions its
/// work requests named are released at once, and the next batch posts normally (the provider's
/// queue was not left locked).
#[test]
fn extended_batch_dropped_is_aborted_and_releases_its_holds() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut back = local(&pd, 4096);
        back.write_at(0, &[7u8; 4096]).unwrap();
        let mut peer = regions(&pd, 4096);
        peer.write_at(0, &pattern(4096, 3)).unwrap();
        let remote = peer.remote();
        {
            let mut batch = a.start_batch().unwrap();
            batch.add(&SendWr::read(&back, 0..4096, &remote, 0).unwrap().wr_id(1)).unwrap();
            batch.add(&SendWr::read(&back, 0..16, &remote, 0).unwrap().wr_id(2)).unwrap();
            drop(batch);
        }
        assert_eq!(a.outstanding_sends(), 0, "the aborted work requests are not outstanding");
        assert!(a.send_cq().poll_extended(&mut [ExtendedCompletion::default(); 4]).unwrap() == 0, "nothing completes");
        let mut got = vec![0; 4096];
        back.read_at(0, &mut got).expect("the READ target is released at the abort");
        assert!(got.iter().all(|&x| x == 7), "the aborted READ wrote nothing");
        let mut batch = a.start_batch().expect("a batch after an abort");
        batch.add(&SendWr::read(&back, 0..4096, &remote, 0).unwrap().wr_id(3)).unwrap();
        batch.complete().unwrap();
        let wc = reap(a.send_cq(), 1);
        assert_eq!((wc[0].wr_id(), wc[0].status()), (3, WcStatus::Success));
        back.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(4096, 3));
        drop((a, b));
    })();
    t.finish();
}

/// Refused work requests leave the batch as it was: one of another PD, one out of bounds, an
/// operation the QP was not made for, and one past the queue's room each fail before anything
/// is held, and what was added before still completes.
#[test]
fn extended_refused_add_holds_nothing_and_keeps_the_batch() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let ctxc = pd.context().clone();
        let (ca, cb) = match (extended_cq(&ctxc, 64), extended_cq(&ctxc, 64)) {
            (Some(a), Some(b)) => (a, b),
            _ => return,
        };
        let ops = SendOps::RDMA_WRITE | SendOps::RDMA_READ;
        let ia = QpInit::new().extended_ops(ops).max_send_wr(4).send_cq(Arc::clone(&ca)).recv_cq(ca);
        let ib = QpInit::new().extended_ops(ops).max_send_wr(4).send_cq(Arc::clone(&cb)).recv_cq(cb);
        let params = RcParams::new().gid_index(gidx);
        let ua = match UnconnectedQp::new(&pd, ia, params.clone()) {
            Ok(q) => q,
            Err(e @ Error::Unsupported { .. }) => {
                common::skipped("extended QPs", &e.to_string());
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let ub = UnconnectedQp::new(&pd, ib, params).unwrap();
        let (la, lb) = (ua.local(), ub.local());
        let (mut a, b) = (ua.connect(&lb).unwrap(), ub.connect(&la).unwrap());
        let src = regions(&pd, 4096);
        let mut peer = regions(&pd, 4096);
        let other_pd = ProtectionDomain::new(&ctx).unwrap();
        let mut foreign = MemoryRegion::new(&other_pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let remote = peer.remote();
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::write(&src, 0..64, &remote, 0).unwrap().wr_id(1)).unwrap();
        let e = batch.add(&SendWr::read(&foreign, 0..64, &remote, 0).unwrap()).unwrap_err();
        assert!(e.to_string().contains("another protection domain"), "{e}");
        let e = batch.add(&SendWr::write(&src, 4000..4200, &remote, 0).unwrap()).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
        let e = batch.add(&SendWr::send(&src, 0..8)).unwrap_err();
        assert!(e.to_string().contains("SEND"), "an operation the QP was not made for is named: {e}");
        for i in 2..=4 {
            batch.add(&SendWr::write(&src, 0..64, &remote, 64).unwrap().wr_id(i)).unwrap();
        }
        let e = batch.add(&SendWr::write(&src, 0..64, &remote, 0).unwrap()).unwrap_err();
        assert!(matches!(e, Error::QueueFull { queue: "send", depth: 4 }), "{e}");
        assert_eq!(batch.len(), 4);
        foreign.write_at(0, b"untouched").expect("a refused READ target holds nothing");
        batch.complete().unwrap();
        let ids: Vec<u64> = reap(a.send_cq(), 4).iter().map(|c| c.wr_id()).collect();
        assert_eq!(ids, [1, 2, 3, 4]);
        assert_eq!(a.outstanding_sends(), 0);
        let mut got = [0u8; 128];
        peer.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..64], &got[64..], "both targets got src[0..64]");
        drop((a, b));
    })();
    t.finish();
}

/// Attack: read a region the device may still write. The READ target of a batch is out of
/// Rust's reach from `add` on, through `complete`, until its completion is reaped; then it
/// holds the peer's bytes.
#[test]
fn extended_read_target_is_unreachable_until_reaped() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut back = local(&pd, 4096);
        let mut peer = regions(&pd, 4096);
        peer.write_at(0, &pattern(4096, 9)).unwrap();
        let remote = peer.remote();
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::read(&back, 0..4096, &remote, 0).unwrap().wr_id(1)).unwrap();
        out_of_reach(&mut back, "added to a batch");
        batch.complete().unwrap();
        out_of_reach(&mut back, "posted, not reaped");
        let wc = reap(a.send_cq(), 1);
        assert!(wc[0].is_ok());
        assert_eq!(back.as_slice().expect("reaped: readable again"), &pattern(4096, 9)[..]);
        drop((a, b));
    })();
    t.finish();
}

/// Attack: drop a region mid-batch. `add` borrows the region only for the call, so safe code
/// may drop it before `complete`: the batch holds it, the registration stays (the kernel's
/// count says so) until the completion is reaped, and the WRITE sends its bytes.
#[test]
fn extended_region_dropped_mid_batch_stays_registered_until_reaped() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut peer = regions(&pd, 4096);
        let remote = peer.remote();
        let mut src = regions(&pd, 4096);
        src.write_at(0, &pattern(4096, 4)).unwrap();
        let before = common::mr_count();
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::write(&src, 0..4096, &remote, 0).unwrap().wr_id(1)).unwrap();
        drop(src);
        assert_eq!(common::mr_count(), before, "the batch holds the dropped region's registration");
        batch.complete().unwrap();
        assert_eq!(common::mr_count(), before, "still held while posted");
        assert!(reap(a.send_cq(), 1)[0].is_ok());
        assert_eq!(common::mr_count(), before.map(|n| n - 1), "released with its completion");
        let mut got = vec![0; 4096];
        peer.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(4096, 4), "the WRITE sent the dropped region's bytes");
        drop((a, b));
    })();
    t.finish();
}

/// Attack: forget a batch. `mem::forget` skips both the doorbell and the abort: the work
/// request it added stays held (its READ target unreachable), every later send on the QP is
/// refused naming the leak (the provider's queue may be locked by the forgotten batch), and
/// dropping the QP releases the region.
#[test]
fn extended_forgotten_batch_keeps_its_holds_and_refuses_later_sends() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut back = local(&pd, 4096);
        let peer = regions(&pd, 4096);
        let remote = peer.remote();
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::read(&back, 0..4096, &remote, 0).unwrap().wr_id(1)).unwrap();
        std::mem::forget(batch);
        out_of_reach(&mut back, "named by a forgotten batch");
        assert_eq!(a.outstanding_sends(), 1, "the forgotten work request counts as outstanding");
        let e = a.start_batch().unwrap_err();
        assert!(e.to_string().contains("leaked"), "{e}");
        let e = a.post_send(&[SendWr::send_inline(b"x")]).unwrap_err();
        assert!(e.to_string().contains("leaked"), "{e}");
        drop(a);
        back.as_slice().expect("dropping the QP released what the forgotten batch held");
        drop((b, peer));
    })();
    t.finish();
}

/// Attack: a bad rkey. A WRITE through a batch with an rkey the peer never gave fails its
/// completion (`REM_ACCESS_ERR`), seen through the extended poll; the region is released, the
/// peer's memory is unchanged, and the QP refuses the next batch (it is in the error state).
#[test]
fn extended_bad_rkey_fails_its_completion_and_releases() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some((mut a, b)) = private_pair(&pd, gidx, SendOps::all()) else { return };
        let mut src = regions(&pd, 4096);
        src.write_at(0, &[1u8; 4096]).unwrap();
        let mut peer = regions(&pd, 4096);
        peer.write_at(0, &[0; 4096]).unwrap();
        let r = peer.remote();
        let forged = rdma_cm::RemoteRegion::new(r.addr, r.rkey ^ 0x5a00, r.len);
        let mut back = local(&pd, 64);
        let mut batch = a.start_batch().unwrap();
        batch.add(&SendWr::write(&src, 0..4096, &forged, 0).unwrap().wr_id(1)).unwrap();
        batch.add(&SendWr::read(&back, 0..64, &forged, 0).unwrap().wr_id(2)).unwrap();
        batch.complete().unwrap();
        let wcs = reap(a.send_cq(), 2);
        assert_eq!(wcs[0].status(), WcStatus::RemAccessErr, "{wcs:?}");
        assert_eq!(wcs[1].status(), WcStatus::WrFlushErr, "{wcs:?}");
        assert_eq!(a.outstanding_sends(), 0);
        back.as_slice().expect("the flushed READ's target is released");
        let mut got = vec![1u8; 4096];
        peer.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0), "the peer's memory is unchanged");
        let e = a.start_batch().unwrap_err();
        assert!(matches!(e, Error::QpInError { .. }), "{e}");
        drop((a, b));
    })();
    t.finish();
}

/// Attack: poll a shared CQ. Two pairs send on one extended CQ; its extended poll, one entry at
/// a time, routes every completion to the QP that posted it (no loss, no misroute), and a QP's
/// own classic wait on the same CQ keeps the other's completions for it.
#[test]
fn extended_poll_on_a_shared_cq_routes_every_completion() {
    let t = DeviceTest::start();
    (|| {
        let Some((pd, gidx, shared, init)) = on_one_extended_cq(t.addr) else { return };
        let Some((mut a1, b1)) = connected(&pd, gidx, init.clone()) else { return };
        let (mut a2, b2) = connected(&pd, gidx, init).expect("the second pair");
        let src = regions(&pd, 4096);
        let peer = regions(&pd, 4096);
        let remote = peer.remote();
        for (qp, base) in [(&mut a1, 0u64), (&mut a2, 100)] {
            let mut batch = qp.start_batch().unwrap();
            for i in 0..5 {
                batch.add(&SendWr::write(&src, 0..64, &remote, 64 * i).unwrap().wr_id(base + i)).unwrap();
            }
            batch.complete().unwrap();
        }
        // a1's own (classic) wait takes its last completion: the ones of a1 it meets first are
        // kept for a1, the ones of a2 for a2, and the CQ's extended poll delivers them all.
        a1.wait_for(WorkQueue::Send, 4, T).unwrap().ok().unwrap();
        let mut seen = Vec::new();
        let deadline = Instant::now() + T;
        while seen.len() < 9 {
            assert!(Instant::now() < deadline, "only {seen:?}");
            let mut one = [ExtendedCompletion::default(); 1];
            if shared.poll_extended(&mut one).unwrap() == 1 {
                assert!(one[0].is_ok(), "{:?}", one[0]);
                seen.push((one[0].qp_num(), one[0].wr_id()));
            }
        }
        assert_eq!(shared.poll_extended(&mut [ExtendedCompletion::default(); 4]).unwrap(), 0, "nothing twice");
        for &(qpn, id) in &seen {
            assert_eq!(qpn, if id < 100 { a1.qp_num() } else { a2.qp_num() }, "routed to its QP: {seen:?}");
        }
        let mut ids: Vec<u64> = seen.iter().map(|s| s.1).collect();
        ids.sort();
        assert_eq!(ids, [0, 1, 2, 3, 100, 101, 102, 103, 104], "every completion exactly once: {seen:?}");
        assert_eq!((a1.outstanding_sends(), a2.outstanding_sends()), (0, 0));
        drop((a1, a2, b1, b2));
    })();
    t.finish();
}

/// The order rxe showed on kernel 6.12, where the test above failed: a QP's wait keeps its own
/// earlier completions while no other QP's completion has come. The CQ's poll after it must
/// still deliver them (it found none until the wait told the routing table it had kept some).
#[test]
fn a_cq_poll_delivers_what_a_qps_wait_kept_with_no_other_qp_in_between() {
    let t = DeviceTest::start();
    (|| {
        let Some((pd, gidx, shared, init)) = on_one_extended_cq(t.addr) else { return };
        let Some((mut a1, b1)) = connected(&pd, gidx, init) else { return };
        let src = regions(&pd, 4096);
        let peer = regions(&pd, 4096);
        let remote = peer.remote();
        let mut batch = a1.start_batch().unwrap();
        for i in 0..5 {
            batch.add(&SendWr::write(&src, 0..64, &remote, 64 * i).unwrap().wr_id(i)).unwrap();
        }
        batch.complete().unwrap();
        // The queue completes in order: the wait for the fifth meets the first four and keeps
        // them.
        a1.wait_for(WorkQueue::Send, 4, T).unwrap().ok().unwrap();
        assert_eq!(a1.undelivered(), 4);
        let mut seen = Vec::new();
        let mut one = [ExtendedCompletion::default(); 1];
        let deadline = Instant::now() + T;
        while seen.len() < 4 {
            assert!(Instant::now() < deadline, "the CQ's poll found only {seen:?} of the four the wait kept");
            if shared.poll_extended(&mut one).unwrap() == 1 {
                seen.push(one[0].wr_id());
            }
        }
        assert_eq!(seen, [0, 1, 2, 3]);
        assert_eq!((a1.undelivered(), a1.outstanding_sends()), (0, 0));
        drop((a1, b1));
    })();
    t.finish();
}

/// Completion timestamps where the device offers them: each completion carries one, and they
/// do not go back. Skipped with the reason where `ibv_create_cq_ex` refuses them (Soft-RoCE).
#[test]
fn extended_completion_timestamps_where_offered() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cq = match CompletionQueue::new_extended(&ctx, 64, true) {
            Ok(cq) => cq,
            Err(e @ Error::Unsupported { .. }) => {
                assert!(e.to_string().contains("timestamps"), "the refusal names the capability: {e}");
                common::skipped("completion timestamps", &e.to_string());
                return;
            }
            Err(e) => panic!("ibv_create_cq_ex with timestamps: {e}"),
        };
        let init = QpInit::new().extended().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
        let Some((mut a, b)) = connected(&pd, gidx, init) else { return };
        let src = regions(&pd, 64);
        let remote = regions(&pd, 64);
        let mut batch = a.start_batch().unwrap();
        for i in 0..3 {
            batch.add(&SendWr::write(&src, 0..8, &remote.remote(), 0).unwrap().wr_id(i)).unwrap();
        }
        batch.complete().unwrap();
        let wcs = reap(&cq, 3);
        let ts: Vec<u64> = wcs.iter().map(|c| c.timestamp().expect("a timestamp on every completion")).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
        drop((a, b));
    })();
    t.finish();
}

/// What needs the extended path says so: a batch on a classic QP, the extended poll on a
/// classic CQ.
#[test]
fn extended_path_refused_where_not_created_for_it() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let (mut a, b) = connected(&pd, gidx, QpInit::new()).expect("classic QPs");
        assert_eq!(a.send_ops(), SendOps::empty());
        let e = a.start_batch().unwrap_err();
        assert!(e.to_string().contains("QpInit::extended"), "{e}");
        let e = a.send_cq().poll_extended(&mut [ExtendedCompletion::default()]).unwrap_err();
        assert!(e.to_string().contains("new_extended"), "{e}");
        drop((a, b));
    })();
    t.finish();
}

/// The extended poll asked for more completions than the CQ holds, round after round, on a CQ
/// of 16 that the rounds lap a dozen times, with the receives on a shared receive queue of one
/// slot per round in use. rdma-core 44's Soft-RoCE advanced its consumer index twice when
/// `ibv_next_poll` ran into `ENOENT` before `ibv_end_poll`, so the next poll replayed a lap of
/// old completions (each naming an earlier posting of the same SRQ slot) and the kernel, seeing
/// the CQ full, dropped the new ones. Every round's completion must come once, name that
/// round's receive, and carry that round's bytes; nothing may come twice.
#[test]
fn extended_poll_with_room_to_spare_loses_and_replays_nothing() {
    let t = DeviceTest::start();
    (|| {
        let Some((ctx, gidx)) = open(t.addr) else { return };
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let Some(cq) = extended_cq(&ctx, 16) else { return };
        let srq = rdma_cm::SharedReceiveQueue::new(&pd, 4).expect("ibv_create_srq");
        let params = RcParams::new().gid_index(gidx);
        let a_init = QpInit::new().max_send_wr(4).send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq)).srq(&srq);
        let a = UnconnectedQp::new(&pd, a_init, params.clone()).expect("the receiver, on the extended CQ and the SRQ");
        let b = UnconnectedQp::new(&pd, QpInit::new(), params).expect("the sender");
        let (ia, ib) = (a.local(), b.local());
        let (_a, mut b) = (a.connect(&ib).expect("connect a"), b.connect(&ia).expect("connect b"));
        let mut buf = local(&pd, 64);
        let mut src = local(&pd, 64);
        for round in 0..200u64 {
            srq.post_recv(&[RecvWr::new(&buf, 0..64).wr_id(round)]).expect("post to the SRQ");
            src.as_mut_slice().unwrap().fill(round as u8);
            b.post_send(&[SendWr::send(&src, 0..64).wr_id(round)]).expect("send");
            let mut out = [ExtendedCompletion::default(); 8];
            let deadline = Instant::now() + T;
            let n = loop {
                let n = cq.poll_extended(&mut out).expect("poll_extended");
                if n > 0 {
                    break n;
                }
                assert!(Instant::now() < deadline, "round {round}: the receive's completion never came (lost)");
            };
            assert_eq!(n, 1, "round {round}: one completion, not a replayed lap: {:?}", &out[..n]);
            let wc = out[0].ok().unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!((wc.wr_id(), wc.byte_len()), (round, 64), "round {round}");
            assert_eq!(cq.poll_extended(&mut out).unwrap(), 0, "round {round}: nothing handed out twice");
            assert!(buf.as_slice().unwrap().iter().all(|&x| x == round as u8), "round {round}: its own bytes");
            b.wait_for(WorkQueue::Send, round, T).expect("the send's completion").ok().unwrap();
        }
    })();
    t.finish();
}
