//! Facts about the store table read from the catalog, cached per backend: its OIDs and column
//! positions, whether its columns are of the types the below-SQL access reads and writes,
//! whether direct writes are allowed, the access checks and the key storage mode. And the
//! search-path pin the statements run under.

use super::heap;
use crate::error::raise;
use crate::keys;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;
use sha2::Digest;
use std::cell::Cell;

/// Pins the search path to `pg_catalog` while the extension runs its own statements, whatever
/// the caller's `search_path`: what a pinning `SET search_path` clause would give, without its
/// per-call cost where the server allows (see [`crate::compat::SearchPathPin`]). Every
/// statement is schema-qualified as well.
pub use crate::compat::SearchPathPin as PinnedSearchPath;

/// The OID of the relation `name` in the extension's schema, InvalidOid when there is none.
pub(crate) fn relation_oid(name: &std::ffi::CStr) -> pg_sys::Oid {
    // SAFETY: two catalog look-ups by name with NUL-terminated names, in the calling
    // transaction: a missing schema is a clean ERROR (missing_ok = false), a missing relation
    // InvalidOid.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"idempotency".as_ptr(), false);
        pg_sys::get_relname_relid(name.as_ptr(), nsp)
    }
}

/// Per-backend cache of the table's OIDs and column numbers, checked against the catalog's
/// current OIDs on every use (they change when the extension is reinstalled).
#[derive(Clone, Copy)]
pub(crate) struct Layout {
    pub(crate) relid: pg_sys::Oid,
    pub(crate) idxid: pg_sys::Oid,
    /// The attribute numbers of [`LOOKED_UP`].
    pub(crate) att: [i32; LOOKED_UP_COUNT],
    /// The role whose table privileges were checked for this layout (see `check_access`).
    pub(crate) checked_for: pg_sys::Oid,
    /// A column that the look-up reads (`att`, or scope and key, which it compares in the
    /// index) whose type is not the one it interprets the column's datums as: claim and
    /// complete refuse the table (`check_layout`) rather than misread or miswrite it.
    pub(crate) mismatch: Option<Mismatch>,
}

/// A column whose type differs from the extension's table.
#[derive(Clone, Copy)]
pub(crate) struct Mismatch {
    pub(crate) column: &'static str,
    pub(crate) expected: &'static str,
    /// The column's type and typmod (InvalidOid: the column is missing).
    pub(crate) found: pg_sys::Oid,
    pub(crate) typmod: i32,
}

/// The columns of the store table as the extension creates them (sql/idempotency.sql), in
/// the order of [`COLUMNS`]: the one definition of the table that the look-up's attribute
/// numbers ([`Layout::att`]), the columns it reads ([`LOOKED_UP`]) and the direct writes'
/// positions ([`DirectLayout`]) derive from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Column {
    Scope,
    Key,
    RequestHash,
    Status,
    Token,
    Response,
    ResponseStatus,
    RecoveryPoint,
    CreatedAt,
    CompletedAt,
    LockedUntil,
    ExpiresAt,
    Ttl,
}

/// One column of the store table.
pub(crate) struct ColumnDef {
    pub(crate) name: &'static std::ffi::CStr,
    /// The type whose datums the look-up reads and the direct writes build (InvalidOid: the
    /// enum `idempotency.key_status`, whose OID is the installation's).
    pub(crate) typid: pg_sys::Oid,
    /// The type as messages name it.
    pub(crate) type_name: &'static str,
    /// Whether a fresh claim leaves it NULL (so it must be nullable).
    pub(crate) fresh_null: bool,
}

const fn def(
    name: &'static std::ffi::CStr,
    typid: pg_sys::Oid,
    type_name: &'static str,
    fresh_null: bool,
) -> ColumnDef {
    ColumnDef {
        name,
        typid,
        type_name,
        fresh_null,
    }
}

const TIMESTAMPTZ: &str = "timestamp with time zone";

