//! Pairs whose QPs are attached to lanes (`rdma_cm::verbs::lane`), one lane per side: a connected RC
//! pair through `pair`, and a UD pair through the UD connection manager.

use std::net::{IpAddr, SocketAddr};
use std::sync::{mpsc, Arc};
use std::thread;

use rdma_cm::cm::ud_cm::{UdClient, UdServer};
use rdma_cm::verbs::lane::{Lane, LaneQp};
use rdma_cm::verbs::ud::UdDest;
use rdma_cm::{ffi, MemoryRegion, ProtectionDomain, QpInit, VerbsContext};

use super::{pair, PairSpec, Side, T};

/// One side of a lane pair: its lane, its QP's place there, its PD and regions.
pub struct LaneSide {
    pub lane: Lane,
    pub qp: LaneQp,
    pub pd: Arc<ProtectionDomain>,
    pub mrs: Vec<MemoryRegion>,
}

/// A lane on the device at `addr`, its CQ `depth` deep.
pub fn lane_on(addr: IpAddr, depth: u32) -> Lane {
    let ctx = VerbsContext::cm_for_addr(addr).expect("the device's context");
    Lane::new(&ctx, depth).expect("Lane::new")
}

/// A connected RC pair (client, server), each QP attached to a lane of its own whose CQ is
/// `depth` deep. `spec.init` gives the capabilities; the lanes' CQs are put in.
pub fn lane_pair(addr: IpAddr, client: PairSpec, server: PairSpec, depth: u32) -> (LaneSide, LaneSide) {
    let (mut la, mut lb) = (lane_on(addr, depth), lane_on(addr, depth));
    let client = PairSpec { init: la.qp_init_from(client.init.clone()), ..client };
    let server = PairSpec { init: lb.qp_init_from(server.init.clone()), ..server };
    let (a, b) = pair(addr, client, server);
    let attach = |lane: &mut Lane, s: Side| {
        let Side { conn, pd, mrs } = s;
        let qp = lane.attach(conn).map_err(|r| r.into_parts().0).expect("attach");
        (qp, pd, mrs)
    };
    let (qa, pa, ma) = attach(&mut la, a);
    let (qb, pb, mb) = attach(&mut lb, b);
    (LaneSide { lane: la, qp: qa, pd: pa, mrs: ma }, LaneSide { lane: lb, qp: qb, pd: pb, mrs: mb })
}

/// A connected RC pair whose client QP, made with `lane`'s CQ, is attached to `lane`: its
/// handle there, its PD, and the server side.
pub fn attached_pair(lane: &mut Lane, addr: IpAddr, spec: PairSpec) -> (LaneQp, Arc<ProtectionDomain>, Side) {
    let client = PairSpec { init: lane.qp_init_from(spec.init.clone()), ..spec.clone() };
    let (a, b) = pair(addr, client, spec);
    let pd = a.pd.clone();
    let qp = lane.attach(a.conn).map_err(|r| r.into_parts().0).expect("attach");
    (qp, pd, b)
}

/// A UD pair on lanes: the client (with the server as a registered destination) and the
/// server. Nothing is posted through the convenient path (a lane's CQ refuses its polls).
pub struct LaneUdPair {
    pub client: LaneSide,
    pub to_server: rdma_cm::verbs::lane::DestKey,
    /// The server's destination as the UD connect gave it.
    pub server_dest: UdDest,
    pub server: LaneSide,
}

/// Sets up a UD pair on `port`, each endpoint attached to a lane of its own.
pub fn lane_ud_pair(addr: IpAddr, port: u16, init: QpInit, depth: u32) -> LaneUdPair {
    let (mut lc, ls) = (lane_on(addr, depth), lane_on(addr, depth));
    let (tx, rx) = mpsc::channel();
    let sinit = ls.qp_init_from(init.clone());
    let server = thread::spawn(move || {
        let mut ls = ls;
        let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 8).unwrap();
        tx.send(()).unwrap();
        let req = l.get_request(T).unwrap();
        let pd = req.alloc_pd().unwrap();
        let ep = req.create_qp(&pd, sinit).unwrap().accept(&[]).unwrap();
        let qp = ls.attach(ep).map_err(|r| r.into_parts().0).expect("attach_ud (server)");
        LaneSide { lane: ls, qp, pd, mrs: vec![] }
    });
    rx.recv_timeout(T).unwrap();
    let route =
        UdClient::new().unwrap().resolve_addr(None, SocketAddr::new(addr, port), T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let mut ep = route.create_qp(&pd, lc.qp_init_from(init)).unwrap();
    let server_dest = ep.connect(&[], T).unwrap();
    let qp = lc.attach(ep).map_err(|r| r.into_parts().0).expect("attach_ud (client)");
    let to_server = lc.add_dest(qp, &server_dest).expect("add_dest");
    let server = server.join().unwrap();
    LaneUdPair { client: LaneSide { lane: lc, qp, pd, mrs: vec![] }, to_server, server_dest, server }
}

