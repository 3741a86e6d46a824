//! Joining a lane across devices and contexts: a QP is made with the lane's CQ, which names
//! its CQ by a handle number that the kernel resolves in the QP's own device file. A CQ of
//! another context (of the same device, or of another device) must therefore be refused before
//! the kernel sees it, whether it comes from a lane or stands alone, and so must a PD of
//! another device.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crate::common::{DeviceTest, T};
use rdma_cm::verbs::lane::Lane;
use rdma_cm::{Client, CompletionQueue, Error, QpInit, RouteResolved, VerbsContext};

/// A fresh route to `dst`, for a QP to be made on.
fn route(dst: SocketAddr) -> RouteResolved {
    Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap()
}

/// A lane made on another context of the route's own device: `lane_qp` (and `create_qp` with
/// the lane's CQs) are refused, naming the cause, and the lane stays empty and usable; a lane
/// on the route's own context takes the QP.
#[test]
fn a_lane_of_another_context_of_the_device_is_refused() {
    let t = DeviceTest::start();
    {
        let dst = SocketAddr::new(t.addr, 7999);
        let r = route(dst);
        let ctx = r.context().unwrap();
        let ctx2 = VerbsContext::open(&ctx.device_name()).unwrap();
        assert!(!ctx2.same_as(&ctx));
        let mut other = Lane::new(&ctx2, 32).unwrap();
        let pd = r.alloc_pd().unwrap();
        let e = r.create_qp(&pd, other.qp_init()).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "a QP was made with a CQ of another context: {e}");
        let r = route(dst);
        let pd = r.alloc_pd().unwrap();
        let e = r.lane_qp(&mut other, &pd, QpInit::new()).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "lane_qp took a lane of another context: {e}");
        assert!(other.poll().unwrap().is_none());
        let r = route(dst);
        let mut own = Lane::new(&r.context().unwrap(), 32).unwrap();
        let pd = r.alloc_pd().unwrap();
        let c = r.lane_qp(&mut own, &pd, QpInit::new()).expect("a lane of the route's own context");
        assert!(own.outstanding(c.qp()).is_ok());
        drop((c, own, other, pd, ctx2, ctx));
    }
    t.finish();
}

/// A CQ of another device is refused (the kernel would resolve its handle in the QP's device
/// file, where the number names some other CQ), also when its handle number equals that of a
/// CQ of the QP's own device, and whether it stands alone or is a lane's; a PD of the other
/// device is refused too. Adds a second Soft-RoCE device, so it runs in the harness guest only.
#[test]
fn guest_only_a_cq_or_lane_of_another_device_is_refused() {
    let t = DeviceTest::start();
    assert!(
        std::env::var_os("RDMA_VM").is_some(),
        "this test adds a second Soft-RoCE device: it runs in the harness guest; elsewhere skip it with \
         `cargo test -- --skip guest_only`"
    );
    let sh = |cmd: &str| {
        let st = Command::new("sh").args(["-c", cmd]).status().unwrap();
        assert!(st.success(), "{cmd}");
    };
    if !std::path::Path::new("/sys/class/infiniband/rxe1").exists() {
        sh("ip link add rdma1 type dummy && ip link set rdma1 mtu 9000 && ip addr add 10.78.0.1/24 dev rdma1 && \
            ip link set rdma1 up && rdma link add rxe1 type rxe netdev rdma1");
    }
    let deadline = Instant::now() + T;
    while !std::fs::read_to_string("/sys/class/infiniband/rxe1/ports/1/state").unwrap_or_default().contains("ACTIVE") {
        assert!(Instant::now() < deadline, "rxe1 never became ACTIVE");
        thread::sleep(Duration::from_millis(20));
    }
    {
        let dst = SocketAddr::new(t.addr, 7999);
        let other = route("10.78.0.1:7999".parse().unwrap());
        let other_ctx = other.context().unwrap();
        assert_eq!(other_ctx.device_name(), "rxe1");
        let foreign_cq = CompletionQueue::new(&other_ctx, 32).unwrap();
        let r = route(dst);
        let pd = r.alloc_pd().unwrap();
        let err = r.create_qp(&pd, QpInit::new().send_cq(Arc::clone(&foreign_cq))).map(|_| ()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::InvalidArgument(_)) && msg.contains("rxe1") && msg.contains("device"), "{msg}");
        // A lane of the other device.
        let mut lane = Lane::new(&other_ctx, 32).unwrap();
        let r = route(dst);
        let pd = r.alloc_pd().unwrap();
        let e = r.lane_qp(&mut lane, &pd, QpInit::new()).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "lane_qp took a lane of another device: {e}");
        // The dangerous case: the foreign CQ's handle number equals that of a CQ of the QP's
        // own device, so the kernel would resolve it to *that* CQ rather than fail. Make the
        // numbers collide, and check it is still refused.
        let r = route(dst);
        let own_cq = CompletionQueue::new(&r.context().unwrap(), 32).unwrap();
        // SAFETY: reading the handle field of a live CQ.
        let own_handle = unsafe { (*own_cq.as_raw()).handle };
        let mut spare = vec![];
        let colliding = loop {
            let cq = CompletionQueue::new(&other_ctx, 32).unwrap();
            // SAFETY: as above.
            let h = unsafe { (*cq.as_raw()).handle };
            if h == own_handle {
                break cq;
            }
            assert!(h < own_handle, "cannot make the handles collide ({h} > {own_handle})");
            spare.push(cq);
        };
        let res = r.create_qp(&pd, QpInit::new().send_cq(colliding).recv_cq(own_cq));
        assert!(matches!(res, Err(Error::InvalidArgument(_))), "a QP was created with a CQ of another device");
        drop(spare);
        // A PD of the other device is refused too.
        let r = route(dst);
        let foreign_pd = other.alloc_pd().unwrap();
        assert!(r.create_qp(&foreign_pd, QpInit::new()).is_err());
        drop((lane, foreign_cq, foreign_pd, pd));
    }
    // rxe1 stays: librdmacm keeps every device context it opened until the process exits, so
    // deleting the link here would wait for this process. The guest is thrown away after.
    t.finish();
}
