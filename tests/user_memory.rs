//! Memory the caller owns, registered in place (`MemoryRegion::register` of a `StableBuffer`)
//! and given back intact (`MemoryRegion::into_buffer_as`), on the device: each kind of buffer
//! (`vec`: a `Vec<u8>` whose capacity exceeds its length; `pod`: a `Vec<u64>` and a
//! `Box<[u32]>`; `huge_page`: a `Mapping` of 2 MiB pages; `mmap`: a `memmap2::MmapMut` of a
//! tmpfs file) is the source of a send, the target of a receive, the source of an RDMA WRITE,
//! the target of an RDMA READ, the peer's target of those, and the target of an atomic, on the
//! lane; then it comes back with the expected contents, at the address it had before it was
//! registered.
//!
//! The `attack_` tests try to free, move or reinterpret such memory from safe code while the
//! device may use it. What does not compile is pinned in `tests/ui/` (`registered_*.rs`: a
//! registered `Vec` cannot grow or be dropped, a registered `Mapping` cannot be unmapped).
//!
//! Needs the features `bytemuck` and `memmap2`: `cargo test --all-features --test user_memory`
//! (`RDMA_VM_PROVIDER=siw` for Soft-iWARP, which has no atomics: those tests skip there).

mod common;

use std::process::Command;

use common::lane::{lane_pair, reap, LaneSide};
use common::{pattern, require, Cap, DeviceTest, PairSpec};
use rdma_cm::verbs::lane::{Lane, RecvWr, SendWr};
use rdma_cm::{AccessFlags, Error, Mapping, MemoryRegion, StableBuffer};

/// Bytes of every buffer in these tests (a multiple of 8: the `pod` kinds hold whole elements).
const N: usize = 4096;

fn remote() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
}

/// A kind of owned buffer: how to make one holding given bytes, and how to look at it.
trait Kind: StableBuffer + Sized {
    /// A new buffer holding `bytes` (a whole number of elements).
    fn filled(bytes: &[u8]) -> Self;
    /// Its first byte's address, to see that it never moved.
    fn at(&self) -> usize;
    /// A copy of its bytes.
    fn bytes(&self) -> Vec<u8>;
    /// What else must survive the round trip (a `Vec`'s capacity).
    fn extra(&self) -> usize {
        0
    }
}

impl Kind for Vec<u8> {
    fn filled(bytes: &[u8]) -> Self {
        // Capacity twice the length: only the length is registered, the capacity comes back.
        let mut v = Vec::with_capacity(2 * bytes.len());
        v.extend_from_slice(bytes);
        v
    }
    fn at(&self) -> usize {
        self.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        self.clone()
    }
    fn extra(&self) -> usize {
        self.capacity()
    }
}

impl Kind for Vec<u64> {
    fn filled(bytes: &[u8]) -> Self {
        bytes.chunks(8).map(|c| u64::from_ne_bytes(c.try_into().unwrap())).collect()
    }
    fn at(&self) -> usize {
        self.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        bytemuck::cast_slice(self).to_vec()
    }
    fn extra(&self) -> usize {
        self.capacity()
    }
}

impl Kind for Box<[u32]> {
    fn filled(bytes: &[u8]) -> Self {
        bytes.chunks(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap())).collect()
    }
    fn at(&self) -> usize {
        self.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        bytemuck::cast_slice(self).to_vec()
    }
}

impl Kind for Mapping {
    fn filled(bytes: &[u8]) -> Self {
        let mut m = Mapping::huge_pages(bytes.len()).unwrap_or_else(|e| panic!("a huge-page mapping: {e}"));
        assert!(m.is_huge() && m.mapped_len() == rdma_cm::HUGE_PAGE_SIZE);
        m.copy_from_slice(bytes);
        m
    }
    fn at(&self) -> usize {
        self.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        self.to_vec()
    }
}

impl Kind for memmap2::MmapMut {
    fn filled(bytes: &[u8]) -> Self {
        // A tmpfs file (the guest's /dev/shm), mapped shared, then unlinked: the mapping keeps
        // its pages. (Long-term pins of writable shared mappings of other file systems are
        // refused by kernels from 6.5 on; tmpfs is exempt.)
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = format!("/dev/shm/rdma-cm-user-memory-{}-{n}", std::process::id());
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        file.set_len(bytes.len() as u64).unwrap();
        // SAFETY: the file is this test's own, unlinked right below: nothing else maps, writes
        // or truncates it while the mapping lives.
        let mut m = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.unwrap();
        std::fs::remove_file(&path).unwrap();
        m.copy_from_slice(bytes);
        m
    }
    fn at(&self) -> usize {
        self.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        self.to_vec()
    }
}

