//! Compare-and-swap transactions.

use crate::kv::{LeaseId, Revision};

/// A condition on one key, checked atomically with the transaction's writes.
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key was last modified at `revision`; revision 0 means the key must not exist.
    ModRevision {
        /// The key to check.
        key: String,
        /// The expected `mod_revision`, or 0 for "absent".
        revision: Revision,
    },
    /// The key exists and holds exactly `value`.
    Value {
        /// The key to check.
        key: String,
        /// The expected value.
        value: Vec<u8>,
    },
}

impl Compare {
    /// The key does not exist.
    pub fn absent(key: impl Into<String>) -> Self {
        Self::ModRevision {
            key: key.into(),
            revision: 0,
        }
    }

    /// The key was last modified at `revision` (0: does not exist).
    pub fn mod_revision(key: impl Into<String>, revision: Revision) -> Self {
        Self::ModRevision {
            key: key.into(),
            revision,
        }
    }

    /// The key exists and holds exactly `value`.
    pub fn value(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self::Value {
            key: key.into(),
            value: value.into(),
        }
    }

    /// The key the condition is about.
    pub fn key(&self) -> &str {
        match self {
            Self::ModRevision { key, .. } | Self::Value { key, .. } => key,
        }
    }
}

/// A write inside a transaction.
#[derive(Debug, Clone)]
pub enum Op {
    /// Sets the key, attached to `lease` if given (a put without a lease detaches any).
    Put {
        /// The key to set.
        key: String,
        /// The new value.
        value: Vec<u8>,
        /// The lease to attach the key to.
        lease: Option<LeaseId>,
    },
    /// Deletes the key if it exists.
    Delete {
        /// The key to delete.
        key: String,
    },
}

impl Op {
    /// Sets `key` to `value`, without a lease.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    /// Sets `key` to `value`, attached to `lease`.
    pub fn put_with_lease(
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> Self {
        Self::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    /// Deletes `key`.
    pub fn delete(key: impl Into<String>) -> Self {
        Self::Delete { key: key.into() }
    }

    /// The key the operation writes.
    pub fn key(&self) -> &str {
        match self {
            Self::Put { key, .. } | Self::Delete { key } => key,
        }
    }
}

/// An atomic "if all compares hold then `success` else `failure`".
///
/// ```
/// use trellis_store::{Compare, Op, Txn};
/// let create = Txn::new()
///     .when(Compare::absent("leader"))
///     .then(Op::put("leader", "node-1"));
/// # let _ = create;
/// ```
#[derive(Debug, Clone, Default)]
pub struct Txn {
    /// Conditions that must all hold for `success` to run.
    pub compares: Vec<Compare>,
    /// Writes applied when every compare holds.
    pub success: Vec<Op>,
    /// Writes applied otherwise.
    pub failure: Vec<Op>,
}

impl Txn {
    /// An empty transaction (no compares: the success branch runs).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a condition.
    #[must_use]
    pub fn when(mut self, compare: Compare) -> Self {
        self.compares.push(compare);
        self
    }

    /// Adds a write to the success branch.
    #[must_use]
    pub fn then(mut self, op: Op) -> Self {
        self.success.push(op);
        self
    }

    /// Adds a write to the failure branch.
    #[must_use]
    pub fn otherwise(mut self, op: Op) -> Self {
        self.failure.push(op);
        self
    }
}

/// The most compares, or writes per branch, one transaction may hold: etcd's default
/// `--max-txn-ops`. etcd refuses a larger transaction ("too many operations in txn request"),
/// so the memory store does too, and code that writes many records splits them into
/// transactions of at most this size ([`Txn::chunks`]).
pub const MAX_TXN_OPS: usize = 128;

impl Txn {
    /// What is wrong with the transaction's size, if anything (see [`MAX_TXN_OPS`]).
    pub fn oversize(&self) -> Option<String> {
        let sizes = [
            ("compares", self.compares.len()),
            ("success ops", self.success.len()),
            ("failure ops", self.failure.len()),
        ];
        sizes
            .iter()
            .find(|(_, n)| *n > MAX_TXN_OPS)
            .map(|(what, n)| {
                format!("too many operations in txn request: {n} {what}, at most {MAX_TXN_OPS}")
            })
    }

    /// Splits guarded writes into transactions that each fit [`MAX_TXN_OPS`]: every item is a
    /// group of compares and success ops that must commit together (e.g. a record's revision
    /// guard and its put), `shared` compares are repeated in every chunk. A group larger than a
    /// chunk on its own is an error (the caller's bug).
    pub fn chunks(
        shared: &[Compare],
        groups: Vec<(Vec<Compare>, Vec<Op>)>,
    ) -> Result<Vec<Txn>, String> {
        let mut out = Vec::new();
        let mut current = Txn {
            compares: shared.to_vec(),
            ..Txn::default()
        };
        let mut pending = false;
        for (compares, ops) in groups {
            if shared.len() + compares.len() > MAX_TXN_OPS || ops.len() > MAX_TXN_OPS {
                return Err(format!(
                    "one group of {} compares and {} ops does not fit a transaction of {MAX_TXN_OPS}",
                    shared.len() + compares.len(),
                    ops.len()
                ));
            }
            if current.compares.len() + compares.len() > MAX_TXN_OPS
                || current.success.len() + ops.len() > MAX_TXN_OPS
            {
                out.push(std::mem::replace(
                    &mut current,
                    Txn {
                        compares: shared.to_vec(),
                        ..Txn::default()
                    },
                ));
            }
            current.compares.extend(compares);
            current.success.extend(ops);
            pending = true;
        }
        if pending {
            out.push(current);
        }
        Ok(out)
    }
}

/// What a transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Whether every compare held (so the success branch ran).
    pub succeeded: bool,
    /// The store revision after the transaction (its own revision if it wrote anything).
    pub revision: Revision,
}

/// The first key written twice by one branch, which etcd rejects.
pub(crate) fn duplicate_key(ops: &[Op]) -> Option<&str> {
    let mut seen = std::collections::HashSet::new();
    ops.iter().map(Op::key).find(|key| !seen.insert(*key))
}
