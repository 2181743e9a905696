//! The raw fmgr entry points (the version-1 calling convention): `claim`, `complete` (through
//! `_complete`) and `claim_many`, on every request's path, read their arguments by position and
//! form their results themselves; and the role_settings trigger.

use super::args::*;
use super::result::*;
use crate::arguments;
use crate::arguments::ArgError;
use crate::encoding;
use crate::error::{arg_error, check, raise};
use crate::stats::{self, Event};
use crate::store::{self, ClaimRequest};
use pgrx::fcinfo::{pg_getarg, pg_return_null};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

v1!(pg_finfo_idempotency_claim);
/// `idempotency.claim(key, request, scope, ttl, lease) RETURNS idempotency.claim_result`
///
/// A raw fmgr function: it is on every request's path, and builds its row from a descriptor and
/// outcome labels cached per backend ([`result_type`]) instead of looking them up per call.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of the function as `sql/idempotency.sql` declares
    // it (in every release): five arguments, of types text, jsonb, text, interval, interval,
    // any of them NULL (the function is not STRICT: each is read as an Option). Their datums
    // and the result are used within the call, in its memory context.
    unsafe {
        let (key, scope) = key_and_scope(Text::arg(fcinfo, 0), Text::arg(fcinfo, 2));
        let (ttl, lease) = ttl_and_lease(pg_getarg(fcinfo, 3), pg_getarg(fcinfo, 4));
        let (ttl, lease) = (ttl.value, lease.value);
        let hash = Jsonb::arg(fcinfo, 1).map(|d| hash_arg(d.datum(), "request"));
        store::refuse_read_only("claim");
        // Checked before anything is written or counted.
        let result_type = result_type(fcinfo);
        let result = store::claim(&ClaimRequest {
            scope: &scope,
            key: &key,
            hash,
            ttl,
            lease,
        });
        stats::count(outcome_slot(result.outcome).1, 1);
        count_takeover_and_wait(&result);
        claim_tuple(&result_type, result)
    }
}

/// Counts a claim's takeover and its wait for a busy key, if it had either (most claims have
/// neither, and cost two branches here).
fn count_takeover_and_wait(result: &store::ClaimResult) {
    if result.took_over {
        stats::count(Event::Takeover, 1);
    }
    if let Some(waited) = result.waited {
        stats::count(Event::ClaimWaited, 1);
        stats::count(Event::ClaimWaitMicros, waited.as_micros() as u64);
    }
}

v1!(pg_finfo_idempotency_complete);
/// `idempotency._complete(key, response, response_status, scope, token, ttl)`: the work of
/// `idempotency.complete`; NULL when there is no live claim to complete, which the SQL wrapper
/// turns into the IK001..IK003 error that says why.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_complete(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of `_complete` as every release declares it: six
    // arguments (text, jsonb, integer, text, bigint, interval), any of them NULL (not STRICT:
    // each is read as an Option). The response datum is used within the call (the store copies
    // it into the row it writes).
    unsafe {
        let (key, scope) = key_and_scope(Text::arg(fcinfo, 0), Text::arg(fcinfo, 3));
        let response_status = check(arguments::check_status(pg_getarg::<i32>(fcinfo, 2)));
        let ttl = optional_ttl(pg_getarg(fcinfo, 5));
        let response = Jsonb::arg(fcinfo, 1).map(Jsonb::datum);
        if let Some(response) = response {
            check_size("response", response, crate::binding::max_response_size());
        }
        store::refuse_read_only("complete");
        let request = store::CompleteRequest {
            scope: &scope,
            key: &key,
            response,
            response_status,
            token: pg_getarg::<i64>(fcinfo, 4),
            ttl,
            audit: crate::binding::audit(),
        };
        match store::complete(&request) {
            Some(expires_at) => {
                stats::count(Event::Completion, 1);
                pg_sys::Datum::from(pg_sys::TimestampTz::from(expires_at))
            }
            None => pg_return_null(fcinfo),
        }
    }
}

