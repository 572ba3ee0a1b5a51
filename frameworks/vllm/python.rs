//! `VllmScheduler` and `VllmWorker`: [`crate::frameworks::vllm`] over plain Python values.
//! `kvbm_connector.vllm` reads vLLM's objects into these calls.

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PySlice, PyString, PyTuple};

use crate::connector::groups::KvCacheGroups;
use crate::connector::leader::TierEvent;
use crate::error::Error;
use crate::frameworks::vllm::{
    CachedRequestData, NewRequestData, Request, SchedulerOutput, VllmScheduler, VllmWorker,
};
use crate::identity::Token;
use crate::python::cache::register_cache;
use crate::python::tensor::{parse_layout_kind, read_layer_tensors, vllm_layout};
use crate::python::transport::{PyLeaderTransport, PyWorkerTransport};
use crate::python::{common, detached, to_py_err, Guarded, PyConfig};

mod read;
mod worker;

/// The most block events a log keeps between two takes (each stream): vLLM takes them every step.
const MAX_EVENT_CAPACITY: usize = 1 << 24;

use read::*;
use worker::PyVllmWorker;

/// The scheduler role of `KVConnectorBase_V1`. Its start-up barrier runs inline (vLLM's engine
/// definition, `frameworks::vllm::Vllm`): vLLM builds it after the workers registered their caches.
#[pyclass(module = "kvbm_connector._kvbm", name = "VllmScheduler", frozen)]
pub(crate) struct PyVllmScheduler {
    inner: Guarded<VllmScheduler>,
    /// The persisted worker disk tiers' reset marker, if they are persisted: a reset is
    /// recorded there before `clear_tiers` returns.
    reset_marker: Option<std::path::PathBuf>,
    /// `(host_tokens, disk_tokens)` of each request's last hit, for
    /// `get_external_cache_hit_sources`.
    hit_split: Mutex<HashMap<String, (usize, usize)>>,
    /// vLLM's `Request` of each request between `update_state_after_alloc` and
    /// `request_finished`: `build_connector_meta` reads the tokens a running request generated
    /// from it (vLLM's scheduler output carries them only with pipeline parallelism), so a block
    /// that fills while the request decodes is stored in the step that computes it, not after
    /// the request finished, when vLLM must keep the request's device blocks for that store.
    live: Mutex<HashMap<String, Py<PyAny>>>,
}

#[pymethods]
impl PyVllmScheduler {
    #[new]
    #[pyo3(signature = (config, block_size, transport))]
    fn new(
        py: Python<'_>,
        config: &PyConfig,
        block_size: usize,
        transport: &PyLeaderTransport,
    ) -> PyResult<Self> {
        let (config, transport) = (config.inner.clone(), transport.inner.clone());
        let reset_marker = crate::backends::standard::reset_marker_path(&config);
        let s = detached(py, "VllmScheduler", move || {
            VllmScheduler::new(config, block_size, transport)
        })?;
        Ok(Self {
            reset_marker,
            inner: Guarded::new("VllmScheduler", s),
            hit_split: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
        })
    }

    /// Does nothing: the floor `benches/python_class.py` measures a call through the binding
    /// against (an empty method call through pyo3, in the same run).
    #[staticmethod]
    #[pyo3(name = "_noop")]
    fn noop() {}