/// A buffer of kind `K` holding `bytes`, registered on `side`'s PD with `access`; the address
/// and the extra (capacity) it had before.
fn registered<K: Kind>(side: &LaneSide, bytes: &[u8], access: AccessFlags) -> (MemoryRegion, usize, usize) {
    let buf = K::filled(bytes);
    let (at, extra) = (buf.at(), buf.extra());
    let mr = MemoryRegion::register(&side.pd, buf, access).unwrap_or_else(|e| panic!("register: {e}"));
    assert_eq!((mr.len(), mr.addr() as usize), (bytes.len(), at), "registered in place");
    (mr, at, extra)
}

/// Gives `mr`'s buffer back and checks that it is where it was, as it was made (capacity),
/// holding `want`.
fn back_intact<K: Kind>(mr: MemoryRegion, at: usize, extra: usize, want: &[u8], what: &str) {
    let buf: K = mr.into_buffer_as().unwrap_or_else(|e| panic!("{what}: into_buffer_as: {e}"));
    assert_eq!(buf.at(), at, "{what}: the buffer moved");
    assert_eq!(buf.extra(), extra, "{what}: the capacity changed");
    assert!(buf.bytes() == want, "{what}: the contents differ");
}

/// The one completion `lane` hands out next: successful, for `wr_id`; its region.
fn done(lane: &mut Lane, wr_id: u64) -> MemoryRegion {
    let mut c = reap(lane, 1).pop().unwrap();
    assert!(c.is_ok() && c.wr_id() == wr_id, "{c:?}");
    c.take_region().expect("the completion hands the region back")
}

/// A lane pair whose own regions are unused (each test registers buffers of its kind).
fn lanes(t: &DeviceTest) -> (LaneSide, LaneSide) {
    let spec = PairSpec { mr_sizes: vec![], ..PairSpec::default() };
    lane_pair(t.addr, spec.clone(), spec, 64)
}

/// A send from a buffer of kind `K` into a receive of another; an RDMA WRITE from one into the
/// peer's; an RDMA READ of the peer's into one. Each comes back intact.
fn send_receive_write_read<K: Kind>() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let (p1, p2, p3, zero) = (pattern(N, 1), pattern(N, 2), pattern(N, 3), vec![0u8; N]);
        // Send and receive.
        let (src, src_at, src_x) = registered::<K>(&a, &p1, AccessFlags::LOCAL_WRITE);
        let (dst, dst_at, dst_x) = registered::<K>(&b, &zero, AccessFlags::LOCAL_WRITE);
        b.lane.post_recv(b.qp, RecvWr::new(dst).wr_id(1)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        back_intact::<K>(done(&mut a.lane, 2), src_at, src_x, &p1, "send source");
        back_intact::<K>(done(&mut b.lane, 1), dst_at, dst_x, &p1, "receive target");
        // The peer's target of WRITE and READ.
        let (target, target_at, target_x) = registered::<K>(&b, &p3, remote());
        let peer = target.remote();
        let (wsrc, wsrc_at, wsrc_x) = registered::<K>(&a, &p2, AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::write(wsrc, 0..N / 2, &peer, 0).wr_id(3)).unwrap();
        back_intact::<K>(done(&mut a.lane, 3), wsrc_at, wsrc_x, &p2, "WRITE source");
        let (rdst, rdst_at, rdst_x) = registered::<K>(&a, &zero, AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(4)).unwrap();
        let want = [&p2[..N / 2], &p3[N / 2..]].concat();
        back_intact::<K>(done(&mut a.lane, 4), rdst_at, rdst_x, &want, "READ target");
        back_intact::<K>(target, target_at, target_x, &want, "the peer's WRITE target and READ source");
        drop((a, b));
    }
    t.finish();
}

