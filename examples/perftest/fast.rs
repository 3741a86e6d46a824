//! The latency and rate modes' data path: a connection attached to a [`Lane`], the crate's
//! fast path (`rdma_cm::verbs::lane`). What the examples teach about it:
//!
//! - the QP is created with the lane's CQ ([`Lane::qp_init_from`]) and, once connected,
//!   handed to the lane ([`Lane::attach`] takes the [`Connection`]);
//! - a work request *moves* its [`MemoryRegion`] into the lane, and the completion that retires
//!   it hands it back: [`Regions`] numbers the regions, each work request carries its region's
//!   number as `wr_id`, so every completion knows where its region goes back;
//! - a lane has no completion channel: the examples poll it, spinning (`--busy-poll`) or
//!   yielding and then sleeping between empty polls ([`LaneConn::idle`]), and its connection's
//!   CM events (the peer's `DISCONNECTED`) are read from the connection's id between polls.
//!
//! This module is the tool's only wait loop: every wait of `perf_client` and `perf_server` on a
//! lane goes through [`LaneConn::next`], [`LaneConn::reap`], [`LaneConn::reap_once`] or
//! [`LaneConn::wait`], and all of them through [`LaneConn::idle`] after an empty poll. When the
//! lane's own blocking and spinning waits take over, they replace `idle` and its callers here,
//! and nothing else in the tool changes.

#![allow(dead_code)] // each side uses part of this module

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_cm::verbs::lane::{Completion, Lane, LaneQp, Wc};
use rdma_cm::{CmEventType, CmId, Connection, Error, MemoryRegion};

/// Empty polls between two looks at the clock and at the CM events (every 16 once sleeping):
/// reading the clock is a system call in the project's guest, and the CM's channel is one too.
const SPINS_PER_CHECK: u32 = 1024;

/// The minimum RNR timer code of a lane's QP (12: 0.64 ms; `ConnParam::min_rnr_timer`), on
/// both examples: its receives are posted once it is connected, and a message that comes
/// before them waits this long before it is sent again (the CM's own value is 655 ms).
pub const LANE_MIN_RNR_TIMER: u8 = 12;

/// Without `--busy-poll`: the pause between two empty polls once [`SPINS_PER_CHECK`] of them
/// found nothing (before that, each yields the CPU).
const IDLE_SLEEP: Duration = Duration::from_micros(200);

/// What ends a [`LaneConn::reap`] early: the first failed completion's error, else the first
/// error of its closure.
enum Fault {
    Failed(Error),
    Refused(Error),
}

/// Notes a failed completion's error (`e`, `None` for none) in `fault`, unless a failed
/// completion's is there already: a failure replaces an error of the closure.
#[cold]
#[inline(never)]
fn note_failed(fault: &mut Option<Fault>, e: Option<Error>) {
    if let (Some(e), false) = (e, matches!(fault, Some(Fault::Failed(_)))) {
        *fault = Some(Fault::Failed(e));
    }
}

/// Notes an error of `reap`'s closure in `fault`, unless a fault is there already.
#[cold]
#[inline(never)]
fn note_refused(fault: &mut Option<Fault>, e: Error) {
    fault.get_or_insert(Fault::Refused(e));
}

/// A connection whose QP a lane owns, with what the examples wait on: completions, bounded,
/// and the peer's departure.
pub struct LaneConn {
    // Field order is drop order: the lane (and the connection in it) before the id.
    pub lane: Lane,
    pub qp: LaneQp,
    id: Arc<CmId>,
    peer: Option<SocketAddr>,
    busy_poll: bool,
    /// The peer's `DISCONNECTED` (or a device removal) was seen.
    gone: bool,
    /// Empty polls since the last completion, and when the first of them was counted.
    idle: (u32, Option<Instant>),
}

impl LaneConn {
    /// Hands `conn` (whose QP was created with `lane`'s [`Lane::qp_init_from`]) to `lane`.
    /// `busy_poll`: spin between empty polls; otherwise yield the CPU between them.
    pub fn attach(mut lane: Lane, conn: Connection, busy_poll: bool) -> Result<LaneConn, Error> {
        let id = Arc::clone(conn.id());
        let peer = conn.peer_addr();
        let qp = lane.attach(conn).map_err(Error::from)?;
        Ok(LaneConn { lane, qp, id, peer, busy_poll, gone: false, idle: (0, None) })
    }

