//! Admission, scheduling and the model's sampling: which requests run this step and on which
//! device blocks.
//!
//! Admission follows arrival order: the device prefix cache first, then the connector's match,
//! then the engine's blocks (as many as its [`blocks_at_admission`] says). A request whose match
//! needs a load waits for it (`Loading`) and rejoins without a new match. Each step the running
//! requests get their tokens in admission order within the chunked-prefill budget (decodes take
//! one token each, outside the budget); out of device blocks, an engine that [`preempts`] gives up
//! its newest running request.
//!
//! [`blocks_at_admission`]: crate::replay::engines::SchedulerSide::blocks_at_admission
//! [`preempts`]: crate::replay::engines::SchedulerSide::preempts

use std::collections::VecDeque;

use kvbm_connector::error::{Error, Result};

use super::Simulator;

/// vLLM's null block (the block table's entry where a sliding window keeps no block).
pub(crate) const NULL_BLOCK: usize = 0;
use crate::replay::request::Phase;
use crate::replay::workload::{sample_token, PREFIX_HASH_SEED};

impl Simulator {
    /// Admits waiting requests in order while the batch and the device blocks allow; returns how
    /// many joined this step's batch (matched, loaded ones rejoining included).
    pub(super) fn admit(&mut self) -> Result<usize> {
        let bs = self.opts.block_size;
        let mut admitted = 0;
        let mut still = VecDeque::new();
        while let Some(i) = self.waiting.pop_front() {
            if self.running.len() >= self.opts.max_batch {
                still.push_back(i);
                continue;
            }
            let r = &self.reqs[i];
            if r.phase == Phase::Loading {
                continue;
            }
            // Loaded requests come back without a new match.
            if r.loaded {
                self.reqs[i].loaded = false;
                self.after_load_admit(i)?;
                admitted += 1;
                continue;
            }
            let n = r.tokens.len();
            // Blocks needed now: vLLM the prompt; TensorRT-LLM prompt and output (no evict).
            let need = self.sched.blocks_at_admission(r, bs);
            let groups = self.opts.n_groups();
            let found = self.device_hit(i, n.saturating_sub(1) / bs);
            let hit = found.first().map_or(0, Vec::len);
            let fresh = need.saturating_sub(hit);
            if self.pool.available() < fresh * groups {
                for f in &found {
                    self.pool.release(f, &[]);
                }
                still.push_back(i);
                // Keep arrival order: nothing behind this one is admitted this step.
                while let Some(j) = self.waiting.pop_front() {
                    still.push_back(j);
                }
                break;
            }
            let local = hit * bs;
            let Some(m) = self.connector_match(i, local)? else {
                // The connector asks to be asked again (a remote lookup is running): the
                // request keeps waiting, those behind it may go first (vLLM's skipped queue).
                for f in &found {
                    self.pool.release(f, &[]);
                }
                self.match_pending += 1;
                still.push_back(i);
                continue;
            };
            let tables = self.admission_tables(i, found, local + m.0, fresh)?;
            let r = &mut self.reqs[i];
            r.blocks = tables;
            r.report.device_hit_tokens += local;
            r.report.matched_tokens += m.0;
            r.report.matched_from.host += m.1;
            r.report.matched_from.disk += m.2;
            r.report.matched_from.remote += m.3;
            r.computed = local;
            self.connector_alloc(i, m.0)?;
            admitted += 1;
            let r = &mut self.reqs[i];
            if m.0 > 0 {
                r.phase = Phase::Loading;
                r.loading = Some((local / bs, m.0 / bs));
                self.sched.load_started(r);
            } else {
                r.phase = Phase::Running;
                self.running.push(i);
            }
        }
        self.waiting = still;
        Ok(admitted)
    }

    /// The device prefix cache's hit for request `i` (its first `blocks` blocks): the prefix
    /// every KV-cache group holds, one referenced block list per group, all as long (each group
    /// looks up its own keys; what one holds past the shortest goes back, still cached).
    fn device_hit(&mut self, i: usize, blocks: usize) -> Vec<Vec<usize>> {
        let mut found: Vec<Vec<usize>> = Vec::with_capacity(self.opts.n_groups());
        for g in 0..self.opts.n_groups() {
            let keys = self.keys(i, g, blocks);
            found.push(self.pool.lookup(&keys));
        }
        let hit = found.iter().map(Vec::len).min().unwrap_or(0);
        for (g, f) in found.iter_mut().enumerate() {
            if f.len() > hit {
                let keys = self.keys(i, g, f.len());
                self.pool.release(&f[hit..], &keys[hit..]);
                f.truncate(hit);
            }
        }
        found
    }