/// A fetch-and-add on the peer's buffer of kind `K`, whose old value lands in a local one:
/// both come back intact, the peer's with the sum, the local one with the old value.
fn atomic_target<K: Kind>() {
    let t = DeviceTest::start();
    if !require(Cap::Atomics) {
        return t.finish();
    }
    {
        let (mut a, b) = lanes(&t);
        let (p3, zero) = (pattern(N, 3), vec![0u8; N]);
        let (target, target_at, target_x) = registered::<K>(&b, &p3, remote());
        let (result, result_at, result_x) = registered::<K>(&a, &zero, AccessFlags::LOCAL_WRITE);
        let at = N / 2 + 8;
        let old = u64::from_ne_bytes(p3[at..at + 8].try_into().unwrap());
        a.lane.post_send(a.qp, SendWr::fetch_add(result, 16, &target.remote(), at as u64, 1_000_003).wr_id(5)).unwrap();
        let mut want_result = zero.clone();
        want_result[16..24].copy_from_slice(&old.to_ne_bytes());
        back_intact::<K>(done(&mut a.lane, 5), result_at, result_x, &want_result, "atomic result");
        let mut want_target = p3.clone();
        want_target[at..at + 8].copy_from_slice(&old.wrapping_add(1_000_003).to_ne_bytes());
        back_intact::<K>(target, target_at, target_x, &want_target, "atomic target");
        drop((a, b));
    }
    t.finish();
}

#[test]
fn vec_is_sent_received_written_and_read_and_comes_back_intact() {
    send_receive_write_read::<Vec<u8>>();
}

#[test]
fn vec_as_atomic_target_comes_back_intact() {
    atomic_target::<Vec<u8>>();
}

#[test]
fn pod_vec_is_sent_received_written_and_read_and_comes_back_intact() {
    send_receive_write_read::<Vec<u64>>();
}

#[test]
fn pod_vec_as_atomic_target_comes_back_intact() {
    atomic_target::<Vec<u64>>();
}

#[test]
fn pod_boxed_slice_is_sent_received_written_and_read_and_comes_back_intact() {
    send_receive_write_read::<Box<[u32]>>();
}

#[test]
fn huge_page_mapping_is_sent_received_written_and_read_and_comes_back_intact() {
    send_receive_write_read::<Mapping>();
}

#[test]
fn huge_page_mapping_as_atomic_target_comes_back_intact() {
    atomic_target::<Mapping>();
}

#[test]
fn mmap_is_sent_received_written_and_read_and_comes_back_intact() {
    send_receive_write_read::<memmap2::MmapMut>();
}

#[test]
fn mmap_as_atomic_target_comes_back_intact() {
    atomic_target::<memmap2::MmapMut>();
}

/// `MemoryRegion::with_huge_pages` allocates in 2 MiB pages: zeroed, usable by the device,
/// and given back as the `Mapping` it is.
#[test]
fn huge_page_region_made_by_the_crate_receives_and_gives_its_mapping_back() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let mut mr = MemoryRegion::with_huge_pages(&b.pd, 3 << 20, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(mr.len(), 3 << 20);
        assert!(mr.as_slice().unwrap().iter().all(|&x| x == 0), "zeroed");
        b.lane.post_recv(b.qp, RecvWr::new(mr).wr_id(1)).unwrap();
        let (src, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 7), AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        let mr = done(&mut b.lane, 1);
        let addr = mr.addr() as usize;
        let m: Mapping = mr.into_buffer_as().unwrap();
        assert!(m.is_huge() && m.len() == 3 << 20 && m.mapped_len() == 4 << 20, "{m:?}");
        assert_eq!(m.as_ptr() as usize, addr);
        assert_eq!(addr % rdma_cm::HUGE_PAGE_SIZE, 0, "huge pages are 2 MiB aligned");
        assert!(m[..N] == pattern(N, 7)[..] && m[N..].iter().all(|&x| x == 0));
        drop((a, b));
    }
    t.finish();
}

