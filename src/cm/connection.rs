//! The connection typestates and the established [`Connection`].
//!
//! Each step consumes the previous state and returns the next, so a call out of order does
//! not compile:
//!
//! ```text
//! client: Client ─resolve_addr→ AddrResolved ─resolve_route→ RouteResolved ─create_qp→ ClientQp ─connect→ Connection
//! server: Server ─bind→ Bound ─listen→ Listener ─get_request→ ConnectRequest ─create_qp→ ServerQp ─accept→ Connection
//!                                                                      └─reject                └─reject
//! a verbs QP adopted: RouteResolved / ConnectRequest ─adopt_qp(UnconnectedQp)→ ClientQp / ServerQp (see crate::cm::adopt)
//! closing:            Connection ─shutdown→ Disconnecting (see crate::cm::closing)
//! ```
//!
//! ```compile_fail
//! # fn f() -> rdma_cm::Result<()> {
//! use std::time::Duration;
//! // A client cannot connect before resolving the address and route and creating a QP.
//! let conn = rdma_cm::Client::new()?.connect(&rdma_cm::ConnParam::new(), Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f() -> rdma_cm::Result<()> {
//! // A server cannot listen before binding.
//! let l = rdma_cm::Server::new()?.listen(8)?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f(req: rdma_cm::ConnectRequest) -> rdma_cm::Result<()> {
//! use std::time::Duration;
//! // A request cannot be accepted before its QP exists.
//! let c = req.accept(&rdma_cm::ConnParam::new(), Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail
//! # fn f(l: rdma_cm::AddrResolved, pd: std::sync::Arc<rdma_cm::ProtectionDomain>) -> rdma_cm::Result<()> {
//! // A QP cannot be created before the route is resolved.
//! let q = l.create_qp(&pd, rdma_cm::QpInit::new())?;
//! # Ok(()) }
//! ```
//!
//! Before the connection exists, a QP takes receives only: its lane refuses a send, RDMA WRITE
//! or READ posted before `ESTABLISHED` ([`Error::InvalidArgument`],
//! with the region given back), where rxe would keep such a post and run it after the
//! connection is up.
//!
//! Every blocking step takes a timeout ([`FOREVER`](crate::FOREVER) waits without one). The
//! blocking steps read only their own id's events ([`EventChannel::get_event_for`](crate::EventChannel::get_event_for)), so ids may
//! share a channel: [`Client::new`](crate::Client::new) and [`Server::new`](crate::Server::new) create a channel per id, while
//! [`Client::on_channel`](crate::Client::on_channel) and [`Server::on_channel`](crate::Server::on_channel) put many ids on one, and
//! [`Listener::get_request`](crate::Listener::get_request) moves each new id onto a channel of its own. An event loop that
//! serves many connections on one channel uses [`EventChannel::get_event`](crate::EventChannel::get_event),
//! [`ConnectRequest::from_event`](crate::ConnectRequest::from_event), [`ServerQp::start_accept`](crate::ServerQp::start_accept) and [`Accepting::complete`](crate::Accepting::complete).
//!
//! # Closing
//!
//! Closing a connection with its teardown overlapped with the disconnect handshake:
//! [`Connection::shutdown`] and the [`Disconnecting`] state.
//!
//! ```text
//! Connection ─shutdown→ Disconnecting ─complete(&DISCONNECTED) / wait→ done   (drop: rdma_destroy_id)
//!             rdma_disconnect, then the QP (and CQs only it used) destroyed at once
//! ```
//!
//! `rdma_disconnect` moves the QP to the error state and sends the disconnect request; the
//! peer's answer (the id's `DISCONNECTED`) takes a round trip. Nothing in that round trip needs
//! the QP any more, so [`Connection::shutdown`] destroys it right away, as rdma-core's `cmtime`
//! does (`rdma_disconnect` then `rdma_destroy_qp`, then it waits for `DISCONNECTED`): the
//! flush of outstanding work is reaped first, so every region a work request held is released
//! only once the device is done with it (the same bounded drain as dropping the QP; see
//! [`crate::verbs::qp`]). What is left, the id, waits for `DISCONNECTED` in [`Disconnecting`].
//! [`Connection::disconnect`] is `shutdown` followed by [`Disconnecting::wait`].
//!
//! Every disconnect (these, [`Connection::start_disconnect`] and a connection's drop) first
//! waits, bounded, while the id's own port is down ([`crate::cm::hold`]): a CM message sent while
//! the link is down leaves the host's CM deaf on the kernels tested, and a disconnect held until
//! the port is `ACTIVE` again does not.
//!
//! The QP is gone from the type too:
//!
//! ```compile_fail
//! # fn f(c: rdma_cm::Connection) -> rdma_cm::Result<()> {
//! let d = c.shutdown()?;
//! let n = d.qp().qp_num();
//! # Ok(()) }
//! ```
//!
//! # Async twins (feature `tokio`)
//!
//! Each blocking step has an `_async` twin, beside it in the same module, that starts the same
//! librdmacm call and then awaits the id's event channel through tokio instead of `poll(2)`. The
//! address and route steps are bounded by librdmacm's own timers (the `timeout` they take); the
//! handshake by the CM's retries. Wrap any of them in `tokio::time::timeout` for a tighter
//! bound: dropping one of these futures is safe at every point, since the ids and QPs they hold
//! are owned values that clean up in `Drop` as usual. The channel's descriptor is registered
//! with the reactor at its first async wait and stays so for the channel's life (see
//! `crate::wait::Reactor`); any number of tasks may await it.

