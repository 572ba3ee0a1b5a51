//! Host memory copies for the transfer engine: ordinary stores for small transfers; for large
//! ones, whichever of ordinary stores and two streaming-store loops is fastest on this machine,
//! by measurement.
//!
//! Why streaming: a copy with ordinary stores first reads every destination cache line into the
//! cache (to own it), then writes it back: three memory transfers per byte copied. Streaming
//! (non-temporal) stores write whole lines straight to memory: two. A plain `memcpy` makes that
//! choice from the size of the one call; the transfer engine copies block by block (2 MiB or
//! less per call), so on an Intel Xeon a 1 GiB transfer ran entirely on ordinary stores while one
//! `memcpy` of the same gigabyte streamed: 0.49–0.62 of memcpy, and streaming stores to four
//! pages in turn brought it to ~1.0. On an AMD EPYC without AVX-512 that loop ran at 0.22–0.42 of
//! memcpy (its `rep movsb` is 3–4× faster there); on an AMD EPYC of family 26 the four-page loop
//! ran at 13 GB/s, memcpy at 19 and streaming stores one line after the other at 27. No vendor or
//! feature flag predicts it, so the choice is measured ([`calibrate`]): the first transfer of at
//! least [`STREAM_MIN_BYTES`] in a process starts a short calibration on a thread of its own
//! (16 MiB copied seven times per method, caches flushed before each copy; tens of
//! milliseconds), and until it ends large transfers use ordinary stores. A process that never
//! makes a large transfer never calibrates (on two cores, 0.1 s of one is a cost the engine
//! feels). `transfer.copy_method` (`KVBM_COPY_METHOD`) forces one method.
//!
//! The engine decides from the size of the whole transfer ([`STREAM_MIN_BYTES`]), not the block,
//! and copies each run itself. Streaming stores exist on x86-64 only (SSE2 is part of that
//! architecture, so no run-time detection is needed); elsewhere every copy is an ordinary one
//! and nothing is calibrated. A streaming copy ends with a store fence, so the bytes are ordered
//! before whatever publishes them (the block's lock).

use std::io::{IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Transfers of at least this many bytes are copied with the calibrated method ([`calibrate`]);
/// smaller ones always with ordinary stores, so a small transfer's destination (which fits in a
/// core's private cache on current server parts, 1–2 MiB) stays cached for whoever reads it next.
pub const STREAM_MIN_BYTES: usize = 4 << 20;

/// Runs shorter than this are copied with ordinary stores even in a streaming copy: a few cache
/// lines gain nothing from bypassing the cache.
const STREAM_MIN_RUN: usize = 256;

/// How a copy stores its bytes.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case", ascii_case_insensitive)]
pub enum CopyMethod {
    /// Ordinary stores: `memcpy` of each run (glibc picks its own loop, `rep movsb` included).
    Plain,
    /// Streaming (non-temporal) stores, one cache line after the other, then a store fence
    /// (x86-64; elsewhere the same as [`CopyMethod::Plain`]).
    Stream,
    /// Streaming stores to four pages in turn (one line of each, then the next line of each):
    /// four sequential streams instead of one. Faster than [`CopyMethod::Stream`] on some CPUs,
    /// half as fast on others (an AMD EPYC of family 26: 13 against 27 GB/s).
    StreamPages,
}

/// Which method large transfers use (`transfer.copy_method`, `KVBM_COPY_METHOD`).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case", ascii_case_insensitive)]
pub enum CopyPolicy {
    /// The faster method on this machine, as measured by [`calibrate`] (ordinary stores until
    /// the calibration has ended). The default.
    #[default]
    Auto,
    /// Always ordinary stores.
    Plain,
    /// Always streaming stores, one line after the other, for transfers of at least
    /// [`STREAM_MIN_BYTES`].
    Stream,
    /// Always streaming stores to four pages in turn, for transfers of at least
    /// [`STREAM_MIN_BYTES`].
    StreamPages,
}

/// What the calibration measured and chose.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyCalibration {
    /// The method large transfers use under [`CopyPolicy::Auto`].
    pub method: CopyMethod,
    /// Bandwidth of ordinary stores, bytes per second, in the fastest of the timed copies (0
    /// where nothing was measured).
    pub plain_bytes_per_sec: f64,
    /// The same for streaming stores, one line after the other.
    pub stream_bytes_per_sec: f64,
    /// The same for streaming stores to four pages in turn.
    pub stream_pages_bytes_per_sec: f64,
    /// Bytes of one timed copy.
    pub bytes: usize,
    /// How long the calibration took (allocation and cache flushes included).
    pub elapsed: Duration,
}

