//! The store table's columns: one definition that the look-up's columns and the direct
//! writes' positions derive from.

use pgrx::pg_sys;

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

/// The columns the look-up reads from the row (`heap::scan::look_up` copies their datums and
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
