//! Figures: side-by-side panels of lines, written as PNG or SVG with plotters.
//!
//! The font is embedded so a figure renders the same on a bare CI machine as on a desktop.

use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::error::ResultsError;
use crate::schema::{BenchResult, Point, Series};

const PANEL_WIDTH_PX: u32 = 640;
const PANEL_HEIGHT_PX: u32 = 480;
const TITLE_HEIGHT_PX: u32 = 40;
const FONT_FAMILY: &str = "sans-serif";

/// Values beyond these magnitudes cannot be placed on an axis without overflowing the
/// range arithmetic, so they are skipped like NaN: plotters asserts its ranges are not NaN,
/// and on a log axis whose end/start ratio overflows to infinity it loops forever.
const PLOT_ABS_MAX: f64 = 1e300;
const PLOT_LOG_MAX: f64 = 1e150;
const PLOT_LOG_MIN: f64 = 1e-150;
/// A span this small relative to the values is a single value as far as ticks go.
const SPAN_RELATIVE_MIN: f64 = 1e-9;
const SPAN_ABS_MIN: f64 = 1e-200;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

static FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static FONT_REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();

fn ensure_font() -> Result<(), ResultsError> {
    FONT_REGISTERED
        .get_or_init(|| {
            plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT_BYTES)
                .map_err(|_| "the embedded DejaVuSans font cannot be parsed".to_string())
        })
        .clone()
        .map_err(ResultsError::Plot)
}

/// A titled row of panels.
#[derive(Debug, Clone)]
pub struct Figure {
    title: String,
    panels: Vec<Panel>,
}

impl Figure {
    pub fn new(title: &str) -> Figure {
        Figure {
            title: title.to_string(),
            panels: Vec::new(),
        }
    }

    pub fn panel(mut self, p: Panel) -> Figure {
        self.panels.push(p);
        self
    }

    pub fn save_png(&self, path: &Path) -> Result<(), ResultsError> {
        ensure_font()?;
        let root = BitMapBackend::new(path, self.size_px()).into_drawing_area();
        self.render(&root)
            .map_err(|e| ResultsError::Plot(format!("{}: {e}", path.display())))
    }

    pub fn save_svg(&self, path: &Path) -> Result<(), ResultsError> {
        ensure_font()?;
        let root = SVGBackend::new(path, self.size_px()).into_drawing_area();
        self.render(&root)
            .map_err(|e| ResultsError::Plot(format!("{}: {e}", path.display())))
    }

    fn size_px(&self) -> (u32, u32) {
        let columns = u32::try_from(self.panels.len().max(1)).unwrap_or(u32::MAX);
        (
            PANEL_WIDTH_PX.saturating_mul(columns),
            PANEL_HEIGHT_PX + TITLE_HEIGHT_PX,
        )
    }

    fn render<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let body = root
            .titled(&self.title, (FONT_FAMILY, 24))
            .map_err(|e| e.to_string())?;
        if self.panels.is_empty() {
            let (width, height) = body.dim_in_pixel();
            let centre = (
                i32::try_from(width / 2).unwrap_or(0),
                i32::try_from(height / 2).unwrap_or(0),
            );
            let style = TextStyle::from((FONT_FAMILY, 20).into_font())
                .pos(Pos::new(HPos::Center, VPos::Center));
            body.draw_text("no data", &style, centre)
                .map_err(|e| e.to_string())?;
        } else {
            let areas = body.split_evenly((1, self.panels.len()));
            for (area, panel) in areas.iter().zip(&self.panels) {
                panel.render(area)?;
            }
        }
        root.present().map_err(|e| e.to_string())
    }
}

/// One chart: axes, lines with markers, a legend.
#[derive(Debug, Clone)]
pub struct Panel {
    title: String,
    x_label: String,
    y_label: String,
    log_x: bool,
    log_y: bool,
    lines: Vec<Line>,
    /// Horizontal dashed lines at a constant y: a peer measured in the same run, or a
    /// machine limit, each with its label in the legend.
    references: Vec<(String, f64)>,
    /// When set, x values are indices into these names and each line is drawn as bars
    /// grouped by category (throughput per workload, one bar per target).
    categories: Option<Vec<String>>,
}

