//! What the lane (`rdma_cm::verbs::lane`) offers beyond plain posts, on the device: prepared
//! requests re-aimed at another remote slot or local piece, inline sends of plain byte slices,
//! and a CQ that grows as QPs are attached.

mod common;

use common::lane::{lane_pair, reap};
use common::{pattern, DeviceTest, PairSpec};
use rdma_cm::verbs::lane::{InlineWr, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Error, MemoryRegion};

const SLOT: usize = 64;

fn remote_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
}

fn spec(access: AccessFlags) -> PairSpec {
    PairSpec { mr_sizes: vec![4096, 4096], access, ..PairSpec::default() }
}

/// A one-sided store's core: one prepared READ, re-aimed at another slot of the peer's table
/// before each post, reads that slot; an aim past the table is refused naming the offset, the
/// length and the table's size, and leaves the request as it was (still aimed at the last
/// slot, still postable); a send has no remote offset to aim.
#[test]
fn a_prepared_read_re_aimed_reads_each_slot_and_an_aim_out_of_range_is_refused() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(remote_access()), spec(remote_access()), 64);
        for slot in 0..4096 / SLOT {
            b.mrs[0].write_at(slot * SLOT, &pattern(SLOT, slot as u8)).unwrap();
        }
        let table = b.mrs[0].remote();
        let mut read = a.lane.prepare_send(a.qp, SendWr::read(a.mrs.remove(0), 0..SLOT, &table, 0).wr_id(5)).unwrap();
        let mut got = [0u8; SLOT];
        for slot in [3usize, 0, 63, 17, 17, 40] {
            read.aim((slot * SLOT) as u64).unwrap();
            assert_eq!(read.remote_offset(), (slot * SLOT) as u64);
            a.lane.post_prepared(&mut read).unwrap();
            let mut c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok() && c.wr_id() == 5, "{c:?}");
            read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
            read.read_at(0, &mut got).unwrap();
            assert_eq!(&got[..], &pattern(SLOT, slot as u8)[..], "slot {slot}");
        }
        // Past the end (by one byte), and far past it: refused, naming offset, length, size.
        for offset in [4096 - SLOT as u64 + 1, 4096, u64::MAX - 8] {
            let e = read.aim(offset).unwrap_err();
            assert!(
                matches!(e, Error::OutOfBounds { what: "remote region", offset: o, len: 64, size: 4096 } if o == offset),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(text.contains(&offset.to_string()) && text.contains("4096") && text.contains("64"), "{text}");
        }
        assert_eq!(read.remote_offset(), 40 * SLOT as u64, "a refused aim changes nothing");
        // Still usable: it reads the slot it was last aimed at.
        b.mrs[0].write_at(40 * SLOT, &pattern(SLOT, 200)).unwrap();
        a.lane.post_prepared(&mut read).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok(), "{c:?}");
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        read.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(SLOT, 200)[..]);
        // The last whole slot is in range; aiming while posted is allowed (the next post takes it).
        a.lane.post_prepared(&mut read).unwrap();
        read.aim(4096 - SLOT as u64).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        read.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(SLOT, 200)[..], "the post before the aim read the old slot");
        a.lane.post_prepared(&mut read).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        read.read_at(0, &mut got).unwrap();
        assert_eq!(&got[..], &pattern(SLOT, 63)[..], "the post after it read the new one");
        // A send has nothing remote to aim.
        let mut send = a.lane.prepare_send(a.qp, SendWr::send(a.mrs.remove(0), 0..8)).unwrap();
        let e = send.aim(0).unwrap_err();
        assert!(e.to_string().contains("no remote address"), "{e}");
        drop((a, b, read, send));
    }
    t.finish();
}

