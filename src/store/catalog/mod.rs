//! Facts about the store table read from the catalog, cached per backend: its OIDs and column
//! positions ([`columns`]: the one definition of its columns), whether its columns are of the
//! types the below-SQL access reads and writes, the access checks, the key storage mode
//! ([`key_storage`]) and whether direct writes are allowed ([`direct`]); the session's row of
//! `idempotency.role_settings` ([`role_settings`]: the `SET ROLE` role's, else the login
//! role's). And the search-path pin the statements run under.
//!
//! The bottom layer of the store: it calls neither `sql` nor `heap`.

use crate::error::raise;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;
use std::cell::Cell;

mod citus;
mod columns;
mod direct;
mod key_storage;
mod role_settings;

pub(crate) use columns::{looked_up_index, Column, COLUMNS, LOOKED_UP, LOOKED_UP_COUNT};
pub(crate) use direct::{direct_layout, direct_layout_for_write, DirectLayout};
pub use key_storage::{key_label, stored_form};
pub(crate) use key_storage::{keys_hashed, KeyStorage};
pub use role_settings::role_settings;

/// Pins the search path to `pg_catalog` while the extension runs its own statements, whatever
/// the caller's `search_path`: what a pinning `SET search_path` clause would give, without its
/// per-call cost where the server allows (see [`crate::compat::SearchPathPin`]). Every
/// statement is schema-qualified as well.
pub use crate::compat::SearchPathPin as PinnedSearchPath;

use crate::compat::raw::GetUserId;

/// The current role (under SECURITY DEFINER, the function's owner).
fn current_role() -> pg_sys::Oid {
    // SAFETY: reads a backend variable; never raises an error.
    unsafe { GetUserId() }
}

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
    /// The table is partitioned (`PARTITION BY HASH (scope)`, see `idempotency.partitions`):
    /// its own relation and primary-key index hold no rows, its partitions do.
    pub(crate) partitioned: bool,
    /// A table that inherits from the (plain) store table, InvalidOid when none does: its rows
    /// are not in the store's primary key, so the look-up cannot see them, the primary key does
    /// not keep their keys unique with the store's, and the sweep's statement (which matches
    /// rows by ctid) could take one of its rows for one of the store's. Claims, completions and
    /// sweeps are refused ([`check_layout`]), naming the table. Checked again on every refused
    /// call, so dropping the table (which sends the store no invalidation) is seen at once.
    pub(crate) child: pg_sys::Oid,
    /// The type of the column `tenant` (bigint or uuid) of a store distributed by its tenant
    /// (`distribute(tenant_type => ...)`, docs/scaling.md), InvalidOid when the store has none:
    /// every statement then names the key's tenant too (Citus routes by it), see
    /// [`tenant_type`].
    pub(crate) tenant: pg_sys::Oid,
}

/// A column or index of the store that differs from the extension's table.
#[derive(Clone, Copy)]
pub(crate) struct Mismatch {
    pub(crate) column: &'static str,
    pub(crate) expected: &'static str,
    pub(crate) found: Found,
}

