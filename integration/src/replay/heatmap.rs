//! The sweep's PNG heatmap, drawn with `plotters`' bitmap backend. Labels
//! use a built-in 5×7 pixel font (upper-case letters, digits, a little
//! punctuation), so no system font is needed and the build stays offline.

use std::path::Path;

use plotters::prelude::*;

/// What to draw: `values[row][col]`, rows along `y_values`, columns along
/// `x_values`; `best` = (row, col) gets an outline.
pub struct Heatmap<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub x_values: Vec<String>,
    pub y_label: &'a str,
    pub y_values: Vec<String>,
    pub values: Vec<Vec<f64>>,
    /// Text of each cell (same shape as `values`).
    pub cells: Vec<Vec<String>>,
    pub best: (usize, usize),
    pub higher_is_better: bool,
}

const CELL_W: i32 = 120;
const CELL_H: i32 = 56;
const LEFT: i32 = 150;
const TOP: i32 = 70;
const BOTTOM: i32 = 110;
const RIGHT: i32 = 30;
const SCALE: i32 = 2;

/// Viridis anchors, worst (dark) to best (bright).
const COLORMAP: [(f64, f64, f64); 5] = [
    (68.0, 1.0, 84.0),
    (59.0, 82.0, 139.0),
    (33.0, 145.0, 140.0),
    (94.0, 201.0, 98.0),
    (253.0, 231.0, 37.0),
];

/// Colour of `t` ∈ [0, 1] (1 = best).
fn color(t: f64) -> RGBColor {
    let t = t.clamp(0.0, 1.0) * (COLORMAP.len() - 1) as f64;
    let i = (t.floor() as usize).min(COLORMAP.len() - 2);
    let f = t - i as f64;
    let (a, b) = (COLORMAP[i], COLORMAP[i + 1]);
    let mix = |x: f64, y: f64| (x + (y - x) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

impl Heatmap<'_> {
    /// Writes the PNG to `path`.
    pub fn render(&self, path: &Path) -> Result<(), String> {
        let cols = self.x_values.len() as i32;
        let rows = self.y_values.len() as i32;
        let width = (LEFT + cols * CELL_W + RIGHT).max(520) as u32;
        let height = (TOP + rows * CELL_H + BOTTOM) as u32;
        let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
        let fail = |e: &dyn std::fmt::Display| format!("heatmap {}: {e}", path.display());
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let flat: Vec<f64> = self.values.iter().flatten().copied().collect();
        let lo = flat.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = flat.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let goodness = |v: f64| {
            if hi - lo < 1e-12 {
                1.0
            } else if self.higher_is_better {
                (v - lo) / (hi - lo)
            } else {
                (hi - v) / (hi - lo)
            }
        };
        text(&root, 10, 12, self.title, &BLACK).map_err(|e| fail(&e))?;
        for (r, row) in self.values.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let x0 = LEFT + c as i32 * CELL_W;
                let y0 = TOP + r as i32 * CELL_H;
                let t = goodness(v);
                root.draw(&Rectangle::new(
                    [(x0, y0), (x0 + CELL_W - 2, y0 + CELL_H - 2)],
                    color(t).filled(),
                ))
                .map_err(|e| fail(&e))?;
                let ink = if t > 0.6 { &BLACK } else { &WHITE };
                let label = &self.cells[r][c];
                let tx = x0 + (CELL_W - text_width(label)) / 2;
                text(&root, tx, y0 + (CELL_H - 7 * SCALE) / 2, label, ink).map_err(|e| fail(&e))?;
                if (r, c) == self.best {
                    for inset in 0..4 {
                        root.draw(&Rectangle::new(
                            [
                                (x0 + inset, y0 + inset),
                                (x0 + CELL_W - 3 - inset, y0 + CELL_H - 3 - inset),
                            ],
                            ShapeStyle::from(&RED),
                        ))
                        .map_err(|e| fail(&e))?;
                    }
                }
            }
        }
        for (r, label) in self.y_values.iter().enumerate() {
            let y = TOP + r as i32 * CELL_H + (CELL_H - 7 * SCALE) / 2;
            text(&root, LEFT - 12 - text_width(label), y, label, &BLACK).map_err(|e| fail(&e))?;
        }
        for (c, label) in self.x_values.iter().enumerate() {
            let x = LEFT + c as i32 * CELL_W + (CELL_W - text_width(label)) / 2;
            text(&root, x, TOP + rows * CELL_H + 8, label, &BLACK).map_err(|e| fail(&e))?;
        }
        let x_title = LEFT + (cols * CELL_W - text_width(self.x_label)) / 2;
        text(
            &root,
            x_title,
            TOP + rows * CELL_H + 34,
            self.x_label,
            &BLACK,
        )
        .map_err(|e| fail(&e))?;
        text(&root, 10, TOP - 26, self.y_label, &BLACK).map_err(|e| fail(&e))?;
        let legend = "BRIGHT = BETTER, RED OUTLINE = BEST";
        text(&root, 10, TOP + rows * CELL_H + 66, legend, &BLACK).map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
        Ok(())
    }
}

/// Pixel width of `s` in the built-in font.
fn text_width(s: &str) -> i32 {
    s.chars().count() as i32 * 6 * SCALE - SCALE
}

/// Draws `s` with its top-left corner at (x, y).
fn text<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x: i32,
    y: i32,
    s: &str,
    ink: &RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    for (i, ch) in s.chars().enumerate() {
        let gx = x + i as i32 * 6 * SCALE;
        for (row, bits) in glyph(ch).iter().enumerate() {
            for col in 0..5 {
                if bits & (0x10 >> col) != 0 {
                    let px = gx + col * SCALE;
                    let py = y + row as i32 * SCALE;
                    // One pixel wider than the grid cell: a slightly bold face.
                    area.draw(&Rectangle::new(
                        [(px, py), (px + SCALE, py + SCALE - 1)],
                        ink.filled(),
                    ))?;
                }
            }
        }
    }
    Ok(())
}

/// 5×7 glyph rows, top first, bit 4 = leftmost column. Lower case draws as
/// upper case; unknown characters as `?`.
fn glyph(ch: char) -> [u8; 7] {
    match ch.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        ' ' => [0; 7],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        '*' => [0, 0x04, 0x15, 0x0E, 0x15, 0x04, 0],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        _ => [0x0E, 0x11, 0x01, 0x02, 0x04, 0, 0x04],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colormap_runs_dark_to_bright() {
        let lum = |c: RGBColor| u32::from(c.0) + u32::from(c.1) + u32::from(c.2);
        assert!(lum(color(0.0)) < lum(color(0.5)) && lum(color(0.5)) < lum(color(1.0)));
        assert_eq!(color(1.0), RGBColor(253, 231, 37));
    }
}
