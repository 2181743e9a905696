//! The SQL-callable functions with typed arguments (`#[pg_extern(sql = false)]`: pgrx reads the
//! arguments; their SQL is hand-written in `sql/idempotency.sql`, which names them by the
//! symbols `api.rs` exports for them). Each is named after its SQL function.

use super::args::{check_size, checked_key_and_scope, hash_arg, key_and_scope, optional_ttl};
use super::args::{DbText, Jsonb, Row, Text, TextArray};
use crate::arguments;
use crate::arguments::ArgError;
use crate::canonical::{self, NumberMode, Value};
use crate::derivation;
use crate::error::{arg_error, canon_error, check, raise};
use crate::stats::{self, Event};
use crate::{guc, store};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use pgrx::{pg_sys, PgSqlErrorCode};
use sha2::{Digest, Sha256};

/// `idempotency._check_args(key, scope, ttl)`: the argument rules the SQL-language functions
/// of release 0.1.0 share with `claim` (0.2.0 uses `_key`); kept so a 0.1.0 schema keeps
/// working with this library until `ALTER EXTENSION idempotency UPDATE`.
#[pg_extern(sql = false)]
fn idempotency_check_args(key: Option<Text<'_>>, scope: Option<Text<'_>>, ttl: Option<Interval>) {
    checked_key_and_scope(key, scope);
    optional_ttl(ttl);
}

/// `idempotency.canonical_json(doc jsonb, numbers text DEFAULT 'exact') RETURNS text`
#[pg_extern(sql = false)]
fn idempotency_canonical_json(doc: Option<Jsonb<'_>>, numbers: Option<Text<'_>>) -> Option<DbText> {
    let mode = numbers.map(|m| m.utf8("numbers"));
    let mode = match mode.as_deref() {
        None => arg_error(ArgError::null("numbers")),
        Some(m) => NumberMode::parse(m).unwrap_or_else(|| {
            raise(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                format!(
                    "numbers must be 'exact' or 'rfc8785' (got {})",
                    arguments::abbreviate(m)
                ),
                None,
            )
        }),
    };
    let doc = doc?;
    let mut text = String::new();
    // SAFETY: a non-NULL jsonb argument of the call.
    unsafe { crate::jsonb::write_canonical(doc.datum(), mode, &mut text) }
        .unwrap_or_else(|e| canon_error("doc", e));
    Some(DbText::new(&text, "canonical_json result"))
}

/// `idempotency.canonical_hash(doc jsonb, exclude text[] DEFAULT '{}') RETURNS bytea`
#[pg_extern(sql = false)]
fn idempotency_canonical_hash(
    doc: Option<Jsonb<'_>>,
    exclude: Option<TextArray<'_>>,
) -> Option<Vec<u8>> {
    let Some(exclude) = exclude.and_then(|e| e.elements("exclude")) else {
        arg_error(ArgError::null("exclude"));
    };
    let doc = doc?;
    if exclude.is_empty() {
        // SAFETY: a non-NULL jsonb argument of the call.
        return Some(unsafe { hash_arg(doc.datum(), "doc") }.to_vec());
    }
    // Exclusions edit a tree of the document (near-linear in members and entries, however
    // many of each: both are the caller's), then hash that.
    let Some(entries) = exclude
        .iter()
        .map(Option::as_deref)
        .collect::<Option<Vec<&str>>>()
    else {
        arg_error(ArgError::null("exclude element"));
    };
    let mut doc = doc.value("doc");
    let mut interrupts = || {
        pgrx::check_for_interrupts!();
    };
    canonical::exclude_all(&mut doc, &entries, &mut interrupts)
        .unwrap_or_else(|e| canon_error("exclude", e));
    let mut text = String::new();
    canonical::write_canonical_checked(&doc, NumberMode::Exact, &mut text, &mut interrupts)
        .unwrap_or_else(|e| canon_error("doc", e));
    Some(Sha256::digest(text.as_bytes()).to_vec())
}

