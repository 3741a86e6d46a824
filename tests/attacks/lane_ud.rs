//! Unreliable datagrams on the lane: a datagram longer than its receive, posts and lists the
//! lane must refuse with nothing held, destinations (and their address handles) kept for as
//! long as the QP is in the lane, gathered datagrams, and forged GRHs or completions handed to
//! the reply helpers.

use std::sync::Arc;

use crate::common::lane::{lane_ud_pair, reap, LaneUdPair};
use crate::common::{pattern, require, Cap, DeviceTest, T};
use rdma_cm::status::WorkQueue;
use rdma_cm::verbs::ah::{AddressHandle, Grh, GRH_LEN};
use rdma_cm::verbs::lane::{Completion, InlineWr, Lane, RecvWr, SendWr};
use rdma_cm::verbs::ud::UdDest;
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, QpInit, QpState, VerbsContext};

const LW: AccessFlags = AccessFlags::LOCAL_WRITE;

/// A region of `len` bytes on `pd` holding `bytes` at its start.
fn filled(pd: &Arc<ProtectionDomain>, len: usize, bytes: &[u8]) -> MemoryRegion {
    let mut mr = MemoryRegion::new(pd, len, LW).unwrap();
    mr.as_mut_slice().unwrap()[..bytes.len()].copy_from_slice(bytes);
    mr
}

/// Waits on `lane` for the completion of `queue` with `wr_id`; fails on any other.
fn one(lane: &mut Lane, queue: WorkQueue, wr_id: u64) -> Completion {
    let c = lane.wait(T).unwrap_or_else(|e| panic!("no completion for {queue:?} {wr_id}: {e}"));
    assert_eq!((c.queue(), c.wr_id()), (queue, wr_id), "{c:?}");
    c
}

/// A peer's datagram longer than the posted receive (the receive is one chunk of a split
/// registration, the next chunk a canary in the caller's hands). Measured outcomes: Debian 12's
/// rxe (6.1) fails the receive (`LOC_QP_OP_ERR`) and moves the UD QP to the error state;
/// Debian 13's (6.12), as hardware does, drops the datagram and the QP lives on, so the receive
/// takes the datagram that fits, sent right after (which tells the two apart without waiting
/// for nothing). Either way no byte lands past the receive (the canary is whole, a successful
/// receive is no longer than its chunk), the region comes back with the completion, and a QP
/// in the error state refuses the next receive saying why, with the region given back, rather
/// than taking one that never completes.
#[test]
fn a_datagram_longer_than_the_receive_writes_nothing_past_it_and_a_stopped_qp_says_why() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let LaneUdPair { mut client, to_server, server_dest, mut server } =
            lane_ud_pair(t.addr, 7421, QpInit::new(), 64);
        let chunk = GRH_LEN + 32;
        let mut chunks = MemoryRegion::new(&server.pd, 2 * chunk, LW).unwrap().split(chunk).unwrap();
        let canary = pattern(chunk, 77);
        chunks[1].as_mut_slice().unwrap().copy_from_slice(&canary);
        let first = chunks.remove(0);
        server.lane.post_recv(server.qp, RecvWr::new(first).wr_id(1)).unwrap();
        let big = pattern(200, 5);
        let fits = pattern(8, 6);
        let big_mr = filled(&client.pd, 200, &big);
        client.lane.post_send(client.qp, SendWr::send(big_mr, 0..200).to(to_server).wr_id(2)).unwrap();
        assert!(one(&mut client.lane, WorkQueue::Send, 2).is_ok());
        client.lane.post_inline(client.qp, InlineWr::send(&fits).to(to_server).wr_id(3)).unwrap();
        assert!(one(&mut client.lane, WorkQueue::Send, 3).is_ok());
        let mut c = one(&mut server.lane, WorkQueue::Recv, 1);
        let mut region = c.take_region().expect("the receive's region comes back with its completion");
        let state = server.lane.attributes(server.qp).unwrap().state;
        eprintln!(
            "measured: a 200-byte datagram into a {chunk}-byte receive: {:?}, the UD QP then {state:?}",
            c.status()
        );
        let spare = MemoryRegion::new(&server.pd, GRH_LEN + 64, LW).unwrap();
        if c.is_ok() {
            // Dropped: the receive holds the datagram that fits, whole, and the QP lives on.
            assert_eq!(c.byte_len() as usize, GRH_LEN + fits.len(), "the datagram after the dropped one");
            assert_eq!(&region.as_slice().unwrap()[GRH_LEN..GRH_LEN + fits.len()], &fits[..]);
            assert_eq!(state, QpState::ReadyToSend);
            server.lane.post_recv(server.qp, RecvWr::new(spare).wr_id(4)).expect("the QP still takes receives");
            assert_eq!(server.lane.outstanding(server.qp).unwrap(), (0, 1));
        } else {
            assert_eq!(state, QpState::Error, "if the QP survives a failed receive, the refusal below is too strict");
            let (e, back) = server.lane.post_recv(server.qp, RecvWr::new(spare).wr_id(4)).unwrap_err().into_parts();
            assert!(matches!(e, Error::QpInError { .. }), "{e}");
            let mut back = back.expect("the refused receive's region comes back");
            assert!(back.as_mut_slice().is_ok());
            assert_eq!(server.lane.outstanding(server.qp).unwrap(), (0, 0), "nothing is held for a stopped QP");
        }
        assert_eq!(chunks[0].as_slice().unwrap(), &canary[..], "the neighbouring chunk was written");
        drop((client, server, server_dest, chunks, region, c));
    }
    t.finish();
}

