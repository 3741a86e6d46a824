//! QPs the connection manager drives: made by `rdma_create_qp` on an id ([`create_qp_on`],
//! blocking multicast loopback when asked), and the [`Link`] through which such a QP asks its
//! id to destroy it, disconnect, and say whether the peer left.

use std::sync::Arc;

use rdma_sys as ffi;

use crate::cm::cm_id::CmId;
use crate::error::{check_rdma, errno, Error, Result};
use crate::verbs::link::Link;
use crate::verbs::pd::ProtectionDomain;
use crate::verbs::qp::{QpInit, QueuePair};

/// How a QP made through `rdma_create_qp` relates to its id: the id's channel lock serialises
/// its destruction with librdmacm's event processing (which uses `id->qp`), and the id's events
/// say when the peer left.
struct CmLink(Arc<CmId>);

impl Link for CmLink {
    fn destroy(&self, qp: *mut ffi::ibv_qp) -> i32 {
        // No event processing (which reads and modifies id->qp) runs between the destroy and
        // clearing id->qp.
        let _lock = self.0.channel().lock();
        // SAFETY: the QP is the id's, destroyed exactly once (QueuePair::drop calls this once).
        let ret = unsafe { ffi::ibv_destroy_qp(qp) };
        if ret == 0 {
            // SAFETY: the id is valid; clearing `qp` mirrors rdma_destroy_qp, so librdmacm
            // never uses the freed QP.
            unsafe { (*self.0.as_raw()).qp = std::ptr::null_mut() };
        }
        ret
    }

    fn disconnect(&self) -> Result<()> {
        // The answer to the peer's disconnect (its DREQ came in over this port a moment ago):
        // not held while the port is down (`crate::hold`), so that a wait, async ones too,
        // never blocks for the hold.
        self.0.disconnect_now()
    }

    fn comm_established(&self) {
        // EISCONN (the CM saw the handshake complete first) and EINVAL (a transport whose CM
        // takes no notification) both leave nothing to do.
        let _ = self.0.notify(crate::status::AsyncEventKind::CommEstablished);
    }
}

/// Creates the RC QP of `id` on `pd` through `rdma_create_qp`, so librdmacm drives its state
/// changes during connect/accept. Only the typestates call this, each consuming the state that
/// owns the id, so an id gets at most one QP.
pub(crate) fn create_qp_on(id: &Arc<CmId>, pd: &Arc<ProtectionDomain>, init: QpInit) -> Result<QueuePair> {
    if id.verbs().map(|v| v.as_ptr()) != Some(pd.context().as_raw()) {
        return Err(Error::InvalidArgument(format!(
            "the protection domain is on device {}, not on the device context of this connection's id (allocate it from the id: alloc_pd)",
            pd.context().device_name()
        )));
    }
    let block_self_mcast_lb = init.block_self_mcast_lb;
    QueuePair::create(
        pd,
        init,
        |attr| {
            // The channel's lock: no event processing reads id->qp while it is being set.
            let _lock = id.channel().lock();
            if block_self_mcast_lb {
                create_qp_blocking_loopback(id, pd, attr)?;
            } else {
                crate::error::clear_errno();
                // SAFETY: id, PD and CQs are valid and on one device context (checked above and
                // in QueuePair::create; librdmacm checks the PD's context against the id's
                // too); attr is fully initialised.
                let ret = unsafe { ffi::rdma_create_qp(id.as_raw(), pd.as_raw(), attr) };
                check_rdma(ret, "rdma_create_qp")?;
            }
            // SAFETY: rdma_create_qp succeeded, so id->qp is the new QP.
            std::ptr::NonNull::new(unsafe { (*id.as_raw()).qp })
                .ok_or_else(|| Error::call("rdma_create_qp", libc::EIO, None))
        },
        Some(Arc::new(CmLink(Arc::clone(id))) as Arc<dyn Link>),
    )
}

/// Creates the id's QP through `rdma_create_qp_ex` with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`.
/// Called by the connection layer's QP creation with the id's channel lock held.
pub(crate) fn create_qp_blocking_loopback(
    id: &CmId,
    pd: &ProtectionDomain,
    attr: &mut ffi::ibv_qp_init_attr,
) -> Result<()> {
    // SAFETY: ibv_qp_init_attr_ex is plain old data (integers, pointers, a hash config); zero
    // is valid and means "not given" for every field not set below.
    let mut ex: ffi::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    ex.qp_context = attr.qp_context;
    ex.send_cq = attr.send_cq;
    ex.recv_cq = attr.recv_cq;
    ex.srq = attr.srq;
    ex.cap = attr.cap;
    ex.qp_type = attr.qp_type;
    ex.sq_sig_all = attr.sq_sig_all;
    ex.comp_mask =
        (ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD | ffi::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_CREATE_FLAGS).0;
    ex.pd = pd.as_raw();
    ex.create_flags = ffi::ibv_qp_create_flags::IBV_QP_CREATE_BLOCK_SELF_MCAST_LB.0;
    // SAFETY: the id, PD and CQs are valid and on one device context (the caller checked);
    // `ex` is fully initialised and only read during the call; the caller holds the id's
    // channel lock, so no event processing reads id->qp meanwhile.
    let ret = unsafe { ffi::rdma_create_qp_ex(id.as_raw(), &mut ex) };
    if ret != 0 {
        let e = errno();
        let hint = match e {
            libc::EOPNOTSUPP | libc::EINVAL => Some(
                "this device cannot block multicast loopback (rxe cannot; neither can `mckey -l` there): keep loopback \
                 on and skip your own datagrams by their source QP (Datagram::src_qp == your QP number)",
            ),
            _ => None,
        };
        return Err(Error::Call {
            op: "rdma_create_qp_ex(IBV_QP_CREATE_BLOCK_SELF_MCAST_LB)",
            addr: None,
            hint,
            source: std::io::Error::from_raw_os_error(e),
        });
    }
    // librdmacm's rdma_create_qp_ex copied the capabilities it got back into `ex`.
    attr.cap = ex.cap;
    Ok(())
}
