//! On-demand paging (`AccessFlags::ON_DEMAND`, `rdma_cm::verbs::odp`) on the device: the
//! capabilities the crate reports are the ones rdma-core's `ibv_devinfo` prints and the kernel
//! implies; an ODP region of memory the caller owns is the source of a send, the target of a
//! receive, both ends of an RDMA WRITE and READ, and an atomic's target, on the lane, and comes
//! back with the expected bytes at the address it had; prefetching a range, and advice refused
//! on a pinned region or out of range; implicit ODP where the device has it, and refused naming
//! the missing capability where it has not; an ODP registration refused with the capability
//! error where the device has no ODP at all.
//!
//! The targets are fresh anonymous mappings (`Mapping::anonymous`), whose pages nobody has
//! touched: the device's first write to each is a page fault the driver resolves.
//!
//! Soft-RoCE has ODP from about Linux 6.14: `RDMA_VM_KERNEL=6.18 cargo test --test
//! user_memory_odp` runs the ODP paths (harness/rdma-vm fetches that kernel from
//! trixie-backports); on 6.1 and 6.12 they skip by capability and the refusals run instead.

mod common;

use std::process::Command;

use common::lane::{lane_pair, reap, LaneSide};
use common::{pattern, require, skipped, Cap, DeviceTest, PairSpec};
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::verbs::odp::{Advice, AdviseFlags, ImplicitOdpRegion, OdpCaps, OdpOps};
use rdma_cm::{AccessFlags, Error, Mapping, MemoryRegion, RemoteRegion};

/// Bytes of the messages and targets (several pages, so that the device faults more than one).
const N: usize = 64 << 10;

fn odp() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND
}

fn remote_odp() -> AccessFlags {
    odp() | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
}

/// The ODP capabilities of `side`'s device, as the crate reports them.
fn caps_of(side: &LaneSide) -> OdpCaps {
    side.pd.context().limits().expect("limits").odp
}

/// A lane pair whose own regions are unused (each test registers its own).
fn lanes(t: &DeviceTest) -> (LaneSide, LaneSide) {
    let spec = PairSpec { mr_sizes: vec![], ..PairSpec::default() };
    lane_pair(t.addr, spec.clone(), spec, 64)
}

/// Whether the device's RC ODP serves `ops`; prints the skip line when it does not.
fn rc_serves(caps: &OdpCaps, ops: OdpOps, what: &str) -> bool {
    if !caps.supported {
        skipped(what, &format!("{} has no on-demand paging", common::caps::device_under_test()));
        return false;
    }
    if !caps.rc.contains(ops) {
        skipped(what, &format!("its RC on-demand paging serves {:?}, not {ops:?}", caps.rc));
        return false;
    }
    true
}

/// The one completion `lane` hands out next: successful, for `wr_id`; its region.
fn done(lane: &mut Lane, wr_id: u64) -> MemoryRegion {
    let mut c = reap(lane, 1).pop().unwrap();
    assert!(c.is_ok() && c.wr_id() == wr_id, "{c:?}");
    c.take_region().expect("the completion hands the region back")
}

/// A fresh anonymous mapping of `N` bytes (untouched pages), or one holding `bytes`,
/// registered with `access`; its address.
fn mapped(side: &LaneSide, bytes: Option<&[u8]>, access: AccessFlags) -> (MemoryRegion, usize) {
    let mut m = Mapping::anonymous(N).expect("an anonymous mapping");
    if let Some(b) = bytes {
        m.copy_from_slice(b);
    }
    let at = m.as_ptr() as usize;
    let mr = MemoryRegion::register(&side.pd, m, access).unwrap_or_else(|e| panic!("register with {access:?}: {e}"));
    assert_eq!((mr.addr() as usize, mr.len()), (at, N), "registered in place");
    assert!(mr.access().contains(AccessFlags::ON_DEMAND) == access.contains(AccessFlags::ON_DEMAND));
    (mr, at)
}

