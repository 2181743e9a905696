//! Key derivation: `derive_key` (a key per downstream side effect), `cron_key` (a key per
//! scheduled slot) and request fingerprints. Pure Rust, no pgrx.

use crate::arguments::{check_key, interval_micros, ArgError, MAX_KEY_CHARS};
use crate::canonical::{self, NumberMode, Value};
use sha2::{Digest, Sha256};

/// Characters of the params hash that `derive_key` appends.
pub const DERIVED_HASH_HEX: usize = 16;

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the exact canonical form.
pub fn hash_value(value: &Value) -> Result<[u8; 32], canonical::CanonError> {
    let mut text = String::new();
    canonical::write_canonical(value, NumberMode::Exact, &mut text)?;
    Ok(Sha256::digest(text.as_bytes()).into())
}

/// Whether a step has the form of the params hash that `derive_key` appends.
fn looks_like_params_hash(step: &str) -> bool {
    step.len() == DERIVED_HASH_HEX && step.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `parent:step`, or `parent:step:<16 hex of the params hash>`.
///
/// Injective (up to a collision of the 64-bit params hash): the part after the last `:` is the
/// params hash exactly when it is 16 lowercase hex digits, which a step may not be, and the
/// step before it holds no `:`, so (parent, step, params) can be read back from the key. These
/// are the keys release 0.2.0 derived, unchanged; 0.2.0 also accepted a 16-hex-digit step,
/// whose key could equal another derivation's (`derive_key('a:b', '7e84cbf0f7a7c92c')` =
/// `derive_key('a', 'b', params)`), and that step is now refused.
pub fn derive_key(
    parent: Option<&str>,
    step: Option<&str>,
    params: Option<&Value>,
) -> Result<String, ArgError> {
    let parent = check_key("parent", parent, false)?;
    let step = step.ok_or_else(|| ArgError::null("step"))?;
    if step.is_empty() {
        return Err(ArgError::invalid("step must not be empty".to_string()));
    }
    if step.contains(':') {
        return Err(ArgError::invalid(
            "step must not contain ':' (it separates the parts of a derived key)".to_string(),
        ));
    }
    if looks_like_params_hash(step) {
        return Err(ArgError::invalid(format!(
            "step must not be {DERIVED_HASH_HEX} lowercase hex digits (got {step:?}): that form \
             marks the params hash, so the key could equal another derivation's"
        )));
    }
    let mut key = format!("{parent}:{step}");
    if let Some(params) = params {
        let digest = hash_value(params).map_err(|e| ArgError::invalid(format!("params: {e}")))?;
        key.push(':');
        key.push_str(&hex(&digest)[..DERIVED_HASH_HEX]);
    }
    if key.chars().count() > MAX_KEY_CHARS {
        return Err(ArgError::invalid(format!(
            "derived key would be longer than {MAX_KEY_CHARS} characters: shorten parent or step"
        )));
    }
    Ok(key)
}

/// Microseconds between 1970-01-01 and PostgreSQL's epoch 2000-01-01.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// Civil date of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn format_utc(unix_micros: i64) -> String {
    let days = unix_micros.div_euclid(86_400_000_000);
    let in_day = unix_micros.rem_euclid(86_400_000_000);
    let (y, m, d) = civil_from_days(days);
    let secs = in_day / 1_000_000;
    let frac = in_day % 1_000_000;
    let mut s = format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    );
    if frac != 0 {
        s.push_str(format!(".{frac:06}").trim_end_matches('0'));
    }
    s.push('Z');
    s
}

fn iso_duration(months: i32, micros: i128) -> String {
    if months != 0 {
        return format!("P{months}M");
    }
    let day = 86_400_000_000i128;
    if micros % day == 0 {
        return format!("P{}D", micros / day);
    }
    let secs = micros / 1_000_000;
    let frac = micros % 1_000_000;
    if frac == 0 {
        format!("PT{secs}S")
    } else {
        format!("PT{secs}.{}S", format!("{frac:06}").trim_end_matches('0'))
    }
}

