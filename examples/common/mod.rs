//! Helpers several examples share: the one-line error exit, host names, rdma-core's number
//! syntax, and perftest's clock and latency table.
#![allow(dead_code)] // each example uses part of this module

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Default port, as in rdma-core's rdma_server/rdma_client.
pub const DEFAULT_PORT: u16 = 7471;

/// Resolves `host` (an IP address or a host name) to an IPv4 socket address with `port`.
pub fn resolve_host(host: &str, port: u16) -> Result<SocketAddr, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    // rdma_getaddrinfo, as rdma-core's examples resolve names.
    let addrs = rdma_cm::lookup(host, &port.to_string())
        .map_err(|e| format!("{e} (give an IPv4 address, or a name in /etc/hosts or DNS)"))?;
    addrs.iter().find(|a| a.is_ipv4()).or(addrs.first()).copied().ok_or_else(|| format!("host '{host}' has no address"))
}

/// Prints `error: …` on stderr and exits 1.
pub fn fail(context: &str, e: impl fmt::Display) -> ! {
    eprintln!("error: {context}: {e}");
    std::process::exit(1)
}

/// A number as rdma-core's tools read their flags (`strtoul(s, NULL, 0)`): decimal, `0x` hex
/// or `0` octal.
pub fn c_number(s: &str) -> Option<u64> {
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if s.len() > 1 && s.starts_with('0') {
        u64::from_str_radix(&s[1..], 8).ok()
    } else {
        s.parse().ok()
    }
}

pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Timestamps for the latency loops, taken as perftest takes them (`get_cycles`): the cycle
/// counter on x86_64, which costs no system call. `Instant::now` is a system call where the
/// kernel has no fast vDSO clock: 0.8 µs in the project's QEMU guest (clock source HPET), two
/// of them per round trip, which perftest does not pay. Elsewhere, `Instant`.
pub struct Stopwatch {
    #[cfg(target_arch = "x86_64")]
    ns_per_tick: f64,
    #[cfg(not(target_arch = "x86_64"))]
    origin: std::time::Instant,
}

impl Stopwatch {
    /// Calibrates the counter against the monotonic clock over about 20 ms.
    pub fn calibrate() -> Stopwatch {
        #[cfg(target_arch = "x86_64")]
        {
            let (t0, c0) = (std::time::Instant::now(), Self::ticks());
            while t0.elapsed() < Duration::from_millis(20) {
                std::hint::spin_loop();
            }
            let (dt, dc) = (t0.elapsed(), Self::ticks().wrapping_sub(c0));
            Stopwatch { ns_per_tick: dt.as_nanos() as f64 / dc.max(1) as f64 }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Stopwatch { origin: std::time::Instant::now() }
    }

    #[cfg(target_arch = "x86_64")]
    fn ticks() -> u64 {
        // SAFETY: RDTSC has no preconditions and exists on every x86_64 CPU; it reads a
        // counter and touches no memory.
        unsafe { std::arch::x86_64::_rdtsc() }
    }

    /// A timestamp, for [`Stopwatch::since`].
    #[inline]
    pub fn now(&self) -> u64 {
        #[cfg(target_arch = "x86_64")]
        return Self::ticks();
        #[cfg(not(target_arch = "x86_64"))]
        return self.origin.elapsed().as_nanos() as u64;
    }

    /// The time from `start` (a [`Stopwatch::now`]) to now.
    #[inline]
    pub fn since(&self, start: u64) -> Duration {
        let d = self.now().wrapping_sub(start);
        #[cfg(target_arch = "x86_64")]
        return Duration::from_nanos((d as f64 * self.ns_per_tick) as u64);
        #[cfg(not(target_arch = "x86_64"))]
        return Duration::from_nanos(d);
    }
}

/// Prints a latency table in perftest's format (half round trip, as ib_send_lat reports).
pub fn print_latency_table(size: u32, rtts: &mut [Duration]) {
    let mut us: Vec<f64> = rtts.iter().map(|d| micros(*d) / 2.0).collect();
    us.sort_by(|a, b| a.total_cmp(b));
    let n = us.len();
    let avg = us.iter().sum::<f64>() / n as f64;
    let var = us.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
    let pct = |p: f64| us[(((n as f64) * p).ceil() as usize).clamp(1, n) - 1];
    println!("---------------------------------------------------------------------------------------");
    println!(" latency = round trip / 2, as ib_send_lat reports it");
    println!(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ");
    println!(
        " {:<6} {:<10}       {:<7.2}        {:<7.2}      {:<7.2}          {:<7.2}        {:<7.2}          {:<7.2}                 {:<7.2}",
        size,
        n,
        us[0],
        us[n - 1],
        us[n / 2],
        avg,
        var.sqrt(),
        pct(0.99),
        pct(0.999)
    );
    println!("---------------------------------------------------------------------------------------");
}
