//! Everything that reads or writes `idempotency.idempotency_keys` from Rust: the claim
//! algorithm and the sweep. Every statement is schema-qualified and parameterized.

use crate::error::raise;
use crate::state::{self, Decision, Stored};
use crate::{encoding, ffi, guc, keys};
use pgrx::datum::{Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use pgrx::PgSqlErrorCode;
use sha2::Digest;
use std::cell::Cell;
use std::time::{Duration, Instant};

/// A jsonb value copied out of an SPI result into the caller's memory context.
pub struct OwnedJsonb(pub pg_sys::Datum);

impl FromDatum for OwnedJsonb {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            None
        } else {
            // pgrx calls this inside the parent memory context: the copy outlives SPI.
            let copy = unsafe { pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr()) };
            Some(OwnedJsonb(pg_sys::Datum::from(copy)))
        }
    }
}

impl IntoDatum for OwnedJsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    New,
    Replay,
    InProgress,
    Mismatch,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::New => "new",
            Outcome::Replay => "replay",
            Outcome::InProgress => "in_progress",
            Outcome::Mismatch => "mismatch",
        }
    }
}

/// What `claim` returns (the fields of `idempotency.claim_result`).
pub struct ClaimResult {
    pub outcome: Outcome,
    pub token: Option<i64>,
    pub response: Option<OwnedJsonb>,
    pub response_status: Option<i32>,
    pub retry_after: Option<Interval>,
    pub expires_at: Option<TimestampWithTimeZone>,
    pub recovery_point: Option<String>,
}

impl ClaimResult {
    fn new(outcome: Outcome) -> ClaimResult {
        ClaimResult {
            outcome,
            token: None,
            response: None,
            response_status: None,
            retry_after: None,
            expires_at: None,
            recovery_point: None,
        }
    }
}

pub struct ClaimRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub hash: Option<[u8; 32]>,
    pub ttl: Interval,
    pub lease: Interval,
}

const ROW_COLUMNS: &str = "k.status OPERATOR(pg_catalog.=) 'completed'::idempotency.key_status, \
     k.request_hash, k.token, k.response, k.response_status, k.recovery_point, k.expires_at, \
     k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     k.locked_until OPERATOR(pg_catalog.<=) pg_catalog.now(), \
     GREATEST(k.locked_until OPERATOR(pg_catalog.-) pg_catalog.now(), '1 second'::pg_catalog.interval)";

fn select_sql(lock: bool) -> String {
    format!(
        "SELECT {ROW_COLUMNS} FROM idempotency.idempotency_keys k \
         WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2{}",
        if lock { " FOR UPDATE SKIP LOCKED" } else { "" }
    )
}

const INSERT_SQL: &str = "INSERT INTO idempotency.idempotency_keys AS k \
       (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl) \
     VALUES ($1, $2, $3, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(), \
       pg_catalog.now() OPERATOR(pg_catalog.+) $4, pg_catalog.now() OPERATOR(pg_catalog.+) $5, $5) \
     ON CONFLICT (scope, key) DO NOTHING \
     RETURNING k.token, k.expires_at";

/// The insert of a key that the probe, under the key's insert lock, found absent: no other
/// claimer can insert it meanwhile, so no ON CONFLICT arbiter (its extra index check and
/// speculative-insertion record) is needed. Under REPEATABLE READ the ON CONFLICT form is kept:
/// it turns a row committed after the snapshot into the serialization error it must be.
const INSERT_FRESH_SQL: &str = "INSERT INTO idempotency.idempotency_keys AS k \
       (scope, key, request_hash, status, token, created_at, locked_until, expires_at, ttl) \
     VALUES ($1, $2, $3, 'in_progress', pg_catalog.nextval('idempotency.token_seq'), pg_catalog.now(), \
       pg_catalog.now() OPERATOR(pg_catalog.+) $4, pg_catalog.now() OPERATOR(pg_catalog.+) $5, $5) \
     RETURNING k.token, k.expires_at";

/// Rewrites an expired row as a fresh claim (it counted as absent).
const RESTART_SQL: &str = "UPDATE idempotency.idempotency_keys AS k SET \
       request_hash = $3, status = 'in_progress', token = pg_catalog.nextval('idempotency.token_seq'), \
       response = NULL, response_status = NULL, recovery_point = NULL, \
       created_at = pg_catalog.now(), completed_at = NULL, \
       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
     WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
     RETURNING k.token, k.expires_at, k.recovery_point";

/// Takes over an in-progress row whose lease ran out; keeps its recovery point.
const TAKEOVER_SQL: &str = "UPDATE idempotency.idempotency_keys AS k SET \
       request_hash = COALESCE(k.request_hash, $3), token = pg_catalog.nextval('idempotency.token_seq'), \
       locked_until = pg_catalog.now() OPERATOR(pg_catalog.+) $4, \
       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) $5, ttl = $5 \
     WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
     RETURNING k.token, k.expires_at, k.recovery_point";

fn stored(r: &Row) -> Stored<'_> {
    Stored {
        completed: r.completed,
        request_hash: r.request_hash.as_deref(),
        expired: r.expired,
        lease_over: r.lease_over,
    }
}

/// The statements claim and sweep run, each prepared once per backend (SPI_keepplan) when it
/// is first needed, so a claim pays for execution only. PostgreSQL's plan cache re-plans them
/// after DDL on the table, re-resolving names, so they survive even DROP and CREATE EXTENSION
/// in one session. Prepared one by one, not all at once: a statement that cannot be planned
/// on the table as it is (an INSERT ... ON CONFLICT on a table with rules, which PostgreSQL
/// refuses) fails only where it is used, not every statement with it.
#[derive(Clone, Copy)]
enum Plan {
    Select,
    SelectLocked,
    Insert,
    InsertFresh,
    Restart,
    TakeOver,
    Complete,
    Sweep,
}

const PLAN_COUNT: usize = 8;

static PLANS: crate::local::BackendLocal<
    [Cell<Option<&'static OwnedPreparedStatement>>; PLAN_COUNT],
> = crate::local::BackendLocal::new([const { Cell::new(None) }; PLAN_COUNT]);

fn plan(
    client: &SpiClient<'_>,
    which: Plan,
) -> Result<&'static OwnedPreparedStatement, pgrx::spi::Error> {
    if let Some(p) = PLANS.with(|c| c[which as usize].get()) {
        return Ok(p);
    }
    let text = PgOid::from(pg_sys::TEXTOID);
    let key_args = [text, text];
    let claim_args = [
        text,
        text,
        PgOid::from(pg_sys::BYTEAOID),
        PgOid::from(pg_sys::INTERVALOID),
        PgOid::from(pg_sys::INTERVALOID),
    ];
    let prepared = match which {
        Plan::Select => client
            .prepare(select_sql(false).as_str(), &key_args)?
            .keep(),
        Plan::SelectLocked => client
            .prepare_mut(select_sql(true).as_str(), &key_args)?
            .keep(),
        Plan::Insert => client.prepare_mut(INSERT_SQL, &claim_args)?.keep(),
        Plan::InsertFresh => client.prepare_mut(INSERT_FRESH_SQL, &claim_args)?.keep(),
        Plan::Restart => client.prepare_mut(RESTART_SQL, &claim_args)?.keep(),
        Plan::TakeOver => client.prepare_mut(TAKEOVER_SQL, &claim_args)?.keep(),
        Plan::Complete => client
            .prepare_mut(
                COMPLETE_SQL,
                &[
                    text,
                    text,
                    PgOid::from(pg_sys::JSONBOID),
                    PgOid::from(pg_sys::INT4OID),
                    PgOid::from(pg_sys::INT8OID),
                    PgOid::from(pg_sys::INTERVALOID),
                ],
            )?
            .keep(),
        Plan::Sweep => client
            .prepare_mut(SWEEP_SQL, &[PgOid::from(pg_sys::INT8OID), text])?
            .keep(),
    };
    let p: &'static OwnedPreparedStatement = Box::leak(Box::new(prepared));
    PLANS.with(|c| c[which as usize].set(Some(p)));
    Ok(p)
}

/// One row as claim reads it.
struct Row {
    completed: bool,
    request_hash: Option<Vec<u8>>,
    token: Option<i64>,
    response: Option<OwnedJsonb>,
    response_status: Option<i32>,
    recovery_point: Option<String>,
    expires_at: Option<TimestampWithTimeZone>,
    expired: bool,
    lease_over: bool,
    retry_after: Option<Interval>,
}