/// Gives the mapping back and checks that it is where it was, holding `want`.
fn back_intact(mr: MemoryRegion, at: usize, want: &[u8], what: &str) {
    let m: Mapping = mr.into_buffer_as().unwrap_or_else(|e| panic!("{what}: into_buffer_as: {e}"));
    assert_eq!(m.as_ptr() as usize, at, "{what}: the mapping moved");
    assert!(m[..] == *want, "{what}: the contents differ");
}

/// What `ibv_devinfo -v` (rdma-core's own reading of `ibv_query_device_ex`) prints of the
/// device's ODP capabilities: each `*_odp_caps` section's words, with its "Unknown flags"
/// as bits.
fn devinfo_odp(dev: &str) -> std::collections::HashMap<String, (Vec<String>, u32)> {
    let out = Command::new("ibv_devinfo").args(["-v", "-d", dev]).output().expect("run ibv_devinfo (ibverbs-utils)");
    assert!(out.status.success(), "ibv_devinfo -v -d {dev}: {}", String::from_utf8_lossy(&out.stderr));
    let mut sections = std::collections::HashMap::new();
    let mut current: Option<String> = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let word = line.trim();
        if word.ends_with("odp_caps:") {
            current = Some(word.trim_end_matches(':').to_string());
            sections.insert(word.trim_end_matches(':').to_string(), (vec![], 0));
        } else if let (Some(c), true) = (&current, line.starts_with("\t\t\t")) {
            let entry = sections.get_mut(c).unwrap();
            match word.strip_prefix("Unknown flags: 0x") {
                Some(hex) => entry.1 = u32::from_str_radix(hex, 16).expect("hex"),
                None => entry.0.push(word.to_string()),
            }
        } else {
            current = None;
        }
    }
    sections
}

/// The bits of one transport's section as `ibv_devinfo` names them.
fn ops_of(words: &[String], unknown: u32) -> OdpOps {
    let names = [
        ("SUPPORT_SEND", OdpOps::SEND),
        ("SUPPORT_RECV", OdpOps::RECV),
        ("SUPPORT_WRITE", OdpOps::WRITE),
        ("SUPPORT_READ", OdpOps::READ),
        ("SUPPORT_ATOMIC", OdpOps::ATOMIC),
        ("SUPPORT_SRQ", OdpOps::SRQ_RECV),
    ];
    let mut ops = OdpOps::from_bits_retain(unknown);
    for w in words {
        if let Some((_, op)) = names.iter().find(|(n, _)| n == w) {
            ops |= *op;
        }
    }
    ops
}

