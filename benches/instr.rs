//! Instructions per operation: one variant of the data path, N times, for
//! `valgrind --tool=callgrind` to count. Run it through `harness/bench-instr`
//! (`harness/bench --instr-only`), which starts it under callgrind in the guest and splits the
//! counts into the crate's own instructions and the provider's.
//!
//! ```text
//! harness/bench --instr-only                        # every variant, table in target/bench/instr.txt
//! cargo bench --bench instr -- write-crate 2000     # one variant, without valgrind (a smoke run)
//! ```
//!
//! Each operation comes as `raw` (the same `rdma-sys` calls made directly, as
//! `benches/datapath.rs` does), `crate` (the path the crate teaches: a lane,
//! [`rdma_cm::verbs::lane`], per side, one work request per post, whose CQ serves both queues of
//! its QP). The operations: `send-*` (post a receive on one end,
//! post a send on the other, poll both completions), `write-*` (post an RDMA WRITE, poll its
//! completion), `write4-*` (an RDMA WRITE gathered from four 16-byte pieces of one region, as
//! `post_poll/write_4sge` in `benches/datapath.rs`, on a QP created with `max_send_sge` 4),
//! `fadd-*` (an atomic fetch-and-add into the peer's first 8 bytes, the original value into 8
//! bytes of the local region), `ud-*` (a 64-byte datagram to the peer's UD QP, into a receive
//! with room for the GRH: post receive, post send, poll both) and `batch-*` (16 RDMA WRITEs of
//! 64 bytes in one post under one doorbell, the last one signaled, then one poll that reaps
//! them; counted per WRITE by the harness; `batch-crate` posts them with `post_send_iter`).
//! The measured code lives in the `instr_*` functions (unmangled, so
//! callgrind's `--toggle-collect=instr_*` finds them); everything else (connection setup, the
//! pause that lets the device complete the work) is not counted. Before polling, the loop waits
//! outside the measured functions until the device is likely done, so almost every poll finds
//! its completion: the count is then the work of a post and of a successful poll, not of the
//! empty polls a busy loop would add (their number depends on timing). Empty polls that still
//! happen are counted and printed, and the harness reports them.
//!
//! After a warm-up (which also resolves the lazy symbol bindings), the counters are zeroed with
//! callgrind's `ZERO_STATS` client request, so only the N measured iterations count.
//!
//! Each operation has a `-prep` variant too: the same work through prepared work requests
//! ([`rdma_cm::verbs::lane::PreparedSend`]: checked and lowered once before the loop, posted with
//! `post_prepared`, re-armed with the region each completion hands back). `batch-prep` is a
//! [`rdma_cm::verbs::lane::PreparedBatch`]: the sixteen WRITEs over one region, posted with
//! `post_batch`, whose one completion hands the region back. `batch-rawpre` is raw as a loop
//! that builds its list of sixteen once and posts it again and again (`batch-raw` builds it
//! at every post, as the other raw rows build their work request). The other operations'
//! batches of sixteen come as `raw` and `prep`: `batch4-*` (WRITEs of 4 pieces), `fbatch-*`
//! (fetch-and-adds, each result into its own 8 bytes) and `ubatch-*` (datagrams, no receive
//! posted: a UD send completes whether or not one waits).

mod common;

use std::mem::MaybeUninit;
use std::time::Duration;

use common::{pair, zeroed, PairSpec, Side};
use rdma_cm::ffi;
use rdma_cm::{AccessFlags, CompletionQueue, MemoryRegion, QpInit, QueuePair, RemoteRegion};

/// Every variant, as `main` takes them.
const VARIANTS: &str =
    "send-raw, send-crate, write-raw, write-crate, write4-raw, write4-crate, fadd-raw, fadd-crate, ud-raw, ud-crate, \
     batch-raw, batch-crate, \
     send-prep, write-prep, write4-prep, fadd-prep, ud-prep, batch-prep, batch-rawpre, \
     batch4-raw, batch4-prep, fbatch-raw, fbatch-prep, ubatch-raw, ubatch-prep";

/// How long the loop lets the device work before it polls (not counted).
const SETTLE: Duration = Duration::from_micros(300);

/// Callgrind's `ZERO_STATS` client request: a no-op when not running under valgrind.
fn callgrind_zero_stats() {
    // VG_USERREQ_TOOL_BASE('C', 'T') + 1 (callgrind.h).
    const ZERO_STATS: u64 = ((b'C' as u64) << 24 | (b'T' as u64) << 16) + 1;
    let args: [u64; 6] = [ZERO_STATS, 0, 0, 0, 0, 0];
    let mut result: u64 = 0;
    // SAFETY: valgrind's client-request sequence (valgrind.h, amd64): the four rotations of rdi
    // add up to 128 bits and leave it unchanged, `xchg rbx, rbx` exchanges rbx with itself, so
    // natively the block changes nothing but flags. Under valgrind it reads the six words at
    // rax (alive for the block) and writes its result to rdx.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!(
            "rol rdi, 3", "rol rdi, 13", "rol rdi, 61", "rol rdi, 51",
            "xchg rbx, rbx",
            inout("rdx") result,
            in("rax") args.as_ptr(),
            options(nostack),
        );
    }
    let _ = (result, args);
}

// --- measured: raw rdma-sys calls --------------------------------------------------------------

