//! One load's and one write's view of the store as a [`StorageTier`]: [`RemoteSource`] and
//! [`RemoteSink`], so reads and writes run through the transfer engine like any other copy.

use super::*;

/// The error of a block a [`RemoteStore::get`] did not serve.
fn read_error(key: u128, outcome: &RemoteRead) -> Error {
    let e = match outcome {
        RemoteRead::Missing => Error::new(
            ErrorKind::NotFound,
            "block not in the remote store (never written, evicted or expired)",
        ),
        RemoteRead::Invalid(why) => Error::new(
            ErrorKind::Corrupt,
            format!("remote value failed verification: {why}"),
        ),
        RemoteRead::Hit => Error::internal("a hit reported as a failure"),
    };
    e.with("tier", TierKind::Remote)
        .with("key", format!("{key:032x}"))
}

fn remote_capability() -> Capability {
    Capability {
        host_addressable: false,
        direct_io_alignment: 1,
        checksummed: true,
        max_in_flight: 4,
    }
}

/// One load's view of the store: block `k` of this tier is `keys[k]` of rank `rank`. Reads go
/// through the store's pipelined [`RemoteStore::get`], one batch per transfer batch (its
/// [`BatchCopy::copy_to`]), all bounded by one deadline, `budget` after the load was created (the
/// worker passes `remote.load_timeout_ms` and creates it when the engine submits the load): a
/// load queued behind others on a stalled connection fails when its own budget is spent, not a
/// budget after its turn came (loads that timed out one after another, 500 ms each, had
/// delayed the last of them by 1.5 s). A block that is missing or fails
/// verification fails alone (never written to the destination). Writes are refused.
#[derive(Debug)]
pub struct RemoteSource {
    store: Arc<dyn RemoteStore>,
    rank: usize,
    keys: Vec<u128>,
    layout: Layout,
    deadline: Instant,
}

/// The layout of `n` values of `store` for a rank whose blocks have dimensions `dims`: refused
/// when the store's values are not exactly one such block.
fn value_layout(store: &dyn RemoteStore, dims: LayoutDims, n: usize) -> Result<Layout> {
    let layout = Layout::fully_contiguous(dims, n)?;
    let want = store.scope().bytes_per_block;
    if layout.bytes_per_block() != want {
        return Err(Error::invalid_layout(format!(
            "remote values hold {want} bytes but this rank's blocks are {}",
            layout.bytes_per_block()
        )));
    }
    Ok(layout)
}

impl RemoteSource {
    /// The source of a load of `keys` for worker `rank`, whose blocks have dimensions `dims`;
    /// its reads end by `budget` from now.
    pub fn new(
        store: Arc<dyn RemoteStore>,
        rank: usize,
        keys: Vec<u128>,
        dims: LayoutDims,
        budget: Duration,
    ) -> Result<Self> {
        let layout = value_layout(store.as_ref(), dims, keys.len())?;
        Ok(Self {
            store,
            rank,
            keys,
            layout,
            deadline: Instant::now() + budget,
        })
    }

    /// Reads `blocks` (indices into the keys) in one batch: one buffer or error per block.
    fn fetch(&self, blocks: &[usize]) -> Vec<Result<Vec<u8>>> {
        let bpb = self.layout.bytes_per_block();
        let mut keys = Vec::with_capacity(blocks.len());
        for &b in blocks {
            match self.keys.get(b) {
                Some(k) => keys.push(*k),
                None => {
                    let e = Error::out_of_range("block", b, self.keys.len())
                        .with("tier", TierKind::Remote);
                    return blocks.iter().map(|_| Err(e.clone())).collect();
                }
            }
        }
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; bpb]).collect();
        let outcome = {
            let mut dst: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
            self.store.get(self.rank, &keys, &mut dst, self.deadline)
        };
        match outcome {
            Ok(reads) if reads.len() == keys.len() => bufs
                .into_iter()
                .zip(reads.iter().zip(&keys))
                .map(|(buf, (r, k))| match r {
                    RemoteRead::Hit => Ok(buf),
                    other => Err(read_error(*k, other)),
                })
                .collect(),
            Ok(reads) => {
                let e = Error::internal(format!(
                    "the remote store answered {} outcomes for {} keys",
                    reads.len(),
                    keys.len()
                ));
                keys.iter().map(|_| Err(e.clone())).collect()
            }
            Err(e) => keys.iter().map(|_| Err(e.clone())).collect(),
        }
    }
}

