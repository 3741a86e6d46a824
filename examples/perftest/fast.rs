//! The perf tool's data path: a connection on a [`Lane`], the crate's data path
//! (`rdma_cm::verbs::lane`). What the tool shows of it:
//!
//! - the QP joins the lane before the connect or accept (`RouteResolved::lane_qp`,
//!   `ConnectRequest::lane_qp`), so the receives the peer's first messages need are posted
//!   before it can send;
//! - a work request *moves* its [`MemoryRegion`] into the lane, and the completion that retires
//!   it hands it back: [`Regions`] numbers the regions, each work request carries its region's
//!   number as `wr_id`, so every completion knows where its region goes back;
//! - the tool waits with the lane's own waits: by default [`Lane::wait_with`], which sleeps on
//!   the CQ's completion channel, and with `--busy-poll` [`Lane::spin_with`], which polls
//!   without sleeping; both hand over every completion the CQ holds once one came (up to what
//!   is still wanted). Between two slices of a wait ([`PEER_CHECK`]) it asks
//!   [`Lane::peer_left`] whether the peer has gone.
//!
//! Every wait of `perf_client` and `perf_server` on a lane goes through [`LaneConn::reap`],
//! [`LaneConn::reap_once`] or [`LaneConn::wait`], and all of them through one call of the
//! lane's wait, in [`LaneConn::reap_once`].

#![allow(dead_code)] // each side uses part of this module

use std::net::SocketAddr;
use std::time::Duration;

use rdma_cm::verbs::lane::{InlineWr, Lane, LaneQp, Wc};
use rdma_cm::{Error, MemoryRegion};

/// The longest the lane's wait runs before the tool asks [`Lane::peer_left`] (a read of the
/// CM's channel, a system call) whether the peer has gone: a peer that leaves while this side
/// waits for a receive is noticed within this long. A completion ends the wait at once.
pub const PEER_CHECK: Duration = Duration::from_millis(100);

/// The largest message send mode's ping-pong sends inline (the QP is created for it), as
/// `ib_send_lat` does by default on RC: the provider copies it at the post, so the send holds
/// no region and can go unsignaled.
pub const INLINE_LAT: u32 = 236;

/// Send mode's inline ping-pong signals one send in this many, as perftest's latency tests
/// signal one in `cq_mod`: a round trip then sleeps (or spins) for the echo alone, not for its
/// own send's completion too. Half the send queue (16), so a signaled completion is reaped
/// long before the queue could fill.
pub const SIGNAL_EVERY: u64 = 8;

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
    pub lane: Lane,
    pub qp: LaneQp,
    peer: Option<SocketAddr>,
    busy_poll: bool,
    /// The peer's `DISCONNECTED` (or a device removal) was seen by [`LaneConn::wait_disconnected`].
    gone: bool,
    /// Inline sends posted ([`LaneConn::send_inline`]): which of them is signaled.
    inline_sent: u64,
}

impl LaneConn {
    /// `lane`'s connection `qp` to `peer` (made with `lane_qp`, connected or accepted).
    /// `busy_poll`: wait with [`Lane::spin_with`]; otherwise with [`Lane::wait_with`].
    pub fn new(lane: Lane, qp: LaneQp, peer: Option<SocketAddr>, busy_poll: bool) -> LaneConn {
        LaneConn { lane, qp, peer, busy_poll, gone: false, inline_sent: 0 }
    }

    /// Whether a message of `len` bytes goes inline on this QP ([`LaneConn::send_inline`]).
    pub fn fits_inline(&mut self, len: usize) -> Result<bool, Error> {
        Ok(len <= self.lane.max_inline_data(self.qp)? as usize)
    }

