//! Mooncake traces (`kvbm replay --trace-format mooncake`): the request format Mooncake released
//! with its FAST'25 paper, read lazily, one line at a time.
//!
//! One JSON object per line: `timestamp` (arrival, milliseconds from the start), `input_length`
//! and `output_length` (tokens), `hash_ids` (one id per [`MOONCAKE_BLOCK_TOKENS`]-token block of
//! the prompt, the last one covering a partial block). The trace carries no tokens; a replay
//! derives them: the tokens of a block are a pure function of its hash id
//! ([`block_token`]), not of its position, so two prompts whose hash ids agree up to block `k`
//! have the same first `k` blocks of tokens, and the last block is cut to `input_length`.
//!
//! How the fields become a [`TraceRequest`]: id `line<N>` (the line number), arrival = the
//! timestamp (one engine step per millisecond; `--sequential` ignores it),
//! `max_tokens = min(output_length, cap)` and at least 1 (the replay's `--max-output-tokens`).
//!
//! The engine's block size is free: the tokens are the same whatever `--block-size` is, so the
//! prefix reuse the engine sees is derived, not assumed. Only at `--block-size 512` (the trace's)
//! are its hit rates the trace's block-level figures; a smaller block size may also match part
//! of a block the trace counts as different (the shared partial last block of two prompts).
//!
//! Validation, before anything is sized by the input: a line is read through a bounded reader
//! ([`MAX_LINE_BYTES`]), is one JSON object whose keys are unique (a UTF-8 byte-order mark at
//! the very start of the file is skipped, anywhere else it is refused by name), every field is
//! checked for presence and type, `input_length` is at most
//! [`MAX_REQUEST_TOKENS`], `hash_ids` has exactly `ceil(input_length / 512)` entries, timestamps
//! do not go back. Every defect is an [`ErrorKind::InvalidArgument`] naming the line and the field.
//!
//! `tests/cli.rs` compiles this file too (its parsing tests), so it uses nothing of the tool but
//! [`super::workload`].

use std::io::BufRead;
use std::path::Path;

use kvbm_connector::error::{Error, ErrorKind, Result};

use super::workload::{
    json_object, TraceRequest, BOM, MAX_ARRIVAL, MAX_REQUESTS, MAX_REQUEST_TOKENS, VOCAB,
};

/// Tokens per block of a Mooncake trace (what one hash id covers).
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Longest line read: 1 MiB. The longest valid line (`MAX_REQUEST_TOKENS / 512` = 32,768 ids of
/// at most 20 digits each) is about 720 KB; a longer line is refused before it is parsed.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The `j`-th token of the block whose hash id is `id` (a SplitMix64 finaliser over both, below
/// [`VOCAB`]).
pub fn block_token(id: u64, j: usize) -> u32 {
    let mut z = id
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((j as u64).wrapping_mul(0xd6e8_feb8_6659_fd93))
        ^ 0x6d6f_6f6e_6361_6b65;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % u64::from(VOCAB)) as u32
}

/// The prompt of a request with these hash ids and `input_length` tokens (the caller checked
/// `input_length` against the ids: `ceil(input_length / 512) == ids.len()`).
pub fn prompt_tokens(ids: &[u64], input_length: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(input_length);
    for &id in ids {
        let n = (input_length - out.len()).min(MOONCAKE_BLOCK_TOKENS);
        out.extend((0..n).map(|j| block_token(id, j)));
    }
    out
}

/// One parsed line: the trace's own fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeRequest {
    /// Arrival, ms.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens the trace recorded.
    pub output_length: usize,
    /// Block hash ids.
    pub hash_ids: Vec<u64>,
}

fn line_err(n: usize, what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("mooncake trace line {n}: {what}"),
    )
    .with("line", n)
}

/// Refuses a field other than the four Mooncake's trace has (the first one found, named).
fn check_keys(n: usize, obj: &serde_json::Map<String, serde_json::Value>) -> Result<()> {
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "timestamp" | "input_length" | "output_length" | "hash_ids"
        ) {
            return Err(line_err(
                n,
                format!(
                    "unknown field {key:?} (expected timestamp, input_length, output_length, hash_ids)"
                ),
            )
            .with("field", key));
        }
    }
    Ok(())
}

/// Field `key` of line `n`: present, a non-negative integer, at most `max`.
fn uint_field(
    n: usize,
    obj: &serde_json::Map<String, serde_json::Value>,
    key: &str,
    max: u64,
) -> Result<u64> {
    match obj.get(key) {
        None => Err(line_err(n, format!("missing field {key:?}")).with("field", key)),
        Some(v) => match v.as_u64() {
            Some(x) if x <= max => Ok(x),
            Some(x) => {
                Err(line_err(n, format!("field {key:?} is {x}; at most {max}")).with("field", key))
            }
            None => Err(line_err(
                n,
                format!("field {key:?} must be a non-negative integer, got {v}"),
            )
            .with("field", key)),
        },
    }
}

