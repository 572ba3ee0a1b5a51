//! Reading vLLM's Python objects (requests, scheduler outputs, block lists, token lists) into
//! the adapter's plain values: bounded, typed errors naming the field, only what is new.

use super::*;

/// `(req_id, prompt_token_ids, block_ids, num_computed_tokens)`: vLLM's `NewRequestData`.
pub(super) type NewTuple = (String, Vec<u32>, Vec<Vec<usize>>, usize);

/// `(req_ids, resumed_from_preemption, new_token_ids, new_block_ids, num_computed_tokens)`:
/// vLLM's `CachedRequestData` (parallel lists).
pub(super) type CachedTuple = (
    Vec<String>,
    Vec<bool>,
    Vec<Vec<u32>>,
    Vec<Option<Vec<Vec<usize>>>>,
    Vec<usize>,
);

pub(super) fn request_view<'a>(
    request_id: &'a str,
    all_token_ids: &'a [u32],
    cache_salt: Option<&'a str>,
    lora_name: Option<&'a str>,
    num_computed_tokens: usize,
) -> Request<'a> {
    Request {
        request_id,
        all_token_ids,
        cache_salt,
        lora_name,
        num_computed_tokens,
    }
}

// -- Reading vLLM's objects in Rust ----------------------------------------------------------------
//
// The class's hot-path calls hand vLLM's objects straight to these methods: the binding reads the
// attributes it needs and, of a request's token list, only the tokens the leader does not hold yet
// (`VllmScheduler::known_tokens`), converting them once, into the Rust state.

/// Above this many tokens to hash in one call, the leader's work runs with the GIL released.
pub(super) const DETACH_TOKENS: usize = 16 * 1024;

pub(super) fn bad_input(py: Python<'_>, what: &'static str, e: PyErr) -> PyErr {
    to_py_err(
        py,
        Error::invalid_argument(format!("{what} must be a sequence of integers ({e})"))
            .with("argument", what),
    )
}

pub(super) fn rust_err<'py>(py: Python<'py>, op: &'static str) -> impl Fn(Error) -> PyErr + 'py {
    move |e| to_py_err(py, e.with("op", op))
}

/// `str(obj)` as Rust text (vLLM's request ids are `str` already).
pub(super) fn text(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(s.to_cow()?.into_owned()),
        Err(_) => Ok(obj.str()?.to_cow()?.into_owned()),
    }
}

/// Appends the integers of `items` (any iterable) to `out`.
pub(super) fn extend_ints<T: for<'a, 'py> FromPyObject<'a, 'py>>(
    items: &Bound<'_, PyAny>,
    out: &mut Vec<T>,
) -> PyResult<()> {
    if let Ok(list) = items.cast::<PyList>() {
        out.reserve(list.len());
        for v in list.iter() {
            out.push(v.extract().map_err(Into::into)?);
        }
    } else if let Ok(tuple) = items.cast::<PyTuple>() {
        out.reserve(tuple.len());
        for v in tuple.iter() {
            out.push(v.extract().map_err(Into::into)?);
        }
    } else {
        for v in items.try_iter()? {
            out.push(v?.extract().map_err(Into::into)?);
        }
    }
    Ok(())
}

/// Appends the tokens of `list` from index `from` on to `out`, reading each item in place (no
/// new reference, no iterator): the hot path of every lookup. Stops at the first item that is
/// not an `int` in `0..=u32::MAX` and returns its index, for the caller to read the rest the
/// general way (which names what is wrong); `None` when every item was read.
pub(super) fn list_tokens(
    list: &Bound<'_, PyList>,
    from: usize,
    out: &mut Vec<Token>,
) -> Option<usize> {
    list_ints(list, from, out)
}