fn read_row(
    client: &mut SpiClient<'_>,
    lock: bool,
    req: &ClaimRequest<'_>,
) -> Result<Option<Row>, pgrx::spi::Error> {
    let args = [
        encoding::spi_text(req.scope, "scope"),
        encoding::spi_text(req.key, "key"),
    ];
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
fn recovery_point(
    t: &pgrx::spi::SpiTupleTable<'_>,
    n: usize,
) -> Result<Option<String>, pgrx::spi::Error> {
    let datum = t.get_datum_by_ordinal(n)?;
    // SAFETY: the column is text; its value lives until the SPI call ends, after this copy.
    Ok(datum.map(|d| unsafe { encoding::text_of(d, "recovery_point") }.into_owned()))
}

#[derive(Clone, Copy)]
enum Write {
    Insert,
    InsertFresh,
    Restart,
    TakeOver,
}

fn write_claim(
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
            Write::Restart => Plan::Restart,
            Write::TakeOver => Plan::TakeOver,
        },
    )?;
    let table = client.update(
        stmt,
        None,
        &[
            encoding::spi_text(req.scope, "scope"),
            encoding::spi_text(req.key, "key"),
            hash.into(),
            req.lease.into(),
            req.ttl.into(),
        ],
    )?;
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

/// Pins the search path to `pg_catalog` while the extension runs its own statements, whatever
/// the caller's `search_path`: what a pinning `SET search_path` clause would give, without its
/// per-call cost where the server allows (see [`crate::compat::SearchPathPin`]). Every
/// statement is schema-qualified as well.
pub use crate::compat::SearchPathPin as PinnedSearchPath;

/// What a dirty-snapshot look at the primary key found.
enum Probe {
    /// No version of the row exists, committed or not.
    Absent,
    /// Another open transaction is inserting, updating or deleting the row.
    Busy,
    /// The newest committed version (or our own transaction's).
    Committed(Row),
    /// The row changed between the index scan and the heap fetch (an update of an indexed
    /// column committed in between, see [`ffi::look_up`]): look again.
    Changed,
}

/// Per-backend cache of the table's OIDs and column numbers, checked against the catalog's
/// current OIDs on every use (they change when the extension is reinstalled).
#[derive(Clone, Copy)]
struct Layout {
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
    /// request_hash, token, response, response_status, recovery_point, expires_at, locked_until
    att: [i32; 7],
    /// The role whose table privileges were checked for this layout (see `check_access`).
    checked_for: pg_sys::Oid,
    /// A column that the look-up reads (`att`, or scope and key, which it compares in the
    /// index) whose type is not the one it interprets the column's datums as: claim and
    /// complete refuse the table (`check_layout`) rather than misread or miswrite it.
    mismatch: Option<Mismatch>,
}

/// A column whose type differs from the extension's table.
#[derive(Clone, Copy)]
struct Mismatch {
    column: &'static str,
    expected: &'static str,
    /// The column's type and typmod (InvalidOid: the column is missing).
    found: pg_sys::Oid,
    typmod: i32,
}

/// The look-up's columns, in the order of `Layout::att`, with the types whose datums
/// `ffi::look_up` copies and `row_from_version` reads (as bytea, int8, jsonb, int4, text and
/// timestamptz).
const LOOKUP_COLUMNS: [(&std::ffi::CStr, pg_sys::Oid, &str); 7] = [
    (c"request_hash", pg_sys::BYTEAOID, "bytea"),
    (c"token", pg_sys::INT8OID, "bigint"),
    (c"response", pg_sys::JSONBOID, "jsonb"),
    (c"response_status", pg_sys::INT4OID, "integer"),
    (c"recovery_point", pg_sys::TEXTOID, "text"),
    (
        c"expires_at",
        pg_sys::TIMESTAMPTZOID,
        "timestamp with time zone",
    ),
    (
        c"locked_until",
        pg_sys::TIMESTAMPTZOID,
        "timestamp with time zone",
    ),
];

/// Whether attribute `a` is a live column of type `typid` with no typmod, stored as that
/// type is (length, by value, alignment): what a datum of `typid` built or read in Rust needs.
/// A typmod (`timestamptz(0)`, `varchar(n)`) would also need the value coerced, which only SQL
/// does.
fn column_is(a: &pg_sys::FormData_pg_attribute, typid: pg_sys::Oid) -> bool {
    let (mut len, mut byval, mut align) = (0i16, false, 0 as std::ffi::c_char);
    // SAFETY: a syscache look-up of a built-in or existing type; raises an ERROR only for a
    // type that does not exist, which the first comparison rules out before it runs.
    a.atttypid == typid && !a.attisdropped && a.atttypmod == -1 && {
        unsafe { pg_sys::get_typlenbyvalalign(typid, &mut len, &mut byval, &mut align) };
        a.attlen == len && a.attbyval == byval && a.attalign == align
    }
}

/// The live attribute `name` of the open relation `rel`, if any.
///
/// # Safety
/// `rel` is an open relation.
unsafe fn attribute<'a>(
    rel: pg_sys::Relation,
    name: &std::ffi::CStr,
) -> Option<&'a pg_sys::FormData_pg_attribute> {
    // SAFETY: the caller's contract; the slice is the relation's own descriptor.
    unsafe {
        let desc = (*rel).rd_att;
        (0..(*desc).natts as usize)
            .map(|i| &*crate::compat::attribute(desc, i))
            .find(|a| !a.attisdropped && std::ffi::CStr::from_ptr(a.attname.data.as_ptr()) == name)
    }
}

/// Finds the columns the look-up reads (their attribute numbers into `att`, from the opened
/// relation, so with every pending invalidation applied) and checks them against the types it
/// reads them as, and the primary key against the scan it makes (`ffi::look_up`: texteq on
/// index columns 1 and 2, collation "C").
/// Once per layout, so once per relcache invalidation of the table.
///
/// # Safety
/// `relid` and `idxid` are the table and its primary key.
unsafe fn check_lookup_columns(
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
    att: &mut [i32; 7],
) -> Option<Mismatch> {
    // SAFETY: opens and closes relations by OID (AccessShareLock, kept to the end of the
    // transaction as every reader's); every pointer read is the relcache's.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(relid, lock);
        let mut mismatch = None;
        let mut note = |name: &'static std::ffi::CStr,
                        expected: &'static str,
                        a: Option<&pg_sys::FormData_pg_attribute>| {
            if mismatch.is_none() {
                mismatch = Some(Mismatch {
                    column: name.to_str().unwrap_or("?"),
                    expected,
                    found: a.map_or(pg_sys::InvalidOid, |a| a.atttypid),
                    typmod: a.map_or(-1, |a| a.atttypmod),
                });
            }
        };
        for (i, (name, typid, expected)) in LOOKUP_COLUMNS.iter().enumerate() {
            let a = attribute(rel, name);
            att[i] = a.map_or(0, |a| a.attnum as i32);
            if !a.is_some_and(|a| column_is(a, *typid)) {
                note(name, expected, a);
            }
        }
        let mut key_columns = [0i16; 2];
        for (i, name) in [c"scope", c"key"].into_iter().enumerate() {
            let a = attribute(rel, name);
            match a {
                Some(a)
                    if column_is(a, pg_sys::TEXTOID)
                        && a.attcollation == pg_sys::C_COLLATION_OID =>
                {
                    key_columns[i] = a.attnum
                }
                _ => note(name, "text COLLATE \"C\"", a),
            }
        }
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        let index = pg_sys::index_open(idxid, lock);
        let form = (*index).rd_index;
        let ok = !form.is_null()
            && (*form).indisunique
            && (*form).indnatts == 2
            && (*form).indnkeyatts == 2
            && (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
            && (*form).indkey.values.as_slice(2) == key_columns;
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        if !ok {
            note(
                c"idempotency_keys_pkey",
                "a btree primary key on (scope, key)",
                None,
            );
        }
        mismatch
    }
}

/// Refuses a table whose look-up columns were altered (see `Layout::mismatch`): claim and
/// complete read and write those columns below SQL and cannot work on other types.
fn check_layout(l: &Layout) {
    let Some(m) = l.mismatch else {
        return;
    };
    let found = if m.found == pg_sys::InvalidOid {
        "missing or not as created".to_string()
    } else {
        // SAFETY: formats an existing type's name (palloc'd in the current context).
        unsafe {
            let name = pg_sys::format_type_with_typemod(m.found, m.typmod);
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned()
        }
    };
    raise(
        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!(
            "idempotency: idempotency.idempotency_keys.{} is {found}, but the extension needs {}",
            m.column, m.expected
        ),
        Some(
            "the table was altered by hand: alter it back, or reinstall the extension \
             (DROP EXTENSION idempotency; CREATE EXTENSION idempotency;)",
        ),
    );
}

static LAYOUT: crate::local::BackendLocal<Cell<Option<Layout>>> =
    crate::local::BackendLocal::new(Cell::new(None));

/// Forgets the cached layout when the relation cache is invalidated (the table may have been
/// dropped, e.g. by DROP EXTENSION).
#[pg_guard]
unsafe extern "C-unwind" fn forget_layout(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    LAYOUT.with(|c| {
        if c.get()
            .is_some_and(|l| relid == pg_sys::InvalidOid || l.relid == relid || l.idxid == relid)
        {
            c.set(None);
            HASHED.with(|h| h.set(None));
            DIRECT.with(|d| d.set(None));
        }
    });
}

