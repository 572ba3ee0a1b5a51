//! `KvbmError`: the one Python exception, with the Rust error's kind, message and context.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::{Error, ErrorKind};

create_exception!(
    _kvbm,
    KvbmError,
    PyException,
    "An error from the kvbm connector. `str(e)` is the full text; `e.kind` the error kind \
     (`invalid_argument`, `invalid_layout`, `not_ready`, `timeout`, ...: see `ERROR_KINDS`); \
     `e.message` the one-line message without context; `e.context` a dict naming the operation, \
     tier, request or block involved."
);

/// Every kind, by the name `e.kind` carries.
pub(crate) const ALL_KINDS: &[ErrorKind] = &[
    ErrorKind::InvalidArgument,
    ErrorKind::InvalidLayout,
    ErrorKind::InvalidConfig,
    ErrorKind::OutOfRange,
    ErrorKind::NoSpace,
    ErrorKind::Corrupt,
    ErrorKind::Io,
    ErrorKind::Unsupported,
    ErrorKind::NotReady,
    ErrorKind::Timeout,
    ErrorKind::Cancelled,
    ErrorKind::InvalidState,
    ErrorKind::NotFound,
    ErrorKind::AlreadyExists,
    ErrorKind::Decode,
    ErrorKind::Internal,
];

/// The names of [`ALL_KINDS`].
pub(crate) fn kind_names() -> Vec<&'static str> {
    ALL_KINDS.iter().map(|k| k.into()).collect()
}

/// The kind whose name is `name` (the `_raise` test hook).
#[cfg(feature = "python-test-hooks")]
pub(crate) fn kind_from_name(name: &str) -> Option<ErrorKind> {
    ALL_KINDS.iter().copied().find(|k| {
        let n: &'static str = k.into();
        n == name
    })
}

/// A `KvbmError` carrying `e`'s text, kind, message and context.
pub fn to_py_err(py: Python<'_>, e: Error) -> PyErr {
    let err = KvbmError::new_err(e.to_string());
    let value = err.value(py);
    let kind: &'static str = e.kind().into();
    // Setting attributes on a fresh exception instance cannot fail short of memory exhaustion;
    // the error itself is still raised if it does.
    let _ = value.setattr("kind", kind);
    let _ = value.setattr("message", e.message());
    let context = PyDict::new(py);
    for (k, v) in e.context() {
        let _ = context.set_item(*k, v);
    }
    let _ = value.setattr("context", context);
    err
}

/// An invalid-argument `KvbmError` for a Python value that could not be read.
pub(crate) fn bad_value(py: Python<'_>, what: &str, cause: PyErr) -> PyErr {
    to_py_err(
        py,
        Error::invalid_argument(format!("{what}: {cause}")).with("argument", what),
    )
}
