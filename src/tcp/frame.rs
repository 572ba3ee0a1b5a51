//! Frames: the 12-byte header, its kinds and the handshake payloads, and reading and writing
//! them (blocking and async).
//!
//! Owns the byte layout described in the [module documentation](super). Invariants: a frame
//! written here always carries [`MAGIC`], [`PROTOCOL_VERSION`] and a reserved byte of 0, and a
//! payload of at most [`MAX_PAYLOAD`] bytes; a header is checked (magic, version, kind, length
//! against the caller's limit) before any payload byte is read, so an oversized or foreign frame
//! never makes the reader allocate its claimed length; the payload buffer then grows in
//! [`READ_BUFFER`] steps as bytes arrive, so a peer that claims a large payload and sends none
//! costs at most one step, and a returned payload never holds more than the limit.

use std::io::Read;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::connector::metadata::OperationId;
use crate::connector::transport::{Completion, Rank};
use crate::error::{Error, Result};

/// The first four bytes of every frame.
pub(super) const MAGIC: [u8; 4] = *b"KVBM";
/// The wire protocol version this build speaks (bytes 4..6 of every frame, big-endian); a peer
/// speaking another is refused. Version 2 added heartbeats (the HEARTBEAT kind and the WELCOME
/// fields announcing them); version 3 the COMPLETIONS kind (a worker's completions, batched, in a
/// binary payload); version 4 the worker's `StoreStats` message (its remote store's counters);
/// version 5 the worker's `DiskIndex` message (what a persisted disk tier holds, at start-up);
/// version 6 the leader's `Ready` (barrier step 3: the leader is ready) and `Goodbye` (it shuts
/// down in order) messages.
pub const PROTOCOL_VERSION: u16 = 6;
/// Bytes of a frame header.
pub(super) const HEADER_LEN: usize = 12;
/// Largest MSG payload (16 MiB); a larger length closes the connection.
pub(super) const MAX_PAYLOAD: u32 = 16 * 1024 * 1024;
/// Largest HELLO payload (64 KiB), read before the peer is authenticated.
pub(super) const MAX_HELLO_PAYLOAD: u32 = 64 * 1024;
/// Read-buffer size of a connection.
pub(super) const READ_BUFFER: usize = 64 * 1024;

/// The kind byte of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub(super) enum FrameKind {
    /// Worker → leader, first frame: [`HandshakeHello`].
    Hello = 1,
    /// Leader → worker: admitted ([`Welcome`]).
    Welcome = 2,
    /// Leader → worker: refused ([`Refusal`]); the leader closes the connection.
    Refused = 3,
    /// A [`WorkerMessage`](crate::connector::transport::WorkerMessage) or
    /// [`LeaderMessage`](crate::connector::transport::LeaderMessage), after the handshake.
    Msg = 4,
    /// Either direction, after the handshake: "still here" (empty payload, ignored).
    Heartbeat = 5,
    /// Worker → leader, after the handshake: a batch of completions, binary
    /// ([`encode_completions`]).
    Completions = 6,
}

impl FrameKind {
    /// The kind for a byte, if it names one.
    pub(super) fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Hello),
            2 => Some(Self::Welcome),
            3 => Some(Self::Refused),
            4 => Some(Self::Msg),
            5 => Some(Self::Heartbeat),
            6 => Some(Self::Completions),
            _ => None,
        }
    }
}

impl std::fmt::Display for FrameKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Hello => "HELLO",
            Self::Welcome => "WELCOME",
            Self::Refused => "REFUSED",
            Self::Msg => "MSG",
            Self::Heartbeat => "HEARTBEAT",
            Self::Completions => "COMPLETIONS",
        })
    }
}

/// HELLO payload: who the connecting worker is.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct HandshakeHello {
    /// The worker's rank.
    pub(super) rank: Rank,
    /// How many ranks the worker believes there are.
    pub(super) world_size: usize,
    /// The shared secret, when the worker has one.
    pub(super) token: Option<String>,
}

impl std::fmt::Debug for HandshakeHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeHello")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// WELCOME payload: the leader admitted the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Welcome {
    /// The rank admitted.
    pub(super) rank: Rank,
    /// The leader's world size.
    pub(super) world_size: usize,
    /// Milliseconds between two heartbeats the worker sends (and the leader sends it).
    pub(super) heartbeat_ms: u64,
    /// Milliseconds of silence after which either side counts the other as lost.
    pub(super) heartbeat_timeout_ms: u64,
}

/// REFUSED payload: why the leader refused the worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Refusal {
    /// One line saying why.
    pub(super) reason: String,
}

