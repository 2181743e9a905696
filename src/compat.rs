//! PostgreSQL version differences, in one place: every item here has one body per supported
//! major version (`cfg(feature = "pgNN")`), and nothing outside this module names a version.

use pgrx::pg_sys;
use std::ffi::CStr;

/// The server's record of a setting (a placeholder too, before the library defines it), or
/// null when the session has never heard of it.
///
/// # Safety
/// Call from the backend's main thread; the record lives as long as the backend.
#[cfg(feature = "pg15")]
pub unsafe fn find_setting(name: &CStr) -> *mut pg_sys::config_generic {
    // SAFETY: get_guc_variables and GetNumConfigOptions describe the server's array of
    // settings, valid until a setting is added (not during this loop).
    unsafe {
        let all = pg_sys::get_guc_variables();
        let n = pg_sys::GetNumConfigOptions().max(0) as usize;
        if all.is_null() {
            return std::ptr::null_mut();
        }
        for i in 0..n {
            let record = *all.add(i);
            if !record.is_null()
                && CStr::from_ptr((*record).name)
                    .to_bytes()
                    .eq_ignore_ascii_case(name.to_bytes())
            {
                return record;
            }
        }
        std::ptr::null_mut()
    }
}

/// See the PostgreSQL 15 version: from 16 on the server looks settings up by name itself.
#[cfg(not(feature = "pg15"))]
pub unsafe fn find_setting(name: &CStr) -> *mut pg_sys::config_generic {
    // SAFETY: find_option with skip_errors never raises; it returns null for an unknown name.
    unsafe { pg_sys::find_option(name.as_ptr(), false, true, pg_sys::DEBUG1 as i32) }
}
