//! `camelot report DIR`: every result in a directory as one static HTML page.
//!
//! The page must read offline and from a file:// URL, so it fetches nothing: the CSS is
//! inline and figures are referenced by relative path (`X.png` beside `X.json`), which
//! keeps `index.html` small and lets the directory be copied or archived as a whole.
//! The only script is a test hook that counts the figures that loaded; the page does not
//! need it.
//!
//! Rendering (`render_html`) is pure; `write_report` does the I/O around it.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::error::ResultsError;
use crate::machine::Machine;
use crate::plot::standard_figure;
use crate::schema::{BenchResult, Point, X};

/// The page written into the results directory.
pub const INDEX_FILE: &str = "index.html";

/// Shown wherever a field is absent: an empty cell would read as a rendering bug, a zero
/// would be a faked measurement.
const ABSENT: &str = "—";

/// One result file and the figure shown for it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportEntry {
    /// `X` of `X.json`: the figure and the file name shown come from it, not from the
    /// `bench` field, which need not match the file's name.
    pub stem: String,
    pub result: BenchResult,
    pub figure: FigureRef,
}

/// What stands in the page for a result's figure.
#[derive(Debug, Clone, PartialEq)]
pub enum FigureRef {
    /// A PNG next to `index.html`, by file name (not yet URL-encoded).
    File(String),
    /// No figure, and why (shown to the reader).
    Missing(String),
}

/// Reads every result in `dir`, draws the figures that are missing, writes
/// `dir/index.html` and returns its path.
///
/// A `*.json` that cannot be read or is not a `BenchResult` is skipped with a warning line
/// on stderr: result directories collect other JSON (peer output, notes), and one stray file
/// must not cost the report. The warnings are printed here because the caller only gets the
/// path back, and a skipped file has to be visible whether or not logging is set up.
///
/// `not_results` names JSON files the caller knows are expected there and are not results
/// (the machine's limits file, say): they are passed over without a warning.
pub fn write_report(dir: &Path, not_results: &[&str]) -> Result<PathBuf, ResultsError> {
    let Found { results, skipped } = read_results(dir, not_results)?;
    for (path, why) in &skipped {
        eprintln!("warning: skipping {}: {why}", path.display());
    }
    if results.is_empty() {
        return Err(ResultsError::InvalidConfig(format!(
            "no benchmark results (*.json) in {}",
            dir.display()
        )));
    }

    let mut entries = Vec::with_capacity(results.len());
    for (stem, result) in results {
        let figure = figure_for(dir, &stem, &result)?;
        entries.push(ReportEntry {
            stem,
            result,
            figure,
        });
    }
    let html = render_html(&entries);
    let path = dir.join(INDEX_FILE);
    write_atomically(dir, &path, html.as_bytes())?;
    Ok(path)
}

/// What `read_results` found: results as (stem, result), and skipped files with the reason.
struct Found {
    results: Vec<(String, BenchResult)>,
    skipped: Vec<(PathBuf, String)>,
}

/// The results in `dir` as (stem, result), sorted by bench name then file name so the page
/// is the same on every run, and the files that were skipped.
fn read_results(dir: &Path, not_results: &[&str]) -> Result<Found, ResultsError> {
    let io_err = |source| ResultsError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err)? {
        let path = entry.map_err(io_err)?.path();
        let expected_stranger = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| not_results.contains(&n));
        if path.extension().is_some_and(|e| e == "json") && !expected_stranger {
            paths.push(path);
        }
    }
    paths.sort();

    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for path in paths {
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            skipped.push((path, "the file name is not UTF-8".to_string()));
            continue;
        };
        let stem = stem.to_string();
        match crate::output::read_result(&path) {
            Ok(result) => results.push((stem, result)),
            Err(e) => skipped.push((path, e.to_string())),
        }
    }
    results.sort_by(|(sa, a), (sb, b)| a.bench.cmp(&b.bench).then_with(|| sa.cmp(sb)));
    Ok(Found { results, skipped })
}

/// `X.png` if it is there; otherwise the standard figure drawn into it when the result
/// has numeric x values and something to plot.
fn figure_for(dir: &Path, stem: &str, result: &BenchResult) -> Result<FigureRef, ResultsError> {
    let name = format!("{stem}.png");
    let path = dir.join(&name);
    if path.is_file() {
        return Ok(FigureRef::File(name));
    }
    let points = || result.series.iter().flat_map(|s| &s.points);
    if points().next().is_none() {
        return Ok(FigureRef::Missing("no points to plot".to_string()));
    }
    if points().any(|p| p.x.as_f64().is_none()) {
        // A line through labels would invent an order and spacing the data does not have.
        return Ok(FigureRef::Missing(
            "x values are labels, not numbers: see the table".to_string(),
        ));
    }
    if !points().any(has_headline) {
        return Ok(FigureRef::Missing(
            "no throughput or latency to plot".to_string(),
        ));
    }
    standard_figure(result).save_png(&path)?;
    Ok(FigureRef::File(name))
}

