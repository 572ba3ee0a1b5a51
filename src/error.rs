//! The one error type of the crate.
//!
//! Every fallible call returns [`Error`]: a [`ErrorKind`] to branch on, a one-line message, and
//! key/value context naming the operation, tier, request and block involved. Constructors are named
//! after the situation (`Error::out_of_range(...)`, `Error::corrupt(...)`) so call sites read as
//! sentences and messages stay consistent.
//!
//! Invariant: nothing reachable from a caller's input panics; it returns one of these instead.

use std::fmt;

/// What went wrong, coarse enough to branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, strum::Display, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorKind {
    /// A caller-supplied value is malformed or out of its allowed range.
    InvalidArgument,
    /// A layout (dimensions, shapes, alignment) is inconsistent or unsupported.
    InvalidLayout,
    /// Configuration (file or environment) is invalid.
    InvalidConfig,
    /// A block id is outside the tier or pool.
    OutOfRange,
    /// No free or evictable block is left.
    NoSpace,
    /// Stored data failed its integrity check and was not served.
    Corrupt,
    /// An operating-system I/O call failed.
    Io,
    /// The operation is not supported by this tier or backend.
    Unsupported,
    /// A component is not initialised yet (e.g. the start-up barrier has not completed).
    NotReady,
    /// A deadline passed.
    Timeout,
    /// The operation was cancelled or its peer went away.
    Cancelled,
    /// A state-machine transition that is not allowed.
    InvalidState,
    /// An id (request, block, operation) that is not known.
    NotFound,
    /// An id that already exists.
    AlreadyExists,
    /// Bytes from outside (wire, file) could not be decoded.
    Decode,
    /// A bug in this crate: an internal invariant did not hold.
    Internal,
}

/// The crate's error: kind, one-line message, context, optional source.
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The longest value an error quotes (a context value, a configuration value); a longer one
/// (a 100,000-character host, say) is cut to this many characters and says how long it was.
pub const MAX_QUOTED_CHARS: usize = 200;

/// `value`, or its first [`MAX_QUOTED_CHARS`] characters and its length.
fn shorten(value: String) -> String {
    let n = value.chars().count();
    if n <= MAX_QUOTED_CHARS {
        return value;
    }
    let head: String = value.chars().take(MAX_QUOTED_CHARS).collect();
    format!("{head}… ({n} characters)")
}

impl Error {
    /// A new error of `kind` with a one-line message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            context: Vec::new(),
            source: None,
        }
    }

    /// Adds one `key=value` pair of context (operation, tier, request, block, ...).
    #[must_use]
    pub fn with(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, shorten(value.to_string())));
        self
    }

    /// Attaches the underlying cause.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The kind to branch on.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The one-line message, without context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The key/value context, in the order it was added.
    pub fn context(&self) -> &[(&'static str, String)] {
        &self.context
    }

    /// The value of one context key, if present.
    pub fn context_value(&self, key: &str) -> Option<&str> {
        self.context
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    // --- named constructors -------------------------------------------------------------------

    /// A caller-supplied value is invalid.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    /// A layout is inconsistent.
    pub fn invalid_layout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidLayout, message)
    }

    /// A configuration value is invalid; names the setting and the offending value.
    pub fn invalid_config(setting: &str, value: impl fmt::Display, why: impl fmt::Display) -> Self {
        Self::new(
            ErrorKind::InvalidConfig,
            format!(
                "invalid value {value:?} for {setting}: {why}",
                value = shorten(value.to_string())
            ),
        )
        .with("setting", setting)
    }

    /// `index` is not below `len` for the thing named `what`.
    pub fn out_of_range(what: &'static str, index: impl fmt::Display, len: usize) -> Self {
        Self::new(
            ErrorKind::OutOfRange,
            format!("{what} {index} out of range (0..{len})"),
        )
        .with(what, index)
    }

    /// No space: `required` more were needed, `available` could be had, of `capacity`.
    pub fn no_space(
        what: &'static str,
        capacity: usize,
        available: usize,
        required: usize,
    ) -> Self {
        Self::new(
            ErrorKind::NoSpace,
            format!("no space for {required} {what}: {available} available of {capacity}"),
        )
    }

    /// Stored data failed verification.
    pub fn corrupt(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Corrupt, message)
    }

    /// An I/O call failed.
    pub fn io(operation: &'static str, source: std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("{operation} failed: {source}"))
            .with("op", operation)
            .with_source(source)
    }

    /// Not supported by this backend.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    /// An internal invariant failed (a bug in this crate, reported instead of panicking).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)?;
        if !self.context.is_empty() {
            f.write_str(" (")?;
            for (i, (k, v)) in self.context.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}={v}")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind)
            .field("message", &self.message)
            .field("context", &self.context);
        if let Some(s) = &self.source {
            d.field("source", &s.to_string());
        }
        d.finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|s| s.as_ref() as &(dyn std::error::Error + 'static))
    }
}

impl Clone for Error {
    /// Clones kind, message and context; the source is kept as its rendered text.
    fn clone(&self) -> Self {
        Self {
            kind: self.kind,
            message: match &self.source {
                Some(s) if !self.message.contains(&s.to_string()) => {
                    format!("{}: {s}", self.message)
                }
                _ => self.message.clone(),
            },
            context: self.context.clone(),
            source: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_has_kind_message_and_context() {
        let e = Error::out_of_range("block", 9, 4).with("tier", "G2");
        assert_eq!(e.kind(), ErrorKind::OutOfRange);
        assert_eq!(
            e.to_string(),
            "out_of_range: block 9 out of range (0..4) (block=9, tier=G2)"
        );
        assert_eq!(e.context_value("tier"), Some("G2"));
    }

    #[test]
    fn config_error_names_setting_and_value() {
        let e = Error::invalid_config("KVBM_HOST_CACHE_GB", "abc", "not a number");
        assert!(e.to_string().contains("KVBM_HOST_CACHE_GB"));
        assert!(e.to_string().contains("\"abc\""));
    }

    #[test]
    fn errors_are_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Error>();
    }
}