/// What the lane refuses before the provider sees it, each with nothing held and the region
/// given back (or left in the list): a send with no destination; a destination registered for
/// another QP of the same lane; a list whose second datagram is over the MTU (the first is not
/// posted either); a piece of a region of another protection domain; a list of receives whose
/// second has no room for the GRH; an address handle of another protection domain of the same
/// context, or of a context the caller opened itself, as a destination (never registered, the
/// caller's handle its only owner). After all that the QP still sends.
#[test]
fn refused_ud_posts_lists_and_destinations_hold_nothing_and_the_qp_still_works() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let init = QpInit::new().max_send_wr(8).max_recv_wr(8);
        let LaneUdPair { mut client, to_server, server_dest, mut server } = lane_ud_pair(t.addr, 7422, init, 64);
        let (lane, qp, pd) = (&mut client.lane, client.qp, Arc::clone(&client.pd));
        let refused = |r: rdma_cm::verbs::lane::Rejected<MemoryRegion>, what: &str| -> MemoryRegion {
            let (e, back) = r.into_parts();
            assert!(matches!(e, Error::InvalidArgument(_) | Error::MessageTooLong { .. }), "{what}: {e}");
            back.unwrap_or_else(|| panic!("{what}: the region comes back"))
        };
        // No destination.
        let mr = MemoryRegion::new(&pd, 64, LW).unwrap();
        let mr = refused(lane.post_send(qp, SendWr::send(mr, 0..8)).unwrap_err(), "a UD send without a destination");
        // A destination registered for another QP of this lane (a second endpoint attached here).
        let other_qp =
            rdma_cm::verbs::ud::UdQp::new(&pd, lane.qp_init_from(QpInit::new()), 1, rdma_cm::verbs::ud::RDMA_UDP_QKEY)
                .unwrap();
        let other = lane.attach(other_qp).map_err(|r| r.into_parts().0).expect("a second UD QP on the lane");
        let others_dest = lane.add_dest(other, &server_dest).unwrap();
        let r = lane.post_send(qp, SendWr::send(mr, 0..8).to(others_dest)).unwrap_err();
        let mr = refused(r, "another QP's destination");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
        // A list whose second datagram is over the MTU (no MTU is above 4096 bytes): none
        // posted, both left in the list.
        let big = MemoryRegion::new(&pd, 4097, LW).unwrap();
        let mut list =
            [Some(SendWr::send(mr, 0..8).to(to_server).wr_id(1)), Some(SendWr::send(big, 0..4097).to(to_server))];
        let e = lane.post_send_list(qp, &mut list).unwrap_err();
        match &e {
            Error::MessageTooLong { len, mtu } => {
                assert!(*len == 4097 && *mtu < 4097, "{e}");
                assert!(e.to_string().contains(&mtu.to_string()), "the error names the MTU: {e}");
            }
            e => panic!("expected MessageTooLong, got {e}"),
        }
        assert!(list.iter().all(Option::is_some), "a refused list posts none of its entries");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
        let [Some(first), Some(_big)] = list else { unreachable!() };
        let mr = first.into_region();
        // A gathered datagram of a region of another protection domain (the server's).
        let foreign = MemoryRegion::new(&server.pd, 64, LW).unwrap();
        let r = lane.post_send(qp, SendWr::send_sg(foreign, &[0..8, 16..24]).to(to_server)).unwrap_err();
        let foreign = refused(r, "a region of another protection domain");
        // A list of receives whose second has no room for the GRH: none posted.
        let a = MemoryRegion::new(&pd, GRH_LEN + 8, LW).unwrap();
        let b = MemoryRegion::new(&pd, GRH_LEN, LW).unwrap();
        let mut recvs = [Some(RecvWr::new(a).wr_id(5)), Some(RecvWr::range(b, 0..GRH_LEN - 1).wr_id(6))];
        let e = lane.post_recv_list(qp, &mut recvs).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("GRH"), "{e}");
        assert!(recvs.iter().all(Option::is_some), "a refused list posts none of its receives");
        assert_eq!(lane.outstanding(qp).unwrap(), (0, 0));
        // Address handles the QP cannot use: another PD of the same context, and a PD of a
        // context the caller opened itself.
        let other_pd = ProtectionDomain::new(pd.context()).unwrap();
        let ah = AddressHandle::new(&other_pd, server_dest.ah().attr()).unwrap();
        let e = lane.add_dest(qp, &UdDest::new(Arc::clone(&ah), server_dest.qpn(), server_dest.qkey())).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert_eq!(Arc::strong_count(&ah), 1, "a refused destination keeps nothing");
        let ctx = VerbsContext::open(&pd.context().device_name()).unwrap();
        assert!(!ctx.same_as(pd.context()), "a context of our own, not librdmacm's");
        let own_pd = ProtectionDomain::new(&ctx).unwrap();
        let own_ah = AddressHandle::new(&own_pd, server_dest.ah().attr()).unwrap();
        let e = lane.add_dest(qp, &UdDest::new(Arc::clone(&own_ah), server_dest.qpn(), server_dest.qkey()));
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
        assert_eq!(Arc::strong_count(&own_ah), 1);
        // The QP still works: the region refused so often goes.
        server
            .lane
            .post_recv(server.qp, RecvWr::new(MemoryRegion::new(&server.pd, GRH_LEN + 64, LW).unwrap()).wr_id(9))
            .unwrap();
        let mut mr = mr;
        mr.as_mut_slice().unwrap()[..8].copy_from_slice(b"at last!");
        lane.post_send(qp, SendWr::send(mr, 0..8).to(to_server).wr_id(7)).unwrap();
        assert!(one(lane, WorkQueue::Send, 7).is_ok());
        let mut got = one(&mut server.lane, WorkQueue::Recv, 9);
        assert_eq!(got.byte_len() as usize, GRH_LEN + 8);
        assert_eq!(&got.take_region().unwrap().as_slice().unwrap()[GRH_LEN..GRH_LEN + 8], b"at last!");
        drop((client, server, server_dest, foreign, recvs, ah, other_pd, own_ah, own_pd, ctx, pd, got));
    }
    t.finish();
}

