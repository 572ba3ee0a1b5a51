//! Keys and values of the Redis tier: what is stored under which name, and how a read value is
//! verified before one byte of it is served.
//!
//! Key: `kvbm:{<fingerprint>:<block key, 32 hex>}:<rank>`. The braces are a Redis Cluster hash
//! tag: every rank's share of one block hashes to the same slot (so one `EXISTS` with all ranks'
//! keys answers whether the block is complete), while different blocks spread over the slots and
//! so over the cluster's nodes.
//!
//! Value: a 64-byte header, then a 32-byte HMAC-SHA256 when the writer had a secret, then the
//! payload (one rank's share of the block). Header, little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `KVBR` |
//! | 4..6 | version (1) |
//! | 6..8 | flags (bit 0: a MAC follows the header) |
//! | 8..24 | block key (u128) |
//! | 24..40 | scope fingerprint (16 bytes) |
//! | 40..44 | rank |
//! | 44..48 | world size |
//! | 48..56 | payload length |
//! | 56..64 | xxh3-64 of the payload |
//!
//! The MAC covers the header and the payload, keyed by the deployment secret.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::connector::remote::{RemoteRead, RemoteScope};

/// Header bytes.
pub const HEADER_BYTES: usize = 64;
/// MAC bytes (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
const MAGIC: &[u8; 4] = b"KVBR";
const VERSION: u16 = 1;
const FLAG_MAC: u16 = 1;

type HmacSha256 = Hmac<Sha256>;

/// A value's header and MAC ([`Codec::head`]).
#[derive(Debug, Clone, Copy)]
pub struct Head {
    bytes: [u8; HEADER_BYTES + MAC_BYTES],
    len: usize,
}

impl Head {
    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Encodes and verifies one scope's values.
#[derive(Clone)]
pub struct Codec {
    fingerprint: [u8; 16],
    fingerprint_hex: String,
    world_size: u32,
    payload: usize,
    mac: Option<HmacSha256>,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec")
            .field("fingerprint", &self.fingerprint_hex)
            .field("payload", &self.payload)
            .field("mac", &self.mac.is_some())
            .finish()
    }
}

impl Codec {
    /// The codec of `scope`, authenticating with `secret` when given (an empty secret is none).
    pub fn new(scope: &RemoteScope, secret: Option<&[u8]>) -> crate::Result<Self> {
        let mut fingerprint = [0u8; 16];
        // The scope's fingerprint is hex; any text works, hashed down to 16 bytes when it is not
        // 32 hex digits.
        let hex = scope.fingerprint.as_bytes();
        let parsed = (hex.len() == 32)
            .then(|| {
                (0..16).try_for_each(|i| {
                    let s = std::str::from_utf8(&hex[2 * i..2 * i + 2]).ok()?;
                    fingerprint[i] = u8::from_str_radix(s, 16).ok()?;
                    Some(())
                })
            })
            .flatten();
        if parsed.is_none() {
            use sha2::Digest;
            fingerprint.copy_from_slice(&Sha256::digest(hex)[..16]);
        }
        let world_size = u32::try_from(scope.world_size).map_err(|_| {
            crate::Error::invalid_argument(format!("world size {} too large", scope.world_size))
        })?;
        let mac = match secret.filter(|s| !s.is_empty()) {
            Some(s) => Some(HmacSha256::new_from_slice(s).map_err(|e| {
                crate::Error::invalid_argument(format!("the remote secret cannot key HMAC: {e}"))
            })?),
            None => None,
        };
        Ok(Self {
            fingerprint,
            fingerprint_hex: fingerprint.iter().map(|b| format!("{b:02x}")).collect(),
            world_size,
            payload: scope.bytes_per_block,
            mac,
        })
    }

    /// Whether values are authenticated.
    pub fn has_secret(&self) -> bool {
        self.mac.is_some()
    }

    /// The Redis key of `key`'s share of `rank`.
    pub fn key(&self, key: u128, rank: usize) -> String {
        format!("kvbm:{{{}:{key:032x}}}:{rank}", self.fingerprint_hex)
    }

    /// The longest valid value (header, MAC, payload): reads ask for one byte more, so that a
    /// longer value shows as such without the whole of it crossing the wire.
    pub fn max_value_len(&self) -> usize {
        HEADER_BYTES + MAC_BYTES + self.payload
    }

    /// The value storing `payload` as `key`'s share of `rank`.
    pub fn encode(&self, key: u128, rank: usize, payload: &[u8]) -> Vec<u8> {
        let head = self.head(key, rank, payload);
        let mut v = Vec::with_capacity(head.as_slice().len() + payload.len());
        v.extend_from_slice(head.as_slice());
        v.extend_from_slice(payload);
        v
    }

