//! JSONL traces for `kvbm replay --trace`: one request per line, checked field by field so that
//! any defect is an error naming the line and the field.

use std::path::Path;

use kvbm_connector::error::{Error, ErrorKind, Result};

use super::workload::TraceRequest;

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
        for key in ["arrival", "max_tokens"] {
            match obj.get(key) {
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

/// Reads and parses a trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceRequest>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("cannot read trace {}: {e}", path.display()),
        )
    })?;
    parse_trace(&text).map_err(|e| e.with("path", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_traces_name_the_line() {
        let cases = [
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}\nnot json", "line 2"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[],\"max_tokens\":1}", "empty prompt"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":0}", "max_tokens"),
            ("{\"id\":\"a\",\"arrival\":-1,\"prompt\":[1],\"max_tokens\":1}", "line 1"),
            ("{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1,\"x\":2}", "unknown field"),
            (
                "{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}\n{\"id\":\"a\",\"arrival\":0,\"prompt\":[1],\"max_tokens\":1}",
                "duplicate id",
            ),
            ("\n\n", "no requests"),
        ];
        for (text, want) in cases {
            let e = parse_trace(text).unwrap_err();
            assert!(e.to_string().contains(want), "{e} should mention {want}");
        }
    }
}
