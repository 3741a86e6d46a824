//! `--shared`: every client from one thread, on one event channel, one CQ and one SRQ.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Args, STOP};
use crate::common::fail;
use crate::protocol::{Mode, Request, LEGACY_SIZE};
use rdma_cm::verbs::lane::{Lane, LaneQp, LaneSrq, RecvWr, SendWr, Wc};
use rdma_cm::{
    Accepting, AccessFlags, CmEvent, CmEventType, ConnParam, ConnectRequest, EventChannel, IdHandle, Listener,
    MemoryRegion, ProtectionDomain, QpInfo, QpInit, Server, WorkQueue,
};

/// Send queue depth of each client's QP: one echo in flight per message, a few to spare.
const SEND_DEPTH: u32 = 4;

/// What the whole server shares, made on the first request (it fixes the device): one lane
/// (its CQ, every client's QP once established, and the SRQ). The SRQ's slots are regions that
/// move between the SRQ and the echoes: each receive hands its slot back with its completion,
/// the echo sends from it, and the send's completion hands it back to be posted again.
struct Pool {
    pd: Arc<ProtectionDomain>,
    lane: Lane,
    srq: LaneSrq,
}

/// One client.
struct Client {
    qp: LaneQp,
    id: IdHandle,
    peer: String,
    iters: u32,
    echoed: u32,
    /// Bytes of the echo in flight (for the log line).
    echo_len: usize,
    last: Instant,
}

struct State {
    pool: Option<Pool>,
    accepting: HashMap<IdHandle, (Accepting, String, u32)>,
    /// Receives that completed for a QP still waiting for its ESTABLISHED (the client may
    /// send as soon as it has the accept): (slot, its region, bytes), echoed once it is
    /// established.
    early: HashMap<u32, Vec<(u64, MemoryRegion, usize)>>,
    /// By QP number: what a completion names.
    clients: HashMap<u32, Client>,
    by_id: HashMap<IdHandle, u32>,
    accepted: u32,
    served: u32,
    failed: u32,
}

pub(super) fn serve_all(args: &Args, bind: SocketAddr, timeout: Duration) {
    let ch = EventChannel::new().unwrap_or_else(|e| fail("creating the event channel", e));
    let server = Server::on_channel(&ch).unwrap_or_else(|e| fail("creating the listening id", e));
    println!("[INFO] Created listening ID");
    let bound = server.bind(bind).unwrap_or_else(|e| fail("binding", e));
    println!("[INFO] Bound to address {bind}");
    let listener = bound.listen(args.backlog).unwrap_or_else(|e| fail("listening", e));
    println!(
        "[INFO] Listening on port {} (shared: one thread, one channel, one CQ, one SRQ of {} x {} bytes)...",
        args.port, args.srq_depth, args.slot
    );
    let mut st = State {
        pool: None,
        accepting: HashMap::new(),
        early: HashMap::new(),
        clients: HashMap::new(),
        by_id: HashMap::new(),
        accepted: 0,
        served: 0,
        failed: 0,
    };
    let mut got: Vec<(Wc, Option<MemoryRegion>)> = Vec::with_capacity(64);
    loop {
        let done = args.count.is_some_and(|c| st.served + st.failed >= c);
        if STOP.load(std::sync::atomic::Ordering::SeqCst) || done {
            break;
        }
        while let Some(ev) = ch.try_get_event().unwrap_or_else(|e| fail("reading the event channel", e)) {
            on_event(args, &listener, &mut st, ev);
        }
        let Some(pool) = &mut st.pool else {
            // Nothing to poll yet: sleep on the channel (bounded, to notice signals).
            match ch.get_event(Duration::from_millis(200)) {
                Ok(ev) => on_event(args, &listener, &mut st, ev),
                Err(rdma_cm::Error::Timeout { .. }) => {}
                Err(e) => fail("reading the event channel", e),
            }
            continue;
        };
        match pool.lane.wait_with(64, Duration::from_millis(20), |wc, mr| got.push((wc, mr))) {
            Ok(_) | Err(rdma_cm::Error::Timeout { .. }) => {}
            // One client's QP failed with no completion saying why: the others go on (its
            // client is dropped when it goes silent, or leaves).
            Err(e @ rdma_cm::Error::QpInError { .. }) => eprintln!("[ERROR] {e}"),
            Err(e) => fail("polling the CQ", e),
        }
        for (wc, mr) in got.drain(..) {
            on_completion(&mut st, &wc, mr);
        }
        // A client silent for longer than the timeout is dropped; nobody waits for it.
        let now = Instant::now();
        let stale: Vec<u32> = st.clients.iter().filter(|(_, c)| now - c.last > timeout).map(|(&q, _)| q).collect();
        for q in stale {
            let c = st.clients.remove(&q).expect("listed above");
            st.by_id.remove(&c.id);
            eprintln!("[ERROR] client {}: silent for {timeout:?}; dropped", c.peer);
            st.failed += 1;
            release(&mut st, c);
        }
    }
    println!("[INFO] Server exiting: {} client(s) served, {} failed", st.served, st.failed);
}