fn has_headline(p: &Point) -> bool {
    p.ops_per_sec.is_some() || p.bytes_per_sec.is_some() || p.latency_us.is_some()
}

/// Temporary name + rename, so a browser open on the old page never sees half a new one.
fn write_atomically(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), ResultsError> {
    let tmp = dir.join(format!(".{INDEX_FILE}.tmp.{}", std::process::id()));
    let written = std::fs::write(&tmp, bytes)
        .map_err(|source| ResultsError::Io {
            path: tmp.clone(),
            source,
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| ResultsError::Io {
                path: path.to_path_buf(),
                source,
            })
        });
    if written.is_err() {
        // Best effort: the original error is the one worth reporting.
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

const STYLE: &str = "
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto;
       max-width: 1300px; padding: 0 1em; color: #222; background: #fff; }
h1 { margin-bottom: 0.2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
.meta { color: #555; }
table { border-collapse: collapse; margin: 0.8em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; }
th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.absent { color: #999; text-align: center; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
.missing { color: #777; font-style: italic; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; }
.scroll { overflow-x: auto; max-width: 100%; }
.scroll table { margin: 0.4em 0; }
th { font-weight: 600; }
table.kv th { max-width: 22em; overflow-wrap: anywhere; }
td.cmd { min-width: 16em; max-width: 34em; }
td.cmd code { overflow-wrap: anywhere; font-size: 0.85em; }
td { overflow-wrap: break-word; }
table.results td:first-child, table.sides td:first-child { white-space: nowrap; }
td.num { white-space: nowrap; }
.config h3, .comparisons h3 { font-size: 1em; margin: 1em 0 0.2em; }
.config table.kv th { background: #fafafa; font-weight: normal; color: #444; }
.inproc { background: #fff3cd; }
.met-yes { color: #196c2e; font-weight: 600; }
.met-no { color: #b3261e; font-weight: 600; }
";

/// Counts figures that loaded into `body[data-images-loaded]` ("N/M") and how far the
/// page is wider than the window into `body[data-overflow-px]` (0: every table fits), so
/// a headless browser test can tell a broken page from a working one. Nothing else
/// depends on it.
const IMAGES_LOADED_SCRIPT: &str = "window.addEventListener('load', function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) {
    if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; }
  }
  document.body.dataset.imagesLoaded = ok + '/' + imgs.length;
  document.body.dataset.overflowPx =
    Math.max(0, document.documentElement.scrollWidth - window.innerWidth);
});";

/// The whole page. Entries are shown in the order given (`write_report` sorts them).
pub fn render_html(entries: &[ReportEntry]) -> String {
    let mut html = String::new();
    html.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    html.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    html.push_str("<title>Camelot benchmark report</title>\n");
    let _ = write!(html, "<style>{STYLE}</style>\n</head>\n<body>\n");
    html.push_str("<h1>Camelot benchmark report</h1>\n");

    if entries.is_empty() {
        html.push_str("<p class=\"missing\">No benchmark results.</p>\n");
    } else {
        render_machines(&mut html, entries);
        html.push_str("<h2>Contents</h2>\n<ul>\n");
        for (i, e) in entries.iter().enumerate() {
            let _ = writeln!(
                html,
                "<li><a href=\"#bench-{i}\">{}</a> <span class=\"meta\">({}.json)</span></li>",
                escape(&e.result.bench),
                escape(&e.stem)
            );
        }
        html.push_str("</ul>\n");
        for (i, e) in entries.iter().enumerate() {
            render_entry(&mut html, i, e);
        }
    }

    let _ = write!(
        html,
        "<script>{IMAGES_LOADED_SCRIPT}</script>\n</body>\n</html>\n"
    );
    html
}

/// One block per distinct machine: results gathered on different hosts must not be read
/// as if they came from one.
fn render_machines(html: &mut String, entries: &[ReportEntry]) {
    let mut machines: Vec<(&Machine, Vec<&str>)> = Vec::new();
    for e in entries {
        match machines.iter_mut().find(|(m, _)| **m == e.result.machine) {
            Some((_, benches)) => benches.push(&e.result.bench),
            None => machines.push((&e.result.machine, vec![&e.result.bench])),
        }
    }
    html.push_str("<h2>Machine</h2>\n");
    for (m, benches) in &machines {
        if machines.len() > 1 {
            let names: Vec<String> = benches.iter().map(|b| escape(b)).collect();
            let _ = writeln!(html, "<p class=\"meta\">Used by: {}</p>", names.join(", "));
        }
        // Machine::detect records 0 for what it could not read: shown as unknown, not 0.
        let cores = if m.cores == 0 {
            ABSENT.to_string()
        } else {
            m.cores.to_string()
        };
        let memory = if m.memory_bytes == 0 {
            ABSENT.to_string()
        } else {
            format_binary_bytes(m.memory_bytes)
        };
        let cpu = m.cpu_model.as_deref().map_or(ABSENT.to_string(), escape);
        let _ = writeln!(
            html,
            "<div class=\"scroll\"><table class=\"machine\">\n<tr><th>cores</th><td>{cores}</td></tr>\n\
             <tr><th>memory</th><td>{memory}</td></tr>\n\
             <tr><th>kernel</th><td>{}</td></tr>\n\
             <tr><th>CPU</th><td>{cpu}</td></tr>\n</table></div>",
            escape(&m.kernel)
        );
    }
}

fn render_entry(html: &mut String, index: usize, e: &ReportEntry) {
    let r = &e.result;
    let _ = writeln!(
        html,
        "<section id=\"bench-{index}\">\n<h2>{}</h2>\n\
         <p class=\"meta\">{}.json · version {} · started {}</p>",
        escape(&r.bench),
        escape(&e.stem),
        escape(&r.version),
        escape(&r.started)
    );
    match &e.figure {
        FigureRef::File(name) => {
            let _ = writeln!(
                html,
                "<p><img src=\"{}\" alt=\"figure of {}\"></p>",
                escape(&url_path_segment(name)),
                escape(&r.bench)
            );
        }
        FigureRef::Missing(why) => {
            let _ = writeln!(html, "<p class=\"missing\">No figure: {}.</p>", escape(why));
        }
    }
    render_comparisons(html, r);
    render_config(html, index, r);
    html.push_str("<details open><summary>every point</summary>\n");
    render_table(html, r);
    html.push_str("</details>\n</section>\n");
}

/// Camelot against each peer: both figures, the ratio, the target and whether it is met.
fn render_comparisons(html: &mut String, r: &BenchResult) {
    if r.comparisons.is_empty() {
        return;
    }
    html.push_str(
        "<div class=\"comparisons\"><h3>Camelot against its peers</h3>\n<div class=\"scroll\">\
         <table class=\"comparisons\">\n<thead><tr><th>check</th><th>camelot</th><th>peer</th>\
         <th>ratio</th><th>target</th><th>met</th><th>peer is</th></tr></thead>\n<tbody>\n",
    );
    for c in &r.comparisons {
        let target = c.target.map_or_else(
            || ABSENT.to_string(),
            |t| format!("{} {}", if c.at_most { "≤" } else { "≥" }, format_number(t)),
        );
        let met = match c.met() {
            Some(true) => "<td class=\"met-yes\">yes</td>",
            Some(false) => "<td class=\"met-no\">no</td>",
            None => "<td class=\"absent\">—</td>",
        };
        let ratio = if c.ratio.is_finite() {
            format!("{:.2}", c.ratio)
        } else {
            ABSENT.to_string()
        };
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td class=\"num\">{} {}</td><td class=\"num\">{} {}</td>\
             <td class=\"num\">{ratio}</td><td class=\"num\">{}</td>{met}<td>{}</td></tr>",
            escape(&c.name),
            format_number(c.camelot),
            escape(&c.unit),
            format_number(c.peer),
            escape(&c.unit),
            escape(&target),
            escape(&c.peer_label),
        );
    }
    html.push_str("</tbody>\n</table></div></div>\n");
}

/// What shaped the run, under its figure: each side of a comparison (process, threads,
/// version, flags, client, data model), the machine, and every other config parameter.
fn render_config(html: &mut String, index: usize, r: &BenchResult) {
    let _ = writeln!(
        html,
        "<div class=\"config\" id=\"config-{index}\"><h3>What shaped this run</h3>"
    );
    if let Some(sides) = r.config.get("sides").and_then(|s| s.as_object()) {
        if !sides.is_empty() {
            html.push_str(
                "<div class=\"scroll\"><table class=\"sides\">\n<thead><tr><th>side</th>\
                 <th>server</th><th>process</th><th>server threads</th><th>version</th>\
                 <th>client</th><th>client threads × depth</th><th>data model</th>\
                 <th>command</th></tr></thead>\n<tbody>\n",
            );
            for (label, side) in sides {
                let text = |k: &str| match side.get(k) {
                    Some(serde_json::Value::String(s)) => escape(s),
                    Some(serde_json::Value::Null) | None => ABSENT.to_string(),
                    Some(v) => escape(&v.to_string()),
                };
                let in_process = side.get("process").and_then(|p| p.as_str()) == Some("in-process");
                let _ = writeln!(
                    html,
                    "<tr{}><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td>\
                     <td>{}</td><td class=\"num\">{} × {}</td><td>{}</td><td class=\"cmd\"><code>{}</code></td></tr>",
                    if in_process { " class=\"inproc\"" } else { "" },
                    escape(label),
                    text("server"),
                    text("process"),
                    text("server_threads"),
                    text("version"),
                    text("client"),
                    text("client_threads"),
                    text("depth"),
                    text("data_model"),
                    text("command"),
                );
            }
            html.push_str("</tbody>\n</table></div>\n");
        }
    }
    let m = &r.machine;
    let _ = writeln!(
        html,
        "<p class=\"meta machine-line\">machine: {} cores · {} · {} · kernel {}</p>",
        if m.cores == 0 {
            ABSENT.to_string()
        } else {
            m.cores.to_string()
        },
        if m.memory_bytes == 0 {
            ABSENT.to_string()
        } else {
            format_binary_bytes(m.memory_bytes)
        },
        m.cpu_model.as_deref().map_or(ABSENT.to_string(), escape),
        escape(&m.kernel),
    );
    let mut rows = Vec::new();
    if let Some(obj) = r.config.as_object() {
        for (k, v) in obj {
            if k != "sides" {
                flatten_config(k, v, &mut rows);
            }
        }
    }
    if !rows.is_empty() {
        html.push_str("<div class=\"scroll\"><table class=\"kv\">\n<tbody>\n");
        for (k, v) in rows {
            let _ = writeln!(
                html,
                "<tr><th>{}</th><td>{}</td></tr>",
                escape(&k),
                escape(&v)
            );
        }
        html.push_str("</tbody>\n</table></div>\n");
    }
    html.push_str("</div>\n");
}

/// Config entries as `dotted.key = value` rows: nested objects and lists of objects are
/// spelled out key by key, lists of plain values joined, so no cell holds raw JSON.
fn flatten_config(key: &str, v: &serde_json::Value, rows: &mut Vec<(String, String)>) {
    use serde_json::Value;
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, inner) in map {
                flatten_config(&format!("{key}.{k}"), inner, rows);
            }
        }
        Value::Array(items) if items.iter().any(|i| i.is_object() || i.is_array()) => {
            for (i, inner) in items.iter().enumerate() {
                flatten_config(&format!("{key}.{i}"), inner, rows);
            }
        }
        _ => rows.push((key.to_string(), plain_value(v))),
    }
}

/// A JSON value as a person would write it: strings bare, numbers formatted, lists joined.
fn plain_value(v: &serde_json::Value) -> String {
    use serde_json::Value;
    match v {
        Value::Null => ABSENT.to_string(),
        Value::String(s) => s.clone(),
        Value::Number(n) => n
            .as_u64()
            .map(|u| group_thousands(&u.to_string()))
            .or_else(|| n.as_i64().map(|i| group_thousands(&i.to_string())))
            .or_else(|| n.as_f64().map(format_number))
            .unwrap_or_else(|| n.to_string()),
        Value::Bool(b) => b.to_string(),
        Value::Array(items) => items.iter().map(plain_value).collect::<Vec<_>>().join(", "),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| format!("{k}: {}", plain_value(v)))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// One row per point. The headline columns are always there so every bench's table reads
/// the same; `extra` keys (the union over all points, sorted) follow.
fn render_table(html: &mut String, r: &BenchResult) {
    let extra_keys: BTreeSet<&str> = r
        .series
        .iter()
        .flat_map(|s| &s.points)
        .flat_map(|p| p.extra.keys().map(String::as_str))
        .collect();
    let x_name = r.config.get("x").and_then(|x| x.as_str()).unwrap_or("x");

    html.push_str("<div class=\"scroll\"><table class=\"results\">\n<thead><tr><th>series</th>");
    let _ = write!(
        html,
        "<th>{}</th><th>ops/s</th><th title=\"10^6 bytes per second\">MB/s</th>\
         <th>p50 µs</th><th>p99 µs</th>",
        escape(x_name)
    );
    for k in &extra_keys {
        let _ = write!(html, "<th>{}</th>", escape(k));
    }
    html.push_str("</tr></thead>\n<tbody>\n");

    let points = r
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(move |p| (s, p)));
    let mut rows = 0usize;
    for (s, p) in points {
        rows += 1;
        let _ = write!(html, "<tr><td>{}</td>", escape(&s.label));
        match &p.x {
            X::Num(v) => push_num(html, Some(*v)),
            X::Label(l) => {
                let _ = write!(html, "<td>{}</td>", escape(l));
            }
        }
        push_num(html, p.ops_per_sec);
        push_num(html, p.bytes_per_sec.map(|b| b / 1e6));
        push_num(html, p.latency_us.as_ref().map(|l| l.p50));
        push_num(html, p.latency_us.as_ref().map(|l| l.p99));
        for k in &extra_keys {
            match p.extra.get(*k) {
                None => push_num(html, None),
                Some(v) => push_json_cell(html, v),
            }
        }
        html.push_str("</tr>\n");
    }
    if rows == 0 {
        let columns = 6 + extra_keys.len();
        let _ = writeln!(
            html,
            "<tr><td class=\"absent\" colspan=\"{columns}\">no points</td></tr>"
        );
    }
    html.push_str("</tbody>\n</table></div>\n");
}

fn push_num(html: &mut String, v: Option<f64>) {
    match v {
        Some(v) => {
            let _ = write!(html, "<td class=\"num\">{}</td>", format_number(v));
        }
        None => {
            let _ = write!(html, "<td class=\"absent\">{ABSENT}</td>");
        }
    }
}

fn push_json_cell(html: &mut String, v: &serde_json::Value) {
    use serde_json::Value;
    match v {
        // Integers exactly (counts can pass 2^53); other numbers like every measurement.
        Value::Number(n) => {
            let text = if let Some(u) = n.as_u64() {
                group_thousands(&u.to_string())
            } else if let Some(i) = n.as_i64() {
                group_thousands(&i.to_string())
            } else {
                n.as_f64().map_or_else(|| n.to_string(), format_number)
            };
            let _ = write!(html, "<td class=\"num\">{text}</td>");
        }
        other => {
            let _ = write!(html, "<td>{}</td>", escape(&plain_value(other)));
        }
    }
}

/// HTML-escapes text for element content and quoted attribute values alike.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes a file name for use as a relative URL: a name with `#`, `?`, `%` or a
/// space would otherwise point somewhere else. Every byte outside RFC 3986's unreserved set
/// is encoded, which also keeps `:` from making the name look like a scheme.
pub fn url_path_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A measurement as people read it: 1,234,567 / 812.5 / 3.25 / 0.0123; exponents only for
/// the very large or very small.
pub fn format_number(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let magnitude = v.abs();
    if magnitude == 0.0 {
        return "0".to_string();
    }
    if !(1e-3..1e15).contains(&magnitude) {
        return format!("{v:.3e}");
    }
    if magnitude >= 1000.0 {
        return group_thousands(&format!("{v:.0}"));
    }
    // Three significant digits below 1, two decimals up to 100, one above.
    let decimals = if magnitude >= 100.0 {
        1
    } else if magnitude >= 1.0 {
        2
    } else {
        // magnitude is in [1e-3, 1): floor(log10) is -1..=-3, so this is 3..=5.
        usize::try_from(2 - magnitude.log10().floor() as i64).unwrap_or(5)
    };
    let text = format!("{v:.decimals$}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    text.to_string()
}

/// `-1234567` → `-1,234,567`; `digits` is an optional sign then ASCII digits.
fn group_thousands(digits: &str) -> String {
    let (sign, digits) = match digits.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", digits),
    };
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    out.push_str(sign);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// 16318412800 → "15.2 GiB".
fn format_binary_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    // Precision loss above 2^53 bytes does not matter at one decimal.
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{LatencySummary, Series};

    fn machine() -> Machine {
        Machine {
            cores: 2,
            memory_bytes: 8 << 30,
            kernel: "6.1.0".to_string(),
            cpu_model: None,
        }
    }

    fn result(bench: &str, series: Vec<Series>) -> BenchResult {
        BenchResult {
            bench: bench.to_string(),
            version: "0.1.0".to_string(),
            started: "2024-01-01T00:00:00Z".to_string(),
            machine: machine(),
            config: serde_json::json!({"x": "threads", "note": "<b>bold</b>"}),
            series,
            references: Vec::new(),
            comparisons: Vec::new(),
        }
    }

    fn full_point(x: u32) -> Point {
        let mut p = Point::new(x);
        p.ops_per_sec = Some(1_234_567.0);
        p.bytes_per_sec = Some(5.0e9);
        p.latency_us = Some(LatencySummary {
            p50: 12.5,
            p90: 20.0,
            p99: 40.25,
            p999: 80.0,
            max: 100.0,
        });
        p.extra.insert("reads".into(), serde_json::json!(1000));
        p
    }

    fn entry(stem: &str, result: BenchResult, figure: FigureRef) -> ReportEntry {
        ReportEntry {
            stem: stem.to_string(),
            result,
            figure,
        }
    }

    /// The `<tbody>` rows of the n-th results table.
    fn body_rows(html: &str, n: usize) -> Vec<&str> {
        html.split("<table class=\"results\">")
            .nth(n + 1)
            .and_then(|t| t.split("<tbody>").nth(1))
            .and_then(|t| t.split("</tbody>").next())
            .map(|b| b.lines().filter(|l| l.starts_with("<tr>")).collect())
            .unwrap_or_default()
    }

    #[test]
    fn strings_from_the_json_are_escaped() {
        let mut s = Series::new("<script>alert('x')</script>");
        let mut p = Point::new("<img src=x onerror=alert(1)>");
        p.extra
            .insert("<k>".into(), serde_json::json!("\"quoted\" & <tag>"));
        s.points.push(p);
        let mut r = result("bench<script>", vec![s]);
        r.machine.kernel = "<script>k</script>".into();
        r.machine.cpu_model = Some("cpu & <co>".into());
        let html = render_html(&[entry("f\"<x>", r, FigureRef::File("a b#\"<>.png".into()))]);

        // The only script element is the page's own.
        assert_eq!(html.matches("<script>").count(), 1, "{html}");
        assert!(html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"));
        assert!(html.contains("bench&lt;script&gt;"));
        assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;"));
        assert!(!html.contains("<img src=x"));
        assert!(html.contains("<th>&lt;k&gt;</th>"));
        assert!(html.contains("&quot;quoted&quot; &amp; &lt;tag&gt;"));
        assert!(html.contains("&lt;script&gt;k&lt;/script&gt;"));
        assert!(html.contains("cpu &amp; &lt;co&gt;"));
        assert!(html.contains("&lt;b&gt;bold&lt;/b&gt;"));
        assert!(html.contains("f&quot;&lt;x&gt;.json"));
        // File names are URL-encoded, so they can neither break out of the attribute nor
        // turn into a fragment or query.
        assert!(
            html.contains("<img src=\"a%20b%23%22%3C%3E.png\""),
            "{html}"
        );
    }

    #[test]
    fn one_row_per_point_across_series() {
        let mut a = Series::new("batched");
        a.points = vec![full_point(1), full_point(2), full_point(4)];
        let mut b = Series::new("unbatched");
        b.points = vec![full_point(1), full_point(2)];
        let empty = Series::new("empty");
        let html = render_html(&[entry(
            "threads",
            result("threads", vec![a, b, empty]),
            FigureRef::File("threads.png".into()),
        )]);
        let rows = body_rows(&html, 0);
        assert_eq!(rows.len(), 5, "{html}");
        assert_eq!(rows.iter().filter(|r| r.contains("batched")).count(), 5);
        assert_eq!(rows.iter().filter(|r| r.contains("unbatched")).count(), 2);
        assert_eq!(
            rows[0],
            "<tr><td>batched</td><td class=\"num\">1</td>\
             <td class=\"num\">1,234,567</td><td class=\"num\">5,000</td>\
             <td class=\"num\">12.5</td><td class=\"num\">40.25</td>\
             <td class=\"num\">1,000</td></tr>"
        );
        assert!(html.contains("<th>threads</th>"));
        assert!(html.contains("<img src=\"threads.png\""));
    }

    #[test]
    fn absent_fields_are_dashes_not_zeros() {
        let mut s = Series::new("sparse");
        let mut only_ops = Point::new(1u32);
        only_ops.ops_per_sec = Some(10.0);
        only_ops
            .extra
            .insert("peer".into(), serde_json::json!("redis"));
        s.points.push(only_ops);
        s.points.push(full_point(2));
        s.points.push(Point::new("label"));
        let html = render_html(&[entry(
            "sparse",
            result("sparse", vec![s]),
            FigureRef::Missing("x values are labels".into()),
        )]);
        let rows = body_rows(&html, 0);
        assert_eq!(rows.len(), 3, "{html}");
        let dash = "<td class=\"absent\">—</td>";
        // ops only: MB/s, p50, p99 and `reads` absent; `peer` present.
        assert_eq!(rows[0].matches(dash).count(), 4, "{}", rows[0]);
        assert!(rows[0].contains("<td>redis</td>"));
        // Everything but `peer`.
        assert_eq!(rows[1].matches(dash).count(), 1, "{}", rows[1]);
        // Only the label.
        assert!(rows[2].contains("<td>label</td>"));
        assert_eq!(rows[2].matches(dash).count(), 6, "{}", rows[2]);
        assert!(!rows[2].contains(">0<"), "{}", rows[2]);
        // No figure is explained, and no image is invented.
        assert!(!html.contains("<img"));
        assert!(html.contains("No figure: x values are labels."));
    }

    #[test]
    fn machines_are_shown_once_each_and_unknowns_as_dashes() {
        let mut unknown = result("b", vec![]);
        unknown.machine = Machine {
            cores: 0,
            memory_bytes: 0,
            kernel: "unknown".into(),
            cpu_model: None,
        };
        let html = render_html(&[
            entry("a", result("a", vec![]), FigureRef::Missing("none".into())),
            entry("c", result("c", vec![]), FigureRef::Missing("none".into())),
            entry("b", unknown, FigureRef::Missing("none".into())),
        ]);
        assert_eq!(html.matches("<table class=\"machine\">").count(), 2);
        assert!(html.contains("<td>8.0 GiB</td>"));
        assert!(html.contains("<th>cores</th><td>—</td>"));
        assert!(html.contains("Used by: a, c"));
        assert!(html.contains("no points"));
        // Entries keep the given order.
        let a = html.find("<h2>a</h2>");
        let c = html.find("<h2>c</h2>");
        let b = html.find("<h2>b</h2>");
        assert!(a < c && c < b, "{a:?} {c:?} {b:?}");
    }

    #[test]
    fn the_page_is_self_contained() {
        let html = render_html(&[entry(
            "t",
            result("t", vec![]),
            FigureRef::File("t.png".into()),
        )]);
        for needle in ["http:", "https:", "<link", "@import", "src=\"/"] {
            assert!(!html.contains(needle), "{needle} in {html}");
        }
        assert!(html.contains("<style>"));
        assert!(html.contains("dataset.imagesLoaded"));
        assert!(render_html(&[]).contains("No benchmark results."));
    }

    #[test]
    fn numbers_are_readable() {
        assert_eq!(format_number(0.0), "0");
        assert_eq!(format_number(1.0), "1");
        assert_eq!(format_number(12.5), "12.5");
        assert_eq!(format_number(7.12345), "7.12");
        assert_eq!(format_number(812.54), "812.5");
        assert_eq!(format_number(1234.4), "1,234");
        assert_eq!(format_number(-1_234_567.8), "-1,234,568");
        assert_eq!(format_number(0.5), "0.5");
        assert_eq!(format_number(0.012345), "0.0123");
        assert_eq!(format_number(0.0012345), "0.00123");
        assert_eq!(format_number(1e-5), "1.000e-5");
        assert_eq!(format_number(2.5e18), "2.500e18");
        assert_eq!(format_number(f64::NAN), "NaN");
        assert_eq!(format_number(f64::INFINITY), "inf");
        assert_eq!(group_thousands("100"), "100");
        assert_eq!(group_thousands("-100000"), "-100,000");
        assert_eq!(format_binary_bytes(512), "512 B");
        assert_eq!(format_binary_bytes(3 << 20), "3.0 MiB");
    }

    #[test]
    fn extra_values_keep_their_type() {
        let mut s = Series::new("s");
        let mut p = Point::new(1u32);
        p.extra.insert("big".into(), serde_json::json!(u64::MAX));
        p.extra.insert("neg".into(), serde_json::json!(-4200));
        p.extra.insert("ratio".into(), serde_json::json!(0.25));
        p.extra.insert("ok".into(), serde_json::json!(true));
        p.extra.insert("list".into(), serde_json::json!([1, "<a>"]));
        p.extra
            .insert("nested".into(), serde_json::json!({"read": {"p99": 5}}));
        s.points.push(p);
        let html = render_html(&[entry(
            "s",
            result("s", vec![s]),
            FigureRef::Missing("n".into()),
        )]);
        assert!(html.contains("18,446,744,073,709,551,615"));
        assert!(html.contains("-4,200"));
        assert!(html.contains("<td class=\"num\">0.25</td>"));
        assert!(html.contains("<td>true</td>"));
        // Lists and objects read as text, never as raw JSON.
        assert!(html.contains("<td>1, &lt;a&gt;</td>"), "{html}");
        assert!(html.contains("<td>read: p99: 5</td>"), "{html}");
        assert!(!html.contains("{&quot;"), "{html}");
    }

    #[test]
    fn sides_comparisons_and_machine_are_under_the_figure() {
        let mut r = result("ycsb", vec![Series::new("camelot-resp")]);
        r.config = serde_json::json!({
            "x": "workload",
            "records": 50000,
            "peers": {"iperf3_bytes_per_sec": 1.5e9, "commands": ["iperf3 -c <host>"]},
            "targets": [{"label": "redis", "target": "Redis(127.0.0.1:1)"}],
            "sides": {
                "camelot-resp (in-process)": {
                    "server": "camelot", "process": "in-process", "server_threads": 1,
                    "nodes": 1, "version": "camelot 0.1.0", "flags": ["--threads", "1"],
                    "command": "DevCluster", "client": "redis crate", "client_threads": 16,
                    "depth": 1, "data_model": "a hash per record"
                },
                "redis": {
                    "server": "redis-server", "process": "separate", "server_threads": 1,
                    "nodes": 1, "version": "Redis server v=7.0.15 <b>", "flags": [],
                    "command": "redis-server --port 1", "client": "redis crate",
                    "client_threads": 16, "depth": 1, "data_model": "a hash per record"
                }
            }
        });
        r.comparisons.push(
            crate::schema::Comparison::new("YCSB A <throughput>", 120.0, 100.0, "ops/s", "redis")
                .with_target(1.0, false),
        );
        r.comparisons.push(
            crate::schema::Comparison::new("p99", 300.0, 200.0, "µs", "redis")
                .with_target(1.0, true),
        );
        let html = render_html(&[entry("ycsb", r, FigureRef::Missing("n".into()))]);
        let config = html.find("id=\"config-0\"").expect("config block");
        assert!(html
            .find("Camelot against its peers")
            .is_some_and(|c| c < config));
        assert!(html.contains("YCSB A &lt;throughput&gt;"), "{html}");
        assert!(html.contains("<td class=\"num\">1.20</td>"), "{html}");
        assert!(html.contains("class=\"met-yes\">yes") && html.contains("class=\"met-no\">no"));
        assert!(html.contains("<tr class=\"inproc\"><td>camelot-resp (in-process)</td>"));
        assert!(html.contains("Redis server v=7.0.15 &lt;b&gt;"));
        assert!(html.contains("16 × 1"));
        assert!(html.contains("machine: 2 cores"), "{html}");
        assert!(
            html.contains("<th>peers.iperf3_bytes_per_sec</th>"),
            "{html}"
        );
        assert!(
            html.contains("<th>targets.0.label</th><td>redis</td>"),
            "{html}"
        );
        assert!(html.contains("<td>iperf3 -c &lt;host&gt;</td>"), "{html}");
    }

    fn scratch(tag: &str) -> PathBuf {
        crate::scratch_dir(&format!("report-{tag}"))
    }

    #[test]
    fn write_report_draws_missing_figures_and_skips_strangers() -> Result<(), ResultsError> {
        let dir = scratch("write");
        let mut numeric = Series::new("batched");
        numeric.points = vec![full_point(1), full_point(2)];
        crate::output::write_result(&dir, &result("zeta", vec![numeric]))?;
        let mut labels = Series::new("peers");
        let mut p = Point::new("redis");
        p.ops_per_sec = Some(1.0);
        labels.points.push(p);
        crate::output::write_result(&dir, &result("alpha", vec![labels]))?;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ResultsError::Io { path, source }
        };
        let junk = dir.join("junk.json");
        std::fs::write(&junk, b"{\"not\": \"a result\"}").map_err(io(&junk))?;
        let notes = dir.join("notes.txt");
        std::fs::write(&notes, b"hello").map_err(io(&notes))?;

        let index = write_report(&dir, &[])?;
        assert_eq!(index, dir.join(INDEX_FILE));
        let html = std::fs::read_to_string(&index).map_err(io(&index))?;
        // Sorted by bench name; the numeric one got a figure drawn, the labelled one none.
        let alpha = html.find("<h2>alpha</h2>");
        let zeta = html.find("<h2>zeta</h2>");
        assert!(alpha.is_some() && alpha < zeta, "{html}");
        assert!(html.contains("<img src=\"zeta.png\""));
        assert!(std::fs::metadata(dir.join("zeta.png")).is_ok_and(|m| m.len() > 0));
        assert!(!dir.join("alpha.png").exists());
        assert!(!html.contains("junk"));

        // Same input, same page.
        write_report(&dir, &[])?;
        assert_eq!(std::fs::read_to_string(&index).map_err(io(&index))?, html);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn an_empty_or_missing_directory_is_an_error() -> Result<(), ResultsError> {
        let dir = scratch("empty");
        assert!(matches!(
            write_report(&dir, &[]),
            Err(ResultsError::Io { .. })
        ));
        std::fs::create_dir_all(&dir).map_err(|source| ResultsError::Io {
            path: dir.clone(),
            source,
        })?;
        assert!(matches!(
            write_report(&dir, &[]),
            Err(ResultsError::InvalidConfig(_))
        ));
        assert!(!dir.join(INDEX_FILE).exists());
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}
