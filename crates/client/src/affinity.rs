//! Which of a node's connections a thread uses, so that threads pinned to one CPU share
//! connections only with threads pinned to the same CPU.
//!
//! Why: every answer frame wakes the threads whose requests it carries. On the 2-vCPU
//! machines this runs on, a futex hand-off between two threads on one vCPU costs about
//! 1.7 µs of CPU, and to a thread on the other (idle) vCPU about 15 µs (IPI and halt
//! exits; BENCHMARKS.md). With a connection's users and its reader thread on one CPU,
//! those wake-ups stay local: 16 pinned threads × depth 16 of 64 B reads went from
//! 1.17–1.27M to 1.38–1.48M reads/s in three alternating pairs (BENCHMARKS.md).
//!
//! The placement is pure ([`connection_index`]); the OS is asked only which CPU a thread
//! is pinned to ([`pinned_cpu`]) and to pin a reader ([`pin_current`]).

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where the calling thread stands, fixed at its first request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ThreadPlace {
    /// Arrival order among all threads: how free threads are spread.
    pub seq: usize,
    /// Pinned to exactly one CPU, as the `rank`-th thread seen pinned there.
    pub pinned: Option<Pinned>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pinned {
    pub cpu: usize,
    pub rank: usize,
}

/// The machine's online CPUs, as seen when the client was created; a pinned thread's
/// class is its CPU's position here.
#[derive(Clone, Debug)]
pub(crate) struct CpuClasses {
    cpus: Vec<usize>,
}

/// Most CPUs read from the OS's list; past this the rest share classes (still correct).
const CPUS_MAX: usize = 4096;

impl CpuClasses {
    /// From `/sys/devices/system/cpu/online`: every CPU a thread can be pinned to, whatever
    /// the calling thread's own affinity. Where that cannot be read, the calling thread's
    /// affinity mask stands in.
    pub(crate) fn of_this_machine() -> CpuClasses {
        let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|list| parse_cpu_list(&list));
        let cpus = online.unwrap_or_else(|| {
            let mut cpus: Vec<usize> = core_affinity::get_core_ids()
                .unwrap_or_default()
                .into_iter()
                .map(|c| c.id)
                .collect();
            cpus.sort_unstable();
            cpus
        });
        CpuClasses { cpus }
    }

    #[cfg(test)]
    pub(crate) fn new(cpus: Vec<usize>) -> CpuClasses {
        CpuClasses { cpus }
    }

    fn count(&self) -> usize {
        self.cpus.len().max(1)
    }

    /// A CPU outside the list (pinned after the client was created, or the list could
    /// not be read) still gets a class; it just may share it with another CPU.
    fn class(&self, cpu: usize) -> usize {
        self.cpus.binary_search(&cpu).unwrap_or(cpu % self.count())
    }
}

/// The connection (of `connections` to one node) a thread at `place` uses.
///
/// Pinned threads: the connections are dealt out to CPU classes round-robin (connection
/// `j` belongs to class `j % groups`, `groups = min(connections, CPUs)`), and a CPU's
/// threads take turns among its class's connections by rank. So when `connections` is a
/// multiple of the CPU count, no connection is shared across CPUs. Free threads keep the
/// rule: arrival order, modulo the connections; so do all threads when `cpu_local` is
/// off. Always below `connections` (at least 1; `ClientConfig::validate` sees to that).
pub(crate) fn connection_index(
    place: ThreadPlace,
    connections: usize,
    cpus: &CpuClasses,
    cpu_local: bool,
) -> usize {
    let connections = connections.max(1);
    match place.pinned.filter(|_| cpu_local) {
        None => place.seq % connections,
        Some(Pinned { cpu, rank }) => {
            let groups = connections.min(cpus.count());
            let class = cpus.class(cpu) % groups;
            // Connections j < `connections` with j % groups == class.
            let members = (connections - class).div_ceil(groups);
            class + groups * (rank % members)
        }
    }
}

/// Whether a connection's pinned users all run on one CPU, so its reader may be pinned
/// there: only when every CPU class has connections of its own. With fewer connections
/// than CPUs a connection serves several CPUs, and pinning its reader to one of them
/// would make it wait behind that CPU's threads.
pub(crate) fn reader_may_follow(connections: usize, cpus: &CpuClasses) -> bool {
    connections >= cpus.count()
}

/// A kernel CPU list such as `0-3,8,10-11` (sorted, without repeats); None if it is not
/// one. At most [`CPUS_MAX`] CPUs are taken.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.parse::<usize>().ok()?, hi.parse::<usize>().ok()?),
            None => {
                let one = part.parse::<usize>().ok()?;
                (one, one)
            }
        };
        if lo > hi {
            return None;
        }
        // Bounded by CPUS_MAX whatever the range says.
        for cpu in (lo..=hi).take(CPUS_MAX.saturating_sub(cpus.len())) {
            cpus.push(cpu);
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then_some(cpus)
}

/// The one CPU the calling thread may run on, if its affinity allows exactly one.
pub(crate) fn pinned_cpu() -> Option<usize> {
    match core_affinity::get_core_ids()?.as_slice() {
        [only] => Some(only.id),
        _ => None,
    }
}

