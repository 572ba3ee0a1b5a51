//! `kvbm bench --redis-url`: host → Redis and Redis → host against raw pipelined `SET`/`GET`.

use super::*;

/// host → Redis and Redis → host against raw pipelined `SET`/`GET` of the same bytes from the
/// same client (see the [module docs](self)).
pub(super) fn redis_paths(url: &str, blocks: usize, rounds: usize) -> Result<Vec<PathResult>> {
    use kvbm_connector::backends::redis::{RedisOptions, RedisStore, RedisUrl};
    use kvbm_connector::connector::remote::{RemoteRead, RemoteScope, RemoteStore};
    if blocks == 0 {
        return Err(Error::invalid_argument("--redis-blocks must be at least 1"));
    }
    let url = RedisUrl::parse(url)?;
    let d = dims();
    let bpb = d.num_layers * d.outer_dim * d.page_size * d.inner_dim * d.dtype_bytes;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_nanos())
        .unwrap_or_default();
    let description = format!("kvbm-bench-{}-{nonce}", std::process::id());
    let scope = RemoteScope::new(&description, d.page_size, 1, bpb, HashAlgorithm::Sha256)?;
    // A private CA or a client certificate comes from the configuration, as for the engine.
    let options = RedisOptions {
        tls: kvbm_connector::Config::load_for_overrides(None)?
            .remote
            .tls_files()?,
        ..RedisOptions::default()
    };
    let store = RedisStore::connect(&url, scope, options)?;
    let deadline = || Instant::now() + Duration::from_secs(120);
    // Fails now, with the reason, if the server cannot be reached.
    store.raw_command(&[b"PING"], deadline())?;
    let host: Vec<Vec<u8>> = (0..blocks)
        .map(|b| (0..bpb).map(|i| (i * 31 + b * 7) as u8).collect())
        .collect();
    let mut dst: Vec<Vec<u8>> = vec![vec![0u8; bpb]; blocks];
    let bytes = blocks * bpb;
    let mut round = 0u128;
    let raw_key = |round: u128, b: usize| format!("kvbm-bench:{{{description}}}:raw:{round}:{b}");
    let ours_keys =
        |round: u128| -> Vec<u128> { (0..blocks as u128).map(|b| (round << 32) | b).collect() };
    let delete = |names: Vec<String>| -> Result<()> {
        for n in names {
            store.raw_command(&[b"UNLINK", n.as_bytes()], deadline())?;
        }
        Ok(())
    };
    // Writes: fresh keys every round (SET NX of a present key writes nothing).
    let (mut lw, mut ow) = (Vec::new(), Vec::new());
    for r in 0..=rounds {
        round += 1;
        let names: Vec<String> = (0..blocks).map(|b| raw_key(round, b)).collect();
        let pairs: Vec<(String, &[u8])> = names
            .iter()
            .cloned()
            .zip(host.iter().map(|h| h.as_slice()))
            .collect();
        let keys = ours_keys(round);
        let refs: Vec<(u128, &[u8])> = keys
            .iter()
            .copied()
            .zip(host.iter().map(|h| h.as_slice()))
            .collect();
        // Alternate which goes first: the second of a round writes into memory the server has
        // not reused yet (the previous round's values are freed between rounds).
        let raw = |pairs: &[(String, &[u8])]| -> Result<Duration> {
            let t = Instant::now();
            store.raw_set(pairs, deadline())?;
            Ok(t.elapsed())
        };
        let ours_put = |refs: &[(u128, &[u8])]| -> Result<(Duration, _)> {
            let t = Instant::now();
            let put = store.put(0, refs, deadline())?;
            Ok((t.elapsed(), put))
        };
        let (limit, (ours, put)) = if r % 2 == 0 {
            let l = raw(&pairs)?;
            (l, ours_put(&refs)?)
        } else {
            let o = ours_put(&refs)?;
            (raw(&pairs)?, o)
        };
        if put.written != blocks {
            return Err(Error::internal(format!(
                "bench: {} of {blocks} blocks written",
                put.written
            )));
        }
        if r > 0 {
            lw.push(limit);
            ow.push(ours);
        }
        delete(names)?;
        delete(keys.iter().map(|&k| store.key_name(k, 0)).collect())?;
    }
    // Reads: one set of values, read every round.
    round += 1;
    let names: Vec<String> = (0..blocks).map(|b| raw_key(round, b)).collect();
    let pairs: Vec<(String, &[u8])> = names
        .iter()
        .cloned()
        .zip(host.iter().map(|h| h.as_slice()))
        .collect();
    store.raw_set(&pairs, deadline())?;
    let keys = ours_keys(round);
    let refs: Vec<(u128, &[u8])> = keys
        .iter()
        .copied()
        .zip(host.iter().map(|h| h.as_slice()))
        .collect();
    store.put(0, &refs, deadline())?;
    let (mut l, mut o) = (Vec::new(), Vec::new());
    for r in 0..=rounds {
        let raw = |dst: &mut [Vec<u8>]| -> Result<Duration> {
            let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            let t = Instant::now();
            store.raw_get(&names, &mut d, deadline())?;
            Ok(t.elapsed())
        };
        let ours_get = |dst: &mut [Vec<u8>]| -> Result<(Duration, Vec<RemoteRead>)> {
            let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|v| v.as_mut_slice()).collect();
            let t = Instant::now();
            let got = store.get(0, &keys, &mut d, deadline())?;
            Ok((t.elapsed(), got))
        };
        // Alternate which goes first, as for writes.
        let (limit, (ours, got)) = if r % 2 == 0 {
            let l = raw(&mut dst)?;
            (l, ours_get(&mut dst)?)
        } else {
            let o = ours_get(&mut dst)?;
            (raw(&mut dst)?, o)
        };
        if got.iter().any(|g| *g != RemoteRead::Hit) || dst != host {
            return Err(Error::internal(format!(
                "bench: Redis reads did not return the blocks written: {got:?}"
            )));
        }
        if r > 0 {
            l.push(limit);
            o.push(ours);
        }
    }
    delete(names)?;
    delete(keys.iter().map(|&k| store.key_name(k, 0)).collect())?;
    let stats = store.stats();
    if stats.errors + stats.timeouts + stats.invalid > 0 {
        return Err(Error::internal(format!(
            "bench: Redis store counters {stats:?}"
        )));
    }
    let what = format!("{blocks} x {} MiB, {}", bpb >> 20, url);
    Ok(vec![
        bandwidth(
            &format!("host -> redis ({blocks} blocks)"),
            bytes,
            median(lw),
            median(ow),
            &format!("raw pipelined SET of the same bytes, same client; {what}"),
        ),
        bandwidth(
            &format!("redis -> host ({blocks} blocks)"),
            bytes,
            median(l),
            median(o),
            &format!("raw pipelined GET of the same bytes into the same buffers; {what}"),
        ),
    ])
}