use std::fmt;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cm::adopt;
use crate::cm::cm_id::{CmId, IdHandle};
use crate::cm::event_channel::{CmEvent, CmEventType, PrivateData};
use crate::cm::expect::{expect, is_peer_gone, with_opt_addr};
use crate::error::{Error, Result};
use crate::verbs::qp::QueuePair;

/// An established RC connection: the QP for the data path, and the id for its events.
///
/// Dropping it disconnects (unless the peer left first); while the id's port is down that
/// drop waits for the port first, bounded ([`crate::cm::hold`]).
pub struct Connection {
    // Dropped first (after Drop::drop disconnects): the QP holds its own Arc of the id.
    pub(crate) qp: QueuePair,
    pub(crate) id: Arc<CmId>,
    peer_private_data: PrivateData,
    /// We called rdma_disconnect.
    pub(crate) disconnected: bool,
    /// The QP was adopted (`adopt_qp`): a disconnect moves it to ERR itself.
    pub(crate) user_qp: bool,
}

impl Connection {
    pub(crate) fn new(id: Arc<CmId>, mut qp: QueuePair, peer_private_data: PrivateData, user_qp: bool) -> Connection {
        qp.set_connected();
        Connection { qp, id, peer_private_data, disconnected: false, user_qp }
    }

    /// `rdma_disconnect`, after moving an adopted QP to ERR (librdmacm does that only for its
    /// own QPs).
    /// Held first while the id's port is down (`crate::cm::hold`).
    pub(crate) fn send_disconnect(&self) -> Result<()> {
        if self.user_qp {
            adopt::to_error(&self.qp)?;
        }
        self.id.disconnect()
    }

    /// The QP.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The QP, for posting and polling.
    pub fn qp_mut(&mut self) -> &mut QueuePair {
        &mut self.qp
    }

