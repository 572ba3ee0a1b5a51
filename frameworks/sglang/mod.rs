//! SGLang: HiCache's storage backend (`kvbm_connector.sglang.KvbmHiCacheStorage`). SGLang keeps
//! its own radix tree and host pool and asks a storage backend for pages by key, so the engine
//! needs no scheduler or worker adapter here: the core's [`crate::page_store::PageStore`] serves
//! it, and this folder holds only its Python binding (`kvbm_connector._kvbm.PageStore`, built
//! with `python`), which the Python module `kvbm_connector.sglang` drives.

pub(crate) mod python;
