//! Hand-rolled fixed-width text: tables with a header row and left-aligned columns separated by
//! two spaces, and aligned "key  value" blocks. Empty cells print as `-`; no trailing spaces.

/// A table being built.
#[derive(Debug, Clone, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row; missing cells are empty, extra cells are dropped.
    pub fn row<I, S>(&mut self, cells: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut row: Vec<String> = cells
            .into_iter()
            .take(self.headers.len())
            .map(|c| clean(&c.into()))
            .collect();
        row.resize(self.headers.len(), "-".into());
        self.rows.push(row);
    }

    /// Whether no row was added.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, one line per row after the header, each ending in a newline.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| width(h)).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(width(cell));
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.headers).chain(&self.rows) {
            let mut text = String::new();
            for (i, (cell, w)) in line.iter().zip(&widths).enumerate() {
                if i > 0 {
                    text.push_str("  ");
                }
                text.push_str(cell);
                text.extend(std::iter::repeat_n(' ', w - width(cell)));
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// "key  value" lines with the values aligned, indented by two spaces.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let key_width = pairs.iter().map(|(k, _)| width(k)).max().unwrap_or(0);
    let mut out = String::new();
    for (key, value) in pairs {
        let line = format!("  {key:<key_width$}  {}", clean(value));
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A section heading followed by its body.
pub fn section(title: &str, body: &str) -> String {
    format!("{title}\n{body}")
}

fn width(text: &str) -> usize {
    text.chars().count()
}

/// One line, never empty.
fn clean(cell: &str) -> String {
    let one_line: String = cell
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let trimmed = one_line.trim();
    if trimmed.is_empty() {
        "-".into()
    } else {
        trimmed.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_to_the_widest_cell() {
        let mut t = Table::new(&["CLUSTER", "KIND", "ORIGIN"]);
        t.row(["leaf-a", "full", ""]);
        t.row(["leaf-c-long-name", "induced", "hub"]);
        assert_eq!(
            t.render(),
            "CLUSTER           KIND     ORIGIN\n\
             leaf-a            full     -\n\
             leaf-c-long-name  induced  hub\n"
        );
    }

    #[test]
    fn short_rows_are_padded_and_newlines_flattened() {
        let mut t = Table::new(&["A", "B"]);
        t.row(["x\ny"]);
        assert!(!t.is_empty());
        assert_eq!(t.render(), "A    B\nx y  -\n");
        assert!(Table::new(&["A"]).is_empty());
    }

    #[test]
    fn fields_align_values() {
        assert_eq!(
            fields(&[("ID", "hub".into()), ("NAME", String::new())]),
            "  ID    hub\n  NAME  -\n"
        );
    }
}
