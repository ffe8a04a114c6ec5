//! Where [`Backoff`] used to live; it is part of the retry policy now ([`crate::retry`]).
//! Kept so that code written against this path still builds.

pub use crate::retry::Backoff;
