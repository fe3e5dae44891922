//! `camelot report` end to end: a real bench run, the real binary writing the page, and
//! headless Chromium loading it from a file:// URL as a reader would.

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const CAMELOT: &str = env!("CARGO_BIN_EXE_camelot");
const CHROMIUM: &str = "/usr/bin/chromium";

/// A unique scratch directory, removed when the test ends however it ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir =
            std::env::temp_dir().join(format!("camelot-cli-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `cmd` to completion within `timeout`, or kills it and fails the test. Output goes
/// to files rather than pipes so a chatty child (Chromium logs a lot) can never block on a
/// full pipe while we poll.
fn run(mut cmd: Command, logs: &Path, name: &str, timeout: Duration) -> Output {
    let out_path = logs.join(format!("{name}.stdout"));
    let err_path = logs.join(format!("{name}.stderr"));
    let stdout = File::create(&out_path).expect("create stdout file");
    let stderr = File::create(&err_path).expect("create stderr file");
    // Its own process group, so that on a timeout the helpers it started (Chromium's
    // zygote, renderer, GPU process) are killed with it.
    let mut child: Child = cmd
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) | Err(_) => {
                kill_group(&mut child);
                panic!(
                    "{name} did not finish within {timeout:?}; stderr:\n{}",
                    tail(&read(&err_path))
                );
            }
        }
    };
    Output {
        status,
        stdout: read(&out_path),
        stderr: read(&err_path),
    }
}