    /// Every group's block table at admission: its device hit `found`, then `fresh` more
    /// positions. A sliding-window group's table holds the null block before the window of the
    /// `computed` tokens it will hold once the load is in (vLLM's `SlidingWindowManager`): its
    /// local blocks there go back to the pool (still cached), and none is allocated there.
    /// The caller checked the pool has the blocks.
    fn admission_tables(
        &mut self,
        i: usize,
        found: Vec<Vec<usize>>,
        computed: usize,
        fresh: usize,
    ) -> Result<Vec<Vec<usize>>> {
        let mut tables = Vec::with_capacity(found.len());
        for (g, mut blocks) in found.into_iter().enumerate() {
            let skip = self.opts.skipped_blocks(g, computed);
            let early = skip.min(blocks.len());
            if early > 0 {
                let keys = self.keys(i, g, early);
                let gone: Vec<usize> = blocks[..early].to_vec();
                self.pool.release(&gone, &keys);
                blocks[..early].fill(NULL_BLOCK);
            }
            for k in blocks.len()..blocks.len() + fresh {
                if k < skip {
                    blocks.push(NULL_BLOCK);
                    continue;
                }
                match self.pool.alloc() {
                    Some(b) => blocks.push(b),
                    None => return Err(Error::internal("device pool ran out after checking")),
                }
            }
            tables.push(blocks);
        }
        Ok(tables)
    }

    /// A request whose load finished joins the running set (vLLM: second alloc call with 0).
    fn after_load_admit(&mut self, i: usize) -> Result<()> {
        self.sched.load_finished(&self.reqs[i], &mut self.timings)?;
        self.reqs[i].phase = Phase::Running;
        self.running.push(i);
        Ok(())
    }

    /// (external tokens, from host, from disk, from remote), or `None`: ask again later.
    fn connector_match(
        &mut self,
        i: usize,
        local: usize,
    ) -> Result<Option<(usize, usize, usize, usize)>> {
        let Some(ext) =
            self.sched
                .get_num_new_matched_tokens(&self.reqs[i], local, &mut self.timings)?
        else {
            return Ok(None);
        };
        let m = self.sched.leader().match_split();
        Ok(Some((ext, m.host_tokens, m.disk_tokens, m.remote_tokens)))
    }

    fn connector_alloc(&mut self, i: usize, external: usize) -> Result<()> {
        self.sched
            .update_state_after_alloc(&self.reqs[i], external, &mut self.timings)
    }

    /// Picks this step's (request, tokens to compute); allocates blocks on demand (vLLM, with
    /// preemption of the newest request when they run out).
    pub(super) fn schedule(&mut self) -> Result<Vec<(usize, usize)>> {
        let bs = self.opts.block_size;
        let mut budget = self.opts.chunk_tokens;
        let mut out = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            let i = self.running[k];
            self.skip_out_of_window(i);
            let r = &self.reqs[i];
            let remaining = r.tokens.len().saturating_sub(r.computed);
            if remaining == 0 {
                k += 1;
                continue;
            }
            let decoding = r.computed >= r.prompt_len;
            let n = if decoding { 1 } else { remaining.min(budget) };
            if n == 0 {
                k += 1;
                continue;
            }
            let need = (r.computed + n).div_ceil(bs);
            let computed = r.computed;
            let mut preempted_self = false;
            while self.reqs[i].table_len() < need {
                // One more block position: a block in every group (the null block in a sliding
                // group where the window has already passed it), all or none.
                let pos = self.reqs[i].table_len();
                let groups = self.opts.n_groups();
                let real: Vec<bool> = (0..groups)
                    .map(|g| pos >= self.opts.skipped_blocks(g, computed))
                    .collect();
                let wanted = real.iter().filter(|&&x| x).count();
                if self.pool.available() >= wanted {
                    for (g, &is_real) in real.iter().enumerate() {
                        let b = if is_real {
                            self.pool.alloc().ok_or_else(|| {
                                Error::internal("device pool ran out after checking")
                            })?
                        } else {
                            NULL_BLOCK
                        };
                        self.reqs[i].blocks[g].push(b);
                    }
                    continue;
                }
                // Out of blocks: vLLM preempts the newest running request. (TensorRT-LLM reserved
                // every block at admission and never gets here.)
                if !self.sched.preempts() {
                    return Err(Error::internal(
                        "TensorRT-LLM request ran out of reserved blocks",
                    ));
                }
                // The newest request the engine has already run (vLLM schedules running
                // requests before it admits waiting ones, so a request admitted this step is
                // never a victim — unless it is the one that needs the block, which then waits).
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&j| j == i || self.reqs[j].announced);
                let Some(victim) = victim else {
                    break;
                };
                self.preempt(victim)?;
                if victim == i {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            if !decoding {
                budget -= n;
            }
            out.push((i, n));
            k += 1;
        }
        Ok(out)
    }