/// How the store keeps keys (`idempotency.config`, changed by `set_key_storage`).
#[derive(Clone, Copy)]
enum KeyStorage {
    Plain,
    /// HMAC-SHA256 under this secret of the key's SHA-256 ([`crate::signing::hashed_key`]).
    Keyed([u8; 32]),
    /// Release 0.2.0's plain SHA-256: a store not yet updated to 0.3.0 (no secret column).
    Sha256,
}

/// The key storage, read once per layout.
static HASHED: crate::local::BackendLocal<Cell<Option<KeyStorage>>> =
    crate::local::BackendLocal::new(Cell::new(None));

/// Locks the store against a concurrent switch of the key storage (which takes an ACCESS
/// EXCLUSIVE lock and invalidates the layout when it commits), then tells how keys are
/// stored. Taking the lock first processes any pending invalidation, so the answer holds
/// until the end of the transaction.
fn key_storage() -> KeyStorage {
    let l = layout();
    unsafe { pg_sys::LockRelationOid(l.relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    let l = layout();
    if let Some(h) = HASHED.with(Cell::get) {
        return h;
    }
    // SAFETY: catalog look-ups inside the calling transaction.
    let config = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        pg_sys::get_relname_relid(c"config".as_ptr(), nsp)
    };
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
        .unwrap_or_else(|e| {
            raise(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                format!("idempotency: reading idempotency.config: {e}"),
                None,
            )
        });
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
    if LAYOUT.with(Cell::get).is_some_and(|c| c.relid == l.relid) {
        HASHED.with(|h| h.set(Some(storage)));
    }
    storage
}

/// Whether the store keeps keys hashed (as far as this transaction has looked).
fn keys_hashed() -> bool {
    !matches!(HASHED.with(Cell::get), None | Some(KeyStorage::Plain))
}

/// The form in which `key` is stored: itself, or its keyed hash in hex when the store keeps
/// keys hashed (`idempotency.set_key_storage`).
pub fn stored_key(key: String) -> String {
    match key_storage() {
        KeyStorage::Plain => key,
        KeyStorage::Keyed(secret) => crate::signing::hashed_key(&key, &secret),
        KeyStorage::Sha256 => keys::hex(&sha2::Sha256::digest(key.as_bytes())),
    }
}

/// How messages name a stored key: quoted, or only a prefix of its hash.
pub fn key_label(stored: &str) -> String {
    if keys_hashed() {
        crate::signing::hash_label(stored)
    } else {
        format!("{stored:?}")
    }
}

/// Claims, completions and sweeps write: refuse them at once, clearly, on a standby or in a
/// read-only transaction (a replay could otherwise be answered from the index alone).
pub fn refuse_read_only(function: &str) {
    if unsafe { pg_sys::XactReadOnly } {
        let standby = unsafe { pg_sys::RecoveryInProgress() };
        raise(
            PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION,
            format!(
                "idempotency.{function} cannot run in a read-only transaction{}",
                if standby {
                    " (this server is a standby)"
                } else {
                    ""
                }
            ),
            Some("claim, complete and sweep on the primary; idempotency.lookup works on a standby"),
        );
    }
}

static CALLBACK_REGISTERED: crate::local::BackendLocal<Cell<bool>> =
    crate::local::BackendLocal::new(Cell::new(false));

fn layout() -> Layout {
    if let Some(l) = LAYOUT.with(Cell::get) {
        return l;
    }
    if !CALLBACK_REGISTERED.with(Cell::get) {
        // SAFETY: registers a callback that only clears backend-local caches; once per backend.
        unsafe {
            pg_sys::CacheRegisterRelcacheCallback(Some(forget_layout), pg_sys::Datum::from(0usize))
        };
        CALLBACK_REGISTERED.with(|c| c.set(true));
    }
    // SAFETY: catalog look-ups by name; the OIDs passed on are checked to exist first.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let relid = pg_sys::get_relname_relid(c"idempotency_keys".as_ptr(), nsp);
        let idxid = pg_sys::get_relname_relid(c"idempotency_keys_pkey".as_ptr(), nsp);
        if relid == pg_sys::InvalidOid || idxid == pg_sys::InvalidOid {
            raise(
                PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
                "idempotency.idempotency_keys or its primary key is missing".to_string(),
                Some("reinstall the extension: DROP EXTENSION idempotency; CREATE EXTENSION idempotency;"),
            );
        }
        let mut att = [0i32; 7];
        let mismatch = check_lookup_columns(relid, idxid, &mut att);
        let l = Layout {
            relid,
            idxid,
            att,
            checked_for: pg_sys::InvalidOid,
            mismatch,
        };
        LAYOUT.with(|c| c.set(Some(l)));
        l
    }
}

/// The probe reads the table below SQL, where PostgreSQL checks no privileges: so claim checks
/// that the current role may SELECT, INSERT and UPDATE the table, as its SQL would need.
/// The result is cached with the layout: GRANT and REVOKE invalidate it (relcache), and a
/// different role (SET ROLE, SECURITY DEFINER callers) is checked again.
fn check_access() {
    let l = layout();
    check_layout(&l);
    let role = ffi::current_role();
    if l.checked_for == role {
        return;
    }
    // pg_class_aclcheck accepts any one of the bits it is given: check them one by one.
    for mode in [pg_sys::ACL_SELECT, pg_sys::ACL_INSERT, pg_sys::ACL_UPDATE] {
        unsafe {
            let result = pg_sys::pg_class_aclcheck(l.relid, role, mode as pg_sys::AclMode);
            if result != pg_sys::AclResult::ACLCHECK_OK {
                pg_sys::aclcheck_error(
                    result,
                    pg_sys::ObjectType::OBJECT_TABLE,
                    c"idempotency_keys".as_ptr(),
                );
            }
        }
    }
    LAYOUT.with(|c| {
        c.set(Some(Layout {
            checked_for: role,
            ..l
        }))
    });
}

/// The row as [`ffi::look_up`] read it: the columns of `Layout::att`, variable-length ones
/// already copied out of the table, judged at `now()`.
fn row_from_version(v: &ffi::Version) -> Row {
    let [hash, token, response, status, recovery, expires, locked] =
        std::array::from_fn(|i| v.get(i));
    let now = ffi::transaction_start();
    let expires_at = expires.map_or(0, |d| d.value() as i64);
    let locked_until = locked.map(|d| d.value() as i64);
    unsafe {
        Row {
            // The table's CHECK constraint ties "completed" to locked_until IS NULL.
            completed: locked_until.is_none(),
            request_hash: hash.map(|d| {
                let p = d.cast_mut_ptr::<pg_sys::varlena>();
                std::slice::from_raw_parts(
                    pgrx::varlena::vardata_any(p).cast::<u8>(),
                    pgrx::varlena::varsize_any_exhdr(p),
                )
                .to_vec()
            }),
            token: token.map(|d| d.value() as i64),
            // Copies in the function's memory context already: no second copy.
            response: response.map(OwnedJsonb),
            response_status: status.map(|d| d.value() as i32),
            recovery_point: recovery.map(|d| encoding::text_of(d, "recovery_point").into_owned()),
            expires_at: expires.and_then(|d| TimestampWithTimeZone::from_datum(d, false)),
            expired: expires_at <= now,
            lease_over: locked_until.is_some_and(|l| l <= now),
            retry_after: Some(seconds_left(locked_until)),
        }
    }
}

/// Looks the key up in the primary key with a dirty snapshot, as PostgreSQL's own unique
/// checks do: it sees committed rows and learns, without waiting, whether another open
/// transaction is inserting, changing or deleting the key.
///
/// `confirm_miss`: a miss is confirmed with a fresh MVCC snapshot and answered `Changed` when
/// that sees the key (a concurrent update raced the look). Callers that act on `Absent` (by
/// inserting) confirm; callers that only look again on `Absent` need not.
fn probe(scope: &str, key: &str, confirm_miss: bool) -> Probe {
    let l = layout();
    let (scope, key) = (
        encoding::server_bytes(scope, "scope"),
        encoding::server_bytes(key, "key"),
    );
    // SAFETY: `layout` checked the OIDs, the key columns (text COLLATE "C") and the types and
    // positive attribute numbers of `att` against the catalog (`check_layout` refuses a table
    // that differs before any probe).
    let v = unsafe {
        ffi::look_up(
            l.relid,
            l.idxid,
            &scope,
            &key,
            &l.att,
            confirm_miss,
            guc::debug_probe_pause(),
        )
    };
    if v.raced {
        Probe::Changed
    } else if !v.exists {
        Probe::Absent
    } else if v.xmin != pg_sys::InvalidTransactionId || v.xmax != pg_sys::InvalidTransactionId {
        Probe::Busy
    } else {
        Probe::Committed(row_from_version(&v))
    }
}

