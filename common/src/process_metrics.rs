//! The standard `process_*` metrics (the names Prometheus' own client libraries export), read
//! from /proc at each scrape: CPU time, resident and virtual memory, open and maximum file
//! descriptors, threads and start time.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// One reading of this process.
#[derive(Debug, Default, PartialEq)]
struct Reading {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    start_time_seconds: f64,
    open_fds: i64,
    max_fds: i64,
}

#[derive(Debug)]
pub struct ProcessCollector {
    /// Clock ticks per second and bytes per page, as the kernel counts them in /proc.
    ticks: f64,
    page: i64,
    /// When the machine booted, in seconds since the epoch (process start times count from it).
    boot_time: f64,
}

impl ProcessCollector {
    pub fn new() -> ProcessCollector {
        #[allow(unsafe_code)] // sysconf(3): std has no safe wrapper
        // SAFETY: sysconf only reads configuration values.
        let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let boot_time = std::fs::read_to_string("/proc/stat").ok().and_then(|stat| boot_time(&stat)).unwrap_or(0.0);
        ProcessCollector { ticks: ticks.max(1) as f64, page: page.max(1), boot_time }
    }

    fn read(&self) -> Reading {
        let mut reading = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| parse_stat(&stat, self.ticks, self.page, self.boot_time))
            .unwrap_or_default();
        reading.open_fds = std::fs::read_dir("/proc/self/fd").map(|dir| dir.count() as i64).unwrap_or(0);
        reading.max_fds = max_fds();
        reading
    }
}

impl Default for ProcessCollector {
    fn default() -> Self {
        ProcessCollector::new()
    }
}

/// The soft limit on open file descriptors (RLIMIT_NOFILE).
#[allow(unsafe_code)] // getrlimit(2): std has no safe wrapper
fn max_fds() -> i64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only into `limit`, which lives for the call.
    match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
        0 => i64::try_from(limit.rlim_cur).unwrap_or(i64::MAX),
        _ => 0,
    }
}

/// `btime` of /proc/stat: the boot time in seconds since the epoch.
fn boot_time(stat: &str) -> Option<f64> {
    stat.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

/// The fields of /proc/self/stat this collector exports (see proc(5)). The command name, field
/// 2, may hold spaces and parentheses: fields are counted from the last ')'.
fn parse_stat(stat: &str, ticks: f64, page: i64, boot_time: f64) -> Option<Reading> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is the first here.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
    Some(Reading {
        cpu_seconds: (field(14)? + field(15)?) / ticks,
        threads: field(20)? as i64,
        start_time_seconds: boot_time + field(22)? / ticks,
        virtual_bytes: field(23)? as i64,
        resident_bytes: field(24)? as i64 * page,
        ..Reading::default()
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let reading = self.read();
        let cpu = ConstCounter::new(reading.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            ("process_resident_memory_bytes", "Resident memory size in bytes", reading.resident_bytes as f64),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes", reading.virtual_bytes as f64),
            ("process_open_fds", "Open file descriptors", reading.open_fds as f64),
            ("process_max_fds", "The limit on open file descriptors (RLIMIT_NOFILE)", reading.max_fds as f64),
            ("process_threads", "Threads of the process", reading.threads as f64),
            (
                "process_start_time_seconds",
                "When the process started, in seconds since the Unix epoch",
                reading.start_time_seconds,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_name() {
        // A command name with spaces and a ')' must not shift the fields.
        let stat = "4242 (tern (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 7 0 \
                    12345 1048576 300 18446744073709551615";
        let mut reading = parse_stat(stat, 100.0, 4096, 1_000.0).unwrap();
        assert!((reading.start_time_seconds - 1_123.45).abs() < 1e-9, "{reading:?}");
        reading.start_time_seconds = 0.0;
        assert_eq!(
            reading,
            Reading {
                cpu_seconds: 3.0,
                threads: 7,
                virtual_bytes: 1_048_576,
                resident_bytes: 300 * 4096,
                ..Reading::default()
            }
        );
        assert_eq!(boot_time("cpu 1 2 3\nbtime 1700000000\nprocesses 5\n"), Some(1_700_000_000.0));
    }

    #[test]
    fn this_process_reads_sensibly() {
        let reading = ProcessCollector::new().read();
        assert!(reading.resident_bytes > 0 && reading.virtual_bytes >= reading.resident_bytes, "{reading:?}");
        assert!(reading.open_fds > 0 && reading.max_fds >= reading.open_fds, "{reading:?}");
        assert!(reading.threads >= 1, "{reading:?}");
        let now = crate::unix_ms() as f64 / 1000.0;
        assert!(reading.start_time_seconds > now - 3600.0 && reading.start_time_seconds <= now + 1.0, "{reading:?}");
    }
}