/// Pins the calling thread to `cpu`; false if the OS refused (the thread then runs
/// wherever it did before, which is only slower).
pub(crate) fn pin_current(cpu: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
}

/// How many threads have been seen pinned to each CPU: a pinned thread's rank. Touched
/// once per thread, at its first request.
static PINNED_SEEN: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
static THREADS_SEEN: AtomicUsize = AtomicUsize::new(0);

/// The calling thread's place, decided now (callers cache it per thread).
pub(crate) fn place_current_thread() -> ThreadPlace {
    let pinned = pinned_cpu().map(|cpu| {
        let mut seen = PINNED_SEEN.lock();
        let n = seen.entry(cpu).or_insert(0);
        let rank = *n;
        *n += 1;
        Pinned { cpu, rank }
    });
    ThreadPlace {
        seq: THREADS_SEEN.fetch_add(1, Ordering::Relaxed),
        pinned,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn two_cpus_four_connections_never_share_a_connection_across_cpus() {
        let cpus = CpuClasses::new(vec![0, 1]);
        let mut owner = [None; 4];
        let mut used = [0usize; 4];
        for t in 0..16 {
            let j = connection_index(pinned(t, t % 2, t / 2), 4, &cpus, true);
            assert_eq!(*owner[j].get_or_insert(t % 2), t % 2, "connection {j}");
            used[j] += 1;
        }
        assert_eq!(used, [4, 4, 4, 4]);
    }

    fn pinned(seq: usize, cpu: usize, rank: usize) -> ThreadPlace {
        ThreadPlace {
            seq,
            pinned: Some(Pinned { cpu, rank }),
        }
    }

    #[test]
    fn free_threads_and_cpu_local_off_go_round_robin() {
        let cpus = CpuClasses::new(vec![0, 1]);
        let free: Vec<_> = (0..6)
            .map(|seq| connection_index(ThreadPlace { seq, pinned: None }, 4, &cpus, true))
            .collect();
        assert_eq!(free, [0, 1, 2, 3, 0, 1]);
        // seq 1 pinned to CPU 0 would get connection 0 with cpu_local on.
        assert_eq!(connection_index(pinned(1, 0, 0), 4, &cpus, true), 0);
        assert_eq!(connection_index(pinned(1, 0, 0), 4, &cpus, false), 1);
    }

    #[test]
    fn a_cpu_outside_the_list_still_gets_a_connection() {
        let cpus = CpuClasses::new(vec![]);
        let j = connection_index(pinned(0, 7, 3), 4, &cpus, true);
        assert!(j < 4);
    }

    #[test]
    fn cpu_lists_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(vec![0, 1]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(
            parse_cpu_list("0-2,8,10-11"),
            Some(vec![0, 1, 2, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(
            parse_cpu_list(&format!("0-{}", usize::MAX)).map(|c| c.len()),
            Some(CPUS_MAX)
        );
    }

    #[test]
    fn this_machine_lists_at_least_the_cpu_we_run_on() {
        let cpus = CpuClasses::of_this_machine();
        assert!(cpus.count() >= 1);
        if let Some(ids) = core_affinity::get_core_ids() {
            for id in ids {
                assert!(
                    cpus.cpus.binary_search(&id.id).is_ok(),
                    "cpu {} missing",
                    id.id
                );
            }
        }
    }

    #[test]
    fn readers_follow_their_users_only_when_no_connection_spans_cpus() {
        let two = CpuClasses::new(vec![0, 1]);
        assert!(reader_may_follow(4, &two));
        assert!(reader_may_follow(2, &two));
        assert!(!reader_may_follow(1, &two));
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused_within_the_limit(list in ".{0,64}") {
            if let Some(cpus) = parse_cpu_list(&list) {
                prop_assert!(!cpus.is_empty() && cpus.len() <= CPUS_MAX);
                prop_assert!(cpus.windows(2).all(|w| w[0] < w[1]));
            }
        }

        #[test]
        fn index_is_in_range_and_cpus_share_only_when_they_must(
            n_cpus in 1usize..12,
            connections in 1usize..20,
            threads in proptest::collection::vec((0usize..12, 0usize..40), 1..64),
        ) {
            let cpus = CpuClasses::new((0..n_cpus).collect());
            let mut owner: HashMap<usize, usize> = HashMap::new();
            for (cpu, rank) in threads {
                let cpu = cpu % n_cpus;
                let j = connection_index(pinned(0, cpu, rank), connections, &cpus, true);
                prop_assert!(j < connections);
                if connections >= n_cpus {
                    let first = *owner.entry(j).or_insert(cpu);
                    prop_assert_eq!(first, cpu, "connection {} shared by CPUs", j);
                }
            }
        }

        #[test]
        fn a_cpus_threads_use_all_of_its_connections(
            n_cpus in 1usize..8,
            per_cpu in 1usize..4,
        ) {
            let connections = n_cpus * per_cpu;
            let cpus = CpuClasses::new((0..n_cpus).collect());
            for cpu in 0..n_cpus {
                let mut got: Vec<_> = (0..per_cpu)
                    .map(|rank| connection_index(pinned(rank, cpu, rank), connections, &cpus, true))
                    .collect();
                got.sort_unstable();
                got.dedup();
                prop_assert_eq!(got.len(), per_cpu);
            }
        }
    }
}