    /// The id.
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }

    /// The private data the peer sent with its request (server side) or its accept (client
    /// side). Untrusted, and zero-padded by the CM.
    pub fn peer_private_data(&self) -> &PrivateData {
        &self.peer_private_data
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.id.local_addr()
    }

    /// Returns the connection's next CM event without waiting (e.g. `DISCONNECTED` when the
    /// peer left). Other ids' events on a shared channel stay there for their owners.
    ///
    /// # Errors
    /// [`Error::Call`] when reading the channel fails.
    pub fn try_event(&mut self) -> Result<Option<CmEvent>> {
        let ev = self.id.channel().try_get_event_for(self.id.handle())?;
        if let Some(ev) = &ev {
            self.handle_event(ev);
        }
        Ok(ev)
    }

    /// Waits up to `timeout` for the connection's next CM event, e.g. the peer's
    /// `DISCONNECTED`. Other ids' events on a shared channel stay there for their owners.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::Call`] when reading the channel fails.
    pub fn next_event(&mut self, timeout: Duration) -> Result<CmEvent> {
        let ev = self.id.channel().get_event_for(self.id.handle(), timeout)?;
        self.handle_event(&ev);
        Ok(ev)
    }

    /// Feeds an event of this connection's id, read from a shared channel by an event loop.
    /// A `DISCONNECTED` (the peer left) is answered here: `rdma_disconnect` sends the CM's
    /// reply the peer's disconnect waits for, and moves the QP to the error state, which
    /// flushes its posted work (see "Disconnects" in the crate docs). Events of other ids are
    /// ignored.
    pub fn handle_event(&mut self, ev: &CmEvent) {
        if ev.id() == self.id.handle() && is_peer_gone(ev) {
            self.qp.peer_gone();
        }
    }

    /// Whether the peer disconnected (a `DISCONNECTED` event was seen).
    pub fn is_disconnected(&self) -> bool {
        self.qp.peer_left()
    }

    /// Starts a disconnect without waiting for the peer (`rdma_disconnect`; the QP goes to the
    /// error state): the id's `DISCONNECTED` follows, for an event loop to read. Returns whether
    /// it was sent. While the id's port is down it first waits, bounded, for the port
    /// ([`crate::cm::hold`]).
    ///
    /// `Ok(false)` means there was nothing to send: either the peer left first (its
    /// `DISCONNECTED` was seen, [`Connection::is_disconnected`] is true, and the connection
    /// answered it then, so no `DISCONNECTED` is to come), or this side disconnected before
    /// (the `DISCONNECTED` that answers it is still to come unless seen already). The QP is
    /// in the error state either way.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_disconnect` fails.
    pub fn start_disconnect(&mut self) -> Result<bool> {
        if self.disconnected || self.qp.peer_left() {
            self.disconnected = true;
            return Ok(false);
        }
        self.send_disconnect()?;
        self.disconnected = true;
        self.qp.set_closing();
        Ok(true)
    }

    /// Disconnects and waits up to `timeout` for the `DISCONNECTED` event, reporting errors
    /// that Drop would only print. While the id's port is down the disconnect is held first
    /// ([`crate::cm::hold`]), which `timeout` does not count. The QP is destroyed before the wait, once its flushed work
    /// is reaped ([`Connection::shutdown`]), so its teardown overlaps the peer's answer.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_disconnect` fails; [`Error::Timeout`].
    pub fn disconnect(self, timeout: Duration) -> Result<()> {
        let id = Arc::clone(&self.id);
        // Registered before the disconnect, so no other reader of a shared channel takes the
        // DISCONNECTED meant for this wait.
        let _expecting = id.channel().expecting(id.handle());
        self.shutdown()?.wait(timeout)
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if !self.disconnected && !self.qp.peer_left() {
            // Best effort: the peer learns we left. Failure (already disconnected) is harmless.
            let _ = self.send_disconnect();
        }
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("qp", &self.qp)
            .finish()
    }
}

/// A connection whose QP is gone and whose disconnect is under way: the id waits for its
/// `DISCONNECTED` ([`Disconnecting::complete`] from an event loop, or [`Disconnecting::wait`]).
/// Dropping it destroys the id (`rdma_destroy_id`), whether or not the event came.
#[derive(Debug)]
pub struct Disconnecting {
    id: Arc<CmId>,
    /// The id's `DISCONNECTED` (or `DEVICE_REMOVAL`) is still to come.
    awaiting: bool,
}

impl Connection {
    /// Starts the disconnect (`rdma_disconnect`, unless the peer left or it was sent already)
    /// and destroys the QP at once, without waiting for the peer's answer: the QP's outstanding
    /// work is flushed and reaped (for at most 2 s), releasing every region it held, then the QP
    /// is destroyed, and with it the CQs that served only it. Returns the id, waiting for its
    /// `DISCONNECTED`.
    ///
    /// This overlaps the teardown with the disconnect round trip, which is what
    /// rdma-core's `cmtime` times as "disconnect" (`examples/cmtime.rs` uses it). On a channel
    /// other ids share, the event loop reads the `DISCONNECTED` and feeds it to
    /// [`Disconnecting::complete`]; [`Connection::disconnect`] registers its wait before
    /// disconnecting instead.
    ///
    /// # Errors
    /// [`Error::Call`] when `rdma_disconnect` fails; the QP is destroyed and the id dropped
    /// all the same.
    pub fn shutdown(self) -> Result<Disconnecting> {
        let peer_left = self.qp.peer_left();
        let sent = if self.disconnected || peer_left { Ok(()) } else { self.send_disconnect() };
        let this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped (ManuallyDrop) nor used after these reads, so the QP
        // and the id are each moved out exactly once and dropped once, by their new owners;
        // the remaining fields are plain data (`PrivateData` is Copy, the flags are bools).
        let (qp, id) = unsafe { (std::ptr::read(&this.qp), std::ptr::read(&this.id)) };
        // The QP goes now, whatever the disconnect said: its drop moves it to the error state
        // if rdma_disconnect did not, reaps the flush, destroys it and only then releases the
        // regions its work requests held.
        drop(qp);
        sent.map_err(|e| with_opt_addr(e, id.peer_addr()))?;
        Ok(Disconnecting { id, awaiting: !peer_left })
    }
}

impl Disconnecting {
    /// The id's token, to match the `DISCONNECTED` event.
    pub fn handle(&self) -> IdHandle {
        self.id.handle()
    }