/// Datagrams to a QP number nobody has and with a QKey the receiver does not accept: UD loses
/// them (no hang, no error). Two go unsignaled with regions, the third signaled: its completion
/// hands both regions back first, in order, each once. Their destinations' address handle,
/// whose every caller-side copy is gone, lives on in the lane for as long as the QP is
/// attached (the lane keeps its destinations), and goes with [`Lane::remove`]. A zero-byte
/// datagram is all GRH: `byte_len` is the GRH's, and it names the sender's QP.
#[test]
fn datagrams_to_nowhere_complete_and_their_address_handle_lives_until_the_qp_leaves_the_lane() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let LaneUdPair { mut client, to_server, server_dest, mut server } =
            lane_ud_pair(t.addr, 7423, QpInit::new(), 64);
        let (lane, qp) = (&mut client.lane, client.qp);
        let ah = AddressHandle::new(&client.pd, server_dest.ah().attr()).unwrap();
        let weak = Arc::downgrade(&ah);
        let nobody = lane.add_dest(qp, &UdDest::new(Arc::clone(&ah), 0x00ab_cdef, server_dest.qkey())).unwrap();
        let bad_qkey = lane.add_dest(qp, &UdDest::new(ah, server_dest.qpn(), server_dest.qkey() ^ 0x0f0f)).unwrap();
        assert!(weak.upgrade().is_some(), "the lane keeps the destinations' address handle");
        let (a, b) = (filled(&client.pd, 64, b"lost a"), filled(&client.pd, 64, b"lost b"));
        lane.post_send(qp, SendWr::send(a, 0..6).to(nobody).wr_id(1).unsignaled()).unwrap();
        lane.post_send(qp, SendWr::send(b, 0..6).to(bad_qkey).wr_id(2).unsignaled()).unwrap();
        lane.post_inline(qp, InlineWr::send(b"lost c").to(nobody).wr_id(3)).unwrap();
        let mut done = reap(lane, 3);
        assert_eq!(
            done.iter().map(|c| (c.wr_id(), c.is_signaled())).collect::<Vec<_>>(),
            [(1, false), (2, false), (3, true)]
        );
        assert!(done.iter().all(|c| c.is_ok()), "{done:?}");
        for (c, want) in done.iter_mut().take(2).zip([b"lost a", b"lost b"]) {
            let mut mr = c.take_region().expect("an unsignaled datagram's region comes back with the signaled one");
            assert_eq!(&mr.as_slice().unwrap()[..6], want);
        }
        assert!(lane.poll().unwrap().is_none(), "each once");
        assert!(weak.upgrade().is_some(), "the handle stays while the QP is in the lane");
        // The empty datagram: the server's first completion is it (the lost ones never came).
        server
            .lane
            .post_recv(server.qp, RecvWr::new(MemoryRegion::new(&server.pd, GRH_LEN + 8, LW).unwrap()).wr_id(5))
            .unwrap();
        lane.post_inline(qp, InlineWr::send(b"").to(to_server).wr_id(4)).unwrap();
        assert!(one(lane, WorkQueue::Send, 4).is_ok());
        let got = one(&mut server.lane, WorkQueue::Recv, 5);
        assert!(got.is_ok(), "{got:?}");
        assert_eq!(got.byte_len() as usize, GRH_LEN, "an empty datagram is all GRH");
        assert_eq!(got.src_qp(), lane.qp_num(qp).unwrap(), "it names the sender's QP");
        lane.remove(qp).unwrap();
        assert!(weak.upgrade().is_none(), "the QP's destinations go with it");
        drop((client, server, server_dest, done, got));
    }
    t.finish();
}