/// Raw: posts one signaled send-queue work request.
#[no_mangle]
#[inline(never)]
pub fn instr_raw_post_send(qp: &QueuePair, mr: &MemoryRegion, len: u32, op: u32, remote: Option<RemoteRegion>) {
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
    // SAFETY: the QP is alive; wr and sge live for the call; the region outlives the
    // completion, which the loop reaps before the next post.
    assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), &mut wr, &mut bad) }, 0);
}

/// Raw: posts one receive.
#[no_mangle]
#[inline(never)]
pub fn instr_raw_post_recv(qp: &QueuePair, mr: &MemoryRegion, len: u32) {
    let mut sge = ffi::ibv_sge { addr: mr.addr(), length: len, lkey: mr.lkey() };
    // SAFETY: ibv_recv_wr is plain old data.
    let mut wr: ffi::ibv_recv_wr = unsafe { zeroed() };
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = std::ptr::null_mut();
    // SAFETY: as in instr_raw_post_send.
    assert_eq!(unsafe { ffi::ibv_post_recv(qp.as_raw(), &mut wr, &mut bad) }, 0);
}

/// Raw: one `ibv_poll_cq` for one entry; whether it found one (a success).
#[no_mangle]
#[inline(never)]
pub fn instr_raw_poll(cq: &CompletionQueue) -> bool {
    let mut wc = MaybeUninit::<ffi::ibv_wc>::uninit();
    // SAFETY: the CQ is alive (held by the QP); `wc` has room for one entry.
    let n = unsafe { ffi::ibv_poll_cq(cq.as_raw(), 1, wc.as_mut_ptr()) };
    assert!(n >= 0, "ibv_poll_cq failed");
    if n == 1 {
        // SAFETY: ibv_poll_cq filled the entry.
        assert_eq!(unsafe { wc.assume_init_ref() }.status, ffi::ibv_wc_status::IBV_WC_SUCCESS);
    }
    n == 1
}

/// Raw: posts one signaled RDMA WRITE gathered from `PIECES` of `mr` to the start of `remote`.
#[no_mangle]
#[inline(never)]
pub fn instr_raw_post_write4(qp: &QueuePair, mr: &MemoryRegion, remote: &RemoteRegion) {
    let mut sge =
        PIECES.map(|r| ffi::ibv_sge { addr: mr.addr() + r.start as u64, length: r.len() as u32, lkey: mr.lkey() });
    common::raw_write_sg(qp, &mut sge, *remote);
}

/// The four pieces of the gathered WRITE, in one region.
const PIECES: [std::ops::Range<usize>; 4] = [0..16, 1024..1040, 2048..2064, 3072..3088];

// --- the loop (not measured) --------------------------------------------------------------------

/// Polls with `poll` until it finds a completion, letting the device work first; counts the
/// polls that found nothing into `empties`.
fn settle_and_poll(empties: &mut u64, mut poll: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        std::thread::sleep(SETTLE);
        if poll() {
            return;
        }
        *empties += 1;
    }
    panic!("no completion within 10,000 polls");
}

fn iteration(variant: &str, a: &mut Side, b: &mut Side, remote: &RemoteRegion, empties: &mut u64) {
    const LEN: u32 = 64;
    match variant {
        "send-raw" => {
            instr_raw_post_recv(b.conn.qp(), &b.mrs[0], LEN);
            instr_raw_post_send(a.conn.qp(), &a.mrs[0], LEN, ffi::ibv_wr_opcode::IBV_WR_SEND, None);
            let (scq, rcq) = (a.conn.qp().send_cq(), b.conn.qp().recv_cq());
            settle_and_poll(empties, || instr_raw_poll(scq));
            settle_and_poll(empties, || instr_raw_poll(rcq));
        }
        "write-raw" => {
            let op = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            instr_raw_post_send(a.conn.qp(), &a.mrs[0], LEN, op, Some(*remote));
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || instr_raw_poll(scq));
        }
        "write4-raw" => {
            instr_raw_post_write4(a.conn.qp(), &a.mrs[0], remote);
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || instr_raw_poll(scq));
        }
        other => panic!("unknown variant {other:?}: {VARIANTS}"),
    }
}

fn main() {
    // `cargo bench` runs every bench binary with `--bench`: this one only runs when asked.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let Some(variant) = args.first() else {
        println!("benches/instr: give a variant ({VARIANTS}) and N; see harness/bench-instr");
        return;
    };
    let n: u64 = args.get(1).map(|s| s.parse().expect("N: a number")).unwrap_or(2000);
    if let Some(run) = lane_bench::runner(variant) {
        run(n);
        return;
    }
    // Only the gathered variants get a QP of 4 send pieces, so the others measure the QP
    // they always did.
    let sge = if variant.starts_with("write4") { 4 } else { 1 };
    let spec = PairSpec {
        mr_sizes: vec![8192],
        access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        init: QpInit::new().max_send_sge(sge),
        ..PairSpec::default()
    };
    let (mut a, mut b) = pair(common::device_addr(), spec.clone(), spec);
    let remote = b.mrs[0].remote();
    let mut warm_empties = 0;
    for _ in 0..200 {
        iteration(variant, &mut a, &mut b, &remote, &mut warm_empties);
    }
    let mut empties = 0;
    callgrind_zero_stats();
    for _ in 0..n {
        iteration(variant, &mut a, &mut b, &remote, &mut empties);
    }
    println!("instr: variant {variant} iterations {n} empty_polls {empties}");
}

