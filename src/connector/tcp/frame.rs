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
            prop_oneof![3 => 1u8..=5, 1 => any::<u8>()],
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