/// A datagram gathered from three pieces of one region, out of order, to a destination the
/// caller registered and then dropped its copy of: the peer receives the pieces' bytes in
/// the order given, after the GRH, and the region comes back whole with the completion, once.
#[test]
fn a_gathered_datagram_arrives_in_order_and_its_region_comes_back_once() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let init = QpInit::new().max_send_sge(3);
        let LaneUdPair { mut client, to_server: _, server_dest, mut server } = lane_ud_pair(t.addr, 7424, init, 64);
        let (lane, qp) = (&mut client.lane, client.qp);
        let to = {
            let copy = UdDest::new(Arc::clone(server_dest.ah()), server_dest.qpn(), server_dest.qkey());
            lane.add_dest(qp, &copy).unwrap()
            // The caller's copy goes here.
        };
        server
            .lane
            .post_recv(server.qp, RecvWr::new(MemoryRegion::new(&server.pd, GRH_LEN + 64, LW).unwrap()).wr_id(3))
            .unwrap();
        let src = pattern(64, 5);
        let mr = filled(&client.pd, 64, &src);
        lane.post_send(qp, SendWr::send_sg(mr, &[48..64, 0..16, 16..32]).to(to).wr_id(9)).unwrap();
        assert_eq!(lane.outstanding(qp).unwrap(), (1, 0));
        let mut sent = one(lane, WorkQueue::Send, 9);
        assert!(sent.is_ok(), "{sent:?}");
        let mut mr = sent.take_region().expect("the region comes back with the completion");
        assert_eq!(mr.as_slice().unwrap(), &src[..], "a send's source is not written");
        assert!(mr.as_mut_slice().is_ok());
        assert!(lane.poll().unwrap().is_none() && sent.take_region().is_none(), "once");
        let mut got = one(&mut server.lane, WorkQueue::Recv, 3);
        assert_eq!(got.byte_len() as usize, GRH_LEN + 48);
        let want: Vec<u8> = [&src[48..64], &src[..16], &src[16..32]].concat();
        assert_eq!(&got.take_region().unwrap().as_slice().unwrap()[GRH_LEN..GRH_LEN + 48], &want[..], "in order");
        drop((client, server, server_dest, mr, got, sent));
    }
    t.finish();
}

