//! Copy planning: a batch of block pairs becomes the fewest copies that move exactly its bytes.
//!
//! Pure functions over addresses, tested without a GPU (`tests/cuda.rs` checks them against an
//! emulation of the copies they plan). For each pair, [`block_pieces`] cuts the device runs and the
//! host runs at every boundary of either; [`plan_copies`] then merges runs adjacent on both sides
//! into one copy (a fully contiguous cache with consecutive blocks is one copy per batch), and turns
//! a run repeated at a fixed stride over consecutive blocks (a layer-separate cache) into one
//! strided 2D copy per run instead of one copy per run per block.
//!
//! Invariant: the planned [`CopyOp`]s together move exactly the pieces' bytes, each byte once, and
//! no strided copy has a pitch below its width or above the device's limit.

use serde::Serialize;

/// Which way a batch copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Direction {
    /// Device → host (stores, offloads): the store stream.
    DeviceToHost,
    /// Host → device (loads, onboards): the load stream.
    HostToDevice,
}

/// `len` bytes of one block between device address `device` and host address `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Device address.
    pub device: u64,
    /// Host address.
    pub host: usize,
    /// Bytes.
    pub len: usize,
}

/// One copy as enqueued: `height` rows of `width` bytes, row `i` at `device + i × device_pitch`
/// and `host + i × host_pitch`. `height == 1` is a plain (1D) copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Device address of row 0.
    pub device: u64,
    /// Host address of row 0.
    pub host: usize,
    /// Bytes per row.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// Device bytes from one row to the next.
    pub device_pitch: usize,
    /// Host bytes from one row to the next.
    pub host_pitch: usize,
}

impl CopyOp {
    /// Bytes moved.
    pub fn bytes(&self) -> usize {
        self.width * self.height
    }
}

/// Cuts one block's device runs and host runs — `(address, len)` in canonical order, the same
/// total on both sides — into pieces at every boundary of either, merging pieces that are
/// adjacent on both sides.
pub fn block_pieces(device_runs: &[(u64, usize)], host_runs: &[(usize, usize)]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(device_runs.len().max(host_runs.len()));
    let (mut di, mut doff, mut hi, mut hoff) = (0usize, 0usize, 0usize, 0usize);
    while di < device_runs.len() && hi < host_runs.len() {
        let (dbase, dlen) = device_runs[di];
        let (hbase, hlen) = host_runs[hi];
        let n = (dlen - doff).min(hlen - hoff);
        if n > 0 {
            let p = Piece {
                device: dbase + doff as u64,
                host: hbase + hoff,
                len: n,
            };
            match out.last_mut() {
                Some(last)
                    if last.device + last.len as u64 == p.device
                        && last.host + last.len == p.host =>
                {
                    last.len += n
                }
                _ => out.push(p),
            }
        }
        doff += n;
        hoff += n;
        if doff == dlen {
            di += 1;
            doff = 0;
        }
        if hoff == hlen {
            hi += 1;
            hoff = 0;
        }
    }
    out
}

/// Per-piece (device, host) strides from block `a` to block `b`, if every piece of `b` is the
/// matching piece of `a` moved forward by a stride that keeps rows apart and fits `max_pitch`.
fn strides(a: &[Piece], b: &[Piece], max_pitch: usize) -> Option<Vec<(usize, usize)>> {
    if a.len() != b.len() || a.is_empty() {
        return None;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.len != y.len {
                return None;
            }
            let dp = usize::try_from(y.device.checked_sub(x.device)?).ok()?;
            let hp = y.host.checked_sub(x.host)?;
            let back_to_back = dp == x.len && hp == x.len;
            let strided = dp >= x.len && hp >= x.len && dp <= max_pitch && hp <= max_pitch;
            (back_to_back || strided).then_some((dp, hp))
        })
        .collect()
}

fn push_op(ops: &mut Vec<CopyOp>, op: CopyOp) {
    let op = if op.height > 1 && op.device_pitch == op.width && op.host_pitch == op.width {
        let bytes = op.width * op.height;
        CopyOp {
            width: bytes,
            height: 1,
            device_pitch: bytes,
            host_pitch: bytes,
            ..op
        }
    } else {
        op
    };
    if op.height == 1 {
        if let Some(last) = ops.last_mut() {
            if last.height == 1
                && last.device + last.width as u64 == op.device
                && last.host + last.width == op.host
            {
                last.width += op.width;
                last.device_pitch = last.width;
                last.host_pitch = last.width;
                return;
            }
        }
    }
    ops.push(op);
}

/// Plans a batch: `blocks[i]` is pair `i`'s pieces (see [`block_pieces`]). Consecutive blocks
/// whose pieces repeat at fixed strides share one strided copy per piece; copies adjacent on both
/// sides merge. The ops together move exactly the pieces' bytes, each byte once.
pub fn plan_copies(blocks: &[Vec<Piece>], max_pitch: usize) -> Vec<CopyOp> {
    let mut ops = Vec::new();
    let mut i = 0;
    while i < blocks.len() {
        let mut j = i + 1;
        let mut group: Option<Vec<(usize, usize)>> = None;
        while j < blocks.len() {
            match strides(&blocks[j - 1], &blocks[j], max_pitch) {
                Some(s) if group.as_ref().is_none_or(|g| *g == s) => {
                    group = Some(s);
                    j += 1;
                }
                _ => break,
            }
        }
        let height = j - i;
        for (k, p) in blocks[i].iter().enumerate() {
            let (device_pitch, host_pitch) = group.as_ref().map_or((p.len, p.len), |g| g[k]);
            push_op(
                &mut ops,
                CopyOp {
                    device: p.device,
                    host: p.host,
                    width: p.len,
                    height,
                    device_pitch,
                    host_pitch,
                },
            );
        }
        i = j;
    }
    ops
}