/// The running kernel's (major, minor), from `uname -r`.
fn kernel() -> (u32, u32) {
    let r = String::from_utf8(Command::new("uname").arg("-r").output().expect("uname").stdout).unwrap();
    let mut it = r.trim().split(|c: char| !c.is_ascii_digit()).map(|n| n.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// The crate's `DeviceLimits::odp` says what `ibv_devinfo -v` says, bit for bit, and what the
/// kernel implies for Soft-RoCE: ODP from 6.14 on (with RC send, receive, WRITE, READ and
/// atomics), never implicit; none before. A registration with `ON_DEMAND` then succeeds or is
/// refused as the capability says, both ways.
#[test]
fn odp_capabilities_are_what_the_device_says() {
    let t = DeviceTest::start();
    {
        let dev = common::caps::device_under_test();
        let ctx = rdma_cm::VerbsContext::open(&dev).unwrap();
        let caps = ctx.limits().unwrap().odp;
        let info = devinfo_odp(&dev);
        let (general, _) = info.get("general_odp_caps").cloned().unwrap_or_default();
        assert_eq!(caps.supported, general.iter().any(|w| w == "ODP_SUPPORT"), "{caps:?} against {info:?}");
        assert_eq!(caps.implicit, general.iter().any(|w| w == "ODP_SUPPORT_IMPLICIT"), "{caps:?} against {info:?}");
        if caps.supported {
            for (name, ops) in [("rc", caps.rc), ("uc", caps.uc), ("ud", caps.ud), ("xrc", caps.xrc)] {
                let (words, unknown) = info.get(&format!("{name}_odp_caps")).cloned().unwrap_or_default();
                assert_eq!(ops, ops_of(&words, unknown), "{name}: {caps:?} against {info:?}");
            }
        } else {
            assert_eq!(caps, OdpCaps::default(), "no ODP, no per-transport ODP");
        }
        if dev.starts_with("rxe") {
            let k = kernel();
            assert_eq!(caps.supported, k >= (6, 14), "rxe on kernel {k:?}: {caps:?}");
            assert!(!caps.implicit, "rxe has no implicit ODP: {caps:?}");
            if caps.supported {
                let rc = OdpOps::SEND | OdpOps::RECV | OdpOps::WRITE | OdpOps::READ | OdpOps::ATOMIC;
                assert!(caps.rc.contains(rc), "{caps:?}");
            }
        }
        let pd = rdma_cm::ProtectionDomain::new(&ctx).unwrap();
        match MemoryRegion::register(&pd, vec![7u8; 4096], odp()) {
            Ok(mr) => {
                assert!(caps.supported, "registered although the device says no ODP: {mr:?}");
                assert!(mr.access().contains(AccessFlags::ON_DEMAND));
            }
            Err(e) => assert!(!caps.supported, "refused although the device says ODP: {e}"),
        }
    }
    t.finish();
}

/// An ODP region (the caller's mapping) is the source of a send and the target of a receive
/// (the receiver's pages untouched before), the source of an RDMA WRITE into the peer's ODP
/// region, and the target of an RDMA READ of it; each comes back at its address holding
/// what it should.
#[test]
fn odp_regions_are_sent_received_written_and_read_and_come_back_intact() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let caps = caps_of(&a);
        let all = OdpOps::SEND | OdpOps::RECV | OdpOps::WRITE | OdpOps::READ;
        if !rc_serves(&caps, all, "send, receive, WRITE and READ of ODP memory") {
            drop((a, b));
            return t.finish();
        }
        let (p1, p2, p3) = (pattern(N, 1), pattern(N, 2), pattern(N, 3));
        // Send and receive: the receive's target was never touched.
        let (src, src_at) = mapped(&a, Some(&p1), odp());
        let (dst, dst_at) = mapped(&b, None, odp());
        b.lane.post_recv(b.qp, RecvWr::new(dst).wr_id(1)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        back_intact(done(&mut a.lane, 2), src_at, &p1, "send source");
        back_intact(done(&mut b.lane, 1), dst_at, &p1, "receive target");
        // The peer's ODP region, WRITE target and READ source.
        let (target, target_at) = mapped(&b, Some(&p3), remote_odp());
        let peer = target.remote();
        let (wsrc, wsrc_at) = mapped(&a, Some(&p2), odp());
        a.lane.post_send(a.qp, SendWr::write(wsrc, 0..N / 2, &peer, 0).wr_id(3)).unwrap();
        back_intact(done(&mut a.lane, 3), wsrc_at, &p2, "WRITE source");
        let (rdst, rdst_at) = mapped(&a, None, odp());
        a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(4)).unwrap();
        let want = [&p2[..N / 2], &p3[N / 2..]].concat();
        back_intact(done(&mut a.lane, 4), rdst_at, &want, "READ target");
        back_intact(target, target_at, &want, "the peer's WRITE target and READ source");
        drop((a, b));
    }
    t.finish();
}

/// A fetch-and-add on the peer's ODP region, whose old value lands in a local ODP region
/// never touched before.
#[test]
fn odp_region_is_an_atomic_target() {
    let t = DeviceTest::start();
    if !require(Cap::Atomics) {
        return t.finish();
    }
    {
        let (mut a, b) = lanes(&t);
        if !rc_serves(&caps_of(&a), OdpOps::ATOMIC, "atomics on ODP memory") {
            drop((a, b));
            return t.finish();
        }
        let p3 = pattern(N, 3);
        let (target, target_at) = mapped(&b, Some(&p3), remote_odp());
        let (result, result_at) = mapped(&a, None, odp());
        let at = 3 * 4096 + 8; // on the fourth page
        let old = u64::from_ne_bytes(p3[at..at + 8].try_into().unwrap());
        a.lane
            .post_send(a.qp, SendWr::fetch_add(result, 2 * 4096, &target.remote(), at as u64, 1_000_003).wr_id(5))
            .unwrap();
        let mut want_result = vec![0u8; N];
        want_result[2 * 4096..2 * 4096 + 8].copy_from_slice(&old.to_ne_bytes());
        back_intact(done(&mut a.lane, 5), result_at, &want_result, "atomic result");
        let mut want_target = p3.clone();
        want_target[at..at + 8].copy_from_slice(&old.wrapping_add(1_000_003).to_ne_bytes());
        back_intact(target, target_at, &want_target, "atomic target");
        drop((a, b));
    }
    t.finish();
}

