//! A disconnect held back while the id's own port is down.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::cm::hold::{disconnect_hold, set_disconnect_hold};
//!
//! // Hold disconnects at most 2 s per link-down, then send them anyway.
//! set_disconnect_hold(Duration::from_secs(2));
//! assert_eq!(disconnect_hold(), Duration::from_secs(2));
//! ```
//!
//! `rdma_disconnect` makes the kernel's CM send a message (a DREQ) on the port's QP1. Sent while
//! the port is down, that send fails, and on the Linux kernels this crate is tested on (Debian's
//! 6.1 and 6.12, Soft-RoCE) the failure leaves the host's CM deaf: the MAD layer puts QP1 back
//! to work for sending but never reposts its flushed receives, so every later connection to or
//! from the host times out until the device is re-created (`rdma link delete/add`).
//! RELIABILITY.md and `tests/twohost_recovery.rs` measured it: any teardown whose CM message
//! goes out while the link is down does it (rping's too), and a teardown held until the port is
//! `ACTIVE` again kept the host able to connect.
//!
//! So every disconnect this side starts (a [`Connection`](crate::Connection)'s drop,
//! [`Connection::disconnect`](crate::Connection::disconnect),
//! [`Connection::shutdown`](crate::Connection::shutdown),
//! [`Connection::start_disconnect`](crate::Connection::start_disconnect)) first asks the port
//! (`ibv_query_port`, a few microseconds). When it is not `ACTIVE`, the call waits for it to be,
//! polling its state every 10 ms, and says so on stderr, once when the hold starts and once when
//! it ends. The wait is bounded per link-down: the first hold on a port that is down sets a
//! deadline [`disconnect_hold`] away (10 s unless [`set_disconnect_hold`] says otherwise), later
//! ones on the same port wait only until that deadline, and once it has passed, disconnects go
//! out at once until the port has been seen `ACTIVE` again. So dropping a hundred connections
//! while the cable is out costs one bound, not a hundred. After the bound the disconnect goes
//! out anyway.
//!
//! These calls block their thread meanwhile (a drop too: mind a lock held around one).
//! `Connection::disconnect_async` (feature `tokio`) holds on tokio's blocking pool instead,
//! leaving the runtime's thread free, and a [`Connection::disconnect`](crate::Connection::disconnect)'s
//! `timeout` counts only the wait for the peer's answer, after the hold.
//!
//! Not held:
//! - the answer to the peer's disconnect (its DREQ just came in over the port): a data-path
//!   wait that meets it, or [`Connection::handle_event`](crate::Connection::handle_event),
//!   answers at once, so that neither blocks;
//! - a connecting id destroyed before it is established (the kernel's CM then sends a reject,
//!   REJ), a [`Connecting`](crate::Connecting) dropped after librdmacm completed the handshake,
//!   and `rdma_reject`;
//! - a process that is killed, or exits with connections alive: the kernel's cleanup sends the
//!   message at once.
//!
//! iWARP ports are not held: their CM speaks TCP, not MADs on a QP1.

use std::fmt;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

/// How long a disconnect waits, by default, for its port to come back ([`set_disconnect_hold`]).
pub const DEFAULT_DISCONNECT_HOLD: Duration = Duration::from_secs(10);

/// The bound, in milliseconds.
static HOLD_MS: AtomicU64 = AtomicU64::new(DEFAULT_DISCONNECT_HOLD.as_millis() as u64);

/// How often a held disconnect asks the port again.
const POLL: Duration = Duration::from_millis(10);

/// Sets, for the whole process, how long disconnects wait for their port to be `ACTIVE` again
/// once it is down (see [the module](self)); `Duration::ZERO` never waits. Millisecond
/// precision, rounded up.
pub fn set_disconnect_hold(hold: Duration) {
    let ms = hold.as_nanos().div_ceil(1_000_000);
    HOLD_MS.store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// How long a disconnect waits for its port to be `ACTIVE` again ([`set_disconnect_hold`]).
pub fn disconnect_hold() -> Duration {
    Duration::from_millis(HOLD_MS.load(Ordering::Relaxed))
}

/// What a disconnect found its port doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The port was up (or not one to hold for, or could not be asked): no wait.
    NotNeeded,
    /// The port was down and came back after this long.
    CameBack(Duration),
    /// The port was still down when the bound passed (or had passed, for an earlier hold on
    /// the same port).
    GaveUp(Duration),
    /// The port could no longer be asked (its device going away).
    Gone(Duration),
}

/// A port that holds have seen down: until when disconnects there wait. Removed when a hold or
/// a disconnect sees it `ACTIVE` again.
struct Episode {
    ctx: usize,
    port: u8,
    deadline: Instant,
}