/// What was found in place of the extension's column or index.
#[derive(Clone, Copy)]
pub(crate) enum Found {
    /// A column of this type and typmod.
    Type(pg_sys::Oid, i32),
    /// No such column, or one that is not as created.
    Missing,
    /// The primary key differs: how.
    Index(&'static str),
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
/// reads them as, and the primary key against the scan it makes (`heap::scan::look_up`: texteq on
/// index columns 1 and 2, collation "C").
/// Once per layout, so once per relcache invalidation of the table.
///
/// # Safety
/// `relid` and `idxid` are the table and its primary key.
unsafe fn check_lookup_columns(
    relid: pg_sys::Oid,
    idxid: pg_sys::Oid,
    att: &mut [i32; LOOKED_UP_COUNT],
    tenant: &mut pg_sys::Oid,
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
                    found: a.map_or(Found::Missing, |a| Found::Type(a.atttypid, a.atttypmod)),
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
        // A store distributed by its tenant: the tenant column, a third column of the
        // primary key (Citus needs the distribution column in every unique index).
        let tenant_column = attribute(rel, c"tenant")
            .filter(|a| column_is(a, pg_sys::INT8OID) || column_is(a, pg_sys::UUIDOID));
        *tenant = tenant_column.map_or(pg_sys::InvalidOid, |a| a.atttypid);
        let tenant_attnum = tenant_column.map(|a| a.attnum);
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        let index = pg_sys::index_open(idxid, lock);
        let differs = index_differs(index, relid, key_columns, tenant_attnum);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        if let Some(how) = differs {
            if mismatch.is_none() {
                mismatch = Some(Mismatch {
                    column: "idempotency_keys_pkey",
                    expected: PRIMARY_KEY,
                    found: Found::Index(how),
                });
            }
        }
        mismatch
    }
}

/// The primary key as the extension makes it, as messages name it.
const PRIMARY_KEY: &str = "a valid, immediate, non-partial unique btree index on (scope, key) \
     with collation \"C\" and operator class text_ops, as its primary key";

/// How the index `index` (the store's `idempotency_keys_pkey`) differs from the primary key
/// the look-up scans and every statement's `ON CONFLICT (scope, key)` takes as its arbiter
/// (None: it does not): a unique btree index of the table `relid` on exactly the columns
/// `key_columns` (scope, key), without expressions or a predicate (a partial index keeps
/// keys unique only among the rows it covers, and the look-up through it misses every other
/// row: a second `new` for one key), valid, ready and live (an index left behind by a failed
/// `CREATE INDEX CONCURRENTLY` is not maintained or not checked), immediate (a deferrable
/// key checks uniqueness at commit, and `ON CONFLICT` refuses it), with collation "C" and the
/// default operator class of text (another collation or operator class defines another
/// equality, e.g. a case-insensitive one).
///
/// # Safety
/// `index` is an open index relation.
///
/// On a store distributed by its tenant (`tenant_attnum`, see `Layout::tenant`) the index is on
/// (scope, key, tenant): the tenant is a function of the scope (a CHECK constraint), so what is
/// unique is the same; its third column is not checked further.
unsafe fn index_differs(
    index: pg_sys::Relation,
    relid: pg_sys::Oid,
    key_columns: [i16; 2],
    tenant_attnum: Option<i16>,
) -> Option<&'static str> {
    // SAFETY: the caller's contract: every pointer read is the relcache entry's; the
    // per-column arrays have `indnkeyatts` (checked to be 2) entries; indclass is read from
    // the entry's own pg_index tuple, as the relcache reads it.
    unsafe {
        let form = (*index).rd_index;
        if form.is_null() || (*form).indrelid != relid {
            return Some("not an index of idempotency.idempotency_keys");
        }
        let f = &*form;
        if (*(*index).rd_rel).relam != pg_sys::BTREE_AM_OID || !f.indisunique {
            return Some("not a unique btree index");
        }
        let columns = match tenant_attnum {
            Some(t) => {
                let n = f.indnkeyatts as usize;
                if n != 3 || f.indnatts != 3 || f.indkey.values.as_slice(3)[2] != t {
                    return Some("not on (scope, key, tenant)");
                }
                3
            }
            None => 2,
        };
        if f.indnatts as usize != columns
            || f.indnkeyatts as usize != columns
            || f.indkey.values.as_slice(2) != key_columns
        {
            return Some("not on (scope, key)");
        }
        let tuple = (*index).rd_indextuple;
        let column_isnull = |attnum: u32| {
            pg_sys::heap_attisnull(tuple, attnum as std::ffi::c_int, std::ptr::null_mut())
        };
        if !column_isnull(pg_sys::Anum_pg_index_indexprs) {
            return Some("an index on expressions");
        }
        if !column_isnull(pg_sys::Anum_pg_index_indpred) {
            return Some("a partial index (it has a WHERE clause)");
        }
        if !f.indisvalid || !f.indisready || !f.indislive {
            return Some("an index that is not valid (a failed or unfinished build)");
        }
        if !f.indimmediate {
            return Some("deferrable (uniqueness checked at commit)");
        }
        let collations = std::slice::from_raw_parts((*index).rd_indcollation, 2);
        if collations.iter().any(|&c| c != pg_sys::C_COLLATION_OID) {
            return Some("an index of another collation than \"C\"");
        }
        let mut isnull = true;
        let classes = pg_sys::SysCacheGetAttr(
            pg_sys::SysCacheIdentifier::INDEXRELID as std::ffi::c_int,
            tuple,
            pg_sys::Anum_pg_index_indclass as pg_sys::AttrNumber,
            &mut isnull,
        );
        let classes = classes.cast_mut_ptr::<pg_sys::oidvector>();
        if isnull
            || classes.is_null()
            || (*classes).dim1 as usize != columns
            || (*classes)
                .values
                .as_slice(2)
                .iter()
                .any(|&c| c != pg_sys::TEXT_BTREE_OPS_OID)
        {
            return Some("an index of another operator class than text_ops");
        }
        None
    }
}

