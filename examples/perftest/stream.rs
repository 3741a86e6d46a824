//! `--bw`: a one-way stream of sends or RDMA WRITEs on the lane, and perftest's bandwidth table.

use std::time::{Duration, Instant};

use rdma_cm::verbs::lane;
use rdma_cm::{AccessFlags, Error, MemoryRegion, ProtectionDomain, RemoteRegion, WorkQueue};

use crate::fast::{LaneConn, Regions};
use crate::protocol::fill_pattern;
use crate::Args;

/// Most bytes the rate mode registers for its work requests in flight: on the lane each holds
/// a region of its own (chunks of one registration; in batches, each batch holds one), so
/// `--tx-depth` is lowered for huge sizes.
const STREAM_BYTES: usize = 64 << 20;

/// Streams `--iters` messages of `size` bytes on the lane: sends, or RDMA WRITEs to `target`;
/// `--tx-depth` in flight, `--post-list` per post (one doorbell per [`lane::MAX_LIST`] work
/// requests: a lane posts lists of at most 16), one signaled per `--cq-mod` (and the last of a
/// list after which no full list fits, so a completion always comes). perftest's usual shape,
/// `--post-list` equal to `--cq-mod`, goes to [`stream_batched`] instead (when the list divides
/// `--tx-depth` and `--iters`). Here each work request in flight has a region of its own:
/// chunks of one registration, all holding the pattern of iteration 0, each in a work request
/// prepared once (checked and lowered: the lane's fastest post, [`lane::PreparedSend`]);
/// message `k` goes in request `k % depth`, whose region the completion that retires it hands
/// back. Prints the bandwidth as perftest does (MB/s = 2^20
/// bytes per second; the peak is the best of ten equal slices of the run).
pub fn stream(
    lc: &mut LaneConn,
    regs: &mut Regions,
    pd: &std::sync::Arc<ProtectionDomain>,
    size: usize,
    target: Option<RemoteRegion>,
    args: &Args,
    t: Duration,
) -> Result<(), Error> {
    let (n, cq_mod) = (args.iters, args.cq_mod);
    // perftest's usual `-l L -Q L`: each post list is one batch, retired by one completion.
    let list = args.post_list;
    if list > 1 && list == cq_mod && args.tx_depth % list == 0 && n % list == 0 {
        return stream_batched(lc, regs, pd, size, target, args, t);
    }
    let depth = args.tx_depth.min((STREAM_BYTES / size).max(1) as u32);
    if depth < args.tx_depth {
        say!(
            "[INFO] --tx-depth {} lowered to {depth}: each one in flight holds {size} bytes of its own",
            args.tx_depth
        );
    }
    let list = args.post_list.min(depth);
    let mut ring = Vec::with_capacity(depth as usize);
    for (k, mr) in stream_regions(pd, size, depth)?.into_iter().enumerate() {
        let wr = match &target {
            Some(r) => lane::SendWr::write(mr, 0..size, r, 0),
            None => lane::SendWr::send(mr, 0..size),
        };
        ring.push(lc.lane.prepare_send(lc.qp, wr.wr_id(k as u64))?);
    }
    const OP: &str = "streaming work requests";
    // Messages `done..posted` are in flight; the requests of `posted..done + depth` (modulo
    // depth) hold their regions: completions come back in order.
    let (mut posted, mut done) = (0u32, 0u32);
    let mut rate = Rate::start(n);
    while done < n {
        loop {
            let room = depth - (posted - done);
            let b = list.min(n - posted).min(room);
            if b == 0 || (b < list && posted + b < n) {
                break;
            }
            let full_after = room - b < list;
            let last = posted + b - 1;
            while posted <= last {
                // One list: at most MAX_LIST requests, and not past the ring's end.
                let at = (posted % depth) as usize;
                let len = (last - posted + 1).min(lane::MAX_LIST as u32).min(depth - at as u32) as usize;
                for (j, p) in ring[at..at + len].iter_mut().enumerate() {
                    let k = posted + j as u32;
                    p.set_signaled(k % cq_mod == cq_mod - 1 || k == n - 1 || (full_after && k == last));
                }
                posted += lc.lane.post_prepared_list(&mut ring[at..at + len])? as u32;
            }
        }
        // Each completion hands its region back; a signaled one first hands back the
        // unsignaled ones it retires, one completion each.
        done += reap_stream(lc, regs, 64, OP, t, |k, mr| match ring.get_mut(k) {
            Some(p) => p.rearm(mr).map_err(Error::from),
            None => Err(Error::InvalidArgument(format!("a completion names no request: {k}"))),
        })?;
        rate.done(done);
    }
    rate.print(size);
    Ok(())
}

