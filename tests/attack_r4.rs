//! Round-4 review: an outside-style attack, in safe code only, on the data path that came with
//! UD (`ud`, `ud_cm`, `ah`), multicast and asynchronous events. Each attempt is a device test
//! that asserts the safe outcome: a clear error with nothing held, or a region that stays out
//! of reach until its completion is reaped, or an object that is not told about another's
//! event.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::ud::{ud_pair, UdPair};
use common::{pattern, DeviceTest, T};
use rdma_cm::{
    AccessFlags, AddressHandle, AsyncElement, AsyncEvent, AsyncEvents, Datagram, Error, Grh, JoinKind, McastClient,
    McastEndpoint, MemoryRegion, ProtectionDomain, QpInit, RecvWr, SharedReceiveQueue, UdClient, UdDest, UdSendWr,
    UdServer, VerbsContext, WorkCompletion, WorkQueue, GRH_LEN,
};

/// Reads `events` (bounded by `within`) until one satisfies `want`.
fn wait_event(events: &mut AsyncEvents, within: Duration, want: impl Fn(&AsyncEvent) -> bool) -> AsyncEvent {
    let deadline = Instant::now() + within;
    let mut others = vec![];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.next(left) {
            Ok(ev) if want(&ev) => return ev,
            Ok(ev) => others.push(ev),
            Err(e) => panic!("the expected event did not come within {within:?} ({e}); others seen: {others:?}"),
        }
    }
}

/// A second receive still posted on the same region keeps `Datagram::parse` (and the region's
/// bytes) out of reach even once the first receive's completion is reaped: the device may
/// still write the other range.
#[test]
fn parse_refuses_a_region_another_posted_receive_still_uses() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7401, QpInit::new());
    let slot = GRH_LEN + 64;
    let mut rbuf = MemoryRegion::new(server.qp().pd(), 2 * slot, AccessFlags::LOCAL_WRITE).unwrap();
    server
        .qp_mut()
        .post_recv(&[RecvWr::new(&rbuf, 0..slot).wr_id(1), RecvWr::new(&rbuf, slot..2 * slot).wr_id(2)])
        .unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[0xa5; 64]).wr_id(10)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 10, T).unwrap();
    let wc1 = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    assert!(
        matches!(Datagram::parse(&wc1, &mut rbuf, 0), Err(Error::InFlight { .. })),
        "the second receive still lets the device write the region"
    );
    assert!(matches!(rbuf.as_slice(), Err(Error::InFlight { .. })));
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[0x5a; 64]).wr_id(11)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 11, T).unwrap();
    let wc2 = server.qp_mut().wait_for(WorkQueue::Recv, 2, T).unwrap();
    let d1 = Datagram::parse(&wc1, &mut rbuf, 0).unwrap();
    let d2 = Datagram::parse(&wc2, &mut rbuf, slot).unwrap();
    let bytes = rbuf.as_slice().unwrap();
    assert!(bytes[d1.payload()].iter().all(|&b| b == 0xa5));
    assert!(bytes[d2.payload()].iter().all(|&b| b == 0x5a));
    drop((client, server, to_server, to_client, rbuf));
    t.finish();
}