/// The first table (by OID) that inherits from the table `relid`, InvalidOid when none does.
/// A table none ever inherited from (`relhassubclass` false) is answered without a query.
fn inheritance_child(relid: pg_sys::Oid) -> pg_sys::Oid {
    // SAFETY: opens and closes an existing relation by OID (AccessShareLock, kept to the end
    // of the transaction); reads a flag of its relcache entry.
    let maybe = unsafe {
        let rel = pg_sys::table_open(relid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let maybe = (*(*rel).rd_rel).relhassubclass;
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        maybe
    };
    if !maybe {
        return pg_sys::InvalidOid;
    }
    let _path = PinnedSearchPath::pin();
    Spi::get_one_with_args::<pg_sys::Oid>(
        "SELECT i.inhrelid FROM pg_catalog.pg_inherits AS i \
          WHERE i.inhparent OPERATOR(pg_catalog.=) $1 ORDER BY i.inhrelid LIMIT 1",
        &[relid.into()],
    )
    .ok()
    .flatten()
    .unwrap_or(pg_sys::InvalidOid)
}

/// A relation's name, schema-qualified and quoted as needed.
fn qualified_name(relid: pg_sys::Oid) -> String {
    // SAFETY: catalog look-ups of a relation by OID; a relation dropped meanwhile gives NULL
    // names, which are not read.
    unsafe {
        let name = pg_sys::get_rel_name(relid);
        let nsp = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(relid));
        if name.is_null() || nsp.is_null() {
            return format!("relation {}", relid.to_u32());
        }
        let q = pg_sys::quote_qualified_identifier(nsp, name);
        std::ffi::CStr::from_ptr(q).to_string_lossy().into_owned()
    }
}

/// Refuses a store that another table inherits from (see `Layout::child`), after looking
/// again: the table may have been dropped or detached since the layout was read, which sends
/// the store no invalidation.
pub(crate) fn check_no_inheritance_children(l: &Layout) {
    if l.child == pg_sys::InvalidOid {
        return;
    }
    let child = inheritance_child(l.relid);
    if child == pg_sys::InvalidOid {
        if layout_is(l.relid) {
            update_cache(|c| {
                if let Some(cached) = c.layout.as_mut() {
                    cached.child = pg_sys::InvalidOid;
                }
            });
        }
        return;
    }
    raise(
        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!(
            "idempotency: table {} inherits from idempotency.idempotency_keys: the extension \
             cannot keep keys unique across an inheritance tree nor see the rows of the \
             inheriting table through its primary key",
            qualified_name(child)
        ),
        Some(
            "the table was altered by hand: detach the inheriting table \
             (ALTER TABLE ... NO INHERIT idempotency.idempotency_keys) or drop it",
        ),
    );
}

