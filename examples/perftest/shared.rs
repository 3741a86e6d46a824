//! `--shared`: every client from one thread, on one event channel, one CQ and one SRQ.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Args, STOP};
use crate::common::fail;
use crate::protocol::{Mode, Request, LEGACY_SIZE};
use rdma_cm::{
    Accepting, AccessFlags, CmEvent, CmEventType, CompletionQueue, ConnParam, ConnectRequest, Connection, EventChannel,
    IdHandle, Listener, MemoryRegion, ProtectionDomain, QpInfo, QpInit, RecvWr, SendWr, Server, SharedReceiveQueue,
    WorkCompletion, WorkQueue,
};

/// Send queue depth of each client's QP: one echo in flight per message, a few to spare.
const SEND_DEPTH: u32 = 4;

/// What the whole server shares, made on the first request (it fixes the device).
struct Pool {
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    srq: SharedReceiveQueue,
    slots: Vec<MemoryRegion>,
}

/// One client.
struct Client {
    conn: Connection,
    peer: String,
    iters: u32,
    echoed: u32,
    /// Bytes of the echo in flight (for the log line).
    echo_len: usize,
    /// Slots whose echo is posted and not yet reaped: if the client goes first, its QP's
    /// drop reaps them, and they go back to the SRQ from here.
    in_flight: Vec<usize>,
    last: Instant,
}

struct State {
    pool: Option<Pool>,
    accepting: HashMap<IdHandle, (Accepting, String, u32)>,
    /// Receives that completed for a QP still waiting for its ESTABLISHED (the client may
    /// send as soon as it has the accept): (slot, bytes), echoed once it is established.
    early: HashMap<u32, Vec<(usize, usize)>>,
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
    let mut wcs = [WorkCompletion::default(); 64];
    loop {
        let done = args.count.is_some_and(|c| st.served + st.failed >= c);
        if STOP.load(std::sync::atomic::Ordering::SeqCst) || done {
            break;
        }
        while let Some(ev) = ch.try_get_event().unwrap_or_else(|e| fail("reading the event channel", e)) {
            on_event(args, &listener, &mut st, ev);
        }
        let Some(pool) = &st.pool else {
            // Nothing to poll yet: sleep on the channel (bounded, to notice signals).
            match ch.get_event(Duration::from_millis(200)) {
                Ok(ev) => on_event(args, &listener, &mut st, ev),
                Err(rdma_cm::Error::Timeout { .. }) => {}
                Err(e) => fail("reading the event channel", e),
            }
            continue;
        };
        let n = pool.cq.wait(&mut wcs, Duration::from_millis(20)).unwrap_or_else(|e| fail("polling the CQ", e));
        for wc in &wcs[..n] {
            on_completion(&mut st, wc);
        }
        // A client silent for longer than the timeout is dropped; nobody waits for it.
        let now = Instant::now();
        let stale: Vec<u32> = st.clients.iter().filter(|(_, c)| now - c.last > timeout).map(|(&q, _)| q).collect();
        for q in stale {
            let c = st.clients.remove(&q).expect("listed above");
            st.by_id.remove(&c.conn.id().handle());
            eprintln!("[ERROR] client {}: silent for {timeout:?}; dropped", c.peer);
            st.failed += 1;
            release(&st, c);
        }
    }
    println!("[INFO] Server exiting: {} client(s) served, {} failed", st.served, st.failed);
}

