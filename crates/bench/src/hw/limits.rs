//! The machine's limits, distilled from `bench hw` results into one small file
//! (`bench hw … --save FILE`, and `limits.json` in `bench all`'s directory), so every other
//! bench can state its figures as a fraction of what this machine allows.

use crate::BenchError;
use camelot_results::output;
use camelot_results::schema::{BenchResult, Point};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where benches look for limits when not told: next to their own results, i.e.
/// `results/limits.json` with the default `--out` (`bench hw all --save` writes it there).
pub const LIMITS_FILE_NAME: &str = "limits.json";
/// Where commands without an `--out` (the demo) look for limits.
pub const DEFAULT_RESULTS_DIR: &str = "results";

/// Best figures seen for each limit. Absent when the bench behind it was not run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tcp_stream_bytes_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tcp_pingpong_us_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mem_seq_read_bytes_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub mem_seq_write_bytes_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disk_seq_write_bytes_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub disk_seq_read_bytes_per_sec: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub gflops: Option<f64>,
}

fn best(values: impl Iterator<Item = f64>, lowest: bool) -> Option<f64> {
    values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold(None, |acc, v| {
            Some(match acc {
                None => v,
                Some(a) if lowest => f64::min(a, v),
                Some(a) => f64::max(a, v),
            })
        })
}

fn points<'a>(r: &'a BenchResult, prefix: &'a str) -> impl Iterator<Item = &'a Point> + 'a {
    r.series
        .iter()
        .filter(move |s| s.label.starts_with(prefix))
        .flat_map(|s| s.points.iter())
}

impl Limits {
    /// Folds one result in: throughputs take the best seen, latencies the lowest.
    pub fn absorb(&mut self, r: &BenchResult) {
        let bw = |prefix: &str| best(points(r, prefix).filter_map(|p| p.bytes_per_sec), false);
        let merge_max =
            |old: Option<f64>, new: Option<f64>| best(old.into_iter().chain(new), false);
        match r.bench.as_str() {
            "net" => {
                self.tcp_stream_bytes_per_sec =
                    merge_max(self.tcp_stream_bytes_per_sec, bw("tcp ×"));
                let p50 = best(
                    points(r, "tcp ping-pong").filter_map(|p| p.latency_us.as_ref().map(|l| l.p50)),
                    true,
                );
                self.tcp_pingpong_us_p50 =
                    best(self.tcp_pingpong_us_p50.into_iter().chain(p50), true);
            }
            "mem" => {
                self.mem_seq_read_bytes_per_sec =
                    merge_max(self.mem_seq_read_bytes_per_sec, bw("seq read"));
                self.mem_seq_write_bytes_per_sec =
                    merge_max(self.mem_seq_write_bytes_per_sec, bw("seq write"));
            }
            "disk" => {
                self.disk_seq_write_bytes_per_sec =
                    merge_max(self.disk_seq_write_bytes_per_sec, bw("seq write ×"));
                self.disk_seq_read_bytes_per_sec =
                    merge_max(self.disk_seq_read_bytes_per_sec, bw("seq read"));
            }
            "cpu" => {
                let g = best(
                    points(r, "gflops")
                        .filter_map(|p| p.extra.get("gflops").and_then(|v| v.as_f64())),
                    false,
                );
                self.gflops = merge_max(self.gflops, g);
            }
            _ => {}
        }
    }

    /// Limits from every `bench hw` result in `dir` (others are ignored).
    pub fn from_results(dir: &Path) -> Result<Limits, BenchError> {
        let mut l = Limits::default();
        for bench in ["cpu", "mem", "net", "disk"] {
            let path = dir.join(format!("{bench}.json"));
            if path.exists() {
                l.absorb(&output::read_result(&path)?);
            }
        }
        Ok(l)
    }