    /// What precedes `payload` in its value (header, and MAC with a secret): the value is
    /// `head ‖ payload`, written as one argument without copying the payload first.
    pub fn head(&self, key: u128, rank: usize, payload: &[u8]) -> Head {
        let mut h = Head {
            bytes: [0u8; HEADER_BYTES + MAC_BYTES],
            len: HEADER_BYTES,
        };
        let b = &mut h.bytes;
        b[0..4].copy_from_slice(MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.mac.is_some() { FLAG_MAC } else { 0 };
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        b[8..24].copy_from_slice(&key.to_le_bytes());
        b[24..40].copy_from_slice(&self.fingerprint);
        b[40..44].copy_from_slice(&(rank as u32).to_le_bytes());
        b[44..48].copy_from_slice(&self.world_size.to_le_bytes());
        b[48..56].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        b[56..64].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
        if let Some(mac) = &self.mac {
            let mut m = mac.clone();
            m.update(&b[..HEADER_BYTES]);
            m.update(payload);
            b[HEADER_BYTES..].copy_from_slice(&m.finalize().into_bytes());
            h.len = HEADER_BYTES + MAC_BYTES;
        }
        h
    }

    /// Verifies `value` as `key`'s share of `rank` and copies its payload into `dst` (exactly
    /// the payload's length). `dst` is written only when the value is valid.
    pub fn decode_into(&self, key: u128, rank: usize, value: &[u8], dst: &mut [u8]) -> RemoteRead {
        match self.verify(key, rank, value) {
            Ok(payload) => {
                if dst.len() != payload.len() {
                    return RemoteRead::Invalid(format!(
                        "destination holds {} bytes, the payload {}",
                        dst.len(),
                        payload.len()
                    ));
                }
                dst.copy_from_slice(payload);
                RemoteRead::Hit
            }
            Err(why) => RemoteRead::Invalid(why),
        }
    }

    /// The payload of a valid value, or why it is not.
    pub fn verify<'a>(&self, key: u128, rank: usize, value: &'a [u8]) -> Result<&'a [u8], String> {
        if value.len() < HEADER_BYTES {
            return Err(format!(
                "truncated: {} bytes, shorter than the {HEADER_BYTES}-byte header",
                value.len()
            ));
        }
        let flags = self.check_header(key, rank, value)?;
        let has_mac = flags & FLAG_MAC != 0;
        let start = HEADER_BYTES + if has_mac { MAC_BYTES } else { 0 };
        let want = start + self.payload;
        if value.len() < want {
            return Err(format!("truncated: {} bytes, expected {want}", value.len()));
        }
        if value.len() > want {
            return Err(format!("longer than expected: more than {want} bytes"));
        }
        let payload = &value[start..];
        self.check_mac(value, start, has_mac)?;
        if xxhash_rust::xxh3::xxh3_64(payload) != u64_le(value, 56) {
            return Err("payload checksum does not match".into());
        }
        Ok(payload)
    }

    /// Checks the fixed header of `value` (at least [`HEADER_BYTES`] long) against `key`'s share
    /// of `rank` in this scope, in order: magic, version, flags, key, fingerprint, rank, world
    /// size, payload length. Returns the flags.
    fn check_header(&self, key: u128, rank: usize, value: &[u8]) -> Result<u16, String> {
        if &value[0..4] != MAGIC {
            return Err("not a kvbm block value (bad magic)".into());
        }
        let version = u16_le(value, 4);
        if version != VERSION {
            return Err(format!(
                "value format version {version}, expected {VERSION}"
            ));
        }
        let flags = u16_le(value, 6);
        if flags & !FLAG_MAC != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        let mut k = [0u8; 16];
        k.copy_from_slice(&value[8..24]);
        let stored_key = u128::from_le_bytes(k);
        if stored_key != key {
            return Err(format!(
                "holds block key {stored_key:032x}, expected {key:032x}"
            ));
        }
        if value[24..40] != self.fingerprint {
            return Err("written for another scope (fingerprint differs)".into());
        }
        let stored_rank = u32_le(value, 40);
        if stored_rank as usize != rank {
            return Err(format!(
                "holds rank {stored_rank}'s share, expected rank {rank}"
            ));
        }
        let stored_world = u32_le(value, 44);
        if stored_world != self.world_size {
            return Err(format!(
                "written with world size {stored_world}, expected {}",
                self.world_size
            ));
        }
        let len = u64_le(value, 48);
        if len != self.payload as u64 {
            return Err(format!(
                "header says {len} payload bytes, expected {}",
                self.payload
            ));
        }
        Ok(flags)
    }

    /// With a secret, the value's MAC (between the header and the payload at `start`) over the
    /// header and the payload: refused when missing or different. Without one, nothing.
    fn check_mac(&self, value: &[u8], start: usize, has_mac: bool) -> Result<(), String> {
        if let Some(mac) = &self.mac {
            if !has_mac {
                return Err("no MAC, and this deployment has a secret".into());
            }
            let mut m = mac.clone();
            m.update(&value[..HEADER_BYTES]);
            m.update(&value[start..]);
            if m.verify_slice(&value[HEADER_BYTES..start]).is_err() {
                return Err("MAC does not match (wrong secret, or written without it)".into());
            }
        }
        Ok(())
    }
}

