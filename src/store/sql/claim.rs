//! The statements of a claim and their calls: the key's row read (locked or not), the writes of
//! a claim (a fresh insert, the restart of an expired row, the takeover of an in-progress row
//! whose lease ran out, with the token above the old one that these two take), and the insert
//! of a batch's fresh keys.

use super::{key_match, plan, tenant_arg, tenant_column, tenant_value, Plan, TenantParam};
use crate::encoding;
use crate::error::raise;
use crate::store::catalog::{key_label, relation_oid};
use crate::store::{ClaimRequest, ClaimResult, Outcome, OwnedJsonb, Row};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use pgrx::PgSqlErrorCode;

pub(crate) const ROW_COLUMNS: &str = "k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status, \
     k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at, \
     k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval)";

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
pub(super) fn restart_sql(tenant: TenantParam) -> String {
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
pub(super) const NEXT_TOKEN_SQL: &str = "SELECT pg_catalog.nextval('idempotency.token_seq')";

/// Takes over an in-progress row whose lease ran out; keeps its recovery point. The new token
/// is a value of this node's sequence above the old one (see [`restart_sql`]).
pub(super) fn takeover_sql(tenant: TenantParam) -> String {
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