/// Walks the versions of (scope, key) that a dirty snapshot sees through the primary key, as
/// PostgreSQL's own unique checks do, until `visit` returns true. `visit` gets each version's
/// slot and the dirty snapshot's verdict on it: the open transaction that inserted it (xmin) or
/// is changing, deleting or locking it for an update (xmax), each invalid when there is none.
///
/// Returns false when the dirty scan saw no version at all but an MVCC snapshot taken after it
/// sees the key: an update of an indexed column committed between the index scan and the heap
/// fetch (see [`ffi::look_up`]), so the caller must look again.
unsafe fn scan_key_dirty(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &str,
    key: &str,
    mut visit: impl FnMut(
        *mut pg_sys::TupleTableSlot,
        pg_sys::TransactionId,
        pg_sys::TransactionId,
    ) -> bool,
) -> bool {
    // SAFETY: `heap` and `index` are open (the caller's contract); the snapshots live on this
    // frame (dirty) or are registered (fresh) for as long as the scans that use them.
    unsafe {
        let mut snapshot: pg_sys::SnapshotData = std::mem::zeroed();
        snapshot.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        // The key columns are COLLATE "C", which is what ScanKeyInit assumes.
        let scope_text = encoding::text_datum(scope, "scope");
        let key_text = encoding::text_datum(key, "key");
        for (i, d) in [scope_text, key_text].into_iter().enumerate() {
            pg_sys::ScanKeyInit(
                &mut keys[i],
                (i + 1) as pg_sys::AttrNumber,
                pg_sys::BTEqualStrategyNumber as u16,
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                d,
            );
        }
        let scan = crate::compat::index_beginscan(heap, index, &mut snapshot, 2);
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap, std::ptr::null_mut());
        let pause = guc::debug_probe_pause();
        let mut found_any = false;
        while next_version(scan, slot, pause) {
            found_any = true;
            if visit(slot, snapshot.xmin, snapshot.xmax) {
                break;
            }
        }
        // A miss may be a race with an update of an indexed column (see `ffi::look_up`):
        // confirm it with a snapshot taken now, which cannot miss a committed version.
        let raced = !found_any && {
            let fresh = pg_sys::RegisterSnapshot(pg_sys::GetLatestSnapshot());
            let confirm = crate::compat::index_beginscan(heap, index, fresh, 2);
            // index_rescan copies the keys: the same array serves both scans.
            pg_sys::index_rescan(confirm, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
            let seen = pg_sys::index_getnext_slot(
                confirm,
                pg_sys::ScanDirection::ForwardScanDirection,
                slot,
            );
            pg_sys::index_endscan(confirm);
            pg_sys::UnregisterSnapshot(fresh);
            seen
        };
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        !raced
    }
}

/// `index_getnext_slot`, which is these two calls, with the test pause of
/// `idempotency.debug_probe_pause` (debug builds only) between the index and the heap.
///
/// # Safety
/// `scan` is an open index scan over the table of `slot`.
unsafe fn next_version(
    scan: pg_sys::IndexScanDesc,
    slot: *mut pg_sys::TupleTableSlot,
    pause_ms: i32,
) -> bool {
    // SAFETY: see the function's contract; the calls are index_getnext_slot's own body.
    unsafe {
        loop {
            // A non-MVCC snapshot may see more than one member of a HOT chain: the heap fetch
            // then continues on the same index entry.
            if !(*scan).xs_heap_continue {
                if pg_sys::index_getnext_tid(scan, pg_sys::ScanDirection::ForwardScanDirection)
                    .is_null()
                {
                    return false;
                }
                if cfg!(debug_assertions) && pause_ms > 0 {
                    pg_sys::WaitLatch(
                        pg_sys::MyLatch,
                        (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH)
                            as i32,
                        pause_ms as std::ffi::c_long,
                        pg_sys::PG_WAIT_EXTENSION,
                    );
                    pg_sys::ResetLatch(pg_sys::MyLatch);
                }
            }
            if pg_sys::index_fetch_heap(scan, slot) {
                return true;
            }
        }
    }
}

/// What direct writes (a fresh claim's insert, a completion's update) need: the table's column
/// positions (0-based), the token sequence and the values of the status labels. Cached with
/// the layout.
#[derive(Clone, Copy)]
struct DirectLayout {
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
    natts: usize,
    response: usize,
    response_status: usize,
    completed_at: usize,
    completed: pg_sys::Datum,
    scope: usize,
    key: usize,
    request_hash: usize,
    status: usize,
    token: usize,
    created_at: usize,
    locked_until: usize,
    expires_at: usize,
    ttl: usize,
    token_seq: pg_sys::Oid,
    in_progress: pg_sys::Datum,
}

/// Some(None): the table is not as the extension made it; claims insert through SQL.
static DIRECT: crate::local::BackendLocal<Cell<Option<Option<DirectLayout>>>> =
    crate::local::BackendLocal::new(Cell::new(None));

/// Every column of the extension's table with the type its datums have in the direct writes
/// (InvalidOid: the enum `idempotency.key_status`), and whether a fresh claim leaves it NULL.
const OWN_COLUMNS: [(&std::ffi::CStr, pg_sys::Oid, bool); 13] = [
    (c"scope", pg_sys::TEXTOID, false),
    (c"key", pg_sys::TEXTOID, false),
    (c"request_hash", pg_sys::BYTEAOID, false),
    (c"status", pg_sys::InvalidOid, false),
    (c"token", pg_sys::INT8OID, false),
    (c"response", pg_sys::JSONBOID, true),
    (c"response_status", pg_sys::INT4OID, true),
    (c"recovery_point", pg_sys::TEXTOID, true),
    (c"created_at", pg_sys::TIMESTAMPTZOID, false),
    (c"completed_at", pg_sys::TIMESTAMPTZOID, true),
    (c"locked_until", pg_sys::TIMESTAMPTZOID, false),
    (c"expires_at", pg_sys::TIMESTAMPTZOID, false),
    (c"ttl", pg_sys::INTERVALOID, false),
];

/// The table's constraints as the extension creates them (sql/idempotency.sql), one line each:
/// type, name and `pg_get_constraintdef` (under the pinned search path), ordered by name. The
/// direct writes build rows that satisfy exactly these; any other set (one dropped, replaced
/// or added, NOT VALID, a foreign key, an exclusion or a unique constraint) goes through SQL,
/// where the executor checks it. NOT NULL constraints (catalogued here from PostgreSQL 18 on,
/// contype 'n') are left out: the layout compares each column's `attnotnull` instead, on every
/// version.
const OWN_CONSTRAINTS: &str = "c idempotency_keys_lease_check CHECK (((status = 'in_progress'::idempotency.key_status) = (locked_until IS NOT NULL)))\n\
p idempotency_keys_pkey PRIMARY KEY (scope, key)\n\
c idempotency_keys_request_hash_check CHECK (((request_hash IS NULL) OR (length(request_hash) = 32)))\n\
c idempotency_keys_response_status_check CHECK (((response_status IS NULL) OR ((response_status >= 100) AND (response_status <= 599))))";

const CONSTRAINTS_SQL: &str = "SELECT pg_catalog.string_agg(c.contype::pg_catalog.text \
       OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) c.conname::pg_catalog.text \
       OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) pg_catalog.pg_get_constraintdef(c.oid), \
       E'\\n' ORDER BY c.conname) \
     FROM pg_catalog.pg_constraint AS c WHERE c.conrelid OPERATOR(pg_catalog.=) $1 \
      AND c.contype OPERATOR(pg_catalog.<>) 'n'";

/// The direct-write layout, or None when the table differs from the extension's own; then the
/// INSERT and UPDATE statements run, with everything PostgreSQL would do for them. Checked
/// once per relcache invalidation of the table (ALTER TABLE, constraints, rules, triggers,
/// publications all send one), never per call:
/// - a plain table (not partitioned), no triggers, no rules (a rewrite rule replaces or adds
///   to the statement), no row-level security;
/// - exactly the extension's columns, each of the type (typmod, length, by-value, alignment)
///   whose datums the writes build, and the ones a fresh claim leaves NULL nullable;
/// - exactly the extension's constraints, by name and definition ([`OWN_CONSTRAINTS`]);
/// - not in any publication: the executor checks a published table's replica identity and
///   the publications' row filters and column lists on UPDATE (`CheckCmdReplicaIdentity`),
///   which the direct update would bypass.
fn direct_layout() -> Option<DirectLayout> {
    let l = layout();
    if let Some(d) = DIRECT.with(Cell::get) {
        if d.is_none_or(|d| d.relid == l.relid) {
            return d;
        }
    }
    // SAFETY: the OIDs are the layout's, just read from the catalog.
    let d = unsafe { build_direct_layout(l.relid, l.idxid) };
    if LAYOUT.with(Cell::get).is_some_and(|c| c.relid == l.relid) {
        DIRECT.with(|c| c.set(Some(d)));
    }
    d
}

