//! Checks this machine for RDMA: devices, ports, GID table, usable addresses, the memlock limit
//! and the device files, and prints a verdict with the fix for each problem.
//!
//! ```text
//! cargo run --example doctor                      # this machine (even without RDMA)
//! cargo run --example doctor -- --size 1073741824 # check the memlock limit for 1 GiB
//! RDMA_CM_VM=always cargo run --example doctor    # inside the project's Soft-RoCE guest
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
}

fn main() {
    let args = Args::parse();
    let report = rdma_cm::diagnostics::diagnose(args.size);
    println!("{report}");
    std::process::exit(if report.healthy() { 0 } else { 1 });
}
