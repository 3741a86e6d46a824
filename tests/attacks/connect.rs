//! Connects given up half way (feature `tokio`): async connects cancelled at every point of the
//! handshake leave nothing behind on either side, and a connection made after them works.
//!
//! The lane has no async connect of its own (`LaneClient::connect` blocks), so the client here
//! is `ClientQp::connect_async`, with no work posted; the server accepts through a lane
//! (`LaneServer::accept`), whose requests the clients abandon.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::common::{DeviceTest, T};
use rdma_cm::verbs::lane::Lane;
use rdma_cm::{Client, ConnParam, ProtectionDomain, QpInit, Server};

/// Async connects given up by a timer after 0 µs to 20 ms (mid-handshake, at every stage the
/// timing lets it reach): the server's lane accepts each request it still finds (or sees its
/// accept fail within its bound, and removes the QP), waits for the client's departure, and
/// lets the connection go. A connect after all that is established end to end and
/// disconnects; every QP, CQ, PD and id of both sides is released (`DeviceTest::finish`).
#[test]
fn async_connects_cancelled_mid_handshake_leave_nothing_behind() {
    let t = DeviceTest::start();
    let listener = Server::new().unwrap().bind(SocketAddr::new(t.addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let ctx = listener.context().unwrap();
            let pd = ProtectionDomain::new(&ctx).unwrap();
            let mut lane = Lane::new(&ctx, 64).unwrap();
            let mut established = 0;
            while !stop.load(Ordering::Relaxed) {
                let Ok(req) = listener.get_request(Duration::from_millis(200)) else { continue };
                // The client may have given up (and its id be gone) by now: then the request's
                // QP or accept fails, which is the point of this test, not a server failure.
                let Ok(s) = req.lane_qp(&mut lane, &pd, QpInit::new()) else { continue };
                let qp = s.qp();
                if s.accept(&mut lane, &ConnParam::new(), Duration::from_secs(3)).is_err() {
                    lane.remove(qp).expect("a failed accept's QP stays on the lane until removed");
                    continue;
                }
                established += 1;
                let _ = lane.wait_peer_left(qp, T);
                let _ = lane.disconnect(qp, Duration::from_secs(1));
            }
            drop((lane, pd, ctx, listener));
            established
        })
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let delays = [0, 50, 200, 1_000, 5_000, 20_000].map(Duration::from_micros);
    let mut completed = 0;
    for d in delays {
        let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
        let pd = route.alloc_pd().unwrap();
        let q = route.create_qp(&pd, QpInit::new()).unwrap();
        let r = rt.block_on(async { tokio::time::timeout(d, q.connect_async(&ConnParam::new())).await });
        if let Ok(conn) = r {
            completed += 1;
            drop(conn.expect("a completed connect_async must have succeeded"));
        }
        drop(pd);
    }
    // A connection after all that works end to end.
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let conn = rt.block_on(async { tokio::time::timeout(T, q.connect_async(&ConnParam::new())).await });
    let conn = conn.expect("connect_async within the bound").expect("connect_async");
    rt.block_on(async { tokio::time::timeout(T, conn.disconnect_async()).await }).unwrap().unwrap();
    stop.store(true, Ordering::Relaxed);
    let established = server.join().unwrap();
    assert!(established > completed, "the last connection was established ({established}, {completed} early)");
    drop((pd, rt));
    t.finish();
}
