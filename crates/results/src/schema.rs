//! The JSON result schema shared by every benchmark (DESIGN.md, "Benchmarks and results").
//! One schema means one plotting module and one report for all benches.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::machine::Machine;

/// One benchmark run: `{bench}.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    pub bench: String,
    pub version: String,
    /// RFC 3339, UTC.
    pub started: String,
    pub machine: Machine,
    /// Every parameter that shaped the run, as a JSON object; `config["x"]` names the x axis.
    /// A comparison records each side in `config["sides"]` (label → process, server
    /// threads, version, flags, client, data model), which the report prints.
    pub config: serde_json::Value,
    pub series: Vec<Series>,
    /// Horizontal lines a figure draws beside the series: a peer's figure measured in the
    /// same run, or a machine limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<Reference>,
    /// Camelot against a peer, figure by figure, with the target ratio where there is one:
    /// the table `bench all` prints and the report shows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comparisons: Vec<Comparison>,
}

impl BenchResult {
    /// A result stamped with this crate's version and the machine it runs on.
    pub fn new(
        bench: &str,
        started: String,
        config: serde_json::Value,
        series: Vec<Series>,
    ) -> BenchResult {
        BenchResult {
            bench: bench.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            started,
            machine: Machine::detect(),
            config,
            series,
            references: Vec::new(),
            comparisons: Vec::new(),
        }
    }
}

/// A constant a figure draws as a labelled horizontal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reference {
    pub label: String,
    /// Which panel it belongs to: `ops_per_sec`, `bytes_per_sec`, or a latency
    /// percentile as `latency_us.p50` (`p90`, `p99`, `p999`, `max`).
    pub metric: String,
    pub value: f64,
}

/// One figure of Camelot set against the same figure of a peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// What is compared (`YCSB A throughput, 1 server thread`).
    pub name: String,
    pub camelot: f64,
    pub peer: f64,
    /// Unit of both figures (`ops/s`, `B/s`, `µs`, `ops/CPU-s`).
    pub unit: String,
    /// Which peer (`redis-server 7.0.15`, `iperf3`).
    pub peer_label: String,
    /// `camelot / peer`.
    pub ratio: f64,
    /// The ratio the issue asks for, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<f64>,
    /// The target is a ceiling (latency), not a floor.
    #[serde(default)]
    pub at_most: bool,
}

impl Comparison {
    pub fn new(
        name: impl Into<String>,
        camelot: f64,
        peer: f64,
        unit: impl Into<String>,
        peer_label: impl Into<String>,
    ) -> Comparison {
        Comparison {
            name: name.into(),
            camelot,
            peer,
            unit: unit.into(),
            peer_label: peer_label.into(),
            ratio: if peer != 0.0 {
                camelot / peer
            } else {
                f64::NAN
            },
            target: None,
            at_most: false,
        }
    }

    /// The ratio must be at least `target` (`at_most`: at most).
    pub fn with_target(mut self, target: f64, at_most: bool) -> Comparison {
        self.target = Some(target);
        self.at_most = at_most;
        self
    }

    /// Whether the target is met; `None` without a target or with no ratio.
    pub fn met(&self) -> Option<bool> {
        let target = self.target?;
        if !self.ratio.is_finite() {
            return None;
        }
        Some(if self.at_most {
            self.ratio <= target
        } else {
            self.ratio >= target
        })
    }
}

/// One line of a figure: the same experiment at several values of x.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub label: String,
    pub points: Vec<Point>,
}

impl Series {
    pub fn new(label: impl Into<String>) -> Series {
        Series {
            label: label.into(),
            points: Vec::new(),
        }
    }
}

/// One measurement. Figures that do not apply stay `None` and are left out of the JSON,
/// never faked as zero.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub x: X,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops_per_sec: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_sec: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_us: Option<LatencySummary>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Point {
    pub fn new(x: impl Into<X>) -> Point {
        Point {
            x: x.into(),
            ops_per_sec: None,
            bytes_per_sec: None,
            latency_us: None,
            extra: BTreeMap::new(),
        }
    }
}

/// The x value of a point: a number (threads, bytes...) or a label (a mode, a peer...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum X {
    Num(f64),
    Label(String),
}

impl X {
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            X::Num(v) => Some(*v),
            X::Label(_) => None,
        }
    }
}

impl From<f64> for X {
    fn from(v: f64) -> X {
        X::Num(v)
    }
}

impl From<u64> for X {
    fn from(v: u64) -> X {
        // Exact up to 2^53, far beyond any thread count or size a benchmark sweeps.
        X::Num(v as f64)
    }
}

impl From<usize> for X {
    fn from(v: usize) -> X {
        X::Num(v as f64)
    }
}

impl From<u32> for X {
    fn from(v: u32) -> X {
        X::Num(f64::from(v))
    }
}