/// Line `n`'s `hash_ids`: an array of one non-negative integer per started block of
/// `input_length` tokens ([`MOONCAKE_BLOCK_TOKENS`] each, the last one partial).
fn block_ids(
    n: usize,
    obj: &serde_json::Map<String, serde_json::Value>,
    input_length: usize,
) -> Result<Vec<u64>> {
    let ids = match obj.get("hash_ids") {
        None => return Err(line_err(n, "missing field \"hash_ids\"").with("field", "hash_ids")),
        Some(serde_json::Value::Array(a)) => a,
        Some(v) => {
            return Err(line_err(
                n,
                format!("field \"hash_ids\" must be an array of block ids, got {v}"),
            )
            .with("field", "hash_ids"))
        }
    };
    let blocks = input_length.div_ceil(MOONCAKE_BLOCK_TOKENS);
    if ids.len() != blocks {
        return Err(line_err(
            n,
            format!(
                "field \"hash_ids\" has {} ids but input_length {input_length} needs {blocks} \
                 ({MOONCAKE_BLOCK_TOKENS} tokens per id, the last one partial)",
                ids.len()
            ),
        )
        .with("field", "hash_ids"));
    }
    let mut hash_ids = Vec::with_capacity(blocks);
    for (k, v) in ids.iter().enumerate() {
        match v.as_u64() {
            Some(id) => hash_ids.push(id),
            None => {
                return Err(line_err(
                    n,
                    format!("field \"hash_ids\"[{k}] must be a non-negative integer, got {v}"),
                )
                .with("field", "hash_ids"))
            }
        }
    }
    Ok(hash_ids)
}

/// Parses one line (`n`: its number, for errors): a JSON object whose keys are unique (a
/// duplicate key is refused, naming it) and that starts with no byte-order mark (the reader
/// skips one at the start of the trace).
pub fn parse_line(n: usize, line: &str) -> Result<MooncakeRequest> {
    let obj = &json_object(line).map_err(|e| match e.field {
        Some(f) => line_err(n, e.what).with("field", f),
        None => line_err(n, e.what),
    })?;
    check_keys(n, obj)?;
    let timestamp = uint_field(n, obj, "timestamp", MAX_ARRIVAL)?;
    let input_length = uint_field(n, obj, "input_length", MAX_REQUEST_TOKENS as u64)? as usize;
    let output_length = uint_field(n, obj, "output_length", MAX_REQUEST_TOKENS as u64)? as usize;
    if input_length == 0 {
        return Err(line_err(
            n,
            "field \"input_length\" is 0; a prompt has at least 1 token",
        )
        .with("field", "input_length"));
    }
    let hash_ids = block_ids(n, obj, input_length)?;
    Ok(MooncakeRequest {
        timestamp,
        input_length,
        output_length,
        hash_ids,
    })
}

/// A Mooncake trace read lazily: each `next()` reads, checks and converts one line.
pub struct MooncakeReader<R> {
    input: R,
    /// Lines read so far (the number of the last one).
    line: usize,
    requests: usize,
    last_timestamp: u64,
    max_output_tokens: usize,
    buf: Vec<u8>,
    failed: bool,
}

impl<R: BufRead> MooncakeReader<R> {
    /// Reads `input`; `max_output_tokens` caps each request's output (at least 1 token).
    pub fn new(input: R, max_output_tokens: usize) -> Self {
        Self {
            input,
            line: 0,
            requests: 0,
            last_timestamp: 0,
            max_output_tokens: max_output_tokens.max(1),
            buf: Vec::new(),
            failed: false,
        }
    }

    /// The next line, or `None` at the end (after an empty trace: an error).
    fn next_request(&mut self) -> Result<Option<TraceRequest>> {
        loop {
            self.buf.clear();
            let n = std::io::Read::take(&mut self.input, MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| line_err(self.line + 1, format!("cannot read: {e}")))?;
            if n == 0 {
                if self.requests == 0 {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        "mooncake trace has no requests",
                    ));
                }
                return Ok(None);
            }
            self.line += 1;
            let ln = self.line;
            if self.buf.len() > MAX_LINE_BYTES {
                return Err(line_err(
                    ln,
                    format!("longer than {MAX_LINE_BYTES} bytes (the most a line may hold)"),
                ));
            }
            let mut text = std::str::from_utf8(&self.buf)
                .map_err(|e| line_err(ln, format!("not UTF-8: {e}")))?;
            if ln == 1 {
                // A byte-order mark at the start of the file (some Windows editors write one)
                // is skipped; anywhere else it is refused by name (`parse_line`).
                text = text.strip_prefix(BOM).unwrap_or(text);
            }
            if text.trim().is_empty() {
                continue;
            }
            let m = parse_line(ln, text)?;
            if m.timestamp < self.last_timestamp {
                return Err(line_err(
                    ln,
                    format!(
                        "field \"timestamp\" {} is earlier than the previous line's {} \
                         (a trace is replayed in order)",
                        m.timestamp, self.last_timestamp
                    ),
                )
                .with("field", "timestamp"));
            }
            if self.requests == MAX_REQUESTS {
                return Err(line_err(
                    ln,
                    format!("more than {MAX_REQUESTS} requests (the most one replay takes)"),
                ));
            }
            self.last_timestamp = m.timestamp;
            self.requests += 1;
            let max_tokens = m.output_length.clamp(1, self.max_output_tokens);
            return Ok(Some(TraceRequest {
                id: format!("line{ln}"),
                arrival: m.timestamp,
                prompt: prompt_tokens(&m.hash_ids, m.input_length),
                max_tokens,
            }));
        }
    }
}

impl<R: BufRead> Iterator for MooncakeReader<R> {
    type Item = Result<TraceRequest>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_request() {
            Ok(r) => r.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

/// Opens a Mooncake trace file for lazy reading.
pub fn open_mooncake(
    path: &Path,
    max_output_tokens: usize,
) -> Result<MooncakeReader<std::io::BufReader<std::fs::File>>> {
    let file = std::fs::File::open(path).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("cannot read trace {}: {e}", path.display()),
        )
    })?;
    Ok(MooncakeReader::new(
        std::io::BufReader::with_capacity(1 << 16, file),
        max_output_tokens,
    ))
}
