//! What the lane (`rdma_cm::verbs::lane`) offers beyond plain posts, on the device: prepared
//! requests re-aimed at another remote slot or local piece, inline sends of plain byte slices,
//! and a CQ that grows as QPs are attached.

mod common;

use common::lane::{lane_pair, reap};
use common::{pattern, DeviceTest, PairSpec};
use rdma_cm::verbs::lane::{RecvWr, SendWr};
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
