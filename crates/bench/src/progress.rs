//! A progress bar for long runs, drawn only for a person watching a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Shared across worker threads by reference or `Arc`: `ProgressBar` is internally
/// synchronised, so `Progress` is `Send + Sync`.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
}

const TEMPLATE: &str = "{msg:24} [{elapsed_precise}] {wide_bar} {pos}/{len} (eta {eta})";

impl Progress {
    /// When stdout is not a terminal (CI, a pipe, a file) the bar is hidden and prints
    /// nothing at all, so logs and redirected output stay clean.
    pub fn new(total: u64, message: &str) -> Progress {
        let bar = if std::io::stdout().is_terminal() {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout());
            // The template is a constant; should indicatif ever reject it, the default
            // style still shows progress.
            if let Ok(style) = ProgressStyle::with_template(TEMPLATE) {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        bar.set_length(total);
        bar.set_message(message.to_string());
        Progress { bar }
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn set_message(&self, m: &str) {
        self.bar.set_message(m.to_string());
    }

    pub fn finish(&self) {
        self.bar.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn progress_is_shareable_and_counts() {
        assert_send_sync::<Progress>();
        let p = std::sync::Arc::new(Progress::new(100, "work"));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let p = &p;
                s.spawn(move || {
                    for _ in 0..25 {
                        p.inc(1);
                    }
                });
            }
        });
        p.set_message("done");
        assert_eq!(p.bar.position(), 100);
        p.finish();
        assert!(p.bar.is_finished());
    }
}