/// A peer's datagram larger than the receive buffer: the completion is an error (or the
/// message is cut to the buffer), or the datagram is dropped, `Datagram::parse` never names
/// bytes past the buffer, and the neighbouring chunk of the same registration is untouched.
///
/// Both outcomes are real: Debian 12's rxe (6.1) completes the receive with an error, and
/// Debian 13's (6.12) drops the datagram silently, as hardware does (IBA C9-92's length check,
/// rxe's `check_length`). A datagram that fits, sent right after, tells them apart without
/// waiting for nothing: a drop leaves the receive to it.
#[test]
fn a_datagram_larger_than_the_buffer_writes_nothing_past_it() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7402, QpInit::new());
    let chunk = GRH_LEN + 32;
    let mut chunks =
        MemoryRegion::new(server.qp().pd(), 2 * chunk, AccessFlags::LOCAL_WRITE).unwrap().split(chunk).unwrap();
    let canary = pattern(chunk, 77);
    chunks[1].as_mut_slice().unwrap().copy_from_slice(&canary);
    server.qp_mut().post_recv(&[RecvWr::new(&chunks[0], 0..chunk).wr_id(1)]).unwrap();
    let big = pattern(512, 5);
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &big[..200]).wr_id(2)]).ok();
    if client.qp().outstanding_sends() == 0 {
        // Inline capacity too small: send from a region instead.
        let mut s = MemoryRegion::new(client.qp().pd(), 512, AccessFlags::LOCAL_WRITE).unwrap();
        s.as_mut_slice().unwrap().copy_from_slice(&big);
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &s, 0..512).wr_id(2)]).unwrap();
    }
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let fits = pattern(8, 6);
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &fits).wr_id(3)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let mut wcs = [WorkCompletion::default(); 1];
    let n = server.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
    assert_eq!(n, 1, "the receive completes: with the too-long datagram, or with the one that fits after it");
    let wc = wcs[0];
    eprintln!(
        "measured: a 200/512-byte datagram into a {chunk}-byte receive, then an 8-byte one: {} byte_len {}",
        wc.status(),
        wc.byte_len()
    );
    match Datagram::parse(&wc, &mut chunks[0], 0) {
        Err(Error::WorkCompletion { .. }) => {}
        // Dropped: the receive holds the datagram that fits, whole.
        Ok(d) if wc.byte_len() as usize == GRH_LEN + fits.len() => {
            assert_eq!(&chunks[0].as_slice().unwrap()[d.payload()], &fits[..], "the datagram after the dropped one")
        }
        Ok(d) => assert!(d.payload().end <= chunk, "payload {:?} past the {chunk}-byte buffer", d.payload()),
        Err(e) => panic!("unexpected error: {e}"),
    }
    assert_eq!(chunks[1].as_slice().unwrap(), &canary[..], "the neighbouring chunk was written");
    assert_eq!(server.qp().outstanding_recvs(), 0);
    drop((client, server, to_server, to_client, chunks));
    t.finish();
}

/// A datagram over the MTU, a receive without room for the GRH, and a batch whose second send
/// names an address handle of another PD: each refused before posting, with nothing held
/// (regions and handles back to one owner, no outstanding work).
#[test]
fn refused_ud_posts_hold_nothing() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7403, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let mtu = client.qp().mtu() as usize;
    let sbuf = MemoryRegion::new(&pd, mtu + 1, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..mtu + 1)]).unwrap_err();
    assert!(matches!(e, Error::MessageTooLong { .. }), "{e}");
    assert!(e.to_string().contains(&mtu.to_string()), "the error names the MTU: {e}");
    // Another PD on the same context.
    let other_pd = ProtectionDomain::new(pd.context()).unwrap();
    let foreign =
        UdDest::new(AddressHandle::new(&other_pd, to_server.ah().attr()).unwrap(), to_server.qpn(), to_server.qkey());
    let e = client
        .qp_mut()
        .post_send(&[UdSendWr::send(&to_server, &sbuf, 0..8).wr_id(1), UdSendWr::send(&foreign, &sbuf, 0..8).wr_id(2)])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(client.qp().outstanding_sends(), 0, "a refused batch posts none of its sends");
    assert_eq!(sbuf.outstanding(), 0);
    assert_eq!(Arc::strong_count(foreign.ah()), 1);
    // A receive with no room for the GRH.
    let rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN, AccessFlags::LOCAL_WRITE).unwrap();
    let e = server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN - 1)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("GRH"), "{e}");
    assert_eq!(rbuf.outstanding(), 0);
    assert_eq!(server.qp().outstanding_recvs(), 0);
    // After all that, the QP still works.
    client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..8).wr_id(3)]).unwrap();
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap().is_ok());
    drop((client, server, to_server, to_client, sbuf, rbuf, foreign, other_pd, pd));
    t.finish();
}

