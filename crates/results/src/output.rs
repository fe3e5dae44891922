//! Reading and writing result files.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::ResultsError;
use crate::schema::BenchResult;

/// Writes `dir/{bench}.json`, creating `dir`. The file is written under a temporary name in
/// the same directory and renamed into place, so a reader never sees half a result and an
/// interrupted run leaves the previous result intact.
pub fn write_result(dir: &Path, result: &BenchResult) -> Result<PathBuf, ResultsError> {
    check_bench_name(&result.bench)?;
    std::fs::create_dir_all(dir).map_err(|source| ResultsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut text = serde_json::to_vec_pretty(result)?;
    text.push(b'\n');

    let path = dir.join(format!("{}.json", result.bench));
    let tmp_path = dir.join(format!(".{}.json.tmp.{}", result.bench, std::process::id()));
    let written = write_synced(&tmp_path, &text).and_then(|()| {
        std::fs::rename(&tmp_path, &path).map_err(|source| ResultsError::Io {
            path: path.clone(),
            source,
        })
    });
    if written.is_err() {
        // Best effort: the original error is the one worth reporting.
        let _ = std::fs::remove_file(&tmp_path);
    }
    written.map(|()| path)
}

pub fn read_result(path: &Path) -> Result<BenchResult, ResultsError> {
    let text = std::fs::read(path).map_err(|source| ResultsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(serde_json::from_slice(&text)?)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ResultsError> {
    let io_err = |source| ResultsError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::create(path).map_err(io_err)?;
    file.write_all(bytes).map_err(io_err)?;
    // Without the sync a crash after the rename could leave an empty file in place.
    file.sync_all().map_err(io_err)
}

/// The bench name becomes a file name: it must not reach outside `dir`.
fn check_bench_name(bench: &str) -> Result<(), ResultsError> {
    let plain = !bench.is_empty()
        && bench != "."
        && bench != ".."
        && !bench.starts_with('.')
        && !bench.contains(['/', '\\', '\0']);
    if plain {
        Ok(())
    } else {
        Err(ResultsError::InvalidConfig(format!(
            "bench name {bench:?} cannot be used as a file name"
        )))
    }
}

/// What every bench writes: `{bench}.json`, and its figure as `{bench}.png` and
/// `{bench}.svg` (PNG for the report, SVG for papers). Returns the three paths.
pub fn write_result_with_figure(
    dir: &Path,
    result: &BenchResult,
    figure: &crate::plot::Figure,
) -> Result<Vec<PathBuf>, ResultsError> {
    let json = write_result(dir, result)?;
    let png = dir.join(format!("{}.png", result.bench));
    let svg = dir.join(format!("{}.svg", result.bench));
    figure.save_png(&png)?;
    figure.save_svg(&svg)?;
    Ok(vec![json, png, svg])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{now_rfc3339, LatencySummary, Point, Series};

    fn scratch(tag: &str) -> PathBuf {
        crate::scratch_dir(&format!("output-{tag}"))
    }

    fn sample() -> BenchResult {
        let mut series = Series::new("batched");
        let mut p = Point::new(1u32);
        p.ops_per_sec = Some(1.5e6);
        p.latency_us = Some(LatencySummary {
            p50: 1.0,
            p90: 2.0,
            p99: 3.5,
            p999: 10.25,
            max: 99.0,
        });
        p.extra.insert("note".into(), serde_json::json!("x"));
        series.points.push(p);
        series.points.push(Point::new(2u32));
        BenchResult::new(
            "threads",
            now_rfc3339(),
            serde_json::json!({"x": "threads", "ops": 100}),
            vec![series],
        )
    }

    #[test]
    fn round_trip() -> Result<(), ResultsError> {
        let dir = scratch("rt").join("nested");
        let result = sample();
        let path = write_result(&dir, &result)?;
        assert_eq!(path, dir.join("threads.json"));
        assert_eq!(read_result(&path)?, result);
        // Overwriting replaces the file and leaves no temporary behind.
        write_result(&dir, &result)?;
        let names: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|source| ResultsError::Io {
                path: dir.clone(),
                source,
            })?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("threads.json")]);
        let _ = std::fs::remove_dir_all(dir.parent().unwrap_or(&dir));
        Ok(())
    }

    #[test]
    fn bad_names_and_missing_files_are_errors() {
        let dir = scratch("bad");
        let mut result = sample();
        result.bench = "../evil".into();
        assert!(matches!(
            write_result(&dir, &result),
            Err(ResultsError::InvalidConfig(_))
        ));
        assert!(matches!(
            read_result(&dir.join("absent.json")),
            Err(ResultsError::Io { .. })
        ));
    }

    #[test]
    fn garbage_is_a_json_error() -> Result<(), ResultsError> {
        let dir = scratch("garbage");
        std::fs::create_dir_all(&dir).map_err(|source| ResultsError::Io {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join("g.json");
        std::fs::write(&path, b"{not json").map_err(|source| ResultsError::Io {
            path: path.clone(),
            source,
        })?;
        assert!(matches!(read_result(&path), Err(ResultsError::Json(_))));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
