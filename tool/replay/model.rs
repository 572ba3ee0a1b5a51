//! The model stand-in's KV: for every token, deterministic bytes that are a function of the token
//! prefix (its rolling hash), the rank, the layer, K or V — so any block's expected image can be
//! recomputed and compared with what was onboarded.

use serde::{Deserialize, Serialize};

use kvbm_connector::layout::LayoutDims;

/// The model shard of one rank, and how its KV bytes are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This rank.
    pub rank: usize,
    /// Block dimensions of this rank's shard.
    pub dims: LayoutDims,
}

impl Shard {
    /// Bytes of one token in one region (layer × K/V) of this shard.
    pub fn token_bytes(&self) -> usize {
        self.dims.inner_dim * self.dims.dtype_bytes
    }

    /// The KV of the token whose prefix hash is `h`, for run `run` (layer × outer + kv).
    pub fn kv_bytes(&self, h: u64, run: usize, out: &mut [u8]) {
        let salt = (self.rank as u64 + 1).wrapping_mul(0xd6e8_feb8_6659_fd93);
        let mut z = h ^ salt ^ ((run as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for chunk in out.chunks_mut(8) {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^= x >> 31;
            let b = x.to_le_bytes();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    /// The canonical image of a block whose tokens have prefix hashes `hashes`.
    pub fn expected_block(&self, hashes: &[u64]) -> Vec<u8> {
        let d = self.dims;
        let tb = self.token_bytes();
        let run = d.region_bytes();
        let mut img = vec![0u8; d.bytes_per_block()];
        for r in 0..d.regions_per_block() {
            for (t, &h) in hashes.iter().enumerate().take(d.page_size) {
                let at = r * run + t * tb;
                self.kv_bytes(h, r, &mut img[at..at + tb]);
            }
        }
        img
    }
}