/// [`direct_layout`] with the table locked for writing first: taking the lock applies the
/// invalidations of DDL that committed since the layout was read, so the layout describes the
/// table as the write will find it (as the executor's lock at the start of a statement does).
fn direct_layout_for_write() -> Option<DirectLayout> {
    let l = layout();
    // SAFETY: locks an existing relation by OID; held to the end of the transaction, as a
    // write's lock is.
    unsafe { pg_sys::LockRelationOid(l.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
    direct_layout()
}

/// # Safety
/// `relid` and `idxid` are the store table and its primary key.
unsafe fn build_direct_layout(relid: pg_sys::Oid, idxid: pg_sys::Oid) -> Option<DirectLayout> {
    let _path = PinnedSearchPath::pin();
    // SAFETY: the caller's contract; the relation stays open (AccessShareLock) while its
    // descriptor, rules and publication description are read.
    unsafe {
        let status_type = Spi::get_one::<pg_sys::Oid>(
            "SELECT 'idempotency.key_status'::pg_catalog.regtype::pg_catalog.oid",
        )
        .ok()
        .flatten()?;
        let rel = pg_sys::table_open(relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let desc = (*rel).rd_att;
        let natts = (*desc).natts as usize;
        let form = (*rel).rd_rel;
        let mut publication: pg_sys::PublicationDesc = Default::default();
        pg_sys::RelationBuildPublicationDesc(rel, &mut publication);
        let actions = publication.pubactions;
        let published =
            actions.pubinsert || actions.pubupdate || actions.pubdelete || actions.pubtruncate;
        let plain = (*form).relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
            && (*rel).trigdesc.is_null()
            && (*rel).rd_rules.is_null()
            && !(*form).relhasrules
            && !(*form).relrowsecurity
            && !published;
        let ours = (0..natts)
            .map(|i| &*crate::compat::attribute(desc, i))
            .filter(|a| !a.attisdropped)
            .all(|a| {
                let name = std::ffi::CStr::from_ptr(a.attname.data.as_ptr());
                OWN_COLUMNS.iter().any(|&(own, typid, nullable)| {
                    own == name
                        && column_is(
                            a,
                            if typid == pg_sys::InvalidOid {
                                status_type
                            } else {
                                typid
                            },
                        )
                        && (!nullable || !a.attnotnull)
                })
            });
        let all = OWN_COLUMNS
            .iter()
            .all(|&(own, _, _)| attribute(rel, own).is_some());
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        if !(plain && ours && all) {
            return None;
        }
        let constraints = Spi::get_one_with_args::<String>(CONSTRAINTS_SQL, &[relid.into()])
            .ok()
            .flatten()?;
        if constraints != OWN_CONSTRAINTS {
            return None;
        }
        let position = |name: &std::ffi::CStr| {
            let n = pg_sys::get_attnum(relid, name.as_ptr());
            (n > 0).then(|| n as usize - 1)
        };
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        let token_seq = pg_sys::get_relname_relid(c"token_seq".as_ptr(), nsp);
        let label = |name: &str| {
            Spi::get_one_with_args::<pg_sys::Oid>(
                "SELECT e.oid FROM pg_catalog.pg_enum AS e \
                  WHERE e.enumtypid OPERATOR(pg_catalog.=) 'idempotency.key_status'::pg_catalog.regtype \
                    AND e.enumlabel OPERATOR(pg_catalog.=) $1",
                &[name.into()],
            )
            .ok()
            .flatten()
        };
        let in_progress = label("in_progress")?;
        let completed = label("completed")?;
        if token_seq == pg_sys::InvalidOid {
            return None;
        }
        Some(DirectLayout {
            relid,
            idxid,
            natts,
            response: position(c"response")?,
            response_status: position(c"response_status")?,
            completed_at: position(c"completed_at")?,
            completed: pg_sys::Datum::from(completed),
            scope: position(c"scope")?,
            key: position(c"key")?,
            request_hash: position(c"request_hash")?,
            status: position(c"status")?,
            token: position(c"token")?,
            created_at: position(c"created_at")?,
            locked_until: position(c"locked_until")?,
            expires_at: position(c"expires_at")?,
            ttl: position(c"ttl")?,
            token_seq,
            in_progress: pg_sys::Datum::from(in_progress),
        })
    }
}

/// Inserts a fresh claim (absent key, under its insert lock, READ COMMITTED) straight into the
/// heap and its indexes, as `INSERT_FRESH_SQL` would, without planning or executing a
/// statement: the row is built here, so the table's CHECK constraints hold by construction,
/// and [`direct_layout`] sends anything else (triggers, extra columns or constraints)
/// through SQL. The primary key is still checked by the index (a row inserted some other way
/// meanwhile is a unique violation, as with the INSERT).
fn insert_direct(d: &DirectLayout, req: &ClaimRequest<'_>) -> ClaimResult {
    use pgrx::IntoDatum;
    unsafe {
        let rel = pg_sys::table_open(d.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
        let desc = (*rel).rd_att;
        if (*desc).natts as usize != d.natts || !(*rel).trigdesc.is_null() {
            // Changed since the layout was read (its invalidation comes with the lock): this
            // transaction retries and the next claim reads the table afresh.
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            table_changed("claim");
        }
        let mut values = vec![pg_sys::Datum::from(0usize); d.natts];
        let mut nulls = vec![true; d.natts];
        let mut set = |i: usize, v: pg_sys::Datum| {
            values[i] = v;
            nulls[i] = false;
        };
        let now = pg_sys::Datum::from(ffi::transaction_start());
        let plus = |interval: pg_sys::Datum| {
            pg_sys::DirectFunctionCall2Coll(
                Some(timestamptz_pl_interval),
                pg_sys::InvalidOid,
                now,
                interval,
            )
        };
        let (Some(lease), Some(ttl), Some(scope), Some(key)) = (
            req.lease.into_datum(),
            req.ttl.into_datum(),
            Some(encoding::text_datum(req.scope, "scope")),
            Some(encoding::text_datum(req.key, "key")),
        ) else {
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            internal("a claim argument could not be converted");
        };
        let token = pg_sys::DirectFunctionCall1Coll(
            Some(nextval_oid),
            pg_sys::InvalidOid,
            pg_sys::Datum::from(d.token_seq),
        );
        let expires_at = plus(ttl);
        set(d.scope, scope);
        set(d.key, key);
        if let Some(hash) = req.hash.and_then(|h| h.to_vec().into_datum()) {
            set(d.request_hash, hash);
        }
        set(d.status, d.in_progress);
        set(d.token, token);
        set(d.created_at, now);
        set(d.locked_until, plus(lease));
        set(d.expires_at, expires_at);
        set(d.ttl, ttl);
        let tuple = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());

        let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsHeapTuple);
        pg_sys::ExecStoreHeapTuple(tuple, slot, false);
        pg_sys::table_tuple_insert(
            rel,
            slot,
            pg_sys::GetCurrentCommandId(true),
            0,
            std::ptr::null_mut(),
        );
        insert_index_entries(rel, slot, false);
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        // What later statements of this transaction (complete, a second claim) must see.
        pg_sys::CommandCounterIncrement();

        let mut result = ClaimResult::new(Outcome::New);
        result.token = Some(token.value() as i64);
        result.expires_at = TimestampWithTimeZone::from_datum(expires_at, false);
        result
    }
}

// The V1 functions themselves, for DirectFunctionCall (which calls them from C): pgrx's
// `pg_sys` wrappers are Rust functions.
unsafe extern "C-unwind" {
    fn timestamptz_pl_interval(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
    fn nextval_oid(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum;
}

fn internal(what: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("idempotency: {what}"),
        None,
    )
}

/// The table was altered while a claim or completion had already chosen how to write to it.
fn table_changed(what: &str) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!("idempotency: the table changed during a {what}"),
        Some("retry the transaction"),
    )
}

/// `locktag_field4` of the extension's advisory locks; the SQL advisory lock functions use 1
/// and 2, so these never collide with an application's own advisory locks.
const LOCK_CLASS: u16 = 0x1de7;

/// A session-level lock on hash(scope, key), held only while one claim probes and inserts the
/// key: microseconds, never until commit, so a transaction can claim any number of keys.
struct KeyInsertLock(pg_sys::LOCKTAG);

impl KeyInsertLock {
    fn acquire(scope: &str, key: &str) -> KeyInsertLock {
        // FNV-1a: stable across builds, so backends running different builds of the library
        // (during an upgrade) still agree on the lock of a key.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in scope.bytes().chain([0xff]).chain(key.bytes()) {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        let tag = pg_sys::LOCKTAG {
            locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
            locktag_field2: (hash >> 32) as u32,
            locktag_field3: hash as u32,
            locktag_field4: LOCK_CLASS,
            locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
            locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
        };
        unsafe {
            pg_sys::LockAcquire(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true, false)
        };
        KeyInsertLock(tag)
    }
}

impl Drop for KeyInsertLock {
    /// Runs on success and while an ERROR unwinds through claim alike.
    fn drop(&mut self) {
        unsafe { pg_sys::LockRelease(&self.0, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, true) };
    }
}