/// One frame (header and payload) ready to write. Fails when the payload exceeds [`MAX_PAYLOAD`].
pub(super) fn encode_frame(kind: FrameKind, payload: &[u8]) -> Result<Vec<u8>> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_PAYLOAD)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "{kind} payload of {} bytes exceeds the {MAX_PAYLOAD}-byte frame limit",
                payload.len()
            ))
        })?;
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.push(kind as u8);
    frame.push(0);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    Ok(frame)
}

/// One frame whose payload is `value` as JSON.
pub(super) fn encode_json(kind: FrameKind, value: &impl Serialize) -> Result<Vec<u8>> {
    let payload = serde_json::to_vec(value)
        .map_err(|e| Error::internal(format!("cannot encode a {kind} payload as JSON: {e}")))?;
    encode_frame(kind, &payload)
}

/// Bytes of a COMPLETIONS payload before its entries: the entry count (`u32`).
const COUNT_LEN: usize = 4;
/// Bytes of a completion entry before its failed blocks: op (`u64`), flags (`u8`), failed-block
/// count (`u32`).
const ENTRY_HEAD: usize = 13;
/// Bytes of one failed block id (`u64`).
const BLOCK_LEN: usize = 8;
/// Entry flag: an error text (`u32` length, UTF-8 bytes) follows the failed blocks.
const FLAG_ERROR: u8 = 1;
/// Entry flag: more failed blocks of the same operation follow in the next entry (which may be
/// in the next frame); only an operation too large for one frame is split so.
const FLAG_CONTINUED: u8 = 2;
/// The longest error text sent with a completion; a longer one is cut at a character boundary
/// and ends with `…` (the text is for people; the failed blocks are never cut).
pub(super) const MAX_ERROR_BYTES: usize = 4096;
/// The most failed blocks the leader merges for one operation split over several entries.
pub(super) const MAX_FAILED_PER_OP: usize = 1 << 24;
/// The smallest payload bound [`encode_completions`] accepts: one entry with one block and a
/// short error.
pub(super) const MIN_COMPLETIONS_PAYLOAD: u32 =
    (COUNT_LEN + ENTRY_HEAD + BLOCK_LEN + 4 + 64) as u32;

/// `text` cut to at most `max` bytes at a character boundary, marked with `…` when cut.
fn cut(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    const MARK: &str = "…";
    let mut end = max.saturating_sub(MARK.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &text[..end]).into()
}

/// COMPLETIONS frames being filled, each at most `max` payload bytes.
struct CompletionFrames {
    max: usize,
    done: Vec<Vec<u8>>,
    /// The frame being filled: header, count, entries.
    cur: Vec<u8>,
    count: u32,
}

impl CompletionFrames {
    fn new(max: usize) -> Self {
        let mut f = Self {
            max,
            done: Vec::new(),
            cur: Vec::new(),
            count: 0,
        };
        f.start();
        f
    }

    fn start(&mut self) {
        self.cur = Vec::with_capacity(HEADER_LEN + COUNT_LEN + 256);
        self.cur.extend_from_slice(&MAGIC);
        self.cur.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        self.cur.push(FrameKind::Completions as u8);
        self.cur.push(0);
        self.cur.extend_from_slice(&[0; 4]); // length, set by `finish`
        self.cur.extend_from_slice(&[0; COUNT_LEN]); // count, set by `finish`
        self.count = 0;
    }

    /// Payload bytes still free in the current frame.
    fn room(&self) -> usize {
        self.max.saturating_sub(self.cur.len() - HEADER_LEN)
    }

    fn push(&mut self, op: OperationId, blocks: &[usize], error: Option<&str>, continued: bool) {
        let flags = u8::from(error.is_some()) * FLAG_ERROR + u8::from(continued) * FLAG_CONTINUED;
        self.cur.extend_from_slice(&op.0.to_be_bytes());
        self.cur.push(flags);
        // Callers bound `blocks` by the frame size (16 MiB / 8), far below u32::MAX.
        self.cur
            .extend_from_slice(&(blocks.len() as u32).to_be_bytes());
        for b in blocks {
            self.cur.extend_from_slice(&(*b as u64).to_be_bytes());
        }
        if let Some(e) = error {
            self.cur.extend_from_slice(&(e.len() as u32).to_be_bytes());
            self.cur.extend_from_slice(e.as_bytes());
        }
        self.count += 1;
    }

    /// Closes the current frame (if it holds an entry) and starts another.
    fn finish(&mut self) {
        if self.count == 0 {
            return;
        }
        let len = (self.cur.len() - HEADER_LEN) as u32;
        self.cur[8..12].copy_from_slice(&len.to_be_bytes());
        self.cur[HEADER_LEN..HEADER_LEN + COUNT_LEN].copy_from_slice(&self.count.to_be_bytes());
        let frame = std::mem::take(&mut self.cur);
        self.done.push(frame);
        self.start();
    }
}