/// `idempotency.derive_key(parent text, step text, params jsonb DEFAULT NULL) RETURNS text`
#[pg_extern(sql = false)]
fn idempotency_derive_key(
    parent: Option<Text<'_>>,
    step: Option<Text<'_>>,
    params: Option<Jsonb<'_>>,
) -> DbText {
    let parent = parent.map(|t| t.utf8("parent"));
    let step = step.map(|t| t.utf8("step"));
    let params = params.map(|j| j.value("params"));
    let key = check(derivation::derive_key(
        parent.as_deref(),
        step.as_deref(),
        params.as_ref(),
    ));
    DbText::new(&key, "derived key")
}

/// `idempotency.cron_key(job text, scheduled_at timestamptz, slot interval) RETURNS text`
#[pg_extern(sql = false)]
fn idempotency_cron_key(
    job: Option<Text<'_>>,
    scheduled_at: Option<TimestampWithTimeZone>,
    slot: Option<Interval>,
) -> DbText {
    let job = job.map(|t| t.utf8("job"));
    let at = scheduled_at.map(pg_sys::TimestampTz::from);
    let key = check(derivation::cron_key(
        job.as_deref(),
        at,
        slot.as_ref().map(super::args::interval_parts),
    ));
    DbText::new(&key, "cron key")
}

/// `idempotency.request_fingerprint(method, path, query jsonb, body jsonb) RETURNS bytea`
#[pg_extern(sql = false)]
fn idempotency_request_fingerprint(
    method: Option<Text<'_>>,
    path: Option<Text<'_>>,
    query: Option<Jsonb<'_>>,
    body: Option<Jsonb<'_>>,
) -> Vec<u8> {
    let method = method.map(|t| t.utf8("method"));
    let path = path.map(|t| t.utf8("path"));
    let query = query.map(|j| j.value("query"));
    if let Some(q) = &query {
        if !matches!(q, Value::Object(_)) {
            raise(
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                "query must be a JSON object of parameter names to values".into(),
                None,
            );
        }
    }
    let body = body.map(|j| j.value("body"));
    let doc = check(derivation::fingerprint_document(
        method.as_deref(),
        path.as_deref(),
        query,
        body,
    ));
    derivation::hash_value(&doc)
        .unwrap_or_else(|e| canon_error("body", e))
        .to_vec()
}

/// `idempotency.sweep(batch_size int DEFAULT NULL) RETURNS bigint`: deletes expired rows in
/// batches until a batch comes back short, skipping rows that other transactions hold.
#[pg_extern(sql = false)]
fn idempotency_sweep(batch_size: Option<i32>) -> i64 {
    let batch = batch_size_arg(batch_size);
    store::refuse_read_only("sweep");
    let prefix = sweep_prefix("sweep");
    let total = stats::sweep_recording_error(|| {
        store::sweep_start();
        in_batches(batch, |b| store::sweep_batch(b, &prefix))
    });
    stats::sweep_finished(total);
    total
}

/// Which rows a sweep may touch: every row for the extension's owner and superusers (and
/// members of the owner's role); for a session with a scope prefix, the rows under its prefix;
/// otherwise none: a tenant must neither delete another tenant's rows nor, inside an open
/// transaction, hold their row locks (which makes their claims answer in_progress).
fn sweep_prefix(function: &str) -> String {
    // SAFETY: reads backend state. The caller is the session's current role: inside these
    // SECURITY DEFINER functions GetUserId() is the owner.
    let caller = unsafe { pg_sys::GetOuterUserId() };
    // SAFETY: catalog look-ups in the calling transaction.
    if unsafe {
        pg_sys::superuser_arg(caller) || pg_sys::has_privs_of_role(caller, extension_owner())
    } {
        return String::new();
    }
    let prefix = crate::binding::with_scope_prefix(str::to_owned);
    if prefix.is_empty() {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            format!("idempotency.{function} of the whole store is for the extension's owner and superusers"),
            Some("run it as the owner (the background sweeper or pg_cron do), or bind this role to a scope prefix (idempotency.role_settings) to sweep only its own scopes"),
        );
    }
    prefix
}

