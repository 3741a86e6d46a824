//! A disconnect held back while the id's own port is down.
//!
//! `rdma_disconnect` makes the kernel's CM send a message (a DREQ, or the DREP answering the
//! peer's) on the port's QP1. Sent while the port is down, that send fails, and on the Linux
//! kernels this crate is tested on (Debian's 6.1 and 6.12, Soft-RoCE) the failure leaves the
//! host's CM deaf: the MAD layer puts QP1 back to work for sending but never reposts its
//! flushed receives, so every later connection to or from the host times out until the device
//! is re-created (`rdma link delete/add`). RELIABILITY.md and `tests/twohost_recovery.rs`
//! measured it: any teardown whose CM message goes out while the link is down does it (rping's
//! too), and a teardown held until the port is `ACTIVE` again kept the host able to connect.
//!
//! So every `rdma_disconnect` this crate makes (a [`Connection`](crate::Connection)'s drop,
//! [`Connection::disconnect`](crate::Connection::disconnect),
//! [`Connection::shutdown`](crate::Connection::shutdown),
//! [`Connection::start_disconnect`](crate::Connection::start_disconnect), and the QPs that own
//! their id) first asks the port (`ibv_query_port`, a few microseconds). When it is not
//! `ACTIVE`, the call waits for it to be, polling its state every 10 ms, for at most
//! [`disconnect_hold`] (10 s unless [`set_disconnect_hold`] says otherwise), and says so on
//! stderr, once when the hold starts and once when it ends. After the bound the disconnect goes
//! out anyway. `Connection::disconnect_async` (feature
//! `tokio`) holds on tokio's blocking pool instead, leaving the runtime's thread free. A
//! process that is killed cannot be helped: the kernel's cleanup sends the message at once.
//!
//! Not held: a connecting id destroyed before it is established (the kernel's CM then sends a
//! reject, REJ), and `rdma_reject` itself.
//!
//! iWARP ports are not held: their CM speaks TCP, not MADs on a QP1.

use std::fmt;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdma_sys as ffi;

/// How long a disconnect waits, by default, for its port to come back ([`set_disconnect_hold`]).
pub const DEFAULT_DISCONNECT_HOLD: Duration = Duration::from_secs(10);

/// The bound, in milliseconds.
static HOLD_MS: AtomicU64 = AtomicU64::new(DEFAULT_DISCONNECT_HOLD.as_millis() as u64);

/// How often a held disconnect asks the port again.
const POLL: Duration = Duration::from_millis(10);

/// Sets, for the whole process, how long a disconnect waits for its port to be `ACTIVE` again
/// when the port is down (see [the module](self)); `Duration::ZERO` never waits. Millisecond
/// precision.
pub fn set_disconnect_hold(hold: Duration) {
    HOLD_MS.store(u64::try_from(hold.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
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
    /// The port was still down when the bound passed.
    GaveUp(Duration),
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
    port_state(ctx, port).filter(|s| !is_up(*s)).map(|s| (ctx, s))
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
    // SAFETY: as above: the context and its device are valid for the id's life.
    let device = crate::verbs::device::device_name(unsafe { (*ctx.as_ptr()).device });
    let to = Peer(peer());
    say(format_args!(
        "rdma-cm: holding the disconnect{to}: port {port} of {device} is {}; waiting up to {:.1} s for it to be \
         ACTIVE (a CM message sent while the link is down can leave this host's CM deaf until the device is \
         re-created)",
        state_name(state),
        bound.as_secs_f64()
    ));
    let start = Instant::now();
    loop {
        std::thread::sleep(POLL);
        let waited = start.elapsed();
        // A port that can no longer be asked (its device going away) is waited for no more.
        if port_state(ctx, port).is_none_or(is_up) {
            say(format_args!(
                "rdma-cm: port {port} of {device} is back after {:.1} s: disconnecting{to}",
                waited.as_secs_f64()
            ));
            return Hold::CameBack(waited);
        }
        if waited >= bound {
            say(format_args!(
                "rdma-cm: port {port} of {device} still down after {:.1} s: disconnecting{to} anyway",
                waited.as_secs_f64()
            ));
            return Hold::GaveUp(waited);
        }
    }
}

/// " from ADDR", or nothing.
struct Peer(Option<SocketAddr>);

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => write!(f, " from {a}"),
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
        assert_eq!(Peer(Some("10.0.0.1:7471".parse().unwrap())).to_string(), " from 10.0.0.1:7471");
        assert_eq!(Peer(None).to_string(), "");
    }
}