/// `list` as COMPLETIONS frames (header included, ready to write), in order, each payload at
/// most `max_payload` bytes ([`MAX_PAYLOAD`] on the wire; smaller in tests): as many entries
/// per frame as fit, a new frame when the next does not. An operation whose failed blocks alone
/// exceed a frame is split over consecutive entries (flag `continued`), which the leader merges
/// back ([`CompletionsDecoder`]): no failed block is ever dropped. Error texts are cut to
/// [`MAX_ERROR_BYTES`] (and to what fits one frame). An empty list is no frame.
///
/// Payload: `count: u32`, then `count` entries of `op: u64`, `flags: u8` (bit 0 an error
/// follows, bit 1 continued), `n: u32`, `n` failed destination blocks as `u64`, and when bit 0
/// is set `len: u32` and `len` bytes of UTF-8; all big-endian.
pub(super) fn encode_completions(list: &[Completion], max_payload: u32) -> Result<Vec<Vec<u8>>> {
    if !(MIN_COMPLETIONS_PAYLOAD..=MAX_PAYLOAD).contains(&max_payload) {
        return Err(Error::invalid_argument(format!(
            "a COMPLETIONS payload bound of {max_payload} bytes is outside {MIN_COMPLETIONS_PAYLOAD}..={MAX_PAYLOAD}"
        )));
    }
    let max = max_payload as usize;
    // Whatever else, an entry with no block and its error fits an empty frame.
    let max_error = MAX_ERROR_BYTES.min(max - COUNT_LEN - ENTRY_HEAD - 4);
    let mut frames = CompletionFrames::new(max);
    for c in list {
        let error = c.error.as_deref().map(|e| cut(e, max_error));
        let error = error.as_deref();
        let error_len = error.map_or(0, |e| 4 + e.len());
        let mut blocks: &[usize] = &c.failed_dst_blocks;
        loop {
            let whole = ENTRY_HEAD + BLOCK_LEN * blocks.len() + error_len;
            if whole <= frames.room() {
                frames.push(c.op, blocks, error, false);
                break;
            }
            if frames.count > 0 && whole <= max - COUNT_LEN {
                // Fits an empty frame: start one rather than split.
                frames.finish();
                continue;
            }
            // Too large for any frame: as many blocks as fit here, the rest continued.
            let fit = (frames.room().saturating_sub(ENTRY_HEAD) / BLOCK_LEN).min(blocks.len());
            if fit == 0 {
                frames.finish();
                continue;
            }
            frames.push(c.op, &blocks[..fit], None, true);
            blocks = &blocks[fit..];
            frames.finish();
        }
    }
    frames.finish();
    Ok(frames.done)
}

/// Reads a COMPLETIONS payload's fields, each bounded by the bytes left.
struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        if n > self.rest.len() {
            return Err(format!(
                "{what} needs {n} bytes but {} remain",
                self.rest.len()
            ));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> std::result::Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
}

/// The leader's decoder of one connection's COMPLETIONS frames: holds an operation split over
/// continued entries until its last entry arrives (possibly in a later frame).
#[derive(Debug, Default)]
pub(super) struct CompletionsDecoder {
    partial: Option<Completion>,
}