/// A region of a `Vec<u64>` viewed as `[u64]` and `[u32]`: the views read what the device
/// wrote, and follow `as_slice`'s rules (refused while a receive may write the region).
#[test]
fn pod_views_read_what_the_device_wrote_and_wait_for_the_device() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let words: Vec<u64> = (0..N as u64 / 8).map(|i| i * 0x0101_0101_0101).collect();
        let mut mr = MemoryRegion::register(&b.pd, vec![0u64; N / 8], AccessFlags::LOCAL_WRITE).unwrap();
        assert!(mr.as_slice_of::<u64>().unwrap().iter().all(|&w| w == 0));
        mr.as_mut_slice_of::<u32>().unwrap()[0] = 7;
        let (src, _, _) = registered::<Vec<u64>>(&a, bytemuck::cast_slice(&words), AccessFlags::LOCAL_WRITE);
        // Posted through the plain QP path would lock it in place; on the lane it moves in, and
        // the view is reached again only through its completion.
        b.lane.post_recv(b.qp, RecvWr::new(mr).wr_id(1)).unwrap();
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        let mut mr = done(&mut b.lane, 1);
        assert_eq!(mr.as_slice_of::<u64>().unwrap(), &words[..]);
        assert_eq!(mr.as_slice_of::<[u8; 8]>().unwrap()[1], words[1].to_ne_bytes());
        let v: Vec<u64> = mr.into_buffer_as().unwrap();
        assert_eq!(v, words);
        drop((a, b));
    }
    t.finish();
}

/// Typed views of a misaligned chunk, of a length that is no whole number of elements, and of
/// a zero-sized type are refused, naming the numbers; the same chunk is fine as bytes.
#[test]
fn attack_pod_views_with_bad_alignment_or_length_are_refused_naming_both_numbers() {
    let t = DeviceTest::start();
    {
        let (a, _b) = lanes(&t);
        let mr = MemoryRegion::register(&a.pd, vec![0u64; 8], AccessFlags::LOCAL_WRITE).unwrap();
        let base = mr.addr();
        assert_eq!(base % 8, 0);
        // Chunks of 12 bytes: the second starts 12 bytes in (4 past an 8-byte boundary).
        let mut chunks = mr.split(12).unwrap();
        let e = chunks[1].as_slice_of::<u64>().unwrap_err();
        assert!(matches!(e, Error::TypedView { addr, len: 12, size: 8, align: 8, .. } if addr == base + 12), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("not a multiple of 8") && text.contains("alignment") && text.contains("4 bytes"),
            "{text}"
        );
        assert!(matches!(chunks[1].as_mut_slice_of::<u32>(), Ok(s) if s.len() == 3), "4-aligned, 3 words");
        // Aligned, but 12 bytes are no whole number of u64s.
        let e = chunks[0].as_mut_slice_of::<u64>().unwrap_err();
        let text = e.to_string();
        assert!(text.contains("length 12 is not a multiple of 8") && text.contains("4 bytes left over"), "{text}");
        // A zero-sized element type.
        let e = chunks[0].as_slice_of::<()>().unwrap_err();
        assert!(e.to_string().contains("zero-sized"), "{e}");
        assert_eq!(chunks[1].as_slice().unwrap().len(), 12, "bytes are always fine");
        drop((chunks, a, _b));
    }
    t.finish();
}

/// Buffers of no bytes (empty, an empty `Vec` with capacity, elements of a zero-sized type)
/// are refused before any call into the library, naming the type.
#[test]
fn attack_vec_of_no_bytes_is_refused() {
    let t = DeviceTest::start();
    {
        let (a, _b) = lanes(&t);
        let empty: Vec<u8> = Vec::with_capacity(4096);
        for e in [
            MemoryRegion::register(&a.pd, empty, AccessFlags::LOCAL_WRITE).unwrap_err(),
            MemoryRegion::register(&a.pd, vec![(); 1000], AccessFlags::LOCAL_WRITE).unwrap_err(),
            MemoryRegion::register(&a.pd, Vec::<u64>::new().into_boxed_slice(), AccessFlags::LOCAL_WRITE).unwrap_err(),
        ] {
            let text = e.to_string();
            assert!(matches!(e, Error::InvalidArgument(_)) && text.contains("0 bytes"), "{text}");
            assert!(text.contains("Vec<") || text.contains("Box<"), "names the type: {text}");
        }
        drop((a, _b));
    }
    t.finish();
}

