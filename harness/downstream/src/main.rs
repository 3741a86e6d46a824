//! Uses rdma-cm and its re-exported bindings (`rdma_cm::ffi`) from outside the workspace.
//! Needs no RDMA device. Run by harness/test, or by hand:
//!
//! ```text
//! cargo build --manifest-path harness/downstream/Cargo.toml
//! harness/downstream/target/debug/rdma-cm-downstream
//! ```

use rdma_cm::ffi;

fn main() {
    // Derives that rdma-sys 0.3.0's bindings had, and that newer bindgen drops unless asked.
    let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    assert_eq!(format!("{access:?}"), "ibv_access_flags(3)");
    assert_eq!(format!("{:?}", ffi::ibv_event_type::IBV_EVENT_PORT_ACTIVE), "IBV_EVENT_PORT_ACTIVE");
    // A constified-enum module, and the crate's own types over the same values.
    assert_eq!(ffi::ibv_wc_status::IBV_WC_SUCCESS, 0);
    assert_eq!(rdma_cm::AccessFlags::LOCAL_WRITE.bits(), ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    let _ = (rdma_cm::QpInit::new(), rdma_cm::ConnParam::new());

    // A call into libibverbs, so linking is checked too. It needs no device.
    let mut devices = 0;
    // SAFETY: `devices` is a valid out-pointer; a non-null list is freed once, unused.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut devices);
        if !list.is_null() {
            ffi::ibv_free_device_list(list);
        }
    }
    println!("rdma-cm downstream: ok ({access:?}; {devices} RDMA devices here)");
}