    /// Reads the connection's pending CM events and feeds them to the lane (a `DISCONNECTED`
    /// moves the QP to the error state, which flushes what is posted).
    fn events(&mut self) -> Result<(), Error> {
        while let Some(ev) = self.id.channel().try_get_event_for(self.id.handle())? {
            self.lane.handle_event(self.qp, &ev)?;
            if matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval) {
                self.gone = true;
            }
        }
        Ok(())
    }

    /// A completion came: the wait for the next one starts afresh.
    pub fn progressed(&mut self) {
        self.idle = (0, None);
    }

    /// Called after each empty poll: spins (or, without `busy_poll`, yields, and sleeps once
    /// [`SPINS_PER_CHECK`] polls found nothing), and every [`SPINS_PER_CHECK`] polls (every 16
    /// while sleeping) looks at the CM events and the clock. Errors when the peer left or when
    /// nothing came for `t`. Busy-polling, it only counts between two looks and does not
    /// pause: as in perftest's loop, the next poll comes at once (`PAUSE` alone takes about
    /// 140 cycles on recent x86 cores). Inlined, so an empty busy poll costs the loop a count.
    #[inline]
    pub fn idle(&mut self, op: &'static str, t: Duration) -> Result<(), Error> {
        // Wrapping: 1,024 divides 2^32, so the schedule holds past the wrap (a wait that long
        // has a timeout far longer than the examples' default).
        self.idle.0 = self.idle.0.wrapping_add(1);
        if self.busy_poll && self.idle.0 % SPINS_PER_CHECK != 0 {
            return Ok(());
        }
        self.idle_rest(op, t)
    }

    /// [`LaneConn::idle`] when it does more than count.
    #[inline(never)]
    fn idle_rest(&mut self, op: &'static str, t: Duration) -> Result<(), Error> {
        // Sleeping, the clock and the events are looked at every 16 polls (3.2 ms).
        let sleeping = !self.busy_poll && self.idle.0 >= SPINS_PER_CHECK;
        if self.idle.0 % if sleeping { 16 } else { SPINS_PER_CHECK } == 0 {
            self.events()?;
            if self.gone {
                return Err(Error::Disconnected { op, addr: self.peer });
            }
            let now = Instant::now();
            if now >= *self.idle.1.get_or_insert(now + t) {
                let hint = Some("the peer stopped answering: is it alive, and is its side still running?");
                return Err(Error::Timeout { op, timeout: t, addr: self.peer, hint });
            }
        }
        if sleeping {
            // Idle for a while (a WRITE stream's target, a peer thinking): sleep between polls,
            // as a blocking wait would, instead of taking a core from the transport.
            std::thread::sleep(IDLE_SLEEP);
        } else if !self.busy_poll {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// A failed completion as the error that explains it: the peer's departure when that is
    /// what flushed it, else the completion's status.
    pub fn failed(&mut self, c: &Wc, op: &'static str) -> Error {
        match c.error() {
            Some(e) => self.failed_as(e, op),
            None => Error::InvalidArgument(format!("{op}: a successful completion reported as failed")),
        }
    }

    /// A failed completion's error `e` as the error that explains it (see [`LaneConn::failed`]).
    fn failed_as(&mut self, e: Error, op: &'static str) -> Error {
        let _ = self.events();
        if self.gone {
            Error::Disconnected { op, addr: self.peer }
        } else {
            e
        }
    }

    /// Waits up to `t` (without a completion) for the next completion; it succeeded.
    pub fn next(&mut self, op: &'static str, t: Duration) -> Result<Completion, Error> {
        loop {
            if let Some(c) = self.lane.poll()? {
                self.progressed();
                return if c.is_ok() { Ok(c) } else { Err(self.failed(&c, op)) };
            }
            self.idle(op, t)?;
        }
    }

    /// Waits up to `t` (without a completion) until `want` completions came, each successful,
    /// handing each to `f` with its region: the loop of prepared requests, whose completions
    /// re-arm them ([`Lane::poll_with`]: nothing is materialised, and the CQ is asked for no
    /// more than is still wanted).
    #[inline(always)]
    pub fn reap(
        &mut self,
        want: usize,
        op: &'static str,
        t: Duration,
        mut f: impl FnMut(Wc, MemoryRegion) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut got = 0;
        while got < want {
            got += self.poll_once(want - got, op, t, &mut f)?;
        }
        Ok(())
    }

    /// One poll of [`LaneConn::reap`] (up to `max` completions), for a loop that has more to do
    /// between polls (a stream posts): hands each successful completion to `f` with its
    /// region, and returns how many completions came. Errors with the first failed
    /// completion's error, else the first error of `f`, once the poll has handed out all it
    /// got; waits ([`LaneConn::idle`]) when nothing came, and otherwise starts the wait afresh.
    #[inline(always)]
    pub fn reap_once(
        &mut self,
        max: usize,
        op: &'static str,
        t: Duration,
        mut f: impl FnMut(Wc, MemoryRegion) -> Result<(), Error>,
    ) -> Result<usize, Error> {
        self.poll_once(max, op, t, &mut f)
    }

    /// [`LaneConn::reap_once`] with `f` borrowed: `reap` lends it to each poll. It is called
    /// as `F` itself, not through the `&mut F` closure impl, which the compiler left out of
    /// line (callgrind: 54 more instructions per echo, two calls).
    #[inline(always)]
    fn poll_once<F: FnMut(Wc, MemoryRegion) -> Result<(), Error>>(
        &mut self,
        max: usize,
        op: &'static str,
        t: Duration,
        f: &mut F,
    ) -> Result<usize, Error> {
        // What ends the wait: the first failed completion, else the first error of `f`. Kept
        // out of the poll's way (a completion that succeeds, and that `f` takes, touches it
        // not at all), so the completion stays in registers.
        let mut fault = None;
        let n = self.lane.poll_with(max, |c, region| {
            if !c.is_ok() {
                note_failed(&mut fault, c.error());
            } else if let Some(r) = region {
                if let Err(e) = f(c, r) {
                    note_refused(&mut fault, e);
                }
            }
        })?;
        if n == 0 {
            self.idle(op, t)?;
            return Ok(0);
        }
        self.progressed();
        match fault {
            Some(fault) => Err(self.fault(fault, op)),
            None => Ok(n),
        }
    }

    /// The error a [`LaneConn::reap_once`] ends with.
    #[cold]
    fn fault(&mut self, fault: Fault, op: &'static str) -> Error {
        match fault {
            Fault::Failed(e) => self.failed_as(e, op),
            Fault::Refused(e) => e,
        }
    }

    /// Waits until region `i` of `regs` is back from the lane (putting back every region whose
    /// completion comes first), and returns what its completion said.
    pub fn wait(&mut self, regs: &mut Regions, i: usize, op: &'static str, t: Duration) -> Result<Done, Error> {
        while !regs.is_back(i) {
            let (c, region) = self.next(op, t)?.into_parts();
            regs.put_back(&c, region);
        }
        Ok(regs.done[i])
    }

    /// Whether the peer disconnected.
    pub fn is_disconnected(&self) -> bool {
        self.gone
    }

    /// Disconnects: the lane flushes and destroys the QP (handing back nothing still posted)
    /// and dropping the connection sends the CM's disconnect; then waits up to `t` for the
    /// id's `DISCONNECTED`, unless the peer left first.
    pub fn disconnect(mut self, t: Duration) -> Result<(), Error> {
        self.lane.remove(self.qp)?;
        self.wait_disconnected(t)
    }

    /// Waits up to `t` for the connection's `DISCONNECTED` (the peer's, or the answer to ours).
    pub fn wait_disconnected(&mut self, t: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + t;
        while !self.gone {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.id.channel().get_event_for(self.id.handle(), left)?;
            // After `disconnect` the QP has left the lane, which then refuses the event: the
            // connection answered the peer already, on its drop.
            let _ = self.lane.handle_event(self.qp, &ev);
            if matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval) {
                self.gone = true;
            }
        }
        Ok(())
    }
}

