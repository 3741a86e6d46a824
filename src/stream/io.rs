//! The stream's blocking I/O: `Read`, `Write`, `shutdown`, the timeouts, and the close.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::time::{Duration, Instant};

use crate::stream::engine::Stream;
use crate::stream::wire::{Ctrl, Msg};

/// How long a drop waits for the close to go out and for the CM's disconnect.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The instant `timeout` from now; a timeout too large for the clock (`Duration::MAX`) never
/// runs out in practice.
pub(super) fn deadline(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600))).unwrap_or(now)
}

impl Stream {
    /// Bounds each blocking [`Read::read`]: one that finds no data for this long fails with
    /// [`io::ErrorKind::TimedOut`] (the stream stays usable). Default 30 s.
    pub fn set_read_timeout(&mut self, timeout: Duration) {
        self.read_timeout = timeout;
    }

    /// Bounds each blocking [`Write::write`] (and [`Write::flush`], [`Stream::shutdown`]): one
    /// that cannot send for this long (no credits, no granted space: the peer does not read)
    /// fails with [`io::ErrorKind::TimedOut`]. Default 30 s.
    pub fn set_write_timeout(&mut self, timeout: Duration) {
        self.write_timeout = timeout;
    }

    /// The bound of a blocking read.
    pub fn read_timeout(&self) -> Duration {
        self.read_timeout
    }

    /// The bound of a blocking write.
    pub fn write_timeout(&self) -> Duration {
        self.write_timeout
    }

    /// Shuts down reading, writing or both, as rsocket's `rshutdown` does: `Write` sends the
    /// peer a SHUTDOWN (its reads end after the data sent so far; it may go on writing),
    /// `Both` a DISCONNECT (the peer's reads end, its writes fail), and `Read` sends nothing
    /// unless writing was shut down already (then a DISCONNECT). Then waits, bounded by the
    /// write timeout, until everything sent has completed. After it, reads return `Ok(0)` once
    /// the data already arrived is read (`Read`, `Both`), and writes fail (`Write`, `Both`).
    ///
    /// # Errors
    /// The error that broke the stream; [`io::ErrorKind::TimedOut`] when the sends did not
    /// complete in time.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        self.mark_shut(how);
        let deadline = deadline(self.write_timeout);
        if self.close_due().is_some() {
            self.poll_now();
            while !self.ctrl_free() && self.fatal.is_none() && !self.peer_gone {
                if !self.wait_until(deadline) {
                    return Err(self.timeout_error("shutdown", self.write_timeout));
                }
            }
            self.send_close();
        }
        self.drain_sends(deadline)
    }

    /// Marks `how` shut down on this side.
    pub(super) fn mark_shut(&mut self, how: Shutdown) {
        match how {
            Shutdown::Read => self.readable = false,
            Shutdown::Write => self.writable = false,
            Shutdown::Both => (self.readable, self.writable) = (false, false),
        }
    }

    /// The message that tells the peer what this side shut down, while one is due and can
    /// still go out: worked out from the stream's state alone, so that a shutdown that timed
    /// out or whose future was dropped before the message went out leaves it due for the
    /// next, and one sent is never due again. As rsocket: SHUTDOWN once writing is shut down
    /// while this side still reads (its socket stops being readable at the peer's SHUTDOWN
    /// too), DISCONNECT once both are; nothing once disconnected (the peer's DISCONNECT, or
    /// its own).
    pub(super) fn close_due(&self) -> Option<Ctrl> {
        let readable = self.readable && !self.peer_eof;
        let msg = match (readable, self.writable) {
            (_, true) => None,
            (true, false) if self.shutdown_sent => None,
            (true, false) => Some(Ctrl::Shutdown),
            (false, false) => Some(Ctrl::Disconnect),
        };
        let connected = !self.disconnect_sent && !self.peer_disconnected && !self.peer_gone;
        msg.filter(|_| connected && self.fatal.is_none())
    }

    /// Sends the close message that is due, if one is (the caller waited for a free control
    /// slot).
    pub(super) fn send_close(&mut self) {
        if let Some(c) = self.close_due() {
            self.send_ctrl(Msg::Ctrl(c));
            match c {
                Ctrl::Disconnect => self.disconnect_sent = true,
                _ => self.shutdown_sent = true,
            }
        }
    }

    /// Waits until everything posted has completed (or the connection is gone). An error
    /// when any data WRITE failed, or was still in flight when the peer left: its bytes may
    /// not have reached the peer.
    fn drain_sends(&mut self, deadline: Instant) -> io::Result<()> {
        self.poll_now();
        while !self.sends_done() && self.fatal.is_none() && !self.peer_gone {
            if !self.wait_until(deadline) {
                return Err(self.timeout_error("waiting for the sends to complete", self.write_timeout));
            }
        }
        self.sends_result()
    }

    /// Why no write can go out any more, if so: the stream broke, writing was shut down, or
    /// the peer disconnected or left.
    pub(super) fn write_refusal(&self) -> io::Result<()> {
        if let Some(e) = self.fatal_error() {
            return Err(e);
        }
        if !self.writable {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the stream was shut down for writing"));
        }
        if self.peer_disconnected {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "the peer disconnected the stream (an rsocket DISCONNECT): it reads no more",
            ));
        }
        if self.peer_gone {
            return Err(self.gone_error());
        }
        Ok(())
    }

    /// A read without waiting, the step the blocking and the async read share: what has
    /// arrived copied into `buf` (a non-empty buffer), the end of the stream (`Ok(0)`) or the
    /// error that broke it; `None` when nothing has arrived and the caller must wait (the CQ
    /// was polled last). Data that arrived before the stream broke is read before the error.
    pub(super) fn try_read(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        loop {
            if !self.readable {
                return Some(Ok(0));
            }
            if !self.rx_msgs.is_empty() {
                let n = self.copy_out(buf);
                if n.is_ok() {
                    self.give_credits();
                }
                return Some(n);
            }
            if let Some(e) = self.fatal_error() {
                return Some(Err(e));
            }
            self.poll_now();
            if !self.rx_msgs.is_empty() || self.fatal.is_some() {
                continue;
            }
            if self.peer_eof {
                return Some(Ok(0));
            }
            if self.peer_gone {
                return Some(Err(self.gone_error()));
            }
            return None;
        }
    }

    /// A write without waiting, the step the blocking and the async write share: as much of
    /// `buf` (non-empty) posted as credits, granted space, send-queue entries and send-buffer
    /// space allow now, one data WRITE per 64 KiB at most, or why no write can go out; `None`
    /// when nothing can go out yet and the caller must wait (the CQ was polled last).
    pub(super) fn try_write(&mut self, buf: &[u8]) -> Option<io::Result<usize>> {
        loop {
            if let Err(e) = self.write_refusal() {
                return Some(Err(e));
            }
            let mut done = 0;
            while done < buf.len() && self.can_send_data(buf.len() - done) {
                match self.send_data(&buf[done..]) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    // What was posted before the failure is reported; the failure broke the
                    // stream, so the next call returns it.
                    Err(e) => return Some(if done > 0 { Ok(done) } else { Err(e) }),
                }
            }
            if done > 0 {
                return Some(Ok(done));
            }
            self.poll_now();
            if self.can_send_data(buf.len()) || self.fatal.is_some() {
                continue;
            }
            return None;
        }
    }

    /// What became of the sends, once none is waited for any more: an error when any data
    /// WRITE failed, or was still in flight when the stream broke or the peer left.
    pub(super) fn sends_result(&self) -> io::Result<()> {
        if let Some(e) = self.fatal_error() {
            return Err(e);
        }
        if let Some(what) = &self.write_lost {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, what.clone()));
        }
        if self.data_in_flight > 0 {
            let n = self.data_in_flight;
            let e = self.gone_error();
            return Err(io::Error::new(
                e.kind(),
                format!("{e}; {n} data WRITEs had not completed: their bytes may not have reached it"),
            ));
        }
        Ok(())
    }
}

