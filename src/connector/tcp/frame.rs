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

use crate::connector::transport::Rank;
use crate::error::{Error, Result};

/// The first four bytes of every frame.
pub(super) const MAGIC: [u8; 4] = *b"KVBM";
/// The protocol version this build speaks (bytes 4..6 of every frame, big-endian). Version 2
/// added heartbeats (the HEARTBEAT kind and the WELCOME fields announcing them).
pub(super) const PROTOCOL_VERSION: u16 = 2;
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
        assert_eq!(&f[4..6], &[0, 2]);
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
            (header(b"KVBM", 2, 9, 0), "kind 9"),
            (header(b"KVBM", 2, 0, 0), "kind 0"),
            (header(b"KVBM", 2, 4, MAX_PAYLOAD + 1), "exceeds"),
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
}
