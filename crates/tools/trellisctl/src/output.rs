//! Printing a command's result: every result is a serde struct (the JSON document, field names
//! stable for scripts) that also knows its table form.

use std::io::Write as _;

use serde::Serialize;

use crate::cli::OutputFormat;
use crate::error::CtlError;

/// A command's result.
pub trait Report: Serialize {
    /// The human-readable form, ending in a newline.
    fn table(&self) -> String;
}

/// The text `report` prints as in `format`.
pub fn render<R: Report>(report: &R, format: OutputFormat) -> Result<String, CtlError> {
    match format {
        OutputFormat::Table => Ok(report.table()),
        OutputFormat::Json => serde_json::to_string_pretty(report)
            .map(|mut json| {
                json.push('\n');
                json
            })
            .map_err(|e| CtlError::Failed(format!("cannot encode the JSON output: {e}"))),
    }
}

/// Writes `report` to stdout. A closed stdout (`trellisctl status | head -1`) is not an error.
pub fn emit<R: Report>(report: &R, format: OutputFormat) -> Result<(), CtlError> {
    let text = render(report, format)?;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CtlError::Failed(format!("cannot write to stdout: {e}")))
        }
        _ => Ok(()),
    }
}
