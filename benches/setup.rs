//! The cost of setup: PD, CQ, QP and CM id creation, memory registration, and a whole
//! connection, each measured as `raw` (the same rdma-sys calls made directly) beside `rdma_cm`
//! (through the crate), on the same device in the same process.
//!
//! ```text
//! cargo bench --bench setup            # on a machine with a device (else in the guest)
//! harness/bench                        # everything, plus the rdma-core/perftest comparison
//! RDMA_VM_HUGEPAGES=160 cargo bench --bench setup -- 'mr_pages|mr_kinds'
//!                                      # 4 KiB beside 2 MiB pages up to 256 MiB (see mr_pages;
//!                                      # 1 GiB with RDMA_VM_HUGEPAGES=520 RDMA_VM_MEM=3072)
//! ```

mod common;

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;

use common::{criterion, raw_expect, route, zeroed, T};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rdma_cm::ffi;
use rdma_cm::ffi::rdma_cm_event_type::*;
use rdma_cm::{
    AccessFlags, Client, CmId, CompletionQueue, ConnParam, EventChannel, Mapping, MemoryRegion, ProtectionDomain,
    QpInit, Server, StableBuffer, HUGE_PAGE_SIZE,
};

fn pd_alloc(c: &mut Criterion) {
    let route = route(7900);
    let ctx = route.context().unwrap();
    let mut g = c.benchmark_group("pd_alloc");
    g.bench_function("raw", |b| {
        b.iter(|| {
            // SAFETY: the context is open (held by `ctx`); the PD is freed at once.
            unsafe {
                let pd = ffi::ibv_alloc_pd(ctx.as_raw());
                assert!(!pd.is_null());
                assert_eq!(ffi::ibv_dealloc_pd(pd), 0);
            }
        })
    });
    g.bench_function("rdma_cm", |b| b.iter(|| drop(black_box(ProtectionDomain::new(&ctx).unwrap()))));
    g.finish();
}

fn cq_create(c: &mut Criterion) {
    let route = route(7901);
    let ctx = route.context().unwrap();
    let mut g = c.benchmark_group("cq_create");
    for depth in [16u32, 4096] {
        g.bench_function(BenchmarkId::new("raw", depth), |b| {
            b.iter(|| {
                // SAFETY: context open; the channel and CQ are destroyed at once, CQ first.
                unsafe {
                    let ch = ffi::ibv_create_comp_channel(ctx.as_raw());
                    let cq = ffi::ibv_create_cq(ctx.as_raw(), depth as i32, std::ptr::null_mut(), ch, 0);
                    assert!(!ch.is_null() && !cq.is_null());
                    assert_eq!(ffi::ibv_destroy_cq(cq), 0);
                    assert_eq!(ffi::ibv_destroy_comp_channel(ch), 0);
                }
            })
        });
        g.bench_function(BenchmarkId::new("rdma_cm", depth), |b| {
            b.iter(|| drop(black_box(CompletionQueue::new(&ctx, depth).unwrap())))
        });
    }
    g.finish();
}

fn qp_create(c: &mut Criterion) {
    let mut held = Some(route(7902));
    let ctx = held.as_ref().unwrap().context().unwrap();
    // The route's id, for the raw calls: it lives as long as `held`'s route, which the crate's
    // variant takes and gives back whole (`destroy_qp` returns the same route).
    let id = held.as_ref().unwrap().id().as_raw();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let (scq, rcq) = (CompletionQueue::new(&ctx, 16).unwrap(), CompletionQueue::new(&ctx, 16).unwrap());
    let mut g = c.benchmark_group("qp_create");
    g.bench_function("raw", |b| {
        b.iter(|| {
            // SAFETY: zeroed ibv_qp_init_attr is valid; id, PD and CQs are alive and on one
            // device; the QP is destroyed at once with rdma_destroy_qp.
            unsafe {
                let mut attr: ffi::ibv_qp_init_attr = zeroed();
                attr.send_cq = scq.as_raw();
                attr.recv_cq = rcq.as_raw();
                attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
                attr.cap = ffi::ibv_qp_cap {
                    max_send_wr: 16,
                    max_recv_wr: 16,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 64,
                };
                assert_eq!(ffi::rdma_create_qp(id, pd.as_raw(), &mut attr), 0);
                ffi::rdma_destroy_qp(id);
            }
        })
    });
    g.bench_function("rdma_cm", |b| {
        b.iter(|| {
            // One QP per id is a type fact: create_qp consumes the route, destroy_qp returns it.
            let init = QpInit::new().send_cq(Arc::clone(&scq)).recv_cq(Arc::clone(&rcq));
            let q = held.take().unwrap().create_qp(&pd, init).unwrap();
            held = Some(black_box(q).destroy_qp());
        })
    });
    g.finish();
}