/// The owner of the extension.
fn extension_owner() -> pg_sys::Oid {
    Spi::get_one::<pg_sys::Oid>(
        "SELECT e.extowner FROM pg_catalog.pg_extension AS e \
          WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency'",
    )
    .ok()
    .flatten()
    .unwrap_or(pg_sys::InvalidOid)
}

/// The `batch_size` argument of the sweep functions (NULL: `idempotency.sweep_batch_size`).
fn batch_size_arg(batch_size: Option<i32>) -> i64 {
    let batch = batch_size.unwrap_or_else(|| guc::SWEEP_BATCH_SIZE.get());
    if batch < 1 {
        raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!("batch_size must be positive (got {batch})"),
            None,
        );
    }
    batch as i64
}

/// Runs `delete_batch` until a batch comes back short ([`store::in_batches`], checking for
/// interrupts between batches); returns the rows deleted in all.
fn in_batches(batch: i64, mut delete_batch: impl FnMut(i64) -> i64) -> i64 {
    store::in_batches(
        || Some(batch),
        |b| Some(delete_batch(b)),
        || {
            pgrx::check_for_interrupts!();
            true
        },
    )
}

/// `idempotency._count(event text)`: counts an event of a PL/pgSQL function (`release`, and
/// `stale_token` for an IK003 answer; the Rust functions count their own).
#[pg_extern(sql = false)]
fn idempotency_count(event: Option<Text<'_>>) {
    match event.map(|t| t.utf8("event")).as_deref() {
        Some("release") => stats::count(Event::Release, 1),
        Some("stale_token") => stats::count(Event::StaleTokenRefused, 1),
        other => raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            format!(
                "event must be 'release' or 'stale_token' (got {})",
                arguments::abbreviate(other.unwrap_or("NULL"))
            ),
            None,
        ),
    }
}

/// `idempotency._sweeper_preloaded()`: whether the library was loaded at server start, so the
/// background sweeper runs (except in a server that pg_upgrade runs) and counters are kept.
#[pg_extern(sql = false)]
fn idempotency_sweeper_preloaded() -> bool {
    crate::worker::sweeper_runs()
}

/// `idempotency._announce()`: tells the background sweeper that this database now has the
/// extension (run by CREATE EXTENSION), so it is swept from the next round on.
#[pg_extern(sql = false)]
fn idempotency_announce() {
    stats::announce();
}

/// `idempotency._stored_key(key, scope) RETURNS text`: checks key and scope like every function does
/// and returns the key in the form the store keeps it; used by the PL/pgSQL functions.
#[pg_extern(sql = false)]
fn idempotency_key(key: Option<Text<'_>>, scope: Option<Text<'_>>) -> DbText {
    let (key, _scope) = key_and_scope(key, scope);
    DbText::new(&key, "key")
}

/// `idempotency._store_changed()`: makes every backend re-read how the store keeps keys once
/// this transaction commits (run by `set_key_storage`).
#[pg_extern(sql = false)]
fn idempotency_store_changed() {
    // SAFETY: catalog look-ups and a relcache invalidation, queued in the calling transaction
    // (sent to every backend at its commit).
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(c"idempotency_keys".as_ptr(), nsp);
        if relid != pg_sys::InvalidOid {
            pg_sys::CacheInvalidateRelcacheByRelid(relid);
        }
    }
}

/// A secret argument: 16 bytes at least.
fn secret_arg(secret: Option<Vec<u8>>) -> Vec<u8> {
    match secret {
        Some(s) if s.len() >= 16 => s,
        Some(_) => raise(
            PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            "secret must be at least 16 bytes".into(),
            None,
        ),
        None => arg_error(ArgError::null("secret")),
    }
}