/// [`list_tokens`] for any integer type `T`: the items of `list` from `from` on, read in place;
/// the index of the first item that is not an exact `int` in `T`'s range, if any.
pub(super) fn list_ints<T: TryFrom<std::os::raw::c_ulong>>(
    list: &Bound<'_, PyList>,
    from: usize,
    out: &mut Vec<T>,
) -> Option<usize> {
    let n = list.len();
    out.reserve(n.saturating_sub(from));
    for i in from..n {
        let Ok(index) = pyo3::ffi::Py_ssize_t::try_from(i) else {
            return Some(i);
        };
        // SAFETY: the GIL is held and `list` is a live list. `PyList_GetItem` checks the index
        // (NULL, with an IndexError set, past the end) and returns a borrowed reference, used
        // only before any Python code can run: `PyLong_AsUnsignedLong` on an exact `int` runs
        // none (a negative or too large one sets an OverflowError, cleared here).
        let v = unsafe {
            let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), index);
            if item.is_null() {
                pyo3::ffi::PyErr_Clear();
                return Some(i);
            }
            if pyo3::ffi::PyLong_CheckExact(item) == 0 {
                return Some(i);
            }
            let v = pyo3::ffi::PyLong_AsUnsignedLong(item);
            if v == std::os::raw::c_ulong::MAX && !pyo3::ffi::PyErr_Occurred().is_null() {
                pyo3::ffi::PyErr_Clear();
                return Some(i);
            }
            v
        };
        match T::try_from(v) {
            Ok(t) => out.push(t),
            Err(_) => return Some(i),
        }
    }
    None
}

/// The list behind a sequence of tokens: the object itself when it is a list, or the list vLLM's
/// `ConstantList` (`Request.all_token_ids`) wraps as `_x`, read directly instead of through the
/// wrapper's Python-level `__iter__` / `__getitem__` (same items, no copy).
pub(super) fn backing_list<'py>(seq: &Bound<'py, PyAny>) -> Option<Bound<'py, PyList>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// The `ConstantList` class seen first (its address; a reference to it is kept, so the
    /// address is never reused): later calls know it without reading its name.
    static CONSTANT_LIST: AtomicUsize = AtomicUsize::new(0);
    if let Ok(list) = seq.cast::<PyList>() {
        return Some(list.clone());
    }
    let py = seq.py();
    let ty = seq.get_type();
    let known = CONSTANT_LIST.load(Ordering::Relaxed);
    if known == 0 || ty.as_ptr() as usize != known {
        if ty.name().ok()?.to_cow().ok()? != "ConstantList" {
            return None;
        }
        if known == 0 {
            let addr = ty.as_ptr() as usize;
            if CONSTANT_LIST
                .compare_exchange(0, addr, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                // Kept for the life of the process (one class object).
                std::mem::forget(ty.clone().unbind());
            }
        }
    }
    let inner = seq.getattr_opt(intern!(py, "_x")).ok()??;
    inner.cast_into::<PyList>().ok()
}

/// A request's tokens from index `from` on, from any sequence of integers (a list, vLLM's
/// `ConstantList`, a tuple, a numpy array): only those are read. `None` reads as no tokens.
pub(super) fn tokens_from(
    py: Python<'_>,
    seq: &Bound<'_, PyAny>,
    from: usize,
    what: &'static str,
) -> PyResult<Vec<Token>> {
    let mut out = Vec::new();
    if seq.is_none() {
        return Ok(out);
    }
    let mut read = || -> PyResult<()> {
        if let Some(list) = backing_list(seq) {
            let Some(stop) = list_tokens(&list, from, &mut out) else {
                return Ok(());
            };
            // An item the fast path does not take: read it and the rest the general way, which
            // raises the error that names it.
            let n = list.len();
            for i in stop..n {
                out.push(list.get_item(i)?.extract()?);
            }
            return Ok(());
        }
        if from == 0 {
            return extend_ints(seq, &mut out);
        }
        let n = seq.len()?;
        if n > from {
            let rest = seq.get_item(PySlice::new(py, from as isize, n as isize, 1))?;
            extend_ints(&rest, &mut out)?;
        }
        Ok(())
    };
    read().map_err(|e| bad_input(py, what, e))?;
    Ok(out)
}