static EPISODES: Mutex<Vec<Episode>> = Mutex::new(Vec::new());

/// The deadline of the link-down of port `port` of `ctx`: the one an earlier hold set, or now
/// plus `bound`. Whether it is new.
fn episode(ctx: usize, port: u8, bound: Duration) -> (Instant, bool) {
    let mut e = EPISODES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(ep) = e.iter().find(|ep| ep.ctx == ctx && ep.port == port) {
        return (ep.deadline, false);
    }
    let deadline = Instant::now().checked_add(bound).unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 32));
    e.push(Episode { ctx, port, deadline });
    (deadline, true)
}

/// Port `port` of `ctx` was seen up: its link-down is over.
fn port_back(ctx: usize, port: u8) {
    let mut e = EPISODES.lock().unwrap_or_else(|p| p.into_inner());
    e.retain(|ep| ep.ctx != ctx || ep.port != port);
}

/// Port `port`'s state, or `None` when it cannot be asked.
fn port_state(ctx: NonNull<ffi::ibv_context>, port: u8) -> Option<u32> {
    // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
    let mut a: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is the context of a live id (librdmacm keeps it open while the id is
    // bound to it), and `a` is a valid out-pointer of the size ___ibv_query_port passes on. A
    // port the device lacks is refused with an error, not read.
    let ret = unsafe { ffi::___ibv_query_port(ctx.as_ptr(), port, &mut a) };
    (ret == 0).then_some(a.state)
}

fn is_up(state: u32) -> bool {
    use ffi::ibv_port_state as s;
    state == s::IBV_PORT_ACTIVE || state == s::IBV_PORT_ACTIVE_DEFER
}

fn state_name(state: u32) -> &'static str {
    use ffi::ibv_port_state as s;
    match state {
        s::IBV_PORT_DOWN => "DOWN",
        s::IBV_PORT_INIT => "INIT",
        s::IBV_PORT_ARMED => "ARMED",
        _ => "not ACTIVE",
    }
}

/// The state of port `port` of `ctx` when a disconnect there should be held: the port is not
/// `ACTIVE` (and is one to hold for: not iWARP's). `None` when it is up, or cannot be asked.
fn down_state(ctx: Option<NonNull<ffi::ibv_context>>, port: u8) -> Option<(NonNull<ffi::ibv_context>, u32)> {
    let ctx = ctx?;
    // SAFETY: the context is open (see `port_state`); its device is set for the context's
    // life, and transport_type is plain data.
    let transport = unsafe { (*(*ctx.as_ptr()).device).transport_type };
    if port == 0 || transport == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP {
        return None;
    }
    match port_state(ctx, port) {
        Some(s) if !is_up(s) => Some((ctx, s)),
        Some(_) => {
            port_back(ctx.as_ptr() as usize, port);
            None
        }
        None => None,
    }
}

/// Whether a disconnect on port `port` of `ctx` would be held now (one `ibv_query_port`).
#[cfg(feature = "tokio")]
pub(crate) fn is_down(ctx: Option<NonNull<ffi::ibv_context>>, port: u8) -> bool {
    down_state(ctx, port).is_some()
}

/// Waits, bounded by [`disconnect_hold`], while port `port` of `ctx` is not `ACTIVE`: what an
/// id's `rdma_disconnect` does first. `peer` names the connection in the lines it prints (asked
/// only then).
pub(crate) fn while_port_down(
    ctx: Option<NonNull<ffi::ibv_context>>,
    port: u8,
    peer: impl FnOnce() -> Option<SocketAddr>,
) -> Hold {
    let Some((ctx, state)) = down_state(ctx, port) else { return Hold::NotNeeded };
    let bound = disconnect_hold();
    if bound.is_zero() {
        return Hold::GaveUp(Duration::ZERO);
    }
    let (deadline, first) = episode(ctx.as_ptr() as usize, port, bound);
    // SAFETY: as in `down_state`: the context and its device are valid for the id's life.
    let device = crate::verbs::device::device_name(unsafe { (*ctx.as_ptr()).device });
    let to = Peer(peer());
    let start = Instant::now();
    if start >= deadline {
        say(format_args!(
            "rdma-cm: port {port} of {device} is still {} past its hold: disconnecting{} now{DEAF}",
            state_name(state),
            to.from()
        ));
        return Hold::GaveUp(Duration::ZERO);
    }
    let left = deadline - start;
    say(format_args!(
        "rdma-cm: holding the disconnect{}: port {port} of {device} is {}; waiting up to {:.1} s{} for it to \
         be ACTIVE (a CM message sent while the link is down can leave this host's CM deaf until the device is \
         re-created)",
        to.of(),
        state_name(state),
        left.as_secs_f64(),
        if first { "" } else { " more (the port's hold started earlier)" }
    ));
    loop {
        std::thread::sleep(POLL);
        let waited = start.elapsed();
        match port_state(ctx, port) {
            None => {
                say(format_args!(
                    "rdma-cm: port {port} of {device} can no longer be queried (device removed?): disconnecting{} now",
                    to.from()
                ));
                return Hold::Gone(waited);
            }
            Some(s) if is_up(s) => {
                port_back(ctx.as_ptr() as usize, port);
                say(format_args!(
                    "rdma-cm: port {port} of {device} is back after {:.1} s: disconnecting{}",
                    waited.as_secs_f64(),
                    to.from()
                ));
                return Hold::CameBack(waited);
            }
            Some(_) if Instant::now() >= deadline => {
                say(format_args!(
                    "rdma-cm: port {port} of {device} still down after {:.1} s: disconnecting{} anyway{DEAF}",
                    waited.as_secs_f64(),
                    to.from()
                ));
                return Hold::GaveUp(waited);
            }
            Some(_) => {}
        }
    }
}