/// An address handle made on a PD of a context the caller opened itself (not librdmacm's):
/// refused by the UD QP, never handed to the provider.
#[test]
fn an_address_handle_of_another_context_is_refused() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, server, to_client } = ud_pair(t.addr, 7404, QpInit::new());
    let name = client.qp().pd().context().device_name();
    let ctx = VerbsContext::open(&name).unwrap();
    assert!(!ctx.same_as(client.qp().pd().context()), "a context of our own, not librdmacm's");
    let pd2 = ProtectionDomain::new(&ctx).unwrap();
    let dest = UdDest::new(AddressHandle::new(&pd2, to_server.ah().attr()).unwrap(), to_server.qpn(), to_server.qkey());
    let e = client.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"x")]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(client.qp().outstanding_sends(), 0);
    drop((client, server, to_server, to_client, dest, pd2, ctx));
    t.finish();
}

/// Sends to a QP number nobody has, and with a QKey the receiver does not accept: UD loses them
/// (no hang, no error), and each send's address handle is released once its completion is
/// reaped. A zero-byte datagram is all GRH: its payload is empty and in bounds.
#[test]
fn sends_to_nowhere_complete_and_release_their_handles_and_an_empty_datagram_parses() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7405, QpInit::new());
    let pd = Arc::clone(client.qp().pd());
    let ah = AddressHandle::new(&pd, to_server.ah().attr()).unwrap();
    let weak = Arc::downgrade(&ah);
    let nobody = UdDest::new(Arc::clone(&ah), 0x00ab_cdef, to_server.qkey());
    let bad_qkey = UdDest::new(ah, to_server.qpn(), to_server.qkey() ^ 0x0f0f);
    client
        .qp_mut()
        .post_send(&[
            UdSendWr::send_inline(&nobody, b"lost").wr_id(1),
            UdSendWr::send_inline(&bad_qkey, b"lost").wr_id(2),
        ])
        .unwrap();
    drop((nobody, bad_qkey));
    assert!(weak.upgrade().is_some());
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap().is_ok());
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap().is_ok());
    assert!(weak.upgrade().is_none(), "reaping both completions releases the handle");
    // The empty datagram: the receive's first completion must be it (the lost ones never came).
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(5)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, b"").wr_id(3)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 3, T).unwrap();
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 5, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert!(d.is_empty() && d.payload() == (GRH_LEN..GRH_LEN), "{:?}", d.payload());
    assert_eq!(d.src_qp(), client.qp().qp_num());
    drop((client, server, to_server, to_client, rbuf, pd));
    t.finish();
}

/// A forged GRH (what a hostile peer controls: every byte of the header area as the provider
/// hands it up) fed to the reply helpers: random bytes, IPv4 headers naming the unspecified,
/// broadcast, multicast and loopback addresses as the sender. Never a panic; either a clear
/// error naming the verb, or a handle for exactly the address the header claims.
#[test]
fn forged_grh_gives_an_error_or_the_claimed_address_never_a_panic() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7406, QpInit::new());
    let spd = Arc::clone(server.qp().pd());
    let mut rbuf = MemoryRegion::new(&spd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, b"hi").wr_id(2)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let wc = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let real = *Datagram::parse(&wc, &mut rbuf, 0).unwrap().grh().unwrap();
    let mut forged: Vec<[u8; GRH_LEN]> = (0u8..32).map(|s| pattern(GRH_LEN, s).try_into().unwrap()).collect();
    for src in [[0, 0, 0, 0], [255, 255, 255, 255], [239, 1, 1, 1], [127, 0, 0, 1], [10, 77, 0, 99]] {
        let mut b = *real.as_bytes();
        b[32..36].copy_from_slice(&src);
        forged.push(b);
    }
    forged.push([0xff; GRH_LEN]);
    let (mut ok, mut refused) = (0, 0);
    for b in forged {
        let g = Grh::from_bytes(b);
        let _ = (g.is_ipv4(), g.is_ipv6(), g.sgid(), g.dgid(), g.src_ip(), format!("{g:?}"));
        match AddressHandle::reply_to(&spd, server.qp().port_num(), &wc, &g) {
            Ok(ah) => {
                ok += 1;
                if let Some(sgid) = g.sgid() {
                    assert_eq!(ah.attr().dgid(), sgid, "the handle answers the claimed sender");
                }
            }
            Err(Error::Call { op, .. }) => {
                refused += 1;
                assert!(op.starts_with("ibv_"), "{op}");
            }
            Err(e) => panic!("unexpected error kind for a forged GRH: {e}"),
        }
    }
    eprintln!("measured: forged GRHs: {ok} gave a handle, {refused} refused");
    drop((client, server, to_server, to_client, rbuf, spd));
    t.finish();
}

