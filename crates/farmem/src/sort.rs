//! A sort for data larger than local memory, written for far memory: sorted runs of
//! what fits locally, then one k-way merge into the output.
//!
//! Where the time went before (profiled, `bench sort`): a binary-heap merge, every run
//! written back and read again, and the sort stopping for every read and write it
//! made. Now:
//! - runs are half of what the budget leaves beside the merge's buffers, in two
//!   buffers taking turns: while one run is sorted, an I/O thread writes the other's
//!   back and reads the next run into it;
//! - the last two runs stay local and are merged from where they were sorted — never
//!   written back nor read again (at 50 % local, about a quarter less far traffic);
//! - the merge is a tree of losers, without branches on the keys (⌈log₂ k⌉
//!   comparisons a key);
//! - the merge's reads and writes go through one reader and one writer thread: each far
//!   run has a second buffer being filled while its first is merged, and one output
//!   buffer is written while the other fills.
//!
//! The sorting and merging stay on the calling thread; the other threads only move
//! bytes. Local memory stays within `local_elements`: two run buffers, then the two
//! resident runs plus two buffers per far run plus two output buffers (the FarVecs'
//! caches are extra).

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};

use bytemuck::Pod;

use crate::farvec::FarVec;
use crate::store::PageStore;
use crate::Error;

/// The merge reads each run this many elements at a time at least.
const MERGE_READ_ELEMENTS_MIN: usize = 512;

/// One part in this many of the local memory holds the merge's buffers; the rest holds
/// the last run, which is merged in place.
const MERGE_SPACE_DIVISOR: usize = 8;

/// Sorts `input` into `output` (same length) using at most `local_elements` elements of
/// local memory for runs and merge buffers (the FarVecs' caches are extra). `input` is
/// left holding its sorted runs, except the last two (which are never written back).
pub fn sort_far<T, S, O>(
    input: &FarVec<T, S>,
    output: &FarVec<T, O>,
    local_elements: usize,
) -> Result<SortStats, Error>
where
    T: Pod + Ord + Send + Sync,
    S: PageStore,
    O: PageStore,
{
    if input.len() != output.len() {
        return Err(Error::Invalid(format!(
            "sorting {} elements into {}",
            input.len(),
            output.len()
        )));
    }
    if local_elements < 2 * MERGE_READ_ELEMENTS_MIN {
        return Err(Error::Invalid(format!(
            "local memory for {local_elements} elements: at least {}",
            2 * MERGE_READ_ELEMENTS_MIN
        )));
    }
    let len = input.len();
    let mut stats = SortStats::default();
    if len == 0 {
        stats.runs = 1;
        return Ok(stats);
    }
    let plan = RunPlan::new(len, local_elements);
    if plan.far_runs.is_empty() {
        // One run is the whole answer.
        let mut buf = vec![T::zeroed(); len as usize];
        input.read_slice(0, &mut buf)?;
        buf.sort_unstable();
        output.write_slice(0, &buf)?;
        stats.runs = 1;
        return Ok(stats);
    }
    let resident = form_runs(input, &plan)?;
    stats.runs = plan.far_runs.len() + resident.len();
    merge(input, output, &plan, resident)?;
    Ok(stats)
}

/// What the I/O thread of the run formation does with a buffer: write the run it holds
/// back to `write_back` (a far run), then read the run at `read` into it.
struct RunJob<T> {
    buf: Vec<T>,
    write_back: Option<u64>,
    read: (u64, u64),
}

