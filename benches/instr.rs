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
//! Variants: `send-raw`, `send-crate` (post a receive on one end, post a send on the other, poll
//! both completions), `write-raw`, `write-crate` (post an RDMA WRITE, poll its completion) and
//! `write4-raw`, `write4-crate` (an RDMA WRITE gathered from four 16-byte pieces of one region,
//! as `post_poll/write_4sge` in `benches/datapath.rs`, on a QP created with `max_send_sge` 4).
//! `raw` makes the same `rdma-sys` calls directly on the same QP and CQs, as
//! `benches/datapath.rs` does. The measured code lives in the `instr_*` functions (unmangled, so
//! callgrind's `--toggle-collect=instr_*` finds them); everything else (connection setup, the
//! pause that lets the device complete the work) is not counted. Before polling, the loop waits
//! outside the measured functions until the device is likely done, so almost every poll finds
//! its completion: the count is then the work of a post and of a successful poll, not of the
//! empty polls a busy loop would add (their number depends on timing). Empty polls that still
//! happen are counted and printed, and the harness reports them.
//!
//! After a warm-up (which also resolves the lazy symbol bindings), the counters are zeroed with
//! callgrind's `ZERO_STATS` client request, so only the N measured iterations count.

mod common;

use std::mem::MaybeUninit;
use std::time::Duration;

use common::{pair, zeroed, PairSpec, Side};
use rdma_cm::ffi;
use rdma_cm::{
    AccessFlags, CompletionQueue, MemoryRegion, QpInit, QueuePair, RecvWr, RemoteRegion, SendWr, WorkCompletion,
    WorkQueue,
};

/// Every variant, as `main` takes them.
const VARIANTS: &str =
    "send-raw, send-crate, write-raw, write-crate, write4-raw, write4-crate, xwrite-raw, xwrite-crate";

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

// --- measured: through the crate ---------------------------------------------------------------

/// The four pieces of the gathered WRITE, in one region.
const PIECES: [std::ops::Range<usize>; 4] = [0..16, 1024..1040, 2048..2064, 3072..3088];

/// The crate: posts one RDMA WRITE gathered from `PIECES` of `mr` to the start of `remote`.
#[no_mangle]
#[inline(never)]
pub fn instr_crate_post_write4(qp: &mut QueuePair, mr: &MemoryRegion, remote: &RemoteRegion) {
    let pieces = PIECES.map(|r| (mr, r));
    qp.post_send(&[SendWr::write_sg(&pieces, remote, 0).unwrap()]).unwrap();
}

/// The crate: posts one send of `mr[0..len]`.
#[no_mangle]
#[inline(never)]
pub fn instr_crate_post_send(qp: &mut QueuePair, mr: &MemoryRegion, len: usize) {
    qp.post_send(&[SendWr::send(mr, 0..len)]).unwrap();
}

/// The crate: posts one RDMA WRITE of `mr[0..len]` to the start of `remote`.
#[no_mangle]
#[inline(never)]
pub fn instr_crate_post_write(qp: &mut QueuePair, mr: &MemoryRegion, len: usize, remote: &RemoteRegion) {
    qp.post_send(&[SendWr::write(mr, 0..len, remote, 0).unwrap()]).unwrap();
}

/// The crate: posts one receive into `mr[0..len]`.
#[no_mangle]
#[inline(never)]
pub fn instr_crate_post_recv(qp: &mut QueuePair, mr: &MemoryRegion, len: usize) {
    qp.post_recv(&[RecvWr::new(mr, 0..len)]).unwrap();
}