/// Asking for another type than the one registered is refused, and the region comes back
/// still registered and usable; a region of `MemoryRegion::new` holds no buffer of the
/// caller's, whatever type is asked for.
#[test]
fn attack_vec_given_back_as_another_type_is_refused_and_the_region_kept() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let (mr, at, extra) = registered::<Vec<u8>>(&b, &pattern(N, 4), AccessFlags::LOCAL_WRITE);
        let e = mr.into_buffer_as::<Box<[u8]>>().unwrap_err();
        let text = e.to_string();
        assert!(matches!(e.error(), Error::WrongBuffer { .. }), "{text}");
        assert!(text.contains("Vec<u8>") && text.contains("Box<[u8]>"), "names both types: {text}");
        let e = e.into_region().unwrap().into_buffer_as::<Vec<u64>>().unwrap_err();
        let mr = e.into_region().unwrap();
        // Still registered: it receives.
        b.lane.post_recv(b.qp, RecvWr::new(mr).wr_id(1)).unwrap();
        let (src, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 5), AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        back_intact::<Vec<u8>>(done(&mut b.lane, 1), at, extra, &pattern(N, 5), "after two refusals");
        let own = MemoryRegion::new(&b.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
        let e = own.into_buffer().unwrap_err();
        assert!(e.to_string().contains("MemoryRegion::new"), "{e}");
        drop((a, b));
    }
    t.finish();
}

/// A region dropped while a work request holds it frees nothing: the posted receive still
/// lands, in memory that stays the region's, and the registration goes only with the last
/// hold. Here the hold is a chunk's: a huge-page mapping split in two, one chunk posted, the
/// other asked for the mapping (refused: its sibling shares it) and dropped.
#[test]
fn attack_huge_page_mapping_cannot_be_unmapped_under_a_posted_receive() {
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let (mr, at, _) = registered::<Mapping>(&b, &vec![0u8; 2 * N], AccessFlags::LOCAL_WRITE);
        let mut chunks = mr.split(N).unwrap();
        let second = chunks.pop().unwrap();
        let first = chunks.pop().unwrap();
        b.lane.post_recv(b.qp, RecvWr::new(first).wr_id(1)).unwrap();
        let e = second.into_buffer_as::<Mapping>().unwrap_err();
        assert!(matches!(e.error(), Error::InvalidArgument(m) if m.contains("1 other chunk")), "{e}");
        drop(e); // the sibling chunk, dropped while the posted one holds the registration
        assert_eq!(common::mr_count(), Some(1), "the registration lives on");
        let (src, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 6), AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::send(src, 0..N).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        let first = done(&mut b.lane, 1);
        // The last chunk gives the whole mapping back, with the receive in its first half.
        let m: Mapping = first.into_buffer_as().unwrap();
        assert_eq!(m.as_ptr() as usize, at);
        assert!(m[..N] == pattern(N, 6)[..] && m[N..2 * N].iter().all(|&x| x == 0));
        drop((a, b));
    }
    t.finish();
}

/// The environment variable that makes `attack_vec_forgotten_while_registered_is_leaked_not_freed`
/// run its body (in a child process of its own, whose exit releases what it leaks).
const CHILD: &str = "RDMA_CM_USER_MEMORY_CHILD";

/// A region forgotten while registered leaks its buffer, which is never freed: the peer can
/// still write it through the rkey, and none of the allocations made after the forget (of the
/// same size, from the same allocator) sees those bytes. Run in a child process, since a leak
/// outlives the test (the kernel releases it at the child's exit).
#[test]
fn attack_vec_forgotten_while_registered_is_leaked_not_freed() {
    if std::env::var_os(CHILD).is_some() {
        return forgotten_child();
    }
    let t = DeviceTest::start();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "attack_vec_forgotten_while_registered_is_leaked_not_freed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "the child failed:\n{text}");
    assert!(text.contains("forgotten region written after 64 allocations"), "the child ran its body:\n{text}");
    t.finish();
}

fn forgotten_child() {
    let t = DeviceTest::start();
    let (mut a, b) = lanes(&t);
    let target = Vec::<u8>::filled(&vec![0u8; N]);
    let mr = MemoryRegion::register(&b.pd, target, remote()).unwrap();
    let peer = mr.remote();
    std::mem::forget(mr);
    // Were the forgotten buffer freed, one of these (same size, same allocator) would get it.
    let fresh: Vec<Vec<u8>> = (0..64).map(|_| Vec::<u8>::filled(&vec![0u8; N])).collect();
    let (src, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 8), AccessFlags::LOCAL_WRITE);
    a.lane.post_send(a.qp, SendWr::write(src, 0..N, &peer, 0).wr_id(1)).unwrap();
    drop(done(&mut a.lane, 1));
    assert!(fresh.iter().all(|v| v.iter().all(|&x| x == 0)), "a fresh allocation was written by the device");
    // The write landed in the forgotten buffer itself.
    // SAFETY: the buffer was leaked (never freed) and nothing else refers to it; the WRITE's
    // completion was reaped, so the device is done writing it; read only here, once.
    let landed = unsafe { std::slice::from_raw_parts(peer.addr as *const u8, N) }.to_vec();
    assert!(landed == pattern(N, 8), "the WRITE landed in the forgotten buffer");
    println!("forgotten region written after 64 allocations");
    drop((a, b, fresh));
}

