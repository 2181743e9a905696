//! How the store keeps keys: plain, or hashed (`idempotency.set_key_storage`).

use super::{cache, layout, layout_is, relation_oid, update_cache, PinnedSearchPath};
use crate::error::raise;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;
use sha2::Digest;

/// How the store keeps keys (`idempotency.config`, changed by `set_key_storage`).
#[derive(Clone, Copy)]
pub(crate) enum KeyStorage {
    Plain,
    /// HMAC-SHA256 under this secret of the key's SHA-256 ([`crate::signing::hashed_key`]).
    Keyed([u8; 32]),
    /// Release 0.2.0's plain SHA-256: a store not yet updated to 0.3.0 (no secret column).
    Sha256,
}

/// Locks the store against a concurrent switch of the key storage (which takes an ACCESS
/// EXCLUSIVE lock and invalidates the layout when it commits), then tells how keys are
/// stored. Taking the lock first processes any pending invalidation, so the answer holds
/// until the end of the transaction.
pub(crate) fn key_storage() -> KeyStorage {
    let l = layout();
    // SAFETY: locks a relation by an OID the catalog just gave (a relation dropped meanwhile is
    // a clean ERROR); the lock is held to the end of the transaction, as a reader's is.
    unsafe { pg_sys::LockRelationOid(l.relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    let l = layout();
    if let Some(h) = cache().key_storage {
        return h;
    }
    let config = relation_oid(c"config");
    let storage = if config == pg_sys::InvalidOid {
        KeyStorage::Plain
    } else {
        // SAFETY: as above.
        let has_secret = unsafe { pg_sys::get_attnum(config, c"key_secret".as_ptr()) } > 0;
        let query = if has_secret {
            "SELECT c.key_storage OPERATOR(pg_catalog.=) 'sha256', c.key_secret \
               FROM idempotency.config AS c"
        } else {
            "SELECT c.key_storage OPERATOR(pg_catalog.=) 'sha256', NULL::pg_catalog.bytea \
               FROM idempotency.config AS c"
        };
        let _path = PinnedSearchPath::pin();
        // A read-only SPI query (select, not update): it must work on a hot standby, where
        // assigning a transaction id is an error.
        let row = Spi::connect(|client| {
            let t = client.select(query, None, &[])?;
            if t.is_empty() {
                return Ok((false, None));
            }
            let row = t.first();
            Ok::<_, pgrx::spi::Error>((
                row.get::<bool>(1)?.unwrap_or(false),
                row.get::<Vec<u8>>(2)?,
            ))
        })
        .unwrap_or_else(|e| crate::store::internal(&format!("reading idempotency.config: {e}")));
        match row {
            (false, _) => KeyStorage::Plain,
            (true, None) if !has_secret => KeyStorage::Sha256,
            (true, secret) => match secret.as_deref().map(<[u8; 32]>::try_from) {
                Some(Ok(s)) => KeyStorage::Keyed(s),
                _ => raise(
                    PgSqlErrorCode::ERRCODE_DATA_CORRUPTED,
                    "idempotency.config keeps keys hashed but has no 32-byte key_secret".into(),
                    Some("the secret was changed by hand: restore it, or forget the hashed keys and call set_key_storage again"),
                ),
            },
        }
    };
    // Only cache what belongs to the current layout (an invalidation may have come in).
    if layout_is(l.relid) {
        update_cache(|c| c.key_storage = Some(storage));
    }
    storage
}

/// Whether the store keeps keys hashed (as far as this transaction has looked).
pub(crate) fn keys_hashed() -> bool {
    !matches!(cache().key_storage, None | Some(KeyStorage::Plain))
}

/// The form in which `key` is stored: itself, or its keyed hash in hex when the store keeps
/// keys hashed (`idempotency.set_key_storage`). The SQL function `idempotency._stored_key`
/// returns it, once its key and scope are checked.
pub fn stored_form(key: String) -> String {
    match key_storage() {
        KeyStorage::Plain => key,
        KeyStorage::Keyed(secret) => crate::signing::hashed_key(&key, &secret),
        KeyStorage::Sha256 => format!("{:x}", sha2::Sha256::digest(key.as_bytes())),
    }
}

/// How messages name a stored key: quoted, or `(hashed)` where keys are stored hashed.
pub fn key_label(stored: &str) -> String {
    if keys_hashed() {
        crate::signing::hash_label(stored)
    } else {
        format!("{stored:?}")
    }
}
