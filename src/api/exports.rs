//! The symbols `sql/idempotency.sql` and every released script (`sql/releases/`, the upgrade
//! scripts) declare the typed functions with: each a V1 function handing the call to pgrx's
//! wrapper of the typed function in `functions`. Grouped by the release whose install script
//! first declared them (`sql/releases/`); a symbol is never removed while a release declares it.

use super::functions;
use pgrx::pg_sys;

// Declared since 0.1.0.
export_as!(
    idempotency_check_args,
    pg_finfo_idempotency_check_args,
    functions::idempotency_check_args_wrapper
);
export_as!(
    idempotency_canonical_json,
    pg_finfo_idempotency_canonical_json,
    functions::idempotency_canonical_json_wrapper
);
export_as!(
    idempotency_canonical_hash,
    pg_finfo_idempotency_canonical_hash,
    functions::idempotency_canonical_hash_wrapper
);
export_as!(
    idempotency_derive_key,
    pg_finfo_idempotency_derive_key,
    functions::idempotency_derive_key_wrapper
);
export_as!(
    idempotency_cron_key,
    pg_finfo_idempotency_cron_key,
    functions::idempotency_cron_key_wrapper
);
export_as!(
    idempotency_request_fingerprint,
    pg_finfo_idempotency_request_fingerprint,
    functions::idempotency_request_fingerprint_wrapper
);
export_as!(
    idempotency_sweep,
    pg_finfo_idempotency_sweep,
    functions::idempotency_sweep_wrapper
);
export_as!(
    idempotency_count,
    pg_finfo_idempotency_count,
    functions::idempotency_count_wrapper
);
export_as!(
    idempotency_sweeper_preloaded,
    pg_finfo_idempotency_sweeper_preloaded,
    functions::idempotency_sweeper_preloaded_wrapper
);
export_as!(
    idempotency_announce,
    pg_finfo_idempotency_announce,
    functions::idempotency_announce_wrapper
);
export_as!(
    idempotency_shared_stats,
    pg_finfo_idempotency_shared_stats,
    functions::idempotency_shared_stats_wrapper
);

// Declared since 0.2.0.
export_as!(
    idempotency_key,
    pg_finfo_idempotency_key,
    functions::idempotency_key_wrapper
);
export_as!(
    idempotency_store_changed,
    pg_finfo_idempotency_store_changed,
    functions::idempotency_store_changed_wrapper
);
export_as!(
    idempotency_sign,
    pg_finfo_idempotency_sign,
    functions::idempotency_sign_wrapper
);
export_as!(
    idempotency_signed_kid,
    pg_finfo_idempotency_signed_kid,
    functions::idempotency_signed_kid_wrapper
);
export_as!(
    idempotency_verify,
    pg_finfo_idempotency_verify,
    functions::idempotency_verify_wrapper
);
export_as!(
    idempotency_random_secret,
    pg_finfo_idempotency_random_secret,
    functions::idempotency_random_secret_wrapper
);
export_as!(
    idempotency_sweep_audit,
    pg_finfo_idempotency_sweep_audit,
    functions::idempotency_sweep_audit_wrapper
);

// Declared since 0.3.0.
export_as!(
    idempotency_rekey,
    pg_finfo_idempotency_rekey,
    functions::idempotency_rekey_wrapper
);
export_as!(
    idempotency_check_recovery_point,
    pg_finfo_idempotency_check_recovery_point,
    functions::idempotency_check_recovery_point_wrapper
);