/// Waits on `lane` (`Lane::wait`, up to `T` each) until `n` completions are handed out;
/// returns them in order.
pub fn reap(lane: &mut Lane, n: usize) -> Vec<rdma_cm::verbs::lane::Completion> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let got = out.len();
        out.push(lane.wait(T).unwrap_or_else(|e| panic!("only {got} of {n} completions: {e}")));
    }
    out
}

/// Moves `side`'s QP back to INIT, as a QP is before connect, through the raw escape hatch (it
/// stands in for a provider that refuses a post): rxe then refuses a send with EINVAL and
/// `bad_wr` NULL, yet keeps the work request.
pub fn back_to_init(side: &mut LaneSide) {
    let qp = side.lane.qp_as_raw(side.qp).unwrap();
    for (state, extra) in [(ffi::ibv_qp_state::IBV_QPS_RESET, false), (ffi::ibv_qp_state::IBV_QPS_INIT, true)] {
        // SAFETY: zeroed ibv_qp_attr is valid; the QP is alive (the lane holds it) and only
        // the attributes named in the mask are read.
        unsafe {
            let mut attr: ffi::ibv_qp_attr = std::mem::zeroed();
            attr.qp_state = state;
            let mut mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE.0;
            if extra {
                attr.port_num = 1;
                mask |= ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
                    | ffi::ibv_qp_attr_mask::IBV_QP_PORT.0
                    | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
            }
            assert_eq!(ffi::ibv_modify_qp(qp, &mut attr, mask as i32), 0, "ibv_modify_qp({state})");
        }
    }
}

/// Whether `status` is what a send posted after [`back_to_init`] completes with once the QP is
/// moved to the error state: the flush, since nothing runs in INIT. A connected iWARP QP is not
/// stopped by siw's RESET and INIT (measured on siw/6.1): its sends ran, and complete
/// successfully, or, when the error state caught one running, with LOC_QP_OP_ERR, or flushed.
pub fn after_back_to_init(status: rdma_cm::WcStatus) -> bool {
    use rdma_cm::WcStatus::{LocQpOpErr, Success, WrFlushErr};
    if super::caps::iwarp() {
        matches!(status, Success | LocQpOpErr | WrFlushErr)
    } else {
        status == WrFlushErr
    }
}

/// An `ibv_post_send` implementation, as a device context's `ops.post_send` holds one.
pub type PostSend =
    unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_send_wr, *mut *mut ffi::ibv_send_wr) -> std::os::raw::c_int;

/// The provider's `post_send`, while [`with_post_send`] has another stand in for it.
static ORIGINAL_POST_SEND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The provider's own `post_send`, for the stand-in [`with_post_send`] installed to call.
pub fn original_post_send() -> PostSend {
    let p = ORIGINAL_POST_SEND.load(std::sync::atomic::Ordering::SeqCst);
    assert_ne!(p, 0, "no post_send was swapped");
    // SAFETY: a non-zero value is the provider's `post_send`, stored by `with_post_send` from
    // the context's own non-NULL function pointer.
    unsafe { std::mem::transmute::<usize, PostSend>(p) }
}

