//! `camelot testbed …`: an emulated network of hosts on this machine (network
//! namespaces, a bridge, rate limits) and faults injected into it.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use camelot_testbed::plan::{parse_delay_us, parse_loss_ppm, parse_rate, LinkSpec, Plan};
use camelot_testbed::{Testbed, DEFAULT_RUN_DIR};
use clap::{Args, Subcommand};

#[derive(Args, Clone)]
pub struct Which {
    /// The testbed's name (a-z, 0-9): several can be up at once.
    #[arg(long, default_value = "tb")]
    pub name: String,
    /// Where runs keep their state (what `down` reads after a crash).
    #[arg(long, env = "CAMELOT_TESTBED_DIR", default_value = DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,
}

#[derive(Subcommand)]
pub enum TestbedCommand {
    /// Build N hosts (h0 … hN-1, 10.213.0.1 … /24) joined by a switch, each in its own
    /// network namespace, with rate-limited links. Needs root.
    Up(UpArgs),
    /// Remove every namespace, link and process of a testbed; works after a crash and
    /// when run twice.
    Down(DownArgs),
    /// Run a command on a host: `camelot testbed run h1 -- iperf3 -c 10.213.0.1`.
    Run(RunArgs),
    /// Inject a fault: kill | pause | resume | partition | heal | slow.
    #[command(subcommand)]
    Fault(FaultCommand),
    /// The testbeds that are up (state or namespaces present).
    List(ListArgs),
}

#[derive(Args)]
pub struct UpArgs {
    #[command(flatten)]
    pub which: Which,
    #[arg(long)]
    pub hosts: usize,
    /// Every host's link rate, each way (tbf): e.g. 1gbit, 100mbit.
    #[arg(long)]
    pub rate: Option<String>,
    /// One-way delay per link, each way: e.g. 50us, 2ms. Applied by a user-space relay
    /// in the switch namespace (this kernel has no netem); it adds its own tens of µs.
    #[arg(long)]
    pub delay: Option<String>,
    /// Loss per link, each way: e.g. 0.1% (by the same relay, seeded per host).
    #[arg(long)]
    pub loss: Option<String>,
    /// Test only: pause after every command, so a test can SIGKILL `up` halfway.
    #[arg(long, hide = true, default_value_t = 0)]
    pub step_pause_ms: u64,
}

#[derive(Args)]
pub struct DownArgs {
    #[command(flatten)]
    pub which: Which,
    /// Every testbed this machine has.
    #[arg(long)]
    pub all: bool,
}

#[derive(Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub which: Which,
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub which: Which,
    /// h0, h1, … (or the index).
    pub host: String,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

#[derive(Args)]
pub struct HostsArgs {
    #[command(flatten)]
    pub which: Which,
    #[arg(required = true)]
    pub hosts: Vec<String>,
}

#[derive(Subcommand)]
pub enum FaultCommand {
    /// SIGKILL every process on the hosts.
    Kill(HostsArgs),
    /// SIGSTOP every process on the hosts.
    Pause(HostsArgs),
    /// SIGCONT every process on the hosts.
    Resume(HostsArgs),
    /// Cut the hosts (as one group) off from all the others; packets across are
    /// dropped silently.
    Partition(HostsArgs),
    /// Undo partitions and slowed links, resume paused processes.
    Heal(ListArgs),
    /// Change the hosts' link rate: `slow --rate 10mbit h2`.
    Slow(SlowArgs),
}

#[derive(Args)]
pub struct SlowArgs {
    #[command(flatten)]
    pub hosts: HostsArgs,
    #[arg(long)]
    pub rate: String,
}

pub fn run(cmd: TestbedCommand) -> Result<()> {
    match cmd {
        TestbedCommand::Up(a) => up(a),
        TestbedCommand::Down(a) => down(a),
        TestbedCommand::Run(a) => run_on(a),
        TestbedCommand::Fault(f) => fault(f),
        TestbedCommand::List(a) => {
            for run in Testbed::list(&a.which.run_dir)? {
                println!("{run}");
            }
            Ok(())
        }
    }
}

fn up(a: UpArgs) -> Result<()> {
    let link = LinkSpec {
        rate_bits_per_s: a.rate.as_deref().map(parse_rate).transpose()?,
        delay_us: a.delay.as_deref().map(parse_delay_us).transpose()?,
        loss_ppm: a.loss.as_deref().map(parse_loss_ppm).transpose()?,
    };
    let plan = Plan::new(&a.which.name, a.hosts, link)?;
    let started = Instant::now();
    let tb = Testbed::up(
        plan,
        &a.which.run_dir,
        Duration::from_millis(a.step_pause_ms),
    )?;
    println!(
        "testbed {} up: {} hosts in {:.2} s (state in {})",
        tb.plan.run,
        tb.plan.hosts,
        started.elapsed().as_secs_f64(),
        tb.dir().display()
    );
    for h in 0..tb.plan.hosts {
        println!(
            "  {}  {}  (namespace {})",
            Plan::host_name(h),
            tb.plan.host_addr(h),
            tb.plan.host_ns(h)
        );
    }
    Ok(())
}

fn down(a: DownArgs) -> Result<()> {
    let runs = if a.all {
        Testbed::list(&a.which.run_dir)?
    } else {
        vec![a.which.name.clone()]
    };
    for run in runs {
        let r = Testbed::down(&run, &a.which.run_dir)?;
        println!(
            "testbed {run} down: {} namespaces removed{}",
            r.namespaces_removed.len(),
            if r.state_removed {
                ", state removed"
            } else {
                ""
            }
        );
    }
    Ok(())
}

