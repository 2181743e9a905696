//! The statements the store runs, each prepared once per backend, and the calls that run them
//! through SPI.

use super::catalog::{key_label, keys_hashed, relation_oid, tenant_type, PinnedSearchPath};
use super::spi_failed;
use super::{ClaimRequest, ClaimResult, CompleteRequest, Completed, Outcome, OwnedJsonb, Row};
use crate::encoding;
use crate::error::raise;
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use pgrx::PgSqlErrorCode;
use std::cell::Cell;

pub(crate) const ROW_COLUMNS: &str = "k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status, \
     k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at, \
     k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval)";

/// The parameter that carries the key's tenant in a statement that names a key, on a store
/// distributed by its tenant (`distribute(tenant_type => ...)`, `catalog::tenant_type`): its
/// number, the statement's last; None on every other store. Each such statement also names the
/// tenant, so that Citus routes it to the tenant's shard: the row's match ([`key_match`]), the
/// inserts' `tenant` column and `ON CONFLICT (scope, key, tenant)`, the primary key there.
type TenantParam = Option<usize>;

/// How a statement finds the key's row: `k.scope = $1 AND k.key = $2`, and the tenant.
fn key_match(tenant: TenantParam) -> String {
    let mut m =
        String::from("k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2");
    if let Some(n) = tenant {
        m.push_str(&format!(" AND k.tenant OPERATOR(pg_catalog.=) ${n}"));
    }
    m
}

/// `", tenant"` (or `", $n"`) where a statement lists the tenant column (or its value).
fn tenant_column(tenant: TenantParam) -> &'static str {
    if tenant.is_some() {
        ", tenant"
    } else {
        ""
    }
}

fn tenant_value(tenant: TenantParam) -> String {
    tenant.map(|n| format!(", ${n}")).unwrap_or_default()
}

pub(crate) fn select_sql(lock: bool, tenant: TenantParam) -> String {
    format!(
        "SELECT {ROW_COLUMNS} FROM idempotency.idempotency_keys k WHERE {}{}",
        key_match(tenant),
        if lock { " FOR UPDATE SKIP LOCKED" } else { "" }
    )
}

/// The values of `status` through `ttl` ($4 the lease, $5 the TTL) that every fresh claim gets,
/// after `(scope, key[, tenant], request_hash`.
const FRESH_CLAIM_VALUES: &str = "'in_progress', pg_catalog.nextval('idempotency.token_seq'), \
       pg_catalog.now(), pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
       pg_catalog.now() OPERATOR(pg_catalog.+) $5, $5";

/// Which rows an insert of fresh claims takes ([`insert_sql`]).
#[derive(Clone, Copy)]
pub(crate) enum InsertRows {
    /// One key: $1 the scope, $2 the key (stored form), $3 the request hash; returns the token
    /// and expiry.
    One,
    /// The keys of a `claim_many` in the batch's order: $2 the keys (stored form), $3 their
    /// request hashes (NULL elements: no request); returns each inserted key with its token
    /// and expiry.
    Batch,
}

/// The text of an insert of fresh claims, the one builder of them all.
///
/// With `on_conflict`, `ON CONFLICT (scope, key) DO NOTHING`: a key that exists is skipped.
/// `claim` under REPEATABLE READ and SERIALIZABLE keeps it (it turns a row committed after the
/// snapshot into the serialization error it must be), and on a partitioned or Citus store
/// (where it waits for another transaction inserting the key); a batch runs it first, holding
/// the insert locks of all its keys without having looked at them.
///
/// Without it, the insert of keys that the probe, under each key's insert lock (held until the
/// statement ends), found absent: no other claimer can insert them meanwhile, so no arbiter
/// (its extra index check and speculative-insertion record) is needed.
pub(crate) fn insert_sql(rows: InsertRows, on_conflict: bool, tenant: TenantParam) -> String {
    let (column, value) = (tenant_column(tenant), tenant_value(tenant));
    let (rows, returning) = match rows {
        InsertRows::One => (format!("VALUES ($1, $2{value}, $3, {FRESH_CLAIM_VALUES})"), ""),
        InsertRows::Batch => (
            format!(
                "SELECT $1, u.key{value}, u.request_hash, {FRESH_CLAIM_VALUES} \
                   FROM ROWS FROM (pg_catalog.unnest($2), pg_catalog.unnest($3)) AS u(key, request_hash)"
            ),
            "k.key, ",
        ),
    };
    let on_conflict = if on_conflict {
        format!(" ON CONFLICT (scope, key{column}) DO NOTHING")
    } else {
        String::new()
    };
    format!(
        "INSERT INTO idempotency.idempotency_keys AS k \
           (scope, key{column}, request_hash, status, token, created_at, locked_until, expires_at, ttl) \
         {rows}{on_conflict} RETURNING {returning}k.token, k.expires_at"
    )
}