/// The fast path (`rdma_cm::verbs::lane`) beside raw `rdma-sys`, and the operations added with it
/// (fetch-and-add, UD send, a WRITE batch of 16) as raw calls and on lanes.
mod lane_bench {
    use super::{callgrind_zero_stats, settle_and_poll, PIECES};
    use crate::common::{self, lane, pair, zeroed, PairSpec};
    use rdma_cm::ffi;
    use rdma_cm::verbs::ah::GRH_LEN;
    use rdma_cm::verbs::lane::{
        Lane, LaneQp, PreparedBatch, PreparedRecv, PreparedSend, RecvWr as LRecv, SendWr as LSend,
    };
    use rdma_cm::{AccessFlags, CompletionQueue, MemoryRegion, QpInit, QueuePair, RemoteRegion};

    /// Bytes each operation moves.
    const LEN: usize = 64;
    /// Work requests in a batch.
    const BATCH: usize = 16;

    type Run = fn(u64);

    /// The runner of `variant`, when it is one of this module's.
    pub fn runner(variant: &str) -> Option<Run> {
        Some(match variant {
            "send-crate" => send_lane,
            "write-crate" => write_lane,
            "write4-crate" => write4_lane,
            "fadd-raw" => fadd_raw,
            "fadd-crate" => fadd_lane,
            "ud-raw" => ud_raw,
            "ud-crate" => ud_lane,
            "batch-raw" => batch_raw,
            "batch-crate" => batch_lane,
            "send-prep" => send_prep,
            "write-prep" => |n| one_prep(n, "write-prep", 1, |mr, remote| LSend::write(mr, 0..LEN, remote, 0)),
            "write4-prep" => |n| one_prep(n, "write4-prep", 4, |mr, remote| LSend::write_sg(mr, &PIECES, remote, 0)),
            "fadd-prep" => |n| {
                one_prep(n, "fadd-prep", 1, |mr, remote| {
                    LSend::fetch_add(mr, 4096, &RemoteRegion { len: 8, ..*remote }, 0, 1)
                })
            },
            "ud-prep" => ud_prep,
            "batch-prep" => batch_prep,
            "batch-rawpre" => batch_rawpre,
            "batch4-raw" => |n| more_batch(n, More::Write4, false),
            "batch4-prep" => |n| more_batch(n, More::Write4, true),
            "fbatch-raw" => |n| more_batch(n, More::Fadd, false),
            "fbatch-prep" => |n| more_batch(n, More::Fadd, true),
            "ubatch-raw" => ubatch_raw,
            "ubatch-prep" => ubatch_prep,
            _ => return None,
        })
    }

    /// Runs `iteration` 200 times to warm up, zeroes the counters, runs it `n` times.
    fn measure(variant: &str, n: u64, mut iteration: impl FnMut(&mut u64)) {
        let mut warm = 0;
        for _ in 0..200 {
            iteration(&mut warm);
        }
        let mut empties = 0;
        callgrind_zero_stats();
        for _ in 0..n {
            iteration(&mut empties);
        }
        println!("instr: variant {variant} iterations {n} empty_polls {empties}");
    }

    fn spec(access: AccessFlags, init: QpInit) -> PairSpec {
        PairSpec { mr_sizes: vec![8192], access, init, ..PairSpec::default() }
    }

    // --- measured: the lane -------------------------------------------------------------------