/// Sorts every run, two buffers taking turns: while one run is sorted here, an I/O
/// thread writes the other buffer's sorted run back and reads the next run into it —
/// so after the first read, the far traffic of the run formation overlaps the sorting.
/// Returns the last two runs, sorted, which stay local for the merge.
fn form_runs<T, S>(input: &FarVec<T, S>, plan: &RunPlan) -> Result<Vec<Vec<T>>, Error>
where
    T: Pod + Ord + Send + Sync,
    S: PageStore,
{
    let runs: Vec<(u64, u64)> = plan
        .far_runs
        .iter()
        .chain(&plan.resident_runs)
        .copied()
        .collect();
    let far = plan.far_runs.len();
    std::thread::scope(|scope| {
        // Each buffer has at most one job, so two slots never fill.
        let (jobs, job_rx) = sync_channel::<RunJob<T>>(2);
        let (done_tx, done) = sync_channel::<Result<Vec<T>, Error>>(2);
        let io = scope.spawn(move || {
            for mut job in job_rx {
                let result = (|| {
                    if let Some(from) = job.write_back {
                        input.write_slice(from, &job.buf)?;
                    }
                    job.buf.clear();
                    job.buf
                        .resize((job.read.1 - job.read.0) as usize, T::zeroed());
                    input.read_slice(job.read.0, &mut job.buf)?;
                    Ok(job.buf)
                })();
                let failed = result.is_err();
                if done_tx.send(result).is_err() || failed {
                    break;
                }
            }
        });
        let formed = (|| -> Result<Vec<Vec<T>>, Error> {
            let io_stopped = || Error::Invalid("the sort's I/O thread stopped".into());
            for &read in runs.iter().take(2) {
                jobs.send(RunJob {
                    buf: Vec::with_capacity(plan.run_len),
                    write_back: None,
                    read,
                })
                .map_err(|_| io_stopped())?;
            }
            let mut resident = Vec::with_capacity(2);
            for (i, &(from, _)) in runs.iter().enumerate() {
                let mut buf = done.recv().map_err(|_| io_stopped())??;
                buf.sort_unstable();
                if i < far {
                    // A far run: back to far memory, and its buffer takes run i + 2 (a
                    // far run is never among the last two).
                    let read = *runs.get(i + 2).ok_or_else(io_stopped)?;
                    jobs.send(RunJob {
                        buf,
                        write_back: Some(from),
                        read,
                    })
                    .map_err(|_| io_stopped())?;
                } else {
                    resident.push(buf);
                }
            }
            Ok(resident)
        })();
        drop(jobs);
        io.join()
            .map_err(|_| Error::Invalid("the sort's I/O thread panicked".into()))?;
        formed
    })
}

/// How a sort cuts its input: runs of half what the budget leaves beside the merge
/// space, from the front; the last two stay local, the others are far runs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RunPlan {
    /// Elements of a run (the last may be shorter).
    run_len: usize,
    /// Runs written back to far memory: [from, until) element ranges.
    far_runs: Vec<(u64, u64)>,
    /// The last two runs, merged from local memory.
    resident_runs: Vec<(u64, u64)>,
    /// Each far run's merge buffers hold this many elements (two of them per run).
    per_run: usize,
    /// Each of the two output buffers holds this many elements.
    out_len: usize,
}

impl RunPlan {
    fn new(len: u64, local_elements: usize) -> Self {
        if len <= local_elements as u64 {
            return RunPlan {
                run_len: len as usize,
                far_runs: Vec::new(),
                resident_runs: vec![(0, len)],
                per_run: 0,
                out_len: 0,
            };
        }
        let merge_space = local_elements / MERGE_SPACE_DIVISOR;
        let run_len = (local_elements - merge_space) / 2;
        let mut runs = Vec::new();
        let mut from = 0u64;
        while from < len {
            let until = (from + run_len as u64).min(len);
            runs.push((from, until));
            from = until;
        }
        // len > local_elements > 2 × run_len: three runs at least.
        let resident_runs = runs.split_off(runs.len() - 2);
        let far_runs = runs;
        // Half the merge space for the output's two buffers, half for the far runs'
        // two each.
        let out_len = (merge_space / 4).max(MERGE_READ_ELEMENTS_MIN);
        let per_run = (merge_space / 4 / far_runs.len().max(1)).max(MERGE_READ_ELEMENTS_MIN);
        RunPlan {
            run_len,
            far_runs,
            resident_runs,
            per_run,
            out_len,
        }
    }
}

/// A read the merge asks the reader thread for: `buf.len()` elements of far run `run`
/// from element `from`, into `buf`.
struct ReadRequest<T> {
    run: usize,
    from: u64,
    buf: Vec<T>,
}

/// One input of the merge: the part of its run in local memory, where the merge is in
/// it, and (for a far run) the rest still to read.
struct Source<T> {
    buf: Vec<T>,
    at: usize,
    /// Next element of the run to ask for, and the run's end.
    next: u64,
    until: u64,
    /// A read of the run's next part is under way (its answer comes on `answers`).
    pending: bool,
    answers: Option<Receiver<Result<Vec<T>, Error>>>,
}

