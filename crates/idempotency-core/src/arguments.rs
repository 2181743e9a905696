//! Argument rules: keys, scopes, scope prefixes, durations, statuses. Pure Rust, no pgrx.
//!
//! Every rule here is enforced before anything is written, and every violation names the
//! argument and the rule, so the SQL layer only has to turn an [`ArgError`] into an ERROR.

/// Longest accepted key and scope, in characters.
pub const MAX_KEY_CHARS: usize = 255;
/// Longest accepted TTL: keys are never stored forever.
pub const MAX_TTL_MICROS: i128 = 10 * 366 * 86_400 * 1_000_000;
/// `idempotency.default_ttl` where nothing sets it, in seconds: at least a day of retries.
pub const DEFAULT_TTL_SECS: i32 = 24 * 3600;
/// `idempotency.default_lease` where nothing sets it, in seconds.
pub const DEFAULT_LEASE_SECS: i32 = 5 * 60;
/// `idempotency.busy_retry_after` where nothing sets it, in milliseconds: the `retry_after` of a
/// claim that meets another open transaction's claim of the key.
pub const DEFAULT_BUSY_RETRY_AFTER_MS: i32 = 1000;
/// How many keys one transaction of the portable edition marks (a transaction-scoped advisory
/// lock each, in PostgreSQL's shared, finite lock table); natively the index orders every write.
pub const PORTABLE_MARKS_PER_TRANSACTION: i32 = 1000;

/// Which SQLSTATE an argument error maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgErrorKind {
    /// 22004 null_value_not_allowed
    Null,
    /// 22023 invalid_parameter_value
    Invalid,
    /// 42501 insufficient_privilege
    Forbidden,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgError {
    pub kind: ArgErrorKind,
    pub message: String,
}

impl ArgError {
    pub fn null(arg: &str) -> ArgError {
        ArgError {
            kind: ArgErrorKind::Null,
            message: format!("{arg} must not be NULL"),
        }
    }
    pub fn invalid(message: String) -> ArgError {
        ArgError {
            kind: ArgErrorKind::Invalid,
            message,
        }
    }
}

/// Checks a key or scope argument: not NULL, at most 255 characters, and (for keys) not empty.
pub fn check_key<'a>(
    arg: &str,
    value: Option<&'a str>,
    allow_empty: bool,
) -> Result<&'a str, ArgError> {
    let v = value.ok_or_else(|| ArgError::null(arg))?;
    if !allow_empty && v.is_empty() {
        return Err(ArgError::invalid(format!("{arg} must not be empty")));
    }
    if v.len() > MAX_KEY_CHARS && v.chars().count() > MAX_KEY_CHARS {
        return Err(ArgError::invalid(format!(
            "{arg} must be at most {MAX_KEY_CHARS} characters (got {})",
            v.chars().count()
        )));
    }
    Ok(v)
}

/// A bad value as error messages quote it: at most 40 characters, then "…" (a 10 MB argument
/// must not become a 10 MB message in the client and the server log).
pub fn abbreviate(value: &str) -> String {
    const MAX: usize = 40;
    match value.char_indices().nth(MAX) {
        Some((end, _)) => format!("{:?}…", &value[..end]),
        None => format!("{value:?}"),
    }
}

/// Checks `scope` against the role's bound value on a store distributed by its tenant: there
/// it is a tenant id, matched whole (`"42"` is tenant 42, not 420 as a prefix would be;
/// empty: every scope allowed).
pub fn check_tenant_allowed(scope: &str, tenant: &str) -> Result<(), ArgError> {
    if tenant.is_empty() || scope == tenant {
        return Ok(());
    }
    Err(ArgError {
        kind: ArgErrorKind::Forbidden,
        message: format!(
            "scope {scope:?} is outside this role's scopes: the store is distributed by its tenant, and its scope prefix {tenant:?} binds it to that one tenant"
        ),
    })
}

/// Checks `scope` against the role's scope prefix (`idempotency.role_settings`, else
/// `idempotency.scope_prefix`; empty: every scope allowed).
pub fn check_scope_allowed(scope: &str, prefix: &str) -> Result<(), ArgError> {
    if scope.starts_with(prefix) {
        return Ok(());
    }
    Err(ArgError {
        kind: ArgErrorKind::Forbidden,
        message: format!(
            "scope {scope:?} is outside this role's scopes: its scope prefix is {prefix:?}"
        ),
    })
}

/// An interval as PostgreSQL orders it: a month is 30 days, a day 24 hours.
pub fn interval_micros(months: i32, days: i32, micros: i64) -> i128 {
    (months as i128 * 30 + days as i128) * 86_400_000_000 + micros as i128
}

/// Checks a TTL or lease: strictly positive and at most ten years.
pub fn check_duration(arg: &str, months: i32, days: i32, micros: i64) -> Result<i128, ArgError> {
    let total = interval_micros(months, days, micros);
    if total <= 0 {
        return Err(ArgError::invalid(format!(
            "{arg} must be a positive interval"
        )));
    }
    if total > MAX_TTL_MICROS {
        return Err(ArgError::invalid(format!("{arg} must be at most 10 years")));
    }
    Ok(total)
}

