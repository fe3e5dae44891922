//! What the benchmark ran on, recorded with every result: a figure means little without it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
}

impl Machine {
    /// Reads the machine description from the OS. Never fails: whatever cannot be read is
    /// recorded as 0 or "unknown", because a missing detail must not cost a benchmark run.
    pub fn detect() -> Machine {
        // available_parallelism honours affinity masks and cgroup quotas, which is what
        // bounds a benchmark's threads, unlike the raw processor count.
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0);
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| parse_meminfo_total_bytes(&text))
            .unwrap_or(0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|text| text.trim().to_string())
            .filter(|release| !release.is_empty())
            .unwrap_or_else(|| "unknown".to_string());
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|text| parse_cpu_model(&text));
        Machine {
            cores,
            memory_bytes,
            kernel,
            cpu_model,
        }
    }
}

/// `MemTotal:  16318412 kB` from /proc/meminfo, in bytes.
fn parse_meminfo_total_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let amount: u64 = words.next()?.parse().ok()?;
    // The kernel always writes kB (KiB); anything else means a format we do not know.
    match words.next() {
        Some("kB") => amount.checked_mul(1024),
        _ => None,
    }
}

/// The first `model name : ...` of /proc/cpuinfo (x86); other architectures may lack it.
fn parse_cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(key, _)| key.trim() == "model name")
        .map(|(_, value)| value.trim().to_string())
        .filter(|model| !model.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let text = "MemTotal:        8148260 kB\nMemFree:         1234 kB\n";
        assert_eq!(parse_meminfo_total_bytes(text), Some(8148260 * 1024));
        assert_eq!(parse_meminfo_total_bytes("MemFree: 1 kB\n"), None);
        assert_eq!(parse_meminfo_total_bytes("MemTotal: lots\n"), None);
        assert_eq!(parse_meminfo_total_bytes("MemTotal: 5 MB\n"), None);
    }

    #[test]
    fn cpu_model_is_the_first_model_name() {
        let text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 85\n\
                    model name\t: Intel(R) Xeon(R) CPU @ 2.00GHz\nprocessor\t: 1\n\
                    model name\t: other\n";
        assert_eq!(
            parse_cpu_model(text).as_deref(),
            Some("Intel(R) Xeon(R) CPU @ 2.00GHz")
        );
        assert_eq!(parse_cpu_model("processor : 0\n"), None);
    }

    #[test]
    fn detect_never_panics_and_fills_the_kernel() {
        let machine = Machine::detect();
        assert!(!machine.kernel.is_empty());
    }
}
