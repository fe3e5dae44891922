//! The one error type of the benchmark crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid benchmark configuration: {0}")]
    InvalidConfig(String),
    /// The experiment could not be set up (threads, sockets, servers...).
    #[error("could not set the experiment up: {0}")]
    Setup(String),
    /// A correctness check inside a benchmark failed: the figures of that run mean nothing.
    #[error("correctness check failed: {0}")]
    Check(String),
    #[error(transparent)]
    Results(#[from] camelot_results::ResultsError),
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// A peer program (or a camelot server process) could not be started, failed or hung.
    #[error(transparent)]
    Peer(#[from] camelot_testkit::TestkitError),
    /// A `bench hw net` peer spoke something other than the control protocol.
    #[error("net-bench control protocol: {0}")]
    Control(#[from] crate::netctl::ControlError),
    #[error("client error: {0}")]
    Client(#[from] camelot_client::ClientError),
    #[error("server error: {0}")]
    Server(#[from] camelot_server::ServerError),
}