/// Rewrites an expired row as a fresh claim (it counted as absent). $6 is the new token, a
/// value of this node's token sequence above the row's token ([`next_token_above`]), taken by
/// statements of its own: Citus refuses volatile functions in an UPDATE of a distributed
/// table. Never `old token + 1`: on Citus each node has a sequence of its own, and that value
/// may be one another node hands out later, to a new claim of the same key once this row is
/// gone, which a stale holder's `complete` would then pass for its own. The row is locked (the
/// claim read it FOR UPDATE), so its token is still the one $6 was chosen above; the condition
/// on it only guards that.
fn restart_sql(tenant: TenantParam) -> String {
    format!(
        "UPDATE idempotency.idempotency_keys AS k SET \
           request_hash = $3, status = 'in_progress', \
           token = $6, \
           response = NULL, response_status = NULL, recovery_point = NULL, \
           created_at = pg_catalog.now(), completed_at = NULL, \
           locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
           expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
         WHERE {} AND k.token OPERATOR(pg_catalog.<) $6 \
         RETURNING k.token, k.expires_at, k.recovery_point",
        key_match(tenant)
    )
}

/// The token of a restart or takeover, before the UPDATE (see [`restart_sql`]).
const NEXT_TOKEN_SQL: &str = "SELECT pg_catalog.nextval('idempotency.token_seq')";

/// Takes over an in-progress row whose lease ran out; keeps its recovery point. The new token
/// is a value of this node's sequence above the old one (see [`restart_sql`]).
fn takeover_sql(tenant: TenantParam) -> String {
    format!(
        "UPDATE idempotency.idempotency_keys AS k SET \
           request_hash = COALESCE(k.request_hash, $3), \
           token = $6, \
           locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
           expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
         WHERE {} AND k.token OPERATOR(pg_catalog.<) $6 \
         RETURNING k.token, k.expires_at, k.recovery_point",
        key_match(tenant)
    )
}

/// The statements claim and sweep run, each prepared once per backend (SPI_keepplan) when it
/// is first needed, so a claim pays for execution only. PostgreSQL's plan cache re-plans them
/// after DDL on the table, re-resolving names, so they survive even DROP and CREATE EXTENSION
/// in one session. Prepared one by one, not all at once: a statement that cannot be planned
/// on the table as it is (an INSERT ... ON CONFLICT on a table with rules, which PostgreSQL
/// refuses) fails only where it is used, not every statement with it.
#[derive(Clone, Copy)]
pub(crate) enum Plan {
    Select,
    SelectLocked,
    Insert,
    InsertFresh,
    Restart,
    TakeOver,
    Complete,
    Sweep,
    SweepByExpiresAt,
    NextToken,
    InsertBatch,
    InsertBatchOnConflict,
}

pub(crate) const PLAN_COUNT: usize = Plan::InsertBatchOnConflict as usize + 1;

pub(crate) static PLANS: crate::local::BackendLocal<
    [Cell<Option<&'static OwnedPreparedStatement>>; PLAN_COUNT],
> = crate::local::BackendLocal::new([const { Cell::new(None) }; PLAN_COUNT]);

/// The argument types of a statement, with the tenant's type appended on a store distributed
/// by its tenant ([`TenantParam`]).
fn args_with_tenant(args: &[PgOid], tenant: pg_sys::Oid) -> Vec<PgOid> {
    let mut v = args.to_vec();
    if tenant != pg_sys::InvalidOid {
        v.push(PgOid::from(tenant));
    }
    v
}

/// The tenant type the kept statements were prepared for (see [`TenantParam`]): when the
/// store's changes (`distribute(tenant_type => ...)` in this session), they are prepared again.
static PLANS_TENANT: crate::local::BackendLocal<Cell<pg_sys::Oid>> =
    crate::local::BackendLocal::new(Cell::new(pg_sys::InvalidOid));

/// The key's tenant as an argument of the statements ([`TenantParam`]) on a store distributed
/// by its tenant, None on any other store. The scope is the tenant id's text form, exactly as
/// the type writes it (`'42'`, `'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'`), so that one tenant
/// has one scope (a CHECK constraint of the table holds the same rule); any other scope is
/// refused (22P02, naming it) before anything is read or written.
pub(crate) fn tenant_arg(scope: &str) -> Option<pgrx::datum::DatumWithOid<'static>> {
    let tenant = tenant_type();
    if tenant == pg_sys::InvalidOid {
        return None;
    }
    if tenant == pg_sys::INT8OID {
        if let Ok(id) = scope.parse::<i64>() {
            if id.to_string() == scope {
                return Some(id.into());
            }
        }
        bad_tenant(scope, "a bigint written as PostgreSQL writes it, e.g. '42'");
    }
    let bytes = scope.as_bytes();
    let canonical = bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, &b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        });
    if canonical {
        let hex: String = scope.chars().filter(|&c| c != '-').collect();
        let mut uuid = [0u8; 16];
        for (i, byte) in uuid.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
        }
        return Some(pgrx::datum::Uuid::from_bytes(uuid).into());
    }
    bad_tenant(
        scope,
        "a uuid written as PostgreSQL writes it, lower case with hyphens, e.g. 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'",
    )
}

