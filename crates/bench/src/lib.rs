//! Shared machinery of the Camelot benchmarks: the JSON result schema, latency recording,
//! figures, progress display and the peer programs the benchmarks compare against.

pub mod error;
pub mod latency;
pub mod machine;
pub mod output;
pub mod peers;
pub mod plot;
pub mod progress;
pub mod report;
pub mod schema;

pub use error::BenchError;

pub mod all;
pub mod api;
pub mod demo;
pub mod hw;
pub mod threads;
pub mod workload;