/// The little-endian `u16` at `value[i..i + 2]`.
fn u16_le(value: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([value[i], value[i + 1]])
}

/// The little-endian `u32` at `value[i..i + 4]`.
fn u32_le(value: &[u8], i: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&value[i..i + 4]);
    u32::from_le_bytes(b)
}

/// The little-endian `u64` at `value[i..i + 8]`.
fn u64_le(value: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&value[i..i + 8]);
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::HashAlgorithm;

    fn scope(ws: usize, bytes: usize) -> RemoteScope {
        RemoteScope::new("test", 16, ws, bytes, HashAlgorithm::default()).unwrap()
    }

    #[test]
    fn round_trip_and_every_check() {
        let s = scope(2, 100);
        let payload: Vec<u8> = (0..100u8).collect();
        for secret in [None, Some(&b"s3cret"[..])] {
            let c = Codec::new(&s, secret).unwrap();
            let v = c.encode(7, 1, &payload);
            assert_eq!(c.verify(7, 1, &v).unwrap(), &payload[..]);
            let mut dst = vec![0u8; 100];
            assert_eq!(c.decode_into(7, 1, &v, &mut dst), RemoteRead::Hit);
            assert_eq!(dst, payload);

            let invalid = |v: &[u8], key: u128, rank: usize| c.verify(key, rank, v).unwrap_err();
            assert!(invalid(&v, 8, 1).contains("block key"));
            assert!(invalid(&v, 7, 0).contains("rank"));
            assert!(invalid(&v[..10], 7, 1).contains("truncated"));
            assert!(invalid(&v[..v.len() - 1], 7, 1).contains("truncated"));
            let mut longer = v.clone();
            longer.push(0);
            assert!(invalid(&longer, 7, 1).contains("longer"));
            let mut flipped = v.clone();
            *flipped.last_mut().unwrap() ^= 1;
            let why = invalid(&flipped, 7, 1);
            assert!(
                why.contains(if secret.is_some() { "MAC" } else { "checksum" }),
                "{why}"
            );
            let mut magic = v.clone();
            magic[0] = b'X';
            assert!(invalid(&magic, 7, 1).contains("magic"));
            // Another scope (other dims) never matches.
            let other = Codec::new(&scope(2, 101), secret).unwrap();
            assert!(other.verify(7, 1, &other.encode(7, 1, &[0; 101])).is_ok());
            assert!(invalid(&other.encode(7, 1, &[0; 101]), 7, 1).contains("fingerprint"));
        }
        // A value without a MAC where a secret is configured, or with another secret.
        let plain = Codec::new(&s, None).unwrap().encode(7, 1, &payload);
        let keyed = Codec::new(&s, Some(b"a")).unwrap();
        assert!(keyed.verify(7, 1, &plain).unwrap_err().contains("no MAC"));
        let other = Codec::new(&s, Some(b"b")).unwrap().encode(7, 1, &payload);
        assert!(keyed
            .verify(7, 1, &other)
            .unwrap_err()
            .contains("MAC does not match"));
        // A forger without the secret who also fixes the checksum still fails the MAC.
        let mut forged = keyed.encode(7, 1, &payload);
        let n = forged.len();
        forged[n - 1] ^= 1;
        let sum = xxhash_rust::xxh3::xxh3_64(&forged[HEADER_BYTES + MAC_BYTES..]);
        forged[56..64].copy_from_slice(&sum.to_le_bytes());
        assert!(keyed.verify(7, 1, &forged).unwrap_err().contains("MAC"));
    }

    #[test]
    fn keys_share_a_hash_tag_per_block() {
        let c = Codec::new(&scope(4, 8), None).unwrap();
        let k0 = c.key(0xabc, 0);
        let k3 = c.key(0xabc, 3);
        let tag = |k: &str| k[k.find('{').unwrap()..=k.find('}').unwrap()].to_string();
        assert_eq!(tag(&k0), tag(&k3));
        assert_ne!(tag(&k0), tag(&c.key(0xabd, 0)));
        assert!(k0.ends_with(":0") && k3.ends_with(":3"));
        assert_eq!(c.max_value_len(), HEADER_BYTES + MAC_BYTES + 8);
    }
}
