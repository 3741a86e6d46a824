//! Checks this machine for RDMA: devices, ports, GID table, usable addresses, the memlock limit
//! and the device files, and prints a verdict with the fix for each problem.
//!
//! ```text
//! cargo run --example doctor                      # this machine (even without RDMA)
//! cargo run --example doctor -- --size 1073741824 # check the memlock limit for 1 GiB
//! RDMA_CM_VM=always cargo run --example doctor    # inside the project's Soft-RoCE guest
//! cargo run --example doctor -- --watch 60        # then print every device's async events
//!                                                 # (port down/up, GID changes, errors) for 60 s,
//!                                                 # like rdma-core's ibv_asyncwatch
//! ```
//!
//! Exit status: 0 when healthy, 1 when something blocks RDMA.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "diagnose RDMA on this machine")]
struct Args {
    /// Bytes you intend to register (checked against `ulimit -l`).
    #[arg(long, default_value_t = 1 << 20)]
    size: u64,
    /// After the report, print the devices' asynchronous events for this many seconds.
    #[arg(long, default_value_t = 0)]
    watch: u64,
}

/// Prints every device's asynchronous events until `secs` have passed.
fn watch(secs: u64) -> rdma_cm::Result<()> {
    use std::time::{Duration, Instant};
    let mut sources = vec![];
    for d in rdma_cm::devices()? {
        let ctx = rdma_cm::VerbsContext::open(&d.name)?;
        sources.push((d.name, ctx.async_events()?));
    }
    if sources.is_empty() {
        println!("no device to watch");
        return Ok(());
    }
    let names: Vec<&str> = sources.iter().map(|(n, _)| n.as_str()).collect();
    println!("watching {} for async events ({secs} s)", names.join(", "));
    let end = Instant::now() + Duration::from_secs(secs);
    let mut fds: Vec<libc::pollfd> = sources
        .iter()
        .map(|(_, s)| libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(s), events: libc::POLLIN, revents: 0 })
        .collect();
    loop {
        for (name, s) in &mut sources {
            while let Some(ev) = s.try_next()? {
                println!("{name}: {ev}");
            }
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        // SAFETY: `fds` is a valid array of pollfds for the sources, which outlive the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, left.as_millis().max(1) as i32) };
    }
}

fn main() {
    let args = Args::parse();
    let report = rdma_cm::verbs::diagnostics::diagnose(args.size);
    println!("{report}");
    if args.watch > 0 {
        if let Err(e) = watch(args.watch) {
            eprintln!("watching async events: {e}");
            std::process::exit(1);
        }
    }
    std::process::exit(if report.healthy() { 0 } else { 1 });
}
