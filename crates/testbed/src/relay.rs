//! The delay/loss relay: what `netem` would do, in user space, for kernels without it.
//!
//! A host whose link has a delay or a loss is not plugged into the bridge directly: its
//! switch port `pN` is left out of the bridge, a second veth pair `rN`–`rbN` is made,
//! `rbN` goes into the bridge, and a relay process in the switch namespace copies every
//! frame between `pN` and `rN`, both ways. Each direction drops a frame with the loss
//! probability and holds the rest for the delay, in arrival order. `tbf` still shapes
//! the rate on `pN` and on the host's `eth0`, as without a relay.
//!
//! What it distorts (measured in BENCHMARKS.md, testbed): each frame costs two system
//! calls and a copy in a process that shares the machine's CPUs, and a sleeping thread
//! wakes tens of microseconds late, so small delays come out longer than asked; a
//! TCP offload frame (up to 64 KiB) is one frame here, so it is dropped or delayed
//! whole, as netem drops a whole packet buffer.

use crate::packet::{PacketSocket, FRAME_BYTES_MAX};
pub use crate::plan::Impairment;
use crate::TestbedError;
use rand::{Rng, SeedableRng};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Frames a direction holds at most; past that, arrivals are dropped (a full queue).
pub const RELAY_QUEUE_FRAMES_MAX: usize = 4096;

/// Decides, frame after frame, which are lost: a seeded stream, so a run replays.
pub struct Dropper {
    rng: rand_chacha::ChaCha8Rng,
    loss_ppm: u32,
}

impl Dropper {
    pub fn new(loss_ppm: u32, seed: u64) -> Dropper {
        Dropper {
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            loss_ppm: loss_ppm.min(crate::plan::LOSS_PPM_MAX),
        }
    }

    /// Whether the next frame is lost.
    pub fn drops_next(&mut self) -> bool {
        self.loss_ppm > 0 && self.rng.gen_range(0..crate::plan::LOSS_PPM_MAX) < self.loss_ppm
    }
}

/// Copies frames between interfaces `a` and `b` (in this namespace) with `imp` applied
/// each way, until a socket fails. Returns once both sockets are bound: the threads do
/// the work (the caller says it is ready, then waits on the handle).
pub fn start(
    a: &str,
    b: &str,
    imp: Impairment,
    seed: u64,
) -> Result<std::thread::JoinHandle<TestbedError>, TestbedError> {
    let bind = |name: &str| {
        PacketSocket::bind(name).map_err(|e| TestbedError::Relay {
            detail: format!("cannot open a packet socket on {name}: {e}"),
        })
    };
    let (a_in, a_out) = (bind(a)?, bind(a)?);
    let (b_in, b_out) = (bind(b)?, bind(b)?);
    let (failed_tx, failed_rx) = mpsc::channel();
    let ways = [
        (a_in, b_out, format!("{a} → {b}"), seed),
        (b_in, a_out, format!("{b} → {a}"), seed.wrapping_add(1)),
    ];
    for (from, to, name, seed) in ways {
        let (tx, rx) = mpsc::sync_channel::<(Instant, Vec<u8>)>(RELAY_QUEUE_FRAMES_MAX);
        let failed = failed_tx.clone();
        let what = name.clone();
        std::thread::spawn(move || {
            let mut dropper = Dropper::new(imp.loss_ppm, seed);
            let delay = Duration::from_micros(imp.delay_us);
            let mut buf = vec![0u8; FRAME_BYTES_MAX];
            loop {
                let n = match from.recv_incoming(&mut buf) {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = failed.send(format!("{what}: receive: {e}"));
                        return;
                    }
                };
                if dropper.drops_next() {
                    continue;
                }
                // A full queue drops, as a full qdisc does; a gone writer ends this side.
                if let Err(mpsc::TrySendError::Disconnected(_)) =
                    tx.try_send((Instant::now() + delay, buf[..n].to_vec()))
                {
                    return;
                }
            }
        });
        let failed = failed_tx.clone();
        std::thread::spawn(move || {
            for (due, frame) in rx {
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                // A frame the interface refuses (it went down) is lost, as on a wire.
                if let Err(e) = to.send(&frame) {
                    if e.raw_os_error() == Some(libc::ENXIO)
                        || e.raw_os_error() == Some(libc::ENODEV)
                    {
                        let _ = failed.send(format!("{name}: send: {e}"));
                        return;
                    }
                }
            }
        });
    }
    Ok(std::thread::spawn(move || {
        let detail = failed_rx
            .recv()
            .unwrap_or_else(|_| "every relay thread ended".into());
        TestbedError::Relay { detail }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn no_loss_drops_nothing_and_full_loss_drops_everything() {
        let mut none = Dropper::new(0, 1);
        assert!((0..100_000).all(|_| !none.drops_next()));
        let mut all = Dropper::new(crate::plan::LOSS_PPM_MAX, 1);
        assert!((0..100_000).all(|_| all.drops_next()));
    }

    #[test]
    fn the_same_seed_drops_the_same_frames() {
        let run = |seed| {
            let mut d = Dropper::new(100_000, seed);
            (0..1000).map(|_| d.drops_next()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    proptest! {
        /// The share dropped is the loss asked for, within five standard deviations.
        #[test]
        fn the_share_dropped_is_the_loss(loss_ppm in 1u32..=1_000_000, seed in any::<u64>()) {
            let frames = 20_000u32;
            let mut d = Dropper::new(loss_ppm, seed);
            let dropped = (0..frames).filter(|_| d.drops_next()).count() as f64;
            let p = f64::from(loss_ppm) / 1e6;
            let mean = p * f64::from(frames);
            let sd = (f64::from(frames) * p * (1.0 - p)).sqrt();
            prop_assert!((dropped - mean).abs() <= 5.0 * sd + 1.0,
                "{dropped} dropped of {frames}, expected {mean} ± {sd}");
        }
    }
}
