//! Workloads for `kvbm replay`: the request type and the built-in generators; and the model
//! stand-in's tokens.
//!
//! A workload is a list of requests, each with an id, an arrival step (the engine admits it at or
//! after that step), a prompt and a number of output tokens. Generators are deterministic for a
//! seed. Generated tokens are a pure function of the token prefix ([`sample_token`]), so a
//! multi-turn generator can put the engine's own earlier answers into the next turn's prompt, as a
//! chat frontend does. JSONL traces are read by the `trace` module.
//!
//! `tests/cli.rs` compiles this file too (the tool is not a library), to compare the binary's
//! reports with the generators and the model; so this file uses nothing of the tool, and its tests
//! live there (inline ones would run in both places).

use serde::{Deserialize, Serialize};

/// Tokens are drawn below this id.
pub const VOCAB: u32 = 32_000;

/// Most tokens one request may hold, prompt and output together: 2^24 = 16,777,216, above the
/// context window of any model we imitate. The engine keeps each token and its prefix hash (12
/// bytes), so the bound also caps one request's memory (about 200 MB) and keeps
/// `prompt + max_tokens` far from overflowing.
pub const MAX_REQUEST_TOKENS: usize = 1 << 24;

/// Most requests in one workload (`--requests`, or lines of a trace): 1,000,000, fifty times the
/// longest replay we run; a workload that large already takes gigabytes before its first step.
pub const MAX_REQUESTS: usize = 1_000_000;

/// Latest arrival step of a request: 2^40 (about 1.1e12 steps, years of simulated serving). The
/// engine's step counter starts at most here and counts up from it, so it never nears `u64::MAX`.
pub const MAX_ARRIVAL: u64 = 1 << 40;

/// Largest `--arrival-gap` of a generated workload: 2^20 steps. With at most [`MAX_REQUESTS`]
/// requests every generated arrival stays below [`MAX_ARRIVAL`].
pub const MAX_ARRIVAL_GAP: u64 = 1 << 20;

/// Tokens a request holds at its end (`prompt_len + max_tokens`), or why it is too many: the sum
/// checked against [`MAX_REQUEST_TOKENS`] without overflowing.
pub fn request_tokens(prompt_len: usize, max_tokens: usize) -> Result<usize, String> {
    match prompt_len.checked_add(max_tokens) {
        Some(n) if n <= MAX_REQUEST_TOKENS => Ok(n),
        _ => Err(format!(
            "prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds \
             {MAX_REQUEST_TOKENS} tokens per request"
        )),
    }
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Request id (unique within the workload).
    pub id: String,
    /// Engine step at or after which the request is admitted.
    pub arrival: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate (at least 1).
    pub max_tokens: usize,
}

/// The built-in workload generators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::Display, strum::EnumString, clap::ValueEnum)]
#[strum(serialize_all = "kebab-case")]
pub enum WorkloadKind {
    /// Conversations whose every turn re-sends the whole history (system prompt, earlier turns
    /// and the model's earlier answers) plus a new user message.
    MultiTurn,
    /// Many requests sharing a few long system prompts, each with its own short suffix.
    SharedPrefix,
    /// Unrelated random prompts (little to share).
    Random,
}

/// A small deterministic generator (SplitMix64): no dependency, same stream on every platform.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (`lo` when `hi < lo`).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Between `lo` and `hi` random tokens.
    pub fn tokens_between(&mut self, lo: usize, hi: usize) -> Vec<u32> {
        let n = self.range(lo, hi);
        self.tokens(n)
    }

    /// `n` random tokens.
    pub fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next_u64() % u64::from(VOCAB)) as u32)
            .collect()
    }
}

