//! Whether claims and completions may write below SQL: the direct-write layout of a table
//! exactly as the extension made it.

use super::{attribute, cache, column_is, layout, layout_is, relation_oid, update_cache};
use super::{Column, Direct, PinnedSearchPath, COLUMNS};
use pgrx::pg_sys;
use pgrx::prelude::*;

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
const OWN_CONSTRAINTS: &str = "c idempotency_keys_lease_check CHECK (((status = 'in_progress'::idempotency.key_status) = (locked_until IS NOT NULL)))\n\
p idempotency_keys_pkey PRIMARY KEY (scope, key)\n\
c idempotency_keys_request_hash_check CHECK (((request_hash IS NULL) OR (length(request_hash) = 32)))\n\
c idempotency_keys_response_status_check CHECK (((response_status IS NULL) OR ((response_status >= 100) AND (response_status <= 599))))";

pub(crate) const CONSTRAINTS_SQL: &str = "SELECT pg_catalog.string_agg(c.contype::pg_catalog.text \
       OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) c.conname::pg_catalog.text \
       OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) pg_catalog.pg_get_constraintdef(c.oid), \
       E'\\n' ORDER BY c.conname) \
     FROM pg_catalog.pg_constraint AS c WHERE c.conrelid OPERATOR(pg_catalog.=) $1 \
      AND c.contype OPERATOR(pg_catalog.<>) 'n'";

/// The table's column defaults as the extension creates them, one line each: column name and
/// `pg_get_expr` of the default (under the pinned search path), ordered by name, with the
/// identity and generated flags where set. The direct insert writes every column the INSERT
/// statement names and leaves the others NULL, which is what the statement stores only while
/// those others have no default: any other set (a default added, changed or dropped, an
/// identity or generated column) goes through SQL, where the executor applies it.
const OWN_DEFAULTS: &str = "created_at now()\nscope ''::text";

pub(crate) const DEFAULTS_SQL: &str = "SELECT pg_catalog.string_agg(pg_catalog.concat_ws(' ', \
       a.attname::pg_catalog.text, pg_catalog.pg_get_expr(d.adbin, d.adrelid), \
       NULLIF(a.attidentity::pg_catalog.text, ''), NULLIF(a.attgenerated::pg_catalog.text, '')), \
       E'\\n' ORDER BY a.attname) \
     FROM pg_catalog.pg_attribute AS a \
     LEFT JOIN pg_catalog.pg_attrdef AS d \
       ON d.adrelid OPERATOR(pg_catalog.=) a.attrelid AND d.adnum OPERATOR(pg_catalog.=) a.attnum \
     WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attnum OPERATOR(pg_catalog.>) 0 \
      AND NOT a.attisdropped \
      AND (a.atthasdef OR d.oid IS NOT NULL \
           OR a.attidentity OPERATOR(pg_catalog.<>) '' OR a.attgenerated OPERATOR(pg_catalog.<>) '')";

/// Whether the table `relid` inherits from another table (as an inheritance child, or as a
/// partition of a partitioned table).
const HAS_PARENT_SQL: &str = "SELECT EXISTS (SELECT FROM pg_catalog.pg_inherits AS i \
      WHERE i.inhrelid OPERATOR(pg_catalog.=) $1)";

/// The direct-write layout, or None when the table differs from the extension's own; then the
/// INSERT and UPDATE statements run, with everything PostgreSQL would do for them. Checked
/// once per relcache invalidation of the table (ALTER TABLE, constraints, defaults, rules,
/// triggers, publications, ATTACH and DETACH PARTITION, INHERIT all send one), never per call:
/// - a plain table (not partitioned), no triggers, no rules (a rewrite rule replaces or adds
///   to the statement), no row-level security;
/// - not a partition of another table nor an inheritance child (`relispartition`,
///   `pg_inherits`): an INSERT or UPDATE of a partition checks its partition bound, which the
///   direct writes would not;
/// - exactly the extension's columns, each of the type (typmod, length, by-value, alignment)
///   whose datums the writes build, and the ones a fresh claim leaves NULL nullable;
/// - exactly the extension's column defaults, and no identity or generated column
///   ([`OWN_DEFAULTS`]);
/// - exactly the extension's constraints, by name and definition ([`OWN_CONSTRAINTS`]);
/// - not in any publication: the executor checks a published table's replica identity and
///   the publications' row filters and column lists on UPDATE (`CheckCmdReplicaIdentity`),
///   which the direct update would bypass.
pub(crate) fn direct_layout() -> Option<DirectLayout> {
    let l = layout();
    if super::citus_table() {
        return None;
    }
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
            && !(*form).relispartition
            && (*rel).trigdesc.is_null()
            // The rules themselves, not pg_class.relhasrules: that stays true after the last
            // rule is dropped (until a VACUUM), and would keep the direct writes off meanwhile.
            && (*rel).rd_rules.is_null()
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
        let defaults = Spi::get_one_with_args::<String>(DEFAULTS_SQL, &[relid.into()])
            .ok()
            .flatten()?;
        if defaults != OWN_DEFAULTS {
            return None;
        }
        let has_parent = Spi::get_one_with_args::<bool>(HAS_PARENT_SQL, &[relid.into()])
            .ok()
            .flatten()?;
        if has_parent {
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