    /// The id (the QP is gone).
    pub fn id(&self) -> &Arc<CmId> {
        &self.id
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.peer_addr()
    }

    /// Whether the disconnect is complete already: the peer had left (its `DISCONNECTED` was
    /// seen) before [`Connection::shutdown`], so no event is to come.
    pub fn is_complete(&self) -> bool {
        !self.awaiting
    }

    /// Completes the disconnect with the id's `DISCONNECTED` (or `DEVICE_REMOVAL`) event, read
    /// by an event loop. The id stays until this value drops (`rdma_destroy_id`), so a
    /// caller may time the two apart, as `cmtime` does.
    ///
    /// # Errors
    /// [`Error::UnexpectedEvent`] for any other event, or another id's (this value is
    /// unchanged and may take the right event later).
    pub fn complete(&mut self, ev: &CmEvent) -> Result<()> {
        if ev.id() == self.id.handle() && is_peer_gone(ev) {
            self.awaiting = false;
            return Ok(());
        }
        Err(with_opt_addr(ev.unexpected("rdma_disconnect", CmEventType::Disconnected), self.id.peer_addr()))
    }

    /// Waits up to `timeout` for the id's `DISCONNECTED` (skipping `TIMEWAIT_EXIT`); returns at
    /// once when [`Disconnecting::is_complete`]. On a channel other ids share, an untargeted
    /// reader may take the event first: there, feed it to [`Disconnecting::complete`] instead.
    ///
    /// # Errors
    /// [`Error::Timeout`]; [`Error::UnexpectedEvent`] for another event of the id.
    pub fn wait(self, timeout: Duration) -> Result<()> {
        if !self.awaiting {
            return Ok(());
        }
        await_disconnected(&self.id, timeout)
    }
}

/// Waits up to `timeout` for `id`'s `DISCONNECTED` (or `DEVICE_REMOVAL`), skipping
/// `TIMEWAIT_EXIT`.
pub(crate) fn await_disconnected(id: &CmId, timeout: Duration) -> Result<()> {
    let _expecting = id.channel().expecting(id.handle());
    let mut deadline = crate::wait::Deadline::new(timeout);
    loop {
        match expect(id, CmEventType::Disconnected, "rdma_disconnect", deadline.left()) {
            Ok(_) => return Ok(()),
            Err(Error::UnexpectedEvent { got: CmEventType::TimewaitExit, .. }) => continue,
            Err(Error::UnexpectedEvent { got: CmEventType::DeviceRemoval, .. }) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(feature = "tokio")]
impl Connection {
    /// [`Connection::next_event`] without blocking the runtime.
    ///
    /// # Errors
    /// [`crate::Error::Call`] when the channel or the reactor fails.
    pub async fn next_event_async(&mut self) -> Result<CmEvent> {
        let ev = self.id.channel().get_event_for_async(self.id.handle()).await?;
        self.handle_event(&ev);
        Ok(ev)
    }

    /// [`Connection::disconnect`] without blocking the runtime: disconnects and awaits the
    /// `DISCONNECTED` event (skipping others, such as `TIMEWAIT_EXIT`). While the id's port is
    /// down, the disconnect is held ([`crate::cm::hold`]) and then sent from tokio's blocking pool
    /// (`spawn_blocking`), not on the runtime's thread; a future dropped meanwhile leaves the
    /// pool's task to send it, once.
    ///
    /// # Errors
    /// [`crate::Error::Call`] when `rdma_disconnect` fails.
    pub async fn disconnect_async(mut self) -> Result<()> {
        let id = std::sync::Arc::clone(&self.id);
        let _expecting = id.channel().expecting(id.handle());
        if self.disconnected || self.qp.peer_left() {
            self.disconnected = true;
            return Ok(());
        }
        if self.user_qp {
            adopt::to_error(&self.qp)?;
        }
        // From here the disconnect is this call's (or its task's): not the drop's.
        self.disconnected = true;
        self.qp.set_closing();
        let sent = if id.port_is_down() {
            let holder = std::sync::Arc::clone(&id);
            let task = tokio::task::spawn_blocking(move || {
                holder.hold_while_port_down();
                holder.disconnect_now()
            });
            // A panic in the task (none is known) leaves the disconnect to be sent here.
            task.await.unwrap_or_else(|_| id.disconnect_now())
        } else {
            id.disconnect_now()
        };
        sent?;
        loop {
            let ev = self.id.channel().get_event_for_async(self.id.handle()).await?;
            if ev.event_type() == CmEventType::Disconnected {
                return Ok(());
            }
        }
    }
}