/// [`stream`] when each post list is one signaled completion (`--post-list` equal to
/// `--cq-mod`, as in perftest's `-l 8 -Q 8`, and dividing `--tx-depth` and `--iters`): each
/// list is a [`lane::PreparedBatch`] (the lane's fastest post of several requests), its
/// requests all over one region: the sends read the same bytes, the WRITEs write them to the
/// same place, as perftest's do. A batch is posted under one doorbell, however long the list
/// (up to the send queue's depth, where [`stream`] rings one per 16), and retired by its last
/// request, the signaled one, whose completion hands the region back. `--tx-depth / --post-list`
/// batches take turns, so a stream of 4 KiB messages reads 64 KiB of buffers where a region per
/// request reads 512 KiB; beside `ib_send_bw` that was worth about 2 % of the message rate at
/// 4 KiB in the guest (BENCHMARKS.md).
pub fn stream_batched(
    lc: &mut LaneConn,
    regs: &mut Regions,
    pd: &std::sync::Arc<ProtectionDomain>,
    size: usize,
    target: Option<RemoteRegion>,
    args: &Args,
    t: Duration,
) -> Result<(), Error> {
    let (n, list) = (args.iters, args.post_list);
    let turns = (args.tx_depth / list).min((STREAM_BYTES / size).max(1) as u32);
    let depth = turns * list;
    if depth < args.tx_depth {
        say!(
            "[INFO] --tx-depth {} lowered to {depth}: each batch in flight holds {size} bytes of its own",
            args.tx_depth
        );
    }
    say!("[INFO] Streaming in batches of {list} work requests (one region, one doorbell and one completion each)");
    let mut ring = Vec::with_capacity(turns as usize);
    for (k, mr) in stream_regions(pd, size, turns)?.into_iter().enumerate() {
        let mut batch = lc.lane.prepare_batch(lc.qp, mr, list as usize, |_, mr| match &target {
            Some(r) => lane::SendWr::write(mr, 0..size, r, 0),
            None => lane::SendWr::send(mr, 0..size),
        })?;
        batch.set_wr_id(k as u64);
        ring.push(batch);
    }
    const OP: &str = "streaming batches of work requests";
    // Messages `done..posted` are in flight, in batches `done / list..posted / list` (modulo
    // `turns`); the others hold their regions. A queue completes in order.
    let (mut posted, mut done) = (0u32, 0u32);
    let mut rate = Rate::start(n);
    while done < n {
        while posted < n && posted - done < depth {
            lc.lane.post_batch(&mut ring[(posted / list % turns) as usize])?;
            posted += list;
        }
        done += list
            * reap_stream(lc, regs, 16, OP, t, |k, mr| match ring.get_mut(k) {
                Some(b) => b.rearm(mr).map_err(Error::from),
                None => Err(Error::InvalidArgument(format!("a completion names no batch: {k}"))),
            })?;
        rate.done(done);
    }
    rate.print(size);
    Ok(())
}

/// `count` regions of `size` bytes for a stream (chunks of one registration), each holding the
/// pattern of iteration 0.
fn stream_regions(pd: &std::sync::Arc<ProtectionDomain>, size: usize, count: u32) -> Result<Vec<MemoryRegion>, Error> {
    let mut whole = MemoryRegion::new(pd, size * count as usize, AccessFlags::LOCAL_WRITE)?;
    for chunk in whole.as_mut_slice()?.chunks_mut(size) {
        fill_pattern(chunk, 0);
    }
    whole.split(size)
}

/// One poll of a stream (up to `max` completions, [`LaneConn::reap_once`]): each completion
/// of a stream's request hands its region to `rearm` with its `wr_id`; the server's answer to a
/// send stream, when it comes early, goes back to `regs`. Returns how many `wr_id`s were
/// re-armed (requests, or batches).
#[inline(always)]
fn reap_stream(
    lc: &mut LaneConn,
    regs: &mut Regions,
    max: usize,
    op: &'static str,
    t: Duration,
    mut rearm: impl FnMut(usize, MemoryRegion) -> Result<(), Error>,
) -> Result<u32, Error> {
    let mut back = 0u32;
    lc.reap_once(max, op, t, |c, mr| {
        if c.queue() == WorkQueue::Recv {
            regs.put_back(&c, Some(mr));
            return Ok(());
        }
        rearm(c.wr_id() as usize, mr)?;
        back += 1;
        Ok(())
    })?;
    Ok(back)
}

/// A stream's message rate, measured as perftest measures it: from the first post to the
/// last completion, with the peak the best of ten equal slices of the run.
struct Rate {
    n: u32,
    slice: u32,
    start: Instant,
    mark: (Instant, u32),
    peak: f64,
}

impl Rate {
    fn start(n: u32) -> Rate {
        let start = Instant::now();
        Rate { n, slice: (n / 10).max(1), start, mark: (start, 0), peak: 0.0 }
    }

    /// `done` messages have completed.
    fn done(&mut self, done: u32) {
        if done - self.mark.1 >= self.slice {
            let now = Instant::now();
            self.peak = self.peak.max((done - self.mark.1) as f64 / (now - self.mark.0).as_secs_f64());
            self.mark = (now, done);
        }
    }

    /// Prints the bandwidth as perftest does (MB/s = 2^20 bytes per second).
    fn print(&self, size: usize) {
        let n = self.n;
        let rate = n as f64 / self.start.elapsed().as_secs_f64();
        let mib = |msgs: f64| msgs * size as f64 / (1 << 20) as f64;
        println!("---------------------------------------------------------------------------------------");
        println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]");
        println!(
            " {size:<10} {n:<10}       {:<7.2}            {:<7.2}              {:.6}",
            mib(self.peak.max(rate)),
            mib(rate),
            rate / 1e6
        );
        println!("---------------------------------------------------------------------------------------");
    }
}