/// Checks an HTTP-like response status.
pub fn check_status(status: Option<i32>) -> Result<i32, ArgError> {
    let s = status.ok_or_else(|| ArgError::null("response_status"))?;
    if !(100..=599).contains(&s) {
        return Err(ArgError::invalid(format!(
            "response_status must be between 100 and 599 (got {s})"
        )));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_abbreviated_in_messages() {
        assert_eq!(abbreviate("exact"), "\"exact\"");
        let long = "é".repeat(1_000_000);
        let short = abbreviate(&long);
        assert_eq!(short, format!("{:?}…", "é".repeat(40)));
    }

    /// The portable edition quotes values as `abbreviate` does, from a list of the code points
    /// Debug escapes (`idempotency._canon_debug_escapes` in sql/portable/messages.sql): the list
    /// must be this Rust's, or the two editions' messages differ (a new Rust may bring new
    /// Unicode tables; then the list is written again from this test's `got`).
    #[test]
    fn the_portable_editions_list_of_debug_escapes_is_this_rusts() {
        let sql = include_str!("../../../sql/portable/messages.sql");
        let start = sql
            .find("CREATE FUNCTION idempotency._canon_debug_escapes()")
            .expect("the function is in sql/portable/messages.sql");
        let body = &sql[start..];
        let body = &body[body.find("'{").expect("a literal") + 2..];
        let body = &body[..body.find("}'").expect("the literal's end")];
        let listed: Vec<(u32, u32)> = body
            .split(['[', ']'])
            .filter_map(|p| {
                let (a, b) = p.trim().split_once(',')?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            })
            .collect();
        let mut got: Vec<(u32, u32)> = Vec::new();
        for c in (1..=0x10FFFFu32).filter_map(char::from_u32) {
            if format!("{:?}", c.to_string()).starts_with("\"\\u{") {
                let cp = c as u32;
                match got.last_mut() {
                    Some(r) if r.1 + 1 == cp => r.1 = cp,
                    _ => got.push((cp, cp)),
                }
            }
        }
        assert!(got.len() > 500);
        assert_eq!(listed, got);
    }

    #[test]
    fn scope_prefix_rule() {
        assert!(check_scope_allowed("anything", "").is_ok());
        assert!(check_scope_allowed("shop_a:42", "shop_a:").is_ok());
        assert!(check_scope_allowed("shop_a:", "shop_a:").is_ok());
        let e = check_scope_allowed("shop_b:42", "shop_a:").unwrap_err();
        assert_eq!(e.kind, ArgErrorKind::Forbidden);
        assert!(
            e.message.starts_with("scope \"shop_b:42\""),
            "{}",
            e.message
        );
        assert!(check_scope_allowed("shop_a", "shop_a:").is_err());
        assert!(check_scope_allowed("", "shop_a:").is_err());
    }

    #[test]
    fn a_tenant_binding_matches_the_whole_id() {
        assert!(check_tenant_allowed("420", "").is_ok());
        assert!(check_tenant_allowed("42", "42").is_ok());
        for other in ["420", "4", "43", "", "42 "] {
            let e = check_tenant_allowed(other, "42").unwrap_err();
            assert_eq!(e.kind, ArgErrorKind::Forbidden);
            assert!(e.message.contains("that one tenant"), "{}", e.message);
        }
    }

    #[test]
    fn key_rules() {
        assert_eq!(check_key("key", Some("a"), false), Ok("a"));
        assert_eq!(
            check_key("key", None, false).unwrap_err().kind,
            ArgErrorKind::Null
        );
        assert!(check_key("key", Some(""), false)
            .unwrap_err()
            .message
            .contains("key must not be empty"));
        assert_eq!(check_key("scope", Some(""), true), Ok(""));
        let max = "é".repeat(255);
        assert!(check_key("key", Some(&max), false).is_ok());
        let long = "x".repeat(256);
        assert!(check_key("key", Some(&long), false)
            .unwrap_err()
            .message
            .contains("at most 255"));
    }

    #[test]
    fn duration_rules() {
        assert!(check_duration("ttl", 0, 0, 1).is_ok());
        assert!(check_duration("ttl", 0, 0, 0)
            .unwrap_err()
            .message
            .contains("ttl must be a positive"));
        assert!(check_duration("lease", 0, 1, -86_400_000_001).is_err());
        assert!(check_duration("ttl", 12 * 11, 0, 0)
            .unwrap_err()
            .message
            .contains("10 years"));
    }

    #[test]
    fn status_rules() {
        assert_eq!(check_status(Some(200)), Ok(200));
        assert!(check_status(Some(99)).is_err());
        assert!(check_status(Some(600)).is_err());
        assert_eq!(check_status(None).unwrap_err().kind, ArgErrorKind::Null);
    }
}