fn cm_id_create(c: &mut Criterion) {
    let ch = EventChannel::new().unwrap();
    let mut g = c.benchmark_group("cm_id_create");
    g.bench_function("raw", |b| {
        b.iter(|| {
            let mut id = std::ptr::null_mut();
            // SAFETY: the channel is open; the id is destroyed at once.
            unsafe {
                let ps = ffi::rdma_port_space::RDMA_PS_TCP;
                assert_eq!(ffi::rdma_create_id(ch.as_raw(), &mut id, std::ptr::null_mut(), ps), 0);
                assert_eq!(ffi::rdma_destroy_id(id), 0);
            }
        })
    });
    g.bench_function("rdma_cm", |b| b.iter(|| drop(black_box(CmId::new(&ch).unwrap()))));
    g.finish();
}

fn mr_reg(c: &mut Criterion) {
    let route = route(7903);
    let pd = route.alloc_pd().unwrap();
    let mut g = c.benchmark_group("mr_reg");
    g.sample_size(10);
    for (name, len) in
        [("4KiB", 4usize << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20), ("64MiB", 64 << 20)]
    {
        // Pre-faulted: every page written once, so the figure is registration alone.
        let mut buf = Some(vec![1u8; len].into_boxed_slice());
        // `raw_alloc`: the raw calls plus the one small allocation the wrapper makes (its
        // `Arc`, made after the registration and freed before the deregistration): a control.
        for (variant, alloc) in [("raw", false), ("raw_alloc", true)] {
            g.bench_function(BenchmarkId::new(variant, name), |b| {
                let p = buf.as_mut().unwrap();
                b.iter(|| {
                    // SAFETY: `p` is a live buffer of `len` bytes; the MR is deregistered at once.
                    unsafe {
                        let mr = ffi::ibv_reg_mr(
                            pd.as_raw(),
                            p.as_mut_ptr().cast(),
                            len,
                            AccessFlags::LOCAL_WRITE.bits() as i32,
                        );
                        assert!(!mr.is_null(), "ibv_reg_mr {len}");
                        if alloc {
                            drop(black_box(Box::new([0u64; 8])));
                        }
                        assert_eq!(ffi::ibv_dereg_mr(mr), 0);
                    }
                })
            });
        }
        g.bench_function(BenchmarkId::new("rdma_cm", name), |b| {
            b.iter(|| {
                let mr = MemoryRegion::register(&pd, buf.take().unwrap(), AccessFlags::LOCAL_WRITE).unwrap();
                buf = Some(mr.into_buffer().unwrap());
            })
        });
    }
    g.finish();
}

/// Registers `buf` (reg + dereg per iteration) as `raw_{kind}/{size}`, the same `ibv_reg_mr` and
/// `ibv_dereg_mr` on its bytes, beside `rdma_cm_{kind}/{size}`, `MemoryRegion::register` and
/// `into_buffer_as` back to the same buffer.
fn reg_pair<B, M>(g: &mut criterion::BenchmarkGroup<'_, M>, pd: &Arc<ProtectionDomain>, kind: &str, size: &str, buf: B)
where
    B: StableBuffer + std::ops::DerefMut<Target = [u8]>,
    M: criterion::measurement::Measurement,
{
    let at = buf.as_ptr() as usize;
    eprintln!("{kind}/{size}: {} KiB of its mapping in transparent huge pages", thp_kib(at));
    let mut buf = Some(buf);
    g.bench_function(BenchmarkId::new(format!("raw_{kind}"), size), |b| {
        let p = buf.as_mut().unwrap();
        let len = p.len();
        b.iter(|| {
            // SAFETY: `p` is a live buffer of `len` bytes; the MR is deregistered at once.
            unsafe {
                let mr =
                    ffi::ibv_reg_mr(pd.as_raw(), p.as_mut_ptr().cast(), len, AccessFlags::LOCAL_WRITE.bits() as i32);
                assert!(!mr.is_null(), "ibv_reg_mr {kind} {size}");
                assert_eq!(ffi::ibv_dereg_mr(mr), 0);
            }
        })
    });
    g.bench_function(BenchmarkId::new(format!("rdma_cm_{kind}"), size), |b| {
        b.iter(|| {
            let mr = MemoryRegion::register(pd, buf.take().unwrap(), AccessFlags::LOCAL_WRITE).unwrap();
            buf = Some(mr.into_buffer_as::<B>().unwrap());
        })
    });
}

/// A mapping of `len` bytes, every page written once (so the figure is registration alone):
/// in 2 MiB huge pages, or in 4 KiB pages with transparent huge pages refused for it (else the
/// kernel may back a large anonymous mapping with 2 MiB pages anyway).
fn prefaulted(len: usize, huge: bool) -> Mapping {
    let mut m = if huge {
        Mapping::huge_pages(len).expect("huge pages (RDMA_VM_HUGEPAGES sets the guest's pool)")
    } else {
        let mut m = Mapping::anonymous(len).unwrap();
        // SAFETY: the range is the mapping's own, whole pages from its page-aligned start;
        // advice changes how the kernel backs it, not its contents.
        let ret = unsafe { libc::madvise(m.as_mut_ptr().cast(), m.mapped_len(), libc::MADV_NOHUGEPAGE) };
        assert_eq!(ret, 0, "madvise(MADV_NOHUGEPAGE)");
        m
    };
    m.fill(1);
    m
}

/// The `AnonHugePages` of the mapping holding `addr` (/proc/self/smaps): how much of it the
/// kernel backs with transparent huge pages, which make pinning it cheaper.
fn thp_kib(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
            let (lo, hi) = range.split_once('-').unwrap();
            let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
            inside = (lo..hi).contains(&addr);
        } else if let Some(v) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
            return v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
        }
    }
    0
}