fn merge<T, S, O>(
    input: &FarVec<T, S>,
    output: &FarVec<T, O>,
    plan: &RunPlan,
    resident: Vec<Vec<T>>,
) -> Result<(), Error>
where
    T: Pod + Ord + Send + Sync,
    S: PageStore,
    O: PageStore,
{
    let far = plan.far_runs.len();
    std::thread::scope(|scope| {
        // At most one read per far run is ever under way, so these channels never fill.
        let (requests, request_rx) = sync_channel::<ReadRequest<T>>(far);
        let mut answer_txs: Vec<SyncSender<Result<Vec<T>, Error>>> = Vec::with_capacity(far);
        let mut sources: Vec<Source<T>> = Vec::with_capacity(far + 1);
        for &(from, until) in &plan.far_runs {
            let (tx, rx) = sync_channel(1);
            answer_txs.push(tx);
            sources.push(Source {
                buf: Vec::new(),
                at: 0,
                next: from,
                until,
                pending: false,
                answers: Some(rx),
            });
        }
        let reader = scope.spawn(move || -> Result<(), Error> {
            for mut r in request_rx {
                // A failed read ends the reader with its error, which the merge (seeing
                // the answers closed) reports.
                input.read_slice(r.from, &mut r.buf)?;
                let answers = answer_txs.get(r.run).ok_or_else(reader_stopped)?;
                // The merge gone (it failed) is no error of the reader's.
                if answers.send(Ok(r.buf)).is_err() {
                    break;
                }
            }
            Ok(())
        });
        // Two output buffers: the writer holds one while the merge fills the other.
        // Only the writer keeps a sender of free buffers, so its end (an error) is seen
        // by a merge waiting for one.
        let (full_tx, full_rx) = sync_channel::<(u64, Vec<T>)>(1);
        let (free_tx, free_rx) = sync_channel::<Vec<T>>(2);
        free_tx
            .send(Vec::with_capacity(plan.out_len))
            .map_err(|_| Error::Invalid("the sort's free buffers closed".into()))?;
        let writer = scope.spawn(move || -> Result<(), Error> {
            for (at, mut buf) in full_rx {
                output.write_slice(at, &buf)?;
                buf.clear();
                if free_tx.send(buf).is_err() {
                    break;
                }
            }
            Ok(())
        });
        let merged = run_merge(&mut sources, resident, plan, &requests, full_tx, &free_rx);
        // Closing the request channel ends the reader; the writer ended when the merge
        // dropped its sender.
        drop(requests);
        drop(sources);
        let reader = reader
            .join()
            .map_err(|_| Error::Invalid("the sort's reader thread panicked".into()))?;
        let writer = writer
            .join()
            .map_err(|_| Error::Invalid("the sort's writer thread panicked".into()))?;
        // A thread's own error explains the closed channel the merge saw, so it wins.
        writer?;
        reader?;
        let written = merged?;
        if written != input.len() {
            return Err(Error::Invalid(format!(
                "merged {written} of {} elements",
                input.len()
            )));
        }
        Ok(())
    })
}

fn reader_stopped() -> Error {
    Error::Invalid("the sort's reader thread stopped".into())
}

fn writer_stopped() -> Error {
    Error::Invalid("the sort's writer thread stopped".into())
}

/// Asks the reader for far run `run`'s next part (up to `per_run` elements) into `buf`,
/// unless the run is all read.
fn request<T: Pod>(
    run: usize,
    s: &mut Source<T>,
    mut buf: Vec<T>,
    per_run: usize,
    requests: &SyncSender<ReadRequest<T>>,
) -> Result<(), Error> {
    if s.next >= s.until {
        return Ok(());
    }
    let n = (per_run as u64).min(s.until - s.next) as usize;
    buf.clear();
    buf.resize(n, T::zeroed());
    requests
        .send(ReadRequest {
            run,
            from: s.next,
            buf,
        })
        .map_err(|_| reader_stopped())?;
    s.next += n as u64;
    s.pending = true;
    Ok(())
}

/// Waits for the read under way of `s`'s run.
fn receive<T>(s: &mut Source<T>) -> Result<Vec<T>, Error> {
    s.pending = false;
    s.answers
        .as_ref()
        .ok_or_else(reader_stopped)?
        .recv()
        .map_err(|_| reader_stopped())?
}