/// Bytes of one calibration copy: large enough that run overheads vanish, small enough to take
/// about a millisecond; both buffers are flushed from the caches before each timed copy, so it
/// measures memory, not cache, whatever the last-level cache's size.
const CAL_BYTES: usize = 16 << 20;
/// Runs per calibration copy: a 2 MiB block, the transfer engine's common run.
const CAL_RUN: usize = 2 << 20;
/// Timed copies per method (in rotating order, so a noisy neighbour hits every method alike).
/// Each method's figure is its fastest copy: interference only ever slows a copy down, so the
/// fastest is the one least disturbed (with the median, one busy moment on a loaded host chose
/// streaming stores where ordinary ones were 1.2× faster).
const CAL_ROUNDS: usize = 7;
/// Streaming stores are chosen only when at least this much faster than ordinary ones: on a
/// tie, ordinary stores keep the destination cached for its next reader.
const CAL_STREAM_MARGIN: f64 = 1.03;

static CALIBRATION: OnceLock<CopyCalibration> = OnceLock::new();
static CALIBRATION_STARTED: AtomicBool = AtomicBool::new(false);

/// The calibration's result, measuring it on the calling thread if no other thread has yet
/// (a thread that comes while one measures waits for it). Runs once per process.
pub fn calibrate() -> &'static CopyCalibration {
    CALIBRATION.get_or_init(measure)
}

/// The calibration's result once it has ended; `None` before (the first large transfer starts
/// it in the background; [`calibrate`] runs it on the calling thread).
pub fn calibration() -> Option<&'static CopyCalibration> {
    CALIBRATION.get()
}