fn pool(req: &ConnectRequest, args: &Args) -> rdma_cm::Result<Pool> {
    let ctx = req.context()?;
    let pd = req.alloc_pd()?;
    // The SRQ grows the CQ by its own depth; each client's QP, by its send queue.
    let mut lane = Lane::new(&ctx, SEND_DEPTH * args.max_clients)?;
    let srq = lane.create_srq(&pd, args.srq_depth)?;
    let region = MemoryRegion::new(&pd, args.slot as usize * args.srq_depth as usize, AccessFlags::LOCAL_WRITE)?;
    for (i, m) in region.split(args.slot as usize)?.into_iter().enumerate() {
        lane.post_srq_recv(srq, RecvWr::new(m).wr_id(i as u64))?;
    }
    Ok(Pool { pd, lane, srq })
}

fn on_event(args: &Args, listener: &Listener, st: &mut State, ev: CmEvent) {
    match ev.event_type() {
        CmEventType::ConnectRequest if ev.listen_id() == Some(listener.handle()) => {
            st.accepted += 1;
            let req = match ConnectRequest::from_event(ev) {
                Ok(r) => r,
                Err(e) => return eprintln!("[ERROR] taking a connection request: {e}"),
            };
            let peer = req.peer_addr().map_or_else(|| "?".into(), |a| a.to_string());
            println!("[EVENT] Received CONNECT_REQUEST from {peer}");
            if let Err(e) = accept(args, st, req, peer.clone()) {
                eprintln!("[ERROR] client {peer}: {e}");
                st.failed += 1;
            }
        }
        CmEventType::Established => {
            let Some((acc, peer, iters)) = st.accepting.remove(&ev.id()) else { return };
            let Some(p) = &mut st.pool else { return };
            // The connection is made: the lane takes it (its receives already come from the SRQ).
            let attached = acc.complete(ev).map_err(|e| e.to_string()).and_then(|conn| {
                let id = conn.id().handle();
                p.lane.attach(conn).map(|qp| (qp, id)).map_err(|e| e.to_string())
            });
            match attached {
                Ok((qp, id)) => {
                    println!("[EVENT] Connection established ({peer}, {} connected)", st.clients.len() + 1);
                    let q = p.lane.qp_num(qp).expect("just attached");
                    st.by_id.insert(id, q);
                    st.clients.insert(q, Client { qp, id, peer, iters, echoed: 0, echo_len: 0, last: Instant::now() });
                    // Messages that arrived before the handshake finished get their echo now.
                    for (slot, mr, n) in st.early.remove(&q).unwrap_or_default() {
                        echo(st, q, slot, mr, n);
                    }
                }
                Err(e) => {
                    eprintln!("[ERROR] client {peer}: {e}");
                    st.failed += 1;
                }
            }
        }
        CmEventType::Disconnected | CmEventType::DeviceRemoval => {
            let Some(q) = st.by_id.remove(&ev.id()) else { return };
            let Some(c) = st.clients.remove(&q) else { return };
            if let Some(p) = &mut st.pool {
                let _ = p.lane.handle_event(c.qp, &ev);
            }
            if c.echoed == c.iters {
                println!("[INFO] Client {} done", c.peer);
                st.served += 1;
            } else {
                eprintln!(
                    "[ERROR] client {}: the peer disconnected after {} of {} messages",
                    c.peer, c.echoed, c.iters
                );
                st.failed += 1;
            }
            // Removing it takes its QP off the shared CQ; the others go on.
            release(st, c);
        }
        CmEventType::Rejected | CmEventType::ConnectError | CmEventType::Unreachable => {
            if let Some((acc, peer, _)) = st.accepting.remove(&ev.id()) {
                if let Some(p) = &mut st.pool {
                    for (slot, mr, _) in st.early.remove(&acc.qp().qp_num()).unwrap_or_default() {
                        repost(p, slot, mr);
                    }
                }
                eprintln!("[ERROR] client {peer}: {} during the handshake", ev.event_type());
                st.failed += 1;
            }
        }
        _ => {}
    }
}

