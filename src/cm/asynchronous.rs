//! Async connection setup and event waiting on tokio's reactor (feature `tokio`).
//!
//! Each blocking step has an `_async` twin that starts the same librdmacm call and then awaits
//! the id's event channel through tokio instead of `poll(2)`. The address and route steps are
//! bounded by librdmacm's own timers (the `timeout` they take); the handshake by the CM's
//! retries. Wrap any of them in `tokio::time::timeout` for a tighter bound: dropping one of
//! these futures is safe at every point, since the ids and QPs they hold are owned values
//! that clean up in `Drop` as usual.
//!
//! The channel's descriptor is registered with the reactor at its first async wait and stays so
//! for the channel's life (see `crate::wait::Reactor`); any number of tasks may await it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::cm::cm_id::CmId;
use crate::cm::connection::{check_event, with_opt_addr};
use crate::cm::event_channel::{CmEvent, CmEventType, EventChannel};
use crate::error::Result;
use crate::{AddrResolved, Client, ClientQp, ConnParam, ConnectRequest, Connection, Listener, RouteResolved, ServerQp};

impl EventChannel {
    /// Waits for the next event without blocking the runtime.
    ///
    /// # Errors
    /// [`crate::Error::Call`] when the channel or the reactor fails.
    pub async fn get_event_async(&self) -> Result<CmEvent> {
        self.wait_async(None).await
    }

    /// [`EventChannel::get_event_for`] without blocking the runtime: the next event of the id
    /// `id`; other ids' events read meanwhile are kept for their owners.
    ///
    /// # Errors
    /// As for [`EventChannel::get_event_async`].
    pub async fn get_event_for_async(&self, id: crate::cm::cm_id::IdHandle) -> Result<CmEvent> {
        self.wait_async(Some(id)).await
    }
}

async fn expect_async(id: &CmId, expected: CmEventType, op: &'static str) -> Result<CmEvent> {
    let ev = id.channel().get_event_for_async(id.handle()).await?;
    check_event(id, &ev, expected, op)?;
    Ok(ev)
}

impl Client {
    /// [`Client::resolve_addr`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`Client::resolve_addr`].
    pub async fn resolve_addr_async(
        self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<AddrResolved> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.start_resolve_addr(src, dst, timeout)?;
        expect_async(&self.id, CmEventType::AddrResolved, "rdma_resolve_addr").await.map_err(|e| e.with_addr(dst))?;
        Ok(AddrResolved { id: self.id })
    }
}

impl AddrResolved {
    /// [`AddrResolved::resolve_route`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`AddrResolved::resolve_route`].
    pub async fn resolve_route_async(self, timeout: Duration) -> Result<RouteResolved> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.id.resolve_route(timeout).map_err(|e| with_opt_addr(e, self.id.peer_addr()))?;
        expect_async(&self.id, CmEventType::RouteResolved, "rdma_resolve_route").await?;
        Ok(RouteResolved { id: std::sync::Arc::new(self.id) })
    }
}

impl ClientQp {
    /// [`ClientQp::connect`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`ClientQp::connect`].
    pub async fn connect_async(self, param: &ConnParam) -> Result<Connection> {
        let _expecting = self.id.channel().expecting(self.id.handle());
        self.start_connect(param)?;
        let ev = expect_async(&self.id, crate::cm::connection::connected_event(self.user), "rdma_connect").await?;
        crate::cm::connection::finish_connect(self.id, self.qp, self.user, &ev)
    }
}

impl Listener {
    /// [`Listener::get_request`] without blocking the runtime; the new id gets its own channel.
    ///
    /// # Errors
    /// [`crate::Error::UnexpectedEvent`] for any event but a connection request.
    pub async fn get_request_async(&self) -> Result<ConnectRequest> {
        let ev = self.id.channel().get_event_for_async(self.id.handle()).await?;
        if ev.event_type() != CmEventType::ConnectRequest {
            return Err(ev.unexpected("waiting for CONNECT_REQUEST", CmEventType::ConnectRequest));
        }
        ConnectRequest::build(ev, true)
    }
}

impl ServerQp {
    /// [`ServerQp::accept`] without blocking the runtime.
    ///
    /// # Errors
    /// As for [`ServerQp::accept`].
    pub async fn accept_async(self, param: &ConnParam) -> Result<Connection> {
        let id = std::sync::Arc::clone(&self.id);
        let _expecting = id.channel().expecting(id.handle());
        let acc = self.start_accept(param)?;
        let ev = expect_async(&acc.id, CmEventType::Established, "rdma_accept").await?;
        Ok(acc.complete(&ev)?)
    }
}

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
    /// `DISCONNECTED` event (skipping others, such as `TIMEWAIT_EXIT`).
    ///
    /// # Errors
    /// [`crate::Error::Call`] when `rdma_disconnect` fails.
    pub async fn disconnect_async(mut self) -> Result<()> {
        let id = std::sync::Arc::clone(&self.id);
        let _expecting = id.channel().expecting(id.handle());
        if self.start_disconnect()? {
            loop {
                let ev = self.id.channel().get_event_for_async(self.id.handle()).await?;
                if ev.event_type() == CmEventType::Disconnected {
                    break;
                }
            }
        }
        Ok(())
    }
}
