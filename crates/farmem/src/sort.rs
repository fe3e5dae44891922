//! A sort for data larger than local memory, written for far memory: sorted runs of
//! what fits locally, then one k-way merge into the output. Every far byte is read twice
//! and written twice, each time as large sequential slices (one batch per cache group),
//! instead of the random single-page faults an in-place sort would make.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use bytemuck::Pod;

use crate::farvec::FarVec;
use crate::store::PageStore;
use crate::Error;

/// The merge reads each run this many elements at a time at least.
const MERGE_READ_ELEMENTS_MIN: usize = 512;

/// Sorts `input` into `output` (same length) using at most `local_elements` elements of
/// local memory for runs and merge buffers (the FarVecs' caches are extra). `input` is
/// left holding its sorted runs.
pub fn sort_far<T, S, O>(
    input: &FarVec<T, S>,
    output: &FarVec<T, O>,
    local_elements: usize,
) -> Result<SortStats, Error>
where
    T: Pod + Ord,
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
    let run_len = local_elements as u64;
    let mut stats = SortStats::default();
    if len == 0 {
        // Nothing to read: one empty run, and the merge below would divide by zero runs.
        stats.runs = 1;
        return Ok(stats);
    }
    // Runs: read what fits, sort it here, write it back in place.
    let mut buf: Vec<T> = Vec::new();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut start = 0u64;
    while start < len {
        let n = run_len.min(len - start);
        buf.resize(n as usize, T::zeroed());
        input.read_slice(start, &mut buf)?;
        buf.sort_unstable();
        if len <= run_len {
            // One run is the whole answer.
            output.write_slice(0, &buf)?;
            stats.runs = 1;
            return Ok(stats);
        }
        input.write_slice(start, &buf)?;
        runs.push((start, start + n));
        start += n;
    }
    drop(buf);
    stats.runs = runs.len();
    // Merge: half the local memory for the runs' read buffers, half for the output.
    let per_run = (local_elements / 2 / runs.len()).max(MERGE_READ_ELEMENTS_MIN);
    let out_len = (local_elements / 2).max(MERGE_READ_ELEMENTS_MIN);
    let mut buffers: Vec<(Vec<T>, usize, u64)> = Vec::with_capacity(runs.len());
    let mut heap = BinaryHeap::with_capacity(runs.len());
    for (i, &(from, until)) in runs.iter().enumerate() {
        let mut b = vec![T::zeroed(); per_run.min((until - from) as usize)];
        input.read_slice(from, &mut b)?;
        heap.push(Reverse((b[0], i)));
        buffers.push((b, 0, from + per_run.min((until - from) as usize) as u64));
    }
    let mut out: Vec<T> = Vec::with_capacity(out_len);
    let mut written = 0u64;
    while let Some(Reverse((value, run))) = heap.pop() {
        out.push(value);
        if out.len() == out_len {
            output.write_slice(written, &out)?;
            written += out.len() as u64;
            out.clear();
        }
        let (b, at, next) = &mut buffers[run];
        *at += 1;
        if *at == b.len() {
            let until = runs[run].1;
            if *next == until {
                continue;
            }
            let n = (per_run as u64).min(until - *next) as usize;
            b.truncate(n);
            input.read_slice(*next, b)?;
            *next += n as u64;
            *at = 0;
        }
        heap.push(Reverse((b[*at], run)));
    }
    output.write_slice(written, &out)?;
    written += out.len() as u64;
    if written != len {
        return Err(Error::Invalid(format!(
            "merged {written} of {len} elements"
        )));
    }
    Ok(stats)
}

/// What a far sort did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SortStats {
    /// Sorted runs the data was cut into (1: it fit locally).
    pub runs: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{CacheConfig, PageCache};
    use crate::store::LocalStore;
    use proptest::prelude::*;

    fn farvec(values: &[u64]) -> FarVec<u64, LocalStore> {
        let pages = ((values.len() as u64 * 8).div_ceil(4096)).max(1);
        let store = LocalStore::new(4096, pages).expect("store");
        let cache = PageCache::new(store, &CacheConfig::new(8 * 4096)).expect("cache");
        let v = FarVec::new(cache, values.len() as u64).expect("farvec");
        v.write_slice(0, values).expect("fill");
        v
    }

    proptest! {
        #[test]
        fn sorts_like_sort_unstable(values in proptest::collection::vec(any::<u64>(), 0..6000), local in 1024usize..3000) {
            let input = farvec(&values);
            let output = farvec(&vec![0; values.len()]);
            let stats = sort_far(&input, &output, local).expect("sort");
            let mut want = values.clone();
            want.sort_unstable();
            let got: Vec<u64> = output.iter().collect::<Result<_, _>>().expect("read");
            prop_assert_eq!(got, want);
            prop_assert_eq!(stats.runs, (values.len().div_ceil(local)).max(1));
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
