//! What a testbed is made of, as data: names, addresses, link shaping, and the exact
//! `ip`/`tc` commands that build and shape it. Pure (no process is run here), so the
//! whole plan is tested without root.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::TestbedError;

/// Every namespace we create starts with this, so `down --all` and a reader of
/// `ip netns list` can tell ours from anyone else's.
pub const NS_PREFIX: &str = "cmlt-tb";
/// At most this many hosts: one /24, and far more than one machine's cores can drive.
pub const HOSTS_MAX: usize = 64;
/// Run names are short so namespace names stay readable; `[a-z0-9]` only, so a name can
/// never reach into another run's (no `-`) or escape a path.
pub const RUN_NAME_BYTES_MAX: usize = 12;
/// The host interface inside each host namespace.
pub const HOST_IF: &str = "eth0";
/// The bridge inside the switch namespace.
pub const BRIDGE: &str = "br0";
/// Hosts are 10.213.0.1 … 10.213.0.N/24. The range exists only inside namespaces we
/// create: no address or route is ever added to the machine's own namespace, so it
/// cannot collide with or leak into the real network whatever that uses.
pub const SUBNET_BASE: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 0);
pub const SUBNET_PREFIX_LEN: u8 = 24;
/// The MAC a partitioned host sends the other side's packets to: locally administered,
/// owned by no interface, so the bridge floods such frames and every host drops them —
/// silently, as a real partition does (see `fault partition`).
pub const BLACKHOLE_MAC: &str = "02:cb:de:ad:00:00";
/// Slowest and fastest rate a link may be given: below 8 kbit/s a 1500-byte packet
/// takes over a second; above 400 Gbit/s tbf's arithmetic is not exact.
pub const RATE_BITS_PER_S_MIN: u64 = 8_000;
pub const RATE_BITS_PER_S_MAX: u64 = 400_000_000_000;
/// At most 10 s of emulated one-way delay.
pub const DELAY_US_MAX: u64 = 10_000_000;
/// Loss in parts per million (100% = 1,000,000).
pub const LOSS_PPM_MAX: u32 = 1_000_000;
/// The token bucket holds at least this much (a 64 KiB GSO packet must fit in one, or
/// tbf drops it) and at least 4 ms of the rate.
const TBF_BURST_BYTES_MIN: u64 = 128 * 1024;
/// How long a packet may wait in the bucket's queue before tbf drops it.
const TBF_LATENCY_MS: u64 = 50;

/// What the delay/loss relay (`relay`) does to every frame, each direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Impairment {
    pub delay_us: u64,
    pub loss_ppm: u32,
}

/// How every host's link is shaped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkSpec {
    pub rate_bits_per_s: Option<u64>,
    pub delay_us: Option<u64>,
    pub loss_ppm: Option<u32>,
}

impl LinkSpec {
    /// Delay or loss: these need the relay (`relay`), not just a token bucket.
    pub fn needs_relay(&self) -> bool {
        self.delay_us.is_some() || self.loss_ppm.is_some()
    }

    /// What the relay applies each way, if anything.
    pub fn impairment(&self) -> Option<Impairment> {
        self.needs_relay().then(|| Impairment {
            delay_us: self.delay_us.unwrap_or(0),
            loss_ppm: self.loss_ppm.unwrap_or(0),
        })
    }
}

/// One testbed: a switch namespace with a bridge, and `hosts` host namespaces each
/// joined to it by a veth pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    pub run: String,
    pub hosts: usize,
    pub link: LinkSpec,
}

/// One program invocation: what `up`, `fault` and `down` are made of. A batch
/// (`ip -batch -`) carries its commands as lines on stdin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cmd {
    pub program: &'static str,
    pub args: Vec<String>,
    pub stdin: Option<String>,
}

impl Cmd {
    fn new(program: &'static str, args: &[&str]) -> Cmd {
        Cmd {
            program,
            args: args.iter().map(|s| s.to_string()).collect(),
            stdin: None,
        }
    }

