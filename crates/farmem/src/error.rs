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
    /// The block volume under a `VolumeStore` failed (e.g. more members lost than its
    /// level tolerates).
    #[error(transparent)]
    Volume(#[from] camelot_blocks::BlocksError),
    /// The memory server answered something a page operation does not expect.
    #[error("remote memory: {0}")]
    Remote(String),
    /// This process may not use userfaultfd; the message says what to change.
    #[error("userfaultfd is not permitted here: {0}")]
    UserfaultNotPermitted(String),
    /// userfaultfd is missing or failed (the message names the step).
    #[error("userfaultfd: {0}")]
    Userfault(String),
    /// A far region stopped serving faults (its store failed); the message says why.
    #[error("the far region failed: {0}")]
    RegionFailed(String),
    /// An evicted dirty page could not be written back, and was lost with its frame; the
    /// cache serves nothing more (the message says why).
    #[error("the page cache lost pages and serves nothing more: {0}")]
    WriteBackLost(String),
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
}
