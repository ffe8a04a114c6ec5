//! The parsing of one result file into its type in [`crate::results`], with the run and machine
//! every result carries, or the reason there is nothing to show.

use serde::Deserialize;

use super::inputs::{Inputs, Loaded};
use crate::results::Header;

/// A parsed result with where it came from.
pub(super) struct Parsed<T> {
    pub(super) path: String,
    pub(super) common: Header,
    pub(super) doc: T,
}

/// Parses benchmark `name`, or says why there is nothing to show.
pub(super) fn parse<T: for<'de> Deserialize<'de>>(
    inputs: &Inputs,
    name: &str,
) -> Result<Parsed<T>, String> {
    match inputs.results.get(name) {
        None | Some(Loaded::Missing) => Err(format!(
            "no result (`bench/results/{name}.json` does not exist: the benchmark has not been run)"
        )),
        Some(Loaded::Unreadable { path, error }) => Err(format!("`{path}` is unreadable: {error}")),
        Some(Loaded::Found { path, value }) => {
            let common = Header::deserialize(value).unwrap_or_default();
            match T::deserialize(value) {
                Ok(doc) => Ok(Parsed {
                    path: path.clone(),
                    common,
                    doc,
                }),
                Err(e) => Err(format!("`{path}` does not have the expected shape: {e}")),
            }
        }
    }
}
