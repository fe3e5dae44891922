//! The one error type of the test kit.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error("{0}")]
    InvalidArgument(String),
    /// Something around the program failed (a port, a directory), not the program.
    #[error("could not set the peer up: {0}")]
    Setup(String),
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the program `{program}` is not installed: run scripts/setup.sh \
         or `apt install {package}`"
    )]
    Missing { program: String, package: String },
    #[error("the program `{program}` failed: {detail}")]
    Failed { program: String, detail: String },
    /// It ran past its time limit and was killed.
    #[error("the program `{program}` hung: {detail}")]
    TimedOut { program: String, detail: String },
}