impl CompletionsDecoder {
    /// The completions a COMPLETIONS payload finishes, in order, or why it does not decode
    /// (which closes the connection). Every count is checked against the bytes that remain
    /// before anything is allocated for it.
    pub(super) fn decode(
        &mut self,
        payload: &[u8],
    ) -> std::result::Result<Vec<Completion>, String> {
        let mut f = Fields { rest: payload };
        let count = f.u32("the entry count")? as usize;
        if count > f.rest.len() / ENTRY_HEAD {
            return Err(format!(
                "{count} entries cannot fit in {} bytes",
                f.rest.len()
            ));
        }
        let mut out = Vec::with_capacity(count);
        for i in 0..count {
            let op = OperationId(f.u64("an entry's op")?);
            let flags = f.u8("an entry's flags")?;
            if flags & !(FLAG_ERROR | FLAG_CONTINUED) != 0 {
                return Err(format!(
                    "entry {i} (op {op}) has unknown flags {flags:#04x}"
                ));
            }
            let n = f.u32("an entry's failed-block count")? as usize;
            if n > f.rest.len() / BLOCK_LEN {
                return Err(format!(
                    "entry {i} (op {op}) claims {n} failed blocks in {} bytes",
                    f.rest.len()
                ));
            }
            let mut failed = Vec::with_capacity(n);
            for _ in 0..n {
                let b = f.u64("a failed block")?;
                failed.push(usize::try_from(b).map_err(|_| {
                    format!("entry {i} (op {op}): block {b} does not fit this platform")
                })?);
            }
            let error = if flags & FLAG_ERROR != 0 {
                let len = f.u32("an error's length")? as usize;
                let bytes = f.take(len, "an error's text")?;
                Some(
                    String::from_utf8(bytes.to_vec())
                        .map_err(|_| format!("entry {i} (op {op}): error text is not UTF-8"))?,
                )
            } else {
                None
            };
            let mut c = Completion {
                op,
                failed_dst_blocks: failed,
                error,
            };
            if let Some(mut p) = self.partial.take() {
                if p.op != op {
                    return Err(format!(
                        "op {} was continued but entry {i} is op {op}",
                        p.op
                    ));
                }
                if p.failed_dst_blocks.len() + c.failed_dst_blocks.len() > MAX_FAILED_PER_OP {
                    return Err(format!(
                        "op {op} names more than {MAX_FAILED_PER_OP} failed blocks"
                    ));
                }
                p.failed_dst_blocks.append(&mut c.failed_dst_blocks);
                p.error = c.error.or(p.error);
                c = p;
            }
            if flags & FLAG_CONTINUED != 0 {
                self.partial = Some(c);
            } else {
                out.push(c);
            }
        }
        if !f.rest.is_empty() {
            return Err(format!(
                "{} bytes after the last of {count} entries",
                f.rest.len()
            ));
        }
        Ok(out)
    }

    /// The operation held for its next entry, if any.
    #[cfg(test)]
    pub(super) fn partial(&self) -> Option<OperationId> {
        self.partial.as_ref().map(|c| c.op)
    }
}

/// Why reading a frame failed.
#[derive(Debug)]
pub(super) enum FrameError {
    /// The peer closed the connection.
    Closed,
    Io(std::io::Error),
    BadMagic([u8; 4]),
    BadVersion(u16),
    UnknownKind(u8),
    TooLarge {
        len: u32,
        max: u32,
    },
}

impl FrameError {
    pub(super) fn from_io(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Closed
        } else {
            Self::Io(e)
        }
    }

    /// Whether the peer speaks this protocol (the magic matched), so a REFUSED answer helps it.
    pub(super) fn speaks_protocol(&self) -> bool {
        matches!(
            self,
            Self::BadVersion(_) | Self::UnknownKind(_) | Self::TooLarge { .. }
        )
    }
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Closed => f.write_str("connection closed by the peer"),
            Self::Io(e) => write!(f, "I/O error: {e}"),
            Self::BadMagic(m) => write!(
                f,
                "bad magic {m:02x?} (expected \"KVBM\"): not a kvbm peer"
            ),
            Self::BadVersion(v) => write!(
                f,
                "protocol version {v} is not supported (this side speaks version {PROTOCOL_VERSION})"
            ),
            Self::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            Self::TooLarge { len, max } => {
                write!(f, "frame payload of {len} bytes exceeds the limit of {max}")
            }
        }
    }
}

/// Checks a header; returns the kind and payload length.
pub(super) fn parse_header(h: &[u8; HEADER_LEN], max: u32) -> Result<(FrameKind, u32), FrameError> {
    let [m0, m1, m2, m3, v0, v1, k, _reserved, l0, l1, l2, l3] = *h;
    let magic = [m0, m1, m2, m3];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([v0, v1]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::BadVersion(version));
    }
    let kind = FrameKind::from_byte(k).ok_or(FrameError::UnknownKind(k))?;
    let len = u32::from_be_bytes([l0, l1, l2, l3]);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok((kind, len))
}

/// A payload being read: grows by at most [`READ_BUFFER`] bytes a step (exactly, never past
/// its length), so its allocation follows the bytes that arrived.
struct Payload {
    buf: Vec<u8>,
    len: usize,
}

impl Payload {
    fn new(len: u32) -> Result<Self, FrameError> {
        let len = usize::try_from(len).map_err(|_| FrameError::TooLarge { len, max: 0 })?;
        Ok(Self {
            buf: Vec::new(),
            len,
        })
    }

    /// The next range to fill, or `None` when complete.
    fn next_step(&mut self) -> Option<std::ops::Range<usize>> {
        let start = self.buf.len();
        let step = (self.len - start).min(READ_BUFFER);
        if step == 0 {
            return None;
        }
        self.buf.reserve_exact(step);
        self.buf.resize(start + step, 0);
        Some(start..start + step)
    }
}