/// Legend rows' height as a fraction of the plotting area, and the room the legend's
/// border and padding take: the top of the y axis is raised so the data stays below the
/// legend instead of under it.
const LEGEND_ROW_FRACTION: f64 = 0.055;
const LEGEND_PAD_FRACTION: f64 = 0.04;
/// More of the panel than this the legend may not claim; past it, it overlaps.
const LEGEND_FRACTION_MAX: f64 = 0.6;
/// Integer x axes with at most this many values get one tick per value.
const INTEGER_TICKS_MAX: usize = 12;

#[derive(Debug, Clone)]
struct Line {
    label: String,
    points: Vec<(f64, f64)>,
}

/// `(x, f(point))` for every point of `series` whose x is a number and that has the value.
pub fn series_points(series: &Series, f: impl Fn(&Point) -> Option<f64>) -> Vec<(f64, f64)> {
    series
        .points
        .iter()
        .filter_map(|p| Some((p.x.as_f64()?, f(p)?)))
        .collect()
}

impl Panel {
    /// The p50 and p99 latency lines of `series`, labelled "<series> p50" and "<series> p99".
    pub fn percentile_lines(self, series: &Series) -> Panel {
        self.line(
            &format!("{} p50", series.label),
            series_points(series, |p| p.latency_us.as_ref().map(|l| l.p50)),
        )
        .line(
            &format!("{} p99", series.label),
            series_points(series, |p| p.latency_us.as_ref().map(|l| l.p99)),
        )
    }

    pub fn new(title: &str, x_label: &str, y_label: &str) -> Panel {
        Panel {
            title: title.to_string(),
            x_label: x_label.to_string(),
            y_label: y_label.to_string(),
            log_x: false,
            log_y: false,
            lines: Vec::new(),
            references: Vec::new(),
            categories: None,
        }
    }

    /// The result's references for `metric` (`bytes_per_sec`, `ops_per_sec`,
    /// `latency_us.p50`; a `latency_us.` prefix takes every percentile), each value times
    /// `scale` to match this panel's unit (1e-6 for MB/s).
    pub fn references_from(mut self, result: &BenchResult, metric: &str, scale: f64) -> Panel {
        for r in &result.references {
            let wanted = if metric.ends_with('.') {
                r.metric.starts_with(metric)
            } else {
                r.metric == metric
            };
            if wanted {
                self = self.reference(&r.label, r.value * scale);
            }
        }
        self
    }

    /// A labelled horizontal reference line at `y` (a peer's figure, a machine limit).
    pub fn reference(mut self, label: &str, y: f64) -> Panel {
        self.references.push((label.to_string(), y));
        self
    }

    /// Draws grouped bars over named categories: a line's point `(i, y)` is its bar in
    /// category `i`.
    pub fn bars(mut self, categories: Vec<String>) -> Panel {
        self.categories = Some(categories);
        // Bars grow from zero, which a log axis does not have.
        self.log_x = false;
        self.log_y = false;
        self
    }

    pub fn log_y(mut self) -> Panel {
        self.log_y = true;
        self
    }

    pub fn log_x(mut self) -> Panel {
        self.log_x = true;
        self
    }

    pub fn line(mut self, label: &str, points: Vec<(f64, f64)>) -> Panel {
        self.lines.push(Line {
            label: label.to_string(),
            points,
        });
        self
    }

    /// The lines with every point that cannot be placed on these axes removed.
    fn plottable_lines(&self) -> Vec<Line> {
        self.lines
            .iter()
            .map(|line| Line {
                label: line.label.clone(),
                points: line
                    .points
                    .iter()
                    .copied()
                    .filter(|&(x, y)| plottable(x, self.log_x) && plottable(y, self.log_y))
                    .collect(),
            })
            .collect()
    }

    /// The reference lines that can be placed on this panel's y axis.
    fn plottable_references(&self) -> Vec<(String, f64)> {
        self.references
            .iter()
            .filter(|(_, y)| plottable(*y, self.log_y))
            .cloned()
            .collect()
    }

    fn legend_rows(&self, lines: &[Line], references: &[(String, f64)]) -> usize {
        lines.len() + references.len()
    }