/// A prepared READ's local piece moves within its region (`aim_local`): the next post lands
/// the slot there, and may take a new length; a piece outside the region, or one whose new
/// length would carry the remote range past the table, is refused and changes nothing.
#[test]
fn a_prepared_read_re_aimed_locally_lands_in_the_new_piece() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(remote_access()), spec(remote_access()), 64);
        b.mrs[0].write_at(0, &pattern(4096, 9)).unwrap();
        let table = b.mrs[0].remote();
        let mut read = a.lane.prepare_send(a.qp, SendWr::read(a.mrs.remove(0), 0..SLOT, &table, 0)).unwrap();
        read.write_at(0, &[0u8; 4096]).unwrap();
        read.aim(128).unwrap();
        read.aim_local(1024..1024 + 2 * SLOT).unwrap();
        a.lane.post_prepared(&mut read).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        assert_eq!((c.is_ok(), c.byte_len()), (true, 2 * SLOT as u32), "{c:?}");
        read.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        let mut got = vec![0u8; 4096];
        read.read_at(0, &mut got).unwrap();
        assert_eq!(&got[1024..1024 + 2 * SLOT], &pattern(4096, 9)[128..128 + 2 * SLOT]);
        assert!(got[..1024].iter().chain(&got[1024 + 2 * SLOT..]).all(|&x| x == 0), "nothing around it");
        // Outside the region; a length that carries the remote range past the table.
        let e = read.aim_local(4000..4100).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { what: "memory region", offset: 4000, len: 100, .. }), "{e:?}");
        read.aim(4096 - 2 * SLOT as u64).unwrap();
        let e = read.aim_local(0..3 * SLOT).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { what: "remote region", len: 192, size: 4096, .. }), "{e:?}");
        // The refused aims changed nothing: the next aim to the table's end checks 128 bytes.
        assert!(read.aim(4096 - 2 * SLOT as u64 + 1).is_err());
        drop((a, b, read));
    }
    t.finish();
}

/// A prepared fetch-and-add re-aimed at another counter, with a new addend, adds there; an
/// unaligned target is refused.
#[test]
fn a_prepared_atomic_re_aimed_adds_to_another_counter() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Atomics) {
        return t.finish();
    }
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(remote_access()), spec(remote_access()), 64);
        b.mrs[0].write_at(0, &[0u8; 64]).unwrap();
        let table = b.mrs[0].remote();
        let mut add = a.lane.prepare_send(a.qp, SendWr::fetch_add(a.mrs.remove(0), 0, &table, 0, 1)).unwrap();
        for (k, counter) in [(1u64, 0u64), (2, 3), (3, 3), (4, 7)] {
            add.aim(counter * 8).unwrap();
            add.set_atomic_operands(k * 10, 0).unwrap();
            a.lane.post_prepared(&mut add).unwrap();
            let mut c = reap(&mut a.lane, 1).pop().unwrap();
            assert!(c.is_ok(), "{c:?}");
            add.rearm(c.take_region().unwrap()).map_err(|r| r.into_parts().0).unwrap();
        }
        let mut value = |at: usize| {
            let mut v = [0u8; 8];
            b.mrs[0].read_at(at * 8, &mut v).unwrap();
            u64::from_ne_bytes(v)
        };
        assert_eq!([value(0), value(3), value(7), value(1)], [10, 50, 40, 0]);
        let e = add.aim(12).unwrap_err();
        assert!(e.to_string().contains("aligned"), "{e}");
        let e = add.aim(4096 - 4).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { len: 8, size: 4096, .. }), "{e:?}");
        drop((a, b, add));
    }
    t.finish();
}

/// An inline send carries the bytes of a plain slice, copied at post time: the slice is
/// overwritten as soon as the post returns, and the peer still receives what it held. Its
/// completion carries no region. More than the QP's inline limit is refused naming both.
#[test]
fn an_inline_send_carries_a_plain_slice_copied_at_post_time() {
    let t = DeviceTest::start();
    {
        let local = spec(AccessFlags::LOCAL_WRITE);
        let (mut a, mut b) = lane_pair(t.addr, local.clone(), local, 64);
        let max = a.lane.max_inline_data(a.qp).unwrap() as usize;
        assert!(max >= 16, "the lane's QP asked for 64 bytes inline, got {max}");
        let n = max.min(64);
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(1)).unwrap();
        let mut bytes = pattern(n, 42);
        a.lane.post_inline(a.qp, InlineWr::send(&bytes).wr_id(2)).unwrap();
        bytes.fill(0xee); // the provider copied them during the post
        drop(bytes);
        let sent = reap(&mut a.lane, 1).pop().unwrap();
        assert!(sent.is_ok() && sent.wr_id() == 2, "{sent:?}");
        let mut sent = sent;
        assert!(sent.take_region().is_none(), "an inline send holds no region");
        let mut got = reap(&mut b.lane, 1).pop().unwrap();
        assert_eq!((got.wr_id(), got.byte_len() as usize), (1, n), "{got:?}");
        let mut buf = got.take_region().unwrap();
        assert_eq!(&buf.as_slice().unwrap()[..n], &pattern(n, 42)[..]);
        // One byte over the limit: refused before the provider, naming both.
        let big = vec![1u8; max + 1];
        let e = a.lane.post_inline(a.qp, InlineWr::send(&big)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&format!("{} bytes", max + 1)) && text.contains(&max.to_string()) && text.contains("inline"),
            "{text}"
        );
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "nothing was taken");
        drop((a, b, buf));
    }
    t.finish();
}