/// The crate: one poll of `queue` for one entry; whether it found one (a success).
#[no_mangle]
#[inline(never)]
pub fn instr_crate_poll(qp: &mut QueuePair, queue: WorkQueue, wcs: &mut [WorkCompletion; 1]) -> bool {
    let n = qp.poll_queue(queue, wcs).unwrap();
    if n == 1 {
        assert!(wcs[0].is_ok(), "{:?}", wcs[0]);
    }
    n == 1
}

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
    let mut wcs = [WorkCompletion::default(); 1];
    match variant {
        "send-raw" => {
            instr_raw_post_recv(b.conn.qp(), &b.mrs[0], LEN);
            instr_raw_post_send(a.conn.qp(), &a.mrs[0], LEN, ffi::ibv_wr_opcode::IBV_WR_SEND, None);
            let (scq, rcq) = (a.conn.qp().send_cq(), b.conn.qp().recv_cq());
            settle_and_poll(empties, || instr_raw_poll(scq));
            settle_and_poll(empties, || instr_raw_poll(rcq));
        }
        "send-crate" => {
            instr_crate_post_recv(b.conn.qp_mut(), &b.mrs[0], LEN as usize);
            instr_crate_post_send(a.conn.qp_mut(), &a.mrs[0], LEN as usize);
            settle_and_poll(empties, || instr_crate_poll(a.conn.qp_mut(), WorkQueue::Send, &mut wcs));
            settle_and_poll(empties, || instr_crate_poll(b.conn.qp_mut(), WorkQueue::Recv, &mut wcs));
        }
        "write-raw" => {
            let op = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            instr_raw_post_send(a.conn.qp(), &a.mrs[0], LEN, op, Some(*remote));
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || instr_raw_poll(scq));
        }
        "write-crate" => {
            instr_crate_post_write(a.conn.qp_mut(), &a.mrs[0], LEN as usize, remote);
            settle_and_poll(empties, || instr_crate_poll(a.conn.qp_mut(), WorkQueue::Send, &mut wcs));
        }
        "write4-raw" => {
            instr_raw_post_write4(a.conn.qp(), &a.mrs[0], remote);
            let scq = a.conn.qp().send_cq();
            settle_and_poll(empties, || instr_raw_poll(scq));
        }
        "write4-crate" => {
            instr_crate_post_write4(a.conn.qp_mut(), &a.mrs[0], remote);
            settle_and_poll(empties, || instr_crate_poll(a.conn.qp_mut(), WorkQueue::Send, &mut wcs));
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
    if variant.starts_with('x') {
        return extended::main(variant, n);
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

/// The extended verbs' rows (issue 21): `xwrite-raw`, `xwrite-crate` post one RDMA WRITE as a
/// batch of one (`ibv_wr_start`, `ibv_wr_rdma_write`, `ibv_wr_set_sge`, `ibv_wr_complete`; the
/// crate: `start_batch`, `add`, `complete`) on a QP made by `ibv_create_qp_ex`, and poll its
/// completion through `ibv_start_poll`/`ibv_end_poll` on a CQ made by `ibv_create_cq_ex` (the
/// crate: `CompletionQueue::poll_extended`). The raw poll reads what a user of the extended
/// API needs at least (status, `wr_id`, QP number, length); the crate's reads every field of a
/// `WorkCompletion`. The pair is verbs-only (`UnconnectedQp`), so that the CQ can be made
/// extended before the QP.
mod extended {
    use std::net::IpAddr;
    use std::sync::Arc;

    use rdma_cm::ffi;
    use rdma_cm::{
        AccessFlags, CompletionQueue, ExtendedCompletion, GidType, MemoryRegion, ProtectionDomain, QpInit, QueuePair,
        RcParams, RemoteRegion, SendWr, UnconnectedQp, VerbsContext,
    };

    use super::{callgrind_zero_stats, settle_and_poll};

    /// Raw: one signaled RDMA WRITE of `mr[0..len]` to the start of `remote`, as a batch of one.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_xraw_post_write(qp: &QueuePair, mr: &MemoryRegion, len: u32, remote: &RemoteRegion) {
        // SAFETY: the QP was made extended (QpInit::extended), so it has an ibv_qp_ex whose
        // calls are set; no batch is open on it; the region outlives the completion, which the
        // loop reaps before the next post; the WRITE's wr_id (0) is not the crate's tag.
        unsafe {
            let x = ffi::ibv_qp_to_qp_ex(qp.as_raw());
            ffi::ibv_wr_start(x);
            (*x).wr_id = 0;
            (*x).wr_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            ffi::ibv_wr_rdma_write(x, remote.rkey, remote.addr);
            ffi::ibv_wr_set_sge(x, mr.lkey(), mr.addr(), len);
            assert_eq!(ffi::ibv_wr_complete(x), 0);
        }
    }

    /// Raw: one extended poll section for one completion; whether it found one (a success).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_xraw_poll(cq: &CompletionQueue) -> bool {
        let x = cq.as_raw().cast::<ffi::ibv_cq_ex>();
        let mut attr = ffi::ibv_poll_cq_attr { comp_mask: 0 };
        // SAFETY: the CQ was made by ibv_create_cq_ex (an ibv_cq_ex begins with its ibv_cq),
        // with the standard fields; nothing else polls it; the section is closed below.
        unsafe {
            let r = ffi::ibv_start_poll(x, &mut attr);
            if r == libc::ENOENT {
                return false;
            }
            assert_eq!(r, 0, "ibv_start_poll");
            assert_eq!((*x).status, ffi::ibv_wc_status::IBV_WC_SUCCESS);
            std::hint::black_box(((*x).wr_id, ffi::ibv_wc_read_qp_num(x), ffi::ibv_wc_read_byte_len(x)));
            ffi::ibv_end_poll(x);
        }
        true
    }

    /// The crate: one RDMA WRITE of `mr[0..len]` to the start of `remote`, as a batch of one.
    #[no_mangle]
    #[inline(never)]
    pub fn instr_xcrate_post_write(qp: &mut QueuePair, mr: &MemoryRegion, len: usize, remote: &RemoteRegion) {
        let mut batch = qp.start_batch().unwrap();
        batch.add(&SendWr::write(mr, 0..len, remote, 0).unwrap()).unwrap();
        batch.complete().unwrap();
    }

    /// The crate: one extended poll for one entry; whether it found one (a success).
    #[no_mangle]
    #[inline(never)]
    pub fn instr_xcrate_poll(cq: &CompletionQueue, out: &mut [ExtendedCompletion; 1]) -> bool {
        let n = cq.poll_extended(out).unwrap();
        if n == 1 {
            assert!(out[0].is_ok(), "{:?}", out[0]);
        }
        n == 1
    }

    /// The RoCE v2 GID index of the device's IPv4 address.
    fn gid_index(ctx: &VerbsContext, addr: IpAddr) -> u8 {
        let e = ctx
            .gid_table(1)
            .expect("gid table")
            .into_iter()
            .find(|e| e.gid.ipv4().map(IpAddr::V4) == Some(addr) && e.gid_type == GidType::RoceV2)
            .expect("a RoCE v2 GID of the device's address");
        u8::try_from(e.index).expect("a GID index under 256")
    }

    pub fn main(variant: &str, n: u64) {
        let name = rdma_cm::devices().expect("devices").into_iter().next().expect("a device").name;
        let ctx = VerbsContext::open(&name).expect("open the device");
        let gidx = gid_index(&ctx, super::common::device_addr());
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let cq = CompletionQueue::new_extended(&ctx, 64, false).expect("an extended CQ");
        let init = QpInit::new().extended().send_cq(Arc::clone(&cq)).recv_cq(Arc::clone(&cq));
        let params = RcParams::new().gid_index(gidx);
        let a = UnconnectedQp::new(&pd, init, params.clone()).expect("an extended QP");
        let b = UnconnectedQp::new(&pd, QpInit::new(), params).unwrap();
        let (ia, ib) = (a.local(), b.local());
        let (mut a, _b) = (a.connect(&ib).unwrap(), b.connect(&ia).unwrap());
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (mr, target) =
            (MemoryRegion::new(&pd, 8192, access).unwrap(), MemoryRegion::new(&pd, 8192, access).unwrap());
        let remote = target.remote();
        const LEN: u32 = 64;
        let mut out = [ExtendedCompletion::default(); 1];
        let mut once = |empties: &mut u64| match variant {
            "xwrite-raw" => {
                instr_xraw_post_write(&a, &mr, LEN, &remote);
                settle_and_poll(empties, || instr_xraw_poll(&cq));
            }
            "xwrite-crate" => {
                instr_xcrate_post_write(&mut a, &mr, LEN as usize, &remote);
                settle_and_poll(empties, || instr_xcrate_poll(&cq, &mut out));
            }
            other => panic!("unknown variant {other:?}: {}", super::VARIANTS),
        };
        let mut warm = 0;
        for _ in 0..200 {
            once(&mut warm);
        }
        let mut empties = 0;
        callgrind_zero_stats();
        for _ in 0..n {
            once(&mut empties);
        }
        println!("instr: variant {variant} iterations {n} empty_polls {empties}");
    }
}