/// Advice is refused before any call on a pinned region (on every kernel), and on an ODP
/// region for an empty range, a range past its end, and a writable prefetch of a region the
/// device may only read; each error says what was wrong.
#[test]
fn advice_is_refused_on_a_pinned_region_and_out_of_range() {
    let t = DeviceTest::start();
    {
        let (a, b) = lanes(&t);
        let pinned = MemoryRegion::new(&a.pd, N, AccessFlags::LOCAL_WRITE).unwrap();
        for r in [pinned.prefetch(0..N), pinned.advise(Advice::Prefetch, 0..4096, AdviseFlags::empty())] {
            match r {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("pinned") && m.contains("ON_DEMAND"), "{m}"),
                other => panic!("advice on a pinned region: {other:?}"),
            }
        }
        if caps_of(&a).supported {
            let mr = MemoryRegion::new(&a.pd, N, odp()).unwrap();
            assert!(
                matches!(mr.prefetch(N - 4096..N + 1), Err(Error::OutOfBounds { offset, len: 4097, size, .. }) if offset == (N - 4096) as u64 && size == N as u64),
                "past the end: {:?}",
                mr.prefetch(N - 4096..N + 1)
            );
            assert!(matches!(mr.prefetch(100..100), Err(Error::InvalidArgument(m)) if m.contains("empty")));
            let read_only = MemoryRegion::new(&a.pd, N, AccessFlags::ON_DEMAND | AccessFlags::REMOTE_READ).unwrap();
            match read_only.advise(Advice::PrefetchWrite, 0..N, AdviseFlags::FLUSH) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("LOCAL_WRITE"), "{m}"),
                other => panic!("a writable prefetch of a read-only region: {other:?}"),
            }
            // Chunks advise their own ranges: the last chunk's range ends where it does.
            let chunks = mr.split(N / 4).unwrap();
            assert!(matches!(chunks[3].prefetch(0..N / 4 + 1), Err(Error::OutOfBounds { .. })));
        } else {
            skipped("advice on ODP regions", &format!("{} has no on-demand paging", common::caps::device_under_test()));
        }
        drop((a, b));
    }
    t.finish();
}

/// A prefetch of a range of a fresh ODP region (synchronous, then one in the background, then
/// one that faults nothing in) succeeds, and the region then receives a message into that
/// range; where the provider library cannot advise, the refusal names it and the region still
/// receives.
#[test]
fn prefetch_of_a_range_then_the_region_receives() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        if !rc_serves(&caps_of(&b), OdpOps::SEND | OdpOps::RECV, "prefetching an ODP region") {
            drop((a, b));
            return t.finish();
        }
        let (dst, dst_at) = mapped(&b, None, odp());
        match dst.prefetch(4096..3 * 4096) {
            Ok(()) => {
                dst.advise(Advice::Prefetch, 0..N, AdviseFlags::empty()).expect("a prefetch in the background");
                dst.advise(Advice::PrefetchNoFault, N / 2..N, AdviseFlags::FLUSH).expect("a prefetch without faults");
            }
            Err(Error::Unsupported { what, why }) => {
                assert!(why.contains("advise_mr") && why.contains("EOPNOTSUPP"), "{why}");
                skipped(what, &why);
            }
            Err(e) => panic!("prefetch: {e}"),
        }
        let p = pattern(N, 9);
        let (src, _) = mapped(&a, Some(&p), odp());
        b.lane.post_recv(b.qp, RecvWr::new(dst).wr_id(1)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        back_intact(done(&mut b.lane, 1), dst_at, &p, "prefetched receive target");
        drop((a, b));
    }
    t.finish();
}