v1!(pg_finfo_idempotency_claim_many);
/// `idempotency.claim_many(keys, requests, scope, ttl, lease) RETURNS SETOF (ord, key,
/// claim_result's columns)`: one row per position of `keys`, in order, each `claim`'s answer.
///
/// Every argument is checked first (nothing is written on bad input). The keys that are absent
/// are then inserted set-based, one statement per chunk ([`store::claim_fresh_batch`]); every
/// other position (a key that exists or is busy, a key repeated within the call, or every
/// position where the set-based insert does not apply) is claimed by [`store::claim`], in
/// input order, so each answer is exactly `claim`'s.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_claim_many(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call of the function as `sql/idempotency.sql` declares
    // it: text[], jsonb[], text, interval, interval, any of them NULL (not STRICT), returning a
    // set of rows (ord int, key text, then claim_result's columns) in materialize mode. The
    // element datums are used within the call; the tuplestore copies every row it is given.
    unsafe {
        let Some(keys) = array_arg(fcinfo, 0, "keys") else {
            arg_error(ArgError::null("keys"))
        };
        let requests = array_arg(fcinfo, 1, "requests");
        same_length("requests", requests.as_ref(), keys.len());
        let scope = Text::arg(fcinfo, 2).map(|t| t.utf8("scope"));
        let scope = check(arguments::check_key("scope", scope.as_deref(), true)).to_string();
        crate::binding::check_scope(&scope);
        let mut stored = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let key = k.map(|d| encoding::text_of(d, "keys"));
            // The position is named only when the key is refused.
            let key = match arguments::check_key("keys", key.as_deref(), false) {
                Ok(key) => key.to_string(),
                Err(_) => check(arguments::check_key(
                    &format!("keys[{}]", i + 1),
                    key.as_deref(),
                    false,
                ))
                .to_string(),
            };
            stored.push(store::stored_form(key));
        }
        let (ttl, lease) = ttl_and_lease(pg_getarg(fcinfo, 3), pg_getarg(fcinfo, 4));
        let (ttl, lease) = (ttl.value, lease.value);
        let hashes: Vec<Option<[u8; 32]>> = match &requests {
            Some(r) => r
                .iter()
                .map(|d| d.map(|d| hash_arg(d, "requests")))
                .collect(),
            None => vec![None; keys.len()],
        };
        store::refuse_read_only("claim_many");

        pg_sys::InitMaterializedSRF(fcinfo, 0);
        let rsinfo = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
        let (store_, tupdesc) = ((*rsinfo).setResult, (*rsinfo).setDesc);
        // Every row below is formed from this descriptor: each field a datum of its column.
        check_result(
            tupdesc,
            &CLAIM_MANY_RESULT,
            "the result of idempotency.claim_many",
        );
        let outcomes = outcome_labels((*crate::compat::attribute(tupdesc, 2)).atttypid);

        let mut counts = [0u64; 4];
        store::claim_many(&scope, &stored, &hashes, ttl, lease, |i, result| {
            let o = outcome_slot(result.outcome).0;
            counts[o] += 1;
            count_takeover_and_wait(&result);
            let fields: [Option<pg_sys::Datum>; 9] = [
                (i as i32 + 1).into_datum(),
                keys[i],
                Some(outcomes[o]),
                result.token.into_datum(),
                result.response.and_then(|j| j.into_datum()),
                result.response_status.into_datum(),
                result.retry_after.into_datum(),
                result.expires_at.into_datum(),
                result
                    .recovery_point
                    .as_deref()
                    .map(|p| encoding::text_datum(p, "recovery_point")),
            ];
            with_row(tupdesc, &fields, |values, nulls| {
                pg_sys::tuplestore_putvalues(store_, tupdesc, values, nulls)
            });
        });
        for (outcome, n) in OUTCOMES.into_iter().zip(counts) {
            if n > 0 {
                stats::count(outcome_slot(outcome).1, n);
            }
        }
        pg_sys::Datum::from(0usize)
    }
}

v1!(pg_finfo_idempotency_role_settings_changed);
/// `idempotency._role_settings_changed()`: the statement-level trigger of
/// `idempotency.role_settings`. Invalidates the table's relation cache entry, which makes every
/// backend read its row again once the changing transaction commits (this backend at its next
/// command); see `store::catalog::role_settings`.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn idempotency_role_settings_changed(
    fcinfo: pg_sys::FunctionCallInfo,
) -> pg_sys::Datum {
    // SAFETY: `fcinfo` is the server's call; its context is a TriggerData node exactly when the
    // function is called as a trigger (checked by its tag before the cast), whose relation is
    // open for the trigger's statement. A trigger function cannot be called any other way from
    // SQL, but the check keeps a hand-made call from reading a wrong node.
    unsafe {
        let context = (*fcinfo).context;
        if context.is_null() || (*context).type_ != pg_sys::NodeTag::T_TriggerData {
            raise(
                PgSqlErrorCode::ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED,
                "idempotency._role_settings_changed() must be called as a trigger".into(),
                None,
            );
        }
        let trigger = context.cast::<pg_sys::TriggerData>();
        pg_sys::CacheInvalidateRelcache((*trigger).tg_relation);
        // A statement-level AFTER trigger's result is ignored, but must not be SQL NULL: a
        // null pointer, as C triggers return.
        pg_sys::Datum::from(0usize)
    }
}
