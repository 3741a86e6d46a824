//! Waiting for the event a step expects, and turning any other into an error that says what
//! arrived and the usual cause; the small helpers the client, server and connection share.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cm::cm_id::CmId;
use crate::cm::event_channel::{CmEvent, CmEventType};
use crate::error::{Error, Result};
use crate::verbs::device::VerbsContext;

/// Whether `ev`, an event of an established connection's id, says the peer is gone:
/// `DISCONNECTED`, `DEVICE_REMOVAL`, or `REJECTED`.
pub(crate) fn is_peer_gone(ev: &CmEvent) -> bool {
    // REJECTED on an established connection: the peer's side was destroyed (its process
    // killed, say) before its CM had our RTU, so its kernel answered with a REJ instead of a
    // DREQ; the kernel has moved our QP to the error state. Ignored, the connection would look
    // alive until a send failed, which on rxe can take longer than any bound.
    matches!(ev.event_type(), CmEventType::Disconnected | CmEventType::DeviceRemoval | CmEventType::Rejected)
}

/// Waits on `id`'s channel for `expected`; any other event becomes a clear error.
pub(crate) fn expect(id: &CmId, expected: CmEventType, op: &'static str, timeout: Duration) -> Result<CmEvent> {
    expect_watching(id, expected, op, timeout, None)
}

/// [`expect`]'s async twin: awaits the event on tokio's reactor (unbounded; wrap it in
/// `tokio::time::timeout`).
#[cfg(feature = "tokio")]
pub(crate) async fn expect_async(id: &CmId, expected: CmEventType, op: &'static str) -> Result<CmEvent> {
    let ev = id.channel().get_event_for_async(id.handle()).await?;
    check_event(id, &ev, expected, op)?;
    Ok(ev)
}

/// [`expect`], reading the device events of `ctx` meanwhile (see
/// `EventChannel::get_event_for_watching`).
pub(crate) fn expect_watching(
    id: &CmId,
    expected: CmEventType,
    op: &'static str,
    timeout: Duration,
    ctx: Option<&VerbsContext>,
) -> Result<CmEvent> {
    let peer = id.peer_addr();
    let got = match ctx {
        Some(ctx) => id.channel().get_event_for_watching(id.handle(), timeout, ctx),
        None => id.channel().get_event_for(id.handle(), timeout),
    };
    let ev = got.map_err(|e| match e {
        Error::Timeout { timeout, .. } => Error::Timeout { op, timeout, addr: peer, hint: expected_hint(expected) },
        e => e,
    })?;
    check_event(id, &ev, expected, op)?;
    Ok(ev)
}

/// Accepts `ev` if it is `expected` for `id`; turns anything else into a clear error.
pub(crate) fn check_event(id: &CmId, ev: &CmEvent, expected: CmEventType, op: &'static str) -> Result<()> {
    let peer = id.peer_addr();
    if ev.event_type() == expected && ev.id() == id.handle() {
        return Ok(());
    }
    // Resolution errors carry a negative errno: report them as the call that failed.
    if matches!(ev.event_type(), CmEventType::AddrError | CmEventType::RouteError) && ev.status() < 0 {
        let call = if ev.event_type() == CmEventType::AddrError { "rdma_resolve_addr" } else { "rdma_resolve_route" };
        return Err(Error::call(call, -ev.status(), peer));
    }
    let mut e = ev.unexpected(op, expected);
    if let Error::UnexpectedEvent { hint, got: CmEventType::Rejected, status, .. } = &mut e {
        *hint = Some(reject_hint(*status));
    }
    Err(match peer {
        Some(p) => e.with_addr(p),
        None => e,
    })
}

fn expected_hint(expected: CmEventType) -> Option<&'static str> {
    Some(match expected {
        CmEventType::AddrResolved => {
            "no answer from the RDMA address resolution: check `ip link`, `rdma link` and the GID table"
        }
        CmEventType::ConnectRequest => "no client connected in time",
        CmEventType::Established | CmEventType::ConnectResponse => {
            "the peer did not complete the handshake: is it running and reachable over RDMA (UDP 4791 for RoCEv2)?"
        }
        CmEventType::Disconnected => "the peer did not confirm the disconnect",
        _ => return None,
    })
}

/// IB CM reject reasons that matter (IBTA table 112); the iWARP CM reports a negated errno.
fn reject_hint(status: i32) -> &'static str {
    match status {
        8 => "nobody listens on that address and port (invalid service ID): is the server running, and is the port right?",
        28 => "the server refused the connection (consumer reject); its private data may say why",
        s if s == -libc::ECONNRESET || s == -libc::ECONNREFUSED => {
            "the server refused the connection (iWARP: an MPA reject, or the connection was closed during the handshake); its private data may say why"
        }
        _ => "the peer rejected the connection: is the server running on that port?",
    }
}

pub(crate) fn with_opt_addr(e: Error, a: Option<SocketAddr>) -> Error {
    match a {
        Some(a) => e.with_addr(a),
        None => e,
    }
}

pub(crate) fn context_of(id: &Arc<CmId>) -> Result<VerbsContext> {
    id.context().ok_or(Error::NoDevice { op: "rdma_cm_id.verbs", addr: id.peer_addr() })
}

pub(crate) fn expect_any_request(listener: &CmId, timeout: Duration) -> Result<CmEvent> {
    let ev = listener.channel().get_event_for(listener.handle(), timeout).map_err(|e| match e {
        Error::Timeout { timeout, .. } => Error::Timeout {
            op: "waiting for CONNECT_REQUEST",
            timeout,
            addr: listener.local_addr(),
            hint: expected_hint(CmEventType::ConnectRequest),
        },
        e => e,
    })?;
    if ev.event_type() == CmEventType::ConnectRequest {
        Ok(ev)
    } else {
        Err(ev.unexpected("waiting for CONNECT_REQUEST", CmEventType::ConnectRequest))
    }
}