/// A panic right after posting (the endpoint unwinds with a receive and a send posted): the
/// QP's drop reaps or outlives them, and afterwards both regions are back with one owner and
/// readable; nothing is leaked on the device.
#[test]
fn a_panic_with_work_posted_leaves_the_regions_whole() {
    let t = DeviceTest::start();
    let UdPair { client, to_server, server, to_client } = ud_pair(t.addr, 7407, QpInit::new());
    let mut rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut sbuf = MemoryRegion::new(client.qp().pd(), 64, AccessFlags::LOCAL_WRITE).unwrap();
    sbuf.as_mut_slice().unwrap().fill(3);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let (mut client, mut server) = (client, server);
        server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 64).wr_id(1)]).unwrap();
        client.qp_mut().post_send(&[UdSendWr::send(&to_server, &sbuf, 0..64).wr_id(2)]).unwrap();
        assert_eq!(rbuf.outstanding(), 1);
        panic!("a caller's bug, mid-flight");
    }));
    assert!(r.is_err());
    assert_eq!(rbuf.outstanding(), 0, "the receive's slot went with the QP");
    assert_eq!(sbuf.outstanding(), 0);
    assert!(rbuf.as_slice().is_ok() && rbuf.as_mut_slice().is_ok());
    assert!(sbuf.as_slice().unwrap().iter().all(|&b| b == 3));
    drop((to_server, to_client, rbuf, sbuf));
    t.finish();
}

/// Posting on a UD QP the caller moved to the error state. Measured on rxe before the fix: a
/// send posted then is flushed, but a receive posted then is never flushed: it stayed held
/// (region unreadable), its wait ran to the timeout, and the QP's drop waited out its drain
/// bound. Now both are refused with nothing held; work posted before `set_error` still flushes
/// and is released when reaped.
#[test]
fn posts_after_set_error_are_refused_with_nothing_held() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7408, QpInit::new());
    let mut before = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&before, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().set_error().unwrap();
    server.qp_mut().set_error().unwrap();
    let flushed = server.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap_err();
    assert!(matches!(flushed, Error::WorkCompletion { wr_id: 1, .. }), "{flushed}");
    assert!(before.as_slice().is_ok(), "the flushed receive's region is back");
    let ah = AddressHandle::new(client.qp().pd(), to_server.ah().attr()).unwrap();
    let weak = Arc::downgrade(&ah);
    let dest = UdDest::new(ah, to_server.qpn(), to_server.qkey());
    let sbuf = MemoryRegion::new(client.qp().pd(), 32, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client.qp_mut().post_send(&[UdSendWr::send(&dest, &sbuf, 0..32).wr_id(2)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("error state"), "{e}");
    assert!(sbuf.outstanding() == 0 && client.qp().outstanding_sends() == 0);
    drop(dest);
    assert!(weak.upgrade().is_none());
    let rbuf = MemoryRegion::new(server.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let e = server.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 8).wr_id(3)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("ibv_post_recv"), "{e}");
    assert!(rbuf.outstanding() == 0 && server.qp().outstanding_recvs() == 0);
    drop((client, server, to_server, to_client, sbuf, rbuf, before));
    t.finish();
}