/// Block ids as one list per KV-cache group: vLLM's `tuple[list[int], ...]`, a
/// `KVCacheBlocks` (`get_block_ids()`), or a flat list (older versions).
pub(super) fn groups(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    what: &'static str,
) -> PyResult<Vec<Vec<usize>>> {
    if blocks.is_none() {
        return Ok(Vec::new());
    }
    let read = || -> PyResult<Vec<Vec<usize>>> {
        let get = intern!(py, "get_block_ids");
        // A tuple or list is the ids themselves (vLLM's SchedulerOutput); asking it for
        // get_block_ids would raise and swallow an AttributeError on every call.
        let plain = blocks.is_instance_of::<PyTuple>() || blocks.is_instance_of::<PyList>();
        let ids = if !plain && blocks.hasattr(get)? {
            blocks.call_method0(get)?
        } else {
            blocks.clone()
        };
        let mut out: Vec<Vec<usize>> = Vec::with_capacity(1);
        let mut flat: Vec<usize> = Vec::new();
        for item in ids.try_iter()? {
            let item = item?;
            if let Ok(list) = item.cast::<PyList>() {
                // One group as a list (the usual case): its ids read in place.
                let mut g = Vec::new();
                if let Some(stop) = list_ints(list, 0, &mut g) {
                    for i in stop..list.len() {
                        g.push(list.get_item(i)?.extract()?);
                    }
                }
                out.push(g);
                continue;
            }
            if item.is_instance_of::<PyInt>() || !item.hasattr(intern!(py, "__iter__"))? {
                flat.push(item.extract()?);
            } else {
                let mut g = Vec::new();
                extend_ints(&item, &mut g)?;
                out.push(g);
            }
        }
        if !flat.is_empty() {
            if !out.is_empty() {
                return Err(pyo3::exceptions::PyTypeError::new_err(
                    "mixes block ids and lists of block ids",
                ));
            }
            out.push(flat);
        }
        Ok(out)
    };
    read().map_err(|e| bad_input(py, what, e))
}
/// Whether each of the `n` cached requests (`ids`: `cached.req_ids`) resumed from preemption:
/// from `resumed_req_ids` (vLLM 0.11+: the set of resumed ids) or, in older versions, the
/// per-request flags `resumed_from_preemption`; none of them: none resumed.
pub(super) fn resumed_flags<'py>(
    py: Python<'py>,
    cached: &Bound<'py, PyAny>,
    ids: &Bound<'py, PyAny>,
    n: usize,
) -> PyResult<Vec<bool>> {
    let mut out = Vec::with_capacity(n);
    // Newer vLLM (0.11+) names the resumed requests in `resumed_req_ids`; older versions
    // have one flag per request in `resumed_from_preemption`. The newer name is asked first:
    // asking an object for an attribute it lacks raises (and swallows) an AttributeError.
    let resumed = cached
        .getattr_opt(intern!(py, "resumed_req_ids"))?
        .filter(|r| !r.is_none());
    let flags = match resumed {
        Some(_) => None,
        None => cached.getattr_opt(intern!(py, "resumed_from_preemption"))?,
    };
    if let Some(flags) = flags.filter(|f| !f.is_none()) {
        for f in flags.try_iter()? {
            out.push(f?.is_truthy()?);
        }
    } else {
        match resumed.filter(|r| r.len().map_or(true, |l| l > 0)) {
            Some(set) => {
                for id in ids.try_iter()? {
                    out.push(set.contains(id?)?);
                }
            }
            None => out.resize(n, false),
        }
    }
    Ok(out)
}

/// The cached requests' `new_block_ids` (per KV-cache group; `None` where vLLM sends none) and
/// `num_computed_tokens`, appended to `c`.
pub(super) fn read_cached_blocks<'py>(
    py: Python<'py>,
    cached: &Bound<'py, PyAny>,
    c: &mut CachedRequestData,
) -> PyResult<()> {
    for b in cached.getattr(intern!(py, "new_block_ids"))?.try_iter()? {
        let b = b?;
        c.new_block_ids.push(if b.is_none() {
            None
        } else {
            Some(groups(py, &b, "new_block_ids")?)
        });
    }
    for v in cached
        .getattr(intern!(py, "num_computed_tokens"))?
        .try_iter()?
    {
        c.num_computed_tokens.push(v?.extract()?);
    }
    Ok(())
}

/// The number of tokens `scheduler_output.num_scheduled_tokens` (`counts`: a dict, or any
/// mapping) schedules for request `id`, into `out` under `key`; nothing when it names none.
pub(super) fn scheduled_count(
    counts: &Bound<'_, PyAny>,
    id: &Bound<'_, PyAny>,
    key: &str,
    out: &mut HashMap<String, usize>,
) -> PyResult<()> {
    let n = match counts.cast::<PyDict>() {
        Ok(d) => d.get_item(id)?,
        Err(_) => counts.get_item(id).ok(),
    };
    if let Some(n) = n {
        out.insert(key.to_owned(), n.extract()?);
    }
    Ok(())
}

