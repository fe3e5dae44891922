//! The one error type of the results crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    /// A name or argument that cannot be used (a bench name that is not a plain file name,
    /// a directory without results).
    #[error("{0}")]
    InvalidConfig(String),
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
}
