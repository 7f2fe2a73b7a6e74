//! The charts of `--plot`: panels of lines over a few labelled points on x (sizes, steps), a line
//! per series with a point where it has a value, written as SVG or PNG by the file's extension.

use std::path::Path;

use anyhow::{bail, Context};

/// One panel: a line per series over the same labelled x positions.
pub(crate) struct Panel {
    pub title: String,
    /// The y axis' unit.
    pub unit: String,
    /// What each x position is.
    pub labels: Vec<String>,
    /// Each series' name and its value at each x position (None: no point there).
    pub series: Vec<(String, Vec<Option<f64>>)>,
}

/// Draws `panels` in a grid of `rows` x `columns` into `path` (`.svg` or `.png`) of `size` pixels.
pub(crate) fn save(
    path: &Path,
    size: (u32, u32),
    (rows, columns): (usize, usize),
    panels: &[Panel],
) -> anyhow::Result<()> {
    use plotters::prelude::*;

    register_font()?;
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    match extension.as_str() {
        "svg" => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            draw(&root, (rows, columns), panels)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        "png" => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            draw(&root, (rows, columns), panels)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        _ => bail!("--plot {}: the file must end in .svg or .png", path.display()),
    }
    Ok(())
}

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    grid: (usize, usize),
    panels: &[Panel],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;

    let fail = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the chart: {e}");
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    for (area, panel) in root.split_evenly(grid).iter().zip(panels) {
        let values = panel.series.iter().flat_map(|(_, v)| v.iter().flatten().copied());
        let top = values.filter(|v| v.is_finite()).fold(1.0, f64::max) * 1.15;
        let labels = &panel.labels;
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5f64..(labels.len() as f64 - 0.5), 0f64..top)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_labels(labels.len().max(1))
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(&panel.unit)
            .draw()
            .map_err(|e| fail(&e))?;
        for (k, (name, values)) in panel.series.iter().enumerate() {
            let color = Palette99::pick(k).to_rgba();
            let points: Vec<(f64, f64)> = values
                .iter()
                .enumerate()
                .filter_map(|(x, v)| v.filter(|v| v.is_finite()).map(|v| (x as f64, v)))
                .collect();
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled()))).map_err(|e| fail(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| fail(&e))?;
    }
    Ok(())
}

/// Plotters needs a font to lay out text; use the first common sans TTF on this machine.
fn register_font() -> anyhow::Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            const CANDIDATES: [&str; 5] = [
                "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/TTF/DejaVuSans.ttf",
                "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
            ];
            let bytes = CANDIDATES.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
                format!(
                    "--plot needs a TrueType font and found none of {}; install one with \
                     `apt-get install fonts-dejavu-core`",
                    CANDIDATES.join(", ")
                )
            })?;
            // Registered once per process, so leaking it is bounded.
            let bytes: &'static [u8] = bytes.leak();
            plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, bytes)
                .map_err(|_| "the font could not be loaded".to_string())
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}