    fn render<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let lines = self.plottable_lines();
        let references = self.plottable_references();
        let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
        let ys = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.1))
            .chain(references.iter().map(|r| r.1));
        let x_range = match &self.categories {
            Some(c) => -0.5..(c.len().max(1) as f64 - 0.5),
            None => axis_range(xs, self.log_x, false),
        };
        // Rates start at zero so their ratios can be read off the chart.
        let y_range = axis_range(ys, self.log_y, true);
        let rows = self.legend_rows(&lines, &references);
        let y_range = with_legend_room(y_range, self.log_y, rows);
        match (self.log_x, self.log_y) {
            (false, false) => self.draw(area, &lines, x_range, y_range),
            (true, false) => self.draw(area, &lines, x_range.log_scale(), y_range),
            (false, true) => self.draw(area, &lines, x_range, y_range.log_scale()),
            (true, true) => self.draw(area, &lines, x_range.log_scale(), y_range.log_scale()),
        }
    }

    fn draw<DB, XS, YS>(
        &self,
        area: &DrawingArea<DB, Shift>,
        lines: &[Line],
        x_spec: XS,
        y_spec: YS,
    ) -> Result<(), String>
    where
        DB: DrawingBackend,
        XS: AsRangedCoord<Value = f64>,
        YS: AsRangedCoord<Value = f64>,
        XS::CoordDescType: ValueFormatter<f64>,
        YS::CoordDescType: ValueFormatter<f64>,
    {
        let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, (FONT_FAMILY, 20))
            .margin(12)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(x_spec, y_spec)
            .map_err(err)?;
        let category_tick = |v: &f64| -> String {
            let Some(names) = &self.categories else {
                return format_tick(*v);
            };
            let i = v.round();
            if (v - i).abs() > 0.01 || i < 0.0 {
                return String::new();
            }
            names.get(i as usize).cloned().unwrap_or_default()
        };
        let integer_x = self.categories.is_none() && all_integers(lines);
        let integer_tick = |v: &f64| -> String {
            // Threads and streams come in whole numbers: a tick between two is noise.
            if (v - v.round()).abs() > 1e-9 {
                String::new()
            } else {
                format_tick(*v)
            }
        };
        let mut mesh = chart.configure_mesh();
        if let Some(names) = &self.categories {
            // One tick per category, so every label lands on its group.
            mesh.x_labels(names.len().max(1) * 2 + 1);
        } else if integer_x && !self.log_x {
            let distinct = distinct_xs(lines);
            if distinct <= INTEGER_TICKS_MAX {
                mesh.x_labels(distinct.max(2));
            }
        }
        mesh.x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FONT_FAMILY, 13))
            .axis_desc_style((FONT_FAMILY, 15))
            .x_label_formatter(if integer_x {
                &integer_tick
            } else {
                &category_tick
            })
            .y_label_formatter(&|v| format_tick(*v))
            .draw()
            .map_err(err)?;

        if self.categories.is_some() {
            let width = 0.8 / lines.len().max(1) as f64;
            for (i, line) in lines.iter().enumerate() {
                let colour = PALETTE[i % PALETTE.len()];
                let left = -0.4 + i as f64 * width;
                chart
                    .draw_series(line.points.iter().map(|&(x, y)| {
                        Rectangle::new(
                            [(x + left, 0.0), (x + left + width * 0.9, y)],
                            colour.filled(),
                        )
                    }))
                    .map_err(err)?
                    .label(line.label.as_str())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 15, y + 5)], colour.filled())
                    });
            }
        }
        for (i, line) in lines
            .iter()
            .enumerate()
            .filter(|_| self.categories.is_none())
        {
            let colour = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().copied(),
                    colour.stroke_width(2),
                ))
                .map_err(err)?
                .label(line.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
            // Marker shapes cycle too, so lines stay apart when printed without colour.
            let points = line.points.iter().copied();
            match (i / PALETTE.len() + i) % 3 {
                0 => chart
                    .draw_series(points.map(|p| Circle::new(p, 4, colour.filled())))
                    .map(|_| ()),
                1 => chart
                    .draw_series(points.map(|p| TriangleMarker::new(p, 5, colour.filled())))
                    .map(|_| ()),
                _ => chart
                    .draw_series(points.map(|p| Cross::new(p, 4, colour.stroke_width(2))))
                    .map(|_| ()),
            }
            .map_err(err)?;
        }

        let references = self.plottable_references();
        let (x_lo, x_hi) = match &self.categories {
            Some(c) => (-0.5, c.len().max(1) as f64 - 0.5),
            None => {
                let xs: Vec<f64> = lines
                    .iter()
                    .flat_map(|l| l.points.iter().map(|p| p.0))
                    .collect();
                let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if lo.is_finite() && hi.is_finite() {
                    (lo, hi)
                } else {
                    (0.0, 1.0)
                }
            }
        };
        for (i, (label, y)) in references.iter().enumerate() {
            // Grey shades, darker first, so references never look like a measured series.
            let shade = 90 + 40 * (i % 3) as u8;
            let colour = RGBColor(shade, shade, shade);
            let legend = format!("{label}: {}", format_tick(*y));
            chart
                .draw_series(DashedLineSeries::new(
                    [(x_lo, *y), (x_hi, *y)],
                    8,
                    5,
                    colour.stroke_width(2),
                ))
                .map_err(err)?
                .label(legend)
                .legend(move |(x, y)| {
                    plotters::element::DashedPathElement::new(
                        vec![(x, y), (x + 20, y)],
                        5,
                        3,
                        colour.stroke_width(2),
                    )
                });
        }

        if !lines.is_empty() || !references.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font((FONT_FAMILY, 13))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(err)?;
        }
        Ok(())
    }
}