fn seconds_left(locked_until: Option<pg_sys::TimestampTz>) -> Interval {
    let now = ffi::transaction_start();
    let left = locked_until.map(|t| t.saturating_sub(now)).unwrap_or(0);
    Interval::new(0, 0, left.max(1_000_000))
        .unwrap_or_else(|_| Interval::new(0, 0, 1_000_000).unwrap())
}

/// The answer to a claim that meets another open transaction's claim (or change) of the key:
/// in progress, come back after `idempotency.busy_retry_after` (that transaction usually ends
/// in milliseconds: its lease says nothing about when). `expires_at` stays NULL: the row is not
/// committed and may never be.
fn busy_result() -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = Interval::new(0, 0, guc::int(&guc::BUSY_RETRY_AFTER).max(1) as i64 * 1000).ok();
    r
}

/// `now()` plus an interval, with PostgreSQL's calendar arithmetic in the session's time zone
/// (what `pg_catalog.now() + interval` gives the statements).
pub fn now_plus(interval: &Interval) -> pg_sys::TimestampTz {
    use pgrx::IntoDatum;
    let now = pg_sys::Datum::from(ffi::transaction_start());
    let Some(i) = interval.into_datum() else {
        internal("an interval could not be converted");
    };
    // SAFETY: timestamptz_pl_interval takes a timestamptz and an interval datum; it raises a
    // clear error (22008) when the result is out of range.
    unsafe {
        pg_sys::DirectFunctionCall2Coll(Some(timestamptz_pl_interval), pg_sys::InvalidOid, now, i)
    }
    .value() as pg_sys::TimestampTz
}

fn sleep_a_little() {
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            5,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
    }
    pgrx::check_for_interrupts!();
}

fn log_mismatch(req: &ClaimRequest<'_>, stored: Option<&[u8]>) {
    let prefix = |h: Option<&[u8]>| {
        h.map(|h| crate::keys::hex(&h[..h.len().min(6)]))
            .unwrap_or_default()
    };
    let message = format!(
        "idempotency: key reused with a different request: scope={:?} key={} stored_hash={} request_hash={}",
        req.scope,
        key_label(req.key),
        prefix(stored),
        prefix(req.hash.as_ref().map(|h| &h[..]))
    );
    pgrx::warning!("{}", encoding::for_message(message));
}

/// How many times claim re-reads a row that changed under it before giving up.
const MAX_ROUNDS: usize = 50;

/// The claim algorithm. Never waits on another transaction's claim of the same key beyond
/// `idempotency.claim_wait`: uncommitted inserts and changes are seen through a dirty-snapshot
/// probe and locked rows are skipped, both answered `in_progress`.
///
/// Under READ COMMITTED (where every statement sees the newest committed data anyway) the
/// probe's row is the answer: replays, mismatches and in-progress answers touch no SQL at all.
/// Under REPEATABLE READ and SERIALIZABLE the row is read through the transaction's snapshot.
pub fn claim(req: &ClaimRequest<'_>) -> ClaimResult {
    check_access();
    let wait = Duration::from_millis(guc::int(&guc::CLAIM_WAIT).max(0) as u64);
    // Only a wait for a busy key needs the clock.
    let mut started = None;
    let snapshot_reads = unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32;
    let mut rounds = 0;
    while rounds < MAX_ROUNDS {
        let step = if snapshot_reads {
            with_spi(|client| match read_row(client, false, req)? {
                Some(row) => decide(client, req, row),
                None => match probe_or_insert(req, || insert(client, req)) {
                    Looked::Inserted(step) => step,
                    Looked::Found(Probe::Busy) => Ok(Step::Busy),
                    // Committed, but not in this REPEATABLE READ snapshot: the insert fails with
                    // a serialization error, as it should.
                    Looked::Found(Probe::Committed(_)) => insert(client, req),
                    Looked::Found(Probe::Absent | Probe::Changed) => Ok(Step::Again),
                },
            })
        } else {
            // First a look without the insert lock: a key that exists (the replay, mismatch and
            // in-progress answers) needs no lock at all. Only an absent key is looked at again
            // under the lock and inserted.
            // Unconfirmed: a miss is looked at again, confirmed, under the insert lock.
            let found = match probe(req.scope, req.key, false) {
                Probe::Absent => probe_or_insert(req, || match direct_layout_for_write() {
                    Some(d) => Ok(Step::Done(insert_direct(&d, req))),
                    None => with_spi(|client| {
                        Ok(write_claim(client, Write::InsertFresh, req)?
                            .map_or(Step::Again, Step::Done))
                    }),
                }),
                found => Looked::Found(found),
            };
            match found {
                Looked::Inserted(step) => step,
                Looked::Found(Probe::Busy) => Ok(Step::Busy),
                Looked::Found(Probe::Committed(row)) => {
                    match state::decide(stored(&row), given(req)) {
                        d @ (Decision::Replay | Decision::Mismatch | Decision::InProgress) => {
                            Ok(Step::Done(answer(req, d, row)))
                        }
                        Decision::Restart | Decision::TakeOver => {
                            with_spi(|client| decide(client, req, row))
                        }
                    }
                }
                Looked::Found(Probe::Absent | Probe::Changed) => Ok(Step::Again),
            }
        };
        match step {
            Ok(Step::Done(result)) => return result,
            Ok(Step::Busy) => {
                if started.get_or_insert_with(Instant::now).elapsed() >= wait {
                    return busy_result();
                }
                sleep_a_little();
            }
            // Only rounds where the row changed under us count; waiting does not.
            Ok(Step::Again) => rounds += 1,
            Err(e) => raise(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                format!("idempotency.claim: {e}"),
                None,
            ),
        }
    }
    raise(
        PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
        format!(
            "idempotency.claim: key {} kept changing under concurrent claims",
            key_label(req.key)
        ),
        Some("retry the transaction"),
    )
}

/// Runs statements through SPI with the search path pinned (see [`PinnedSearchPath`]). Only
/// the paths that run SQL pin it: the look-up and the direct writes resolve no names.
fn with_spi<R>(f: impl FnOnce(&mut SpiClient<'_>) -> R) -> R {
    let _path = PinnedSearchPath::pin();
    Spi::connect_mut(f)
}

enum Looked {
    Inserted(Result<Step, pgrx::spi::Error>),
    Found(Probe),
}

/// One look at the key under its insert lock: an absent key is inserted at once (by `insert`);
/// anything else is returned after the lock is released. The lock serializes probe+insert of
/// a key across backends for a moment, so an insert never meets another claimer's
/// half-finished insert of the same key (which would wait for that transaction to end). Under
/// READ COMMITTED a key that exists was already answered by a look without the lock.
fn probe_or_insert(
    req: &ClaimRequest<'_>,
    insert: impl FnOnce() -> Result<Step, pgrx::spi::Error>,
) -> Looked {
    let _insert_lock = KeyInsertLock::acquire(req.scope, req.key);
    // Under READ COMMITTED an absent key is inserted without ON CONFLICT: a miss that raced a
    // concurrent update must not pass for absence (it would be a unique violation, where the
    // row should have been answered). Under REPEATABLE READ the insert's ON CONFLICT DO
    // NOTHING handles that race (the executor re-checks), and a fresh snapshot outside the
    // transaction's own would only confuse SERIALIZABLE's conflict checks.
    // SAFETY: reads a backend variable.
    let read_committed = unsafe { pg_sys::XactIsoLevel } < pg_sys::XACT_REPEATABLE_READ as i32;
    match probe(req.scope, req.key, read_committed) {
        Probe::Absent => Looked::Inserted(insert()),
        found => Looked::Found(found),
    }
}

fn given<'a>(req: &'a ClaimRequest<'_>) -> Option<&'a [u8]> {
    req.hash.as_ref().map(|h| &h[..])
}

/// Inserts the claim; `Again` when another claimer's row got there first.
fn insert(client: &mut SpiClient<'_>, req: &ClaimRequest<'_>) -> Result<Step, pgrx::spi::Error> {
    Ok(write_claim(client, Write::Insert, req)?.map_or(Step::Again, Step::Done))
}

/// The answers that write nothing: replay, mismatch and in_progress.
fn answer(req: &ClaimRequest<'_>, decision: Decision, row: Row) -> ClaimResult {
    match decision {
        Decision::Replay => replay(row),
        Decision::Mismatch => {
            log_mismatch(req, row.request_hash.as_deref());
            let mut r = ClaimResult::new(Outcome::Mismatch);
            r.expires_at = row.expires_at;
            r
        }
        _ => in_progress(row),
    }
}

/// Applies the outcome table to a row that exists.
fn decide(
    client: &mut SpiClient<'_>,
    req: &ClaimRequest<'_>,
    row: Row,
) -> Result<Step, pgrx::spi::Error> {
    match state::decide(stored(&row), given(req)) {
        d @ (Decision::Replay | Decision::Mismatch | Decision::InProgress) => {
            Ok(Step::Done(answer(req, d, row)))
        }
        Decision::Restart | Decision::TakeOver => {
            // Lock the newest version without waiting, then decide again on it.
            let Some(locked) = read_row(client, true, req)? else {
                return Ok(match probe(req.scope, req.key, false) {
                    Probe::Busy => Step::Busy,
                    // Still there, so another claimer holds its row lock while it decides on a
                    // takeover: the key is busy (spinning here would only burn rounds).
                    Probe::Committed(_) => Step::Busy,
                    Probe::Absent | Probe::Changed => Step::Again,
                });
            };
            match state::decide(stored(&locked), given(req)) {
                Decision::Restart => {
                    Ok(write_claim(client, Write::Restart, req)?.map_or(Step::Again, Step::Done))
                }
                Decision::TakeOver => {
                    Ok(write_claim(client, Write::TakeOver, req)?.map_or(Step::Again, Step::Done))
                }
                d => Ok(Step::Done(answer(req, d, locked))),
            }
        }
    }
}

enum Step {
    Done(ClaimResult),
    Busy,
    Again,
}

fn replay(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::Replay);
    r.token = row.token;
    r.response = row.response;
    r.response_status = row.response_status;
    r.expires_at = row.expires_at;
    r
}