/// A `Vec` registered at a chosen I/O virtual address (`register_at`, `ibv_reg_mr_iova2`):
/// the region says that address, a peer READs and WRITEs it there, its own lane sends from it
/// through that address, and the `Vec` comes back intact where it was. Soft-iWARP ignores the
/// address asked for (its driver keeps the virtual one): on an iWARP device whose READ at the
/// chosen address fails, the test says so and skips.
#[test]
fn vec_registered_at_a_chosen_io_address_is_addressed_there() {
    const IOVA: u64 = 0x7e57_0000_1000;
    let t = DeviceTest::start();
    {
        let (mut a, mut b) = lanes(&t);
        let buf = Vec::<u8>::filled(&pattern(N, 12));
        let at = buf.at();
        // The kernel maps whole pages: the address must lie as far into its page as the buffer.
        let iova = IOVA + (at % 4096) as u64;
        let e = MemoryRegion::register_at(&b.pd, buf, remote(), iova + 1).unwrap_err();
        let text = e.to_string();
        let (off, boff) = ((at + 1) % 4096, at % 4096);
        assert!(
            text.contains(&format!("{off} bytes into its page")) && text.contains(&format!("{boff} bytes")),
            "{text}"
        );
        let buf = Vec::<u8>::filled(&pattern(N, 12));
        let (at, extra) = (buf.at(), buf.extra());
        let iova = IOVA + (at % 4096) as u64;
        let mr = MemoryRegion::register_at(&b.pd, buf, remote(), iova).unwrap();
        assert_eq!((mr.addr(), mr.remote().addr, mr.len()), (iova, iova, N));
        assert_ne!(at as u64, iova);
        let peer = mr.remote();
        // The peer READs it at the chosen address.
        let (rdst, _, _) = registered::<Vec<u8>>(&a, &vec![0u8; N], AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(1)).unwrap();
        let mut c = reap(&mut a.lane, 1).pop().unwrap();
        if !c.is_ok() && common::caps::iwarp() {
            let why = format!(
                "{} ignores it: a READ at {IOVA:#x} completed with {:?}",
                common::caps::device_under_test(),
                c.status()
            );
            common::skipped("a region at a chosen I/O address", &why);
            drop((c, mr, a, b));
            return t.finish();
        }
        assert!(c.is_ok() && c.wr_id() == 1, "{c:?}");
        let rdst: Vec<u8> = c.take_region().unwrap().into_buffer_as().unwrap();
        assert!(rdst == pattern(N, 12), "the READ at the chosen address read the buffer");
        // The peer WRITEs its second half there.
        let (wsrc, _, _) = registered::<Vec<u8>>(&a, &pattern(N / 2, 13), AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::write(wsrc, 0..N / 2, &peer, (N / 2) as u64).wr_id(2)).unwrap();
        drop(done(&mut a.lane, 2));
        // Its own lane sends from it (the scatter/gather entry says the chosen address).
        let (dst, _, _) = registered::<Vec<u8>>(&a, &vec![0u8; N], AccessFlags::LOCAL_WRITE);
        a.lane.post_recv(a.qp, RecvWr::new(dst).wr_id(3)).unwrap();
        b.lane.post_send(b.qp, SendWr::send(mr, 0..N).wr_id(4)).unwrap();
        let want = [&pattern(N, 12)[..N / 2], &pattern(N / 2, 13)[..]].concat();
        let mr = done(&mut b.lane, 4);
        let got: Vec<u8> = done(&mut a.lane, 3).into_buffer_as().unwrap();
        assert!(got == want, "the send from the chosen address carried the buffer");
        back_intact::<Vec<u8>>(mr, at, extra, &want, "registered at a chosen address");
        // An address range that wraps is refused before the library is called.
        let e = MemoryRegion::register_at(&b.pd, vec![0u8; 16], AccessFlags::LOCAL_WRITE, u64::MAX - 8).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("address space")), "{e}");
        drop((a, b));
    }
    t.finish();
}