/// Bytes of free 2 MiB huge pages, from /proc/meminfo.
fn huge_bytes_free() -> usize {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let free: usize =
        info.lines().find_map(|l| l.strip_prefix("HugePages_Free:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    free * HUGE_PAGE_SIZE
}

/// What 2 MiB huge pages save: registration of the same sizes in 4 KiB pages (`*_4KiB`) and in
/// huge pages (`*_2MiB`), raw beside the crate. Sizes the huge-page pool cannot hold are skipped
/// for both (the guest reserves 128 MiB; `RDMA_VM_HUGEPAGES=160` holds 256 MiB, and
/// `RDMA_VM_HUGEPAGES=520 RDMA_VM_MEM=3072` 1 GiB beside a 1 GiB buffer of 4 KiB pages).
fn mr_pages(c: &mut Criterion) {
    let route = route(7904);
    let pd = route.alloc_pd().unwrap();
    let mut g = c.benchmark_group("mr_pages");
    g.sample_size(10);
    for (name, len) in [
        ("64KiB", 64usize << 10),
        ("1MiB", 1 << 20),
        ("16MiB", 16 << 20),
        ("64MiB", 64 << 20),
        ("256MiB", 256 << 20),
        ("1GiB", 1 << 30),
    ] {
        let free = huge_bytes_free();
        if len.next_multiple_of(HUGE_PAGE_SIZE) > free {
            eprintln!("mr_pages/{name}: skipped, {free} bytes of huge pages free (RDMA_VM_HUGEPAGES raises the pool)");
            continue;
        }
        reg_pair(&mut g, &pd, "4KiB", name, prefaulted(len, false));
        reg_pair(&mut g, &pd, "2MiB", name, prefaulted(len, true));
    }
    g.finish();
}

/// The crate ÷ raw for each kind of caller-owned buffer at 1 MiB, pre-faulted.
fn mr_kinds(c: &mut Criterion) {
    let route = route(7905);
    let pd = route.alloc_pd().unwrap();
    let mut g = c.benchmark_group("mr_kinds");
    g.sample_size(10);
    let len = 1 << 20;
    reg_pair(&mut g, &pd, "vec", "1MiB", vec![1u8; len]);
    reg_pair(&mut g, &pd, "box", "1MiB", vec![1u8; len].into_boxed_slice());
    let mut m = Mapping::anonymous(len).unwrap();
    m.fill(1);
    reg_pair(&mut g, &pd, "mapping", "1MiB", m);
    reg_pair(&mut g, &pd, "huge_mapping", "1MiB", prefaulted(len, true));
    g.finish();
}

/// One whole connection through the crate: the server thread accepts, waits for the client's
/// disconnect, and tears down.
fn connect_once_crate(dst: SocketAddr, server: &Server2) {
    let route = Client::new().unwrap().resolve_addr(None, dst, T).unwrap().resolve_route(T).unwrap();
    let pd = route.alloc_pd().unwrap();
    let q = route.create_qp(&pd, QpInit::new()).unwrap();
    let conn = q.connect(&ConnParam::new(), T).unwrap();
    conn.disconnect(T).unwrap();
    server.done.recv().unwrap();
}

struct Server2 {
    done: std::sync::mpsc::Receiver<()>,
}

fn crate_server(addr: std::net::IpAddr) -> (SocketAddr, Server2) {
    let listener = Server::new().unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        while let Ok(req) = listener.get_request(std::time::Duration::from_secs(600)) {
            let pd = req.alloc_pd().unwrap();
            let q = req.create_qp(&pd, QpInit::new()).unwrap();
            let mut conn = q.accept(&ConnParam::new(), T).unwrap();
            while !conn.is_disconnected() {
                conn.next_event(T).unwrap();
            }
            drop((conn, pd));
            if tx.send(()).is_err() {
                break;
            }
        }
    });
    (dst, Server2 { done: rx })
}

