//! Argument checks that several benches' configs share, with one wording for each.

use crate::BenchError;

/// At least one thread count, each 1 to `max`.
pub(crate) fn check_threads(threads: &[usize], max: usize) -> Result<(), BenchError> {
    if threads.is_empty() || threads.iter().any(|&t| t == 0 || t > max) {
        return Err(BenchError::InvalidConfig(format!(
            "threads must be 1 to {max}"
        )));
    }
    Ok(())
}

/// A duration in seconds that is finite and above zero; `what` names it in the error.
pub(crate) fn check_seconds(what: &str, seconds: f64) -> Result<(), BenchError> {
    if !(seconds.is_finite() && seconds > 0.0) {
        return Err(BenchError::InvalidConfig(format!(
            "{what} must be positive"
        )));
    }
    Ok(())
}