/// Inline sends take send-queue slots like any other: a queue filled with unsignaled ones
/// drains (the one that takes the last free slot is signaled), each comes back as its own
/// completion without a region, and the queue is empty again. An inline WRITE lands its bytes
/// in the peer's region; one outside the remote region is refused.
#[test]
fn unsignaled_inline_sends_fill_the_queue_and_all_retire() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lane_pair(t.addr, spec(remote_access()), spec(remote_access()), 64);
        let depth = 16u64; // QpInit's default send queue
        for k in 0..depth {
            let mr = MemoryRegion::new(&b.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            b.lane.post_recv(b.qp, RecvWr::new(mr).wr_id(100 + k)).unwrap();
        }
        for k in 0..depth {
            a.lane.post_inline(a.qp, InlineWr::send(&k.to_ne_bytes()).wr_id(k).unsignaled()).unwrap();
        }
        let e = a.lane.post_inline(a.qp, InlineWr::send(b"x")).unwrap_err();
        assert!(matches!(e, Error::QueueFull { .. }), "{e:?}");
        let done = reap(&mut a.lane, depth as usize);
        for (k, c) in done.into_iter().enumerate() {
            let mut c = c;
            assert!(c.is_ok() && c.wr_id() == k as u64 && c.take_region().is_none(), "{c:?}");
            // (iWARP signals every request.)
            let signaled = k as u64 == depth - 1 || common::caps::iwarp();
            assert_eq!(c.is_signaled(), signaled, "only the last slot's asks: {c:?}");
        }
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0), "every slot retired");
        for (k, mut r) in reap(&mut b.lane, depth as usize).into_iter().enumerate() {
            let mut v = [0u8; 8];
            r.take_region().unwrap().read_at(0, &mut v).unwrap();
            assert_eq!((r.wr_id(), u64::from_ne_bytes(v)), (100 + k as u64, k as u64));
        }
        // An inline WRITE, and one past the end of the remote region.
        let table = MemoryRegion::new(&b.pd, 256, remote_access()).unwrap();
        let r = table.remote();
        a.lane.post_inline(a.qp, InlineWr::write(b"inline write", &r, 100).wr_id(7)).unwrap();
        let c = reap(&mut a.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 7, "{c:?}");
        let mut table = table;
        let mut seen = [0u8; 12];
        table.read_at(100, &mut seen).unwrap();
        assert_eq!(&seen, b"inline write");
        let e = a.lane.post_inline(a.qp, InlineWr::write(b"too far", &r, 250)).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { what: "remote region", offset: 250, len: 7, size: 256 }), "{e:?}");
        drop((a, b, table));
    }
    t.finish();
}

/// An inline datagram on UD reaches its destination, with no region on either side of the
/// send.
#[test]
fn an_inline_datagram_reaches_its_destination() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::Ud) {
        return t.finish();
    }
    {
        let mut p = common::lane::lane_ud_pair(t.addr, 7631, rdma_cm::QpInit::new(), 64);
        let buf = MemoryRegion::new(&p.server.pd, rdma_cm::verbs::ah::GRH_LEN + 64, AccessFlags::LOCAL_WRITE).unwrap();
        p.server.lane.post_recv(p.server.qp, RecvWr::new(buf).wr_id(1)).unwrap();
        p.client.lane.post_inline(p.client.qp, InlineWr::send(b"datagram").to(p.to_server).wr_id(2)).unwrap();
        let c = reap(&mut p.client.lane, 1).pop().unwrap();
        assert!(c.is_ok() && c.wr_id() == 2, "{c:?}");
        let mut r = reap(&mut p.server.lane, 1).pop().unwrap();
        assert_eq!(r.byte_len() as usize, rdma_cm::verbs::ah::GRH_LEN + 8);
        let mut got = [0u8; 8];
        r.take_region().unwrap().read_at(rdma_cm::verbs::ah::GRH_LEN, &mut got).unwrap();
        assert_eq!(&got, b"datagram");
        let e = p.client.lane.post_inline(p.client.qp, InlineWr::send(b"nowhere")).unwrap_err();
        assert!(e.to_string().contains("destination"), "{e}");
        drop(p);
    }
    t.finish();
}