    /// As a person would type it, for errors and `--verbose`.
    pub fn line(&self) -> String {
        let mut s = self.program.to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(a);
        }
        if let Some(lines) = &self.stdin {
            s.push_str(" <<< ");
            s.push_str(&lines.replace('\n', "; "));
        }
        s
    }

    /// The namespace a command runs in (`-n NS …`), if any.
    fn ns(&self) -> Option<&str> {
        match self.args.as_slice() {
            [flag, ns, ..] if flag == "-n" => Some(ns),
            _ => None,
        }
    }
}

/// A batch's rank in the order of effect, its program and its namespace.
type GroupKey = (u8, &'static str, Option<String>);

/// Groups commands into as few `ip`/`tc` processes as keep their order of effect:
/// first every `ip netns add` (one `ip -batch`), then the switch namespace's `ip`
/// commands (the bridge and every veth pair, whose far ends need the host namespaces),
/// then each host's `ip` commands (its end of the veth exists by then), then each
/// namespace's `tc` commands (every device exists by then). Within a group the order
/// is the given one. A process per command costs ~4 ms unloaded and ten times that on
/// a busy machine: 8 hosts are 60 commands but 19 processes.
pub fn batch(cmds: &[Cmd], switch_ns: &str) -> Vec<Cmd> {
    let is_netns_add = |c: &Cmd| {
        c.program == "ip" && c.args.len() == 3 && c.args[0] == "netns" && c.args[1] == "add"
    };
    let rank = |c: &Cmd| -> u8 {
        if is_netns_add(c) {
            0
        } else if c.program == "ip" && c.ns() == Some(switch_ns) {
            1
        } else if c.program == "ip" {
            2
        } else {
            3
        }
    };
    // (rank, program, namespace) → lines, in first-seen order.
    let mut groups: Vec<(GroupKey, Vec<String>)> = Vec::new();
    for c in cmds {
        let key = (rank(c), c.program, c.ns().map(str::to_string));
        let line = if key.2.is_some() {
            c.args[2..].join(" ")
        } else {
            c.args.join(" ")
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, lines)) => lines.push(line),
            None => groups.push((key, vec![line])),
        }
    }
    groups.sort_by_key(|((rank, _, _), _)| *rank);
    groups
        .into_iter()
        .map(|((_, program, ns), lines)| {
            let mut args = Vec::new();
            if let Some(ns) = ns {
                args.push("-n".to_string());
                args.push(ns);
            }
            args.push("-batch".to_string());
            args.push("-".to_string());
            Cmd {
                program,
                args,
                stdin: Some(lines.join("\n") + "\n"),
            }
        })
        .collect()
}

pub fn check_run_name(run: &str) -> Result<(), TestbedError> {
    if run.is_empty()
        || run.len() > RUN_NAME_BYTES_MAX
        || !run
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(TestbedError::InvalidArgument(format!(
            "testbed name {run:?}: 1 to {RUN_NAME_BYTES_MAX} characters from a-z and 0-9"
        )));
    }
    Ok(())
}

/// The prefix every namespace of run `run` carries (and no other run's can: run names
/// have no `-`).
pub fn run_ns_prefix(run: &str) -> String {
    format!("{NS_PREFIX}-{run}-")
}

impl Plan {
    pub fn new(run: &str, hosts: usize, link: LinkSpec) -> Result<Plan, TestbedError> {
        check_run_name(run)?;
        if hosts == 0 || hosts > HOSTS_MAX {
            return Err(TestbedError::InvalidArgument(format!(
                "--hosts {hosts}: between 1 and {HOSTS_MAX}"
            )));
        }
        if let Some(r) = link.rate_bits_per_s {
            if !(RATE_BITS_PER_S_MIN..=RATE_BITS_PER_S_MAX).contains(&r) {
                return Err(TestbedError::InvalidArgument(format!(
                    "rate {r} bit/s: between {RATE_BITS_PER_S_MIN} and {RATE_BITS_PER_S_MAX}"
                )));
            }
        }
        if link.delay_us.is_some_and(|d| d > DELAY_US_MAX) {
            return Err(TestbedError::InvalidArgument(format!(
                "delay: at most {DELAY_US_MAX} µs"
            )));
        }
        if link.loss_ppm.is_some_and(|l| l > LOSS_PPM_MAX) {
            return Err(TestbedError::InvalidArgument("loss: at most 100%".into()));
        }
        Ok(Plan {
            run: run.to_string(),
            hosts,
            link,
        })
    }

