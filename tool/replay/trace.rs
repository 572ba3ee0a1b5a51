//! JSONL traces for `kvbm replay --trace`: one request per line, checked field by field so that
//! any defect is an error naming the line and the field.
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
    request_tokens, TraceRequest, MAX_ARRIVAL, MAX_REQUESTS, MAX_REQUEST_TOKENS,
};

/// Largest trace file read: 1 GiB. Parsing holds the text and one line's JSON value at a time,
/// so memory stays within a small multiple of this.
pub const MAX_TRACE_BYTES: u64 = 1 << 30;

/// Parses a JSONL trace: one request per non-empty line. Any defect is an error naming the line
/// and what is wrong; nothing is returned partially.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: &str| -> Result<Vec<TraceRequest>> {
            Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("trace line {n}: {what}"),
            )
            .with("line", n))
        };
        // Check each field's presence and type first, so the error names the field.
        let value: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => return bad(&format!("not JSON: {e}")),
        };
        let Some(obj) = value.as_object() else {
            return bad("expected a JSON object");
        };
        for key in obj.keys() {
            if !matches!(key.as_str(), "id" | "arrival" | "prompt" | "max_tokens") {
                return bad(&format!(
                    "unknown field {key:?} (expected id, arrival, prompt, max_tokens)"
                ));
            }
        }
        match obj.get("id") {
            Some(serde_json::Value::String(_)) => {}
            Some(other) => return bad(&format!("field \"id\" must be a string, got {other}")),
            None => return bad("missing field \"id\""),
        }
        if out.len() == MAX_REQUESTS {
            return bad(&format!(
                "more than {MAX_REQUESTS} requests (the most one replay takes)"
            ));
        }
        for key in ["arrival", "max_tokens"] {
            match obj.get(key) {
                Some(v) if key == "max_tokens" && v.as_u64().is_some_and(|m| m > MAX_REQUEST_TOKENS as u64) => {
                    return bad(&format!(
                        "field \"max_tokens\" is {v}; at most {MAX_REQUEST_TOKENS} tokens per request"
                    ))
                }
                Some(v) if key == "arrival" && v.as_u64().is_some_and(|a| a > MAX_ARRIVAL) => {
                    return bad(&format!(
                        "field \"arrival\" is {v}; at most {MAX_ARRIVAL} (engine steps)"
                    ))
                }
                Some(v) if v.as_u64().is_some() => {}
                Some(v) => {
                    return bad(&format!(
                        "field {key:?} must be a non-negative integer, got {v}"
                    ))
                }
                None => return bad(&format!("missing field {key:?}")),
            }
        }
        match obj.get("prompt") {
            Some(serde_json::Value::Array(items)) => {
                if let Some((k, v)) = items
                    .iter()
                    .enumerate()
                    .find(|(_, v)| v.as_u64().is_none_or(|t| t > u64::from(u32::MAX)))
                {
                    return bad(&format!(
                        "field \"prompt\"[{k}] must be a token id (0..=4294967295), got {v}"
                    ));
                }
            }
            Some(other) => {
                return bad(&format!(
                    "field \"prompt\" must be an array of token ids, got {other}"
                ))
            }
            None => return bad("missing field \"prompt\""),
        }
        let r: TraceRequest = match serde_json::from_value(value) {
            Ok(r) => r,
            Err(e) => return bad(&e.to_string()),
        };
        let bad = |what: &str| {
            Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("trace line {n}: {what}"),
            )
            .with("line", n))
        };
        if r.id.is_empty() {
            return bad("empty id");
        }
        if r.prompt.is_empty() {
            return bad("empty prompt");
        }
        if r.max_tokens == 0 {
            return bad("max_tokens must be at least 1");
        }
        if let Err(e) = request_tokens(r.prompt.len(), r.max_tokens) {
            return bad(&format!("fields \"prompt\" and \"max_tokens\": {e}"));
        }
        if !ids.insert(r.id.clone()) {
            return bad(&format!("duplicate id {:?}", r.id));
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
