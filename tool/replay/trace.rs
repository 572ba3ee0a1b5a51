//! JSONL traces for `kvbm replay --trace`: one request per line, checked field by field so that
//! any defect is an error naming the line and the field.
//!
//! Each line is one JSON object whose keys are unique (a duplicate key is refused, naming it);
//! a UTF-8 byte-order mark at the very start of the file is skipped, anywhere else it is refused
//! by name.
//!
//! Invariants of a parsed trace (every size that comes from the file is bounded before anything
//! is sized by it): at most [`MAX_TRACE_BYTES`] read, at most [`MAX_REQUESTS`] requests, each
//! with `prompt + max_tokens <= MAX_REQUEST_TOKENS` (checked without overflow), an arrival at
//! most [`MAX_ARRIVAL`], a non-empty id
//! and prompt, `max_tokens >= 1`, unique ids; sorted by arrival. Any input gives `Ok` or an
//! [`ErrorKind::InvalidArgument`] naming the line and field, never a panic.
//!
//! `tests/cli.rs` compiles this file too (its fuzz tests), so it uses nothing of the tool but
//! [`super::workload`].

use std::io::Read;
use std::path::Path;

use kvbm_connector::error::{Error, ErrorKind, Result};

use super::workload::{
    json_object, request_tokens, TraceRequest, BOM, MAX_ARRIVAL, MAX_REQUESTS, MAX_REQUEST_TOKENS,
};

/// Largest trace file read: 1 GiB. Parsing holds the text and one line's JSON value at a time,
/// so memory stays within a small multiple of this.
pub const MAX_TRACE_BYTES: u64 = 1 << 30;

/// Parses a JSONL trace: one request per non-empty line. Any defect is an error naming the line
/// and what is wrong; nothing is returned partially.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    let mut ids = std::collections::HashSet::new();
    // A byte-order mark at the start of the file is skipped; anywhere else it is refused.
    let text = text.strip_prefix(BOM).unwrap_or(text);
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let r =
            parse_request(line, out.len() == MAX_REQUESTS).map_err(|what| line_error(n, &what))?;
        if !ids.insert(r.id.clone()) {
            return Err(line_error(n, &format!("duplicate id {:?}", r.id)));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            "trace has no requests",
        ));
    }
    out.sort_by_key(|r| r.arrival);
    Ok(out)
}

/// The error for line `n` (1-based): `trace line {n}: {what}`, with the line as a field.
fn line_error(n: usize, what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("trace line {n}: {what}"),
    )
    .with("line", n)
}

/// One non-empty line's request, or what is wrong with it. Each field's presence and type is
/// checked first, so the error names the field; `full` (the trace already holds
/// [`MAX_REQUESTS`]) refuses the line once its id is known good. Duplicate ids are the caller's.
fn parse_request(line: &str, full: bool) -> std::result::Result<TraceRequest, String> {
    let obj = json_object(line).map_err(|e| e.what)?;
    check_fields(&obj, full)?;
    let r: TraceRequest = match serde_json::from_value(serde_json::Value::Object(obj)) {
        Ok(r) => r,
        Err(e) => return Err(e.to_string()),
    };
    if r.id.is_empty() {
        return Err("empty id".into());
    }
    if r.prompt.is_empty() {
        return Err("empty prompt".into());
    }
    if r.max_tokens == 0 {
        return Err("max_tokens must be at least 1".into());
    }
    if let Err(e) = request_tokens(r.prompt.len(), r.max_tokens) {
        return Err(format!("fields \"prompt\" and \"max_tokens\": {e}"));
    }
    Ok(r)
}

/// The fields' names, presence, types and bounds, in this order: unknown fields, `id`, the
/// request count (`full`), `arrival` and `max_tokens`, then `prompt`'s token ids.
fn check_fields(
    obj: &serde_json::Map<String, serde_json::Value>,
    full: bool,
) -> std::result::Result<(), String> {
    for key in obj.keys() {
        if !matches!(key.as_str(), "id" | "arrival" | "prompt" | "max_tokens") {
            return Err(format!(
                "unknown field {key:?} (expected id, arrival, prompt, max_tokens)"
            ));
        }
    }
    match obj.get("id") {
        Some(serde_json::Value::String(_)) => {}
        Some(other) => return Err(format!("field \"id\" must be a string, got {other}")),
        None => return Err("missing field \"id\"".into()),
    }
    if full {
        return Err(format!(
            "more than {MAX_REQUESTS} requests (the most one replay takes)"
        ));
    }
    for key in ["arrival", "max_tokens"] {
        match obj.get(key) {
            Some(v)
                if key == "max_tokens"
                    && v.as_u64().is_some_and(|m| m > MAX_REQUEST_TOKENS as u64) =>
            {
                return Err(format!(
                    "field \"max_tokens\" is {v}; at most {MAX_REQUEST_TOKENS} tokens per request"
                ))
            }
            Some(v) if key == "arrival" && v.as_u64().is_some_and(|a| a > MAX_ARRIVAL) => {
                return Err(format!(
                    "field \"arrival\" is {v}; at most {MAX_ARRIVAL} (engine steps)"
                ))
            }
            Some(v) if v.as_u64().is_some() => {}
            Some(v) => {
                return Err(format!(
                    "field {key:?} must be a non-negative integer, got {v}"
                ))
            }
            None => return Err(format!("missing field {key:?}")),
        }
    }
    match obj.get("prompt") {
        Some(serde_json::Value::Array(items)) => {
            if let Some((k, v)) = items
                .iter()
                .enumerate()
                .find(|(_, v)| v.as_u64().is_none_or(|t| t > u64::from(u32::MAX)))
            {
                return Err(format!(
                    "field \"prompt\"[{k}] must be a token id (0..=4294967295), got {v}"
                ));
            }
        }
        Some(other) => {
            return Err(format!(
                "field \"prompt\" must be an array of token ids, got {other}"
            ))
        }
        None => return Err("missing field \"prompt\"".into()),
    }
    Ok(())
}

/// Reads and parses a trace file (at most [`MAX_TRACE_BYTES`]).
pub fn read_trace(path: &Path) -> Result<Vec<TraceRequest>> {
    let cannot = |e: &dyn std::fmt::Display| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("cannot read trace {}: {e}", path.display()),
        )
    };
    let file = std::fs::File::open(path).map_err(|e| cannot(&e))?;
    let too_large = || {
        cannot(&format!(
            "larger than {MAX_TRACE_BYTES} bytes (the most a trace may hold)"
        ))
    };
    if file.metadata().map_err(|e| cannot(&e))?.len() > MAX_TRACE_BYTES {
        return Err(too_large());
    }
    let mut text = String::new();
    file.take(MAX_TRACE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| cannot(&e))?;
    if text.len() as u64 > MAX_TRACE_BYTES {
        return Err(too_large());
    }
    parse_trace(&text).map_err(|e| e.with("path", path.display()))
}