    /// vLLM's `remove_skipped_blocks`: a running request's blocks before its window go back to
    /// the pool (cached under their keys) and the null block takes their place, in every
    /// sliding-window group.
    fn skip_out_of_window(&mut self, i: usize) {
        for g in 0..self.opts.n_groups() {
            let skip = self
                .opts
                .skipped_blocks(g, self.reqs[i].computed)
                .min(self.reqs[i].blocks[g].len());
            if skip == 0 {
                continue;
            }
            let keys = self.keys(i, g, skip);
            let blocks: Vec<usize> = self.reqs[i].blocks[g][..skip].to_vec();
            self.reqs[i].blocks[g][..skip].fill(NULL_BLOCK);
            self.release_blocks(&blocks, &keys);
        }
    }

    /// Returns `blocks` to the pool, each cached under the key at its position in `keys` (if
    /// any), leaving out the null block, and queues the freed ones to be clobbered.
    fn release_blocks(&mut self, blocks: &[usize], keys: &[u128]) {
        if !self.opts.windowed() {
            self.pool.release(blocks, keys);
            self.to_clobber.extend_from_slice(blocks);
            return;
        }
        for (k, &b) in blocks.iter().enumerate() {
            if b == NULL_BLOCK {
                continue;
            }
            self.pool
                .release(&[b], keys.get(k).map(std::slice::from_ref).unwrap_or(&[]));
            self.to_clobber.push(b);
        }
    }

    /// Returns every group's table of request `i` to the pool, its first `full` blocks cached.
    fn release_tables(&mut self, i: usize, full: usize) {
        let tables = std::mem::take(&mut self.reqs[i].blocks);
        for (g, blocks) in tables.iter().enumerate() {
            let keys = self.keys(i, g, full);
            self.release_blocks(blocks, &keys);
        }
        self.reqs[i].blocks = vec![Vec::new(); tables.len()];
    }

    fn preempt(&mut self, i: usize) -> Result<()> {
        self.running.retain(|&j| j != i);
        self.release_tables(i, self.reqs[i].computed / self.opts.block_size);
        let r = &mut self.reqs[i];
        let was_announced = r.announced;
        r.computed = 0;
        r.announced = false;
        r.phase = Phase::Waiting;
        r.report.preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(i);
        self.sched.preempted(&self.reqs[i], was_announced);
        Ok(())
    }

    /// After the forward pass: the model samples a token for every request whose tokens are all
    /// computed; finished requests leave the batch.
    pub(super) fn advance(&mut self, scheduled: &[(usize, usize)]) -> Result<()> {
        let mut finished = Vec::new();
        for &(i, n) in scheduled {
            let r = &mut self.reqs[i];
            r.computed += n;
            r.report.computed_tokens += n;
            self.progress += n as u64;
            if r.computed == r.tokens.len() {
                // The model samples the next token.
                let h = r.prefix.last().copied().unwrap_or(PREFIX_HASH_SEED);
                r.push_token(sample_token(h));
                r.generated += 1;
                r.report.output_tokens = r.generated;
                if r.first_token_us.is_none() {
                    r.first_token_us = Some(self.clock_us);
                    r.report.ttft_ms = (self.clock_us - r.arrival_clock_us) / 1000.0;
                }
                if r.generated >= r.max_tokens {
                    finished.push(i);
                }
            }
        }
        for i in finished {
            self.finish(i)?;
        }
        Ok(())
    }

    fn finish(&mut self, i: usize) -> Result<()> {
        self.running.retain(|&j| j != i);
        let held = self
            .sched
            .request_finished(&self.reqs[i], &mut self.timings)?;
        if held {
            self.reqs[i].phase = Phase::Held;
        } else {
            self.free_request_blocks(i)?;
            self.retire(i);
        }
        Ok(())
    }

    /// Returns a finished request's blocks to the pool (full computed ones stay cached).
    pub(super) fn free_request_blocks(&mut self, i: usize) -> Result<()> {
        let bs = self.opts.block_size;
        self.release_tables(i, self.reqs[i].computed / bs);
        Ok(())
    }
}