/// Relaxed ordering (`IBV_ACCESS_RELAXED_ORDERING`) is an optional access flag: a device
/// without it (a software one has no PCIe writes to reorder) ignores it, and the region works
/// as any other; the region says it was asked for.
#[test]
fn vec_registered_with_relaxed_ordering_works_as_any_other() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lanes(&t);
        let access = remote() | AccessFlags::RELAXED_ORDERING;
        let (target, at, extra) = registered::<Vec<u8>>(&b, &pattern(N, 14), access);
        assert!(target.access().contains(AccessFlags::RELAXED_ORDERING));
        let peer = target.remote();
        let (wsrc, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 15), access);
        a.lane.post_send(a.qp, SendWr::write(wsrc, 0..N, &peer, 0).wr_id(1)).unwrap();
        drop(done(&mut a.lane, 1));
        let (rdst, _, _) = registered::<Vec<u8>>(&a, &vec![0u8; N], access);
        a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(2)).unwrap();
        let got: Vec<u8> = done(&mut a.lane, 2).into_buffer_as().unwrap();
        assert!(got == pattern(N, 15));
        back_intact::<Vec<u8>>(target, at, extra, &pattern(N, 15), "registered with relaxed ordering");
        drop((a, b));
    }
    t.finish();
}

/// What a file truncated under its registered mapping means (the mapping's maker promised it
/// would not be, since `MmapOptions::map_mut` is unsafe; this pins what happens when the
/// promise is broken): a mapping that reaches past the file's end is refused by the
/// registration (the kernel cannot pin pages the file does not have); once registered, the
/// pages are pinned, so a truncation leaves the device working on pages the file no longer has
/// (a peer's WRITE and READ still complete, and read back what was written), while the CPU
/// would get SIGBUS touching them: this test never does.
#[test]
fn mmap_of_a_file_truncated_while_registered_keeps_the_device_on_its_pinned_pages() {
    let t = DeviceTest::start();
    {
        let (mut a, b) = lanes(&t);
        let path = format!("/dev/shm/rdma-cm-user-memory-truncated-{}", std::process::id());
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        // A mapping of two pages over a file of half a page: the second page has nothing to pin.
        file.set_len((N / 2) as u64).unwrap();
        // SAFETY: the file is this test's own, and nothing touches the mapping's bytes past the
        // file's end (the registration below fails before any access).
        let short = unsafe { memmap2::MmapOptions::new().len(2 * N).map_mut(&file) }.unwrap();
        let e = MemoryRegion::register(&b.pd, short, remote()).unwrap_err();
        assert_eq!(e.errno(), Some(libc::EFAULT), "{e}");
        // A whole file, registered, then truncated to nothing.
        file.set_len(N as u64).unwrap();
        // SAFETY: the file is this test's own; after the truncation below, the mapping's bytes
        // are never touched by the CPU (it is given back and dropped unread).
        let m = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.unwrap();
        let target = MemoryRegion::register(&b.pd, m, remote()).unwrap();
        let peer = target.remote();
        file.set_len(0).unwrap();
        let (wsrc, _, _) = registered::<Vec<u8>>(&a, &pattern(N, 16), AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::write(wsrc, 0..N, &peer, 0).wr_id(1)).unwrap();
        drop(done(&mut a.lane, 1));
        let (rdst, _, _) = registered::<Vec<u8>>(&a, &vec![0u8; N], AccessFlags::LOCAL_WRITE);
        a.lane.post_send(a.qp, SendWr::read(rdst, 0..N, &peer, 0).wr_id(2)).unwrap();
        let got: Vec<u8> = done(&mut a.lane, 2).into_buffer_as().unwrap();
        assert!(got == pattern(N, 16), "the device reads back what it wrote, in the pinned pages");
        assert_eq!(file.metadata().unwrap().len(), 0, "the file itself stays empty");
        let m: memmap2::MmapMut = target.into_buffer_as().unwrap();
        drop(m); // unmapped without a touch
        drop((a, b));
    }
    t.finish();
}