    pub fn switch_ns(&self) -> String {
        format!("{}sw", run_ns_prefix(&self.run))
    }

    pub fn host_ns(&self, host: usize) -> String {
        format!("{}h{host}", run_ns_prefix(&self.run))
    }

    /// The host's name on the command line.
    pub fn host_name(host: usize) -> String {
        format!("h{host}")
    }

    /// Every namespace of the plan, switch first (the order `up` creates them in).
    pub fn namespaces(&self) -> Vec<String> {
        let mut v = vec![self.switch_ns()];
        v.extend((0..self.hosts).map(|h| self.host_ns(h)));
        v
    }

    /// The switch port (in the switch namespace) that host `host` is plugged into.
    pub fn switch_port(host: usize) -> String {
        format!("p{host}")
    }

    /// With a relay: the relay's end of the pair that stands in the bridge for host
    /// `host` (`relay_bridge_port` is the other end, in the bridge).
    pub fn relay_port(host: usize) -> String {
        format!("r{host}")
    }

    pub fn relay_bridge_port(host: usize) -> String {
        format!("rb{host}")
    }

    pub fn host_addr(&self, host: usize) -> Ipv4Addr {
        host_addr(host)
    }

    /// `h3`, `3` → 3; anything else, or a host past the plan, is an error.
    pub fn parse_host(&self, s: &str) -> Result<usize, TestbedError> {
        let digits = s.strip_prefix('h').unwrap_or(s);
        match digits.parse::<usize>() {
            Ok(h) if h < self.hosts && !digits.starts_with('+') => Ok(h),
            _ => Err(TestbedError::NoSuchHost {
                host: s.to_string(),
                hosts: self.hosts,
            }),
        }
    }

    /// The commands that build the testbed, in order. Each namespace is created before
    /// anything goes into it; a veth pair is created straight into the switch and host
    /// namespaces (`ip -n SW link add … peer … netns H`), so no interface ever appears in
    /// the machine's own namespace, even for an instant.
    pub fn up_commands(&self) -> Vec<Cmd> {
        let sw = self.switch_ns();
        let mut cmds = vec![
            Cmd::new("ip", &["netns", "add", &sw]),
            Cmd::new("ip", &["-n", &sw, "link", "set", "lo", "up"]),
            Cmd::new("ip", &["-n", &sw, "link", "add", BRIDGE, "type", "bridge"]),
            Cmd::new("ip", &["-n", &sw, "link", "set", BRIDGE, "up"]),
        ];
        for h in 0..self.hosts {
            let ns = self.host_ns(h);
            let port = Self::switch_port(h);
            let addr = format!("{}/{SUBNET_PREFIX_LEN}", self.host_addr(h));
            cmds.push(Cmd::new("ip", &["netns", "add", &ns]));
            cmds.push(Cmd::new("ip", &["-n", &ns, "link", "set", "lo", "up"]));
            cmds.push(Cmd::new(
                "ip",
                &[
                    "-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", HOST_IF,
                    "netns", &ns,
                ],
            ));
            if self.link.needs_relay() {
                // The relay copies between the host's port and a pair whose other end
                // is in the bridge; the port itself stays out of it.
                let (r, rb) = (Self::relay_port(h), Self::relay_bridge_port(h));
                cmds.push(Cmd::new(
                    "ip",
                    &[
                        "-n", &sw, "link", "add", &r, "type", "veth", "peer", "name", &rb,
                    ],
                ));
                cmds.push(Cmd::new(
                    "ip",
                    &["-n", &sw, "link", "set", &rb, "master", BRIDGE, "up"],
                ));
                cmds.push(Cmd::new("ip", &["-n", &sw, "link", "set", &r, "up"]));
                cmds.push(Cmd::new("ip", &["-n", &sw, "link", "set", &port, "up"]));
            } else {
                cmds.push(Cmd::new(
                    "ip",
                    &["-n", &sw, "link", "set", &port, "master", BRIDGE, "up"],
                ));
            }
            cmds.push(Cmd::new(
                "ip",
                &["-n", &ns, "addr", "add", &addr, "dev", HOST_IF],
            ));
            cmds.push(Cmd::new("ip", &["-n", &ns, "link", "set", HOST_IF, "up"]));
            cmds.extend(self.shape_commands(h, &self.link, "add"));
        }
        cmds
    }

