//! `kvbm config`: the effective configuration (defaults < file < `DYN_KVBM_*` < `KVBM_*`), the
//! environment variables in effect, and the block counts derived for a block size.

use std::path::PathBuf;
use std::process::ExitCode;

use kvbm_connector::config::{redact_url, Config, ENV_VARS, REMOTE_URL_ENV};
use kvbm_connector::error::{Error, Result};

use crate::ModelArgs;

/// `kvbm config` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArgs {
    /// Configuration file (TOML); the environment still overrides it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Bytes of one block (all ranks) to derive block counts for; default: the model flags.
    #[arg(long)]
    pub bytes_per_block: Option<usize>,
    /// Model shape (used when --bytes-per-block is not given).
    #[command(flatten)]
    pub model: ModelArgs,
}

/// Runs `kvbm config`.
pub fn run(a: &ConfigArgs) -> Result<ExitCode> {
    let config = Config::load(a.config.as_deref())?;
    kvbm_connector::backends::remote::check(&config)?;
    let bpb = match a.bytes_per_block {
        Some(0) => {
            return Err(Error::invalid_argument(
                "--bytes-per-block must be at least 1",
            ))
        }
        Some(n) => n,
        None => a.model.bytes_per_block()?,
    };
    let (host, disk) = config.block_counts(bpb)?;
    println!("# effective configuration (defaults < file < DYN_KVBM_* < KVBM_*)");
    print!("{}", config.to_toml_redacted()?);
    println!();
    println!("# environment variables in effect");
    let mut any = false;
    for v in ENV_VARS {
        if let Ok(val) = std::env::var(v.name) {
            any = true;
            let alias = if v.dynamo_alias { " (Dynamo name)" } else { "" };
            let shown = if v.name == REMOTE_URL_ENV {
                format!("{:?}", redact_url(&val))
            } else {
                v.shown(&val)
            };
            println!("#   {}={} -> {}{alias}", v.name, shown, v.key);
        }
    }
    if !any {
        println!("#   (none)");
    }
    println!();
    println!("# derived for {bpb} bytes per block");
    println!("host_blocks = {host}");
    println!("disk_blocks = {disk}");
    Ok(ExitCode::SUCCESS)
}