fn pool(req: &ConnectRequest, args: &Args) -> rdma_cm::Result<Pool> {
    let ctx = req.context()?;
    let pd = req.alloc_pd()?;
    let depth = SEND_DEPTH * args.max_clients + args.srq_depth;
    let cq = CompletionQueue::new(&ctx, depth)?;
    let srq = SharedReceiveQueue::new(&pd, args.srq_depth)?;
    let region = MemoryRegion::new(&pd, args.slot as usize * args.srq_depth as usize, AccessFlags::LOCAL_WRITE)?;
    let slots = region.split(args.slot as usize)?;
    let recvs: Vec<RecvWr> =
        slots.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..args.slot as usize).wr_id(i as u64)).collect();
    srq.post_recv(&recvs)?;
    Ok(Pool { pd, cq, srq, slots })
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
            match acc.complete(ev) {
                Ok(conn) => {
                    println!("[EVENT] Connection established ({peer}, {} connected)", st.clients.len() + 1);
                    let q = conn.qp().qp_num();
                    st.by_id.insert(conn.id().handle(), q);
                    st.clients.insert(
                        q,
                        Client {
                            conn,
                            peer,
                            iters,
                            echoed: 0,
                            echo_len: 0,
                            in_flight: Vec::new(),
                            last: Instant::now(),
                        },
                    );
                    // Messages that arrived before the handshake finished get their echo now.
                    for (slot, n) in st.early.remove(&q).unwrap_or_default() {
                        echo(st, q, slot, n);
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
            let Some(mut c) = st.clients.remove(&q) else { return };
            c.conn.handle_event(&ev);
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
            // Dropping it takes its QP off the shared CQ; the others go on.
            release(st, c);
        }
        CmEventType::Rejected | CmEventType::ConnectError | CmEventType::Unreachable => {
            if let Some((acc, peer, _)) = st.accepting.remove(&ev.id()) {
                if let Some(p) = &st.pool {
                    for (slot, _) in st.early.remove(&acc.qp().qp_num()).unwrap_or_default() {
                        repost(p, slot);
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
    let p = st.pool.as_ref().expect("just made");
    let init = QpInit::new().max_send_wr(SEND_DEPTH).send_cq(Arc::clone(&p.cq)).recv_cq(Arc::clone(&p.cq)).srq(&p.srq);
    let pending = req.create_qp(&p.pd, init).map_err(|e| e.to_string())?;
    let info = QpInfo { qp_num: pending.qp().qp_num(), ..QpInfo::default() };
    let param = ConnParam::new().private_data(&info.encode()).map_err(|e| e.to_string())?;
    let acc = pending.start_accept(&param).map_err(|e| e.to_string())?;
    st.early.insert(acc.qp().qp_num(), Vec::new());
    st.accepting.insert(acc.handle(), (acc, peer, iters));
    Ok(())
}

/// Drops a client's connection (its QP reaps its own work) and returns the slots of echoes
/// it still had in flight to the SRQ: their completions went with the QP.
fn release(st: &State, c: Client) {
    let Client { conn, in_flight, .. } = c;
    drop(conn);
    if let Some(p) = &st.pool {
        for slot in in_flight {
            repost(p, slot);
        }
    }
}

/// Returns a slot to the SRQ.
fn repost(p: &Pool, slot: usize) {
    let _ = p.srq.post_recv(&[RecvWr::new(&p.slots[slot], 0..p.slots[slot].len()).wr_id(slot as u64)]);
}

/// Echoes `n` bytes of `slot` to client `q`, from the slot itself: it returns to the SRQ
/// once the send completes.
fn echo(st: &mut State, q: u32, slot: usize, n: usize) {
    let (Some(p), Some(c)) = (&st.pool, st.clients.get_mut(&q)) else { return };
    c.last = Instant::now();
    c.echo_len = n;
    if c.iters == 1 {
        println!("[INFO] Received {n} bytes");
    }
    // Counted once posted: the client may see the echo, and leave, before this loop polls
    // the send's completion.
    match c.conn.qp_mut().post_send(&[SendWr::send(&p.slots[slot], 0..n).wr_id(slot as u64)]) {
        Ok(()) => {
            c.echoed += 1;
            c.in_flight.push(slot);
        }
        Err(e) => {
            eprintln!("[ERROR] client {}: {e}", c.peer);
            repost(p, slot);
        }
    }
}

fn on_completion(st: &mut State, wc: &WorkCompletion) {
    let Some(p) = &st.pool else { return };
    let slot = wc.wr_id() as usize;
    match wc.queue() {
        WorkQueue::Recv => {
            let n = match wc.ok() {
                Ok(wc) => wc.byte_len() as usize,
                Err(e) => {
                    if let Some(c) = st.clients.get(&wc.qp_num()) {
                        eprintln!("[ERROR] client {}: {e}", c.peer);
                    }
                    return repost(p, slot);
                }
            };
            if st.clients.contains_key(&wc.qp_num()) {
                echo(st, wc.qp_num(), slot, n);
            } else if let Some(early) = st.early.get_mut(&wc.qp_num()) {
                early.push((slot, n));
            } else {
                // Its QP is gone: the slot goes back.
                repost(p, slot);
            }
        }
        WorkQueue::Send => {
            if let Some(c) = st.clients.get_mut(&wc.qp_num()) {
                c.in_flight.retain(|&s| s != slot);
                if wc.is_ok() && c.iters == 1 {
                    println!("[INFO] Sent {} bytes", c.echo_len);
                }
            }
            repost(p, slot);
        }
    }
}
