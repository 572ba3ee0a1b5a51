//! One engine iteration through the connector and the ranks: the scheduler's metadata and the
//! model's KV go to every live rank; a request is loaded or released only once every live rank
//! reported it; every onboarded block is verified on every rank; a rank that stops answering is
//! dropped and its unconfirmed loads are recomputed.

use std::collections::HashSet;

use kvbm_connector::error::{Error, Result};

use super::{group_hash, Simulator};
use crate::replay::messages::{BlockWrite, StepCommand, StepReply, Verify};
use crate::replay::request::Phase;

impl Simulator {
    /// One engine iteration: the scheduler's metadata, then every live rank runs the step (binds
    /// it, clobbers freed blocks, loads, writes the computed KV, saves) and reports what finished.
    pub(super) fn engine_iteration(
        &mut self,
        scheduled: &[(usize, usize)],
        computed_before: &[usize],
    ) -> Result<()> {
        self.run_ranks(scheduled, computed_before, true)
    }

    /// The metadata part of an iteration: the scheduler's metadata, then every live rank binds it,
    /// clobbers freed blocks, starts its loads and, when a request computes, runs the forward pass
    /// (writes the computed KV, saves); with `report` it then reports what finished.
    pub(super) fn run_ranks(
        &mut self,
        scheduled: &[(usize, usize)],
        computed_before: &[usize],
        report: bool,
    ) -> Result<()> {
        let metadata =
            self.sched
                .build_connector_meta(&mut self.reqs, scheduled, &mut self.timings)?;
        let bs = self.opts.block_size;
        // The KV the model computes this iteration, block by block.
        let mut writes = Vec::new();
        for (&(i, n), &before) in scheduled.iter().zip(computed_before) {
            let r = &self.reqs[i];
            for (g, table) in r.blocks.iter().enumerate() {
                let mut p = before;
                while p < before + n {
                    let k = p / bs;
                    let upto = ((k + 1) * bs).min(before + n);
                    let block = *table
                        .get(k)
                        .ok_or_else(|| Error::internal("a scheduled token has no device block"))?;
                    writes.push(BlockWrite {
                        block,
                        first_slot: p % bs,
                        hashes: r.prefix[p..upto]
                            .iter()
                            .map(|&h| group_hash(h, g))
                            .collect(),
                    });
                    p = upto;
                }
            }
        }
        let (finished, started_loading) = if report {
            self.sched.worker_finished_lists()
        } else {
            (Vec::new(), Vec::new())
        };
        // Freed blocks are clobbered on the ranks unless reused or kept by the prefix cache.
        let clobber: Vec<usize> = std::mem::take(&mut self.to_clobber)
            .into_iter()
            .filter(|&b| self.pool.is_free(b))
            .collect();
        let cmd = StepCommand {
            metadata: Some(metadata),
            forward: !scheduled.is_empty(),
            report,
            clobber,
            writes,
            finished,
            started_loading,
        };
        self.send_step(&cmd)
    }

    /// The `get_finished` part alone: what the engine does after finishing requests (TensorRT-LLM),
    /// and all it does in an iteration with nothing scheduled.
    pub(super) fn report_iteration(&mut self) -> Result<()> {
        let (finished, started_loading) = self.sched.worker_finished_lists();
        let cmd = StepCommand {
            metadata: None,
            report: true,
            finished,
            started_loading,
            ..StepCommand::default()
        };
        self.send_step(&cmd)
    }

    /// Sends `cmd` to every live rank and acts on their replies.
    fn send_step(&mut self, cmd: &StepCommand) -> Result<()> {
        let mut replies = Vec::new();
        for rank in 0..self.ranks.len() {
            // Fault injection: at the first step from S on with a load in flight.
            if let Some((victim, at)) = self.opts.kill {
                if victim == rank
                    && self.step >= at
                    && self.ranks[rank].is_some()
                    && self.reqs.iter().any(|r| r.phase == Phase::Loading)
                {
                    self.kill_rank(rank);
                }
            }
            let Some(driver) = self.ranks[rank].as_mut() else {
                continue;
            };
            match driver.step(cmd) {
                Ok(r) => replies.push(r),
                Err(e) => self.rank_died(rank, &e),
            }
        }
        self.apply_replies(replies)
    }

