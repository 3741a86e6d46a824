//! What a device offers of on-demand paging, as `ibv_query_device_ex` reports it. A leaf of
//! its own so that [`DeviceLimits`](crate::DeviceLimits) can hold it without the device layer
//! depending on memory regions; users reach it as [`crate::verbs::odp::OdpCaps`].

use bitflags::bitflags;
use rdma_sys as ffi;

bitflags! {
    /// The operations whose memory on-demand paging serves on one transport
    /// (`enum ibv_odp_transport_cap_bits`, `rc_odp_caps` and its siblings). Bits the crate does
    /// not know are kept.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct OdpOps: u32 {
        /// The source of a send (`IBV_ODP_SUPPORT_SEND`).
        const SEND = 1;
        /// The target of a receive (`IBV_ODP_SUPPORT_RECV`).
        const RECV = 1 << 1;
        /// Both ends of an RDMA WRITE (`IBV_ODP_SUPPORT_WRITE`).
        const WRITE = 1 << 2;
        /// Both ends of an RDMA READ (`IBV_ODP_SUPPORT_READ`).
        const READ = 1 << 3;
        /// Both ends of an atomic (`IBV_ODP_SUPPORT_ATOMIC`).
        const ATOMIC = 1 << 4;
        /// The target of a shared receive queue's receive (`IBV_ODP_SUPPORT_SRQ_RECV`).
        const SRQ_RECV = 1 << 5;
        /// The target of an RDMA FLUSH (the kernel's `IB_ODP_SUPPORT_FLUSH`).
        const FLUSH = 1 << 6;
        /// The target of an atomic write (the kernel's `IB_ODP_SUPPORT_ATOMIC_WRITE`).
        const ATOMIC_WRITE = 1 << 7;
        // Bits a later kernel defines are kept, not dropped.
        const _ = !0;
    }
}

/// What a device offers of on-demand paging (`odp_caps` and `xrc_odp_caps` of
/// `ibv_query_device_ex`), in [`DeviceLimits::odp`](crate::DeviceLimits::odp). All empty on a
/// device or kernel without ODP, and where the provider library cannot say
/// (`ibv_query_device_ex` missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct OdpCaps {
    /// Explicit ODP regions can be registered ([`AccessFlags::ON_DEMAND`](crate::verbs::mr::AccessFlags::ON_DEMAND);
    /// `IBV_ODP_SUPPORT` in `general_caps`).
    pub supported: bool,
    /// The whole address space can be registered at once ([`ImplicitOdpRegion`](crate::verbs::odp::ImplicitOdpRegion);
    /// `IBV_ODP_SUPPORT_IMPLICIT`).
    pub implicit: bool,
    /// Operations of reliable-connected QPs whose memory may be ODP memory (`rc_odp_caps`).
    pub rc: OdpOps,
    /// Of unreliable-connected QPs (`uc_odp_caps`).
    pub uc: OdpOps,
    /// Of unreliable-datagram QPs (`ud_odp_caps`).
    pub ud: OdpOps,
    /// Of XRC QPs (`xrc_odp_caps`).
    pub xrc: OdpOps,
}

/// `IBV_ODP_SUPPORT` and `IBV_ODP_SUPPORT_IMPLICIT` (`enum ibv_odp_general_caps`).
const GENERAL_SUPPORT: u64 = ffi::ibv_odp_general_caps::IBV_ODP_SUPPORT.0 as u64;
const GENERAL_IMPLICIT: u64 = ffi::ibv_odp_general_caps::IBV_ODP_SUPPORT_IMPLICIT.0 as u64;

impl OdpCaps {
    /// The capabilities in an `ibv_device_attr_ex` filled by `ibv_query_device_ex`.
    pub(crate) fn from_attr(a: &ffi::ibv_device_attr_ex) -> OdpCaps {
        let t = &a.odp_caps.per_transport_caps;
        OdpCaps {
            supported: a.odp_caps.general_caps & GENERAL_SUPPORT != 0,
            implicit: a.odp_caps.general_caps & GENERAL_IMPLICIT != 0,
            rc: OdpOps::from_bits_retain(t.rc_odp_caps),
            uc: OdpOps::from_bits_retain(t.uc_odp_caps),
            ud: OdpOps::from_bits_retain(t.ud_odp_caps),
            xrc: OdpOps::from_bits_retain(a.xrc_odp_caps),
        }
    }
}