    /// Sends `data` inline, signaled once in [`SIGNAL_EVERY`] sends (the lane signals the one
    /// that takes the send queue's last slot anyway). Its completion, when it has one, carries
    /// no region: [`LaneConn::reap`]'s callback never sees it.
    #[inline(always)]
    pub fn send_inline(&mut self, data: &[u8], wr_id: u64) -> Result<(), Error> {
        self.inline_sent = self.inline_sent.wrapping_add(1);
        let wr = InlineWr::send(data).wr_id(wr_id);
        let wr = if self.inline_sent % SIGNAL_EVERY == 0 { wr } else { wr.unsignaled() };
        self.lane.post_inline(self.qp, wr)
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
        if self.gone || self.lane.peer_left(self.qp).unwrap_or(false) {
            Error::Disconnected { op, addr: self.peer }
        } else {
            e
        }
    }

    /// Waits up to `t` (without a completion) until `want` completions came, each successful,
    /// handing each to `f` with its region: the loop of prepared requests, whose completions
    /// re-arm them ([`Lane::wait_with`], [`Lane::spin_with`]: nothing is materialised, and the
    /// CQ is asked for no more than is still wanted).
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

    /// One wait of [`LaneConn::reap`] (up to `max` completions), for a loop that has more to do
    /// between waits (a stream posts): waits up to `t` for a completion, hands each successful
    /// completion to `f` with its region, and returns how many completions came (at least
    /// one). Errors with the first failed completion's error, else the first error of `f`,
    /// once the wait has handed out all it got; with [`Error::Disconnected`] when the peer
    /// left, and [`Error::Timeout`] when nothing came in time.
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

    /// [`LaneConn::reap_once`] with `f` borrowed: `reap` lends it to each wait. It is called
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
        let mut each = |c: Wc, region: Option<MemoryRegion>| {
            if !c.is_ok() {
                note_failed(&mut fault, c.error());
            } else if let Some(r) = region {
                if let Err(e) = f(c, r) {
                    note_refused(&mut fault, e);
                }
            }
        };
        // The wait runs in slices of PEER_CHECK, so that a peer that left is noticed; counted,
        // not timed (a look at the clock is a system call in the project's guest).
        let mut waited = Duration::ZERO;
        let n = loop {
            let slice = PEER_CHECK.min(t.saturating_sub(waited));
            let got = if self.busy_poll {
                self.lane.spin_with(max, slice, &mut each)
            } else {
                self.lane.wait_with(max, slice, &mut each)
            };
            match got {
                Ok(n) => break n,
                Err(Error::Timeout { .. }) => {
                    waited += slice;
                    self.still_there(op, t, waited)?;
                }
                Err(e) => return Err(self.failed_as(e, op)),
            }
        };
        match fault {
            Some(fault) => Err(self.fault(fault, op)),
            None => Ok(n),
        }
    }

    /// After a slice of a wait that found nothing: errors when the peer left, or when the
    /// wait has lasted `t` (`waited`).
    #[cold]
    #[inline(never)]
    fn still_there(&mut self, op: &'static str, t: Duration, waited: Duration) -> Result<(), Error> {
        if self.lane.peer_left(self.qp)? {
            return Err(Error::Disconnected { op, addr: self.peer });
        }
        if waited >= t {
            let hint = Some("the peer stopped answering: is it alive, and is its side still running?");
            return Err(Error::Timeout { op, timeout: t, addr: self.peer, hint });
        }
        Ok(())
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
            self.reap_once(4, op, t, |c, region| {
                regs.put_back(&c, Some(region));
                Ok(())
            })?;
        }
        Ok(regs.done[i])
    }

    /// Disconnects ([`Lane::disconnect`]): the lane flushes and destroys the QP (handing back
    /// nothing still posted), sends the CM's disconnect unless the peer left first, and waits
    /// up to `t` for its answer.
    pub fn disconnect(mut self, t: Duration) -> Result<(), Error> {
        self.lane.disconnect(self.qp, t)
    }

    /// Waits up to `t` for the peer to disconnect ([`Lane::wait_peer_left`]).
    pub fn wait_disconnected(&mut self, t: Duration) -> Result<(), Error> {
        self.gone = self.gone || self.lane.wait_peer_left(self.qp, t)?;
        if self.gone {
            return Ok(());
        }
        let hint = Some("the peer did not disconnect: is it still running?");
        Err(Error::Timeout { op: "waiting for the peer to disconnect", timeout: t, addr: self.peer, hint })
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