/// What a disconnect sent while the port is down may cost, and the fix.
const DEAF: &str = " (if new connections from or to this host then time out, its CM is deaf: \
                    `rdma link delete DEV && rdma link add DEV type rxe netdev NETDEV` on Soft-RoCE, \
                    or reload the driver)";

/// The connection in the lines: " of the connection with ADDR" (`of`) or " from ADDR", or
/// nothing.
struct Peer(Option<SocketAddr>);

impl Peer {
    fn of(&self) -> Named<'_> {
        Named(self, " of the connection with ")
    }
    fn from(&self) -> Named<'_> {
        Named(self, " from ")
    }
}

struct Named<'a>(&'a Peer, &'static str);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 .0 {
            Some(a) => write!(f, "{}{a}", self.1),
            None => Ok(()),
        }
    }
}

/// One line on stderr; never panics (this runs in drop, where `eprintln!` to a closed pipe
/// would).
fn say(line: fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_context_no_hold() {
        assert_eq!(while_port_down(None, 1, || None), Hold::NotNeeded);
    }

    #[test]
    fn the_bound_is_set_for_the_process() {
        assert_eq!(disconnect_hold(), DEFAULT_DISCONNECT_HOLD);
        set_disconnect_hold(Duration::from_millis(1500));
        assert_eq!(disconnect_hold(), Duration::from_millis(1500));
        set_disconnect_hold(Duration::MAX);
        assert_eq!(disconnect_hold(), Duration::from_millis(u64::MAX));
        set_disconnect_hold(DEFAULT_DISCONNECT_HOLD);
    }

    #[test]
    fn port_states() {
        use ffi::ibv_port_state as s;
        assert!(is_up(s::IBV_PORT_ACTIVE) && is_up(s::IBV_PORT_ACTIVE_DEFER));
        assert!(!is_up(s::IBV_PORT_DOWN) && !is_up(s::IBV_PORT_INIT) && !is_up(s::IBV_PORT_ARMED));
        assert_eq!(state_name(s::IBV_PORT_DOWN), "DOWN");
        let p = Peer(Some("10.0.0.1:7471".parse().unwrap()));
        assert_eq!(p.of().to_string(), " of the connection with 10.0.0.1:7471");
        assert_eq!(p.from().to_string(), " from 10.0.0.1:7471");
        assert_eq!(Peer(None).of().to_string(), "");
    }

    /// One bound per link-down of a port: later holds on it wait for the first one's deadline;
    /// the port seen up again ends it; other ports have their own.
    #[test]
    fn a_ports_link_down_has_one_deadline() {
        let (ctx, other) = (0x1000_usize, 0x2000_usize);
        let (d1, new1) = episode(ctx, 1, Duration::from_secs(10));
        let (d2, new2) = episode(ctx, 1, Duration::from_secs(99));
        assert!(new1 && !new2 && d1 == d2, "a second hold on the same port set a deadline of its own");
        let (d3, new3) = episode(other, 1, Duration::from_secs(10));
        assert!(new3 && d3 >= d1, "another context's port shares the deadline");
        let (_, new4) = episode(ctx, 2, Duration::from_secs(10));
        assert!(new4, "another port of the context shares the deadline");
        port_back(ctx, 1);
        let (d5, new5) = episode(ctx, 1, Duration::from_secs(10));
        assert!(new5 && d5 > d1, "the port came back, yet its old deadline stayed");
        for (c, p) in [(ctx, 1), (ctx, 2), (other, 1)] {
            port_back(c, p);
        }
    }
}