/// Raises the top of `range` so that the legend's `rows`, drawn in the upper corner, sit
/// above every data point instead of over them.
fn with_legend_room(range: Range<f64>, log: bool, rows: usize) -> Range<f64> {
    if rows == 0 {
        return range;
    }
    let legend = (LEGEND_PAD_FRACTION + LEGEND_ROW_FRACTION * rows as f64).min(LEGEND_FRACTION_MAX);
    let keep = 1.0 - legend;
    if log {
        let (lo, hi) = (range.start.log10(), range.end.log10());
        let top = lo + (hi - lo) / keep;
        let end = 10f64.powf(top);
        if end.is_finite() && end <= PLOT_LOG_MAX {
            return range.start..end;
        }
        return range;
    }
    let end = range.start + (range.end - range.start) / keep;
    if end.is_finite() && end.abs() <= PLOT_ABS_MAX {
        range.start..end
    } else {
        range
    }
}

fn all_integers(lines: &[Line]) -> bool {
    let mut any = false;
    for (x, _) in lines.iter().flat_map(|l| &l.points) {
        any = true;
        if (x - x.round()).abs() > 1e-9 {
            return false;
        }
    }
    any
}

fn distinct_xs(lines: &[Line]) -> usize {
    let mut xs: Vec<f64> = lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    xs.len()
}

fn plottable(v: f64, log: bool) -> bool {
    if log {
        (PLOT_LOG_MIN..=PLOT_LOG_MAX).contains(&v)
    } else {
        v.is_finite() && v.abs() <= PLOT_ABS_MAX
    }
}

/// An axis range holding every value with some room around it. `values` are plottable.
fn axis_range(values: impl Iterator<Item = f64>, log: bool, from_zero: bool) -> Range<f64> {
    let bounds = values.fold(None, |acc: Option<(f64, f64)>, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    });
    let Some((min, max)) = bounds else {
        return if log { 1.0..10.0 } else { 0.0..1.0 };
    };
    if log {
        // Whole decades: the grid lines then fall on round numbers.
        let lo = 10f64.powf(min.log10().floor());
        let hi = 10f64.powf(max.log10().ceil());
        let lo = if lo > 0.0 && lo <= min { lo } else { min };
        let hi = if hi.is_finite() && hi >= max { hi } else { max };
        return if hi > lo { lo..hi } else { lo..lo * 10.0 };
    }
    let magnitude = min.abs().max(max.abs());
    let span = max - min;
    if span <= SPAN_ABS_MIN.max(magnitude * SPAN_RELATIVE_MIN) {
        let pad = if magnitude > SPAN_ABS_MIN {
            magnitude * 0.1
        } else {
            1.0
        };
        if from_zero && min >= 0.0 {
            return 0.0..(max + pad).max(1e-300);
        }
        return (min - pad)..(max + pad);
    }
    if from_zero && min >= 0.0 {
        return 0.0..max + span * 0.1;
    }
    let pad = span * 0.05;
    (min - pad)..(max + pad)
}