fn kill_group(child: &mut Child) {
    // The group id is the child's pid (process_group(0)); only processes we started are in it.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

fn read(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

fn tail(s: &str) -> &str {
    let start = s.len().saturating_sub(4000);
    let start = (start..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    &s[start..]
}

fn camelot(args: &[&str]) -> Command {
    let mut cmd = Command::new(CAMELOT);
    cmd.args(args).env("RUST_LOG", "warn");
    cmd
}

/// Chromium as it works in a container: no sandbox (no user namespaces as root), no GPU,
/// and a profile of its own so runs never share state or need a writable HOME.
fn chromium(profile: &Path, extra: &[&str], url: &str) -> Command {
    let mut cmd = Command::new(CHROMIUM);
    cmd.args([
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .env("HOME", profile);
    cmd
}

/// Every `src="…"` in `html`, HTML-unescaped for the characters the report escapes.
fn img_sources(html: &str) -> Vec<String> {
    html.split("<img")
        .skip(1)
        .map(|tag| {
            let tag = tag.split('>').next().unwrap_or("");
            let src = tag
                .split("src=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .unwrap_or_else(|| panic!("an <img> without src: <img{tag}>"));
            src.replace("&quot;", "\"")
                .replace("&#39;", "'")
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&amp;", "&")
        })
        .collect()
}

/// Decodes the %XX escapes of a relative URL path.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("utf-8 file name")
}

fn assert_images_exist(html: &str, dir: &Path, what: &str) -> usize {
    let sources = img_sources(html);
    for src in &sources {
        if src.starts_with("data:") {
            continue;
        }
        assert!(
            !src.contains(':') && !src.starts_with('/'),
            "{what}: image {src:?} is not a relative path"
        );
        let path = dir.join(percent_decode(src));
        assert!(
            std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() > 0),
            "{what}: image {src:?} refers to {} which does not exist",
            path.display()
        );
    }
    sources.len()
}

/// The `<body …>` line of a dumped DOM: where the page's test hook writes its findings.
fn body_tag(dom: &str) -> &str {
    dom.split("<body")
        .nth(1)
        .unwrap_or("")
        .lines()
        .next()
        .unwrap_or("")
}

#[test]
fn report_of_a_real_bench_loads_in_chromium() {
    assert!(
        Path::new(CHROMIUM).is_file(),
        "{CHROMIUM} is missing: run scripts/setup.sh (it installs Debian's chromium) — \
         this test needs a real browser and does not skip"
    );
    let scratch = Scratch::new("report");
    let dir = scratch.0.join("results");
    let logs = scratch.0.join("logs");
    std::fs::create_dir_all(&logs).expect("create logs dir");
    let dir_s = dir.to_str().expect("utf-8 temp dir");

    // Every bench, as a reader regenerates the whole report.
    let bench = run(
        camelot(&["bench", "all", "--quick", "--out", dir_s]),
        &logs,
        "bench",
        // The five middlebox benches take about three minutes of it in a debug build.
        Duration::from_secs(840),
    );
    assert!(bench.status.success(), "bench all failed: {}", bench.stderr);
    assert!(dir.join("threads.json").is_file());
    let results = std::fs::read_dir(&dir)
        .expect("results dir")
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            name.ends_with(".json") && name != "limits.json"
        })
        .count();
    // cpu mem net disk threads api ycsb rvm-commit rvm-recovery resp paging sort prefetch
    // raid-encode raid-compare raid-overhead raid-rebuild fault middlebox-cas
    // middlebox-bandwidth middlebox-tail middlebox-full-system middlebox-memory
    // cluster-throughput cluster-replication, with etcd cluster-percentiles
    // cluster-expand cluster-rebalance cluster-failover, and as root testbed
    let root = camelot_testkit::process::euid_is_root();
    assert!(
        root || std::env::var_os("CI").is_none(),
        "CI runs as root: bench all must run the testbed bench there"
    );
    let expected = if cfg!(feature = "etcd") { 29 } else { 25 } + usize::from(root);
    assert_eq!(results, expected, "bench all writes one result per bench");

    // A second result without a figure, so the report has to draw one, and files that are
    // not results, which it must skip with a warning and not fail on.
    let text = std::fs::read_to_string(dir.join("threads.json")).expect("read threads.json");
    let mut copy: serde_json::Value = serde_json::from_str(&text).expect("parse threads.json");
    copy["bench"] = serde_json::json!("threads-copy");
    copy["series"][0]["label"] = serde_json::json!("<script>alert(1)</script>");
    std::fs::write(dir.join("copy.json"), copy.to_string()).expect("write copy.json");
    std::fs::write(dir.join("junk.json"), "{\"not\": \"a result\"}").expect("write junk.json");
    std::fs::write(dir.join("broken.json"), "{not json").expect("write broken.json");
    std::fs::write(dir.join("notes.txt"), "hello").expect("write notes.txt");

    let report = run(
        camelot(&["report", dir_s]),
        &logs,
        "report",
        Duration::from_secs(60),
    );
    assert!(report.status.success(), "report failed: {}", report.stderr);
    let index = dir.join("index.html");
    assert!(
        report.stdout.contains(index.to_str().expect("utf-8 path")),
        "stdout does not name the page: {}",
        report.stdout
    );
    for skipped in ["junk.json", "broken.json"] {
        assert!(
            report
                .stderr
                .lines()
                .any(|l| l.contains("warning") && l.contains(skipped)),
            "no warning about {skipped}: {}",
            report.stderr
        );
    }
    assert!(
        !report.stderr.contains("notes.txt"),
        "non-JSON files are not results: {}",
        report.stderr
    );
    assert!(
        dir.join("copy.png").is_file(),
        "the missing figure was not drawn"
    );

    let html = std::fs::read_to_string(&index).expect("read index.html");
    // Every result has its figure, the copy included (drawn by the report).
    assert_eq!(assert_images_exist(&html, &dir, "index.html"), results + 1);
    assert!(!html.contains("<script>alert(1)"), "label not escaped");
    // Self-contained: nothing is loaded from the network. (A config block may quote an
    // etcd URL from a server's command line as text; that loads nothing.)
    for external in [
        "src=\"http",
        "href=\"http",
        "src='http",
        "href='http",
        "url(http",
        "@import",
    ] {
        assert!(!html.contains(external), "the report loads {external}…");
    }

    let url = format!("file://{}", index.display());
    let shot = dir.join("report.png");
    let screenshot = run(
        chromium(
            &scratch.0.join("profile-shot"),
            &[
                &format!("--screenshot={}", shot.display()),
                "--window-size=1280,2000",
            ],
            &url,
        ),
        &logs,
        "chromium-screenshot",
        Duration::from_secs(90),
    );
    assert!(
        screenshot.status.success(),
        "chromium --screenshot failed: {}",
        tail(&screenshot.stderr)
    );
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 0),
        "no screenshot at {}: {}",
        shot.display(),
        tail(&screenshot.stderr)
    );

    let dump = run(
        chromium(
            &scratch.0.join("profile-dom"),
            &[
                "--virtual-time-budget=5000",
                "--window-size=1280,2000",
                "--dump-dom",
            ],
            &url,
        ),
        &logs,
        "chromium-dom",
        Duration::from_secs(90),
    );
    assert!(
        dump.status.success(),
        "chromium --dump-dom failed: {}",
        tail(&dump.stderr)
    );
    let dom = dump.stdout;
    assert!(
        dom.contains("<h2>threads</h2>"),
        "bench name missing: {dom}"
    );
    assert!(dom.contains("<h2>threads-copy</h2>"), "copy missing: {dom}");
    assert!(dom.contains("<table class=\"results\">"), "no table: {dom}");
    // Under every figure, what shaped the run: one config block per result, the sides of
    // every comparison with their process, and the comparisons themselves.
    let blocks = dom.matches("<div class=\"config\" id=\"config-").count();
    assert_eq!(blocks, results + 1, "a result without its config block");
    assert!(dom.matches("machine: 2 cores").count() >= 1 || dom.contains("machine: "));
    for bench in ["ycsb", "rvm-commit"] {
        let section = dom
            .split("<section ")
            .find(|s| s.contains(&format!("<h2>{bench}</h2>")))
            .unwrap_or_else(|| panic!("no section for {bench}"));
        assert!(
            section.contains("<table class=\"sides\">"),
            "{bench}: no sides table"
        );
        assert!(
            section.contains("<td>separate</td>"),
            "{bench}: sides without their process"
        );
        assert!(
            section.contains("<table class=\"comparisons\">"),
            "{bench}: no comparisons"
        );
    }
    // Every table fits the window (wide ones scroll inside their own box).
    assert!(
        dom.contains("data-overflow-px=\"0\""),
        "the page is wider than the window: {}",
        body_tag(&dom)
    );
    assert!(dom.contains("<td>batched</td>"), "no row: {dom}");
    assert!(
        dom.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "escaped label missing: {dom}"
    );
    let images = assert_images_exist(&dom, &dir, "dumped DOM");
    assert!(images >= 1);
    let loaded = format!("data-images-loaded=\"{images}/{images}\"");
    assert!(
        dom.contains(&loaded),
        "expected {loaded}: figures did not all load in the browser: {}",
        body_tag(&dom)
    );
}