    /// The qdiscs that shape host `host`'s link both ways: one on the host's interface
    /// (what it sends) and one on its switch port (what it receives). `verb` is `add` at
    /// `up`, `replace` for `fault slow` and `heal`.
    pub fn shape_commands(&self, host: usize, link: &LinkSpec, verb: &str) -> Vec<Cmd> {
        let ends = [
            (self.host_ns(host), HOST_IF.to_string()),
            (self.switch_ns(), Self::switch_port(host)),
        ];
        let mut cmds = Vec::new();
        for (ns, dev) in ends {
            let mut args: Vec<String> = ["-n", &ns, "qdisc", verb, "dev", &dev, "root"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            // Delay and loss are the relay's (`relay`); qdiscs shape only the rate.
            if let Some(r) = link.rate_bits_per_s {
                args.extend([
                    "tbf".into(),
                    "rate".into(),
                    format!("{r}bit"),
                    "burst".into(),
                    tbf_burst_bytes(r).to_string(),
                    "latency".into(),
                    format!("{TBF_LATENCY_MS}ms"),
                ]);
            } else if verb == "replace" {
                // Back to no shaping: the kernel's default qdisc.
                args.truncate(args.len() - 1);
                args[3] = "del".into();
                args.push("root".into());
            } else {
                continue;
            }
            cmds.push(Cmd {
                program: "tc",
                args,
                stdin: None,
            });
        }
        cmds
    }

    /// The neighbour entries that cut `group` off from every other host: each side
    /// resolves the other side's addresses to [`BLACKHOLE_MAC`], so packets leave, are
    /// flooded by the bridge and dropped by every host — the sender sees a silent loss
    /// and TCP times out, as across a real partition. This kernel has neither netfilter
    /// tools nor tc classifiers nor bridge VLAN filtering, so neighbour entries are the
    /// means left that drop silently (a blackhole route would fail `connect` at once
    /// with EINVAL, which no real partition does).
    pub fn partition_commands(&self, group: &[usize]) -> Vec<Cmd> {
        let mut cmds = Vec::new();
        for a in 0..self.hosts {
            let a_in = group.contains(&a);
            for b in 0..self.hosts {
                if a != b && a_in != group.contains(&b) {
                    cmds.push(Cmd::new(
                        "ip",
                        &[
                            "-n",
                            &self.host_ns(a),
                            "neigh",
                            "replace",
                            &self.host_addr(b).to_string(),
                            "lladdr",
                            BLACKHOLE_MAC,
                            "nud",
                            "permanent",
                            "dev",
                            HOST_IF,
                        ],
                    ));
                }
            }
        }
        cmds
    }

    /// Undoes every fault but kills and pauses (those are processes' business): the
    /// partition's neighbour entries go, links come up, shaping goes back to the plan's.
    pub fn heal_commands(&self) -> Vec<Cmd> {
        let mut cmds = Vec::new();
        for h in 0..self.hosts {
            let ns = self.host_ns(h);
            cmds.push(Cmd::new(
                "ip",
                &[
                    "-n",
                    &ns,
                    "neigh",
                    "flush",
                    "dev",
                    HOST_IF,
                    "nud",
                    "permanent",
                ],
            ));
            cmds.push(Cmd::new("ip", &["-n", &ns, "link", "set", HOST_IF, "up"]));
            cmds.push(Cmd::new(
                "ip",
                &[
                    "-n",
                    &self.switch_ns(),
                    "link",
                    "set",
                    &Self::switch_port(h),
                    "up",
                ],
            ));
            cmds.extend(self.shape_commands(h, &self.link, "replace"));
        }
        cmds
    }
}

pub fn host_addr(host: usize) -> Ipv4Addr {
    let o = SUBNET_BASE.octets();
    // Hosts are < HOSTS_MAX (64), so host + 1 fits the last octet.
    Ipv4Addr::new(o[0], o[1], o[2], (host + 1) as u8)
}

fn tbf_burst_bytes(rate_bits_per_s: u64) -> u64 {
    (rate_bits_per_s / 8 / 250).max(TBF_BURST_BYTES_MIN)
}

#[cfg(test)]
fn format_loss(ppm: u32) -> String {
    format!("{}.{:04}%", ppm / 10_000, ppm % 10_000)
}

/// `1gbit`, `100mbit`, `500kbit`, `8000bit`, `10gbit` (decimal, as tc reads them) →
/// bits per second.
pub fn parse_rate(s: &str) -> Result<u64, TestbedError> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("gbit") {
        (n, 1_000_000_000u64)
    } else if let Some(n) = t.strip_suffix("mbit") {
        (n, 1_000_000)
    } else if let Some(n) = t.strip_suffix("kbit") {
        (n, 1_000)
    } else if let Some(n) = t.strip_suffix("bit") {
        (n, 1)
    } else {
        return Err(TestbedError::InvalidArgument(format!(
            "rate {s:?}: a number and a unit, e.g. 1gbit, 100mbit, 500kbit"
        )));
    };
    let v: u64 = num.parse().map_err(|_| {
        TestbedError::InvalidArgument(format!("rate {s:?}: a whole number before the unit"))
    })?;
    v.checked_mul(mult)
        .filter(|r| (RATE_BITS_PER_S_MIN..=RATE_BITS_PER_S_MAX).contains(r))
        .ok_or_else(|| {
            TestbedError::InvalidArgument(format!(
                "rate {s:?}: between {RATE_BITS_PER_S_MIN} bit/s and {RATE_BITS_PER_S_MAX} bit/s"
            ))
        })
}

