//! A result's comparisons as a plain-text table, for the console (`bench all` prints one
//! per bench) and for BENCHMARKS.md.

use std::fmt::Write as _;

use crate::report::format_number;
use crate::schema::{BenchResult, Comparison};

/// `name | camelot | peer | ratio | target | met`, one row per comparison, aligned; empty
/// when the result has none.
pub fn comparison_table(result: &BenchResult) -> String {
    if result.comparisons.is_empty() {
        return String::new();
    }
    let header = ["check", "camelot", "peer", "ratio", "target", "met"].map(String::from);
    let rows: Vec<[String; 6]> = result.comparisons.iter().map(row).collect();
    let mut widths = header.clone().map(|h| h.chars().count());
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for line in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = line
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join(" | ").trim_end());
    }
    out
}

fn row(c: &Comparison) -> [String; 6] {
    let target = c
        .target
        .map(|t| format!("{} {}", if c.at_most { "≤" } else { "≥" }, format_number(t)))
        .unwrap_or_else(|| "—".into());
    let met = match c.met() {
        Some(true) => "yes",
        Some(false) => "no",
        None => "—",
    };
    [
        c.name.clone(),
        format!("{} {}", format_number(c.camelot), c.unit),
        format!("{} {} ({})", format_number(c.peer), c.unit, c.peer_label),
        if c.ratio.is_finite() {
            format!("{:.2}", c.ratio)
        } else {
            "—".into()
        },
        target,
        met.into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_show_ratio_target_and_verdict() {
        let mut r = BenchResult::new("x", "t".into(), serde_json::json!({}), Vec::new());
        assert_eq!(comparison_table(&r), "");
        r.comparisons.push(
            Comparison::new("GET -P16", 150.0, 100.0, "ops/s", "redis-server")
                .with_target(1.0, false),
        );
        r.comparisons.push(
            Comparison::new("p99", 300.0, 200.0, "µs", "redis-server").with_target(1.0, true),
        );
        r.comparisons
            .push(Comparison::new("no peer", 1.0, 0.0, "ops/s", "nobody"));
        let table = comparison_table(&r);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(
            lines[1].contains("1.50") && lines[1].ends_with("yes"),
            "{table}"
        );
        assert!(
            lines[2].contains("≤ 1") && lines[2].ends_with("no"),
            "{table}"
        );
        assert!(lines[3].ends_with("—"), "{table}");
    }
}
