//! [`StepError`]: an event-loop step that did not complete gives its state back.
//!
//! The steps an event loop drives with the events it reads ([`ResolvingAddr::complete`],
//! [`ResolvingRoute::complete`], [`Connecting::complete`], [`Accepting::complete`], and
//! [`ConnectRequest::from_event`] for the event itself) consume their state, so that a
//! completed step cannot be completed twice. When the event is not the one the step waits for
//! (another id's, say, or a `REJECTED`), the step fails with a [`StepError`] that carries the
//! state back, unchanged, beside the [`Error`]: put it back where it was and feed it the next
//! event, or drop it (which destroys its id) if the error ends the connection. The steps take
//! the event by reference (or by value, as before), so the event itself stays with the loop
//! for its owner. [`Disconnecting::complete`](crate::Disconnecting::complete) takes `&mut self`
//! and needs none of this.
//!
//! `?` turns a `StepError` into the crate's [`Error`] (dropping the state), so code written
//! for the steps' earlier `Result<_, Error>` keeps working where it uses `?`:
//!
//! ```no_run
//! # fn f(acc: rdma_cm::Accepting, ev: rdma_cm::CmEvent) -> rdma_cm::Result<rdma_cm::Connection> {
//! let conn = acc.complete(&ev)?;
//! # Ok(conn) }
//! ```
//!
//! and an event loop keeps the state, e.g. to retry after an `ADDR_ERROR`:
//!
//! ```no_run
//! # use std::collections::HashMap;
//! # use std::time::Duration;
//! use rdma_cm::{CmEventType, EventChannel, IdHandle, ResolvingAddr};
//!
//! # fn f(ch: &EventChannel, resolving: &mut HashMap<IdHandle, ResolvingAddr>, dst: std::net::SocketAddr) -> rdma_cm::Result<()> {
//! let t = Duration::from_secs(2);
//! let ev = ch.get_event(t)?;
//! if let Some(r) = resolving.remove(&ev.id()) {
//!     match r.complete(&ev) {
//!         Ok(resolved) => { /* start_resolve_route ... */ }
//!         Err(e) if ev.event_type() == CmEventType::AddrError => {
//!             eprintln!("{}: trying again", e.error());
//!             let r = e.into_state();
//!             r.retry(None, dst, t)?;
//!             resolving.insert(r.handle(), r);
//!         }
//!         Err(e) => return Err(e.into()),
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! [`ResolvingAddr::complete`]: crate::ResolvingAddr::complete
//! [`ResolvingRoute::complete`]: crate::ResolvingRoute::complete
//! [`Connecting::complete`]: crate::Connecting::complete
//! [`Accepting::complete`]: crate::Accepting::complete
//! [`ConnectRequest::from_event`]: crate::ConnectRequest::from_event

use std::fmt;

use crate::error::Error;

/// A step that did not complete: the state it was given (unchanged) and why (after
/// `std::io::IntoInnerError`). Converts into [`Error`] with `?`, dropping the state.
///
/// One pointer wide (the pair is boxed on this, the failing, path), so that the `Result` of a
/// step is no larger for carrying the state back.
pub struct StepError<S> {
    inner: Box<(S, Error)>,
}

impl<S> StepError<S> {
    pub(crate) fn new(state: S, error: Error) -> StepError<S> {
        StepError { inner: Box::new((state, error)) }
    }

    /// Why the step did not complete.
    pub fn error(&self) -> &Error {
        &self.inner.1
    }

    /// The state, as the step was given it.
    pub fn state(&self) -> &S {
        &self.inner.0
    }

    /// The state, to feed it another event.
    pub fn into_state(self) -> S {
        self.inner.0
    }

    /// The error, dropping the state (what `?` does).
    pub fn into_error(self) -> Error {
        self.inner.1
    }

    /// Both.
    pub fn into_parts(self) -> (S, Error) {
        *self.inner
    }
}

impl<S> From<StepError<S>> for Error {
    fn from(e: StepError<S>) -> Error {
        e.into_error()
    }
}

impl<S> fmt::Debug for StepError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepError").field("state", &std::any::type_name::<S>()).field("error", self.error()).finish()
    }
}

impl<S> fmt::Display for StepError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.error(), f)
    }
}

impl<S> std::error::Error for StepError<S> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(self.error())
    }
}
