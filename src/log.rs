//! Where the library's `tracing` events go (features `cli` and `python` only; the lean core
//! installs nothing and leaves the choice to its host program).
//!
//! Both outputs share one filter, [`LOG_ENV`] (`KVBM_LOG`), in `RUST_LOG` syntax: `warn`,
//! `kvbm_connector=info`, `info,kvbm_connector::tcp=debug`. Unset or empty, it is
//! [`DEFAULT_FILTER`] (`warn`): warnings and errors show, nothing else. A value that does not
//! parse is not fatal: the default is used and a warning naming the variable says so.
//!
//! * The `kvbm` binary writes events on stderr ([`init_stderr`]).
//! * The Python package forwards them to `logging.getLogger("kvbm_connector")` (the layer lives in
//!   the bindings, `src/python/log.rs`), so engine users see them where their own logs go.

use tracing_subscriber::EnvFilter;

/// The filter's environment variable (`RUST_LOG` syntax).
pub const LOG_ENV: &str = "KVBM_LOG";
/// The filter when [`LOG_ENV`] is unset or empty: warnings and errors.
pub const DEFAULT_FILTER: &str = "warn";

/// The filter from [`LOG_ENV`], and a complaint to log once the output is installed when its
/// value did not parse (the default is used then).
pub fn env_filter() -> (EnvFilter, Option<String>) {
    let value = std::env::var(LOG_ENV).unwrap_or_default();
    filter_from(&value)
}

/// [`env_filter`] for a given value.
pub fn filter_from(value: &str) -> (EnvFilter, Option<String>) {
    let value = value.trim();
    if value.is_empty() {
        return (EnvFilter::new(DEFAULT_FILTER), None);
    }
    match EnvFilter::try_new(value) {
        Ok(f) => (f, None),
        Err(e) => (
            EnvFilter::new(DEFAULT_FILTER),
            Some(format!(
                "{LOG_ENV}={value:?} is not a valid filter ({e}); using {DEFAULT_FILTER:?}"
            )),
        ),
    }
}

/// Installs stderr output filtered by [`LOG_ENV`] as the process's global subscriber. Does
/// nothing when the process already has one (returns false then).
pub fn init_stderr() -> bool {
    let (filter, complaint) = env_filter();
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true)
        .try_init()
        .is_ok();
    if let Some(c) = complaint {
        tracing::warn!("{c}");
    }
    installed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_warnings_and_bad_values_fall_back_with_a_complaint() {
        assert_eq!(filter_from("").0.to_string(), "warn");
        assert!(filter_from("").1.is_none());
        let (f, c) = filter_from("kvbm_connector=info");
        assert_eq!(f.to_string(), "kvbm_connector=info");
        assert!(c.is_none());
        let (f, c) = filter_from("kvbm_connector=[[");
        assert_eq!(f.to_string(), "warn");
        assert!(c.is_some_and(|c| c.contains(LOG_ENV)));
    }
}
