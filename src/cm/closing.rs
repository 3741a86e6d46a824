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
//! [`Connection::disconnect`] is `shutdown` followed by [`Disconnecting::wait`]. The QP is
//! gone from the type too:
//!
//! ```compile_fail
//! # fn f(c: rdma_cm::Connection) -> rdma_cm::Result<()> {
//! let d = c.shutdown()?;
//! let n = d.qp().qp_num();
//! # Ok(()) }
//! ```

use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cm::cm_id::{CmId, IdHandle};
use crate::cm::connection::{expect, is_peer_gone, with_opt_addr, Connection};
use crate::cm::event_channel::{CmEvent, CmEventType};
use crate::error::{Error, Result};

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
        let _expecting = self.id.channel().expecting(self.id.handle());
        let mut deadline = crate::wait::Deadline::new(timeout);
        loop {
            match expect(&self.id, CmEventType::Disconnected, "rdma_disconnect", deadline.left()) {
                Ok(_) => return Ok(()),
                Err(Error::UnexpectedEvent { got: CmEventType::TimewaitExit, .. }) => continue,
                Err(Error::UnexpectedEvent { got: CmEventType::DeviceRemoval, .. }) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }
}