/// A lane's CQ grows when a QP is attached that it has no room for, keeping the completions it
/// holds: ten receives complete (the peer's sends all completed, so their completions sit in
/// the CQ), two are polled, a second QP (created beyond the CQ's room) is attached, and the
/// other eight come out after the resize in order,
/// each once, and nothing more. Both QPs work on afterwards.
#[test]
fn attach_grows_the_lanes_cq_keeping_the_completions_it_holds() {
    let t = DeviceTest::start();
    if !common::require(common::Cap::CqResize) {
        return t.finish();
    }
    {
        let local = spec(AccessFlags::LOCAL_WRITE);
        let (mut a, mut b) = lane_pair(t.addr, local.clone(), local, 32);
        assert_eq!(a.lane.cq_depth(), 32, "room for one QP of 16 + 16");
        for k in 0..10u64 {
            let mr = MemoryRegion::new(&a.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
            a.lane.post_recv(a.qp, RecvWr::new(mr).wr_id(k)).unwrap();
        }
        for k in 0..10u8 {
            b.lane.post_inline(b.qp, InlineWr::send(&[k; 8]).wr_id(k as u64)).unwrap();
        }
        // Every send completed: the peer acknowledged each after its receive completed.
        assert!(reap(&mut b.lane, 10).iter().all(|c| c.is_ok()));
        for k in 0..2u64 {
            let c = a.lane.poll().unwrap().expect("a receive that completed");
            assert_eq!(c.wr_id(), k, "{c:?}");
        }
        // A second QP on the lane's CQ, which has no room for it yet.
        let client = PairSpec { init: a.lane.qp_init(), ..PairSpec::default() };
        let (c, d) = common::pair(t.addr, client, PairSpec::default());
        let qc = a.lane.attach(c.conn).map_err(|r| r.into_parts().0).expect("attach grows the CQ");
        assert!(a.lane.cq_depth() >= 64, "grown to hold both QPs: {}", a.lane.cq_depth());
        for (k, mut r) in reap(&mut a.lane, 8).into_iter().enumerate() {
            let k = k as u64 + 2;
            assert_eq!((r.wr_id(), r.byte_len(), r.is_ok()), (k, 8, true), "{r:?}");
            let mut got = [0u8; 8];
            r.take_region().unwrap().read_at(0, &mut got).unwrap();
            assert_eq!(got, [k as u8; 8]);
        }
        assert!(a.lane.poll().unwrap().is_none(), "nothing handed out twice");
        assert_eq!(a.lane.outstanding(a.qp).unwrap(), (0, 0));
        // Both QPs work on.
        common::raw::post_recv(&d.conn, &d.mrs[0], 0..64, 1);
        a.lane.post_inline(qc, InlineWr::send(b"grown").wr_id(20)).unwrap();
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(2)).unwrap();
        a.lane.post_inline(a.qp, InlineWr::send(b"still").wr_id(21)).unwrap();
        let mut ids: Vec<u64> = reap(&mut a.lane, 2).iter().map(|c| c.wr_id()).collect();
        ids.sort();
        assert_eq!(ids, [20, 21]);
        assert_eq!(common::raw::wait(&d.conn, false, 1), (0, 5), "the peer's receive: success, 5 bytes");
        let r = reap(&mut b.lane, 1).pop().unwrap();
        assert_eq!((r.wr_id(), r.byte_len()), (2, 5));
        drop((a, b, d));
    }
    t.finish();
}

/// Where the device cannot resize a CQ, an attach the lane's CQ has no room for is refused,
/// saying so and what depth to create the lane with, and the owner comes back; the lane and
/// its first QP work on.
#[test]
fn attach_that_cannot_grow_the_cq_is_refused_with_the_owner_back() {
    let t = DeviceTest::start();
    if common::caps::has(common::Cap::CqResize) {
        common::caps::skipped("a CQ that cannot grow", "the device resizes CQs, so the lane grows its CQ instead");
        return t.finish();
    }
    {
        let local = spec(AccessFlags::LOCAL_WRITE);
        let (mut a, mut b) = lane_pair(t.addr, local.clone(), local, 32);
        let client = PairSpec { init: a.lane.qp_init(), ..PairSpec::default() };
        let (c, d) = common::pair(t.addr, client, PairSpec::default());
        let r = a.lane.attach(c.conn).unwrap_err();
        let text = r.to_string();
        assert!(text.contains("ibv_resize_cq") && text.contains("Lane::new(ctx, 64)"), "{text}");
        let conn = r.into_inner().expect("the connection comes back");
        assert_eq!(a.lane.cq_depth(), 32);
        b.lane.post_recv(b.qp, RecvWr::new(b.mrs.remove(0)).wr_id(1)).unwrap();
        a.lane.post_inline(a.qp, InlineWr::send(b"on").wr_id(2)).unwrap();
        assert_eq!(reap(&mut a.lane, 1).pop().unwrap().wr_id(), 2);
        assert_eq!(reap(&mut b.lane, 1).pop().unwrap().byte_len(), 2);
        drop((conn, c.mrs, d, a, b));
    }
    t.finish();
}