fn in_progress(row: Row) -> ClaimResult {
    let mut r = ClaimResult::new(Outcome::InProgress);
    r.retry_after = row.retry_after;
    r.expires_at = row.expires_at;
    r.recovery_point = row.recovery_point;
    r
}

/// Stores the response on the live in-progress claim (with the right token, when given).
const COMPLETE_SQL: &str = "UPDATE idempotency.idempotency_keys AS k SET \
       status = 'completed'::idempotency.key_status, response = $3, response_status = $4, \
       completed_at = pg_catalog.now(), locked_until = NULL, \
       expires_at = pg_catalog.now() OPERATOR(pg_catalog.+) COALESCE($6, k.ttl), \
       ttl = COALESCE($6, k.ttl) \
     WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 \
       AND k.status OPERATOR(pg_catalog.=) 'in_progress'::idempotency.key_status \
       AND k.expires_at OPERATOR(pg_catalog.>) pg_catalog.now() \
       AND ($5 IS NULL OR k.token OPERATOR(pg_catalog.=) $5) \
     RETURNING k.expires_at, k.request_hash, k.token";

/// One audit row per completion (`idempotency.audit = on`), in the completing transaction.
const AUDIT_SQL: &str = "INSERT INTO idempotency.audit \
       (scope, key, key_is_hash, request_hash, token, response_status, completed_at, completed_by) \
     VALUES ($1, $2, $3, $4, $5, $6, pg_catalog.now(), $7)";

/// Deletes up to $2 audit rows older than $1 seconds whose scope starts with $3 ('' for all),
/// skipping rows other transactions hold.
const AUDIT_SWEEP_SQL: &str = "DELETE FROM idempotency.audit AS a \
     WHERE a.ctid OPERATOR(pg_catalog.=) ANY (ARRAY( \
       SELECT s.ctid FROM idempotency.audit AS s \
        WHERE s.completed_at OPERATOR(pg_catalog.<) (pg_catalog.now() \
              OPERATOR(pg_catalog.-) pg_catalog.make_interval(secs => $1)) \
          AND pg_catalog.starts_with(s.scope, $3) \
        LIMIT $2 FOR UPDATE SKIP LOCKED))";

/// The audit statements, prepared on first use (a store created by release 0.1.0 and not yet
/// updated has no audit table).
struct AuditPlans {
    insert: OwnedPreparedStatement,
    sweep: OwnedPreparedStatement,
}

static AUDIT_PLANS: crate::local::BackendLocal<Cell<Option<&'static AuditPlans>>> =
    crate::local::BackendLocal::new(Cell::new(None));

fn audit_plans(client: &SpiClient<'_>) -> Result<&'static AuditPlans, pgrx::spi::Error> {
    if let Some(p) = AUDIT_PLANS.with(Cell::get) {
        return Ok(p);
    }
    let exists = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        pg_sys::get_relname_relid(c"audit".as_ptr(), nsp) != pg_sys::InvalidOid
    };
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
                AUDIT_SQL,
                &[
                    oid(pg_sys::TEXTOID),
                    oid(pg_sys::TEXTOID),
                    oid(pg_sys::BOOLOID),
                    oid(pg_sys::BYTEAOID),
                    oid(pg_sys::INT8OID),
                    oid(pg_sys::INT4OID),
                    oid(pg_sys::TEXTOID),
                ],
            )?
            .keep(),
        sweep: client
            .prepare_mut(
                AUDIT_SWEEP_SQL,
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

pub struct CompleteRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub response: Option<pg_sys::Datum>,
    pub response_status: i32,
    pub token: Option<i64>,
    pub ttl: Option<Interval>,
}

/// What a completion changed: the new expiry, and the claim's request hash and token (for the
/// audit row).
struct Completed {
    expires_at: Option<TimestampWithTimeZone>,
    request_hash: Option<Vec<u8>>,
    token: Option<i64>,
}

/// Completes a claim (`req.key` in its stored form); None when there is no live in-progress
/// claim with that token (the SQL wrapper then explains why, with its own SQLSTATE).
///
/// Under READ COMMITTED the row is updated directly ([`complete_direct`]); under REPEATABLE
/// READ and SERIALIZABLE (whose snapshot and predicate-lock rules the executor applies) and on
/// a table that is not as the extension made it ([`direct_layout`]: changed by hand, with
/// rules, or published), through the UPDATE statement.
pub fn complete(req: &CompleteRequest<'_>) -> Option<TimestampWithTimeZone> {
    let _path = PinnedSearchPath::pin();
    // Both paths read the completed row's columns as the extension's types.
    check_layout(&layout());
    let read_committed = unsafe { pg_sys::XactIsoLevel } < pg_sys::XACT_REPEATABLE_READ as i32;
    let direct = if read_committed {
        direct_layout_for_write()
    } else {
        None
    };
    let done = match direct {
        Some(d) => {
            check_access();
            complete_direct(&d, req)
        }
        None => complete_sql(req),
    };
    let done = done?;
    if guc::audit() {
        audit(req, &done);
    }
    done.expires_at
}

fn spi_failed(e: pgrx::spi::Error) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("idempotency.complete: {e}"),
        None,
    )
}

