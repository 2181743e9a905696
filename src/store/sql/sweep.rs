//! The sweep's statements: the deletes of expired rows in the order of their sweep key (and by
//! `expires_at` on a store not yet updated), the count of rows expired since a time, and the
//! form every sweep statement takes (the audit table's too).

use super::STORE;

/// The form of every sweep statement: a DELETE of the rows of `table` (schema-qualified) that a
/// subquery selects by `condition` (over the alias `s`), in `order` (an `ORDER BY` clause, or
/// empty), at most `limit` (a parameter) of them, skipping rows other transactions hold, then
/// `returning` (a `RETURNING` clause, or empty). The rows are matched by ctid, which is unique
/// within one table: on a partitioned or Citus store the statement runs part by part.
pub(super) fn delete_skip_locked(
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
pub(super) fn sweep_by_expires_at_sql() -> String {
    delete_skip_locked(
        STORE,
        "s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
         AND pg_catalog.starts_with(s.scope, $2)",
        "",
        "$1",
        "",
    )
}