/// Short tick labels: 1.5k, 20M, 0.25, 1e-5.
fn format_tick(v: f64) -> String {
    let magnitude = v.abs();
    if v == 0.0 {
        return "0".to_string();
    }
    if !v.is_finite() {
        return format!("{v}");
    }
    let (scaled, suffix) = if magnitude >= 1e12 {
        return format!("{v:.1e}");
    } else if magnitude >= 1e9 {
        (v / 1e9, "G")
    } else if magnitude >= 1e6 {
        (v / 1e6, "M")
    } else if magnitude >= 1e3 {
        (v / 1e3, "k")
    } else if magnitude >= 1e-3 {
        (v, "")
    } else {
        return format!("{v:.1e}");
    };
    let text = format!("{scaled:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{suffix}")
}

/// The standard figure of a result whose x values are numbers: latency (p50 and p99 per
/// series, log scale), throughput in ops/s, and bandwidth in GB/s when any point has bytes.
/// Panels without data are left out.
pub fn standard_figure(result: &BenchResult) -> Figure {
    let x_label = result
        .config
        .get("x")
        .and_then(|x| x.as_str())
        .unwrap_or("x");

    let mut latency = Panel::new("latency", x_label, "latency (µs)").log_y();
    let mut throughput = Panel::new("throughput", x_label, "ops/s");
    let mut bandwidth = Panel::new("bandwidth", x_label, "GB/s");
    let (mut has_latency, mut has_ops, mut has_bytes) = (false, false, false);

    for series in &result.series {
        let has_p50 = series
            .points
            .iter()
            .any(|p| p.x.as_f64().is_some() && p.latency_us.is_some());
        let ops = series_points(series, |p| p.ops_per_sec);
        let gb = series_points(series, |p| p.bytes_per_sec.map(|v| v / 1e9));
        if has_p50 {
            has_latency = true;
            latency = latency.percentile_lines(series);
        }
        if !ops.is_empty() {
            has_ops = true;
            throughput = throughput.line(&series.label, ops);
        }
        if !gb.is_empty() {
            has_bytes = true;
            bandwidth = bandwidth.line(&series.label, gb);
        }
    }

    throughput = throughput.references_from(result, "ops_per_sec", 1.0);
    bandwidth = bandwidth.references_from(result, "bytes_per_sec", 1e-9);
    latency = latency.references_from(result, "latency_us.", 1.0);

    let mut figure = Figure::new(&result.bench);
    if has_latency {
        figure = figure.panel(latency);
    }
    if has_ops {
        figure = figure.panel(throughput);
    }
    if has_bytes {
        figure = figure.panel(bandwidth);
    }
    figure
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{now_rfc3339, LatencySummary, Point, Series};
    use proptest::prelude::*;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "camelot-bench-plot-{tag}-{}-{nanos}",
            std::process::id()
        ));
        let _ = std::fs::create_dir_all(&dir);
        dir
    }

    fn assert_written(path: &Path) {
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        assert!(size > 0, "{} is missing or empty", path.display());
    }

    fn save_both(figure: &Figure, dir: &Path, name: &str) -> Result<(), ResultsError> {
        let png = dir.join(format!("{name}.png"));
        let svg = dir.join(format!("{name}.svg"));
        figure.save_png(&png)?;
        figure.save_svg(&svg)?;
        assert_written(&png);
        assert_written(&svg);
        Ok(())
    }

    #[test]
    fn figures_are_written_including_degenerate_ones() -> Result<(), ResultsError> {
        let dir = scratch("figs");
        let normal = Figure::new("normal")
            .panel(
                Panel::new("latency", "threads", "µs")
                    .log_y()
                    .line("a", vec![(1.0, 10.0), (2.0, 12.0), (4.0, 30.0)])
                    .line("b", vec![(1.0, 100.0), (2.0, 500.0), (4.0, 2000.0)]),
            )
            .panel(
                Panel::new("throughput", "threads", "ops/s")
                    .line("a", vec![(1.0, 1e6), (2.0, 1.9e6), (4.0, 3.5e6)]),
            );
        save_both(&normal, &dir, "normal")?;

        save_both(&Figure::new("no panels"), &dir, "no-panels")?;
        save_both(
            &Figure::new("empty").panel(Panel::new("empty", "x", "y").log_x().log_y()),
            &dir,
            "empty",
        )?;
        save_both(
            &Figure::new("empty line").panel(Panel::new("p", "x", "y").line("none", vec![])),
            &dir,
            "empty-line",
        )?;
        save_both(
            &Figure::new("single").panel(Panel::new("p", "x", "y").line("one", vec![(3.0, 7.0)])),
            &dir,
            "single",
        )?;
        save_both(
            &Figure::new("single log").panel(
                Panel::new("p", "x", "y")
                    .log_x()
                    .log_y()
                    .line("one", vec![(100.0, 1000.0)]),
            ),
            &dir,
            "single-log",
        )?;
        let awkward = vec![
            (0.0, 0.0),
            (-1.0, -5.0),
            (f64::NAN, 1.0),
            (1.0, f64::INFINITY),
            (f64::NEG_INFINITY, 2.0),
            (2.0, f64::MAX),
            (3.0, 4.0),
        ];
        save_both(
            &Figure::new("awkward log").panel(
                Panel::new("p", "x", "y")
                    .log_x()
                    .log_y()
                    .line("awkward", awkward.clone()),
            ),
            &dir,
            "awkward-log",
        )?;
        save_both(
            &Figure::new("awkward linear")
                .panel(Panel::new("p", "x", "y").line("awkward", awkward)),
            &dir,
            "awkward-linear",
        )?;
        // A log axis spanning ~490 decades once sent plotters into an endless loop.
        save_both(
            &Figure::new("vast").panel(Panel::new("p", "x", "y").log_y().line(
                "vast",
                vec![(0.0, 2.07e220), (1.0, 1.7e-266), (2.0, 1e-149)],
            )),
            &dir,
            "vast",
        )?;
        save_both(
            &Figure::new("only bad").panel(
                Panel::new("p", "x", "y")
                    .log_y()
                    .line("bad", vec![(1.0, 0.0), (2.0, -1.0), (f64::NAN, f64::NAN)]),
            ),
            &dir,
            "only-bad",
        )?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn saving_into_a_missing_directory_is_an_error() {
        let dir = scratch("missing");
        let path = dir.join("no/such/dir/f.png");
        let figure = Figure::new("f").panel(Panel::new("p", "x", "y").line("a", vec![(1.0, 1.0)]));
        assert!(matches!(figure.save_png(&path), Err(ResultsError::Plot(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn sample_result() -> BenchResult {
        let mut with_all = Series::new("batched");
        let mut plain = Series::new("plain");
        for threads in [1u32, 2, 4] {
            let t = f64::from(threads);
            let mut p = Point::new(threads);
            p.ops_per_sec = Some(1e6 * t);
            p.bytes_per_sec = Some(2e9 * t);
            p.latency_us = Some(LatencySummary {
                p50: 10.0 * t,
                p90: 20.0 * t,
                p99: 40.0 * t,
                p999: 80.0 * t,
                max: 100.0 * t,
            });
            with_all.points.push(p);
            let mut q = Point::new(threads);
            q.ops_per_sec = Some(5e5 * t);
            plain.points.push(q);
        }
        plain.points.push(Point::new("label x is skipped"));
        BenchResult::new(
            "sample",
            now_rfc3339(),
            serde_json::json!({"x": "threads"}),
            vec![with_all, plain],
        )
    }

    #[test]
    fn the_legend_gets_room_above_the_data() {
        // Two rows of legend on a 0..100 axis: the data's top must sit below the legend.
        let r = with_legend_room(0.0..100.0, false, 2);
        let legend = LEGEND_PAD_FRACTION + 2.0 * LEGEND_ROW_FRACTION;
        assert!(
            (100.0 - r.start) / (r.end - r.start) <= 1.0 - legend + 1e-9,
            "{r:?}"
        );
        assert_eq!(with_legend_room(0.0..100.0, false, 0), 0.0..100.0);
        // Log axes in decades, and never past what can be drawn.
        let r = with_legend_room(1.0..1000.0, true, 1);
        assert!(r.end > 1000.0 && r.end.is_finite(), "{r:?}");
        let huge = with_legend_room(1.0..PLOT_LOG_MAX, true, 50);
        assert!(huge.end <= PLOT_LOG_MAX);
    }

    #[test]
    fn integer_axes_are_recognised() {
        let line = |xs: &[f64]| Line {
            label: "l".into(),
            points: xs.iter().map(|&x| (x, 1.0)).collect(),
        };
        assert!(all_integers(&[line(&[1.0, 2.0, 64.0])]));
        assert!(!all_integers(&[line(&[1.0, 2.5])]));
        assert!(!all_integers(&[line(&[])]));
        assert_eq!(distinct_xs(&[line(&[1.0, 2.0]), line(&[2.0, 4.0])]), 3);
    }

    #[test]
    fn references_are_drawn_and_only_where_they_fit() -> Result<(), ResultsError> {
        let dir = crate::scratch_dir("plot-refs");
        std::fs::create_dir_all(&dir).map_err(|source| ResultsError::Io {
            path: dir.clone(),
            source,
        })?;
        let panel = Panel::new("p", "threads", "ops/s")
            .line("camelot", vec![(1.0, 10.0), (2.0, 20.0)])
            .reference("redis", 15.0)
            .reference("nan", f64::NAN);
        assert_eq!(panel.plottable_references().len(), 1);
        let log = Panel::new("p", "x", "y").log_y().reference("zero", 0.0);
        assert!(log.plottable_references().is_empty());
        let figure = Figure::new("refs").panel(panel).panel(log);
        figure.save_png(&dir.join("refs.png"))?;
        figure.save_svg(&dir.join("refs.svg"))?;
        let svg =
            std::fs::read_to_string(dir.join("refs.svg")).map_err(|source| ResultsError::Io {
                path: dir.clone(),
                source,
            })?;
        assert!(svg.contains("redis: 15"), "the reference is in the legend");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn standard_figure_has_the_panels_with_data() -> Result<(), ResultsError> {
        let result = sample_result();
        let figure = standard_figure(&result);
        assert_eq!(figure.title, "sample");
        let titles: Vec<&str> = figure.panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(titles, ["latency", "throughput", "bandwidth"]);
        let latency_labels: Vec<&str> = figure.panels[0]
            .lines
            .iter()
            .map(|l| l.label.as_str())
            .collect();
        assert_eq!(latency_labels, ["batched p50", "batched p99"]);
        assert_eq!(figure.panels[1].y_label, "ops/s");
        assert_eq!(figure.panels[1].x_label, "threads");
        assert_eq!(figure.panels[2].lines[0].points[0], (1.0, 2.0));
        assert!(figure.panels[0].log_y);

        let dir = scratch("standard");
        save_both(&figure, &dir, "sample")?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn standard_figure_leaves_out_empty_panels() {
        let mut series = Series::new("only ops");
        let mut p = Point::new(1u32);
        p.ops_per_sec = Some(3.0);
        series.points.push(p);
        let result = BenchResult::new("ops", now_rfc3339(), serde_json::json!({}), vec![series]);
        let figure = standard_figure(&result);
        assert_eq!(figure.panels.len(), 1);
        assert_eq!(figure.panels[0].title, "throughput");
        assert_eq!(figure.panels[0].x_label, "x");

        let empty = BenchResult::new("none", now_rfc3339(), serde_json::json!({}), vec![]);
        assert!(standard_figure(&empty).panels.is_empty());
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(format_tick(0.0), "0");
        assert_eq!(format_tick(1500.0), "1.5k");
        assert_eq!(format_tick(2e6), "2M");
        assert_eq!(format_tick(0.25), "0.25");
        assert_eq!(format_tick(-3e9), "-3G");
        assert_eq!(format_tick(1e-5), "1.0e-5");
    }

    fn any_value() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<f64>(),
            -1e3f64..1e3,
            Just(0.0),
            Just(f64::MIN_POSITIVE),
            Just(5e-324),
            Just(f64::MAX),
            Just(1e-149),
            Just(1e149),
            Just(1e-266),
            Just(1e220),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn rendering_never_fails(
            lines in proptest::collection::vec(
                proptest::collection::vec((any_value(), any_value()), 0..6), 0..4),
            log_x in any::<bool>(),
            log_y in any::<bool>(),
        ) {
            ensure_font().map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut panel = Panel::new("p", "x", "y");
            if log_x { panel = panel.log_x(); }
            if log_y { panel = panel.log_y(); }
            for (i, points) in lines.into_iter().enumerate() {
                panel = panel.line(&format!("l{i}"), points);
            }
            let figure = Figure::new("prop").panel(panel);
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, figure.size_px()).into_drawing_area();
                figure.render(&root).map_err(TestCaseError::fail)?;
            }
            prop_assert!(!svg.is_empty());
        }
    }
}