/// A UD server QP that takes its receives from an SRQ, and the regions posted there.
struct SrqServer {
    ep: rdma_cm::UdEndpoint,
    srq: SharedReceiveQueue,
    chunks: Vec<MemoryRegion>,
    ctx: VerbsContext,
}

/// A UD client connected to a UD server whose QP draws on an SRQ of `n` receives of `slot`
/// bytes each (all posted, and the limit armed when given, before the accept).
fn ud_srq_pair(
    addr: std::net::IpAddr,
    port: u16,
    n: usize,
    slot: usize,
    limit: Option<u32>,
) -> (rdma_cm::UdEndpoint, UdDest, SrqServer) {
    let l = UdServer::new().unwrap().listen(SocketAddr::new(addr, port), 4).unwrap();
    let client = std::thread::spawn(move || {
        let route = UdClient::new()
            .unwrap()
            .resolve_addr(None, SocketAddr::new(addr, port), T)
            .unwrap()
            .resolve_route(T)
            .unwrap();
        let pd = route.alloc_pd().unwrap();
        let mut ep = route.create_qp(&pd, QpInit::new()).unwrap();
        let dest = ep.connect(&[], T).unwrap();
        (ep, dest)
    });
    let req = l.get_request(T).unwrap();
    let ctx = req.context().unwrap();
    let pd = req.alloc_pd().unwrap();
    let chunks = MemoryRegion::new(&pd, n * slot, AccessFlags::LOCAL_WRITE).unwrap().split(slot).unwrap();
    let srq = SharedReceiveQueue::new(&pd, n as u32).unwrap();
    let recvs: Vec<RecvWr> =
        chunks.iter().enumerate().map(|(i, m)| RecvWr::new(m, 0..slot).wr_id(100 + i as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    drop(recvs);
    if let Some(k) = limit {
        srq.arm_limit(k).unwrap();
    }
    let sq = req.create_qp(&pd, QpInit::new().srq(&srq)).unwrap();
    let ep = sq.accept(&[]).unwrap();
    let (cep, dest) = client.join().unwrap();
    drop(l);
    (cep, dest, SrqServer { ep, srq, chunks, ctx })
}

/// A UD QP on an SRQ: posting receives to the QP itself is refused; a datagram lands in an SRQ
/// chunk, which `Datagram::parse` reads only once its completion is reaped, while the chunks
/// still posted stay unreadable; the SRQ's limit event reaches the SRQ and every source (two
/// of them, each its own copy); and an SRQ made after the first is gone (possibly at the same
/// address) is not told about the old one's event.
#[test]
fn ud_on_an_srq_two_sources_and_a_reused_address() {
    let t = DeviceTest::start();
    let slot = GRH_LEN + 64;
    let (mut client, to_server, mut s) = ud_srq_pair(t.addr, 7409, 4, slot, Some(2));
    let mut a = s.ctx.async_events().unwrap();
    let mut b = s.ctx.async_events().unwrap();
    let spare = MemoryRegion::new(client.qp().pd(), slot, AccessFlags::LOCAL_WRITE).unwrap();
    drop(spare);
    let r = MemoryRegion::new(s.srq.pd(), slot, AccessFlags::LOCAL_WRITE).unwrap();
    let e = s.ep.qp_mut().post_recv(&[RecvWr::new(&r, 0..slot)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(r.outstanding(), 0);
    for i in 0..3u8 {
        client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[i; 64]).wr_id(i as u64)]).unwrap();
        client.qp_mut().wait_for(WorkQueue::Send, i as u64, T).unwrap();
    }
    let mut got = vec![];
    while got.len() < 3 {
        let mut wcs = [WorkCompletion::default(); 4];
        let n = s.ep.qp_mut().wait_queue(WorkQueue::Recv, &mut wcs, T).unwrap();
        assert!(n > 0, "only {} of 3 datagrams arrived", got.len());
        got.extend_from_slice(&wcs[..n]);
    }
    let mut seen = [false; 4];
    for wc in &got {
        let k = (wc.wr_id() - 100) as usize;
        seen[k] = true;
        let d = Datagram::parse(wc, &mut s.chunks[k], 0).unwrap();
        let v = s.chunks[k].as_slice().unwrap()[d.payload()].to_vec();
        assert!(v.len() == 64 && v.iter().all(|&x| x == v[0]) && v[0] < 3, "{v:?}");
    }
    let posted = seen.iter().position(|&x| !x).unwrap();
    assert!(matches!(Datagram::parse(&got[0], &mut s.chunks[posted], 0), Err(Error::InFlight { .. })));
    assert!(matches!(s.chunks[posted].as_slice(), Err(Error::InFlight { .. })));
    // The limit event: both sources get it; the SRQ is marked.
    let old_raw = s.srq.as_raw() as usize;
    let ea = wait_event(&mut a, T, |e| e.is_srq_limit());
    let eb = wait_event(&mut b, T, |e| e.is_srq_limit());
    assert_eq!(ea, eb);
    assert_eq!(ea.element, AsyncElement::Srq(old_raw));
    assert!(s.srq.limit_reached().unwrap());
    // Tear the server down, then make a fresh SRQ on a fresh PD of the same context.
    let SrqServer { ep, srq, chunks, ctx } = s;
    drop(ep);
    drop(srq);
    assert!(chunks.iter().all(|c| c.outstanding() == 0), "the SRQ's receives went with it");
    drop(chunks);
    let pd2 = ProtectionDomain::new(&ctx).unwrap();
    let fresh: Vec<SharedReceiveQueue> = (0..4).map(|_| SharedReceiveQueue::new(&pd2, 4).unwrap()).collect();
    let reused = fresh.iter().any(|q| q.as_raw() as usize == old_raw);
    eprintln!("measured: a fresh SRQ reused the old one's address: {reused}");
    for q in &fresh {
        assert!(!q.limit_reached().unwrap(), "a new SRQ was told about the old one's limit event");
        assert_eq!(q.last_async_event().unwrap(), None);
    }
    drop((fresh, pd2, a, b, ctx, client, to_server, r));
    t.finish();
}

/// A multicast endpoint bound to the device, loopback on.
fn mcast_endpoint(src: std::net::IpAddr, g: std::net::IpAddr) -> McastEndpoint {
    let r = McastClient::new().unwrap().resolve(Some(src), g, T).unwrap();
    let pd = r.alloc_pd().unwrap();
    r.create_qp(&pd, QpInit::new().max_send_wr(8).max_recv_wr(8)).unwrap()
}

/// A send to the group after leaving it, through a clone of the membership's destination: the
/// handle lives in the send's slot until its completion, the send completes, and nothing is
/// left behind. The clone is refused by another endpoint (another PD).
#[test]
fn a_multicast_send_after_leave_and_on_another_endpoint() {
    let t = DeviceTest::start();
    let g: std::net::IpAddr = "239.1.4.1".parse().unwrap();
    let mut ep = mcast_endpoint(t.addr, g);
    let mut other = mcast_endpoint(t.addr, g);
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    let dest = m.dest().clone();
    m.leave().unwrap();
    let weak = Arc::downgrade(dest.ah());
    ep.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"after leave").wr_id(1)]).unwrap();
    let e = other.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"x").wr_id(2)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert_eq!(other.qp().outstanding_sends(), 0);
    drop(dest);
    assert!(weak.upgrade().is_some(), "the posted send holds the group's handle");
    assert!(ep.qp_mut().wait_for(WorkQueue::Send, 1, T).unwrap().is_ok());
    assert!(weak.upgrade().is_none());
    drop((ep, other));
    t.finish();
}