/// FNV-1a step over one token: the rolling hash of a token prefix.
pub fn prefix_hash_step(h: u64, token: u32) -> u64 {
    (h ^ u64::from(token)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// Rolling hash of the empty prefix.
pub const PREFIX_HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// The token the model stand-in samples after a prefix with rolling hash `h`.
pub fn sample_token(h: u64) -> u32 {
    let mut z = h ^ 0x5851_f42d_4c95_7f2d;
    z = (z ^ (z >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    ((z ^ (z >> 29)) % u64::from(VOCAB)) as u32
}

/// The `n` tokens the model stand-in generates after `prompt`.
pub fn generate(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut h = prompt
        .iter()
        .fold(PREFIX_HASH_SEED, |h, &t| prefix_hash_step(h, t));
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = sample_token(h);
        out.push(t);
        h = prefix_hash_step(h, t);
    }
    out
}

/// Sizes of a generated workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadSize {
    /// Requests (multi-turn: conversations × turns).
    pub requests: usize,
    /// Steps between consecutive arrivals.
    pub arrival_gap: u64,
}

/// Generates a built-in workload.
pub fn generate_workload(kind: WorkloadKind, seed: u64, size: WorkloadSize) -> Vec<TraceRequest> {
    let mut rng = Rng::new(seed);
    let gap = size.arrival_gap;
    match kind {
        WorkloadKind::MultiTurn => {
            let turns = 4usize;
            let conversations = size.requests.div_ceil(turns).max(1);
            let system = rng.tokens(96);
            let mut out = Vec::with_capacity(conversations * turns);
            for c in 0..conversations {
                let mut history = system.clone();
                history.extend(rng.tokens_between(32, 96));
                for t in 0..turns {
                    if out.len() == size.requests {
                        break;
                    }
                    history.extend(rng.tokens_between(24, 72));
                    let max_tokens = rng.range(8, 24);
                    // Turns of one conversation arrive far apart (the user reads and types),
                    // conversations interleave.
                    // Saturating: the caller bounds `gap` (MAX_ARRIVAL_GAP); never a panic.
                    let arrival = (c as u64)
                        .saturating_mul(gap)
                        .saturating_add((t as u64).saturating_mul(gap).saturating_mul(6));
                    out.push(TraceRequest {
                        id: format!("c{c}-t{t}"),
                        arrival,
                        prompt: history.clone(),
                        max_tokens,
                    });
                    history.extend(generate(&history, max_tokens));
                }
            }
            out.sort_by_key(|r| r.arrival);
            out
        }
        WorkloadKind::SharedPrefix => {
            let prefixes: Vec<Vec<u32>> = (0..4).map(|_| rng.tokens_between(192, 384)).collect();
            (0..size.requests)
                .map(|i| {
                    let p = &prefixes[rng.range(0, prefixes.len() - 1)];
                    let mut prompt = p.clone();
                    prompt.extend(rng.tokens_between(16, 64));
                    TraceRequest {
                        id: format!("s{i}"),
                        arrival: (i as u64).saturating_mul(gap),
                        prompt,
                        max_tokens: rng.range(4, 16),
                    }
                })
                .collect()
        }
        WorkloadKind::Random => (0..size.requests)
            .map(|i| {
                let n = rng.range(64, 384);
                TraceRequest {
                    id: format!("r{i}"),
                    arrival: (i as u64).saturating_mul(gap),
                    prompt: rng.tokens(n),
                    max_tokens: rng.range(4, 16),
                }
            })
            .collect(),
    }
}

/// The UTF-8 byte-order mark (bytes EF BB BF) as the character a decoded line starts with.
pub const BOM: char = '\u{feff}';

/// Why a trace line is not a JSON object the readers take, and the field concerned (if any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonLineError {
    /// What is wrong, for the reader's `line N: …` error.
    pub what: String,
    /// The field it concerns (a duplicate key).
    pub field: Option<String>,
}

/// Parses one trace line as a JSON object whose keys are unique.
///
/// `serde_json` keeps the last of two equal keys silently (`{"a": 1, "a": 2}` is `{"a": 2}`), so
/// a line with a duplicate key would be taken with one of its values dropped: it is refused here,
/// naming the key. A line that starts with a byte-order mark is refused naming the mark (the
/// readers skip one at the very start of a trace before calling this).
pub fn json_object(
    line: &str,
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, JsonLineError> {
    let plain = |what: String| JsonLineError { what, field: None };
    if line.starts_with(BOM) {
        return Err(plain(
            "starts with a UTF-8 byte-order mark (EF BB BF), which only the trace's first line \
             may carry: save the file without it"
                .into(),
        ));
    }
    let value: UniqueKeys =
        serde_json::from_str(line).map_err(|e| plain(format!("not JSON: {e}")))?;
    match value {
        UniqueKeys::Object(map) => Ok(map),
        UniqueKeys::Duplicate(key) => Err(JsonLineError {
            what: format!("duplicate field {key:?} (each field appears once)"),
            field: Some(key),
        }),
        UniqueKeys::Other => Err(plain("expected a JSON object".into())),
    }
}

/// A top-level JSON value read by [`json_object`]: an object with unique keys, the first key
/// found twice, or anything but an object. Nested values are ordinary `serde_json` values (a
/// trace's fields hold numbers and arrays of numbers; anything else is refused by type).
enum UniqueKeys {
    Object(serde_json::Map<String, serde_json::Value>),
    Duplicate(String),
    Other,
}

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = UniqueKeys;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<UniqueKeys, A::Error> {
                let mut map = serde_json::Map::new();
                let mut duplicate = None;
                while let Some(key) = m.next_key::<String>()? {
                    let value: serde_json::Value = m.next_value()?;
                    if duplicate.is_none() && map.contains_key(&key) {
                        duplicate = Some(key);
                    } else {
                        map.insert(key, value);
                    }
                }
                Ok(match duplicate {
                    Some(k) => UniqueKeys::Duplicate(k),
                    None => UniqueKeys::Object(map),
                })
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> std::result::Result<UniqueKeys, A::Error> {
                while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(UniqueKeys::Other)
            }

            fn visit_bool<E>(self, _: bool) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
            fn visit_i64<E>(self, _: i64) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
            fn visit_u64<E>(self, _: u64) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
            fn visit_f64<E>(self, _: f64) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
            fn visit_str<E>(self, _: &str) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
            fn visit_unit<E>(self) -> std::result::Result<UniqueKeys, E> {
                Ok(UniqueKeys::Other)
            }
        }
        d.deserialize_any(V)
    }
}