/// Every column of the store table, in the order of [`Column`] (`Column::X as usize` is its
/// index here).
pub(crate) const COLUMNS: [ColumnDef; 13] = [
    def(c"scope", pg_sys::TEXTOID, "text", false),
    def(c"key", pg_sys::TEXTOID, "text", false),
    def(c"request_hash", pg_sys::BYTEAOID, "bytea", false),
    def(
        c"status",
        pg_sys::InvalidOid,
        "idempotency.key_status",
        false,
    ),
    def(c"token", pg_sys::INT8OID, "bigint", false),
    def(c"response", pg_sys::JSONBOID, "jsonb", true),
    def(c"response_status", pg_sys::INT4OID, "integer", true),
    def(c"recovery_point", pg_sys::TEXTOID, "text", true),
    def(c"created_at", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ, false),
    def(c"completed_at", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ, true),
    def(c"locked_until", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ, false),
    def(c"expires_at", pg_sys::TIMESTAMPTZOID, TIMESTAMPTZ, false),
    def(c"ttl", pg_sys::INTERVALOID, "interval", false),
];

impl Column {
    pub(crate) const fn def(self) -> &'static ColumnDef {
        &COLUMNS[self as usize]
    }
}

/// The columns the look-up reads from the row (`heap::look_up` copies their datums and
/// `row_from_version` reads them as the types of [`COLUMNS`]), in the order of
/// [`Layout::att`]. The key columns it compares in the index are checked apart.
/// How many columns the look-up reads.
pub(crate) const LOOKED_UP_COUNT: usize = 7;

pub(crate) const LOOKED_UP: [Column; LOOKED_UP_COUNT] = [
    Column::RequestHash,
    Column::Token,
    Column::Response,
    Column::ResponseStatus,
    Column::RecoveryPoint,
    Column::ExpiresAt,
    Column::LockedUntil,
];

/// The place of `c` in [`LOOKED_UP`] (a column the look-up does not read: a bug, caught by
/// the tests in debug builds; reads the first column in release builds).
pub(crate) fn looked_up_index(c: Column) -> usize {
    let i = LOOKED_UP.iter().position(|&l| l == c);
    debug_assert!(i.is_some(), "{c:?} is not read by the look-up");
    i.unwrap_or(0)
}

/// Whether attribute `a` is a live column of type `typid` with no typmod, stored as that
/// type is (length, by value, alignment): what a datum of `typid` built or read in Rust needs.
/// A typmod (`timestamptz(0)`, `varchar(n)`) would also need the value coerced, which only SQL
/// does.
pub(crate) fn column_is(a: &pg_sys::FormData_pg_attribute, typid: pg_sys::Oid) -> bool {
    let (mut len, mut byval, mut align) = (0i16, false, 0 as std::ffi::c_char);
    a.atttypid == typid && !a.attisdropped && a.atttypmod == -1 && {
        // SAFETY: a syscache look-up of a built-in or existing type into three locals; raises
        // an ERROR only for a type that does not exist, which the comparison with the live
        // column's type rules out before it runs.
        unsafe { pg_sys::get_typlenbyvalalign(typid, &mut len, &mut byval, &mut align) };
        a.attlen == len && a.attbyval == byval && a.attalign == align
    }
}

