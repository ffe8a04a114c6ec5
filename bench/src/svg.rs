//! A small SVG chart writer for the benchmark plots: line charts (linear or log axes) and
//! grouped bar charts. Written here rather than pulled in (`plotters` would add a dozen
//! crates and a font stack to the workspace for four plots). Output is deterministic (fixed
//! decimals, no timestamps), so the committed plots can be compared with regenerated ones.

use std::fmt::Write as _;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// How an axis maps values to positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Base 10; non-positive values are left out.
    Log,
}

/// One named line of points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (e.g. a fitted or reference line).
    pub dashed: bool,
}

/// A chart of lines with markers.
#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_scale: Scale,
    pub y_scale: Scale,
    pub series: Vec<Series>,
}

/// Groups of bars: one group per category, one bar per series.
#[derive(Debug, Clone)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub y_scale: Scale,
    pub categories: Vec<String>,
    /// Series name and one value per category (`None`: not measured, no bar).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

/// Escapes text for XML.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A value on an axis: fixed decimals (deterministic) without trailing zeros.
fn label(v: f64) -> String {
    let s = if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// An axis: the range it shows and where its ticks are.
#[derive(Debug, Clone)]
struct Axis {
    scale: Scale,
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Axis {
    fn new(scale: Scale, values: impl Iterator<Item = f64>, from_zero: bool) -> Self {
        let values: Vec<f64> = values
            .filter(|v| v.is_finite() && (scale == Scale::Linear || *v > 0.0))
            .collect();
        let (mut lo, mut hi) = values
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(*v), hi.max(*v))
            });
        if values.is_empty() {
            (lo, hi) = (1.0, 10.0);
        }
        match scale {
            Scale::Linear => {
                if from_zero {
                    lo = lo.min(0.0);
                }
                if hi <= lo {
                    hi = lo + 1.0;
                }
                let raw = (hi - lo) / 5.0;
                let mag = 10f64.powf(raw.log10().floor());
                let step = [1.0, 2.0, 5.0, 10.0]
                    .iter()
                    .map(|m| m * mag)
                    .find(|s| *s >= raw)
                    .unwrap_or(10.0 * mag);
                lo = (lo / step).floor() * step;
                hi = (hi / step).ceil() * step;
                let n = ((hi - lo) / step).round() as i64;
                let ticks = (0..=n).map(|i| lo + i as f64 * step).collect();
                Self {
                    scale,
                    lo,
                    hi,
                    ticks,
                }
            }
            Scale::Log => {
                let (dlo, dhi) = (
                    lo.log10().floor(),
                    hi.log10().ceil().max(lo.log10().floor() + 1.0),
                );
                let decades = (dhi - dlo) as i64;
                let mut ticks = Vec::new();
                for d in 0..=decades {
                    let base = 10f64.powf(dlo + d as f64);
                    ticks.push(base);
                    // Few decades: 2 and 5 between them too.
                    if decades <= 2 && d < decades {
                        ticks.push(2.0 * base);
                        ticks.push(5.0 * base);
                    }
                }
                Self {
                    scale,
                    lo: 10f64.powf(dlo),
                    hi: 10f64.powf(dhi),
                    ticks,
                }
            }
        }
    }

    /// Position of `v` in 0..=1 along the axis.
    fn fraction(&self, v: f64) -> Option<f64> {
        match self.scale {
            Scale::Linear => Some((v - self.lo) / (self.hi - self.lo)),
            Scale::Log if v > 0.0 => {
                Some((v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()))
            }
            Scale::Log => None,
        }
    }
}

fn header(out: &mut String, title: &str) {
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH:.0}\" height=\"{HEIGHT:.0}\" \
         viewBox=\"0 0 {WIDTH:.0} {HEIGHT:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{:.1}\" y=\"28\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        WIDTH / 2.0,
        escape(title)
    );
}

fn plot_w() -> f64 {
    WIDTH - LEFT - RIGHT
}

fn plot_h() -> f64 {
    HEIGHT - TOP - BOTTOM
}

fn y_axis(out: &mut String, axis: &Axis, title: &str) {
    for t in &axis.ticks {
        let Some(f) = axis.fraction(*t) else { continue };
        let y = TOP + plot_h() * (1.0 - f);
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            LEFT + plot_w(),
            LEFT - 6.0,
            y + 4.0,
            label(*t)
        );
    }
    let _ = writeln!(
        out,
        "<text transform=\"translate(20 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n\
         <rect x=\"{LEFT:.1}\" y=\"{TOP:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#333\"/>",
        TOP + plot_h() / 2.0,
        escape(title),
        plot_w(),
        plot_h()
    );
}

fn legend(out: &mut String, names: &[(String, bool)]) {
    for (i, (name, dashed)) in names.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 20.0;
        let x = LEFT + plot_w() + 15.0;
        let color = COLORS[i % COLORS.len()];
        let dash = if *dashed {
            " stroke-dasharray=\"5 3\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<line x1=\"{x:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"{color}\" stroke-width=\"3\"{dash}/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            x + 20.0,
            x + 26.0,
            y + 4.0,
            escape(name)
        );
    }
}