/// Reads one frame whose payload is at most `max` bytes (async: the leader's tasks).
pub(super) async fn read_frame_async<R: AsyncRead + Unpin>(
    r: &mut R,
    max: u32,
) -> Result<(FrameKind, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).await.map_err(FrameError::from_io)?;
    let (kind, len) = parse_header(&h, max)?;
    let mut payload = Payload::new(len)?;
    while let Some(range) = payload.next_step() {
        r.read_exact(&mut payload.buf[range])
            .await
            .map_err(FrameError::from_io)?;
    }
    Ok((kind, payload.buf))
}

/// Reads one frame whose payload is at most `max` bytes (blocking: the worker's socket).
pub(super) fn read_frame_sync(
    r: &mut impl Read,
    max: u32,
) -> Result<(FrameKind, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h).map_err(FrameError::from_io)?;
    let (kind, len) = parse_header(&h, max)?;
    let mut payload = Payload::new(len)?;
    while let Some(range) = payload.next_step() {
        r.read_exact(&mut payload.buf[range])
            .map_err(FrameError::from_io)?;
    }
    Ok((kind, payload.buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn header(magic: &[u8; 4], version: u16, kind: u8, len: u32) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(magic);
        h[4..6].copy_from_slice(&version.to_be_bytes());
        h[6] = kind;
        h[8..].copy_from_slice(&len.to_be_bytes());
        h
    }

    #[test]
    fn frame_layout_is_as_documented() {
        let f = encode_frame(FrameKind::Msg, b"\"Ready\"").unwrap();
        assert_eq!(&f[..4], b"KVBM");
        assert_eq!(&f[4..6], &PROTOCOL_VERSION.to_be_bytes());
        assert_eq!(f[6], 4);
        assert_eq!(f[7], 0);
        assert_eq!(&f[8..12], &[0, 0, 0, 7]);
        assert_eq!(&f[12..], b"\"Ready\"");
        let h: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        assert_eq!(parse_header(&h, MAX_PAYLOAD).unwrap(), (FrameKind::Msg, 7));
    }

    #[test]
    fn bad_headers_are_rejected() {
        let cases = [
            (header(b"GET ", 1, 4, 0), "bad magic"),
            (header(b"KVBM", 1, 4, 0), "version 1"),
            (header(b"KVBM", 2, 4, 0), "version 2"),
            (header(b"KVBM", PROTOCOL_VERSION, 9, 0), "kind 9"),
            (header(b"KVBM", PROTOCOL_VERSION, 0, 0), "kind 0"),
            (
                header(b"KVBM", PROTOCOL_VERSION, 4, MAX_PAYLOAD + 1),
                "exceeds",
            ),
        ];
        for (h, want) in cases {
            let e = parse_header(&h, MAX_PAYLOAD).unwrap_err().to_string();
            assert!(e.contains(want), "{e} should contain {want}");
        }
    }

    #[test]
    fn oversized_payloads_are_not_encoded() {
        let big = vec![0u8; MAX_PAYLOAD as usize + 1];
        let e = encode_frame(FrameKind::Msg, &big).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }

    fn done(op: u64, failed: Vec<usize>, error: Option<&str>) -> Completion {
        Completion {
            op: OperationId(op),
            failed_dst_blocks: failed,
            error: error.map(str::to_string),
        }
    }

    /// Decodes `frames` as the leader does: header checked, then each payload in turn.
    fn decode_frames(frames: &[Vec<u8>], max: u32) -> Vec<Completion> {
        let mut d = CompletionsDecoder::default();
        let mut out = Vec::new();
        for f in frames {
            let h: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
            let (kind, len) = parse_header(&h, MAX_PAYLOAD).unwrap();
            assert_eq!(kind, FrameKind::Completions);
            assert!(len <= max, "payload {len} above the bound {max}");
            assert_eq!(f.len(), HEADER_LEN + len as usize);
            out.extend(d.decode(&f[HEADER_LEN..]).unwrap());
        }
        assert_eq!(d.partial(), None, "an operation left continued");
        out
    }

    #[test]
    fn n_completions_travel_in_one_frame_in_order() {
        let list: Vec<Completion> = (0..100u64)
            .rev()
            .map(|i| match i % 3 {
                0 => done(i, vec![], None),
                1 => done(i, vec![i as usize, 7], Some("disk full")),
                _ => done(i, vec![], Some("")),
            })
            .collect();
        let frames = encode_completions(&list, MAX_PAYLOAD).unwrap();
        assert_eq!(frames.len(), 1);
        let f = &frames[0];
        assert_eq!(&f[..4], b"KVBM");
        assert_eq!(f[6], 6, "kind 6 = COMPLETIONS");
        assert_eq!(&f[HEADER_LEN..HEADER_LEN + 4], &100u32.to_be_bytes());
        assert_eq!(decode_frames(&frames, MAX_PAYLOAD), list);
        assert!(encode_completions(&[], MAX_PAYLOAD).unwrap().is_empty());
    }

    #[test]
    fn the_layout_of_one_entry_is_as_documented() {
        let frames = encode_completions(&[done(0x0102, vec![5], Some("é"))], MAX_PAYLOAD).unwrap();
        let p = &frames[0][HEADER_LEN..];
        let want: Vec<u8> = [
            &1u32.to_be_bytes()[..],
            &0x0102u64.to_be_bytes(),
            &[FLAG_ERROR],
            &1u32.to_be_bytes(),
            &5u64.to_be_bytes(),
            &2u32.to_be_bytes(),
            "é".as_bytes(),
        ]
        .concat();
        assert_eq!(p, &want[..]);
    }

    #[test]
    fn a_batch_splits_at_the_size_bound_and_keeps_its_order() {
        let max = 200;
        let list: Vec<Completion> = (0..50u64)
            .map(|i| {
                done(
                    i,
                    vec![i as usize; (i % 4) as usize],
                    (i % 5 == 0).then_some("why"),
                )
            })
            .collect();
        let frames = encode_completions(&list, max).unwrap();
        assert!(frames.len() > 3, "{} frames", frames.len());
        // Full frames: the next entry would not have fit.
        let total: usize = frames.iter().map(|f| f.len() - HEADER_LEN).sum();
        assert!(total <= frames.len() * max as usize);
        assert_eq!(decode_frames(&frames, max), list);
    }

    #[test]
    fn one_operation_larger_than_a_frame_is_continued_and_merged_back() {
        let max = MIN_COMPLETIONS_PAYLOAD;
        let failed: Vec<usize> = (0..1000).collect();
        let long_error = "x".repeat(10_000);
        let list = vec![
            done(1, vec![], None),
            done(2, failed.clone(), Some(&long_error)),
            done(3, vec![9], None),
        ];
        let frames = encode_completions(&list, max).unwrap();
        assert!(frames.len() > 10, "{} frames", frames.len());
        let got = decode_frames(&frames, max);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], list[0]);
        assert_eq!(got[2], list[2]);
        assert_eq!(got[1].op, OperationId(2));
        assert_eq!(got[1].failed_dst_blocks, failed, "no failed block lost");
        let e = got[1].error.as_deref().unwrap();
        assert!(
            e.len() < long_error.len() && e.ends_with('…') && e.starts_with("xxx"),
            "{e}"
        );
        // At the wire bound, the error is cut at MAX_ERROR_BYTES only.
        let frames = encode_completions(&list, MAX_PAYLOAD).unwrap();
        assert_eq!(frames.len(), 1);
        let got = decode_frames(&frames, MAX_PAYLOAD);
        assert_eq!(got[1].error.as_deref().unwrap().len(), MAX_ERROR_BYTES);
        assert!(encode_completions(&list, MIN_COMPLETIONS_PAYLOAD - 1).is_err());
    }

    #[test]
    fn a_leader_refuses_malformed_completions() {
        let good = encode_completions(&[done(1, vec![2, 3], Some("e"))], MAX_PAYLOAD).unwrap();
        let p = good[0][HEADER_LEN..].to_vec();
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (p[..p.len() - 1].to_vec(), "remain"),
            ([p.clone(), vec![0]].concat(), "after the last"),
            (
                [&u32::MAX.to_be_bytes()[..], &p[4..]].concat(),
                "cannot fit",
            ),
            (vec![0, 0], "remain"),
        ];
        let mut flags = p.clone();
        flags[12] = 0x80;
        cases.push((flags, "unknown flags"));
        let mut blocks = p.clone();
        blocks[13..17].copy_from_slice(&u32::MAX.to_be_bytes());
        cases.push((blocks, "claims"));
        let mut utf8 = p.clone();
        let last = utf8.len() - 1;
        utf8[last] = 0xff;
        cases.push((utf8, "UTF-8"));
        for (bytes, want) in cases {
            let e = CompletionsDecoder::default().decode(&bytes).unwrap_err();
            assert!(e.contains(want), "{e} should contain {want}");
        }
        // An operation continued, then another one: refused.
        let mut continued = encode_completions(&[done(1, (0..40).collect(), None)], 200).unwrap();
        let other = encode_completions(&[done(2, vec![], None)], 200).unwrap();
        let mut d = CompletionsDecoder::default();
        assert!(d
            .decode(&continued.remove(0)[HEADER_LEN..])
            .unwrap()
            .is_empty());
        assert_eq!(d.partial(), Some(OperationId(1)));
        let e = d.decode(&other[0][HEADER_LEN..]).unwrap_err();
        assert!(e.contains("was continued"), "{e}");
    }

    #[test]
    fn a_claimed_length_is_not_allocated_up_front() {
        let mut p = Payload::new(MAX_PAYLOAD).unwrap();
        let first = p.next_step().unwrap();
        assert_eq!(first, 0..READ_BUFFER);
        assert!(p.buf.capacity() <= READ_BUFFER, "{}", p.buf.capacity());
        // A peer that claims 16 MiB and sends 10 bytes: a typed error, nothing large held.
        let mut bytes = header(b"KVBM", PROTOCOL_VERSION, 4, MAX_PAYLOAD).to_vec();
        bytes.extend_from_slice(&[b'x'; 10]);
        assert!(matches!(
            read_frame_sync(&mut &bytes[..], MAX_PAYLOAD),
            Err(FrameError::Closed)
        ));
    }
}