/// Starts the calibration on a thread of its own, once per process; returns at once. Where no
/// thread can be started, large transfers keep ordinary stores.
pub(crate) fn start_calibration() {
    if CALIBRATION.get().is_some() || CALIBRATION_STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("kvbm-copy-calibration".into())
        .spawn(|| {
            let c = calibrate();
            tracing::info!(
                method = %c.method,
                plain_gbps = c.plain_bytes_per_sec / 1e9,
                stream_gbps = c.stream_bytes_per_sec / 1e9,
                elapsed_ms = c.elapsed.as_secs_f64() * 1e3,
                "kvbm copy method calibrated for transfers of at least 4 MiB"
            );
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the copy calibration; large transfers use ordinary stores");
    }
}

/// The method a transfer of `bytes` bytes uses under `policy`.
pub fn method_for(bytes: usize, policy: CopyPolicy) -> CopyMethod {
    if bytes < STREAM_MIN_BYTES {
        return CopyMethod::Plain;
    }
    match policy {
        CopyPolicy::Plain => CopyMethod::Plain,
        CopyPolicy::Stream => CopyMethod::Stream,
        CopyPolicy::StreamPages => CopyMethod::StreamPages,
        CopyPolicy::Auto => match calibration() {
            Some(c) => c.method,
            None => {
                start_calibration();
                CopyMethod::Plain
            }
        },
    }
}

#[cfg(target_arch = "x86_64")]
fn measure() -> CopyCalibration {
    let start = Instant::now();
    let src: Vec<u8> = (0..CAL_BYTES).map(|i| (i as u8) ^ 0x5a).collect();
    let mut dst = vec![1u8; CAL_BYTES];
    let run = |dst: &mut [u8], method: CopyMethod| {
        let began = Instant::now();
        for (d, s) in dst.chunks_mut(CAL_RUN).zip(src.chunks(CAL_RUN)) {
            copy_segments(&[IoSlice::new(s)], &mut [IoSliceMut::new(d)], method);
        }
        began.elapsed()
    };
    const METHODS: [CopyMethod; 3] = [
        CopyMethod::Plain,
        CopyMethod::Stream,
        CopyMethod::StreamPages,
    ];
    let mut best = [Duration::MAX; 3];
    for m in METHODS {
        run(&mut dst, m);
    }
    for round in 0..CAL_ROUNDS {
        // Rotate which method goes first, so none always follows the same one.
        for k in 0..METHODS.len() {
            let i = (round + k) % METHODS.len();
            flush(&src);
            flush(&dst);
            let t = run(&mut dst, METHODS[i]);
            best[i] = best[i].min(t);
        }
    }
    std::hint::black_box(&dst);
    let rate = |d: Duration| CAL_BYTES as f64 / d.as_secs_f64().max(1e-9);
    let (p, s, sp) = (rate(best[0]), rate(best[1]), rate(best[2]));
    CopyCalibration {
        method: choose(p, s, sp),
        plain_bytes_per_sec: p,
        stream_bytes_per_sec: s,
        stream_pages_bytes_per_sec: sp,
        bytes: CAL_BYTES,
        elapsed: start.elapsed(),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn measure() -> CopyCalibration {
    CopyCalibration {
        method: CopyMethod::Plain,
        plain_bytes_per_sec: 0.0,
        stream_bytes_per_sec: 0.0,
        stream_pages_bytes_per_sec: 0.0,
        bytes: 0,
        elapsed: Duration::ZERO,
    }
}

/// The method to use given the measured bandwidths (bytes per second): the faster streaming
/// loop, if it beats ordinary stores by [`CAL_STREAM_MARGIN`].
fn choose(plain: f64, stream: f64, stream_pages: f64) -> CopyMethod {
    let (method, rate) = if stream_pages > stream {
        (CopyMethod::StreamPages, stream_pages)
    } else {
        (CopyMethod::Stream, stream)
    };
    if rate > plain * CAL_STREAM_MARGIN {
        method
    } else {
        CopyMethod::Plain
    }
}

/// Writes `buf` back from every cache level and evicts it, so the next copy starts from memory.
///
/// With `clflushopt` where the CPU has it (CPUID leaf 7, EBX bit 23): `clflush` is ordered
/// against every other flush and store, one line at a time, and on an Intel Xeon (family 6 model
/// 207) it took 42 ms per 16 MiB against 0.9 ms for `clflushopt`, which made the calibration cost
/// 0.9 s of a core instead of tens of milliseconds. Both are followed by `mfence`.
#[cfg(target_arch = "x86_64")]
fn flush(buf: &[u8]) {
    if has_clflushopt() {
        for line in buf.chunks(64) {
            // SAFETY: `clflushopt` is present (CPUID above); flushing an address inside a live
            // slice writes its line back and evicts it, without changing its contents.
            unsafe {
                std::arch::asm!(
                    "clflushopt [{0}]",
                    in(reg) line.as_ptr(),
                    options(nostack, preserves_flags)
                )
            };
        }
    } else {
        for line in buf.chunks(64) {
            // SAFETY: `clflush` of an address inside a live slice has no effect on its
            // contents; SSE2 (which includes clflush) is part of x86-64.
            unsafe { std::arch::x86_64::_mm_clflush(line.as_ptr()) };
        }
    }
    // SAFETY: as above (SSE2).
    unsafe { std::arch::x86_64::_mm_mfence() };
}

/// Whether the CPU has `clflushopt` (CPUID leaf 7 sub-leaf 0, EBX bit 23).
#[cfg(target_arch = "x86_64")]
fn has_clflushopt() -> bool {
    // `cpuid` exists on every x86-64 CPU; leaf 0 says whether leaf 7 does.
    let max_leaf = std::arch::x86_64::__cpuid(0).eax;
    if max_leaf < 7 {
        return false;
    }
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    leaf7.ebx & (1 << 23) != 0
}

/// Copies between two segment lists that describe the same canonical image (same total length),
/// cutting at whichever boundary comes first, with `method`'s stores (see the
/// [module docs](self)).
pub(crate) fn copy_segments(src: &[IoSlice<'_>], dst: &mut [IoSliceMut<'_>], method: CopyMethod) {
    let stream = method != CopyMethod::Plain;
    let pages = method == CopyMethod::StreamPages;
    let (mut si, mut so, mut di, mut doff) = (0usize, 0usize, 0usize, 0usize);
    let mut streamed = false;
    while si < src.len() && di < dst.len() {
        let s = &src[si][so..];
        let d = &mut dst[di][doff..];
        let n = s.len().min(d.len());
        if stream && n >= STREAM_MIN_RUN {
            stream_copy(&mut d[..n], &s[..n], pages);
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

/// `dst.copy_from_slice(src)` with streaming stores where the platform has them (`pages`: four
/// pages in turn). The caller issues [`store_fence`] before publishing the bytes. `dst` and
/// `src` have the same length.
fn stream_copy(dst: &mut [u8], src: &[u8], pages: bool) {
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
        unsafe {
            x86::stream_lines(
                dst.as_mut_ptr().add(head),
                src.as_ptr().add(head),
                body,
                pages,
            )
        };
        let tail = head + body;
        dst[tail..n].copy_from_slice(&src[tail..n]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = pages;
        dst.copy_from_slice(src);
    }
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

    /// Copies `len` bytes (a multiple of 64) with streaming stores: line by line, or with
    /// `pages` four pages at a time, one line of each in turn (four sequential read and write
    /// streams keep more memory requests in flight than one on some CPUs), then line by line.
    ///
    /// # Safety
    /// `len` bytes readable at `src` and writable at `dst`, not overlapping; `dst` 64-byte
    /// aligned; `len % 64 == 0`.
    pub(super) unsafe fn stream_lines(dst: *mut u8, src: *const u8, len: usize, pages: bool) {
        let mut done = 0;
        // SAFETY: every line copied starts at `done + k * PAGE + off` with that sum + 64 <= len
        // (the loops' bounds), so it lies inside the caller's `len` bytes; `dst + that` stays
        // 64-byte aligned (PAGE, LINE and `done` are multiples of 64).
        unsafe {
            while pages && done + 4 * PAGE <= len {
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
                    for pages in [false, true] {
                        let src = pattern(n + src_off, 1);
                        let mut dst = vec![0xEEu8; n + dst_off + 64];
                        stream_copy(
                            &mut dst[dst_off..dst_off + n],
                            &src[src_off..src_off + n],
                            pages,
                        );
                        store_fence();
                        assert_eq!(
                            &dst[dst_off..dst_off + n],
                            &src[src_off..src_off + n],
                            "n {n} src+{src_off} dst+{dst_off} pages {pages}"
                        );
                        assert!(dst[..dst_off].iter().all(|&b| b == 0xEE), "wrote before");
                        assert!(dst[dst_off + n..].iter().all(|&b| b == 0xEE), "wrote after");
                    }
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
        for method in [
            CopyMethod::Plain,
            CopyMethod::Stream,
            CopyMethod::StreamPages,
        ] {
            let mut x = vec![0u8; 17];
            let mut y = vec![0u8; 50_000];
            let mut z = vec![0u8; want.len() - 50_017];
            {
                let mut dst = [
                    IoSliceMut::new(&mut x),
                    IoSliceMut::new(&mut y),
                    IoSliceMut::new(&mut z),
                ];
                copy_segments(&src, &mut dst, method);
            }
            let got: Vec<u8> = x.iter().chain(&y).chain(&z).copied().collect();
            assert_eq!(got, want, "{method}");
        }
    }

    /// The choice follows the measured figures, with ties (within the margin) to ordinary
    /// stores; small transfers never stream, whatever the policy; forced policies are obeyed.
    #[test]
    fn the_faster_method_is_chosen_and_small_transfers_stay_plain() {
        assert_eq!(choose(10e9, 20e9, 13e9), CopyMethod::Stream);
        assert_eq!(choose(10e9, 13e9, 20e9), CopyMethod::StreamPages);
        assert_eq!(choose(20e9, 10e9, 19e9), CopyMethod::Plain);
        assert_eq!(
            choose(10e9, 10.2e9, 10.1e9),
            CopyMethod::Plain,
            "a tie keeps ordinary stores"
        );
        for policy in [
            CopyPolicy::Auto,
            CopyPolicy::Plain,
            CopyPolicy::Stream,
            CopyPolicy::StreamPages,
        ] {
            assert_eq!(method_for(STREAM_MIN_BYTES - 1, policy), CopyMethod::Plain);
        }
        assert_eq!(
            method_for(STREAM_MIN_BYTES, CopyPolicy::Plain),
            CopyMethod::Plain
        );
        assert_eq!(
            method_for(STREAM_MIN_BYTES, CopyPolicy::Stream),
            CopyMethod::Stream
        );
        assert_eq!(
            method_for(STREAM_MIN_BYTES, CopyPolicy::StreamPages),
            CopyMethod::StreamPages
        );
        assert_eq!("Stream".parse::<CopyPolicy>(), Ok(CopyPolicy::Stream));
        assert_eq!(
            "stream-pages".parse::<CopyPolicy>(),
            Ok(CopyPolicy::StreamPages)
        );
        assert_eq!(CopyMethod::StreamPages.to_string(), "stream-pages");
        assert!("fast".parse::<CopyPolicy>().is_err());
    }

    /// The calibration measures every method (on x86-64), picks the one its own figures favour,
    /// and auto then uses that method for large transfers.
    #[test]
    fn calibration_measures_every_method_and_auto_follows_it() {
        let c = calibrate();
        #[cfg(target_arch = "x86_64")]
        {
            assert!(
                c.plain_bytes_per_sec > 0.0
                    && c.stream_bytes_per_sec > 0.0
                    && c.stream_pages_bytes_per_sec > 0.0,
                "{c:?}"
            );
            assert_eq!(
                c.method,
                choose(
                    c.plain_bytes_per_sec,
                    c.stream_bytes_per_sec,
                    c.stream_pages_bytes_per_sec
                )
            );
            assert_eq!(c.bytes, CAL_BYTES);
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(c.method, CopyMethod::Plain);
        assert_eq!(calibration(), Some(c));
        assert_eq!(method_for(1 << 30, CopyPolicy::Auto), c.method);
    }
}