/// Every drop order of endpoint and membership, a membership forgotten (its leave never runs),
/// and the same group joined twice on one endpoint: the QP is always destroyed when the
/// endpoint goes (the kernel refuses while it is attached: that would leak it), nothing hangs,
/// and a fresh member receives through the group afterwards.
#[test]
fn memberships_and_endpoints_dropped_in_any_order_or_forgotten() {
    let t = DeviceTest::start();
    let g: std::net::IpAddr = "239.1.4.2".parse().unwrap();
    let qps = || common::resources().into_iter().find(|(k, _)| *k == "qp").unwrap().1;
    let base = qps();
    // Endpoint first, membership after.
    let mut ep = mcast_endpoint(t.addr, g);
    let m = ep.join(JoinKind::FullMember, T).unwrap();
    drop(ep);
    assert_eq!(qps(), base, "the endpoint's QP is destroyed while its membership lives");
    drop(m);
    // Membership forgotten (ManuallyDrop, undone at the end).
    let mut ep = mcast_endpoint(t.addr, g);
    let kept = std::mem::ManuallyDrop::new(ep.join(JoinKind::FullMember, T).unwrap());
    drop(ep);
    assert_eq!(qps(), base, "a forgotten membership does not keep the QP attached");
    // Joined twice on one endpoint.
    let mut ep = mcast_endpoint(t.addr, g);
    let m1 = ep.join(JoinKind::FullMember, T).unwrap();
    let second = ep.join(JoinKind::FullMember, T);
    // A second join on one id would share the first's attachment, and one leave would end both
    // (librdmacm leaves the first it finds): refused, naming the group.
    let err = second.as_ref().expect_err("a second join of a group on one endpoint is refused").to_string();
    assert!(err.contains("239.1.4.2") && err.contains("already holds a membership"), "{err}");
    drop(m1);
    // Once the first membership has left, the group can be joined again.
    let again = ep.join(JoinKind::FullMember, T).expect("the group is joined again after the leave");
    drop(again);
    drop(ep);
    assert_eq!(qps(), base, "the twice-joined endpoint's QP is destroyed");
    drop(second);
    drop(std::mem::ManuallyDrop::into_inner(kept));
    // A fresh member still receives through the group.
    let mut rx = mcast_endpoint(t.addr, g);
    let mut rbuf = MemoryRegion::new(rx.qp().pd(), GRH_LEN + 16, AccessFlags::LOCAL_WRITE).unwrap();
    rx.qp_mut().post_recv(&[RecvWr::new(&rbuf, 0..GRH_LEN + 16).wr_id(1)]).unwrap();
    let m = rx.join(JoinKind::FullMember, T).unwrap();
    let dest = m.dest().clone();
    rx.qp_mut().post_send(&[UdSendWr::send_inline(&dest, b"still works").wr_id(2)]).unwrap();
    rx.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    let wc = rx.qp_mut().wait_for(WorkQueue::Recv, 1, T).unwrap();
    let d = Datagram::parse(&wc, &mut rbuf, 0).unwrap();
    assert_eq!(&rbuf.as_slice().unwrap()[d.payload()], b"still works");
    drop((dest, m, rx, rbuf));
    t.finish();
}