/// `job:<slot start, UTC>/<slot length>`: the same for every scheduler firing in one slot.
///
/// `scheduled_at` is microseconds since 2000-01-01 UTC (PostgreSQL's timestamptz). A slot is
/// either whole months (floored to calendar months since 1970-01) or a fixed length without
/// months (floored on the Unix epoch).
pub fn cron_key(
    job: Option<&str>,
    scheduled_at: Option<i64>,
    slot: Option<(i32, i32, i64)>,
) -> Result<String, ArgError> {
    let job = check_key("job", job, false)?;
    let at = scheduled_at.ok_or_else(|| ArgError::null("scheduled_at"))?;
    let (months, days, micros) = slot.ok_or_else(|| ArgError::null("slot"))?;
    if at == i64::MAX || at == i64::MIN {
        return Err(ArgError::invalid("scheduled_at must be finite".to_string()));
    }
    let unix = at
        .checked_add(PG_EPOCH_UNIX_MICROS)
        .ok_or_else(|| ArgError::invalid("scheduled_at is out of range".to_string()))?;
    let (start, length) = if months != 0 {
        if days != 0 || micros != 0 || months < 0 {
            return Err(ArgError::invalid(
                "slot must be whole months, or a positive length without months".to_string(),
            ));
        }
        let days_since = unix.div_euclid(86_400_000_000);
        let (y, m, _) = civil_from_days(days_since);
        let index = (y - 1970) * 12 + (m as i64 - 1);
        let floored = index - index.rem_euclid(months as i64);
        let (fy, fm) = (
            1970 + floored.div_euclid(12),
            floored.rem_euclid(12) as u32 + 1,
        );
        // A slot of so many months that its start lies beyond 64-bit microseconds.
        let start = days_from_civil(fy, fm, 1)
            .checked_mul(86_400_000_000)
            .ok_or_else(|| ArgError::invalid("slot is too long".to_string()))?;
        (start, iso_duration(months, 0))
    } else {
        let len = interval_micros(0, days, micros);
        if len <= 0 {
            return Err(ArgError::invalid(
                "slot must be a positive interval".to_string(),
            ));
        }
        let len64 =
            i64::try_from(len).map_err(|_| ArgError::invalid("slot is too long".to_string()))?;
        (unix - unix.rem_euclid(len64), iso_duration(0, len))
    };
    let key = format!("{job}:{}/{length}", format_utc(start));
    if key.chars().count() > MAX_KEY_CHARS {
        return Err(ArgError::invalid(format!(
            "cron key would be longer than {MAX_KEY_CHARS} characters: shorten job"
        )));
    }
    Ok(key)
}