/// The crate's event-loop server: every connection stays on the listener's channel (no
/// per-connection channel to open, migrate to and close), as a raw C server does.
fn crate_server_shared(addr: std::net::IpAddr) -> (SocketAddr, Server2) {
    let ch = EventChannel::new().unwrap();
    let listener = Server::on_channel(&ch).unwrap().bind(SocketAddr::new(addr, 0)).unwrap().listen(16).unwrap();
    let dst = listener.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let _listener = listener;
        let mut accepting = None;
        let mut conn: Option<(rdma_cm::Connection, Arc<ProtectionDomain>)> = None;
        while let Ok(ev) = ch.get_event(std::time::Duration::from_secs(600)) {
            match ev.event_type() {
                rdma_cm::CmEventType::ConnectRequest => {
                    let req = rdma_cm::ConnectRequest::from_event(ev).unwrap();
                    let pd = req.alloc_pd().unwrap();
                    let q = req.create_qp(&pd, QpInit::new()).unwrap();
                    accepting = Some((q.start_accept(&ConnParam::new()).unwrap(), pd));
                }
                rdma_cm::CmEventType::Established => {
                    let (acc, pd) = accepting.take().unwrap();
                    conn = Some((acc.complete(ev).unwrap(), pd));
                }
                rdma_cm::CmEventType::Disconnected => {
                    let (mut c, pd) = conn.take().unwrap();
                    c.handle_event(&ev);
                    drop((c, pd));
                    if tx.send(()).is_err() {
                        break;
                    }
                }
                _ => {}
            }
        }
    });
    (dst, Server2 { done: rx })
}

/// The same connection with raw librdmacm/verbs calls on both sides.
mod raw_conn {
    use super::*;

    pub struct Qp {
        pub pd: *mut ffi::ibv_pd,
        pub cqs: [*mut ffi::ibv_cq; 2],
        pub chs: [*mut ffi::ibv_comp_channel; 2],
    }

    /// Creates CQs (with channels) and an RC QP on `id`, as the crate does.
    ///
    /// # Safety
    /// `id` must be route-resolved or a connection request.
    pub unsafe fn create_qp(id: *mut ffi::rdma_cm_id) -> Qp {
        // SAFETY: caller guarantees `id`; librdmacm set its verbs context.
        unsafe {
            let ctx = (*id).verbs;
            let pd = ffi::ibv_alloc_pd(ctx);
            let chs = [ffi::ibv_create_comp_channel(ctx), ffi::ibv_create_comp_channel(ctx)];
            let cqs = [
                ffi::ibv_create_cq(ctx, 16, std::ptr::null_mut(), chs[0], 0),
                ffi::ibv_create_cq(ctx, 16, std::ptr::null_mut(), chs[1], 0),
            ];
            let mut attr: ffi::ibv_qp_init_attr = zeroed();
            attr.send_cq = cqs[0];
            attr.recv_cq = cqs[1];
            attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            attr.cap = ffi::ibv_qp_cap {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 64,
            };
            assert_eq!(ffi::rdma_create_qp(id, pd, &mut attr), 0);
            Qp { pd, cqs, chs }
        }
    }

    /// # Safety
    /// `id` must own the QP described by `q`, and nothing may use them afterwards.
    pub unsafe fn destroy(id: *mut ffi::rdma_cm_id, q: Qp) {
        // SAFETY: caller guarantees exclusivity; children are destroyed before parents.
        unsafe {
            ffi::rdma_destroy_qp(id);
            for cq in q.cqs {
                ffi::ibv_destroy_cq(cq);
            }
            for ch in q.chs {
                ffi::ibv_destroy_comp_channel(ch);
            }
            ffi::ibv_dealloc_pd(q.pd);
            ffi::rdma_destroy_id(id);
        }
    }