/// A peer's datagram longer than the posted receive. Measured on rxe (6.1): the receive fails
/// (`LOC_QP_OP_ERR`) and the UD QP goes to the error state, so one hostile datagram stops it
/// receiving; before the fix, the next receive was accepted and never completed (its wait
/// timed out blaming the peer). Now the QP refuses posts with an error that names the cause
/// and `UdQp::recv_len`, and holds nothing. On rxe 6.12 (as on hardware) the datagram is
/// dropped instead and the QP lives on: a datagram that fits, sent after it, then completes
/// the receive, and the QP still takes receives. Then, on the healthy QP: gathered sends
/// naming a region of another PD, and a batch of receives whose second has no room for the
/// GRH, are refused whole.
#[test]
fn a_too_long_datagram_stops_the_qp_and_posts_then_say_why() {
    let t = DeviceTest::start();
    let UdPair { mut client, to_server, mut server, to_client } = ud_pair(t.addr, 7410, QpInit::new());
    let spd = Arc::clone(server.qp().pd());
    let small = MemoryRegion::new(&spd, GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let mut ok = MemoryRegion::new(&spd, GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
    server.qp_mut().post_recv(&[RecvWr::new(&small, 0..GRH_LEN + 8).wr_id(1)]).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[1; 64]).wr_id(2)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 2, T).unwrap();
    client.qp_mut().post_send(&[UdSendWr::send_inline(&to_server, &[2; 8]).wr_id(4)]).unwrap();
    client.qp_mut().wait_for(WorkQueue::Send, 4, T).unwrap();
    match server.qp_mut().wait_for(WorkQueue::Recv, 1, T) {
        Err(e) => {
            assert!(matches!(e, Error::WorkCompletion { wr_id: 1, .. }), "{e}");
            let state = server.qp().qp().attributes().unwrap().state;
            eprintln!("measured: the UD QP after a too-long datagram: {state:?}");
            assert_eq!(state, rdma_cm::QpState::Error, "if the QP survives, the refusal below is too strict");
            let e = server.qp_mut().post_recv(&[RecvWr::new(&ok, 0..GRH_LEN + 64).wr_id(3)]).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("recv_len"), "{e}");
            assert!(ok.outstanding() == 0 && server.qp().outstanding_recvs() == 0);
            assert!(ok.as_mut_slice().is_ok());
        }
        Ok(wc) => {
            // Dropped: the receive took the datagram that fits, and the QP lives on.
            assert_eq!(wc.byte_len() as usize, GRH_LEN + 8, "the datagram after the dropped one");
            let state = server.qp().qp().attributes().unwrap().state;
            eprintln!("measured: the too-long datagram was dropped; the UD QP is {state:?}");
            assert_eq!(state, rdma_cm::QpState::ReadyToSend);
            server.qp_mut().post_recv(&[RecvWr::new(&ok, 0..GRH_LEN + 64).wr_id(3)]).unwrap();
            assert_eq!((ok.outstanding(), server.qp().outstanding_recvs()), (1, 1));
            // The receive is reaped by the QP's drop below (its flush); the region goes with it.
        }
    }
    // Gathered sends naming a region of another PD are refused before posting.
    let other = ProtectionDomain::new(client.qp().pd().context()).unwrap();
    let a = MemoryRegion::new(client.qp().pd(), 8, AccessFlags::LOCAL_WRITE).unwrap();
    let b = MemoryRegion::new(&other, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let pieces = [(&a, 0..8), (&b, 0..8)];
    let r = UdSendWr::send_sg(&to_server, &pieces).and_then(|w| client.qp_mut().post_send(&[w]));
    assert!(r.is_err(), "a piece on another PD was posted");
    assert!(a.outstanding() == 0 && b.outstanding() == 0 && client.qp().outstanding_sends() == 0);
    // A batch of receives whose second has no room for the GRH: none is posted.
    let c = MemoryRegion::new(client.qp().pd(), GRH_LEN + 8, AccessFlags::LOCAL_WRITE).unwrap();
    let e = client
        .qp_mut()
        .post_recv(&[RecvWr::new(&c, 0..GRH_LEN + 8).wr_id(5), RecvWr::new(&a, 0..8).wr_id(6)])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("GRH"), "{e}");
    assert!(c.outstanding() == 0 && a.outstanding() == 0 && client.qp().outstanding_recvs() == 0);
    // The healthy QP still sends.
    client.qp_mut().post_send(&[UdSendWr::send_sg(&to_server, &pieces[..1]).unwrap().wr_id(7)]).unwrap();
    assert!(client.qp_mut().wait_for(WorkQueue::Send, 7, T).unwrap().is_ok());
    drop((client, server, to_server, to_client, small, ok, a, b, c, other, spd));
    t.finish();
}