/// One datagram from the client to the server, received on the server's lane: its completion
/// (the receive's), the GRH as the device wrote it, and the client's send completion.
fn one_datagram(p: &mut LaneUdPair) -> (Completion, Grh, Completion) {
    let (s, c) = (&mut p.server, &mut p.client);
    s.lane.post_recv(s.qp, RecvWr::new(MemoryRegion::new(&s.pd, GRH_LEN + 8, LW).unwrap()).wr_id(1)).unwrap();
    c.lane.post_inline(c.qp, InlineWr::send(b"hi").to(p.to_server).wr_id(2)).unwrap();
    let sent = one(&mut c.lane, WorkQueue::Send, 2);
    let mut got = one(&mut s.lane, WorkQueue::Recv, 1);
    assert!(got.is_ok(), "{got:?}");
    let mut mr = got.take_region().unwrap();
    let grh = Grh::from_bytes(mr.as_slice().unwrap()[..GRH_LEN].try_into().unwrap());
    (got, grh, sent)
}

/// Forged GRHs (what a hostile peer controls: every byte of the header area as the provider
/// hands it up) with a real receive's completion, fed to `AddressHandle::reply_to`: random
/// bytes, and IPv4 headers naming the unspecified, broadcast, multicast and loopback addresses
/// as the sender. Never a panic; either a clear error naming the verb, or a handle for exactly
/// the address the header claims.
#[test]
fn forged_grhs_give_an_error_or_the_claimed_address_never_a_panic() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = lane_ud_pair(t.addr, 7425, QpInit::new(), 64);
        let (got, real, _) = one_datagram(&mut p);
        let wc = *got;
        let port = p.server.lane.attributes(p.server.qp).unwrap().port_num;
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
            match AddressHandle::reply_to(&p.server.pd, port, &wc, &g) {
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
        drop((p, got));
    }
    t.finish();
}

/// Completions and headers that are no datagram's: `AddressHandle::reply_to` refuses a send's
/// completion (a clear `InvalidArgument`, never a handle), an all-zero GRH (it names no
/// sender), and a port that does not exist; the real datagram's completion and GRH answer the
/// client, and a reply through that handle reaches it.
#[test]
fn reply_to_refuses_what_is_not_a_received_datagram() {
    let t = DeviceTest::start();
    if !require(Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = lane_ud_pair(t.addr, 7426, QpInit::new(), 64);
        let (got, grh, sent) = one_datagram(&mut p);
        let (wc, send_wc) = (*got, *sent);
        let (pd, port) = (Arc::clone(&p.server.pd), p.server.lane.attributes(p.server.qp).unwrap().port_num);
        let e = AddressHandle::reply_to(&pd, port, &send_wc, &grh).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "a send's completion answers nobody: {e}");
        let r = AddressHandle::reply_to(&pd, port, &wc, &Grh::from_bytes([0; GRH_LEN]));
        assert!(r.is_err(), "an all-zero GRH gives no address: {r:?}");
        assert!(AddressHandle::reply_to(&pd, 9, &wc, &grh).is_err(), "port 9 does not exist");
        // The real ones answer the client.
        let ah = AddressHandle::reply_to(&pd, port, &wc, &grh).unwrap();
        let back = p
            .server
            .lane
            .add_dest(p.server.qp, &UdDest::new(ah, got.src_qp(), rdma_cm::verbs::ud::RDMA_UDP_QKEY))
            .unwrap();
        let c = &mut p.client;
        c.lane.post_recv(c.qp, RecvWr::new(MemoryRegion::new(&c.pd, GRH_LEN + 8, LW).unwrap()).wr_id(7)).unwrap();
        p.server.lane.post_inline(p.server.qp, InlineWr::send(b"back").to(back).wr_id(8)).unwrap();
        assert!(one(&mut p.server.lane, WorkQueue::Send, 8).is_ok());
        let mut reply = one(&mut c.lane, WorkQueue::Recv, 7);
        assert_eq!(&reply.take_region().unwrap().as_slice().unwrap()[GRH_LEN..GRH_LEN + 4], b"back");
        drop((p, got, sent, reply, pd));
    }
    t.finish();
}
