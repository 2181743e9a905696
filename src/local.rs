//! Per-backend state in plain statics.
//!
//! A PostgreSQL backend is one process running the extension on one thread (pgrx refuses
//! calls into the server from any other), so a static is already per-backend state. Rust's
//! `thread_local!` costs a `__tls_get_addr` call per access in a dynamically loaded library,
//! several times on every claim; [`BackendLocal`] keeps `thread_local!`'s `with` interface
//! without it.

/// A value for this backend alone. Only the backend's main thread may touch it, as with every
/// other piece of backend state.
pub struct BackendLocal<T>(T);

// SAFETY: only ever accessed from the backend's single thread (see the module comment); the
// extension starts no threads.
unsafe impl<T> Sync for BackendLocal<T> {}

impl<T> BackendLocal<T> {
    pub const fn new(value: T) -> BackendLocal<T> {
        BackendLocal(value)
    }

    /// Runs `f` on the value, like `LocalKey::with`.
    pub fn with<R>(&'static self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.0)
    }
}