fn complete_sql(req: &CompleteRequest<'_>) -> Option<Completed> {
    let response = req
        .response
        .map(|d| unsafe { pgrx::datum::DatumWithOid::new(d, pg_sys::JSONBOID) });
    Spi::connect_mut(|client| {
        let complete = plan(client, Plan::Complete)?;
        let response = match response {
            Some(d) => d,
            None => pgrx::datum::DatumWithOid::null_oid(pg_sys::JSONBOID),
        };
        let table = client.update(
            complete,
            None,
            &[
                encoding::spi_text(req.scope, "scope"),
                encoding::spi_text(req.key, "key"),
                response,
                req.response_status.into(),
                req.token.into(),
                req.ttl.into(),
            ],
        )?;
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
    .unwrap_or_else(|e| spi_failed(e))
}

/// Appends the audit row of a completion, in the completing transaction.
fn audit(req: &CompleteRequest<'_>, done: &Completed) {
    Spi::connect_mut(|client| {
        let audit = audit_plans(client)?;
        client.update(
            &audit.insert,
            None,
            &[
                encoding::spi_text(req.scope, "scope"),
                encoding::spi_text(req.key, "key"),
                keys_hashed().into(),
                done.request_hash.clone().into(),
                done.token.into(),
                req.response_status.into(),
                completing_role(),
            ],
        )?;
        Ok(())
    })
    .unwrap_or_else(|e| spi_failed(e))
}

/// The newest version of a key's row, as a completion must see it.
enum Newest {
    /// No row, or only one that another open transaction is inserting (an UPDATE statement
    /// would not see it either).
    Absent,
    /// Another open transaction is changing, deleting or locking the row: wait for it.
    Wait(pg_sys::TransactionId),
    /// The newest committed version (or this transaction's own), copied.
    Row(pg_sys::HeapTuple),
    /// The scan raced an update of the row (see [`scan_key_dirty`]): look again.
    Changed,
}

unsafe fn newest_version(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    scope: &str,
    key: &str,
) -> Newest {
    let mut found = Newest::Absent;
    // SAFETY: `rel` and `index` are the open table and its primary key (the caller's contract).
    let whole = unsafe {
        scan_key_dirty(rel, index, scope, key, |slot, xmin, xmax| {
            if xmax != pg_sys::InvalidTransactionId {
                found = Newest::Wait(xmax);
                return true;
            }
            if xmin != pg_sys::InvalidTransactionId {
                return false; // another transaction's uncommitted insert (or new version)
            }
            found = Newest::Row(pg_sys::ExecCopySlotHeapTuple(slot));
            true
        })
    };
    if whole {
        found
    } else {
        Newest::Changed
    }
}

/// [`complete_sql`]'s UPDATE, done directly on the row (READ COMMITTED, table as the extension
/// made it): finds the newest version through the primary key, waits for a transaction that
/// is changing it and looks again (as the UPDATE re-checks a concurrently updated row), checks
/// that it is a live in-progress claim with the given token, and updates it in place
/// (heap_update, HOT when no indexed column changes), adding index entries only when it was
/// not HOT.
fn complete_direct(d: &DirectLayout, req: &CompleteRequest<'_>) -> Option<Completed> {
    use pgrx::IntoDatum;
    unsafe {
        // What this transaction's earlier statements (the claim) wrote must be visible.
        pg_sys::CommandCounterIncrement();
        let lock = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(d.relid, lock);
        let index = pg_sys::index_open(d.idxid, lock);
        let desc = (*rel).rd_att;
        let close = || {
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        };
        if (*desc).natts as usize != d.natts || !(*rel).trigdesc.is_null() {
            close();
            table_changed("completion");
        }
        let now = ffi::transaction_start();
        for _ in 0..MAX_ROUNDS {
            let old = match newest_version(rel, index, req.scope, req.key) {
                Newest::Absent => {
                    close();
                    return None;
                }
                Newest::Wait(xid) => {
                    pg_sys::XactLockTableWait(
                        xid,
                        rel,
                        std::ptr::null_mut(),
                        pg_sys::XLTW_Oper::XLTW_None,
                    );
                    continue;
                }
                // Counts as a round, like a row that changed under the update.
                Newest::Changed => continue,
                Newest::Row(tuple) => tuple,
            };
            let mut values = vec![pg_sys::Datum::from(0usize); d.natts];
            let mut nulls = vec![true; d.natts];
            pg_sys::heap_deform_tuple(old, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let live_claim = !nulls[d.status]
                && values[d.status] == d.in_progress
                && !nulls[d.expires_at]
                && (values[d.expires_at].value() as i64) > now
                && req
                    .token
                    .is_none_or(|t| !nulls[d.token] && values[d.token].value() as i64 == t);
            if !live_claim {
                close();
                return None;
            }
            let request_hash = Vec::<u8>::from_datum(values[d.request_hash], nulls[d.request_hash]);
            let token = values[d.token].value() as i64;
            let ttl = match req.ttl.and_then(|t| t.into_datum()) {
                Some(t) => t,
                None => values[d.ttl],
            };
            let expires_at = pg_sys::DirectFunctionCall2Coll(
                Some(timestamptz_pl_interval),
                pg_sys::InvalidOid,
                pg_sys::Datum::from(now),
                ttl,
            );
            let mut set = |i: usize, v: Option<pg_sys::Datum>| {
                nulls[i] = v.is_none();
                values[i] = v.unwrap_or(pg_sys::Datum::from(0usize));
            };
            set(d.status, Some(d.completed));
            set(d.response, req.response);
            set(
                d.response_status,
                Some(pg_sys::Datum::from(req.response_status)),
            );
            set(d.completed_at, Some(pg_sys::Datum::from(now)));
            set(d.locked_until, None);
            set(d.expires_at, Some(expires_at));
            set(d.ttl, Some(ttl));
            let new = pg_sys::heap_form_tuple(desc, values.as_mut_ptr(), nulls.as_mut_ptr());
            let slot = pg_sys::MakeSingleTupleTableSlot(desc, &pg_sys::TTSOpsHeapTuple);
            pg_sys::ExecStoreHeapTuple(new, slot, false);
            let mut tid = (*old).t_self;
            let mut tmfd: pg_sys::TM_FailureData = std::mem::zeroed();
            let mut lockmode: pg_sys::LockTupleMode::Type = 0;
            let (result, index_update) = crate::compat::table_tuple_update(
                rel,
                &mut tid,
                slot,
                pg_sys::GetCurrentCommandId(true),
                true,
                &mut tmfd,
                &mut lockmode,
            );
            match result {
                pg_sys::TM_Result::TM_Ok => {
                    // As the executor: a HOT update adds no index entries, except (16 on) to
                    // summarizing indexes whose column changed.
                    match index_update {
                        crate::compat::IndexUpdate::None => {}
                        crate::compat::IndexUpdate::All => insert_index_entries(rel, slot, false),
                        crate::compat::IndexUpdate::Summarizing => {
                            insert_index_entries(rel, slot, true)
                        }
                    }
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                    close();
                    return Some(Completed {
                        expires_at: TimestampWithTimeZone::from_datum(expires_at, false),
                        request_hash,
                        token: Some(token),
                    });
                }
                // Changed or deleted since we read it (its transaction committed while we
                // waited in heap_update): read the newest version again.
                pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted => {
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                }
                other => {
                    pg_sys::ExecDropSingleTupleTableSlot(slot);
                    close();
                    internal(&format!("unexpected result {other} updating the row"));
                }
            }
        }
        close();
        raise(
            PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
            format!(
                "idempotency.complete: key {} kept changing under concurrent completions",
                key_label(req.key)
            ),
            Some("retry the transaction"),
        )
    }
}

/// Adds the index entries of a row just written to the heap (in `slot`, with its TID): what
/// the executor does after an insert or a non-HOT update (or, `only_summarizing`, after a HOT
/// update that changed a summarizing index's column).
unsafe fn insert_index_entries(
    rel: pg_sys::Relation,
    slot: *mut pg_sys::TupleTableSlot,
    only_summarizing: bool,
) {
    unsafe {
        let estate = pg_sys::CreateExecutorState();
        let rri = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>())
            as *mut pg_sys::ResultRelInfo;
        (*rri).type_ = pg_sys::NodeTag::T_ResultRelInfo;
        // No range table entry: this is not a planned statement.
        pg_sys::InitResultRelInfo(rri, rel, 0, std::ptr::null_mut(), 0);
        pg_sys::ExecOpenIndices(rri, false);
        // update = false (inside compat): it only feeds a hint to btree's bottom-up deletion,
        // which would look the changed columns up in a range table this write does not have.
        let recheck = crate::compat::insert_index_tuples(rri, slot, estate, only_summarizing);
        pg_sys::list_free(recheck);
        pg_sys::ExecCloseIndices(rri);
        pg_sys::FreeExecutorState(estate);
    }
}

/// Deletes up to $1 expired rows whose scope starts with $2 ('' for all).
const SWEEP_SQL: &str = "DELETE FROM idempotency.idempotency_keys AS k \
     WHERE k.ctid OPERATOR(pg_catalog.=) ANY (ARRAY( \
       SELECT s.ctid FROM idempotency.idempotency_keys AS s \
        WHERE s.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now() \
          AND pg_catalog.starts_with(s.scope, $2) \
        LIMIT $1 FOR UPDATE SKIP LOCKED))";

/// How many rows still in the table expired after `since` (and by now()): the inflow the
/// sweeper must keep up with while it yields to the application. An index range scan over the
/// newest expiries only.
pub fn expired_since(since: pg_sys::TimestampTz) -> i64 {
    let _path = PinnedSearchPath::pin();
    let since = unsafe {
        pgrx::datum::DatumWithOid::new(pg_sys::Datum::from(since), pg_sys::TIMESTAMPTZOID)
    };
    Spi::get_one_with_args::<i64>(
        "SELECT pg_catalog.count(*) FROM idempotency.idempotency_keys AS k \
          WHERE k.expires_at OPERATOR(pg_catalog.>) $1 \
            AND k.expires_at OPERATOR(pg_catalog.<=) pg_catalog.now()",
        &[since],
    )
    .ok()
    .flatten()
    .unwrap_or(0)
}

/// Deletes up to `batch` expired rows whose scope starts with `prefix` ("": every row),
/// skipping rows other transactions hold; returns how many.
pub fn sweep_batch(batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    let deleted = Spi::connect_mut(|client| {
        client
            .update(
                plan(client, Plan::Sweep)?,
                None,
                &[
                    batch.into(),
                    encoding::spi_text(prefix, "idempotency.scope_prefix"),
                ],
            )
            .map(|t| t.len() as i64)
    })
    .unwrap_or_else(|e| {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            format!("idempotency.sweep: {e}"),
            None,
        )
    });
    deleted
}

/// Deletes up to `batch` audit rows older than `retention_secs` whose scope starts with
/// `prefix` ("": every row); returns how many.
pub fn sweep_audit_batch(retention_secs: f64, batch: i64, prefix: &str) -> i64 {
    let _path = PinnedSearchPath::pin();
    Spi::connect_mut(|client| {
        let p = audit_plans(client)?;
        client
            .update(
                &p.sweep,
                None,
                &[
                    retention_secs.into(),
                    batch.into(),
                    encoding::spi_text(prefix, "idempotency.scope_prefix"),
                ],
            )
            .map(|t| t.len() as i64)
    })
    .unwrap_or_else(|e| {
        raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            format!("idempotency.sweep_audit: {e}"),
            None,
        )
    })
}