/// The merge proper, on the calling thread: the far runs' first parts, then one key at
/// a time from the tree's winner. Returns the elements handed to the writer.
fn run_merge<T: Pod + Ord>(
    sources: &mut Vec<Source<T>>,
    resident: Vec<Vec<T>>,
    plan: &RunPlan,
    requests: &SyncSender<ReadRequest<T>>,
    full_tx: SyncSender<(u64, Vec<T>)>,
    free_rx: &Receiver<Vec<T>>,
) -> Result<u64, Error> {
    let per_run = plan.per_run;
    for (run, s) in sources.iter_mut().enumerate() {
        request(run, s, Vec::with_capacity(per_run), per_run, requests)?;
    }
    // Each far run's second part is read while its first is merged.
    for (run, s) in sources.iter_mut().enumerate() {
        s.buf = receive(s)?;
        request(run, s, Vec::with_capacity(per_run), per_run, requests)?;
    }
    sources.extend(resident.into_iter().map(|buf| Source {
        buf,
        at: 0,
        next: 0,
        until: 0,
        pending: false,
        answers: None,
    }));
    let k = sources.len();
    let mut heads: Vec<T> = sources
        .iter()
        .map(|s| s.buf.first().copied().unwrap_or_else(T::zeroed))
        .collect();
    let mut done: Vec<bool> = sources.iter().map(|s| s.buf.is_empty()).collect();
    let mut tree = LoserTree::new(k, &|a, b| less(&heads, &done, a, b));
    let mut out: Vec<T> = Vec::with_capacity(plan.out_len);
    let mut written = 0u64;
    loop {
        let w = tree.winner();
        if done[w] {
            break;
        }
        out.push(heads[w]);
        if out.len() == plan.out_len {
            let n = out.len() as u64;
            full_tx.send((written, out)).map_err(|_| writer_stopped())?;
            written += n;
            out = free_rx.recv().map_err(|_| writer_stopped())?;
        }
        let s = &mut sources[w];
        s.at += 1;
        if s.at == s.buf.len() && s.pending {
            let next = receive(s)?;
            let used = std::mem::replace(&mut s.buf, next);
            s.at = 0;
            request(w, s, used, per_run, requests)?;
        }
        match s.buf.get(s.at) {
            Some(&v) => heads[w] = v,
            None => done[w] = true,
        }
        tree.replay(|a, b| less(&heads, &done, a, b));
    }
    if !out.is_empty() {
        let n = out.len() as u64;
        full_tx.send((written, out)).map_err(|_| writer_stopped())?;
        written += n;
    }
    Ok(written)
}

/// Whether input `a`'s head comes before input `b`'s: an exhausted input comes last.
#[inline]
fn less<T: Ord>(heads: &[T], done: &[bool], a: usize, b: usize) -> bool {
    // Without short cuts: random keys make every branch here a coin toss, so all of it
    // is computed and combined (the heads of exhausted inputs are still valid values).
    let (done_a, done_b) = (done[a], done[b]);
    let before = heads[a] < heads[b];
    (!done_a & done_b) | (!done_a & !done_b & before)
}

/// A tree of losers over `k` inputs (Knuth, TAOCP 5.4.1): `nodes[0]` is the input whose
/// head comes first, every inner node holds the loser of the match played there. After
/// the winner's head changes, one replay up its path — ⌈log₂ k⌉ comparisons, against
/// the binary heap's two a level — finds the next winner. Inputs are the leaves
/// `k..2k` of a heap-shaped tree, which works for any `k`.
struct LoserTree {
    nodes: Vec<usize>,
}

impl LoserTree {
    fn new(k: usize, less: &impl Fn(usize, usize) -> bool) -> Self {
        let mut nodes = vec![0; k.max(1)];
        if k > 1 {
            nodes[0] = Self::build(1, k, &mut nodes, less);
        }
        LoserTree { nodes }
    }

    /// Plays the matches below `node`, records their losers, returns the winner.
    fn build(
        node: usize,
        k: usize,
        nodes: &mut [usize],
        less: &impl Fn(usize, usize) -> bool,
    ) -> usize {
        if node >= k {
            return node - k;
        }
        let a = Self::build(2 * node, k, nodes, less);
        let b = Self::build(2 * node + 1, k, nodes, less);
        let (winner, loser) = if less(b, a) { (b, a) } else { (a, b) };
        nodes[node] = loser;
        winner
    }

    fn winner(&self) -> usize {
        self.nodes[0]
    }

    /// Replays the winner's path after its head changed.
    fn replay(&mut self, less: impl Fn(usize, usize) -> bool) {
        let k = self.nodes.len();
        let mut winner = self.nodes[0];
        let mut node = (winner + k) / 2;
        while node >= 1 {
            let other = self.nodes[node];
            // Selects, not a branch (see `less`).
            let swap = less(other, winner);
            self.nodes[node] = if swap { winner } else { other };
            winner = if swap { other } else { winner };
            node /= 2;
        }
        self.nodes[0] = winner;
    }
}

