//! Host memory copies for the transfer engine: ordinary stores for small transfers, streaming
//! (non-temporal) stores for large ones.
//!
//! Why: a copy with ordinary stores first reads every destination cache line into the cache (to
//! own it), then writes it back: three memory transfers per byte copied. Streaming stores write
//! whole lines straight to memory: two. A plain `memcpy` makes that choice from the size of the
//! one call (glibc switches to streaming stores above a fraction of the last-level cache); the
//! transfer engine copies block by block (2 MiB or less per call, far below that size), so a
//! 1 GiB transfer ran entirely on ordinary stores while one `memcpy` of the same gigabyte
//! streamed: 0.49–0.62 of memcpy. The engine therefore decides from the size of the whole
//! transfer ([`STREAM_MIN_BYTES`]) and copies each run itself.
//!
//! Streaming stores are used on x86-64 only (SSE2 is part of that architecture, so no run-time
//! detection is needed); elsewhere every copy is an ordinary one. A streaming copy ends with a
//! store fence, so the bytes are ordered before whatever publishes them (the block's lock).

use std::io::{IoSlice, IoSliceMut};

/// Transfers of at least this many bytes are copied with streaming stores; smaller ones with
/// ordinary stores, so a small transfer's destination (which fits in a core's private cache on
/// current server parts, 1–2 MiB) stays cached for whoever reads it next.
pub(crate) const STREAM_MIN_BYTES: usize = 4 << 20;

/// Runs shorter than this are copied with ordinary stores even in a streaming copy: a few cache
/// lines gain nothing from bypassing the cache.
const STREAM_MIN_RUN: usize = 256;

/// Copies between two segment lists that describe the same canonical image (same total length),
/// cutting at whichever boundary comes first; with streaming stores when `stream` (see the
/// [module docs](self)).
pub(crate) fn copy_segments(src: &[IoSlice<'_>], dst: &mut [IoSliceMut<'_>], stream: bool) {
    let (mut si, mut so, mut di, mut doff) = (0usize, 0usize, 0usize, 0usize);
    let mut streamed = false;
    while si < src.len() && di < dst.len() {
        let s = &src[si][so..];
        let d = &mut dst[di][doff..];
        let n = s.len().min(d.len());
        if stream && n >= STREAM_MIN_RUN {
            stream_copy(&mut d[..n], &s[..n]);
            streamed = true;
        } else {
            d[..n].copy_from_slice(&s[..n]);
        }
        so += n;
        doff += n;
        if so == src[si].len() {
            si += 1;
            so = 0;
        }
        if doff == dst[di].len() {
            di += 1;
            doff = 0;
        }
    }
    if streamed {
        store_fence();
    }
}