impl Read for Stream {
    /// Reads what has arrived, waiting (up to the read timeout) while nothing has. `Ok(0)` at
    /// the end of the stream: the peer's SHUTDOWN or DISCONNECT after all its data, or this
    /// side's own read shutdown. Data that arrived before the stream broke is read before the
    /// error that broke it.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        // The clock is read only once the call must wait: a read of data already there
        // costs no clock read (a system call on machines without a vDSO clock source).
        let mut until = None;
        loop {
            if let Some(r) = self.try_read(buf) {
                return r;
            }
            let d = *until.get_or_insert_with(|| deadline(self.read_timeout));
            if !self.wait_until(d) {
                return Err(self.timeout_error("read", self.read_timeout));
            }
        }
    }
}

impl Write for Stream {
    /// Copies as much of `buf` into the send buffer as fits now (writes of up to 64 bytes go
    /// inline instead) and RDMA-WRITEs it into the peer's granted space, waiting (up to the
    /// write timeout) while nothing fits: no credits, granted space or free send buffer.
    /// Returns as soon as the WRITEs are posted: [`Write::flush`] waits for them to complete.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut until = None;
        loop {
            if let Some(r) = self.try_write(buf) {
                return r;
            }
            let d = *until.get_or_insert_with(|| deadline(self.write_timeout));
            if !self.wait_until(d) {
                return Err(self.timeout_error("write", self.write_timeout));
            }
        }
    }

    /// Waits until every WRITE posted has completed (the peer's device has the data).
    fn flush(&mut self) -> io::Result<()> {
        let deadline = deadline(self.write_timeout);
        self.drain_sends(deadline)
    }
}

impl Drop for Stream {
    /// Closes as rsocket's `rclose`: a DISCONNECT unless one was sent (or the connection is
    /// gone), its completion awaited briefly, then the QP and the id destroyed. As `rclose`,
    /// it does not wait for the peer's answer to the CM's disconnect (the id's teardown sends
    /// it), so a drop never waits on the peer's reading its events.
    fn drop(&mut self) {
        if !self.disconnect_sent && !self.peer_gone && self.fatal.is_none() {
            self.write_timeout = self.write_timeout.min(CLOSE_TIMEOUT);
            let _ = self.shutdown(Shutdown::Both);
        }
        let _ = self.lane.remove(self.qp);
    }
}
