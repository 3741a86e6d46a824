//! The verbs wing: devices, protection domains, memory regions, completion queues, shared
//! receive queues, queue pairs, address handles and work requests (libibverbs). Nothing here
//! imports the connection manager ([`crate::cm`]), which stands on top of it.

pub mod ah;
pub mod async_event;
pub mod buffer;
pub mod cq;
pub mod device;
pub mod diagnostics;
pub mod extended;
pub mod fork;
pub(crate) mod hub;
pub mod lane;
pub(crate) mod link;
pub mod mr;
pub mod mw;
pub mod pd;
pub mod peer;
pub mod port;
pub mod qp;
pub(crate) mod qp_attr;
pub(crate) mod ring;
pub(crate) mod router;
pub mod srq;
pub mod ud;
pub mod wc;
pub mod wr;