/// The live attribute `name` of the open relation `rel`, if any.
///
/// # Safety
/// `rel` is an open relation.
pub(crate) unsafe fn attribute<'a>(
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
/// reads them as, and the primary key against the scan it makes (`heap::look_up`: texteq on
/// index columns 1 and 2, collation "C").
/// Once per layout, so once per relcache invalidation of the table.
///
/// # Safety
/// `relid` and `idxid` are the table and its primary key.
pub(crate) unsafe fn check_lookup_columns(
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
    att: &mut [i32; LOOKED_UP_COUNT],
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
        for (i, c) in LOOKED_UP.iter().enumerate() {
            let c = c.def();
            let a = attribute(rel, c.name);
            att[i] = a.map_or(0, |a| a.attnum as i32);
            if !a.is_some_and(|a| column_is(a, c.typid)) {
                note(c.name, c.type_name, a);
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
pub(crate) fn check_layout(l: &Layout) {
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

/// Whether claims and completions may write below SQL, as far as this backend has looked.
#[derive(Clone, Copy)]
enum Direct {
    /// Not looked at since the layout was read.
    Unknown,
    /// The table is not as the extension made it: claims and completions write through SQL.
    Sql,
    /// The direct writes may run, with these column positions.
    Allowed(DirectLayout),
}

/// What this backend knows of the store table, read from the catalog on first use and
/// forgotten all together when the table's relation cache entry is invalidated
/// ([`forget`]): DDL, GRANT and REVOKE, a reinstall of the extension, a switch of the key
/// storage all send one.
#[derive(Clone, Copy)]
struct Cache {
    layout: Option<Layout>,
    /// Read once per layout (see [`key_storage`]).
    key_storage: Option<KeyStorage>,
    direct: Direct,
    /// Whether [`forget`] is registered (once per backend; it cannot be unregistered).
    callback_registered: bool,
}

static CACHE: crate::local::BackendLocal<Cell<Cache>> =
    crate::local::BackendLocal::new(Cell::new(Cache {
        layout: None,
        key_storage: None,
        direct: Direct::Unknown,
        callback_registered: false,
    }));

fn cache() -> Cache {
    CACHE.with(Cell::get)
}

fn update_cache(f: impl FnOnce(&mut Cache)) {
    CACHE.with(|c| {
        let mut cache = c.get();
        f(&mut cache);
        c.set(cache);
    });
}

/// Whether the cached layout is still the one of `relid` (an invalidation may have come in
/// while a fact about it was being read): only then is the fact cached.
fn layout_is(relid: pg_sys::Oid) -> bool {
    cache().layout.is_some_and(|c| c.relid == relid)
}

/// Forgets what the cache knows of the table when its relation cache entry (or every entry)
/// is invalidated: the table may have been altered or dropped, e.g. by DROP EXTENSION.
#[pg_guard]
unsafe extern "C-unwind" fn forget(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    update_cache(|c| {
        if c.layout
            .is_some_and(|l| relid == pg_sys::InvalidOid || l.relid == relid || l.idxid == relid)
        {
            c.layout = None;
            c.key_storage = None;
            c.direct = Direct::Unknown;
        }
    });
}

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
        .unwrap_or_else(|e| super::internal(&format!("reading idempotency.config: {e}")));
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

pub(crate) fn layout() -> Layout {
    let known = cache();
    if let Some(l) = known.layout {
        return l;
    }
    if !known.callback_registered {
        // SAFETY: registers a callback that only clears this backend's cache (it calls no
        // server function, so it is safe at any point an invalidation is processed); once per
        // backend, as the callback table is fixed-size and entries cannot be removed.
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0usize)) };
        update_cache(|c| c.callback_registered = true);
    }
    let relid = relation_oid(c"idempotency_keys");
    let idxid = relation_oid(c"idempotency_keys_pkey");
    // SAFETY: `check_lookup_columns` opens the table and the index by OID, which exist: both
    // were just found in the catalog, and raise() returns nowhere when either is missing.
    unsafe {
        if relid == pg_sys::InvalidOid || idxid == pg_sys::InvalidOid {
            raise(
                PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
                "idempotency.idempotency_keys or its primary key is missing".to_string(),
                Some("reinstall the extension: DROP EXTENSION idempotency; CREATE EXTENSION idempotency;"),
            );
        }
        let mut att = [0i32; LOOKED_UP_COUNT];
        let mismatch = check_lookup_columns(relid, idxid, &mut att);
        let l = Layout {
            relid,
            idxid,
            att,
            checked_for: pg_sys::InvalidOid,
            mismatch,
        };
        update_cache(|c| c.layout = Some(l));
        l
    }
}

/// The probe reads the table below SQL, where PostgreSQL checks no privileges: so claim checks
/// that the current role may SELECT, INSERT and UPDATE the table, as its SQL would need.
/// The result is cached with the layout: GRANT and REVOKE invalidate it (relcache), and a
/// different role (SET ROLE, SECURITY DEFINER callers) is checked again.
pub(crate) fn check_access() {
    let l = layout();
    check_layout(&l);
    let role = heap::current_role();
    if l.checked_for == role {
        return;
    }
    // pg_class_aclcheck accepts any one of the bits it is given: check them one by one.
    for mode in [pg_sys::ACL_SELECT, pg_sys::ACL_INSERT, pg_sys::ACL_UPDATE] {
        // SAFETY: a privilege check of an existing relation (the layout's) for an existing role
        // (the current one); `aclcheck_error` raises the ERROR a statement would, with a
        // NUL-terminated name.
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
    let mut checked = l;
    checked.checked_for = role;
    update_cache(|c| c.layout = Some(checked));
}

/// What direct writes (a fresh claim's insert, a completion's update) need: the table's column
/// positions (0-based), the token sequence and the values of the status labels. Cached with
/// the layout.
#[derive(Clone, Copy)]
pub(crate) struct DirectLayout {
    pub(crate) relid: pg_sys::Oid,
    pub(crate) idxid: pg_sys::Oid,
    pub(crate) natts: usize,
    /// The 0-based position of each column of [`COLUMNS`] in the table's rows (`d[column]`).
    position: [usize; COLUMNS.len()],
    pub(crate) token_seq: pg_sys::Oid,
    /// The values of the status labels.
    pub(crate) in_progress: pg_sys::Datum,
    pub(crate) completed: pg_sys::Datum,
}

impl std::ops::Index<Column> for DirectLayout {
    type Output = usize;
    fn index(&self, c: Column) -> &usize {
        &self.position[c as usize]
    }
}

/// The table's constraints as the extension creates them (sql/idempotency.sql), one line each:
/// type, name and `pg_get_constraintdef` (under the pinned search path), ordered by name. The
/// direct writes build rows that satisfy exactly these; any other set (one dropped, replaced
/// or added, NOT VALID, a foreign key, an exclusion or a unique constraint) goes through SQL,
/// where the executor checks it. NOT NULL constraints (catalogued here from PostgreSQL 18 on,
/// contype 'n') are left out: the layout compares each column's `attnotnull` instead, on every
/// version.
pub(crate) const OWN_CONSTRAINTS: &str = "c idempotency_keys_lease_check CHECK (((status = 'in_progress'::idempotency.key_status) = (locked_until IS NOT NULL)))\n\
p idempotency_keys_pkey PRIMARY KEY (scope, key)\n\
c idempotency_keys_request_hash_check CHECK (((request_hash IS NULL) OR (length(request_hash) = 32)))\n\
c idempotency_keys_response_status_check CHECK (((response_status IS NULL) OR ((response_status >= 100) AND (response_status <= 599))))";

pub(crate) const CONSTRAINTS_SQL: &str = "SELECT pg_catalog.string_agg(c.contype::pg_catalog.text \
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
pub(crate) fn direct_layout() -> Option<DirectLayout> {
    let l = layout();
    match cache().direct {
        Direct::Sql => return None,
        Direct::Allowed(d) if d.relid == l.relid => return Some(d),
        Direct::Allowed(_) | Direct::Unknown => {}
    }
    // SAFETY: the OIDs are the layout's, just read from the catalog.
    let d = unsafe { build_direct_layout(l.relid, l.idxid) };
    if layout_is(l.relid) {
        update_cache(|c| c.direct = d.map_or(Direct::Sql, Direct::Allowed));
    }
    d
}

/// [`direct_layout`] with the table locked for writing first: taking the lock applies the
/// invalidations of DDL that committed since the layout was read, so the layout describes the
/// table as the write will find it (as the executor's lock at the start of a statement does).
/// None under `idempotency.force_sql_path`, which sends the writes through SQL as a trigger on
/// the table would.
pub(crate) fn direct_layout_for_write() -> Option<DirectLayout> {
    let l = layout();
    // SAFETY: locks an existing relation by OID; held to the end of the transaction, as a
    // write's lock is.
    unsafe { pg_sys::LockRelationOid(l.relid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
    if crate::guc::FORCE_SQL_PATH.get() {
        return None;
    }
    direct_layout()
}

/// # Safety
/// `relid` and `idxid` are the store table and its primary key.
pub(crate) unsafe fn build_direct_layout(
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
) -> Option<DirectLayout> {
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
                COLUMNS.iter().any(|c| {
                    let (typid, nullable) = (c.typid, c.fresh_null);
                    c.name == name
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
        let all = COLUMNS.iter().all(|c| attribute(rel, c.name).is_some());
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
        let token_seq = relation_oid(c"token_seq");
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
        let mut positions = [0usize; COLUMNS.len()];
        for (p, c) in positions.iter_mut().zip(COLUMNS.iter()) {
            *p = position(c.name)?;
        }
        Some(DirectLayout {
            relid,
            idxid,
            natts,
            position: positions,
            token_seq,
            in_progress: pg_sys::Datum::from(in_progress),
            completed: pg_sys::Datum::from(completed),
        })
    }
}