/// The new requests of `scheduler_output.scheduled_new_reqs` (`new_reqs`), each into `output`
/// (its scheduled count from `counts`, its block ids and computed tokens; its prompt is read
/// later, under the lock, from the first token the leader does not hold); returned with their
/// `req_id` objects for that.
pub(super) fn read_new_requests<'py>(
    py: Python<'py>,
    new_reqs: &Bound<'py, PyAny>,
    counts: &Bound<'py, PyAny>,
    output: &mut SchedulerOutput,
) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let news: Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = new_reqs
        .try_iter()?
        .map(|r| {
            let r = r?;
            let id = r.getattr(intern!(py, "req_id"))?;
            Ok((r, id))
        })
        .collect::<PyResult<_>>()?;
    for (r, id) in &news {
        let key = text(id)?;
        scheduled_count(counts, id, &key, &mut output.num_scheduled_tokens)?;
        output.scheduled_new_reqs.push(NewRequestData {
            req_id: key,
            prompt_token_ids: Vec::new(),
            first_token_index: 0,
            block_ids: groups(py, &r.getattr(intern!(py, "block_ids"))?, "block_ids")?,
            num_computed_tokens: r.getattr(intern!(py, "num_computed_tokens"))?.extract()?,
        });
    }
    Ok(news)
}

/// Under the scheduler's lock (`s`), the tokens the leader does not hold yet: of each running
/// request read from its `Request` (`from_requests`, parallel to the cached requests), the
/// generated tokens after those the leader holds; of each new request (`news`, parallel to
/// `output.scheduled_new_reqs`), its prompt after those. Returns the new requests' token count.
pub(super) fn read_unknown_tokens<'py>(
    py: Python<'py>,
    s: &VllmScheduler,
    from_requests: &[Option<Bound<'py, PyAny>>],
    news: &[(Bound<'py, PyAny>, Bound<'py, PyAny>)],
    output: &mut SchedulerOutput,
) -> PyResult<usize> {
    let c = &mut output.scheduled_cached_reqs;
    if from_requests.iter().any(Option::is_some) {
        c.new_token_index = vec![None; c.req_ids.len()];
        for (i, r) in from_requests.iter().enumerate() {
            let Some(r) = r else { continue };
            let first = s.known_tokens(&c.req_ids[i]);
            if first == 0 {
                // Not tracked by the leader (a tracked request holds its prompt): nothing to
                // append, and its whole list is not read every step.
                continue;
            }
            let all = r.getattr(intern!(py, "all_token_ids"))?;
            c.new_token_ids[i] = tokens_from(py, &all, first, "request.all_token_ids")?;
            c.new_token_index[i] = Some(first);
        }
    }
    let mut total = 0;
    for ((r, _), d) in news.iter().zip(output.scheduled_new_reqs.iter_mut()) {
        let first = s.known_tokens(&d.req_id);
        let prompt = r.getattr(intern!(py, "prompt_token_ids"))?;
        d.prompt_token_ids = tokens_from(py, &prompt, first, "prompt_token_ids")?;
        d.first_token_index = first;
        total += d.prompt_token_ids.len();
    }
    Ok(total)
}

/// `request.cache_salt` and `request.lora_request.lora_name`, when present.
pub(super) fn salt_and_lora(
    py: Python<'_>,
    request: &Bound<'_, PyAny>,
) -> PyResult<(Option<String>, Option<String>)> {
    let opt = |obj: &Bound<'_, PyAny>, name: &Bound<'_, PyString>| -> PyResult<Option<String>> {
        match obj.getattr_opt(name)? {
            Some(v) if !v.is_none() => Ok(Some(text(&v)?)),
            _ => Ok(None),
        }
    };
    let salt = opt(request, intern!(py, "cache_salt"))?;
    let lora = match request.getattr_opt(intern!(py, "lora_request"))? {
        Some(l) if !l.is_none() => opt(&l, intern!(py, "lora_name"))?,
        _ => None,
    };
    Ok((salt, lora))
}
