//! The connection-manager wing (librdmacm): event channels, ids, the client and server
//! typestates, connections and their closing, UD through the CM, and multicast. It stands on
//! the verbs wing ([`crate::verbs`]).

pub mod addrinfo;
pub mod adopt;
pub mod client;
pub mod cm_id;
pub(crate) mod cm_qp;
pub mod conn_param;
pub mod connection;
pub mod event_channel;
pub(crate) mod expect;
pub mod hold;
mod lane_cm;
pub mod lane_conn;
mod lane_mcast;
pub mod multicast;
pub mod private_data;
pub mod server;
pub mod step;
pub mod ud_cm;