/// `dst.copy_from_slice(src)` with streaming stores where the platform has them. The caller
/// issues [`store_fence`] before publishing the bytes. `dst` and `src` have the same length.
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let n = dst.len().min(src.len());
        // Ordinary copy up to the first 64-byte boundary of the destination; the streaming loop
        // then writes whole cache lines only.
        let head = dst.as_ptr().align_offset(64).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (n - head) & !63;
        // SAFETY: `dst[head..head + body]` and `src[head..head + body]` are in bounds (body <=
        // n - head), do not overlap (`&mut` and `&` borrows), and dst + head is 64-byte aligned.
        unsafe { x86::stream_lines(dst.as_mut_ptr().add(head), src.as_ptr().add(head), body) };
        let tail = head + body;
        dst[tail..n].copy_from_slice(&src[tail..n]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders earlier streaming stores before later stores (a no-op where none are used).
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64; `sfence` has no other requirement.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};

    const PAGE: usize = 4096;
    const LINE: usize = 64;

    /// One 64-byte line from `src` (any alignment) to `dst` (64-byte aligned), streaming.
    ///
    /// # Safety
    /// 64 bytes readable at `src`, writable at `dst`, `dst` 16-byte aligned; SSE2 (x86-64).
    #[inline(always)]
    unsafe fn line(dst: *mut u8, src: *const u8) {
        let s = src.cast::<__m128i>();
        let d = dst.cast::<__m128i>();
        // SAFETY: the caller's contract: four 16-byte loads inside the 64 readable bytes at
        // `src` (unaligned loads), four 16-byte streaming stores to 16-byte aligned addresses
        // inside the 64 writable bytes at `dst`.
        unsafe {
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
    }

    /// Copies `len` bytes (a multiple of 64) with streaming stores: four pages at a time, one
    /// line of each in turn (four sequential read and write streams keep more memory requests in
    /// flight than one), then line by line.
    ///
    /// # Safety
    /// `len` bytes readable at `src` and writable at `dst`, not overlapping; `dst` 64-byte
    /// aligned; `len % 64 == 0`.
    pub(super) unsafe fn stream_lines(dst: *mut u8, src: *const u8, len: usize) {
        let mut done = 0;
        // SAFETY: every line copied starts at `done + k * PAGE + off` with that sum + 64 <= len
        // (the loops' bounds), so it lies inside the caller's `len` bytes; `dst + that` stays
        // 64-byte aligned (PAGE, LINE and `done` are multiples of 64).
        unsafe {
            while done + 4 * PAGE <= len {
                let (d, s) = (dst.add(done), src.add(done));
                let mut off = 0;
                while off < PAGE {
                    line(d.add(off), s.add(off));
                    line(d.add(PAGE + off), s.add(PAGE + off));
                    line(d.add(2 * PAGE + off), s.add(2 * PAGE + off));
                    line(d.add(3 * PAGE + off), s.add(3 * PAGE + off));
                    off += LINE;
                }
                done += 4 * PAGE;
            }
            while done < len {
                line(dst.add(done), src.add(done));
                done += LINE;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(131) ^ (i >> 8)) as u8 ^ seed)
            .collect()
    }

    /// Every length around the loop boundaries, at every alignment of either side: the
    /// streaming copy writes exactly the source's bytes and nothing outside the destination.
    #[test]
    fn stream_copy_matches_at_every_length_and_alignment() {
        let lens = [
            0,
            1,
            63,
            64,
            65,
            255,
            256,
            4095,
            4096,
            16383,
            16384,
            16385,
            16384 + 4096 + 64 + 7,
            3 * 16384 + 100,
        ];
        for &n in &lens {
            for src_off in [0usize, 1, 16, 63] {
                for dst_off in [0usize, 1, 8, 33, 64] {
                    let src = pattern(n + src_off, 1);
                    let mut dst = vec![0xEEu8; n + dst_off + 64];
                    stream_copy(&mut dst[dst_off..dst_off + n], &src[src_off..src_off + n]);
                    store_fence();
                    assert_eq!(
                        &dst[dst_off..dst_off + n],
                        &src[src_off..src_off + n],
                        "n {n} src+{src_off} dst+{dst_off}"
                    );
                    assert!(dst[..dst_off].iter().all(|&b| b == 0xEE), "wrote before");
                    assert!(dst[dst_off + n..].iter().all(|&b| b == 0xEE), "wrote after");
                }
            }
        }
    }

    /// Segment lists cut at different places: both copies give the joined source image.
    #[test]
    fn copy_segments_streaming_and_plain_agree_across_boundaries() {
        let a = pattern(70_000, 3);
        let b = pattern(300, 4);
        let c = pattern(33_000, 5);
        let src = [IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&c)];
        let want: Vec<u8> = a.iter().chain(&b).chain(&c).copied().collect();
        for stream in [false, true] {
            let mut x = vec![0u8; 17];
            let mut y = vec![0u8; 50_000];
            let mut z = vec![0u8; want.len() - 50_017];
            {
                let mut dst = [
                    IoSliceMut::new(&mut x),
                    IoSliceMut::new(&mut y),
                    IoSliceMut::new(&mut z),
                ];
                copy_segments(&src, &mut dst, stream);
            }
            let got: Vec<u8> = x.iter().chain(&y).chain(&z).copied().collect();
            assert_eq!(got, want, "stream {stream}");
        }
    }
}