    /// Kills a rank's process (fault injection for tests).
    fn kill_rank(&mut self, rank: usize) {
        if let Some(child) = self.children.get_mut(rank) {
            tracing::warn!(rank, "killing the rank's process (fault injection)");
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A rank stopped answering: its device is gone. Requests whose loads it had not confirmed
    /// are treated as failed loads (recomputed); the engine runs on with the live ranks.
    pub(super) fn rank_died(&mut self, rank: usize, e: &Error) {
        tracing::error!(rank, error = %e, "rank lost; its loads are recomputed");
        eprintln!("kvbm: rank {rank} lost: {e}");
        self.ranks[rank] = None;
        // A lost rank's process may be stopped or stuck rather than dead: end it, so the
        // run's final wait for its children cannot hang on it.
        if let Some(child) = self.children.get_mut(rank) {
            let _ = child.kill();
        }
        self.rank_failures += 1;
        let loading: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].phase == Phase::Loading)
            .collect();
        for i in loading {
            let Some((first, count)) = self.reqs[i].loading.take() else {
                continue;
            };
            self.load_errors += count;
            let r = &mut self.reqs[i];
            r.report.load_errors += count;
            r.computed = first * self.opts.block_size;
            r.loaded = true;
            r.phase = Phase::Waiting;
            self.waiting.push_front(i);
        }
    }

    fn live_ranks(&self) -> usize {
        self.ranks.iter().filter(|r| r.is_some()).count()
    }

    /// Acts on an id only once every live rank reported it.
    fn apply_replies(&mut self, replies: Vec<StepReply>) -> Result<()> {
        let mut errors: HashSet<usize> = HashSet::new();
        let mut released = Vec::new();
        let mut loaded = Vec::new();
        for r in replies {
            errors.extend(r.load_errors);
            for id in r.released {
                if let Some(&i) = self.by_request_id.get(&id) {
                    *self.released_votes.entry(i).or_default() += 1;
                }
            }
            for id in r.loaded {
                if let Some(&i) = self.by_request_id.get(&id) {
                    *self.loaded_votes.entry(i).or_default() += 1;
                }
            }
        }
        let live = self.live_ranks().max(1);
        self.released_votes.retain(|&i, v| {
            if *v >= live {
                released.push(i);
                false
            } else {
                true
            }
        });
        self.loaded_votes.retain(|&i, v| {
            if *v >= live {
                loaded.push(i);
                false
            } else {
                true
            }
        });
        released.sort_unstable();
        loaded.sort_unstable();
        self.load_errors += errors.len();
        for i in loaded {
            self.on_loaded(i, &errors)?;
        }
        for i in released {
            if self.reqs[i].phase == Phase::Held {
                self.free_request_blocks(i)?;
                self.retire(i);
            }
        }
        Ok(())
    }

    fn on_loaded(&mut self, i: usize, errors: &HashSet<usize>) -> Result<()> {
        let bs = self.opts.block_size;
        let Some((first, count)) = self.reqs[i].loading.take() else {
            return Ok(());
        };
        let mut first_bad: Option<usize> = None;
        let mut check = Verify::default();
        let windowed = self.opts.windowed();
        // Positions with a failed block in any group: the request recomputes from the first.
        let mut failed = 0;
        for k in first..first + count {
            for table in &self.reqs[i].blocks {
                let block = table.get(k).copied().unwrap_or(super::schedule::NULL_BLOCK);
                if windowed && block == super::schedule::NULL_BLOCK {
                    continue;
                }
                if errors.contains(&block) {
                    first_bad.get_or_insert(k);
                    failed += 1;
                }
            }
        }
        self.reqs[i].report.load_errors += failed;
        let good_end = first_bad.unwrap_or(first + count);
        for (g, table) in self.reqs[i].blocks.iter().enumerate() {
            for (k, &block) in table.iter().enumerate().take(good_end).skip(first) {
                if windowed && block == super::schedule::NULL_BLOCK {
                    // Before the window: nothing was loaded, nothing is needed.
                    continue;
                }
                let hashes = self.reqs[i].prefix[k * bs..(k + 1) * bs]
                    .iter()
                    .map(|&h| group_hash(h, g))
                    .collect();
                check.blocks.push((block, hashes));
            }
        }
        // Every live rank compares its shard of each onboarded block with the model's KV.
        let mut bad = 0;
        for rank in 0..self.ranks.len() {
            let Some(driver) = self.ranks[rank].as_mut() else {
                continue;
            };
            match driver.verify(&check) {
                Ok(n) => bad += n,
                Err(e) => self.rank_died(rank, &e),
            }
        }
        self.blocks_verified += check.blocks.len();
        if bad > 0 {
            self.integrity_errors += bad;
            tracing::error!(request = %self.reqs[i].id, bad, "onboarded blocks differ from the model's KV");
        }
        let r = &mut self.reqs[i];
        // Loaded tokens count as computed, up to the first bad block (recomputed instead).
        let good_blocks = first_bad.unwrap_or(first + count);
        r.computed = good_blocks * bs;
        r.loaded = true;
        self.progress += 1;
        r.phase = Phase::Waiting;
        self.waiting.push_front(i);
        Ok(())
    }
}
