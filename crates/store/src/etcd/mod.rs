//! [`EtcdStore`]: the production [`Store`] on etcd's v3 API.

mod auth;
mod errors;
mod keys;
mod watcher;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, CompareOp, ConnectOptions, GetOptions, PutOptions, TxnOp};

use crate::Store;
use crate::error::StoreError;
use crate::kv::{KeyValue, LeaseId, Listing, Revision, RevisionListing};
use crate::txn::{Compare, Op, Txn, TxnOutcome};
use crate::watch::WatchStream;
use errors::{from_etcd, header_revision, is_compacted, request, request_raw};
use keys::Keys;

pub use auth::{EtcdAuth, EtcdTls};

/// How long [`EtcdStore::connect`] waits for etcd to answer before giving up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Keys per request when listing, so a large prefix never hits gRPC's message size limit.
const LIST_PAGE: i64 = 1000;

/// How often a listing restarts when etcd compacts away the revision it is paging at.
const LIST_ATTEMPTS: usize = 3;

/// A [`Store`] on an etcd cluster, with every key under an optional prefix.
///
/// Clones share one connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    keys: Keys,
    endpoints: Arc<[String]>,
}

impl EtcdStore {
    /// Connects to etcd at `endpoints` (`host:port` each) and checks that it answers.
    ///
    /// Every key the caller uses is stored under `/<prefix>/` (no prefix if `prefix` is
    /// empty), so several services can share one etcd without seeing each other's keys.
    /// Fails with [`StoreError::Unavailable`] if etcd does not answer within five seconds.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, StoreError> {
        Self::connect_with(endpoints, prefix, false, &EtcdAuth::default()).await
    }

    /// [`EtcdStore::connect`] over TLS when `tls` (with `auth.tls`, required then) and with
    /// `auth.user`'s credentials when given.
    pub async fn connect_with(
        endpoints: &[String],
        prefix: &str,
        tls: bool,
        auth: &EtcdAuth,
    ) -> Result<Self, StoreError> {
        if endpoints.is_empty() {
            return Err(StoreError::InvalidUrl("no etcd endpoints given".to_owned()));
        }
        let listing = endpoints.join(",");
        let hint = auth.hint(tls);
        let unreachable = |reason: String| {
            let login = if auth.user.is_none() && reason.contains("user name is empty") {
                "; etcd requires authentication: set --store-user and TRELLIS_STORE_PASSWORD"
            } else {
                ""
            };
            StoreError::Unavailable(format!(
                "cannot reach etcd at {listing}: {reason}{hint}{login}"
            ))
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            // Detects a dead connection under a quiet watch; etcd refuses pings more often
            // than every 5 s.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        match (tls, &auth.tls) {
            (true, Some(settings)) => options = options.with_tls(settings.client_config()),
            (true, None) => {
                return Err(StoreError::InvalidUrl(
                    "etcds:// needs the CA that signed etcd's server certificate \
                     (--store-ca-cert)"
                        .into(),
                ));
            }
            (false, Some(_)) => {
                return Err(StoreError::InvalidUrl(
                    "TLS settings (--store-ca-cert, --store-cert, --store-key) need an \
                     etcds:// URL"
                        .into(),
                ));
            }
            (false, None) => {}
        }
        if let Some((user, password)) = &auth.user {
            options = options.with_user(user.clone(), password.clone());
        }
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| {
                if tls {
                    format!("https://{e}")
                } else {
                    e.clone()
                }
            })
            .collect();
        let client = Client::connect(&endpoints, Some(options))
            .await
            .map_err(|err| match err {
                etcd_client::Error::InvalidUri(err) => {
                    StoreError::InvalidUrl(format!("etcd endpoints {listing:?}: {err}"))
                }
                err => unreachable(err.to_string()),
            })?;
        let store = Self {
            client,
            keys: Keys::new(prefix),
            endpoints: endpoints.clone().into(),
        };
        // The client connects lazily: one linearizable read proves etcd is up and has a
        // leader before the service starts relying on it.
        let probe = store.keys.full("");
        let probe = if probe.is_empty() {
            b"/".to_vec()
        } else {
            probe
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, store.client.kv_client().get(probe, None)).await
        {
            Ok(Ok(_)) => {}
            Ok(Err(err)) => return Err(unreachable(err.to_string())),
            Err(_) => {
                return Err(unreachable(format!(
                    "no answer within {}s",
                    CONNECT_TIMEOUT.as_secs()
                )));
            }
        }
        tracing::info!(endpoints = %listing, prefix = store.keys.prefix(), "connected to etcd");
        Ok(store)
    }

    /// One consistent listing, paged at the revision of the first page; with `keys_only`, the
    /// values are left empty (etcd sends none).
    async fn list_at_one_revision(
        &self,
        start: &[u8],
        end: &[u8],
        keys_only: bool,
    ) -> Result<Result<Listing, etcd_client::Error>, StoreError> {
        let mut kv = self.client.kv_client();
        let mut from = start.to_vec();
        let mut revision = 0;
        let mut kvs = Vec::new();
        loop {
            let mut options = GetOptions::new().with_range(end).with_limit(LIST_PAGE);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            if keys_only {
                options = options.with_keys_only();
            }
            let page = match request_raw("list", kv.get(from, Some(options))).await? {
                Ok(page) => page,
                Err(err) => return Ok(Err(err)),
            };
            if revision == 0 {
                revision = header_revision("list", page.header())?;
            }
            for item in page.kvs() {
                kvs.push(self.keys.kv(item)?);
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    // The next page starts right after the last key of this one.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(Ok(Listing { kvs, revision })),
            }
        }
    }

    /// [`Store::list`], or with `keys_only` the same without values: restarted when etcd
    /// compacts under a paged listing.
    async fn list_with(&self, prefix: &str, keys_only: bool) -> Result<Listing, StoreError> {
        let (start, end) = self.keys.range(prefix);
        let mut attempt = 1;
        loop {
            match self.list_at_one_revision(&start, &end, keys_only).await? {
                Ok(listing) => return Ok(listing),
                Err(err) if is_compacted(&err) && attempt < LIST_ATTEMPTS => {
                    tracing::debug!(
                        prefix,
                        attempt,
                        "etcd compacted under a paged listing; restarting it"
                    );
                    attempt += 1;
                }
                Err(err) => return Err(from_etcd("list", err, None)),
            }
        }
    }

    fn txn_op(&self, op: Op) -> TxnOp {
        match op {
            Op::Put { key, value, lease } => TxnOp::put(
                self.keys.full(&key),
                value,
                lease.map(|lease| PutOptions::new().with_lease(lease.0)),
            ),
            Op::Delete { key } => TxnOp::delete(self.keys.full(&key), None),
        }
    }
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.keys.prefix())
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let mut kv = self.client.kv_client();
        let response = request("get", None, kv.get(self.keys.full(key), None)).await?;
        response
            .kvs()
            .first()
            .map(|item| self.keys.kv(item))
            .transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.list_with(prefix, false).await
    }

    async fn list_revisions(&self, prefix: &str) -> Result<RevisionListing, StoreError> {
        Ok(self.list_with(prefix, true).await?.into())
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        let mut kv = self.client.kv_client();
        let response = request("put", None, kv.put(self.keys.full(key), value, None)).await?;
        header_revision("put", response.header())
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut kv = self.client.kv_client();
        let response = request("delete", None, kv.delete(self.keys.full(key), None)).await?;
        Ok(response.deleted() > 0)
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        // If etcd rejects a lease, it is the (usually only) one the transaction uses.
        let lease = txn
            .success
            .iter()
            .chain(&txn.failure)
            .find_map(|op| match op {
                Op::Put { lease, .. } => *lease,
                Op::Delete { .. } => None,
            });
        let compares: Vec<_> = txn
            .compares
            .into_iter()
            .map(|compare| match compare {
                // A missing key's mod_revision is 0 to etcd, which is how "absent" works.
                Compare::ModRevision { key, revision } => etcd_client::Compare::mod_revision(
                    self.keys.full(&key),
                    CompareOp::Equal,
                    revision,
                ),
                Compare::Value { key, value } => {
                    etcd_client::Compare::value(self.keys.full(&key), CompareOp::Equal, value)
                }
            })
            .collect();
        let success: Vec<_> = txn.success.into_iter().map(|op| self.txn_op(op)).collect();
        let failure: Vec<_> = txn.failure.into_iter().map(|op| self.txn_op(op)).collect();
        let request_txn = etcd_client::Txn::new()
            .when(compares)
            .and_then(success)
            .or_else(failure);
        let mut kv = self.client.kv_client();
        let response = request("txn", lease, kv.txn(request_txn)).await?;
        Ok(TxnOutcome {
            succeeded: response.succeeded(),
            revision: header_revision("txn", response.header())?,
        })
    }

    async fn watch(
        &self,
        prefix: &str,
        start: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        watcher::watch(&self.client, &self.keys, prefix, start).await
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        // etcd counts whole seconds; rounding down could turn a short TTL into none.
        let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let seconds = i64::try_from(seconds.max(1)).unwrap_or(i64::MAX);
        let mut lease = self.client.lease_client();
        let response = request("lease grant", None, lease.grant(seconds, None)).await?;
        if !response.error().is_empty() {
            return Err(StoreError::Internal(format!(
                "etcd lease grant: {}",
                response.error()
            )));
        }
        Ok(LeaseId(response.id()))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut client = self.client.lease_client();
        // Opens a keep-alive stream, refreshes once and waits for etcd's answer; dropping the
        // stream afterwards closes it.
        request("lease keep-alive", Some(lease), client.keep_alive(lease.0)).await?;
        Ok(())
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut client = self.client.lease_client();
        request("lease revoke", Some(lease), client.revoke(lease.0)).await?;
        Ok(())
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        let mut kv = self.client.kv_client();
        let options = PutOptions::new().with_lease(lease.0);
        let response = request(
            "put",
            Some(lease),
            kv.put(self.keys.full(key), value, Some(options)),
        )
        .await?;
        header_revision("put", response.header())
    }
}
