//! The connection-manager wing (librdmacm): event channels, ids, the client and server
//! typestates, connections and their closing, UD through the CM, and multicast. It stands on
//! the verbs wing ([`crate::verbs`]).

pub mod addrinfo;
#[cfg(feature = "tokio")]
mod asynchronous;
pub mod closing;
pub mod cm_id;
pub mod connection;
pub mod event_channel;
pub mod multicast;
pub mod private_data;
pub mod step;
pub mod ud_cm;
pub mod user_qp;
