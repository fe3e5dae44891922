//! Human-friendly sizes on the command line: `64M`, `1.5GiB`, `4096`.

/// Parses a byte count. Suffixes K/M/G/T (with optional `i`/`iB`/`B`) are powers of 1024,
/// as a memory size means on every tool users compare us with (free, top, redis).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if t.starts_with('-') {
        return Err(format!(
            "'{s}' is negative: a size is at least 0 (try 512M, 2G)"
        ));
    }
    if num.is_empty() {
        return Err(format!("'{s}' is not a size (try 4096, 64K, 512M, 2G)"));
    }
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "ki" | "kib" => 10,
        "m" | "mb" | "mi" | "mib" => 20,
        "g" | "gb" | "gi" | "gib" => 30,
        "t" | "tb" | "ti" | "tib" => 40,
        other => {
            return Err(format!(
                "unknown size suffix '{other}' in '{s}' (use K, M, G or T)"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (try 4096, 64K, 512M, 2G)"))?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("size '{s}' is too large"));
    }
    Ok(bytes.round() as u64)
}

/// This machine's RAM (`MemTotal` in /proc/meminfo), when it can be read.
pub fn physical_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// Formats a byte count the way [`parse_bytes`] reads it back.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_usual_spellings() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("G").is_err());
        assert!(parse_bytes("99999999999T").is_err());
        let negative = parse_bytes("-5G").unwrap_err();
        assert!(negative.contains("negative"), "{negative}");
    }

    #[test]
    fn mem_total_is_read_from_meminfo() {
        let text = "MemTotal:       24000000 kB\nMemFree:        1000 kB\n";
        assert_eq!(parse_mem_total(text), Some(24_000_000 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: lots kB\n"), None);
    }

    proptest! {
        #[test]
        fn never_panics(s in ".{0,20}") {
            let _ = parse_bytes(&s);
        }

        #[test]
        fn whole_units_round_trip(n in 0u64..1024, shift in prop::sample::select(vec![0u32, 10, 20, 30])) {
            let bytes = n << shift;
            prop_assert_eq!(parse_bytes(&bytes.to_string()), Ok(bytes));
        }
    }
}
