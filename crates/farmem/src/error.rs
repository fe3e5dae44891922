/// What can go wrong in far memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting or argument out of its range (the message names it and the range).
    #[error("{0}")]
    Invalid(String),
    /// A trace file that is not a trace; the message names the line.
    #[error("trace line {line}: {reason}")]
    Trace { line: u64, reason: String },
    /// The memory server could not be reached or refused a request.
    #[error(transparent)]
    Client(#[from] camelot_client::ClientError),
    /// The memory server answered something a page operation does not expect.
    #[error("remote memory: {0}")]
    Remote(String),
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
}
