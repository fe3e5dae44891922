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
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot draw the figure: {0}")]
    Plot(String),
    #[error(
        "the peer program `{program}` is not installed: run scripts/setup.sh \
         or `apt install {package}`"
    )]
    PeerMissing {
        program: &'static str,
        package: &'static str,
    },
    #[error("the peer program `{program}` failed: {detail}")]
    PeerFailed {
        program: &'static str,
        detail: String,
    },
    /// It ran past its time limit and was killed.
    #[error("the peer program `{program}` hung: {detail}")]
    PeerTimedOut {
        program: &'static str,
        detail: String,
    },
    /// A `bench hw net` peer spoke something other than the control protocol.
    #[error("net-bench control protocol: {0}")]
    Control(#[from] crate::hw::netctl::ControlError),
    #[error("client error: {0}")]
    Client(#[from] camelot_client::ClientError),
    #[error("server error: {0}")]
    Server(#[from] camelot_server::ServerError),
}