fn accept(args: &Args, st: &mut State, req: ConnectRequest, peer: String) -> Result<(), String> {
    let parsed = match Request::decode(req.private_data()) {
        Ok(r) => r,
        Err(why) => {
            let _ = req.reject(why.as_bytes().get(..100).unwrap_or(why.as_bytes()));
            return Err(format!("rejected: {why}"));
        }
    };
    let (mode, size, iters) = parsed.map_or((Mode::Send, LEGACY_SIZE, 1), |r| (r.mode, r.size, r.iters));
    if mode != Mode::Send || size > args.slot {
        let why = format!("the shared server echoes send mode up to {} bytes", args.slot);
        let _ = req.reject(why.as_bytes());
        return Err(format!("rejected: asked for {mode} of {size} bytes; {why}"));
    }
    if st.clients.len() + st.accepting.len() >= args.max_clients as usize {
        let _ = req.reject(b"server full");
        return Err("rejected: server full (--max-clients)".into());
    }
    if st.pool.is_none() {
        st.pool = Some(pool(&req, args).map_err(|e| e.to_string())?);
    }
    let p = st.pool.as_mut().expect("just made");
    // The QP completes on the lane's CQ and takes its receives from the lane's SRQ from the
    // start; the lane takes the QP itself once established (the accept runs on the shared
    // channel, without blocking).
    let init = p.lane.srq_qp_init(p.srq, QpInit::new().max_send_wr(SEND_DEPTH)).map_err(|e| e.to_string())?;
    let pending = req.create_qp(&p.pd, init).map_err(|e| e.to_string())?;
    let info = QpInfo { qp_num: pending.qp().qp_num(), ..QpInfo::default() };
    let param = ConnParam::new().private_data(&info.encode()).map_err(|e| e.to_string())?;
    let acc = pending.start_accept(&param).map_err(|e| e.to_string())?;
    st.early.insert(acc.qp().qp_num(), Vec::new());
    st.accepting.insert(acc.handle(), (acc, peer, iters));
    Ok(())
}

/// Removes a client's QP from the lane. The echoes it still had in flight are flushed: their
/// completions come out of a later poll, and their slots go back to the SRQ from there.
fn release(st: &mut State, c: Client) {
    if let Some(p) = &mut st.pool {
        if let Err(e) = p.lane.remove(c.qp) {
            eprintln!("[ERROR] client {}: removing its QP: {e}", c.peer);
        }
    }
}

/// Returns a slot to the SRQ.
fn repost(p: &mut Pool, slot: u64, mr: MemoryRegion) {
    let _ = p.lane.post_srq_recv(p.srq, RecvWr::new(mr).wr_id(slot));
}

/// Echoes `n` bytes of `slot` to client `q`, from the slot itself: it returns to the SRQ
/// once the send completes.
fn echo(st: &mut State, q: u32, slot: u64, mr: MemoryRegion, n: usize) {
    let (Some(p), Some(c)) = (&mut st.pool, st.clients.get_mut(&q)) else { return };
    c.last = Instant::now();
    c.echo_len = n;
    if c.iters == 1 {
        println!("[INFO] Received {n} bytes");
    }
    // Counted once posted: the client may see the echo, and leave, before this loop polls
    // the send's completion.
    match p.lane.post_send(c.qp, SendWr::send(mr, 0..n).wr_id(slot)) {
        Ok(()) => c.echoed += 1,
        Err(e) => {
            eprintln!("[ERROR] client {}: {e}", c.peer);
            let (_, back) = e.into_parts();
            if let Some(mr) = back {
                repost(p, slot, mr);
            }
        }
    }
}

fn on_completion(st: &mut State, wc: &Wc, mr: Option<MemoryRegion>) {
    let (Some(p), Some(mr)) = (&mut st.pool, mr) else { return };
    let slot = wc.wr_id();
    match wc.queue() {
        WorkQueue::Recv => {
            if let Some(e) = wc.error() {
                if let Some(c) = st.clients.get(&wc.qp_num()) {
                    eprintln!("[ERROR] client {}: {e}", c.peer);
                }
                return repost(p, slot, mr);
            }
            let n = wc.byte_len() as usize;
            if st.clients.contains_key(&wc.qp_num()) {
                echo(st, wc.qp_num(), slot, mr, n);
            } else if let Some(early) = st.early.get_mut(&wc.qp_num()) {
                early.push((slot, mr, n));
            } else {
                // Its QP is gone: the slot goes back.
                repost(p, slot, mr);
            }
        }
        WorkQueue::Send => {
            if let Some(c) = st.clients.get_mut(&wc.qp_num()) {
                if wc.is_ok() && c.iters == 1 {
                    println!("[INFO] Sent {} bytes", c.echo_len);
                }
            }
            repost(p, slot, mr);
        }
    }
}
