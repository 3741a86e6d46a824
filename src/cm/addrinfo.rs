//! Host and service names to RDMA addresses: [`lookup`] and [`lookup_passive`] wrap
//! `rdma_getaddrinfo`, which resolves names the way `getaddrinfo` does (and, where the ibacm
//! service runs, asks it for InfiniBand routes), for the reliable-connected port space.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_cm::{lookup, lookup_passive, Client, Server};
//!
//! # fn main() -> rdma_cm::Result<()> {
//! let dst = lookup("server.example", "7471")?[0]; // where to connect
//! let route = Client::new()?.resolve_addr(None, dst, Duration::from_secs(5))?;
//! let here = lookup_passive(None, "7471")?[0]; // where to listen: the wildcard address
//! let listener = Server::new()?.bind(here)?.listen(16)?;
//! # let _ = (route, listener);
//! # Ok(()) }
//! ```

use std::ffi::{CStr, CString};
use std::net::SocketAddr;
use std::ptr;

use rdma_sys as ffi;

use crate::cm::cm_id::sockaddr_to_std;
use crate::error::{errno, Error, Result};

/// `RAI_PASSIVE` of <rdma/rdma_cma.h>: resolve for a listener (the answer's source address).
const RAI_PASSIVE: i32 = 1;

/// Resolves `host` and `service` (a port number, or a name from `/etc/services`) to the
/// addresses to connect to, in the resolver's order of preference: give each to
/// [`Client::resolve_addr`](crate::Client::resolve_addr) until one answers.
///
/// ```no_run
/// # fn main() -> rdma_cm::Result<()> {
/// let dst = rdma_cm::lookup("storage-7.example", "7471")?[0];
/// let route = rdma_cm::Client::new()?.resolve_addr(None, dst, std::time::Duration::from_secs(2))?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Lookup`] when the name does not resolve; [`Error::NoDevice`] without the RDMA
/// connection manager (librdmacm opens it before resolving); [`Error::InvalidArgument`] for
/// a name with a NUL byte.
pub fn lookup(host: &str, service: &str) -> Result<Vec<SocketAddr>> {
    getaddrinfo(Some(host), Some(service), false)
}

/// Resolves the address a listener binds to: `host` (`None` for every local address) and
/// `service`, as [`Server::bind`](crate::Server::bind) takes it.
///
/// # Errors
/// As for [`lookup`].
pub fn lookup_passive(host: Option<&str>, service: &str) -> Result<Vec<SocketAddr>> {
    getaddrinfo(host, Some(service), true)
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} {s:?} contains a NUL byte")))
}

fn getaddrinfo(host: Option<&str>, service: Option<&str>, passive: bool) -> Result<Vec<SocketAddr>> {
    let query = format!("{}:{}", host.unwrap_or("*"), service.unwrap_or("*"));
    let node = host.map(|h| cstring("host", h)).transpose()?;
    let serv = service.map(|s| cstring("service", s)).transpose()?;
    // SAFETY: rdma_addrinfo is plain old data (integers and pointers); all-zero is a valid
    // "no hint" value for every field.
    let mut hints: ffi::rdma_addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_port_space = ffi::rdma_port_space::RDMA_PS_TCP as i32;
    if passive {
        hints.ai_flags = RAI_PASSIVE;
    }
    let mut res: *mut ffi::rdma_addrinfo = ptr::null_mut();
    // SAFETY: the strings are NUL-terminated and outlive the call; `hints` is initialised;
    // `res` is a valid out-pointer, freed below with rdma_freeaddrinfo.
    let ret = unsafe {
        ffi::rdma_getaddrinfo(
            node.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            serv.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            &hints,
            &mut res,
        )
    };
    if ret != 0 {
        // librdmacm returns -1 with errno, or (from getaddrinfo) an EAI_* code.
        let reason = if ret == -1 {
            let e = errno();
            if e == libc::ENODEV || e == libc::ENOENT {
                // librdmacm opens /dev/infiniband/rdma_cm before resolving anything.
                return Err(Error::NoDevice { op: "rdma_getaddrinfo", addr: None });
            }
            std::io::Error::from_raw_os_error(e).to_string()
        } else {
            // SAFETY: gai_strerror returns a static NUL-terminated string for any code.
            unsafe { CStr::from_ptr(libc::gai_strerror(ret)) }.to_string_lossy().into_owned()
        };
        return Err(Error::Lookup { query, reason });
    }
    let mut out = Vec::new();
    let mut cur = res;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list rdma_getaddrinfo returned, alive until freed.
        let ai = unsafe { &*cur };
        let addr = if passive { ai.ai_src_addr } else { ai.ai_dst_addr };
        if !addr.is_null() {
            // SAFETY: a non-NULL address of the list points at an initialised sockaddr of its
            // family (its length is that family's), and sockaddr_to_std reads the family field,
            // then only as far as that family's size, through the raw pointer.
            if let Some(a) = unsafe { sockaddr_to_std(addr.cast::<libc::sockaddr_storage>()) } {
                if !out.contains(&a) {
                    out.push(a);
                }
            }
        }
        cur = ai.ai_next;
    }
    // SAFETY: `res` came from rdma_getaddrinfo and is freed once.
    unsafe { ffi::rdma_freeaddrinfo(res) };
    if out.is_empty() {
        return Err(Error::Lookup { query, reason: "no address of a family RDMA can use".into() });
    }
    Ok(out)
}