/// Runs `f` while `side`'s device context posts sends through `stand_in` (which may call the
/// provider's through [`original_post_send`]), and puts the provider's back after, even if `f`
/// panics. The lane reads the table's functions once, so it is told to read them again
/// (`Lane::reload_provider_functions`) after each swap; only `side`'s lane posts through the
/// stand-in (another lane on the same context keeps the provider's). The tests of a binary run one at a
/// time (DeviceTest), so no other test posts through the stand-in.
pub fn with_post_send<R>(side: &mut LaneSide, stand_in: PostSend, f: impl FnOnce(&mut LaneSide) -> R) -> R {
    struct Restore(*mut ffi::ibv_context, Option<PostSend>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: the context is alive (the lane's QP holds it, and outlives this guard).
            unsafe { (*self.0).ops.post_send = self.1 };
        }
    }
    let raw = side.lane.qp_as_raw(side.qp).unwrap();
    // SAFETY: the QP is alive (the lane holds it), and so is its context; its `post_send` is
    // swapped for `stand_in` while `f` runs and put back by `Restore`.
    let restore = unsafe {
        let ctx = (*raw).context;
        let saved = Restore(ctx, (*ctx).ops.post_send);
        let original = (*ctx).ops.post_send.expect("the provider's post_send");
        ORIGINAL_POST_SEND.store(original as usize, std::sync::atomic::Ordering::SeqCst);
        (*ctx).ops.post_send = Some(stand_in);
        saved
    };
    side.lane.reload_provider_functions().expect("the stand-in is read");
    // A panic in `f` puts the provider's back in the lane too, before it goes on.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *side)));
    drop(restore);
    side.lane.reload_provider_functions().expect("the provider's own is read again");
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// The provider's `post_send`, whatever it returns reported as EINVAL with `bad_wr` NULL.
unsafe extern "C" fn post_send_naming_none(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> std::os::raw::c_int {
    // SAFETY: the arguments are passed on to the provider as they came; `bad` is its
    // out-pointer, valid for a write.
    unsafe {
        let ret = original_post_send()(qp, wr, bad);
        *bad = std::ptr::null_mut();
        if ret == 0 {
            libc::EINVAL
        } else {
            ret
        }
    }
}

/// Runs `f` while every `ibv_post_send` on `side`'s device context fails with EINVAL naming no
/// work request (`bad_wr` NULL), whatever the provider did with them. That is what rxe itself
/// does for a QP moved back to INIT ([`back_to_init`]), which keeps the requests; siw takes
/// them there and says so. Together with `back_to_init` (nothing posted runs before the
/// flush), the same post fails the same way on every provider.
pub fn posts_fail_naming_none<R>(side: &mut LaneSide, f: impl FnOnce(&mut LaneSide) -> R) -> R {
    with_post_send(side, post_send_naming_none, f)
}

/// Waits on `lane` (`Lane::wait_with`, up to `T`) for up to `max` completions with a closure
/// that panics; asserts that the wait ended in that panic, not with a completion handed out
/// without the closure or an error.
pub fn wait_until_the_closure_panics(lane: &mut Lane, max: usize) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lane.wait_with(max, T, |c, _| panic!("the caller fails on completion {}", c.wr_id()))
    }));
    if let Ok(r) = r {
        panic!("the wait ended without handing a completion to the closure: {r:?}");
    }
}

pub type PostRecv = unsafe extern "C" fn(*mut ffi::ibv_qp, *mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> i32;

/// The provider's `post_recv`, while [`with_post_recv`] has another stand in for it.
static ORIGINAL_POST_RECV: std::sync::OnceLock<PostRecv> = std::sync::OnceLock::new();

/// Runs `f` while `side`'s device context posts receives through `stand_in` (which calls the
/// provider's through `ORIGINAL_POST_RECV`), and puts the provider's back after, even if `f`
/// panics; the lane is told to read the table again after each swap. The tests of a binary
/// run one at a time (DeviceTest), so nothing else posts through the stand-in.
pub fn with_post_recv<R>(side: &mut LaneSide, stand_in: PostRecv, f: impl FnOnce(&mut LaneSide) -> R) -> R {
    struct Restore(*mut ffi::ibv_context, Option<PostRecv>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: the context is alive (the lane's QP holds it, and outlives this guard).
            unsafe { (*self.0).ops.post_recv = self.1 };
        }
    }
    let raw = side.lane.qp_as_raw(side.qp).unwrap();
    // SAFETY: the QP is alive (the lane holds it), and so is its context; its `post_recv` is
    // swapped for `stand_in` while `f` runs and put back by `Restore`.
    let restore = unsafe {
        let ctx = (*raw).context;
        let saved = Restore(ctx, (*ctx).ops.post_recv);
        let original = (*ctx).ops.post_recv.expect("the provider's post_recv");
        let _ = ORIGINAL_POST_RECV.set(original);
        assert_eq!(*ORIGINAL_POST_RECV.get().unwrap() as usize, original as usize, "one provider per binary");
        (*ctx).ops.post_recv = Some(stand_in);
        saved
    };
    side.lane.reload_provider_functions().expect("the stand-in is read");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut *side)));
    drop(restore);
    side.lane.reload_provider_functions().expect("the provider's own is read again");
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// The provider's own `post_recv`, for a stand-in installed by [`with_post_recv`].
pub fn original_post_recv() -> PostRecv {
    *ORIGINAL_POST_RECV.get().expect("no post_recv was swapped")
}