/// Fuzz tests of the frame decoder ("keep them fixed", issue 13): arbitrary bytes and headers
/// into both frame readers and the payload decoders: a frame or a typed error, never a panic,
/// never a payload (or its allocation) above the reader's limit, never a payload byte read
/// before the header passed. Bounded (a few hundred cases) so they run in about a second.
#[cfg(test)]
mod fuzz {
    use std::io::Cursor;

    use proptest::prelude::*;

    use super::*;
    use crate::connector::transport::{
        Completion, FinishWork, LeaderMessage, TierCounts, WorkerMessage,
    };

    /// The limits the readers are called with, and a few others.
    fn limit() -> impl Strategy<Value = u32> {
        prop_oneof![
            Just(0u32),
            Just(16),
            Just(MAX_HELLO_PAYLOAD),
            Just(MAX_PAYLOAD),
            0u32..1024,
        ]
    }

    /// A header whose fields are each valid or not, then up to 300 payload bytes.
    fn framed() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![3 => Just(MAGIC), 1 => any::<[u8; 4]>()],
            prop_oneof![3 => Just(PROTOCOL_VERSION), 1 => any::<u16>()],
            prop_oneof![3 => 1u8..=6, 1 => any::<u8>()],
            any::<u8>(),
            prop_oneof![3 => 0u32..400, 1 => any::<u32>(), 1 => Just(u32::MAX)],
            prop::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(magic, version, kind, reserved, len, payload)| {
                let mut f = Vec::with_capacity(HEADER_LEN + payload.len());
                f.extend_from_slice(&magic);
                f.extend_from_slice(&version.to_be_bytes());
                f.push(kind);
                f.push(reserved);
                f.extend_from_slice(&len.to_be_bytes());
                f.extend_from_slice(&payload);
                f
            })
    }

    /// What a reader made of some bytes, comparable between the two readers.
    fn summary(r: &Result<(FrameKind, Vec<u8>), FrameError>) -> String {
        match r {
            Ok((k, p)) => format!("ok {k} {}", p.len()),
            Err(e) => format!("err {e}"),
        }
    }

    /// The invariants every read must hold, whatever the bytes.
    fn check(bytes: &[u8], max: u32) -> Result<(), TestCaseError> {
        let mut cur = Cursor::new(bytes);
        let got = read_frame_sync(&mut cur, max);
        let header: Option<[u8; HEADER_LEN]> =
            bytes.get(..HEADER_LEN).and_then(|h| h.try_into().ok());
        match (&got, header) {
            (Ok((kind, payload)), Some(h)) => {
                let (k, len) =
                    parse_header(&h, max).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(*kind, k);
                prop_assert_eq!(payload.len(), len as usize);
                prop_assert!(payload.len() <= max as usize);
                prop_assert!(
                    payload.capacity() <= (max as usize).max(1),
                    "capacity {}",
                    payload.capacity()
                );
                prop_assert_eq!(&payload[..], &bytes[HEADER_LEN..HEADER_LEN + len as usize]);
            }
            (Ok(_), None) => prop_assert!(false, "a frame from {} bytes", bytes.len()),
            (Err(FrameError::Closed), _) => {
                // Only when the bytes ran out: a short header, or a short payload.
                if let Some(h) = header {
                    let (_, len) =
                        parse_header(&h, max).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(bytes.len() < HEADER_LEN + len as usize);
                }
            }
            (Err(FrameError::TooLarge { len, max: m }), Some(_)) => {
                prop_assert!(len > m);
                // Refused from the header alone: no payload byte was read.
                prop_assert_eq!(cur.position(), HEADER_LEN as u64);
            }
            (Err(e), Some(h)) => {
                prop_assert!(parse_header(&h, max).is_err(), "{}", e);
                prop_assert_eq!(cur.position(), HEADER_LEN as u64);
            }
            (Err(e), None) => prop_assert!(false, "{} from a short header", e),
        }
        // The leader's async reader agrees with the worker's blocking one.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut rd = bytes;
        let async_got = rt.block_on(read_frame_async(&mut rd, max));
        prop_assert_eq!(summary(&got), summary(&async_got));
        Ok(())
    }

    /// Every payload decoder the transport runs on received bytes: Ok or Err, never a panic.
    fn decode_all(payload: &[u8]) {
        let _ = serde_json::from_slice::<HandshakeHello>(payload);
        let _ = serde_json::from_slice::<Welcome>(payload);
        let _ = serde_json::from_slice::<Refusal>(payload);
        let _ = serde_json::from_slice::<WorkerMessage>(payload);
        let _ = serde_json::from_slice::<LeaderMessage>(payload);
        let mut d = CompletionsDecoder::default();
        if let Ok(list) = d.decode(payload) {
            for c in &list {
                assert!(c.failed_dst_blocks.len() <= payload.len() / BLOCK_LEN);
            }
        }
    }

    fn valid_payloads() -> Vec<Vec<u8>> {
        let msgs: Vec<Vec<u8>> = vec![
            serde_json::to_vec(&WorkerMessage::Completed(vec![Completion {
                op: crate::connector::metadata::OperationId(7),
                failed_dst_blocks: vec![1, 2],
                error: Some("why".into()),
            }])),
            serde_json::to_vec(&WorkerMessage::Ready),
            serde_json::to_vec(&LeaderMessage::Allocate(TierCounts {
                num_host_blocks: 8,
                num_disk_blocks: 0,
                num_device_blocks: 32,
            })),
            serde_json::to_vec(&LeaderMessage::Finish(FinishWork {
                after_iteration: 3,
                metadata: vec![1, 2, 255],
            })),
            serde_json::to_vec(&HandshakeHello {
                rank: 1,
                world_size: 2,
                token: Some("t".into()),
            }),
            serde_json::to_vec(&Welcome {
                rank: 1,
                world_size: 2,
                heartbeat_ms: 1000,
                heartbeat_timeout_ms: 10_000,
            }),
        ]
        .into_iter()
        .flatten()
        .collect();
        msgs
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_are_a_frame_or_a_typed_error(
            bytes in prop::collection::vec(any::<u8>(), 0..400),
            max in limit(),
        ) {
            check(&bytes, max)?;
        }

        #[test]
        fn arbitrary_headers_are_a_frame_or_a_typed_error(bytes in framed(), max in limit()) {
            check(&bytes, max)?;
            if bytes.len() > HEADER_LEN {
                decode_all(&bytes[HEADER_LEN..]);
            }
        }

        #[test]
        fn completions_round_trip_at_any_bound(
            list in prop::collection::vec(
                (any::<u64>(), prop::collection::vec(0usize..1 << 40, 0..60), prop::option::of("[a-zé]{0,300}")),
                0..40,
            ),
            max in MIN_COMPLETIONS_PAYLOAD..2048,
        ) {
            let list: Vec<Completion> = list
                .into_iter()
                .map(|(op, failed_dst_blocks, error)| Completion {
                    op: crate::connector::metadata::OperationId(op),
                    failed_dst_blocks,
                    error,
                })
                .collect();
            let frames = encode_completions(&list, max).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut d = CompletionsDecoder::default();
            let mut got = Vec::new();
            for f in &frames {
                prop_assert!(f.len() - HEADER_LEN <= max as usize);
                check(f, max)?;
                got.extend(d.decode(&f[HEADER_LEN..]).map_err(TestCaseError::fail)?);
            }
            prop_assert_eq!(got.len(), list.len());
            for (g, want) in got.iter().zip(&list) {
                prop_assert_eq!(g.op, want.op);
                prop_assert_eq!(&g.failed_dst_blocks, &want.failed_dst_blocks);
                prop_assert_eq!(g.error.is_some(), want.error.is_some());
            }
        }

        #[test]
        fn mutated_payloads_decode_or_fail_cleanly(
            which in any::<prop::sample::Index>(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
        ) {
            let payloads = valid_payloads();
            let mut p = payloads[which.index(payloads.len())].clone();
            for (at, byte, op) in edits {
                match op {
                    0 if !p.is_empty() => { let i = at.index(p.len()); p[i] = byte; }
                    1 => { let i = at.index(p.len() + 1); p.insert(i, byte); }
                    _ if !p.is_empty() => { let i = at.index(p.len()); p.truncate(i); }
                    _ => {}
                }
            }
            decode_all(&p);
            // And framed, through the reader.
            let frame = encode_frame(FrameKind::Msg, &p).map_err(|e| TestCaseError::fail(e.to_string()))?;
            check(&frame, MAX_PAYLOAD)?;
        }
    }
}
