//! Benchmark results, whatever bench made them: the JSON schema every `camelot bench`
//! writes (DESIGN.md, "Benchmarks and results"), reading and writing it atomically, the
//! figures drawn from it and the offline HTML report over a directory of them.
//!
//! This crate does no measuring and knows no particular bench: anything a figure or the
//! report shows comes from the result itself (its series, its `config`, its machine).
#![forbid(unsafe_code)]

pub mod error;
pub mod machine;
pub mod output;
pub mod plot;
pub mod report;
pub mod schema;
pub mod summary;

pub use error::ResultsError;

/// A fresh directory path under the temp dir for one test: unique per process, tag and
/// moment, so parallel tests and reruns never share files.
#[cfg(test)]
pub(crate) fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "camelot-results-{tag}-{}-{nanos}",
        std::process::id()
    ))
}