/// `idempotency._sign(key text, kid int, secret bytea) RETURNS text`: the work of `sign_key`.
#[pg_extern(sql = false)]
fn idempotency_sign(key: Option<Text<'_>>, kid: Option<i32>, secret: Option<Vec<u8>>) -> DbText {
    let key = key.map(|t| t.utf8("key"));
    let key = check(arguments::check_key("key", key.as_deref(), false)).to_string();
    let Some(kid) = kid.filter(|k| *k > 0) else {
        arg_error(ArgError::invalid("kid must be a positive integer".into()));
    };
    let secret = secret_arg(secret);
    let signed = crate::binding::with_scope_prefix(|prefix| {
        crate::signing::sign(&key, kid, &secret, prefix)
    });
    DbText::new(&signed, "signed key")
}

/// `idempotency._signed_kid(signed text) RETURNS int`: the secret id a signed key names, NULL
/// when the text is not shaped like a signed key.
#[pg_extern(sql = false)]
fn idempotency_signed_kid(signed: Option<Text<'_>>) -> Option<i32> {
    let signed = signed.map(|t| t.utf8("signed"));
    signed
        .as_deref()
        .and_then(crate::signing::parse)
        .map(|(_, kid, _)| kid)
}

/// `idempotency._verify(signed text, secret bytea) RETURNS text`: the bare key when the
/// signature is right, NULL otherwise.
#[pg_extern(sql = false)]
fn idempotency_verify(signed: Option<Text<'_>>, secret: Option<Vec<u8>>) -> Option<DbText> {
    let signed = signed.map(|t| t.utf8("signed"));
    let secret = secret_arg(secret);
    match signed.as_deref().and_then(crate::signing::parse) {
        Some((key, kid, sig))
            if crate::binding::with_scope_prefix(|prefix| {
                crate::signing::verify(key, kid, &sig, &secret, prefix)
            }) =>
        {
            Some(DbText::new(key, "key"))
        }
        _ => None,
    }
}

/// `idempotency._random_secret() RETURNS bytea`: 32 bytes from the server's strong random
/// source, so a new signing secret never appears in any SQL text or log.
#[pg_extern(sql = false)]
fn idempotency_random_secret() -> Vec<u8> {
    let mut buf = [0u8; 32];
    // SAFETY: `buf` is 32 writable bytes.
    if !unsafe { pg_sys::pg_strong_random(buf.as_mut_ptr().cast(), buf.len()) } {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            "could not generate a random secret".into(),
            None,
        );
    }
    buf.to_vec()
}

/// `idempotency.sweep_audit(batch_size int DEFAULT NULL) RETURNS bigint`: deletes audit rows
/// older than `idempotency.audit_retention` (none when it is 0) in batches.
#[pg_extern(sql = false)]
fn idempotency_sweep_audit(batch_size: Option<i32>) -> i64 {
    let batch = batch_size_arg(batch_size);
    store::refuse_read_only("sweep_audit");
    let prefix = sweep_prefix("sweep_audit");
    let retention = guc::AUDIT_RETENTION.get();
    if retention <= 0 {
        return 0;
    }
    in_batches(batch, |b| {
        store::sweep_audit_batch(retention as f64, b, &prefix)
    })
}

/// `idempotency._rekey(digest bytea, secret bytea) RETURNS text`: the stored form of a key
/// whose SHA-256 is `digest` when the store keeps keys hashed under `secret` (used by
/// `set_key_storage` and the upgrade from 0.2.0, whose stored form was the hex SHA-256).
#[pg_extern(sql = false)]
fn idempotency_rekey(digest: Option<Vec<u8>>, secret: Option<Vec<u8>>) -> DbText {
    let Some(digest) = digest.filter(|d| d.len() == 32) else {
        arg_error(ArgError::invalid("digest must be a 32-byte SHA-256".into()));
    };
    let secret = secret_arg(secret);
    DbText::new(&crate::signing::rekeyed(&digest, &secret), "key")
}