/// The document `request_fingerprint` hashes: `{"body":…,"method":…,"path":…,"query":…}`.
pub fn fingerprint_document(
    method: Option<&str>,
    path: Option<&str>,
    query: Option<Value>,
    body: Option<Value>,
) -> Result<Value, ArgError> {
    let method = method.ok_or_else(|| ArgError::null("method"))?;
    if method.is_empty()
        || !method
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    {
        return Err(ArgError::invalid(
            "method must be a non-empty HTTP token such as POST".to_string(),
        ));
    }
    let path = path.ok_or_else(|| ArgError::null("path"))?;
    Ok(Value::Object(vec![
        (
            "method".to_string(),
            Value::String(method.to_ascii_uppercase()),
        ),
        ("path".to_string(), Value::String(path.to_string())),
        (
            "query".to_string(),
            query.unwrap_or(Value::Object(Vec::new())),
        ),
        ("body".to_string(), body.unwrap_or(Value::Null)),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arguments::ArgErrorKind;
    use crate::json_text::parse_json;
    #[test]
    fn derived_keys_are_stable_and_unambiguous() {
        let p = parse_json(r#"{"b":1.0,"a":[1]}"#).unwrap();
        let q = parse_json(r#"{"a":[1],"b":1}"#).unwrap();
        let k1 = derive_key(Some("order-1"), Some("charge"), Some(&p)).unwrap();
        let k2 = derive_key(Some("order-1"), Some("charge"), Some(&q)).unwrap();
        assert_eq!(k1, k2);
        assert!(k1.starts_with("order-1:charge:"));
        assert_eq!(k1.len(), "order-1:charge:".len() + DERIVED_HASH_HEX);
        assert_eq!(derive_key(Some("a"), Some("b"), None).unwrap(), "a:b");
        assert!(derive_key(Some("a"), Some("b:c"), None).is_err());
        // The review's collision: ('order-1', 'charge', params) against ('order-1:charge', hash).
        let params = parse_json(r#"{"amount":5}"#).unwrap();
        let with_params = derive_key(Some("order-1"), Some("charge"), Some(&params)).unwrap();
        let (parent, hash) = with_params.rsplit_once(':').unwrap();
        assert_eq!(
            derive_key(Some(parent), Some(hash), None).unwrap_err().kind,
            ArgErrorKind::Invalid
        );
        // A step that is merely hex-like (other length, upper case) is still a step.
        assert!(derive_key(Some("a"), Some("7e84cbf0f7a7c92"), None).is_ok());
        assert!(derive_key(Some("a"), Some("7E84CBF0F7A7C92C"), None).is_ok());
        assert!(derive_key(Some(&"x".repeat(250)), Some("charge"), None).is_err());
        assert!(derive_key(None, Some("b"), None).is_err());
    }

    #[test]
    fn cron_keys_floor_to_the_slot() {
        // 2026-11-30 01:59:30 UTC in PostgreSQL microseconds.
        let unix = (days_from_civil(2026, 11, 30) * 86_400 + 3600 + 59 * 60 + 30) * 1_000_000;
        let pg = unix - PG_EPOCH_UNIX_MICROS;
        let hour = cron_key(Some("report"), Some(pg), Some((0, 0, 3_600_000_000))).unwrap();
        assert_eq!(hour, "report:2026-11-30T01:00:00Z/PT3600S");
        let later = cron_key(
            Some("report"),
            Some(pg + 29 * 1_000_000),
            Some((0, 0, 3_600_000_000)),
        )
        .unwrap();
        assert_eq!(hour, later);
        let day = cron_key(Some("report"), Some(pg), Some((0, 1, 0))).unwrap();
        assert_eq!(day, "report:2026-11-30T00:00:00Z/P1D");
        let quarter = cron_key(Some("billing"), Some(pg), Some((3, 0, 0))).unwrap();
        assert_eq!(quarter, "billing:2026-10-01T00:00:00Z/P3M");
        let before_epoch = cron_key(
            Some("j"),
            Some(-PG_EPOCH_UNIX_MICROS - 1),
            Some((0, 0, 1_000_000)),
        )
        .unwrap();
        assert_eq!(before_epoch, "j:1969-12-31T23:59:59Z/PT1S");
        assert!(cron_key(Some("j"), Some(pg), Some((0, 0, 0))).is_err());
        assert!(cron_key(Some("j"), Some(pg), Some((1, 1, 0))).is_err());
        assert!(cron_key(Some("j"), Some(i64::MAX), Some((0, 0, 1))).is_err());
        // A slot of months whose start lies beyond 64-bit microseconds (a million years,
        // floored from 1969) is refused, not wrapped; so is a fixed length beyond them.
        let too_long = |at, slot| {
            cron_key(Some("j"), Some(at), Some(slot))
                .unwrap_err()
                .message
        };
        assert_eq!(
            too_long(-PG_EPOCH_UNIX_MICROS - 1, (12_000_000, 0, 0)),
            "slot is too long"
        );
        assert_eq!(too_long(pg, (0, 123_456_789, 0)), "slot is too long");
        for days in [-1_000_000i64, -1, 0, 1, 59, 60, 365, 10_000, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn fingerprint_ignores_query_order_and_method_case() {
        let a = fingerprint_document(
            Some("post"),
            Some("/orders"),
            Some(parse_json(r#"{"a":"1","b":"2"}"#).unwrap()),
            None,
        )
        .unwrap();
        let b = fingerprint_document(
            Some("POST"),
            Some("/orders"),
            Some(parse_json(r#"{"b":"2","a":"1"}"#).unwrap()),
            None,
        )
        .unwrap();
        assert_eq!(hash_value(&a).unwrap(), hash_value(&b).unwrap());
        let c = fingerprint_document(Some("POST"), Some("/orders/"), None, None).unwrap();
        assert_ne!(hash_value(&a).unwrap(), hash_value(&c).unwrap());
        assert!(fingerprint_document(Some("PO ST"), Some("/"), None, None).is_err());
        assert!(fingerprint_document(Some("POST"), None, None, None).is_err());
    }
}