impl StorageTier for RemoteSource {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }
    fn capability(&self) -> Capability {
        remote_capability()
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn read_block(&self, block: usize, dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        let len = crate::tier::total_len(dst);
        crate::tier::check_io(
            TierKind::Remote,
            "read",
            block,
            self.keys.len(),
            len,
            self.layout.bytes_per_block(),
        )?;
        let buf = self
            .fetch(&[block])
            .pop()
            .unwrap_or_else(|| Err(Error::internal("the remote store answered nothing")))?;
        crate::tier::copy_segments(&[IoSlice::new(&buf)], dst);
        Ok(())
    }
    fn write_block(&self, block: usize, _src: &[IoSlice<'_>]) -> Result<()> {
        Err(Error::unsupported("a remote load's source is read-only")
            .with("tier", TierKind::Remote)
            .with("block", block))
    }
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}

impl BatchCopy for RemoteSource {
    fn copy_to(&self, dst: &dyn StorageTier, pairs: &[(usize, usize)]) -> Option<Vec<Result<()>>> {
        let blocks: Vec<usize> = pairs.iter().map(|p| p.0).collect();
        let bufs = self.fetch(&blocks);
        Some(
            bufs.into_iter()
                .zip(pairs)
                .map(|(buf, &(_, d))| dst.write_block(d, &[IoSlice::new(&buf?)]))
                .collect(),
        )
    }

    fn copy_from(
        &self,
        _src: &dyn StorageTier,
        _pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        None
    }
}

/// One write's view of the store: block `k` of this tier is `keys[k]` of rank `rank`. Writes go
/// through the store's pipelined [`RemoteStore::put`] (a value already present is not
/// rewritten), one batch per transfer batch, each bounded by `io_timeout`. Reads are refused.
#[derive(Debug)]
pub struct RemoteSink {
    store: Arc<dyn RemoteStore>,
    rank: usize,
    keys: Vec<u128>,
    layout: Layout,
    io_timeout: Duration,
    written: AtomicU64,
    present: AtomicU64,
}

impl RemoteSink {
    /// The destination of a write of `keys` by worker `rank`, whose blocks have dimensions
    /// `dims`.
    pub fn new(
        store: Arc<dyn RemoteStore>,
        rank: usize,
        keys: Vec<u128>,
        dims: LayoutDims,
        io_timeout: Duration,
    ) -> Result<Self> {
        let layout = value_layout(store.as_ref(), dims, keys.len())?;
        Ok(Self {
            store,
            rank,
            keys,
            layout,
            io_timeout,
            written: AtomicU64::new(0),
            present: AtomicU64::new(0),
        })
    }

    /// Values written and values found already present so far.
    pub fn counts(&self) -> RemotePut {
        RemotePut {
            written: self.written.load(Ordering::Relaxed) as usize,
            present: self.present.load(Ordering::Relaxed) as usize,
        }
    }

    fn put_batch(&self, blocks: &[(usize, Vec<u8>)]) -> Result<()> {
        let mut batch = Vec::with_capacity(blocks.len());
        for (b, bytes) in blocks {
            let key = self.keys.get(*b).ok_or_else(|| {
                Error::out_of_range("block", *b, self.keys.len()).with("tier", TierKind::Remote)
            })?;
            batch.push((*key, bytes.as_slice()));
        }
        let done = self
            .store
            .put(self.rank, &batch, Instant::now() + self.io_timeout)?;
        self.written
            .fetch_add(done.written as u64, Ordering::Relaxed);
        self.present
            .fetch_add(done.present as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl StorageTier for RemoteSink {
    fn kind(&self) -> TierKind {
        TierKind::Remote
    }
    fn capability(&self) -> Capability {
        remote_capability()
    }
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn read_block(&self, block: usize, _dst: &mut [IoSliceMut<'_>]) -> Result<()> {
        Err(
            Error::unsupported("a remote write's destination is write-only")
                .with("tier", TierKind::Remote)
                .with("block", block),
        )
    }
    fn write_block(&self, block: usize, src: &[IoSlice<'_>]) -> Result<()> {
        let len = crate::tier::total_len(src);
        crate::tier::check_io(
            TierKind::Remote,
            "write",
            block,
            self.keys.len(),
            len,
            self.layout.bytes_per_block(),
        )?;
        let bytes: Vec<u8> = src.iter().flat_map(|s| s.iter().copied()).collect();
        self.put_batch(&[(block, bytes)])
    }
    fn batch_copy(&self) -> Option<&dyn BatchCopy> {
        Some(self)
    }
}

impl BatchCopy for RemoteSink {
    fn copy_to(
        &self,
        _dst: &dyn StorageTier,
        _pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        None
    }

    fn copy_from(
        &self,
        src: &dyn StorageTier,
        pairs: &[(usize, usize)],
    ) -> Option<Vec<Result<()>>> {
        let bpb = self.layout.bytes_per_block();
        let mut results: Vec<Result<()>> = Vec::with_capacity(pairs.len());
        let mut batch = Vec::with_capacity(pairs.len());
        let mut slots = Vec::with_capacity(pairs.len());
        for (i, &(s, d)) in pairs.iter().enumerate() {
            let mut buf = vec![0u8; bpb];
            match src.read_block(s, &mut [IoSliceMut::new(&mut buf)]) {
                Ok(()) => {
                    batch.push((d, buf));
                    slots.push(i);
                    results.push(Ok(()));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if !batch.is_empty() {
            if let Err(e) = self.put_batch(&batch) {
                for i in slots {
                    results[i] = Err(e.clone());
                }
            }
        }
        Some(results)
    }
}