    pub fn conn_param() -> ffi::rdma_conn_param {
        // SAFETY: rdma_conn_param is plain old data.
        let mut p: ffi::rdma_conn_param = unsafe { zeroed() };
        p.responder_resources = 1;
        p.initiator_depth = 1;
        p.flow_control = 1;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        p
    }

    /// A raw server: one channel, accept, wait for DISCONNECTED, tear down, repeat.
    pub fn server(addr: std::net::IpAddr) -> (SocketAddr, Server2) {
        let (tx, rx) = std::sync::mpsc::channel();
        let (atx, arx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            // SAFETY: every pointer below comes from the call before it and is used on this
            // thread only; events are acked in raw_expect before their ids are destroyed.
            unsafe {
                let ch = ffi::rdma_create_event_channel();
                let mut lid = std::ptr::null_mut();
                assert_eq!(
                    ffi::rdma_create_id(ch, &mut lid, std::ptr::null_mut(), ffi::rdma_port_space::RDMA_PS_TCP),
                    0
                );
                let mut sa = common::sockaddr_v4(SocketAddr::new(addr, 0));
                assert_eq!(ffi::rdma_bind_addr(lid, (&mut sa as *mut libc::sockaddr_storage).cast()), 0);
                assert_eq!(ffi::rdma_listen(lid, 16), 0);
                atx.send(u16::from_be((*lid).route.addr.src_addr_union.src_sin.sin_port)).unwrap();
                loop {
                    let id = raw_expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
                    let q = create_qp(id);
                    let mut p = conn_param();
                    assert_eq!(ffi::rdma_accept(id, &mut p), 0);
                    raw_expect(ch, RDMA_CM_EVENT_ESTABLISHED);
                    raw_expect(ch, RDMA_CM_EVENT_DISCONNECTED);
                    ffi::rdma_disconnect(id);
                    destroy(id, q);
                    if tx.send(()).is_err() {
                        break;
                    }
                }
            }
        });
        let port = arx.recv().unwrap();
        (SocketAddr::new(addr, port), Server2 { done: rx })
    }

    /// One raw client connection through teardown.
    pub fn connect_once(dst: SocketAddr, server: &Server2) {
        // SAFETY: as in `server`.
        unsafe {
            let ch = ffi::rdma_create_event_channel();
            let mut id = std::ptr::null_mut();
            assert_eq!(ffi::rdma_create_id(ch, &mut id, std::ptr::null_mut(), ffi::rdma_port_space::RDMA_PS_TCP), 0);
            let mut d = common::sockaddr_v4(dst);
            assert_eq!(
                ffi::rdma_resolve_addr(
                    id,
                    std::ptr::null_mut(),
                    (&mut d as *mut libc::sockaddr_storage).cast(),
                    10_000
                ),
                0
            );
            raw_expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED);
            assert_eq!(ffi::rdma_resolve_route(id, 10_000), 0);
            raw_expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED);
            let q = create_qp(id);
            let mut p = conn_param();
            assert_eq!(ffi::rdma_connect(id, &mut p), 0);
            raw_expect(ch, RDMA_CM_EVENT_ESTABLISHED);
            assert_eq!(ffi::rdma_disconnect(id), 0);
            raw_expect(ch, RDMA_CM_EVENT_DISCONNECTED);
            destroy(id, q);
            ffi::rdma_destroy_event_channel(ch);
        }
        server.done.recv().unwrap();
    }
}

fn connect(c: &mut Criterion) {
    let addr = common::device_addr();
    let (raw_dst, raw_srv) = raw_conn::server(addr);
    let (dst, srv) = crate_server(addr);
    let (sdst, ssrv) = crate_server_shared(addr);
    let mut g = c.benchmark_group("connect");
    g.sample_size(10);
    g.bench_function("raw", |b| b.iter(|| raw_conn::connect_once(raw_dst, &raw_srv)));
    g.bench_function("rdma_cm", |b| b.iter(|| connect_once_crate(dst, &srv)));
    g.bench_function("rdma_cm_event_loop", |b| b.iter(|| connect_once_crate(sdst, &ssrv)));
    g.finish();
}

criterion_group! {
    name = benches;
    config = criterion();
    targets = pd_alloc, cq_create, qp_create, cm_id_create, mr_reg, mr_pages, mr_kinds, connect
}
criterion_main!(benches);