/// Renders a line chart.
pub fn line_chart(chart: &LineChart) -> String {
    let points = || chart.series.iter().flat_map(|s| s.points.iter());
    let x = Axis::new(chart.x_scale, points().map(|p| p.0), false);
    let y = Axis::new(chart.y_scale, points().map(|p| p.1), true);
    let mut out = String::new();
    header(&mut out, &chart.title);
    y_axis(&mut out, &y, &chart.y_label);
    for t in &x.ticks {
        let Some(f) = x.fraction(*t) else { continue };
        let px = LEFT + plot_w() * f;
        let _ = writeln!(
            out,
            "<line x1=\"{px:.1}\" y1=\"{TOP:.1}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\
             <text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            TOP + plot_h(),
            TOP + plot_h() + 18.0,
            label(*t)
        );
    }
    let _ = writeln!(
        out,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
        LEFT + plot_w() / 2.0,
        HEIGHT - 18.0,
        escape(&chart.x_label)
    );
    for (i, s) in chart.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let coords: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter_map(|(px, py)| {
                Some((
                    LEFT + plot_w() * x.fraction(*px)?,
                    TOP + plot_h() * (1.0 - y.fraction(*py)?),
                ))
            })
            .filter(|(a, b)| a.is_finite() && b.is_finite())
            .collect();
        let path: Vec<String> = coords
            .iter()
            .map(|(a, b)| format!("{a:.1},{b:.1}"))
            .collect();
        let dash = if s.dashed {
            " stroke-dasharray=\"5 3\""
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
            escape(&s.name),
            path.join(" ")
        );
        if !s.dashed {
            for (a, b) in &coords {
                let _ = writeln!(
                    out,
                    "<circle cx=\"{a:.1}\" cy=\"{b:.1}\" r=\"3.5\" fill=\"{color}\"/>"
                );
            }
        }
    }
    let names: Vec<(String, bool)> = chart
        .series
        .iter()
        .map(|s| (s.name.clone(), s.dashed))
        .collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

/// Renders a grouped bar chart; missing values leave a gap marked "n/m" (not measured).
pub fn bar_chart(chart: &BarChart) -> String {
    let values = chart
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied());
    let y = Axis::new(chart.y_scale, values, true);
    let mut out = String::new();
    header(&mut out, &chart.title);
    y_axis(&mut out, &y, &chart.y_label);
    let groups = chart.categories.len().max(1) as f64;
    let group_w = plot_w() / groups;
    let bars = chart.series.len().max(1) as f64;
    let bar_w = group_w * 0.8 / bars;
    let base = match y.scale {
        Scale::Linear => y.fraction(0.0).unwrap_or(0.0).clamp(0.0, 1.0),
        Scale::Log => 0.0,
    };
    for (c, category) in chart.categories.iter().enumerate() {
        let gx = LEFT + group_w * c as f64;
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            gx + group_w / 2.0,
            TOP + plot_h() + 18.0,
            escape(category)
        );
        for (s, (name, values)) in chart.series.iter().enumerate() {
            let bx = gx + group_w * 0.1 + bar_w * s as f64;
            let color = COLORS[s % COLORS.len()];
            match values.get(c).copied().flatten().and_then(|v| y.fraction(v)) {
                Some(f) => {
                    let f = f.clamp(0.0, 1.0);
                    let (top, bottom) = (TOP + plot_h() * (1.0 - f), TOP + plot_h() * (1.0 - base));
                    let _ = writeln!(
                        out,
                        "<rect class=\"bar\" data-series=\"{}\" data-category=\"{}\" x=\"{bx:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\"/>",
                        escape(name),
                        escape(category),
                        top.min(bottom),
                        bar_w * 0.9,
                        (bottom - top).abs()
                    );
                }
                None => {
                    let _ = writeln!(
                        out,
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"9\" fill=\"#888\">n/m</text>",
                        bx + bar_w * 0.45,
                        TOP + plot_h() - 4.0
                    );
                }
            }
        }
    }
    let names: Vec<(String, bool)> = chart
        .series
        .iter()
        .map(|(n, _)| (n.clone(), false))
        .collect();
    legend(&mut out, &names);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_chart_names_every_series_and_closes() {
        let svg = line_chart(&LineChart {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Linear,
            series: vec![
                Series {
                    name: "measured".into(),
                    points: vec![(2.0, 0.5), (10.0, 1.5), (50.0, 8.0)],
                    dashed: false,
                },
                Series {
                    name: "fit".into(),
                    points: vec![(2.0, 0.4), (50.0, 9.0)],
                    dashed: true,
                },
            ],
        });
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt; b"));
        assert!(svg.contains("data-name=\"measured\""));
        assert!(svg.contains("data-name=\"fit\""));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn empty_and_missing_values_do_not_break_the_chart() {
        let svg = bar_chart(&BarChart {
            title: "t".into(),
            y_label: "ms".into(),
            y_scale: Scale::Log,
            categories: vec!["a".into(), "b".into()],
            series: vec![("p50".into(), vec![Some(0.3), None])],
        });
        assert_eq!(svg.matches("class=\"bar\"").count(), 1);
        assert!(svg.contains("n/m"));
        let empty = line_chart(&LineChart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_scale: Scale::Linear,
            y_scale: Scale::Log,
            series: vec![],
        });
        assert!(empty.ends_with("</svg>\n"));
        assert!(!empty.contains("NaN"));
    }

    #[test]
    fn axis_labels_are_short() {
        assert_eq!(label(2.0), "2");
        assert_eq!(label(0.5), "0.5");
        assert_eq!(label(2.5), "2.5");
        assert_eq!(label(1000.0), "1000");
    }
}
