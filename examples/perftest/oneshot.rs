//! The one-shot exchange and the atomics' steps on the convenient path (`QueuePair::post_send`
//! and its waits): what `perf_client` runs with `--iters 1`, and the atomics with any count.

use std::time::Duration;

use rdma_cm::{Connection, Error, MemoryRegion, RecvWr, RemoteRegion, SendWr, WorkQueue};

use crate::protocol::Mode;

#[allow(clippy::too_many_arguments)]
pub fn round_trip_send(
    conn: &mut Connection,
    data: &MemoryRegion,
    back: &MemoryRegion,
    i: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let qp = conn.qp_mut();
    let size = data.len();
    // The first receive was posted before connecting; later ones after checking the last echo.
    if i > 0 {
        qp.post_recv(&[RecvWr::new(back, 0..size).wr_id(i as u64)])?;
    }
    qp.post_send(&[SendWr::send(data, 0..size).wr_id(i as u64)])?;
    qp.wait_for(WorkQueue::Send, i as u64, t)?;
    if log {
        say!("[INFO] Sent {size} bytes");
    }
    let wc = qp.wait_for(WorkQueue::Recv, i as u64, t)?;
    if log {
        say!("[INFO] Received {} bytes", wc.byte_len());
    }
    Ok(wc.byte_len() as usize)
}

#[allow(clippy::too_many_arguments)]
pub fn round_trip_write(
    conn: &mut Connection,
    data: &MemoryRegion,
    ctl: &mut MemoryRegion,
    server: RemoteRegion,
    send_doorbell: bool,
    i: u32,
    iters: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let qp = conn.qp_mut();
    let size = data.len();
    let write = SendWr::write(data, 0..size, &server, 0)?;
    if send_doorbell {
        // The SEND's completion retires the unsignaled WRITE before it.
        let ring = i.to_be_bytes();
        qp.post_send(&[write.unsignaled(), SendWr::send_inline(&ring).wr_id(i as u64)])?;
    } else {
        qp.post_send(&[write.imm(i).wr_id(i as u64)])?;
    }
    qp.wait_for(WorkQueue::Send, i as u64, t)?;
    if log {
        say!("[INFO] Sent {size} bytes (RDMA WRITE)");
    }
    let wc = qp.wait_for(WorkQueue::Recv, i as u64, t)?;
    let rung = if send_doorbell {
        let mut ring = [0u8; 4];
        ctl.read_at(0, &mut ring)?;
        (wc.byte_len() == 4).then_some(u32::from_be_bytes(ring))
    } else {
        wc.imm_data()
    };
    if rung != Some(i) {
        return Err(Error::InvalidArgument(format!(
            "expected the server's doorbell for iteration {i} ({}), got {rung:?} ({} bytes)",
            if send_doorbell { "a 4-byte send" } else { "immediate data" },
            wc.byte_len()
        )));
    }
    if log {
        say!("[INFO] Received {size} bytes (RDMA WRITE)");
    }
    if i + 1 < iters {
        qp.post_recv(&[RecvWr::new(ctl, 0..64).wr_id(i as u64 + 1)])?;
    }
    Ok(size)
}

#[allow(clippy::too_many_arguments)]
pub fn round_trip_read(
    conn: &mut Connection,
    back: &MemoryRegion,
    ctl: &MemoryRegion,
    server: RemoteRegion,
    i: u32,
    iters: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let qp = conn.qp_mut();
    let size = back.len();
    // "go": the server now RDMA-READs our data region.
    qp.post_send(&[SendWr::send_inline(&i.to_be_bytes()).wr_id(u64::MAX)])?;
    qp.wait_for(WorkQueue::Send, u64::MAX, t)?;
    if log {
        say!("[INFO] Sent {size} bytes (exposed to RDMA READ)");
    }
    // "done": read the server's copy back.
    qp.wait_for(WorkQueue::Recv, i as u64, t)?;
    if i + 1 < iters {
        qp.post_recv(&[RecvWr::new(ctl, 0..64).wr_id(i as u64 + 1)])?;
    }
    qp.post_send(&[SendWr::read(back, 0..size, &server, 0)?.wr_id(i as u64)])?;
    let wc = qp.wait_for(WorkQueue::Send, i as u64, t)?;
    if log {
        say!("[INFO] Received {} bytes (RDMA READ)", wc.byte_len());
    }
    Ok(wc.byte_len() as usize)
}

/// One atomic on the server's counter: fetch-and-add 1, or compare-and-swap i -> i + 1. Both
/// must find `i` there (the counter starts at 0 and only this client moves it).
pub fn atomic_step(
    conn: &mut Connection,
    back: &mut MemoryRegion,
    server: RemoteRegion,
    mode: Mode,
    i: u32,
    log: bool,
    t: Duration,
) -> Result<usize, Error> {
    let i = u64::from(i);
    let wr = match mode {
        Mode::CmpSwap => SendWr::compare_swap(back, 0..8, &server, 0, i, i + 1)?,
        _ => SendWr::fetch_add(back, 0..8, &server, 0, 1)?,
    };
    let qp = conn.qp_mut();
    qp.post_send(&[wr.wr_id(i)])?;
    qp.wait_for(WorkQueue::Send, i, t)?;
    let mut v = [0u8; 8];
    back.read_at(0, &mut v)?;
    let found = u64::from_ne_bytes(v);
    if found != i {
        return Err(Error::InvalidArgument(format!("{mode} {i} found the counter at {found}, expected {i}")));
    }
    if log {
        say!("[INFO] {mode}: the counter was {found}");
    }
    Ok(8)
}