impl From<&str> for X {
    fn from(v: &str) -> X {
        X::Label(v.to_string())
    }
}

impl From<String> for X {
    fn from(v: String) -> X {
        X::Label(v)
    }
}

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

/// The current UTC time in RFC 3339, for `BenchResult::started`.
pub fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    // Formatting fails only for years outside 0..=9999; a clock that wrong still deserves
    // a timestamp rather than a failed run.
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| format!("@{}", now.unix_timestamp()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn finite() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>().prop_filter("finite", |v| v.is_finite()),
            (0u32..1_000_000).prop_map(f64::from),
        ]
    }

    fn x_value() -> impl Strategy<Value = X> {
        prop_oneof![finite().prop_map(X::Num), ".{0,12}".prop_map(X::Label)]
    }

    fn latency() -> impl Strategy<Value = LatencySummary> {
        (finite(), finite(), finite(), finite(), finite()).prop_map(|(p50, p90, p99, p999, max)| {
            LatencySummary {
                p50,
                p90,
                p99,
                p999,
                max,
            }
        })
    }

    fn json_leaf() -> impl Strategy<Value = serde_json::Value> {
        prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            finite().prop_map(serde_json::Value::from),
            ".{0,8}".prop_map(serde_json::Value::from),
        ]
    }

    fn point() -> impl Strategy<Value = Point> {
        (
            x_value(),
            proptest::option::of(finite()),
            proptest::option::of(finite()),
            proptest::option::of(latency()),
            proptest::collection::btree_map(".{0,6}", json_leaf(), 0..4),
        )
            .prop_map(|(x, ops_per_sec, bytes_per_sec, latency_us, extra)| Point {
                x,
                ops_per_sec,
                bytes_per_sec,
                latency_us,
                extra,
            })
    }

    proptest! {
        #[test]
        fn point_json_round_trips(p in point()) {
            let text = serde_json::to_string(&p).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back: Point = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back, p);
        }

        #[test]
        fn result_json_round_trips(points in proptest::collection::vec(point(), 0..5)) {
            let mut series = Series::new("s");
            series.points = points;
            let result = BenchResult::new(
                "prop",
                now_rfc3339(),
                serde_json::json!({"x": "threads", "n": 3}),
                vec![series],
            );
            let text = serde_json::to_string_pretty(&result).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back: BenchResult = serde_json::from_str(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back, result);
        }
    }

    #[test]
    fn none_fields_are_left_out() -> Result<(), serde_json::Error> {
        let value = serde_json::to_value(Point::new(4u32))?;
        assert_eq!(value, serde_json::json!({"x": 4.0}));
        let text = serde_json::to_string(&Point::new("mode"))?;
        assert_eq!(text, r#"{"x":"mode"}"#);
        Ok(())
    }

    #[test]
    fn integer_and_label_x_are_read_back() -> Result<(), serde_json::Error> {
        let p: Point = serde_json::from_str(r#"{"x": 1, "ops_per_sec": 2}"#)?;
        assert_eq!(p.x, X::Num(1.0));
        assert_eq!(p.x.as_f64(), Some(1.0));
        assert_eq!(p.ops_per_sec, Some(2.0));
        let p: Point = serde_json::from_str(r#"{"x": "12"}"#)?;
        assert_eq!(p.x, X::Label("12".to_string()));
        assert_eq!(p.x.as_f64(), None);
        Ok(())
    }

    #[test]
    fn design_example_parses() -> Result<(), serde_json::Error> {
        let text = r#"{"bench": "threads", "version": "0.1.0", "started": "2024-01-01T00:00:00Z",
           "machine": {"cores": 2, "memory_bytes": 0, "kernel": "6.1"},
           "config": {"x": "threads"},
           "series": [{"label": "batched", "points": [{"x": 1, "ops_per_sec": 0.0,
              "bytes_per_sec": 0.0,
              "latency_us": {"p50": 0, "p90": 0, "p99": 0, "p999": 0, "max": 0},
              "extra": {}}]}]}"#;
        let r: BenchResult = serde_json::from_str(text)?;
        assert_eq!(
            r.series[0].points[0].latency_us.as_ref().map(|l| l.max),
            Some(0.0)
        );
        assert_eq!(r.machine.cpu_model, None);
        Ok(())
    }

    #[test]
    fn now_is_rfc3339_utc() {
        let now = now_rfc3339();
        // e.g. 2024-05-01T12:34:56.789012345Z
        let bytes = now.as_bytes();
        assert!(now.len() >= 20, "{now}");
        assert_eq!(
            (bytes[4], bytes[7], bytes[10], bytes[13], bytes[16]),
            (b'-', b'-', b'T', b':', b':'),
            "{now}"
        );
        assert!(now.ends_with('Z'), "{now}");
    }
}