/// `50us`, `2ms`, `1s` → microseconds.
pub fn parse_delay_us(s: &str) -> Result<u64, TestbedError> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = if let Some(n) = t.strip_suffix("us") {
        (n, 1u64)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1_000)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1_000_000)
    } else {
        return Err(TestbedError::InvalidArgument(format!(
            "delay {s:?}: a number and a unit, e.g. 50us, 2ms"
        )));
    };
    let v: u64 = num.parse().map_err(|_| {
        TestbedError::InvalidArgument(format!("delay {s:?}: a whole number before the unit"))
    })?;
    v.checked_mul(mult)
        .filter(|d| *d <= DELAY_US_MAX)
        .ok_or_else(|| {
            TestbedError::InvalidArgument(format!("delay {s:?}: at most {DELAY_US_MAX} µs"))
        })
}

/// `0.1%`, `5%`, `0.0001%` → parts per million.
pub fn parse_loss_ppm(s: &str) -> Result<u32, TestbedError> {
    let bad = || {
        TestbedError::InvalidArgument(format!(
            "loss {s:?}: a percentage with at most 4 decimals, e.g. 0.1%"
        ))
    };
    let t = s.trim().strip_suffix('%').ok_or_else(bad)?;
    let (whole, frac) = t.split_once('.').unwrap_or((t, ""));
    if whole.is_empty() || frac.len() > 4 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let whole: u32 = whole.parse().map_err(|_| bad())?;
    let frac_ppm: u32 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u32>().map_err(|_| bad())? * 10u32.pow(4 - frac.len() as u32)
    };
    whole
        .checked_mul(10_000)
        .and_then(|w| w.checked_add(frac_ppm))
        .filter(|p| *p <= LOSS_PPM_MAX)
        .ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn plan(hosts: usize) -> Plan {
        Plan::new("t1", hosts, LinkSpec::default()).unwrap()
    }

    #[test]
    fn names_are_ours_and_distinct() {
        let p = plan(8);
        let ns = p.namespaces();
        assert_eq!(ns.len(), 9);
        assert_eq!(ns[0], "cmlt-tb-t1-sw");
        assert_eq!(ns[3], "cmlt-tb-t1-h2");
        let mut sorted = ns.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ns.len());
        for n in &ns {
            assert!(n.starts_with(&run_ns_prefix("t1")));
        }
        // Another run's prefix never matches ours: `t1` vs `t12`.
        assert!(!Plan::new("t12", 1, LinkSpec::default())
            .unwrap()
            .host_ns(0)
            .starts_with(&run_ns_prefix("t1")));
    }

    #[test]
    fn bad_names_and_counts_are_refused() {
        for bad in ["", "A", "a-b", "a b", "../x", "abcdefghijklm"] {
            assert!(Plan::new(bad, 1, LinkSpec::default()).is_err(), "{bad}");
        }
        assert!(Plan::new("x", 0, LinkSpec::default()).is_err());
        assert!(Plan::new("x", HOSTS_MAX + 1, LinkSpec::default()).is_err());
        assert!(Plan::new("x", HOSTS_MAX, LinkSpec::default()).is_ok());
    }

    #[test]
    fn hosts_parse_by_name_or_index() {
        let p = plan(4);
        assert_eq!(p.parse_host("h3").unwrap(), 3);
        assert_eq!(p.parse_host("0").unwrap(), 0);
        for bad in ["h4", "x", "h-1", "h+1", "", "h"] {
            assert!(p.parse_host(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn up_never_touches_the_machines_own_namespace() {
        let p = Plan::new(
            "t1",
            3,
            LinkSpec {
                rate_bits_per_s: Some(1_000_000_000),
                ..LinkSpec::default()
            },
        )
        .unwrap();
        for c in p.up_commands() {
            // Either it creates one of our namespaces, or it runs inside one.
            let creates = c.args.len() == 3
                && c.args[0] == "netns"
                && c.args[1] == "add"
                && c.args[2].starts_with(&run_ns_prefix("t1"));
            let inside = c.args[0] == "-n" && c.args[1].starts_with(&run_ns_prefix("t1"));
            assert!(creates || inside, "{}", c.line());
            // A veth's far end goes straight into one of ours.
            if c.args.contains(&"veth".to_string()) {
                let i = c.args.iter().position(|a| a == "netns").unwrap();
                assert!(c.args[i + 1].starts_with(&run_ns_prefix("t1")));
            }
        }
        let tbf = p
            .up_commands()
            .into_iter()
            .filter(|c| c.program == "tc")
            .count();
        assert_eq!(tbf, 6, "both ends of every link are shaped");
    }

    #[test]
    fn batches_hold_every_command_in_an_order_that_works() {
        let p = Plan::new(
            "t1",
            8,
            LinkSpec {
                rate_bits_per_s: Some(1_000_000_000),
                ..LinkSpec::default()
            },
        )
        .unwrap();
        let cmds = p.up_commands();
        let batches = batch(&cmds, &p.switch_ns());
        assert_eq!(cmds.len(), 4 + 8 * 8);
        assert_eq!(batches.len(), 2 * 8 + 3);
        // The same commands, line for line.
        let mut want: Vec<String> = cmds
            .iter()
            .map(|c| format!("{} {}", c.program, c.args.join(" ")))
            .collect();
        let mut got: Vec<String> = Vec::new();
        for b in &batches {
            let prefix = match b.args.as_slice() {
                [n, ns, ..] if n == "-n" => format!("{} -n {ns} ", b.program),
                _ => format!("{} ", b.program),
            };
            for line in b.stdin.as_ref().unwrap().lines() {
                got.push(format!("{prefix}{line}"));
            }
        }
        want.sort();
        got.sort();
        assert_eq!(want, got);
        // Namespaces first, then the switch (veths), then hosts, then qdiscs.
        assert!(batches[0]
            .stdin
            .as_ref()
            .unwrap()
            .lines()
            .all(|l| l.starts_with("netns add")));
        assert_eq!(batches[1].args[1], p.switch_ns());
        assert!(batches[1].stdin.as_ref().unwrap().contains("veth"));
        assert!(batches[2..10].iter().all(|b| b.program == "ip"));
        assert!(batches[10..].iter().all(|b| b.program == "tc"));
    }

    #[test]
    fn delay_and_loss_put_a_relay_between_the_port_and_the_bridge() {
        let p = Plan::new(
            "t1",
            1,
            LinkSpec {
                rate_bits_per_s: Some(1_000_000_000),
                delay_us: Some(50),
                loss_ppm: Some(1_000),
            },
        )
        .unwrap();
        // The qdiscs shape the rate only; delay and loss are the relay's.
        let c = &p.shape_commands(0, &p.link, "add")[0];
        assert!(
            c.line()
                .starts_with("tc -n cmlt-tb-t1-h0 qdisc add dev eth0 root tbf rate 1000000000bit"),
            "{}",
            c.line()
        );
        let lines: Vec<String> = p.up_commands().iter().map(|c| c.line()).collect();
        assert!(
            lines
                .iter()
                .any(|l| l == "ip -n cmlt-tb-t1-sw link add r0 type veth peer name rb0"),
            "{lines:?}"
        );
        assert!(lines
            .iter()
            .any(|l| l == "ip -n cmlt-tb-t1-sw link set rb0 master br0 up"));
        assert!(
            !lines.iter().any(|l| l.contains("link set p0 master")),
            "{lines:?}"
        );
        let plain = plan(1)
            .up_commands()
            .iter()
            .map(|c| c.line())
            .collect::<Vec<_>>();
        assert!(plain
            .iter()
            .any(|l| l.contains("link set p0 master br0 up")));
        assert!(!plain.iter().any(|l| l.contains("rb0")));
        assert_eq!(
            p.link.impairment(),
            Some(crate::plan::Impairment {
                delay_us: 50,
                loss_ppm: 1_000
            })
        );
    }

    #[test]
    fn heal_without_a_rate_removes_shaping() {
        let p = plan(1);
        let c = p.shape_commands(0, &p.link, "replace");
        assert_eq!(c[0].line(), "tc -n cmlt-tb-t1-h0 qdisc del dev eth0 root");
        assert_eq!(c[1].line(), "tc -n cmlt-tb-t1-sw qdisc del dev p0 root");
        assert!(p.shape_commands(0, &p.link, "add").is_empty());
    }

    #[test]
    fn partition_cuts_exactly_the_pairs_across() {
        let p = plan(4);
        let cmds = p.partition_commands(&[0, 1]);
        // 2 × 2 pairs across, each seen from both sides.
        assert_eq!(cmds.len(), 8);
        let within = cmds.iter().any(|c| {
            (c.args[1] == p.host_ns(0) && c.args[4] == p.host_addr(1).to_string())
                || (c.args[1] == p.host_ns(2) && c.args[4] == p.host_addr(3).to_string())
        });
        assert!(!within);
        assert!(p.partition_commands(&[]).is_empty());
        assert!(p.partition_commands(&[0, 1, 2, 3]).is_empty());
    }

    #[test]
    fn units() {
        assert_eq!(parse_rate("1gbit").unwrap(), 1_000_000_000);
        assert_eq!(parse_rate("100Mbit").unwrap(), 100_000_000);
        assert_eq!(parse_rate("8000bit").unwrap(), 8_000);
        for bad in ["1gb", "gbit", "-1mbit", "1000tbit", "7bit", "1.5gbit"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_delay_us("50us").unwrap(), 50);
        assert_eq!(parse_delay_us("2ms").unwrap(), 2_000);
        assert!(parse_delay_us("11s").is_err());
        assert!(parse_delay_us("5").is_err());
        assert_eq!(parse_loss_ppm("0.1%").unwrap(), 1_000);
        assert_eq!(parse_loss_ppm("100%").unwrap(), 1_000_000);
        assert_eq!(parse_loss_ppm("0.0001%").unwrap(), 1);
        for bad in ["0.1", "101%", "0.00001%", ".5%", "1.x%", "%"] {
            assert!(parse_loss_ppm(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn addresses_are_distinct_and_in_the_subnet(hosts in 1usize..=HOSTS_MAX) {
            let p = plan(hosts);
            let mut seen = std::collections::HashSet::new();
            for h in 0..hosts {
                let a = p.host_addr(h);
                prop_assert_eq!(&a.octets()[..3], &SUBNET_BASE.octets()[..3]);
                prop_assert!(a.octets()[3] != 0 && a.octets()[3] != 255);
                prop_assert!(a.is_private());
                prop_assert!(seen.insert(a));
            }
        }

        #[test]
        fn loss_round_trips(ppm in 0u32..=LOSS_PPM_MAX) {
            prop_assert_eq!(parse_loss_ppm(&format_loss(ppm)).unwrap(), ppm);
        }

        #[test]
        fn unit_parsers_never_panic(s in ".{0,24}") {
            let _ = parse_rate(&s);
            let _ = parse_delay_us(&s);
            let _ = parse_loss_ppm(&s);
        }
    }
}