fn open(which: &Which) -> Result<Testbed> {
    Ok(Testbed::open(&which.name, &which.run_dir)?)
}

fn hosts(tb: &Testbed, names: &[String]) -> Result<Vec<usize>> {
    names
        .iter()
        .map(|n| tb.plan.parse_host(n).map_err(Into::into))
        .collect()
}

fn run_on(a: RunArgs) -> Result<()> {
    let tb = open(&a.which)?;
    let host = tb.plan.parse_host(&a.host)?;
    let Some((program, args)) = a.command.split_first() else {
        bail!("nothing to run: give the command after `--`");
    };
    // exec: our pid becomes the command's, so whoever started us can signal and wait
    // for it directly.
    let err = tb.command(host, program).args(args).exec();
    Err(err).with_context(|| format!("cannot run `ip netns exec` for {program}"))
}

fn fault(f: FaultCommand) -> Result<()> {
    match f {
        FaultCommand::Kill(h) => {
            let tb = open(&h.which)?;
            let n = tb.kill(&hosts(&tb, &h.hosts)?)?;
            println!("SIGKILL sent to {n} processes");
        }
        FaultCommand::Pause(h) => {
            let tb = open(&h.which)?;
            let n = tb.pause(&hosts(&tb, &h.hosts)?)?;
            println!("SIGSTOP sent to {n} processes");
        }
        FaultCommand::Resume(h) => {
            let tb = open(&h.which)?;
            let n = tb.resume(&hosts(&tb, &h.hosts)?)?;
            println!("SIGCONT sent to {n} processes");
        }
        FaultCommand::Partition(h) => {
            let tb = open(&h.which)?;
            let group = hosts(&tb, &h.hosts)?;
            tb.partition(&group)?;
            println!("partitioned {:?} from the rest", h.hosts);
        }
        FaultCommand::Heal(a) => {
            open(&a.which)?.heal()?;
            println!("healed");
        }
        FaultCommand::Slow(s) => {
            let tb = open(&s.hosts.which)?;
            let link = LinkSpec {
                rate_bits_per_s: Some(parse_rate(&s.rate)?),
                ..tb.plan.link
            };
            tb.shape(&hosts(&tb, &s.hosts.hosts)?, &link)?;
            println!("{:?} now at {}", s.hosts.hosts, s.rate);
        }
    }
    Ok(())
}

/// Takes testbed `run` down if this process gets SIGINT or SIGTERM, then exits (130):
/// commands that build a testbed for themselves (chaos, bench testbed) clean up after a
/// Ctrl-C as they do on every other path. (A SIGKILL cannot be caught: `camelot testbed
/// down --name RUN`, or `--all`, removes what is left.)
///
/// The teardown kills the run's servers and workers, so the main thread may see them
/// fail and head for its own exit while the watcher is still at work; `main` calls
/// [`exit_if_interrupted`] first so that such a run still ends with 130, not 1.
pub fn down_on_signal(run: String, run_dir: PathBuf) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the signal watcher")?;
    std::thread::spawn(move || {
        rt.block_on(async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(_) => return,
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            // Held until exit: whoever waits on it waits for the 130 below.
            let _teardown = TEARDOWN.lock();
            INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
            // Not eprintln!: with stderr gone (the parent shell killed first) it panics,
            // this thread dies, and nothing takes the testbed down or exits.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "interrupted: taking testbed {run} down");
            if let Err(e) = Testbed::down(&run, &run_dir) {
                let _ = writeln!(std::io::stderr(), "testbed down: {e}");
            }
            std::process::exit(130);
        });
    });
    Ok(())
}

/// Set by the signal watcher before it starts taking a testbed down.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Held by the signal watcher from the moment it sets [`INTERRUPTED`] until it exits.
static TEARDOWN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// If a signal watcher is taking a testbed down, waits for it to finish and exit
/// (130); otherwise returns at once. Anything the main thread saw fail after the
/// watcher began is the teardown's doing, not the run's.
pub fn exit_if_interrupted() {
    if INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        // The watcher holds the lock until it calls exit, so this never returns.
        let _wait = TEARDOWN.lock();
        std::process::exit(130);
    }
}

#[derive(Args)]
pub struct RelayArgs {
    /// The host's switch port.
    #[arg(long)]
    a: String,
    /// The relay's end of the pair whose other end is in the bridge.
    #[arg(long)]
    b: String,
    #[arg(long, default_value_t = 0)]
    delay_us: u64,
    #[arg(long, default_value_t = 0)]
    loss_ppm: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// The relay process: binds, says so, then copies frames until a socket fails.
pub fn relay(a: RelayArgs) -> Result<()> {
    use std::io::Write;
    let imp = camelot_testbed::plan::Impairment {
        delay_us: a.delay_us.min(camelot_testbed::plan::DELAY_US_MAX),
        loss_ppm: a.loss_ppm.min(camelot_testbed::plan::LOSS_PPM_MAX),
    };
    let failed = camelot_testbed::relay::start(&a.a, &a.b, imp, a.seed)?;
    println!("{}", camelot_testbed::RELAY_READY);
    std::io::stdout().flush()?;
    let e = failed
        .join()
        .map_err(|_| anyhow::anyhow!("a relay thread panicked"))?;
    Err(e.into())
}