/// What a completion said about its work request: the bytes received (or read) and the
/// immediate data of a receive.
#[derive(Debug, Default, Clone, Copy)]
pub struct Done {
    pub byte_len: u32,
    pub imm: Option<u32>,
}

/// Regions that take turns in a lane, by number: region `i` is posted with `wr_id(i)` and
/// comes back, with its completion, to place `i`.
pub struct Regions {
    mrs: Vec<Option<MemoryRegion>>,
    done: Vec<Done>,
}

impl Regions {
    pub fn new(mrs: Vec<MemoryRegion>) -> Regions {
        let done = vec![Done::default(); mrs.len()];
        Regions { mrs: mrs.into_iter().map(Some).collect(), done }
    }

    /// Whether region `i` is in hand (not posted).
    pub fn is_back(&self, i: usize) -> bool {
        matches!(self.mrs.get(i), Some(Some(_)))
    }

    /// Takes region `i` out, to post it.
    pub fn take(&mut self, i: usize) -> Result<MemoryRegion, Error> {
        self.mrs.get_mut(i).and_then(Option::take).ok_or_else(|| still_posted(i))
    }

    /// Region `i`, to read or fill it.
    pub fn get(&mut self, i: usize) -> Result<&mut MemoryRegion, Error> {
        self.mrs.get_mut(i).and_then(Option::as_mut).ok_or_else(|| still_posted(i))
    }

    /// Puts region `i` back by hand (one taken out with [`Regions::take`]).
    pub fn put(&mut self, i: usize, region: MemoryRegion) {
        if let Some(place) = self.mrs.get_mut(i) {
            *place = Some(region);
        }
    }

    /// Puts back the region of completion `c`, at its `wr_id`.
    pub fn put_back(&mut self, c: &Wc, region: Option<MemoryRegion>) {
        let i = c.wr_id() as usize;
        let done = Done { byte_len: c.byte_len(), imm: c.imm_data() };
        if let (Some(place), Some(d)) = (self.mrs.get_mut(i), self.done.get_mut(i)) {
            *place = region;
            *d = done;
        }
    }
}

fn still_posted(i: usize) -> Error {
    Error::InvalidArgument(format!("region {i} is still posted (its completion has not come back)"))
}