/// Implicit ODP: where the device has it, the whole address space is registered, and the peer
/// READs a plain `Vec` of this process through its rkey, and a prefetch of the `Vec` succeeds;
/// where it has not, the registration is refused naming the capability it lacks.
#[test]
fn implicit_odp_registers_the_address_space_or_is_refused_naming_why() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lanes(&t);
        let caps = caps_of(&b);
        let p = pattern(N, 5);
        // SAFETY: read rights only, no LOCAL_WRITE: neither a local work request nor a peer can
        // write through its keys; the rkey goes to this test's own READ, of `p`, which lives
        // (unchanged) until the READ's completion is reaped.
        let r = unsafe { ImplicitOdpRegion::register(&b.pd, AccessFlags::REMOTE_READ) };
        match r {
            Ok(implicit) => {
                assert!(caps.implicit, "registered although the device says no implicit ODP");
                assert!(implicit.access().contains(AccessFlags::ON_DEMAND | AccessFlags::REMOTE_READ));
                match implicit.advise(Advice::Prefetch, p.as_ptr() as u64, N, AdviseFlags::FLUSH) {
                    Ok(()) | Err(Error::Unsupported { .. }) => {}
                    Err(e) => panic!("prefetch through the implicit region: {e}"),
                }
                let peer = RemoteRegion::new(p.as_ptr() as u64, implicit.rkey(), N as u64);
                let (rdst, rdst_at) = mapped(&a, None, AccessFlags::LOCAL_WRITE);
                a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(1)).unwrap();
                back_intact(done(&mut a.lane, 1), rdst_at, &p, "READ through the implicit rkey");
                implicit.close().expect("ibv_dereg_mr");
            }
            Err(Error::Unsupported { what, why }) => {
                assert!(!caps.implicit, "refused although the device says implicit ODP: {why}");
                assert_eq!(what, "implicit on-demand paging");
                let lacks = if caps.supported { "IBV_ODP_SUPPORT_IMPLICIT" } else { "IBV_ODP_SUPPORT" };
                assert!(why.contains(lacks) && why.contains(&common::caps::device_under_test()), "{why}");
            }
            Err(e) => panic!("implicit ODP: {e}"),
        }
        drop(p);
        drop((a, b));
    }
    t.finish();
}

/// Where the device has no ODP (Soft-RoCE before about 6.14, Soft-iWARP), a registration with
/// `ON_DEMAND` is refused before `ibv_reg_mr`, by every constructor, with an error that names
/// the device, the missing capability and the usual cause; the caller's buffer is dropped, and
/// nothing is registered.
#[test]
fn odp_registration_is_refused_naming_the_missing_capability() {
    let t = DeviceTest::start();
    {
        let (a, b) = lanes(&t);
        if caps_of(&a).supported {
            skipped(
                "a refused ODP registration",
                &format!("{} has on-demand paging: nothing to refuse", common::caps::device_under_test()),
            );
            drop((a, b));
            return t.finish();
        }
        let before = common::mr_count();
        let attempts = [
            ("new", MemoryRegion::new(&a.pd, N, odp()).err()),
            ("register", MemoryRegion::register(&a.pd, vec![1u8; N], odp()).err()),
            ("register_at", MemoryRegion::register_at(&a.pd, Mapping::anonymous(N).unwrap(), odp(), 0).err()),
            ("remote rights", MemoryRegion::register(&a.pd, vec![1u8; 4096], remote_odp()).err()),
        ];
        for (how, e) in attempts {
            let e = e.unwrap_or_else(|| panic!("{how}: registered with ON_DEMAND without ODP"));
            let text = e.to_string();
            match &e {
                Error::Unsupported { what, why } => {
                    assert!(what.contains("ON_DEMAND"), "{how}: {what}");
                    assert!(why.contains(&common::caps::device_under_test()), "{how}: names the device: {why}");
                    assert!(why.contains("IBV_ODP_SUPPORT") && why.contains("6.14"), "{how}: names the cause: {why}");
                }
                other => panic!("{how}: {other:?}"),
            }
            assert!(text.contains("not supported"), "{text}");
        }
        assert_eq!(common::mr_count(), before, "nothing was registered");
        drop((a, b));
    }
    t.finish();
}