/// What a far sort did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SortStats {
    /// Sorted runs the data was cut into (1: it fit locally), the resident one included.
    pub runs: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheConfig, PageCache};
    use crate::store::LocalStore;
    use crate::PageId;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::Arc;

    fn farvec_over<S: PageStore>(store: S, values: &[u64]) -> FarVec<u64, S> {
        let cache = PageCache::new(store, &CacheConfig::new(8 * 4096)).expect("cache");
        let v = FarVec::new(cache, values.len() as u64).expect("farvec");
        v.write_slice(0, values).expect("fill");
        v.flush().expect("flush");
        v
    }

    fn pages_for(len: usize) -> u64 {
        ((len as u64 * 8).div_ceil(4096)).max(1)
    }

    fn farvec(values: &[u64]) -> FarVec<u64, LocalStore> {
        farvec_over(
            LocalStore::new(4096, pages_for(values.len())).expect("store"),
            values,
        )
    }

    /// Runs a sort must make, counted independently of `RunPlan`: one if it fits, else
    /// runs of half of 7/8 of `local` (the rest is the merge's).
    fn runs_expected(len: usize, local: usize) -> usize {
        if len <= local {
            return 1;
        }
        let run = (local - local / 8) / 2;
        len.div_ceil(run)
    }

    fn check_sort(values: Vec<u64>, local: usize) -> Result<(), TestCaseError> {
        let input = farvec(&values);
        let output = farvec(&vec![0; values.len()]);
        let stats = sort_far(&input, &output, local).expect("sort");
        let mut want = values.clone();
        want.sort_unstable();
        let got: Vec<u64> = output.iter().collect::<Result<_, _>>().expect("read");
        prop_assert_eq!(got, want);
        prop_assert_eq!(stats.runs, runs_expected(values.len(), local));
        Ok(())
    }

    proptest! {
        #[test]
        fn sorts_like_sort_unstable(values in proptest::collection::vec(any::<u64>(), 0..9000), local in 1024usize..3000) {
            check_sort(values, local)?;
        }

        /// Many equal keys: ties between runs, and runs made of one key.
        #[test]
        fn sorts_repeated_keys(values in proptest::collection::vec(0u64..8, 0..9000), local in 1024usize..2000) {
            check_sort(values, local)?;
        }

        /// The tree of losers merges any number of sorted inputs, empty ones included,
        /// into what sorting their concatenation gives.
        #[test]
        fn the_loser_tree_merges_sorted_inputs(mut inputs in proptest::collection::vec(proptest::collection::vec(0u64..1000, 0..40), 1..12)) {
            for v in &mut inputs {
                v.sort_unstable();
            }
            let k = inputs.len();
            let mut at = vec![0usize; k];
            let mut heads: Vec<u64> = inputs.iter().map(|v| v.first().copied().unwrap_or(0)).collect();
            let mut done: Vec<bool> = inputs.iter().map(Vec::is_empty).collect();
            let mut tree = LoserTree::new(k, &|a, b| less(&heads, &done, a, b));
            let mut merged = Vec::new();
            while !done[tree.winner()] {
                let w = tree.winner();
                merged.push(heads[w]);
                at[w] += 1;
                match inputs[w].get(at[w]) {
                    Some(&v) => heads[w] = v,
                    None => done[w] = true,
                }
                tree.replay(|a, b| less(&heads, &done, a, b));
            }
            let mut want: Vec<u64> = inputs.concat();
            want.sort_unstable();
            prop_assert_eq!(merged, want);
        }
    }

    /// The last two runs are merged from local memory: the input's store gets only the
    /// far runs written back (at half the keys local, 21,504 of 32,768 keys), where
    /// writing every run back wrote them all.
    #[test]
    fn the_resident_run_is_never_written_back() {
        let len = 64 * 512; // 64 pages of keys
        let values: Vec<u64> = (0..len as u64).rev().collect();
        let input = farvec(&values);
        let output = farvec(&vec![0; len]);
        let written_before = input.traffic().1;
        let stats = sort_far(&input, &output, len / 2).expect("sort");
        input.flush().expect("flush");
        let written = input.traffic().1 - written_before;
        // Runs of (16,384 − 2,048) / 2 = 7,168 keys: three far, then the last two.
        let far_keys = 3 * 7168;
        assert_eq!(stats.runs, 5);
        assert!(
            written <= (far_keys * 8 + 4096) as u64,
            "{written} B written back for {} B of far runs",
            far_keys * 8
        );
        let got: Vec<u64> = output.iter().collect::<Result<_, _>>().expect("read");
        assert_eq!(got, (0..len as u64).collect::<Vec<_>>());
    }

    /// A store that fails every read or write once its allowance (shared with the test,
    /// which arms it after filling the store) is spent.
    struct FailingStore {
        inner: LocalStore,
        reads_left: Arc<AtomicI64>,
        writes_left: Arc<AtomicI64>,
    }

    fn spend(left: &AtomicI64) -> Result<(), Error> {
        if left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            return Err(Error::Remote("the test store failed".into()));
        }
        Ok(())
    }

    impl PageStore for FailingStore {
        fn page_bytes(&self) -> usize {
            self.inner.page_bytes()
        }
        fn pages(&self) -> u64 {
            self.inner.pages()
        }
        fn read_pages(&self, pages: &[PageId], out: &mut [Box<[u8]>]) -> Result<(), Error> {
            spend(&self.reads_left)?;
            self.inner.read_pages(pages, out)
        }
        fn write_pages(&self, pages: &[(PageId, &[u8])]) -> Result<(), Error> {
            spend(&self.writes_left)?;
            self.inner.write_pages(pages)
        }
        fn traffic_bytes(&self) -> (u64, u64) {
            self.inner.traffic_bytes()
        }
    }

    /// A FarVec holding `values` over a store that fails once `reads` reads or `writes`
    /// writes more have been made.
    fn failing(values: &[u64], reads: i64, writes: i64) -> Failing {
        let (reads_left, writes_left) = (
            Arc::new(AtomicI64::new(i64::MAX)),
            Arc::new(AtomicI64::new(i64::MAX)),
        );
        let store = FailingStore {
            inner: LocalStore::new(4096, pages_for(values.len())).expect("store"),
            reads_left: reads_left.clone(),
            writes_left: writes_left.clone(),
        };
        let v = farvec_over(store, values);
        reads_left.store(reads, Ordering::SeqCst);
        writes_left.store(writes, Ordering::SeqCst);
        (v, reads_left, writes_left)
    }

    type Failing = (FarVec<u64, FailingStore>, Arc<AtomicI64>, Arc<AtomicI64>);

    /// A store failing under the run formation, the merge's reader thread or its writer
    /// thread ends the sort with that store's error — not a hang, not a panic.
    #[test]
    fn a_failing_store_under_the_merge_threads_is_an_error() {
        let len = 40 * 512;
        let values: Vec<u64> = (0..len as u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        // How many reads and writes a whole sort makes, then failures spread over them:
        // the first ones land in the run formation, the later ones in the merge's
        // reader (input) — the output is written only by the merge's writer.
        let (reads, writes) = {
            let (input, reads_left, _) = failing(&values, i64::MAX, i64::MAX);
            let (output, _, writes_left) = failing(&vec![0; len], i64::MAX, i64::MAX);
            sort_far(&input, &output, 4096).expect("sort");
            let spent = |left: &AtomicI64| i64::MAX - left.load(Ordering::SeqCst);
            (spent(&reads_left), spent(&writes_left))
        };
        assert!(reads > 20 && writes > 8, "{reads} reads, {writes} writes");
        for fraction in [0, 1, 2, 3] {
            let allowance = reads * fraction / 4;
            let (input, _, _) = failing(&values, allowance, i64::MAX);
            let output = farvec(&vec![0; len]);
            let err = sort_far(&input, &output, 4096).expect_err("the input store failed");
            assert!(
                err.to_string().contains("test store failed"),
                "reads {allowance}: {err}"
            );
        }
        for fraction in [0, 1, 2, 3] {
            let allowance = writes * fraction / 4;
            let input = farvec(&values);
            let (output, _, _) = failing(&vec![0; len], i64::MAX, allowance);
            let err = sort_far(&input, &output, 4096).expect_err("the output store failed");
            assert!(
                err.to_string().contains("test store failed"),
                "writes {allowance}: {err}"
            );
        }
    }

    #[test]
    fn an_empty_vector_sorts_to_an_empty_vector() {
        let a = farvec(&[]);
        let b = farvec(&[]);
        assert_eq!(sort_far(&a, &b, 1024).expect("sort").runs, 1);
    }

    #[test]
    fn lengths_and_memory_are_checked() {
        let a = farvec(&[3, 2, 1]);
        let b = farvec(&[0, 0]);
        assert!(sort_far(&a, &b, 4096).is_err());
        let c = farvec(&[0, 0, 0]);
        assert!(sort_far(&a, &c, 10).is_err());
    }
}
