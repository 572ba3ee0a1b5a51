//! The `[host]` and `[disk]` settings: each tier's size (GB or blocks), the disk tier's file,
//! I/O path and admission, and the block counts they give.

use super::*;

/// Decimal gigabyte.
pub const GB: f64 = 1e9;

/// The host tier's size in GB when no host or disk size is set at all (see
/// [`Config::block_counts`]); [`default_host_cache_gb`] caps it at a quarter of the machine's
/// memory.
pub const DEFAULT_HOST_CACHE_GB: f64 = 4.0;

/// [`DEFAULT_HOST_CACHE_GB`], or a quarter of the machine's memory (`MemTotal` of
/// `/proc/meminfo`) when that is less; [`DEFAULT_HOST_CACHE_GB`] where it cannot be read.
pub fn default_host_cache_gb() -> f64 {
    let total_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        });
    match total_kb {
        Some(kb) if kb > 0.0 => DEFAULT_HOST_CACHE_GB.min(kb * 1024.0 / 4.0 / GB),
        _ => DEFAULT_HOST_CACHE_GB,
    }
}

/// Size of one cache tier: GB or an explicit block count (which wins when both are set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierSize {
    /// Capacity in decimal GB. Default: unset (tier off unless `cache_blocks` is set).
    pub cache_gb: Option<f64>,
    /// Capacity in blocks; overrides `cache_gb`. Default: unset.
    pub cache_blocks: Option<usize>,
}

impl TierSize {
    /// Block count for blocks of `bytes_per_block`: the override if set, else
    /// `floor(cache_gb × 1e9 / bytes_per_block)`, else 0 (tier off).
    pub fn blocks(&self, bytes_per_block: usize) -> Result<usize> {
        if let Some(n) = self.cache_blocks {
            return Ok(n);
        }
        let Some(gb) = self.cache_gb else {
            return Ok(0);
        };
        if bytes_per_block == 0 {
            return Err(Error::invalid_argument("bytes_per_block must be non-zero"));
        }
        // Validated finite and >= 0; the cast saturates for absurd sizes.
        Ok((gb * GB / bytes_per_block as f64).floor() as usize)
    }

    pub(super) fn validate(&self, key: &str) -> Result<()> {
        if let Some(gb) = self.cache_gb {
            if !gb.is_finite() || gb < 0.0 {
                return Err(Error::invalid_config(
                    &format!("{key}.cache_gb"),
                    gb,
                    "must be a finite number >= 0",
                ));
            }
        }
        Ok(())
    }
}

/// How the disk tier does its I/O.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    strum::Display,
    strum::EnumString,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", ascii_case_insensitive)]
pub enum DiskIo {
    /// The crate's own disk tier: positional vectored I/O (`preadv`/`pwritev`) on one file.
    #[default]
    Builtin,
    /// Through NIXL's POSIX plugin (needs the `nixl` feature).
    Nixl,
}

/// The disk (G3) tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiskConfig {
    /// Capacity in decimal GB. Default: unset (disk tier off unless `cache_blocks` is set).
    pub cache_gb: Option<f64>,
    /// Capacity in blocks; overrides `cache_gb`. Default: unset.
    pub cache_blocks: Option<usize>,
    /// Directory for the tier's file. Default: `$TMPDIR/kvbm-<uid>` (system temp dir; one per
    /// user, created `0700`). Must not be empty. Only its last component is created (`0700`);
    /// a directory owned by another user (not root) or writable by others without the sticky
    /// bit is refused (the disk tier's `DiskTierOptions::dir`).
    pub dir: PathBuf,
    /// Offload a block to disk only after it was seen this many times; 1 admits every block.
    /// Default: 1.
    pub min_frequency: u32,
    /// Use O_DIRECT where the filesystem allows it. Default: true.
    pub direct_io: bool,
    /// Keep the file after shutdown. SGLang's page store reopens it at the next start (same
    /// namespace, page size and page count; else refused naming the difference); the vLLM and
    /// TensorRT-LLM workers keep it for inspection only (not reloaded yet). Default: false.
    pub persist: bool,
    /// Parallel I/O requests the tier keeps in flight. Default: 4.
    pub max_in_flight: usize,
    /// Who does the disk I/O: `builtin` or `nixl` (needs the `nixl` feature). Default: builtin.
    pub io: DiskIo,
}

impl Default for DiskConfig {
    fn default() -> Self {
        Self {
            cache_gb: None,
            cache_blocks: None,
            dir: default_disk_dir(),
            min_frequency: 1,
            direct_io: true,
            persist: false,
            max_in_flight: 4,
            io: DiskIo::Builtin,
        }
    }
}

/// `$TMPDIR/kvbm-<uid>`: private to the user, so users of one machine never share (or fight
/// over) the default directory.
pub(super) fn default_disk_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("kvbm-{uid}"))
}

/// [`TierSize::blocks`] of tier `key`, refused (naming the setting that sized it) when the
/// tier's bytes would not fit `isize::MAX`.
pub(super) fn sized_blocks(key: &str, size: &TierSize, bytes_per_block: usize) -> Result<usize> {
    let n = size.blocks(bytes_per_block)?;
    let fits = n
        .checked_mul(bytes_per_block)
        .is_some_and(|b| isize::try_from(b).is_ok());
    if fits {
        return Ok(n);
    }
    let (setting, value) = match (size.cache_blocks, size.cache_gb) {
        (Some(b), _) => ("cache_blocks", b.to_string()),
        (None, Some(gb)) => ("cache_gb", format!("{gb:?}")),
        (None, None) => ("cache_blocks", n.to_string()),
    };
    Err(Error::invalid_config(
        &format!("{key}.{setting}"),
        value,
        format_args!("{n} blocks of {bytes_per_block} bytes exceed what one process can address"),
    ))
}

impl DiskConfig {
    /// Whether the workers' disk tier outlives the process and is reopened with its blocks:
    /// `persist` with the built-in disk I/O (the NIXL disk tier is not reopened).
    pub fn reopens(&self) -> bool {
        self.persist && self.io == DiskIo::Builtin
    }

    /// `disk.dir` must name a directory: the empty path (the current directory, by accident) is
    /// refused from the TOML file as from the environment.
    pub(super) fn validate_dir(&self) -> Result<()> {
        if self.dir.as_os_str().is_empty() || self.dir.to_str().is_some_and(|d| d.trim().is_empty())
        {
            return Err(Error::invalid_config(
                "disk.dir",
                self.dir.display(),
                "must be a directory path",
            ));
        }
        Ok(())
    }
}