/// `idempotency._check_recovery_point(recovery_point text)`: refuses a recovery point larger
/// than `idempotency.max_recovery_point_size` (used by `checkpoint`).
#[pg_extern(sql = false)]
fn idempotency_check_recovery_point(recovery_point: Option<Text<'_>>) {
    if let Some(point) = recovery_point {
        // SAFETY: a non-NULL text argument of the call.
        unsafe {
            check_size(
                "recovery_point",
                point.datum(),
                crate::binding::max_recovery_point_size(),
            )
        };
    }
}

/// `idempotency._shared_stats()`: this database's counters since server start (NULL when the
/// library is not preloaded), as the row of its OUT parameters.
#[pg_extern(sql = false)]
fn idempotency_shared_stats() -> Row {
    refuse_stats_to_tenants();
    let slot = stats::snapshot();
    let counter = |e: Event| slot.map(|s| s.counters[e as usize] as i64).into_datum();
    let last_at = slot
        .filter(|s| s.last_sweep_at != 0)
        .map(|s| pg_sys::Datum::from(s.last_sweep_at));
    let last_rows = slot
        .filter(|s| s.last_sweep_at != 0)
        .map(|s| s.last_sweep_rows)
        .into_datum();
    let seconds = |micros: Option<u64>| micros.map(|m| m as f64 / 1e6).into_datum();
    let error = slot
        .as_ref()
        .and_then(|s| s.sweep_error())
        .map(|e| crate::encoding::text_datum(e, "last_sweep_error"));
    Row {
        columns: &super::result::SHARED_STATS_RESULT,
        // A store not yet updated to 0.6.0 declares the first ten.
        required: 10,
        what: "the result of idempotency._shared_stats",
        fields: vec![
            Some(pg_sys::Datum::from(crate::worker::sweeper_runs())),
            counter(Event::ClaimNew),
            counter(Event::ClaimReplay),
            counter(Event::ClaimInProgress),
            counter(Event::ClaimMismatch),
            counter(Event::Completion),
            counter(Event::Release),
            counter(Event::Swept),
            last_at,
            last_rows,
            counter(Event::Takeover),
            counter(Event::StaleTokenRefused),
            counter(Event::ClaimWaited),
            seconds(slot.map(|s| s.counters[Event::ClaimWaitMicros as usize])),
            error,
        ],
    }
}

/// The counters are the whole database's: only for roles that may read `idempotency.stats`
/// (its owner, superusers, roles granted SELECT on it) or are granted the monitoring schema
/// `idempotency_monitor` (whose view shows the same row), not for every tenant that has USAGE
/// on schema `idempotency`.
fn refuse_stats_to_tenants() {
    // SAFETY: catalog look-ups inside the calling transaction; `_shared_stats` is not SECURITY
    // DEFINER (it is also called from the views), so GetUserId() is the role asking.
    let allowed = unsafe {
        let role = pg_sys::GetUserId();
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let view = pg_sys::get_relname_relid(c"stats".as_ptr(), nsp);
        // Missing in a store not yet updated to 0.5.0.
        let monitor = pg_sys::get_namespace_oid(c"idempotency_monitor".as_ptr(), true);
        pg_sys::superuser_arg(role)
            || (view != pg_sys::InvalidOid
                && pg_sys::pg_class_aclcheck(view, role, pg_sys::ACL_SELECT as pg_sys::AclMode)
                    == pg_sys::AclResult::ACLCHECK_OK)
            || (monitor != pg_sys::InvalidOid && crate::compat::has_schema_usage(monitor, role))
    };
    if !allowed {
        raise(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "idempotency._shared_stats: the database-wide counters are for roles that may read idempotency.stats".into(),
            Some("for a monitoring role: GRANT USAGE ON SCHEMA idempotency_monitor TO <role>; (see the README's Privileges and tenants)"),
        );
    }
}
