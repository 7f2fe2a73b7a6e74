//! The chart of `--plot`: throughput against size, a line per system, a panel per (op,
//! concurrency), SVG or PNG.

use std::fmt;
use std::path::Path;

use anyhow::{bail, Context};

use super::{human_size, CellResult, Op};

/// Draws throughput against size, a line per system, a panel per (op, concurrency); SVG or PNG
/// by the file's extension.
pub fn plot(results: &[CellResult], path: &Path) -> anyhow::Result<()> {
    use plotters::prelude::*;

    register_font()?;
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default().to_ascii_lowercase();
    let mut concurrencies: Vec<u32> = results.iter().map(|r| r.concurrency).collect();
    concurrencies.sort_unstable();
    concurrencies.dedup();
    let (width, height) = (420 * concurrencies.len().max(1) as u32, 720u32);
    match extension.as_str() {
        "svg" => {
            let root = SVGBackend::new(path, (width, height)).into_drawing_area();
            draw(&root, results, &concurrencies)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        "png" => {
            let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
            draw(&root, results, &concurrencies)?;
            root.present().with_context(|| format!("writing {}", path.display()))?;
        }
        _ => bail!("--plot {}: the file must end in .svg or .png", path.display()),
    }
    Ok(())
}

fn draw<DB: plotters::prelude::DrawingBackend>(
    root: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    results: &[CellResult],
    concurrencies: &[u32],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;

    let fail = |e: &dyn fmt::Display| anyhow::anyhow!("drawing the chart: {e}");
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut sizes: Vec<u64> = results.iter().map(|r| r.size_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut systems: Vec<&str> = Vec::new();
    for r in results {
        if !systems.contains(&r.system.as_str()) {
            systems.push(&r.system);
        }
    }
    let panels = root.split_evenly((2, concurrencies.len().max(1)));
    for (i, panel) in panels.iter().enumerate() {
        let op = if i / concurrencies.len().max(1) == 0 { Op::Write } else { Op::Read };
        let Some(&concurrency) = concurrencies.get(i % concurrencies.len().max(1)) else { continue };
        let cells: Vec<&CellResult> = results.iter().filter(|r| r.op == op && r.concurrency == concurrency).collect();
        let top = cells.iter().map(|r| r.throughput_mib_s).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{} x{concurrency}", op.name()), ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(-0.5f64..(sizes.len() as f64 - 0.5), 0f64..top)
            .map_err(|e| fail(&e))?;
        let labels = sizes.clone();
        chart
            .configure_mesh()
            .x_labels(sizes.len().max(1))
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).map(|s| human_size(*s)).unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("MiB/s")
            .draw()
            .map_err(|e| fail(&e))?;
        for (s, system) in systems.iter().enumerate() {
            let color = Palette99::pick(s).to_rgba();
            let points: Vec<(f64, f64)> = sizes
                .iter()
                .enumerate()
                .filter_map(|(x, size)| {
                    cells
                        .iter()
                        .find(|r| r.system == *system && r.size_bytes == *size)
                        .map(|r| (x as f64, r.throughput_mib_s))
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(*system)
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
pub(crate) fn register_font() -> anyhow::Result<()> {
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