/// Refuses a table whose look-up columns or primary key were altered (see `Layout::mismatch`):
/// claim and complete read and write those columns below SQL and cannot work on other types,
/// and every statement relies on the primary key; and a table other tables inherit from
/// ([`check_no_inheritance_children`]).
pub(crate) fn check_layout(l: &Layout) {
    check_no_inheritance_children(l);
    let Some(m) = l.mismatch else {
        return;
    };
    if let Found::Index(how) = m.found {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "idempotency: index idempotency.{} is {how}, but the extension needs {}",
                m.column, m.expected
            ),
            Some(
                "the index was replaced by hand: drop it and put the primary key back \
                 (ALTER TABLE idempotency.idempotency_keys ADD CONSTRAINT idempotency_keys_pkey \
                 PRIMARY KEY (scope, key)), or reinstall the extension",
            ),
        );
    }
    let found = match m.found {
        Found::Type(typid, typmod) =>
        // SAFETY: formats an existing type's name (palloc'd in the current context).
        unsafe {
            let name = pg_sys::format_type_with_typemod(typid, typmod);
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned()
        },
        _ => "missing or not as created".to_string(),
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
    /// Whether the table is a Citus table (read once per layout, see [`citus_table`]).
    citus: Option<bool>,
    /// Whether [`forget`] is registered (once per backend; it cannot be unregistered).
    callback_registered: bool,
}

static CACHE: crate::local::BackendLocal<Cell<Cache>> =
    crate::local::BackendLocal::new(Cell::new(Cache {
        layout: None,
        key_storage: None,
        direct: Direct::Unknown,
        citus: None,
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
    role_settings::forget(relid);
    update_cache(|c| {
        if c.layout
            .is_some_and(|l| relid == pg_sys::InvalidOid || l.relid == relid || l.idxid == relid)
        {
            c.layout = None;
            c.key_storage = None;
            c.direct = Direct::Unknown;
            c.citus = None;
        }
    });
}

/// Registers [`forget`] (for this cache and the role settings' cache), once per backend.
fn register_callback() {
    if cache().callback_registered {
        return;
    }
    // SAFETY: registers a callback that only clears this backend's caches (it calls no
    // server function, so it is safe at any point an invalidation is processed); once per
    // backend, as the callback table is fixed-size and entries cannot be removed.
    unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0usize)) };
    update_cache(|c| c.callback_registered = true);
}

/// Whether the store is a Citus table: then only SQL touches it (no probe, no direct writes,
/// each node sweeps its own shards). Read once per layout, like the rest of the cache.
pub(crate) fn citus_table() -> bool {
    let l = layout();
    if let Some(known) = cache().citus {
        return known;
    }
    let citus = citus::is_citus_table(l.relid);
    if layout_is(l.relid) {
        update_cache(|c| c.citus = Some(citus));
    }
    citus
}

/// The type of the store's tenant column (bigint or uuid) where it is distributed by its tenant,
/// else InvalidOid (see `Layout::tenant`).
pub(crate) fn tenant_type() -> pg_sys::Oid {
    layout().tenant
}

/// On Citus, refuses a claim or an audited completion on a node whose token and audit id
/// sequences have no range of their own yet (see [`citus::check_node_sequences`]); elsewhere
/// nothing.
pub(crate) fn check_citus_node() {
    if citus_table() {
        citus::check_node_sequences();
    }
}

/// Whether only SQL may touch the store's rows: where the table's own relation holds none (a
/// Citus table's shell, a partitioned table's parent) the probe and the direct writes, which use
/// the relation and its primary key by OID, would see and write nothing of the store. Claims
/// then go through SQL, and sweeps run on each part (shard or partition) in turn.
pub(crate) fn sql_only() -> bool {
    layout().partitioned || citus_table()
}

pub(crate) fn layout() -> Layout {
    let known = cache();
    if let Some(l) = known.layout {
        return l;
    }
    if !known.callback_registered {
        register_callback();
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
        let mut tenant = pg_sys::InvalidOid;
        let mismatch = check_lookup_columns(relid, idxid, &mut att, &mut tenant);
        let partitioned =
            pg_sys::get_rel_relkind(relid) == pg_sys::RELKIND_PARTITIONED_TABLE as std::ffi::c_char;
        // A partitioned store's partitions are its own (`idempotency.partitions`).
        let child = if partitioned {
            pg_sys::InvalidOid
        } else {
            inheritance_child(relid)
        };
        let l = Layout {
            relid,
            idxid,
            att,
            checked_for: pg_sys::InvalidOid,
            mismatch,
            partitioned,
            child,
            tenant,
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
    let role = current_role();
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