    pub fn save(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| BenchError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::write(path, text).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn load(path: &Path) -> Result<Limits, BenchError> {
        let text = std::fs::read(path).map_err(|source| BenchError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(serde_json::from_slice(&text)?)
    }

    /// `explicit` if given (it must exist), else `out/limits.json` if there is one.
    pub fn find(
        explicit: Option<&Path>,
        out: &Path,
    ) -> Result<Option<(Limits, PathBuf)>, BenchError> {
        match explicit {
            Some(p) => Ok(Some((Limits::load(p)?, p.to_path_buf()))),
            None => {
                let p = out.join(LIMITS_FILE_NAME);
                if p.exists() {
                    Ok(Some((Limits::load(&p)?, p)))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// The measured limit a figure is read against, if it was measured.
    pub fn limit(&self, against: Against) -> Option<f64> {
        match against {
            Against::TcpStream => self.tcp_stream_bytes_per_sec,
            Against::TcpPingpongP50 => self.tcp_pingpong_us_p50,
        }
    }

    /// `value` (in the limit's unit) as a fraction of the limit, if it was measured.
    pub fn fraction(&self, against: Against, value: f64) -> Option<f64> {
        Some(value / self.limit(against).filter(|l| *l > 0.0)?)
    }

    /// `value` read against the limit, for people, e.g. "8% of this machine's TCP
    /// stream limit".
    pub fn describe(&self, against: Against, value: f64) -> Option<String> {
        Some(against.describe(self.fraction(against, value)?))
    }

    /// Records in `extra`, under `against.key()`, `value` as a fraction of the limit;
    /// returns that fraction. Nothing when unmeasured.
    pub fn annotate(
        &self,
        extra: &mut BTreeMap<String, serde_json::Value>,
        against: Against,
        value: f64,
    ) -> Option<f64> {
        let f = self.fraction(against, value)?;
        extra.insert(against.key().into(), json!(f));
        Some(f)
    }

    /// Records on a request-API point its throughput as a fraction of the TCP stream
    /// limit and its p50 latency as a multiple of the TCP ping-pong p50.
    pub fn annotate_network_point(&self, p: &mut Point) {
        if let Some(bw) = p.bytes_per_sec {
            self.annotate(&mut p.extra, Against::TcpStream, bw);
        }
        if let Some(l) = &p.latency_us {
            self.annotate(&mut p.extra, Against::TcpPingpongP50, l.p50);
        }
    }
}

/// The limits a request-API figure can be read against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Against {
    /// Bytes per second, against one-or-N-stream TCP throughput.
    TcpStream,
    /// Microseconds p50, against a TCP ping-pong round trip.
    TcpPingpongP50,
}

impl Against {
    /// The key a point's `extra` records the fraction under.
    pub fn key(self) -> &'static str {
        match self {
            Against::TcpStream => "fraction_of_tcp_stream",
            Against::TcpPingpongP50 => "p50_over_tcp_pingpong_p50",
        }
    }

    /// How a person reads the fraction: a share of a throughput, a multiple of a latency.
    pub fn describe(self, fraction: f64) -> String {
        match self {
            Against::TcpStream => {
                format!(
                    "{:.0}% of this machine's TCP stream limit",
                    fraction * 100.0
                )
            }
            Against::TcpPingpongP50 => {
                format!("{fraction:.2}× this machine's TCP ping-pong p50")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use camelot_results::schema::{LatencySummary, Series};

    fn result(bench: &str, series: Vec<Series>) -> BenchResult {
        BenchResult::new(bench, "t".into(), json!({}), series)
    }

    fn series(label: &str, bws: &[f64]) -> Series {
        let mut s = Series::new(label);
        for (i, b) in bws.iter().enumerate() {
            let mut p = Point::new(i);
            p.bytes_per_sec = Some(*b);
            s.points.push(p);
        }
        s
    }

    #[test]
    fn best_throughput_and_lowest_latency_are_kept() {
        let mut pp = Series::new("tcp ping-pong");
        for p50 in [30.0, 12.0, f64::NAN] {
            let mut p = Point::new(1usize);
            p.latency_us = Some(LatencySummary {
                p50,
                p90: p50,
                p99: p50,
                p999: p50,
                max: p50,
            });
            pp.points.push(p);
        }
        let mut l = Limits::default();
        l.absorb(&result(
            "net",
            vec![series("tcp ×1", &[1e9, 3e9]), series("udp ×1", &[9e9]), pp],
        ));
        l.absorb(&result(
            "mem",
            vec![
                series("seq read ×1", &[5e9]),
                series("seq write ×2", &[2e9]),
            ],
        ));
        l.absorb(&result("threads", vec![series("tcp ×1", &[99e9])]));
        assert_eq!(
            l.tcp_stream_bytes_per_sec,
            Some(3e9),
            "UDP and other benches ignored"
        );
        assert_eq!(l.tcp_pingpong_us_p50, Some(12.0));
        assert_eq!(l.mem_seq_read_bytes_per_sec, Some(5e9));
        assert_eq!(l.mem_seq_write_bytes_per_sec, Some(2e9));
        assert_eq!(l.gflops, None, "not measured, not faked");

        let mut p = Point::new(8usize);
        p.bytes_per_sec = Some(1.5e9);
        l.annotate_network_point(&mut p);
        assert_eq!(p.extra["fraction_of_tcp_stream"], json!(0.5));
        assert!(
            !p.extra.contains_key(Against::TcpPingpongP50.key()),
            "no latency, no ratio"
        );
        p.latency_us = Some(LatencySummary {
            p50: 18.0,
            p90: 20.0,
            p99: 30.0,
            p999: 40.0,
            max: 50.0,
        });
        l.annotate_network_point(&mut p);
        assert_eq!(p.extra["p50_over_tcp_pingpong_p50"], json!(1.5));
        assert_eq!(
            Limits::default().annotate(&mut p.extra, Against::TcpStream, 1.0),
            None,
            "an unmeasured limit records nothing"
        );
        assert_eq!(
            Against::TcpStream.describe(0.084),
            "8% of this machine's TCP stream limit"
        );
        assert_eq!(
            Against::TcpPingpongP50.describe(1.5),
            "1.50× this machine's TCP ping-pong p50"
        );
    }

    #[test]
    fn save_and_load_round_trip_and_find_prefers_the_explicit_file() {
        let dir = crate::scratch_dir("limits");
        let l = Limits {
            gflops: Some(23.5),
            ..Limits::default()
        };
        let path = dir.join(LIMITS_FILE_NAME);
        l.save(&path).expect("save");
        assert_eq!(Limits::load(&path).expect("load"), l);
        let (found, at) = Limits::find(None, &dir).expect("find").expect("present");
        assert_eq!((found, at), (l.clone(), path.clone()));
        assert!(Limits::find(Some(&dir.join("absent.json")), &dir).is_err());
        assert!(Limits::find(None, &dir.join("nothing-here"))
            .expect("ok")
            .is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