    /// `(num_external_tokens, load_async)`.
    #[pyo3(signature = (request_id, all_token_ids, num_computed_tokens, cache_salt=None, lora_name=None))]
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request_id: String,
        all_token_ids: Vec<u32>,
        num_computed_tokens: usize,
        cache_salt: Option<String>,
        lora_name: Option<String>,
    ) -> PyResult<(Option<usize>, bool)> {
        self.inner.call(py, "get_num_new_matched_tokens", move |s| {
            s.get_num_new_matched_tokens(
                &request_view(
                    &request_id,
                    &all_token_ids,
                    cache_salt.as_deref(),
                    lora_name.as_deref(),
                    0,
                ),
                num_computed_tokens,
            )
        })
    }

    /// `block_ids`: one list per KV-cache group (`blocks.get_block_ids()`).
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request_id: String,
        block_ids: Vec<Vec<usize>>,
        num_external_tokens: usize,
    ) -> PyResult<()> {
        self.inner.call(py, "update_state_after_alloc", move |s| {
            s.update_state_after_alloc(
                &request_view(&request_id, &[], None, None, 0),
                &block_ids,
                num_external_tokens,
            )
        })
    }

    /// The metadata bytes of this step.
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduled_new_reqs: Vec<NewTuple>,
        scheduled_cached_reqs: CachedTuple,
        num_scheduled_tokens: HashMap<String, usize>,
        finished_req_ids: HashSet<String>,
        preempted_req_ids: HashSet<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (req_ids, resumed_from_preemption, new_token_ids, new_block_ids, num_computed_tokens) =
            scheduled_cached_reqs;
        let output = SchedulerOutput {
            scheduled_new_reqs: scheduled_new_reqs
                .into_iter()
                .map(
                    |(req_id, prompt_token_ids, block_ids, num_computed_tokens)| NewRequestData {
                        req_id,
                        prompt_token_ids,
                        first_token_index: 0,
                        block_ids,
                        num_computed_tokens,
                    },
                )
                .collect(),
            scheduled_cached_reqs: CachedRequestData {
                req_ids,
                resumed_from_preemption,
                new_token_ids,
                new_block_ids,
                num_computed_tokens,
                new_token_index: Vec::new(),
            },
            num_scheduled_tokens,
            finished_req_ids,
            preempted_req_ids,
        };
        let bytes = self.inner.call(py, "build_connector_meta", move |s| {
            s.build_connector_meta(&output)
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// True while operations on the request's device blocks are in flight.
    fn request_finished(
        &self,
        py: Python<'_>,
        request_id: String,
        all_token_ids: Vec<u32>,
        num_computed_tokens: usize,
        block_ids: Vec<usize>,
    ) -> PyResult<bool> {
        self.inner.call(py, "request_finished", move |s| {
            s.request_finished(
                &request_view(&request_id, &all_token_ids, None, None, num_computed_tokens),
                &block_ids,
            )
            .map(|(held, _)| held)
        })
    }

    // -- The class's hot path: vLLM's objects in, only what is new read --------------------------

    /// `KvbmConnector.get_num_new_matched_tokens(request, num_computed_tokens)`: reads
    /// `request_id`, `cache_salt`, `lora_request.lora_name` and, of `all_token_ids`, only the
    /// tokens the leader does not hold yet. Keeps where a hit is held (host, disk) for
    /// [`PyVllmScheduler::take_hit_sources`].
    fn match_request(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: usize,
    ) -> PyResult<(Option<usize>, bool)> {
        let op = "get_num_new_matched_tokens";
        let rid = text(&request.getattr(intern!(py, "request_id"))?)?;
        let all = request.getattr(intern!(py, "all_token_ids"))?;
        let (salt, lora) = salt_and_lora(py, request)?;
        let (out, split) = self.inner.call_attached(py, op, |s| {
            let first = s.known_tokens(&rid);
            let tokens = tokens_from(py, &all, first, "request.all_token_ids")?;
            let r = request_view(&rid, &tokens, salt.as_deref(), lora.as_deref(), 0);
            let run = |s: &mut VllmScheduler| {
                let out = s.get_num_new_matched_tokens_from(&r, first, num_computed_tokens)?;
                let m = s.leader().last_match();
                Ok((out, (m.host_tokens, m.disk_tokens)))
            };
            if tokens.len() > DETACH_TOKENS {
                py.detach(|| run(s))
            } else {
                run(s)
            }
            .map_err(rust_err(py, op))
        })?;
        let mut hits = self.hit_split.lock();
        if out.0.unwrap_or(0) > 0 {
            hits.insert(rid, split);
        } else if !hits.is_empty() {
            hits.remove(&rid);
        }
        Ok(out)
    }

    /// The model's KV-cache groups (vLLM's hybrid manager): how many, and each group's sliding
    /// window in tokens (`None`: full attention; all full without the list); set before the
    /// first request.
    #[pyo3(signature = (n, windows=None))]
    fn set_kv_cache_groups(
        &self,
        py: Python<'_>,
        n: usize,
        windows: Option<Vec<Option<i64>>>,
    ) -> PyResult<()> {
        self.inner.call(py, "set_kv_cache_groups", move |s| {
            let Some(windows) = windows else {
                return s.set_kv_cache_groups(n);
            };
            if windows.len() != n {
                return Err(Error::invalid_argument(format!(
                    "{} sliding windows given for {n} KV-cache groups",
                    windows.len()
                ))
                .with("kv_cache_groups", n));
            }
            s.set_kv_cache_group_kinds(KvCacheGroups::from_windows(&windows)?)
        })
    }

    /// `(host_tokens, disk_tokens)` of the request's last hit, forgotten once taken; `(0, 0)`
    /// when none is kept.
    fn take_hit_sources(&self, request_id: &str) -> (usize, usize) {
        self.hit_split.lock().remove(request_id).unwrap_or((0, 0))
    }

    /// `KvbmConnector.update_state_after_alloc(request, blocks, num_external_tokens)`: reads
    /// `request.request_id` and `blocks.get_block_ids()`.
    fn alloc_request(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_external_tokens: usize,
    ) -> PyResult<()> {
        let op = "update_state_after_alloc";
        let rid = text(&request.getattr(intern!(py, "request_id"))?)?;
        let block_ids = groups(py, blocks, "blocks")?;
        self.inner.call_attached(py, op, |s| {
            s.update_state_after_alloc(
                &request_view(&rid, &[], None, None, 0),
                &block_ids,
                num_external_tokens,
            )
            .map_err(rust_err(py, op))
        })?;
        self.live.lock().insert(rid, request.clone().unbind());
        Ok(())
    }

    /// `KvbmConnector.build_connector_meta(scheduler_output)`: reads vLLM's `SchedulerOutput`
    /// (`scheduled_new_reqs`, `scheduled_cached_reqs`, `num_scheduled_tokens` of the scheduled
    /// requests, `preempted_req_ids`) in one call; of a new request's prompt, only the tokens the
    /// leader does not hold yet (those its lookup did not see).
    fn build_meta<'py>(
        &self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let op = "build_connector_meta";
        let so = scheduler_output;
        let new_reqs = so.getattr(intern!(py, "scheduled_new_reqs"))?;
        let cached = so.getattr(intern!(py, "scheduled_cached_reqs"))?;
        let counts = so.getattr(intern!(py, "num_scheduled_tokens"))?;
        let mut output = SchedulerOutput::default();
        // The cached requests' lists (read before the lock: no token list is read but the
        // new_token_ids vLLM sends with pipeline parallelism).
        let c = &mut output.scheduled_cached_reqs;
        let ids = cached.getattr(intern!(py, "req_ids"))?;
        for id in ids.try_iter()? {
            let id = id?;
            let key = text(&id)?;
            scheduled_count(&counts, &id, &key, &mut output.num_scheduled_tokens)?;
            c.req_ids.push(key);
        }
        let n = c.req_ids.len();
        c.resumed_from_preemption = resumed_flags(py, &cached, &ids, n)?;
        let new_tokens = cached.getattr_opt(intern!(py, "new_token_ids"))?;
        let new_tokens = new_tokens.filter(|t| !t.is_none() && t.len().ok() == Some(n) && n > 0);
        // vLLM fills new_token_ids only with pipeline parallelism; otherwise a running request's
        // generated tokens are read from its `Request` (kept since update_state_after_alloc),
        // once the leader's count of its tokens is known (below, under the lock).
        let mut from_requests: Vec<Option<Bound<'py, PyAny>>> = Vec::new();
        match new_tokens {
            None => {
                c.new_token_ids.resize(n, Vec::new());
                let live = self.live.lock();
                from_requests = c
                    .req_ids
                    .iter()
                    .map(|id| live.get(id).map(|r| r.bind(py).clone()))
                    .collect();
            }
            Some(lists) => {
                for t in lists.try_iter()? {
                    c.new_token_ids
                        .push(tokens_from(py, &t?, 0, "new_token_ids")?);
                }
            }
        }
        read_cached_blocks(py, &cached, c)?;
        if let Some(p) = so.getattr_opt(intern!(py, "preempted_req_ids"))? {
            if !p.is_none() {
                for id in p.try_iter()? {
                    output.preempted_req_ids.insert(text(&id?)?);
                }
            }
        }
        let news = read_new_requests(py, &new_reqs, &counts, &mut output)?;
        let bytes = self.inner.call_attached(py, op, |s| {
            let total = read_unknown_tokens(py, s, &from_requests, &news, &mut output)?;
            if total > DETACH_TOKENS {
                py.detach(|| s.build_connector_meta(&output))
            } else {
                s.build_connector_meta(&output)
            }
            .map_err(rust_err(py, op))
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// `KvbmConnector.request_finished(request, block_ids)`: reads `request_id`,
    /// `num_computed_tokens` and, of `all_token_ids`, only the tokens the leader does not hold
    /// yet (those generated since it last saw the request). True while operations on the
    /// request's device blocks are in flight.
    fn finish_request(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<bool> {
        let op = "request_finished";
        let rid = text(&request.getattr(intern!(py, "request_id"))?)?;
        let all = request.getattr(intern!(py, "all_token_ids"))?;
        let computed: usize = request
            .getattr(intern!(py, "num_computed_tokens"))?
            .extract()?;
        {
            let mut hits = self.hit_split.lock();
            if !hits.is_empty() {
                hits.remove(&rid);
            }
        }
        self.live.lock().remove(&rid);
        self.inner.call_attached(py, op, |s| {
            let first = s.known_tokens(&rid);
            let tokens = tokens_from(py, &all, first, "request.all_token_ids")?;
            let r = request_view(&rid, &tokens, None, None, computed);
            let run = |s: &mut VllmScheduler| s.request_finished_from(&r, first, &[]);
            if tokens.len() > DETACH_TOKENS {
                py.detach(|| run(s))
            } else {
                run(s)
            }
            .map(|(held, _)| held)
            .map_err(rust_err(py, op))
        })
    }

    /// `(external_tokens, load_async, host_tokens, disk_tokens)` of the most recent match: where
    /// the matched tokens are held.
    fn last_match(&self, py: Python<'_>) -> PyResult<(usize, bool, usize, usize)> {
        self.inner.call(py, "last_match", |s| {
            let m = s.leader().last_match();
            Ok((
                m.external_tokens,
                m.load_async,
                m.host_tokens,
                m.disk_tokens,
            ))
        })
    }

    /// Applies operation completions that arrived.
    fn update_connector_output(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.call(py, "update_connector_output", |s| {
            s.update_connector_output();
            Ok(())
        })
    }

    /// Starts recording block events (vLLM's KV events; see
    /// [`crate::connector::leader::BlockEvents`]), at most `capacity` of each stream between
    /// two `take_block_events` calls.
    fn record_block_events(&self, py: Python<'_>, capacity: usize) -> PyResult<()> {
        if capacity == 0 || capacity > MAX_EVENT_CAPACITY {
            return Err(to_py_err(
                py,
                Error::invalid_argument(format!(
                    "the block event capacity must be 1 to {MAX_EVENT_CAPACITY}, not {capacity}"
                ))
                .with("setting", "capacity"),
            ));
        }
        self.inner.call(py, "record_block_events", move |s| {
            s.leader_mut().record_block_events(capacity);
            Ok(())
        })
    }

    /// The block events since the last call: `(submitted, events, dropped)`, where `submitted`
    /// lists `(request_id, group, block_index, key)` for each store decided, `events` lists
    /// `(kind, tier, key)` with kind `"stored"`, `"removed"` or `"cleared"` (tier and key `None`
    /// for `"cleared"`), and `dropped` counts what a full log lost.
    #[allow(clippy::type_complexity)]
    fn take_block_events(
        &self,
        py: Python<'_>,
    ) -> PyResult<(
        Vec<(String, usize, usize, u128)>,
        Vec<(&'static str, Option<String>, Option<u128>)>,
        u64,
    )> {
        let ev = self.inner.call(py, "take_block_events", |s| {
            Ok(s.leader_mut().take_block_events())
        })?;
        let submitted = ev
            .submitted
            .into_iter()
            .map(|x| {
                let (real, g) = KvCacheGroups::real_of(x.request.as_str());
                (real.to_string(), g, x.block, x.key.0)
            })
            .collect();
        let events = ev
            .events
            .into_iter()
            .map(|e| match e {
                TierEvent::Stored { tier, key } => ("stored", Some(tier.to_string()), Some(key.0)),
                TierEvent::Removed { tier, key } => {
                    ("removed", Some(tier.to_string()), Some(key.0))
                }
                TierEvent::Cleared => ("cleared", None, None),
            })
            .collect();
        Ok((submitted, events, ev.dropped))
    }

    /// Withdraws every block the host and disk tiers hold (vLLM's `reset_cache`); returns how
    /// many. With persisted worker disk tiers (`disk.persist`) the reset is on disk before this
    /// returns: no worker serves those blocks again, after a restart either.
    ///
    /// Errors: the reset could not be recorded on disk (the blocks are withdrawn in this process
    /// all the same).
    fn clear_tiers(&self, py: Python<'_>) -> PyResult<usize> {
        let n = self
            .inner
            .call(py, "clear_tiers", |s| Ok(s.leader_mut().clear_tiers()))?;
        if let Some(marker) = self.reset_marker.clone() {
            detached(py, "clear_tiers", move || {
                crate::backends::standard::record_cache_reset(&marker)
            })?;
        }
        Ok(n)
    }

    /// The host and disk pools' block counts (`free`, `mutable`: being written, `active`: held,
    /// `inactive`, `registered`, `evictions`) as JSON text: `{"host": {...} | null, "disk": ...}`;
    /// `null` before the tiers exist.
    fn pool_stats_json(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.call(py, "pool_stats_json", |s| {
            let v = s
                .leader()
                .pool_stats()
                .map(|(host, disk)| serde_json::json!({ "host": host, "disk": disk }));
            serde_json::to_string(&v)
                .map_err(|e| Error::internal(format!("cannot encode the pool counts: {e}")))
        })
    }
}

common::scheduler_methods!(PyVllmScheduler);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVllmScheduler>()?;
    m.add_class::<PyVllmWorker>()?;
    Ok(())
}