fn bad_tenant(scope: &str, form: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION,
        format!("scope must be a tenant id of this store, {form}: got {scope:?}"),
        Some(
            "the store is distributed by its tenant (idempotency.distribute(tenant_type => ...)): \
             pass the tenant id as the scope, e.g. idempotency.claim(key, request, 42)",
        ),
    )
}

pub(crate) fn plan(
    client: &SpiClient<'_>,
    which: Plan,
) -> Result<&'static OwnedPreparedStatement, pgrx::spi::Error> {
    // The sweep's statements and the token's name no key: the same on every store.
    let keyed = !matches!(
        which,
        Plan::Sweep | Plan::SweepByExpiresAt | Plan::NextToken
    );
    let tenant = if keyed {
        tenant_type()
    } else {
        pg_sys::InvalidOid
    };
    if keyed && PLANS_TENANT.with(Cell::get) != tenant {
        // Prepared for another store: leave them (kept plans are not freed) and start again.
        PLANS.with(|c| c.iter().for_each(|p| p.set(None)));
        PLANS_TENANT.with(|c| c.set(tenant));
    }
    if let Some(p) = PLANS.with(|c| c[which as usize].get()) {
        return Ok(p);
    }
    let text = PgOid::from(pg_sys::TEXTOID);
    // The tenant's parameter number in a statement of n parameters without it.
    let at = |n: usize| (tenant != pg_sys::InvalidOid).then_some(n);
    let key_args = args_with_tenant(&[text, text], tenant);
    let claim_args = args_with_tenant(
        &[
            text,
            text,
            PgOid::from(pg_sys::BYTEAOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INTERVALOID),
        ],
        tenant,
    );
    let token_args = args_with_tenant(
        &[
            text,
            text,
            PgOid::from(pg_sys::BYTEAOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INTERVALOID),
            PgOid::from(pg_sys::INT8OID),
        ],
        tenant,
    );
    let prepared = match which {
        Plan::Select => client
            .prepare(select_sql(false, at(3)).as_str(), &key_args)?
            .keep(),
        Plan::SelectLocked => client
            .prepare_mut(select_sql(true, at(3)).as_str(), &key_args)?
            .keep(),
        Plan::Insert | Plan::InsertFresh => client
            .prepare_mut(
                insert_sql(InsertRows::One, matches!(which, Plan::Insert), at(6)).as_str(),
                &claim_args,
            )?
            .keep(),
        Plan::Restart => client
            .prepare_mut(restart_sql(at(7)).as_str(), &token_args)?
            .keep(),
        Plan::TakeOver => client
            .prepare_mut(takeover_sql(at(7)).as_str(), &token_args)?
            .keep(),
        Plan::NextToken => client.prepare_mut(NEXT_TOKEN_SQL, &[])?.keep(),
        Plan::InsertBatch | Plan::InsertBatchOnConflict => client
            .prepare_mut(
                insert_sql(
                    InsertRows::Batch,
                    matches!(which, Plan::InsertBatchOnConflict),
                    at(6),
                )
                .as_str(),
                &args_with_tenant(
                    &[
                        text,
                        PgOid::from(pg_sys::TEXTARRAYOID),
                        PgOid::from(pg_sys::BYTEAARRAYOID),
                        PgOid::from(pg_sys::INTERVALOID),
                        PgOid::from(pg_sys::INTERVALOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        Plan::Complete => client
            .prepare_mut(
                complete_statement(at(7)).as_str(),
                &args_with_tenant(
                    &[
                        text,
                        text,
                        PgOid::from(pg_sys::JSONBOID),
                        PgOid::from(pg_sys::INT4OID),
                        PgOid::from(pg_sys::INT8OID),
                        PgOid::from(pg_sys::INTERVALOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        Plan::SweepByExpiresAt => client
            .prepare_mut(
                sweep_by_expires_at_sql().as_str(),
                &[PgOid::from(pg_sys::INT8OID), text],
            )?
            .keep(),
        Plan::Sweep => client
            .prepare_mut(
                sweep_sql(STORE).as_str(),
                &[
                    PgOid::from(pg_sys::INT8OID),
                    text,
                    PgOid::from(pg_sys::TIMESTAMPOID),
                ],
            )?
            .keep(),
    };
    let p: &'static OwnedPreparedStatement = Box::leak(Box::new(prepared));
    PLANS.with(|c| c[which as usize].set(Some(p)));
    Ok(p)
}

pub(crate) fn read_row(
    client: &mut SpiClient<'_>,
    lock: bool,
    req: &ClaimRequest<'_>,
) -> Result<Option<Row>, pgrx::spi::Error> {
    let mut args = vec![
        encoding::spi_text(req.scope, "scope"),
        encoding::spi_text(req.key, "key"),
    ];
    args.extend(tenant_arg(req.scope));
    let table = if lock {
        // Row locks need a read-write SPI call.
        client.update(plan(client, Plan::SelectLocked)?, Some(1), &args)?
    } else {
        client.select(plan(client, Plan::Select)?, Some(1), &args)?
    };
    if table.is_empty() {
        return Ok(None);
    }
    let t = table.first();
    Ok(Some(Row {
        completed: t.get::<bool>(1)?.unwrap_or(false),
        request_hash: t.get::<Vec<u8>>(2)?,
        token: t.get::<i64>(3)?,
        response: t.get::<OwnedJsonb>(4)?,
        response_status: t.get::<i32>(5)?,
        recovery_point: recovery_point(&t, 6)?,
        expires_at: t.get::<TimestampWithTimeZone>(7)?,
        expired: t.get::<bool>(8)?.unwrap_or(true),
        lease_over: t.get::<bool>(9)?.unwrap_or(false),
        retry_after: t.get::<Interval>(10)?,
    }))
}

/// The recovery point in column `n` of an SPI row, as UTF-8.
pub(crate) fn recovery_point(
    t: &pgrx::spi::SpiTupleTable<'_>,
    n: usize,
) -> Result<Option<String>, pgrx::spi::Error> {
    let datum = t.get_datum_by_ordinal(n)?;
    // SAFETY: the column is text; its value lives until the SPI call ends, after this copy.
    Ok(datum.map(|d| unsafe { encoding::text_of(d, "recovery_point") }.into_owned()))
}

#[derive(Clone, Copy)]
pub(crate) enum Write {
    Insert,
    InsertFresh,
    /// A restart of an expired row whose token is this.
    Restart(i64),
    /// A takeover of an in-progress row whose lease ran out, whose token is this.
    TakeOver(i64),
}

pub(crate) fn write_claim(
    client: &mut SpiClient<'_>,
    write: Write,
    req: &ClaimRequest<'_>,
) -> Result<Option<ClaimResult>, pgrx::spi::Error> {
    let hash = req.hash.map(|h| h.to_vec());
    let stmt = plan(
        client,
        match write {
            Write::Insert => Plan::Insert,
            Write::InsertFresh => Plan::InsertFresh,
            Write::Restart(_) => Plan::Restart,
            Write::TakeOver(_) => Plan::TakeOver,
        },
    )?;
    let mut args = vec![
        encoding::spi_text(req.scope, "scope"),
        encoding::spi_text(req.key, "key"),
        hash.into(),
        req.lease.into(),
        req.ttl.into(),
    ];
    if let Write::Restart(old) | Write::TakeOver(old) = write {
        args.push(next_token_above(client, old, req.key)?.into());
    }
    args.extend(tenant_arg(req.scope));
    let table = client.update(stmt, None, &args)?;
    if table.is_empty() {
        return Ok(None);
    }
    let t = table.first();
    let mut result = ClaimResult::new(Outcome::New);
    result.token = t.get::<i64>(1)?;
    result.expires_at = t.get::<TimestampWithTimeZone>(2)?;
    if t.columns()? >= 3 {
        result.recovery_point = recovery_point(&t, 3)?;
    }
    Ok(Some(result))
}

fn next_token(client: &mut SpiClient<'_>) -> Result<i64, pgrx::spi::Error> {
    Ok(client
        .update(plan(client, Plan::NextToken)?, Some(1), &[])?
        .first()
        .get::<i64>(1)?
        .unwrap_or(0))
}

/// Steps of the sequence a token above the old one may be this far ahead, and is still reached
/// by taking values one by one.
const STEPS_TAKEN_ONE_BY_ONE: i64 = 1000;

/// The token of a restart or takeover: the next value of this node's token sequence, and if
/// that is not above `old` (on Citus, `old` came from a node whose sequence is ahead, or from
/// before a shard moved here), the least value above `old` that this node's sequence hands out
/// (the sequence counts by its increment: 1, or on Citus the stride of the node classes), with
/// the sequence moved past it, so that it never hands that value out again.
///
/// Moves of the sequence are serialized by a lock on it (SHARE UPDATE EXCLUSIVE, which claims'
/// `nextval` does not wait for), released at once: each move reads the sequence again under
/// the lock. A value at most [`STEPS_TAKEN_ONE_BY_ONE`] steps ahead is reached by `nextval`
/// alone (every value taken is this call's or another claim's, never both); a farther one is
/// set with `setval` right after a `nextval`, which would go back over values handed out only
/// if other claims took that many values of this node's sequence in between.
///
/// The sequence is never moved into the upper half of its range ([`highest_token_moved_past`]):
/// the sequence is shared by every key, and one row whose token is there (restored from a dump
/// or written by hand; the sequence itself gets there only after handing out half its range)
/// would otherwise leave it next to nothing, or with `bigint`'s maximum nothing at all, so that
/// every later claim of any key failed (`2200H`). The claim of such a key is refused with
/// `22003` instead (tokens must rise per key, so no smaller one is given), and the sequence is
/// left where it is: the key is usable again once `forget` or the sweep deleted its row.
fn next_token_above(
    client: &mut SpiClient<'_>,
    old: i64,
    key: &str,
) -> Result<i64, pgrx::spi::Error> {
    let next = next_token(client)?;
    if next > old {
        return Ok(next);
    }
    let seq = relation_oid(c"token_seq");
    // SAFETY: locks a relation that exists (found just now in the catalog) in this transaction;
    // released below, or with the transaction if an error comes first.
    unsafe { pg_sys::LockRelationOid(seq, pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE) };
    let result = (|| {
        let row = client
            .select(
                "SELECT s.seqincrement, s.seqmax FROM pg_catalog.pg_sequence AS s \
                  WHERE s.seqrelid OPERATOR(pg_catalog.=) $1",
                Some(1),
                &[seq.into()],
            )?
            .first();
        let increment = row.get::<i64>(1)?.unwrap_or(1).max(1);
        let highest = highest_token_moved_past(row.get::<i64>(2)?.unwrap_or(i64::MAX));
        let mut next = next_token(client)?;
        if next > old {
            return Ok(next);
        }
        if old > highest {
            raise(
                PgSqlErrorCode::ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE,
                format!(
                    "idempotency.claim: key {} has token {old}, above the highest token a \
                     claim moves the token sequence past ({highest}): no larger token is issued \
                     for it",
                    key_label(key)
                ),
                Some(
                    "the row was restored from a dump or written by hand; delete it with \
                     idempotency.forget(key, scope) (the sweep deletes it once it expires), \
                     then claim the key again",
                ),
            );
        }
        let steps = (old - next) / increment + 1;
        if steps <= STEPS_TAKEN_ONE_BY_ONE {
            while next <= old {
                next = next_token(client)?;
            }
            return Ok(next);
        }
        let target = next.saturating_add(steps.saturating_mul(increment));
        client.update(
            "SELECT pg_catalog.setval('idempotency.token_seq', $1)",
            Some(1),
            &[target.into()],
        )?;
        Ok(target)
    })();
    // SAFETY: releases the lock taken above, held by this transaction.
    unsafe { pg_sys::UnlockRelationOid(seq, pg_sys::ShareUpdateExclusiveLock as pg_sys::LOCKMODE) };
    result
}

/// The highest stored token a restart or takeover moves the token sequence past: half the
/// sequence's maximum, so that the upper half is always left to the sequence itself.
fn highest_token_moved_past(seqmax: i64) -> i64 {
    seqmax / 2
}

/// A key a batch inserted (its index in the `keys` given), its token and its expiry.
pub(crate) type Inserted = (usize, Option<i64>, Option<TimestampWithTimeZone>);

/// Inserts the fresh keys of a batch in one statement ([`insert_sql`]); returns each
/// inserted key (its index in `keys`) with its token and expiry. The statement inserts in the
/// order of `keys` and returns the inserted rows in that order, so each returned key is looked
/// for from the previous one on (and from the start, should that find nothing).
pub(crate) fn insert_batch(
    client: &mut SpiClient<'_>,
    scope: &str,
    keys: &[&str],
    hashes: &[Option<[u8; 32]>],
    lease: Interval,
    ttl: Interval,
    on_conflict: bool,
) -> Result<Vec<Inserted>, pgrx::spi::Error> {
    let stmt = plan(
        client,
        if on_conflict {
            Plan::InsertBatchOnConflict
        } else {
            Plan::InsertBatch
        },
    )?;
    let key_datums: Vec<pg_sys::Datum> = keys
        .iter()
        .map(|k| encoding::text_datum(k, "key"))
        .collect();
    // SAFETY: every element is a text datum in the database encoding, allocated in the current
    // memory context; construct_array copies them into one text[] there.
    let key_array = unsafe {
        let mut elems = key_datums;
        let array = pg_sys::construct_array(
            elems.as_mut_ptr(),
            elems.len() as i32,
            pg_sys::TEXTOID,
            -1,
            false,
            pg_sys::TYPALIGN_INT as std::ffi::c_char,
        );
        pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(array), pg_sys::TEXTARRAYOID)
    };
    let hashes: Vec<Option<Vec<u8>>> = hashes.iter().map(|h| h.map(|h| h.to_vec())).collect();
    let mut args = vec![
        encoding::spi_text(scope, "scope"),
        key_array,
        hashes.into(),
        lease.into(),
        ttl.into(),
    ];
    args.extend(tenant_arg(scope));
    let mut table = client.update(stmt, None, &args)?;
    let mut out = Vec::with_capacity(keys.len());
    let mut next = 0;
    // Each step positions the table on its next row, read through the table.
    while table.next().is_some() {
        let Some(d) = table.get_datum_by_ordinal(1)? else {
            continue;
        };
        // SAFETY: the column is text; its value lives until the SPI call ends, after this use.
        let key = unsafe { encoding::text_of(d, "key") };
        let found = (next..keys.len())
            .chain(0..next)
            .find(|&i| keys[i] == key.as_ref());
        if let Some(i) = found {
            next = i + 1;
            out.push((
                i,
                table.get::<i64>(2)?,
                table.get::<TimestampWithTimeZone>(3)?,
            ));
        }
    }
    Ok(out)
}

/// Runs statements through SPI with the search path pinned (see [`PinnedSearchPath`]). Only
/// the paths that run SQL pin it: the look-up and the direct writes resolve no names.
pub(crate) fn with_spi<R>(f: impl FnOnce(&mut SpiClient<'_>) -> R) -> R {
    let _path = PinnedSearchPath::pin();
    Spi::connect_mut(f)
}

/// Stores the response on the live in-progress claim (with the right token, when given).
fn complete_statement(tenant: TenantParam) -> String {
    format!(
        "UPDATE idempotency.idempotency_keys AS k SET \
           status = 'completed'::idempotency.key_status, response = $3, response_status = $4, \
           completed_at = pg_catalog.now(), locked_until = NULL, \
           expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) COALESCE($6, k.ttl), \
           ttl = COALESCE($6, k.ttl) \
         WHERE {} \
           AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status \
           AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() \
           AND ($5 IS NULL OR k.token OPERATOR(pg_catalog.=) $5) \
         RETURNING k.expires_at, k.request_hash, k.token",
        key_match(tenant)
    )
}

/// One audit row per completion (`idempotency.audit = on`), in the completing transaction.
fn audit_sql(tenant: TenantParam) -> String {
    format!(
        "INSERT INTO idempotency.audit \
           (scope, key, key_is_hash, request_hash, token, response_status, completed_at, \
            completed_by{}) \
         VALUES ($1, $2, $3, $4, $5, $6, pg_catalog.now(), $7{})",
        tenant_column(tenant),
        tenant_value(tenant)
    )
}

/// The audit table, as statements name it.
pub(crate) const AUDIT: &str = "idempotency.audit";

/// Deletes up to $2 audit rows of `table` (the audit table, or one part of it) older than $1
/// seconds whose scope starts with $3 ('' for all), skipping rows other transactions hold.
pub(crate) fn audit_sweep_sql(table: &str) -> String {
    delete_skip_locked(
        table,
        "s.completed_at OPERATOR(pg_catalog.<) (pg_catalog.now() \
           OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => $1)) \
         AND pg_catalog.starts_with(s.scope, $3)",
        "",
        "$2",
        "",
    )
}

/// The form of every sweep statement: a DELETE of the rows of `table` (schema-qualified) that a
/// subquery selects by `condition` (over the alias `s`), in `order` (an `ORDER BY` clause, or
/// empty), at most `limit` (a parameter) of them, skipping rows other transactions hold, then
/// `returning` (a `RETURNING` clause, or empty). The rows are matched by ctid, which is unique
/// within one table: on a partitioned or Citus store the statement runs part by part.
fn delete_skip_locked(
    table: &str,
    condition: &str,
    order: &str,
    limit: &str,
    returning: &str,
) -> String {
    format!(
        "DELETE FROM {table} AS d \
          WHERE d.ctid OPERATOR(pg_catalog.=) ANY (ARRAY( \
            SELECT s.ctid FROM {table} AS s WHERE {condition} {order} \
             LIMIT {limit} FOR UPDATE SKIP LOCKED)) {returning}"
    )
}

/// The audit statements, prepared on first use (a store created by release 0.1.0 and not yet
/// updated has no audit table).
pub(crate) struct AuditPlans {
    pub(crate) insert: OwnedPreparedStatement,
    pub(crate) sweep: OwnedPreparedStatement,
}

pub(crate) static AUDIT_PLANS: crate::local::BackendLocal<Cell<Option<&'static AuditPlans>>> =
    crate::local::BackendLocal::new(Cell::new(None));

static AUDIT_PLANS_TENANT: crate::local::BackendLocal<Cell<pg_sys::Oid>> =
    crate::local::BackendLocal::new(Cell::new(pg_sys::InvalidOid));

pub(crate) fn audit_plans(client: &SpiClient<'_>) -> Result<&'static AuditPlans, pgrx::spi::Error> {
    let tenant = tenant_type();
    if AUDIT_PLANS_TENANT.with(Cell::get) != tenant {
        // Prepared for another store (see [`PLANS_TENANT`]).
        AUDIT_PLANS.with(|c| c.set(None));
        AUDIT_PLANS_TENANT.with(|c| c.set(tenant));
    }
    if let Some(p) = AUDIT_PLANS.with(Cell::get) {
        return Ok(p);
    }
    let exists = relation_oid(c"audit") != pg_sys::InvalidOid;
    if !exists {
        raise(
            PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            "idempotency.audit does not exist".into(),
            Some("update the extension: ALTER EXTENSION idempotency UPDATE"),
        );
    }
    let oid = |o| PgOid::from(o);
    let p: &'static AuditPlans = Box::leak(Box::new(AuditPlans {
        insert: client
            .prepare_mut(
                audit_sql((tenant != pg_sys::InvalidOid).then_some(8)).as_str(),
                &args_with_tenant(
                    &[
                        oid(pg_sys::TEXTOID),
                        oid(pg_sys::TEXTOID),
                        oid(pg_sys::BOOLOID),
                        oid(pg_sys::BYTEAOID),
                        oid(pg_sys::INT8OID),
                        oid(pg_sys::INT4OID),
                        oid(pg_sys::TEXTOID),
                    ],
                    tenant,
                ),
            )?
            .keep(),
        sweep: client
            .prepare_mut(
                audit_sweep_sql(AUDIT).as_str(),
                &[
                    oid(pg_sys::FLOAT8OID),
                    oid(pg_sys::INT8OID),
                    oid(pg_sys::TEXTOID),
                ],
            )?
            .keep(),
    }));
    AUDIT_PLANS.with(|c| c.set(Some(p)));
    Ok(p)
}

/// The role that completes: the session's current role (SET ROLE), not the owner of the
/// SECURITY DEFINER function that runs the statement. Its name's bytes as the catalog holds
/// them, not through a UTF-8 string (as `current_user` gives it, in any database encoding).
fn completing_role<'a>() -> pgrx::datum::DatumWithOid<'a> {
    // SAFETY: GetUserNameFromId returns a palloc'd, NUL-terminated name (it raises an ERROR
    // for a role that does not exist); the text datum is a copy of its bytes.
    unsafe {
        let name = pg_sys::GetUserNameFromId(pg_sys::GetOuterUserId(), false);
        let len = std::ffi::CStr::from_ptr(name).to_bytes().len();
        let text = pg_sys::cstring_to_text_with_len(name, len as i32);
        pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(text), pg_sys::TEXTOID)
    }
}

pub(crate) fn complete_sql(req: &CompleteRequest<'_>) -> Option<Completed> {
    let response = req
        .response
        // SAFETY: the response is a jsonb datum (the SQL function's argument, checked by it).
        .map(|d| unsafe { pgrx::datum::DatumWithOid::new(d, pg_sys::JSONBOID) });
    Spi::connect_mut(|client| {
        let complete = plan(client, Plan::Complete)?;
        let response = match response {
            Some(d) => d,
            None => pgrx::datum::DatumWithOid::null_oid(pg_sys::JSONBOID),
        };
        let mut args = vec![
            encoding::spi_text(req.scope, "scope"),
            encoding::spi_text(req.key, "key"),
            response,
            req.response_status.into(),
            req.token.into(),
            req.ttl.into(),
        ];
        args.extend(tenant_arg(req.scope));
        let table = client.update(complete, None, &args)?;
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        Ok(Some(Completed {
            expires_at: row.get::<TimestampWithTimeZone>(1)?,
            request_hash: row.get::<Vec<u8>>(2)?,
            token: row.get::<i64>(3)?,
        }))
    })
    .unwrap_or_else(|e| spi_failed("complete", e))
}

/// Appends the audit row of a completion, in the completing transaction.
pub(crate) fn audit(req: &CompleteRequest<'_>, done: &Completed) {
    Spi::connect_mut(|client| {
        let audit = audit_plans(client)?;
        let mut args = vec![
            encoding::spi_text(req.scope, "scope"),
            encoding::spi_text(req.key, "key"),
            keys_hashed().into(),
            done.request_hash.clone().into(),
            done.token.into(),
            req.response_status.into(),
            completing_role(),
        ];
        args.extend(tenant_arg(req.scope));
        client.update(&audit.insert, None, &args)?;
        Ok(())
    })
    .unwrap_or_else(|e| spi_failed("complete", e))
}

/// The store table, as statements name it.
pub(crate) const STORE: &str = "idempotency.idempotency_keys";

/// The sweep key of a row: the expiry its claim set, in UTC (`created_at + ttl`), the expression
/// of the sweeper's index `idempotency_keys_sweep_idx` as `sql/idempotency.sql` writes it. Every
/// statement that reads it is built from this one text; its columns are unqualified, so in each
/// statement they are those of the innermost table read (the subquery's, in a DELETE's
/// selection; the deleted row's, in its RETURNING clause).
///
/// It is never later than `expires_at` (a completion moves that only later, or changes `ttl`,
/// and so the key, too), except by the clock change between a claim and its expiry when a
/// calendar TTL (days, months) is added in a time zone with daylight saving time. `complete`
/// changes neither column, so its update is HOT (docs/architecture.md#the-sweep-index).
pub(crate) const SWEEP_KEY: &str = "((created_at AT TIME ZONE 'UTC') OPERATOR(pg_catalog.+) ttl)";

/// Deletes up to $1 expired rows of `table` (the store, or one part of it) whose scope starts
/// with $2 ('' for all), in the order of their [`SWEEP_KEY`] from $3 on (the key a previous
/// batch of the same sweep reached; -infinity at first), through the index on it; returns their
/// keys. Rows whose key has passed but whose `expires_at` has not (completed after their claim,
/// or with a longer TTL) are read and left; starting each batch where the last one ended reads
/// them once per sweep, not once per batch.
pub(crate) fn sweep_sql(table: &str) -> String {
    delete_skip_locked(
        table,
        &format!(
            "{SWEEP_KEY} OPERATOR(pg_catalog.<=) (pg_catalog.now() AT TIME ZONE 'UTC') \
             AND {SWEEP_KEY} OPERATOR(pg_catalog.>=) $3 \
             AND s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
             AND pg_catalog.starts_with(s.scope, $2)"
        ),
        &format!("ORDER BY {SWEEP_KEY}"),
        "$1",
        &format!("RETURNING {SWEEP_KEY}"),
    )
}

/// How many rows of `table` (the store, or one part of it) expired after $1 (and by now()):
/// with the sweep index, an index range scan over the newest [`SWEEP_KEY`]s ($1 a timestamp in
/// UTC); without it (a store not yet updated to 0.4.0), over `expires_at` ($1 a timestamptz).
pub(crate) fn expired_since_sql(table: &str, sweep_index: bool) -> String {
    if sweep_index {
        format!(
            "SELECT pg_catalog.count(*) FROM {table} AS s \
              WHERE {SWEEP_KEY} OPERATOR(pg_catalog.>) $1 \
                AND {SWEEP_KEY} OPERATOR(pg_catalog.<=) (pg_catalog.now() AT TIME ZONE 'UTC') \
                AND s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()"
        )
    } else {
        format!(
            "SELECT pg_catalog.count(*) FROM {table} AS s \
              WHERE s.expires_at OPERATOR(pg_catalog.>) $1 \
                AND s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()"
        )
    }
}

/// [`sweep_sql`] for a store whose extension is not yet updated to 0.4.0 (the new library
/// serves the old schema until `ALTER EXTENSION idempotency UPDATE`): it has the index on
/// `expires_at`, not the sweep index, which the ordered statement would have to replace with a
/// sort of every expired row per batch.
fn sweep_by_expires_at_sql() -> String {
    delete_skip_locked(
        STORE,
        "s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
         AND pg_catalog.starts_with(s.scope, $2)",
        "",
        "$1",
        "",
    )
}

/// This node's shards of `table`: the placements in its group whose relation exists here (a
/// shard being moved away stays until Citus drops it; one being moved here appears when the
/// move completes).
const LOCAL_SHARDS_SQL: &str = "SELECT pg_catalog.shard_name(s.logicalrelid, s.shardid) \
       FROM pg_catalog.pg_dist_shard AS s \
       JOIN pg_catalog.pg_dist_placement AS p ON p.shardid OPERATOR(pg_catalog.=) s.shardid \
      WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1::pg_catalog.regclass \
        AND p.groupid OPERATOR(pg_catalog.=) (SELECT g.groupid FROM pg_catalog.pg_dist_local_group AS g) \
        AND pg_catalog.to_regclass(pg_catalog.shard_name(s.logicalrelid, s.shardid)) IS NOT NULL \
      ORDER BY s.shardid";

/// The leaf partitions of `table` (a plain table is its own only leaf), under their
/// schema-qualified names (the search path is pinned to pg_catalog).
const PARTITIONS_SQL: &str = "SELECT t.relid::pg_catalog.regclass::pg_catalog.text \
       FROM pg_catalog.pg_partition_tree($1::pg_catalog.regclass) AS t \
      WHERE t.isleaf ORDER BY t.relid";

/// The parts of `table` this node holds, schema-qualified: on Citus its shards placed on this
/// node (read from this node's own metadata: no other node is asked), else its leaf partitions.
pub(crate) fn local_parts(
    client: &pgrx::spi::SpiClient<'_>,
    table: &str,
) -> Result<Vec<String>, pgrx::spi::Error> {
    Ok(client
        .select(
            if super::catalog::citus_table() {
                LOCAL_SHARDS_SQL
            } else {
                PARTITIONS_SQL
            },
            None,
            &[table.into()],
        )?
        .filter_map(|r| r.get::<String>(1).ok().flatten())
        .collect())
}

/// A sweep on Citus or of a partitioned store: runs the DELETE `statement(part)` on each of this
/// node's parts of `table` (schema-qualified), until `batch` rows are deleted; `args(left)`
/// gives the statement's arguments for at most `left` more rows. Each node sweeps the shards
/// it holds (its background sweeper runs this): a DELETE of the distributed table with a
/// row-locking subquery is no statement Citus runs across shards. Without Citus the parts are
/// the table's partitions: the statement matches rows by ctid, which is unique in one
/// partition only.
pub(crate) fn sweep_local_shards<'a>(
    table: &str,
    statement: impl Fn(&str) -> String,
    batch: i64,
    args: impl Fn(i64) -> Vec<pgrx::datum::DatumWithOid<'a>>,
) -> Result<i64, pgrx::spi::Error> {
    let _path = super::catalog::PinnedSearchPath::pin();
    Spi::connect_mut(|client| {
        let shards = local_parts(client, table)?;
        let mut deleted = 0;
        for shard in shards {
            if deleted >= batch {
                break;
            }
            deleted += client
                .update(statement(&shard).as_str(), None, &args(batch - deleted))?
                .len() as i64;
        }
        Ok(deleted)
    })
}