    /// The lane: posts one send of `mr[0..LEN]`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_send(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion) {
        lane.post_send(qp, LSend::send(mr, 0..LEN)).unwrap();
    }

    /// The lane: posts one receive into `mr[0..LEN]` (`len` bytes).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_recv(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, len: usize) {
        lane.post_recv(qp, LRecv::range(mr, 0..len)).unwrap();
    }

    /// The lane: posts one RDMA WRITE of `mr[0..LEN]` to the start of `remote`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_write(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, remote: &RemoteRegion) {
        lane.post_send(qp, LSend::write(mr, 0..LEN, remote, 0)).unwrap();
    }

    /// The lane: posts one RDMA WRITE gathered from `PIECES` of `mr` to the start of `remote`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_write4(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, remote: &RemoteRegion) {
        lane.post_send(qp, LSend::write_sg(mr, &PIECES, remote, 0)).unwrap();
    }

    /// The lane: posts one fetch-and-add of 1 on `counter`, the original value into `mr[4096..]`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_fadd(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, counter: &RemoteRegion) {
        lane.post_send(qp, LSend::fetch_add(mr, 4096, counter, 0, 1)).unwrap();
    }

    /// The lane: posts one datagram of `mr[0..LEN]` to `dest`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_ud(lane: &mut Lane, qp: LaneQp, mr: MemoryRegion, dest: rdma_cm::verbs::lane::DestKey) {
        lane.post_send(qp, LSend::send(mr, 0..LEN).to(dest)).unwrap();
    }

    /// The lane: one poll; a completion found hands its region back into `back`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_poll(lane: &mut Lane, back: &mut Option<MemoryRegion>) -> bool {
        let n = lane
            .poll_with(1, |c, region| {
                if !c.is_ok() {
                    failed(c.status());
                }
                *back = region;
            })
            .unwrap();
        n == 1
    }

    /// A failed completion in a measured loop (out of line: never reached). It gets the status,
    /// as the raw loop's assertion does: a reference to the whole completion would make the
    /// compiler build it in memory on the measured path.
    #[cold]
    #[inline(never)]
    fn failed(status: rdma_cm::WcStatus) -> ! {
        panic!("completion failed: {status:?}")
    }

    /// The lane: posts `BATCH` RDMA WRITEs of `mrs[k][0..LEN]` in one list (one doorbell), the
    /// last one signaled.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_post_batch(
        lane: &mut Lane,
        qp: LaneQp,
        mrs: &mut [Option<MemoryRegion>; BATCH],
        remote: &RemoteRegion,
    ) {
        let wrs = mrs.iter_mut().enumerate().filter_map(|(k, m)| {
            let w = LSend::write(m.take()?, 0..LEN, remote, 0).wr_id(k as u64);
            Some(if k + 1 < BATCH { w.unsignaled() } else { w })
        });
        assert_eq!(lane.post_send_iter(qp, wrs).unwrap(), BATCH);
    }

    /// The lane: polls until it finds nothing or has handed out what is left of the batch; each
    /// region goes back to its place. Returns how many it handed out.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_lane_poll_batch(lane: &mut Lane, mrs: &mut [Option<MemoryRegion>; BATCH], want: usize) -> usize {
        lane.poll_with(want, |c, region| {
            if !c.is_ok() {
                failed(c.status());
            }
            mrs[c.wr_id() as usize % BATCH] = region;
        })
        .unwrap()
    }

    // --- measured: the lane's prepared work requests ---------------------------------------------

    /// The lane: posts the prepared send-queue work request `p` (lowered once, before the loop).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_post_send(lane: &mut Lane, p: &mut PreparedSend) {
        lane.post_prepared(p).unwrap();
    }

    /// The lane: posts the prepared receive `p`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_post_recv(lane: &mut Lane, p: &mut PreparedRecv) {
        lane.post_prepared_recv(p).unwrap();
    }

    /// The lane: one poll; a completion found re-arms `p` with the region it hands back.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_poll_send(lane: &mut Lane, p: &mut PreparedSend) -> bool {
        poll_rearm(lane, p)
    }

    /// The lane: as `instr_prep_poll_send`, for a prepared receive.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_poll_recv(lane: &mut Lane, p: &mut PreparedRecv) -> bool {
        poll_rearm(lane, p)
    }

    /// A prepared request of either queue, re-armed by the region its completion hands back.
    trait Rearm {
        fn rearm_with(&mut self, mr: MemoryRegion);
    }

    impl Rearm for PreparedSend {
        #[inline(always)]
        fn rearm_with(&mut self, mr: MemoryRegion) {
            self.rearm(mr).unwrap()
        }
    }

    impl Rearm for PreparedRecv {
        #[inline(always)]
        fn rearm_with(&mut self, mr: MemoryRegion) {
            self.rearm(mr).unwrap()
        }
    }

    /// One poll of `lane`; a completion found re-arms `p` with its region. Whether it found one.
    /// (The closure borrows `p` itself, as a user's would: one level of reference.)
    #[inline(always)]
    fn poll_rearm(lane: &mut Lane, p: &mut impl Rearm) -> bool {
        let n = lane
            .poll_with(1, |c, region| {
                if !c.is_ok() {
                    failed(c.status());
                }
                if let Some(r) = region {
                    p.rearm_with(r);
                }
            })
            .unwrap();
        n == 1
    }

    /// The lane: posts the prepared batch of `BATCH` RDMA WRITEs (one region, one list, one
    /// doorbell, the last one signaled).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_post_batch(lane: &mut Lane, batch: &mut PreparedBatch) {
        lane.post_batch(batch).unwrap();
    }

    /// The lane: one poll for up to `BATCH` completions, as raw's; the batch's one completion
    /// re-arms it with its region. Returns how many it handed out.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_prep_poll_batch(lane: &mut Lane, batch: &mut PreparedBatch) -> usize {
        lane.poll_with(BATCH, |c, region| {
            if !c.is_ok() {
                failed(c.status());
            }
            if let Some(r) = region {
                batch.rearm(r).unwrap();
            }
        })
        .unwrap()
    }

    // --- measured: raw calls for the added operations ---------------------------------------------

    /// Raw: posts one signaled fetch-and-add of 1 on `counter`, the original value into
    /// `mr[4096..4104]`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_fadd(qp: &QueuePair, mr: &MemoryRegion, counter: &RemoteRegion) {
        let mut sge = ffi::ibv_sge { addr: mr.addr() + 4096, length: 8, lkey: mr.lkey() };
        // SAFETY: ibv_send_wr is plain old data.
        let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.atomic = ffi::atomic_t { remote_addr: counter.addr, compare_add: 1, swap: 0, rkey: counter.rkey };
        let mut bad = std::ptr::null_mut();
        // SAFETY: QP alive; wr and sge live for the call; the 8 result bytes outlive the
        // completion, which the loop reaps before the next post.
        assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), &mut wr, &mut bad) }, 0);
    }

    /// Raw: posts one receive of `len` bytes of `mr` on `qp`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_recv_ud(qp: *mut ffi::ibv_qp, mr: &MemoryRegion, len: u32) {
        let mut sge = ffi::ibv_sge { addr: mr.addr(), length: len, lkey: mr.lkey() };
        // SAFETY: ibv_recv_wr is plain old data.
        let mut wr: ffi::ibv_recv_wr = unsafe { zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive; wr and sge live for the call; the region outlives the
        // completion, which the loop reaps.
        assert_eq!(unsafe { ffi::ibv_post_recv(qp, &mut wr, &mut bad) }, 0);
    }

    /// Raw: posts one signaled datagram of `mr[0..LEN]` to `dest` on `qp`.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_ud(qp: *mut ffi::ibv_qp, mr: &MemoryRegion, dest: &rdma_cm::verbs::ud::UdDest) {
        let mut sge = ffi::ibv_sge { addr: mr.addr(), length: LEN as u32, lkey: mr.lkey() };
        // SAFETY: ibv_send_wr is plain old data.
        let mut wr: ffi::ibv_send_wr = unsafe { zeroed() };
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.ud = ffi::ud_t { ah: dest.ah().as_raw(), remote_qpn: dest.qpn(), remote_qkey: dest.qkey() };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive; wr and sge live for the call; the region and the address
        // handle (held by `dest`) outlive the completion, which the loop reaps.
        assert_eq!(unsafe { ffi::ibv_post_send(qp, &mut wr, &mut bad) }, 0);
    }

    /// Raw: posts `BATCH` RDMA WRITEs of `mr[0..LEN]` in one list, the last one signaled.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_batch(qp: &QueuePair, mr: &MemoryRegion, remote: &RemoteRegion) {
        let mut sge = ffi::ibv_sge { addr: mr.addr(), length: LEN as u32, lkey: mr.lkey() };
        // SAFETY: ibv_send_wr is plain old data.
        let mut wrs: [ffi::ibv_send_wr; BATCH] = unsafe { zeroed() };
        let base = wrs.as_mut_ptr();
        for (k, wr) in wrs.iter_mut().enumerate() {
            wr.wr_id = k as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = if k + 1 == BATCH { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr, rkey: remote.rkey };
            // The list's links (the last one stays NULL).
            wr.next = if k + 1 < BATCH { base.wrapping_add(k + 1) } else { std::ptr::null_mut() };
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive (send queue 16 deep); the list and the one sge live for the
        // call; the region outlives the completions, which the loop reaps before the next post.
        assert_eq!(unsafe { ffi::ibv_post_send(qp.as_raw(), base, &mut bad) }, 0);
    }

    /// Raw: one `ibv_poll_cq` for up to `BATCH` entries; how many it found.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_poll_batch(cq: &CompletionQueue) -> usize {
        let mut wc = [const { std::mem::MaybeUninit::<ffi::ibv_wc>::uninit() }; BATCH];
        // SAFETY: the CQ is alive (held by the QP); `wc` has room for BATCH entries.
        let n = unsafe { ffi::ibv_poll_cq(cq.as_raw(), BATCH as i32, wc.as_mut_ptr().cast()) };
        assert!(n >= 0, "ibv_poll_cq failed");
        for w in &wc[..n as usize] {
            // SAFETY: ibv_poll_cq filled the first n entries.
            assert_eq!(unsafe { w.assume_init_ref() }.status, ffi::ibv_wc_status::IBV_WC_SUCCESS);
        }
        n as usize
    }

    // --- the loops (not measured) -----------------------------------------------------------------

    fn rc_lanes(sge: u32, access: AccessFlags) -> (lane::LaneSide, lane::LaneSide) {
        let s = spec(access, QpInit::new().max_send_sge(sge));
        lane::lane_pair(common::device_addr(), s.clone(), s, 64)
    }

    fn poll_lane(empties: &mut u64, lane: &mut Lane, back: &mut Option<MemoryRegion>) {
        settle_and_poll(empties, || instr_lane_poll(lane, back));
    }

    fn send_lane(n: u64) {
        let (mut a, mut b) = rc_lanes(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let (mut sbuf, mut rbuf) = (Some(a.mrs.remove(0)), Some(b.mrs.remove(0)));
        measure("send-crate", n, |empties| {
            instr_lane_post_recv(&mut b.lane, b.qp, rbuf.take().unwrap(), LEN);
            instr_lane_post_send(&mut a.lane, a.qp, sbuf.take().unwrap());
            poll_lane(empties, &mut a.lane, &mut sbuf);
            poll_lane(empties, &mut b.lane, &mut rbuf);
        });
    }

    fn write_lane(n: u64) {
        let (mut a, b) = rc_lanes(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let remote = b.mrs[0].remote();
        let mut buf = Some(a.mrs.remove(0));
        measure("write-crate", n, |empties| {
            instr_lane_post_write(&mut a.lane, a.qp, buf.take().unwrap(), &remote);
            poll_lane(empties, &mut a.lane, &mut buf);
        });
    }

    fn write4_lane(n: u64) {
        let (mut a, b) = rc_lanes(4, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let remote = b.mrs[0].remote();
        let mut buf = Some(a.mrs.remove(0));
        measure("write4-crate", n, |empties| {
            instr_lane_post_write4(&mut a.lane, a.qp, buf.take().unwrap(), &remote);
            poll_lane(empties, &mut a.lane, &mut buf);
        });
    }

    const ATOMIC: AccessFlags =
        AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_WRITE).union(AccessFlags::REMOTE_ATOMIC);

    fn fadd_raw(n: u64) {
        let s = spec(ATOMIC, QpInit::new());
        let (a, b) = pair(common::device_addr(), s.clone(), s);
        let counter = RemoteRegion { len: 8, ..b.mrs[0].remote() };
        measure("fadd-raw", n, |empties| {
            instr_raw_post_fadd(a.conn.qp(), &a.mrs[0], &counter);
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || super::instr_raw_poll(scq));
        });
    }

    fn fadd_lane(n: u64) {
        let (mut a, b) = rc_lanes(1, ATOMIC);
        let counter = RemoteRegion { len: 8, ..b.mrs[0].remote() };
        let mut buf = Some(a.mrs.remove(0));
        measure("fadd-crate", n, |empties| {
            instr_lane_post_fadd(&mut a.lane, a.qp, buf.take().unwrap(), &counter);
            poll_lane(empties, &mut a.lane, &mut buf);
        });
    }

    fn ud_raw(n: u64) {
        let common::ud::UdPair { client, to_server, server } =
            common::ud::ud_pair(common::device_addr(), 7492, QpInit::new());
        let sbuf = MemoryRegion::new(client.qp().pd(), LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + LEN, AccessFlags::LOCAL_WRITE).unwrap();
        measure("ud-raw", n, |empties| {
            instr_raw_post_recv_ud(server.qp().as_raw(), &rbuf, (GRH_LEN + LEN) as u32);
            instr_raw_post_ud(client.qp().as_raw(), &sbuf, &to_server);
            let (scq, rcq) = (client.qp().send_cq(), server.qp().recv_cq());
            settle_and_poll(empties, || super::instr_raw_poll(scq));
            settle_and_poll(empties, || super::instr_raw_poll(rcq));
        });
    }

    fn ud_lane(n: u64) {
        let lane::LaneUdPair { mut client, to_server, server_dest: _d, mut server } =
            lane::lane_ud_pair(common::device_addr(), 7493, QpInit::new(), 64);
        let mut sbuf = Some(MemoryRegion::new(&client.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap());
        let mut rbuf = Some(MemoryRegion::new(&server.pd, GRH_LEN + LEN, AccessFlags::LOCAL_WRITE).unwrap());
        measure("ud-crate", n, |empties| {
            instr_lane_post_recv(&mut server.lane, server.qp, rbuf.take().unwrap(), GRH_LEN + LEN);
            instr_lane_post_ud(&mut client.lane, client.qp, sbuf.take().unwrap(), to_server);
            poll_lane(empties, &mut client.lane, &mut sbuf);
            poll_lane(empties, &mut server.lane, &mut rbuf);
        });
    }

    fn batch_raw(n: u64) {
        let s = spec(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, QpInit::new());
        let (a, b) = pair(common::device_addr(), s.clone(), s);
        let remote = b.mrs[0].remote();
        measure("batch-raw", n, |empties| {
            instr_raw_post_batch(a.conn.qp(), &a.mrs[0], &remote);
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || instr_raw_poll_batch(scq) == 1);
        });
    }

    fn send_prep(n: u64) {
        let (mut a, mut b) = rc_lanes(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let mut send = a.lane.prepare_send(a.qp, LSend::send(a.mrs.remove(0), 0..LEN)).unwrap();
        let mut recv = b.lane.prepare_recv(b.qp, LRecv::range(b.mrs.remove(0), 0..LEN)).unwrap();
        measure("send-prep", n, |empties| {
            instr_prep_post_recv(&mut b.lane, &mut recv);
            instr_prep_post_send(&mut a.lane, &mut send);
            settle_and_poll(empties, || instr_prep_poll_send(&mut a.lane, &mut send));
            settle_and_poll(empties, || instr_prep_poll_recv(&mut b.lane, &mut recv));
        });
    }

    /// One prepared send-queue operation, `wr` of the region and the peer's, posted and polled.
    fn one_prep(n: u64, name: &str, sge: u32, wr: fn(MemoryRegion, &RemoteRegion) -> LSend) {
        let (mut a, b) = rc_lanes(sge, ATOMIC);
        let remote = b.mrs[0].remote();
        let mut p = a.lane.prepare_send(a.qp, wr(a.mrs.remove(0), &remote)).unwrap();
        measure(name, n, |empties| {
            instr_prep_post_send(&mut a.lane, &mut p);
            settle_and_poll(empties, || instr_prep_poll_send(&mut a.lane, &mut p));
        });
    }

    fn ud_prep(n: u64) {
        let lane::LaneUdPair { mut client, to_server, server_dest: _d, mut server } =
            lane::lane_ud_pair(common::device_addr(), 7494, QpInit::new(), 64);
        let sbuf = MemoryRegion::new(&client.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let rbuf = MemoryRegion::new(&server.pd, GRH_LEN + LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let mut send = client.lane.prepare_send(client.qp, LSend::send(sbuf, 0..LEN).to(to_server)).unwrap();
        let mut recv = server.lane.prepare_recv(server.qp, LRecv::range(rbuf, 0..GRH_LEN + LEN)).unwrap();
        measure("ud-prep", n, |empties| {
            instr_prep_post_recv(&mut server.lane, &mut recv);
            instr_prep_post_send(&mut client.lane, &mut send);
            settle_and_poll(empties, || instr_prep_poll_send(&mut client.lane, &mut send));
            settle_and_poll(empties, || instr_prep_poll_recv(&mut server.lane, &mut recv));
        });
    }

    fn batch_prep(n: u64) {
        let (mut a, b) = rc_lanes(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let remote = b.mrs[0].remote();
        let mut batch =
            a.lane.prepare_batch(a.qp, a.mrs.remove(0), BATCH, |_, mr| LSend::write(mr, 0..LEN, &remote, 0)).unwrap();
        measure("batch-prep", n, |empties| {
            instr_prep_post_batch(&mut a.lane, &mut batch);
            settle_and_poll(empties, || instr_prep_poll_batch(&mut a.lane, &mut batch) == 1);
        });
    }

    /// Raw, as a raw loop that builds its list once: the sixteen WRITEs linked in an array made
    /// before the loop, posted again and again (`batch-raw` builds its list at every post).
    fn batch_rawpre(n: u64) {
        let s = spec(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE, QpInit::new());
        let (a, b) = pair(common::device_addr(), s.clone(), s);
        let remote = b.mrs[0].remote();
        let mr = &a.mrs[0];
        let mut sge = Box::new(ffi::ibv_sge { addr: mr.addr(), length: LEN as u32, lkey: mr.lkey() });
        // SAFETY: ibv_send_wr is plain old data.
        let mut wrs: Box<[ffi::ibv_send_wr; BATCH]> = Box::new(unsafe { zeroed() });
        raw_list(&mut wrs, |k, wr| {
            wr.wr_id = k as u64;
            wr.sg_list = &mut *sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr, rkey: remote.rkey };
        });
        let scq = a.conn.qp().send_cq();
        measure("batch-rawpre", n, |empties| {
            instr_raw_post_list(a.conn.qp().as_raw(), &mut wrs[0]);
            settle_and_poll(empties, || instr_raw_poll_batch(scq) == 1);
        });
    }

    /// Links `wrs` in order, `fill` writing each one's fields; the last one signaled.
    fn raw_list(wrs: &mut [ffi::ibv_send_wr; BATCH], mut fill: impl FnMut(usize, &mut ffi::ibv_send_wr)) {
        let base = wrs.as_mut_ptr();
        for (k, wr) in wrs.iter_mut().enumerate() {
            fill(k, wr);
            wr.send_flags = if k + 1 == BATCH { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.next = if k + 1 < BATCH { base.wrapping_add(k + 1) } else { std::ptr::null_mut() };
        }
    }

    /// Raw: posts the linked list that starts at `first` (built by the caller, before the
    /// loop).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_list(qp: *mut ffi::ibv_qp, first: &mut ffi::ibv_send_wr) {
        post_list(qp, first);
    }

    /// Posts the linked list that starts at `first`. (Not a measured function itself: one
    /// measured function inside another would switch callgrind's counting off.)
    #[inline(always)]
    fn post_list(qp: *mut ffi::ibv_qp, first: &mut ffi::ibv_send_wr) {
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive (16 deep); the list (and the scatter lists and address
        // handles it names) outlives the call; the regions outlive the completions, which the
        // loop reaps before the next post.
        assert_eq!(unsafe { ffi::ibv_post_send(qp, first, &mut bad) }, 0);
    }

    #[derive(Clone, Copy)]
    pub enum More {
        /// Sixteen WRITEs, each gathered from the four `PIECES` of one region.
        Write4,
        /// Sixteen fetch-and-adds of 1 on the peer's counter, each result into its own 8 bytes.
        Fadd,
    }

    /// Raw: posts a batch of sixteen `what`, built at every post as raw code would, the last
    /// one signaled.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_batch_of(qp: *mut ffi::ibv_qp, what: More, mr: &MemoryRegion, remote: &RemoteRegion) {
        // SAFETY: ibv_sge and ibv_send_wr are plain old data.
        let (mut sges, mut wrs): ([[ffi::ibv_sge; 4]; BATCH], [ffi::ibv_send_wr; BATCH]) =
            unsafe { (zeroed(), zeroed()) };
        let sg = sges.as_mut_ptr();
        raw_list(&mut wrs, |k, wr| {
            wr.wr_id = k as u64;
            // SAFETY: k < BATCH: an entry of `sges`, which outlives the post below.
            let sge = unsafe { &mut *sg.add(k) };
            if let More::Write4 = what {
                for (s, r) in sge.iter_mut().zip(PIECES) {
                    *s = ffi::ibv_sge { addr: mr.addr() + r.start as u64, length: r.len() as u32, lkey: mr.lkey() };
                }
                wr.num_sge = 4;
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.wr.rdma = ffi::rdma_t { remote_addr: remote.addr, rkey: remote.rkey };
            } else {
                sge[0] = ffi::ibv_sge { addr: mr.addr() + 4096 + 8 * k as u64, length: 8, lkey: mr.lkey() };
                wr.num_sge = 1;
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                wr.wr.atomic = ffi::atomic_t { remote_addr: remote.addr, compare_add: 1, swap: 0, rkey: remote.rkey };
            }
            wr.sg_list = sge.as_mut_ptr();
        });
        post_list(qp, &mut wrs[0]);
    }

    /// The batch of sixteen `what`, raw (`prep` false) or as a `PreparedBatch` on a lane.
    fn more_batch(n: u64, what: More, prep: bool) {
        let name = match (what, prep) {
            (More::Write4, false) => "batch4-raw",
            (More::Write4, true) => "batch4-prep",
            (More::Fadd, false) => "fbatch-raw",
            (More::Fadd, true) => "fbatch-prep",
        };
        let sge = if matches!(what, More::Write4) { 4 } else { 1 };
        if !prep {
            let s = spec(ATOMIC, QpInit::new().max_send_sge(sge));
            let (a, b) = pair(common::device_addr(), s.clone(), s);
            let remote = match what {
                More::Write4 => b.mrs[0].remote(),
                More::Fadd => RemoteRegion { len: 8, ..b.mrs[0].remote() },
            };
            let scq = a.conn.qp().send_cq();
            measure(name, n, |empties| {
                instr_raw_post_batch_of(a.conn.qp().as_raw(), what, &a.mrs[0], &remote);
                settle_and_poll(empties, || instr_raw_poll_batch(scq) == 1);
            });
            return;
        }
        let (mut a, b) = rc_lanes(sge, ATOMIC);
        let remote = b.mrs[0].remote();
        let counter = RemoteRegion { len: 8, ..remote };
        let mut batch = a
            .lane
            .prepare_batch(a.qp, a.mrs.remove(0), BATCH, |k, mr| match what {
                More::Write4 => LSend::write_sg(mr, &PIECES, &remote, 0),
                More::Fadd => LSend::fetch_add(mr, 4096 + 8 * k, &counter, 0, 1),
            })
            .unwrap();
        measure(name, n, |empties| {
            instr_prep_post_batch(&mut a.lane, &mut batch);
            settle_and_poll(empties, || instr_prep_poll_batch(&mut a.lane, &mut batch) == 1);
        });
    }

    /// Raw: sixteen datagrams of `mr[0..LEN]` to the peer in one list, built at every post (no
    /// receive is posted for them: a UD send completes whether or not one waits).
    fn ubatch_raw(n: u64) {
        let common::ud::UdPair { client, to_server, server: _server } =
            common::ud::ud_pair(common::device_addr(), 7495, QpInit::new());
        let sbuf = MemoryRegion::new(client.qp().pd(), LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let scq = client.qp().send_cq();
        measure("ubatch-raw", n, |empties| {
            instr_raw_post_ubatch(client.qp().as_raw(), &sbuf, &to_server);
            settle_and_poll(empties, || instr_raw_poll_batch(scq) == 1);
        });
    }

    /// Raw: posts sixteen datagrams of `mr[0..LEN]` to `dest` in one list, the last one
    /// signaled.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_raw_post_ubatch(qp: *mut ffi::ibv_qp, mr: &MemoryRegion, dest: &rdma_cm::verbs::ud::UdDest) {
        let mut sge = ffi::ibv_sge { addr: mr.addr(), length: LEN as u32, lkey: mr.lkey() };
        // SAFETY: ibv_send_wr is plain old data.
        let mut wrs: [ffi::ibv_send_wr; BATCH] = unsafe { zeroed() };
        raw_list(&mut wrs, |k, wr| {
            wr.wr_id = k as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
            wr.wr.ud = ffi::ud_t { ah: dest.ah().as_raw(), remote_qpn: dest.qpn(), remote_qkey: dest.qkey() };
        });
        post_list(qp, &mut wrs[0]);
    }

    /// The lane: the same sixteen datagrams as a `PreparedBatch`.
    fn ubatch_prep(n: u64) {
        let lane::LaneUdPair { mut client, to_server, server_dest: _d, server: _server } =
            lane::lane_ud_pair(common::device_addr(), 7496, QpInit::new(), 64);
        let sbuf = MemoryRegion::new(&client.pd, LEN, AccessFlags::LOCAL_WRITE).unwrap();
        let mut batch =
            client.lane.prepare_batch(client.qp, sbuf, BATCH, |_, mr| LSend::send(mr, 0..LEN).to(to_server)).unwrap();
        measure("ubatch-prep", n, |empties| {
            instr_prep_post_batch(&mut client.lane, &mut batch);
            settle_and_poll(empties, || instr_prep_poll_batch(&mut client.lane, &mut batch) == 1);
        });
    }

    fn batch_lane(n: u64) {
        let (mut a, b) = rc_lanes(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let remote = b.mrs[0].remote();
        let chunks = a.mrs.remove(0).split(8192 / BATCH).unwrap();
        let mut mrs: [Option<MemoryRegion>; BATCH] = [const { None }; BATCH];
        for (k, c) in chunks.into_iter().enumerate() {
            mrs[k] = Some(c);
        }
        measure("batch-crate", n, |empties| {
            instr_lane_post_batch(&mut a.lane, a.qp, &mut mrs, &remote);
            let mut got = 0;
            settle_and_poll(empties, || {
                got += instr_lane_poll_batch(&mut a.lane, &mut mrs, BATCH - got);
                got == BATCH
            });
        });
    }
}
