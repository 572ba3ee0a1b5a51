//! Fuzz tests of the configuration parser (issue 13, "keep them fixed"): arbitrary TOML text,
//! near-valid TOML over every key with values of any type and size, and arbitrary environment
//! values for every variable of `ENV_VARS`. Each gives `Ok` — a configuration that validates,
//! whose `disk.dir` is not empty and whose tier sizes are addressable or refused naming the
//! setting — or an `InvalidConfig` error; never a panic. Cases are bounded (a few hundred per
//! property) so the file runs in seconds.

use kvbm_connector::config::{Config, ENV_VARS};
use kvbm_connector::error::{Error, ErrorKind};
use proptest::prelude::*;

/// Block sizes the sizes are derived for: tiny, a real model's, and one that overflows easily.
const BYTES_PER_BLOCK: [usize; 3] = [1, 65_536, usize::MAX / 2];

/// What every configuration that loaded promises.
fn check_loaded(c: &Config) {
    assert!(c.validate().is_ok());
    assert!(
        !c.disk.dir.as_os_str().is_empty(),
        "empty disk.dir accepted"
    );
    for gb in [c.host.cache_gb, c.disk.cache_gb].into_iter().flatten() {
        assert!(gb.is_finite() && gb >= 0.0, "cache_gb {gb}");
    }
    for bpb in BYTES_PER_BLOCK {
        match c.block_counts(bpb) {
            Ok((host, disk)) => {
                for n in [host, disk] {
                    let bytes = n.checked_mul(bpb).expect("sizes are addressable");
                    assert!(isize::try_from(bytes).is_ok(), "{n} blocks of {bpb}");
                }
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
                assert!(e.context_value("setting").is_some(), "{e} names no setting");
            }
        }
    }
}

fn check_refused(e: &Error) {
    assert_eq!(e.kind(), ErrorKind::InvalidConfig, "{e}");
}

/// A TOML value of any type, sized from tiny to extreme.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        (0i64..10).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        Just("1e300".to_string()),
        Just("-0.0".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("\"\"".to_string()),
        Just("\"  \"".to_string()),
        "[a-z0-9/._:-]{0,12}".prop_map(|s| format!("{s:?}")),
        any::<bool>().prop_map(|b| b.to_string()),
        Just("[]".to_string()),
    ]
}

/// One key of the file format (a table, its key) or an unknown one.
fn toml_key() -> impl Strategy<Value = (Option<&'static str>, &'static str)> {
    prop_oneof![
        Just((None, "hash")),
        Just((None, "init_timeout_secs")),
        Just((None, "bogus")),
        Just((Some("host"), "cache_gb")),
        Just((Some("host"), "cache_blocks")),
        Just((Some("disk"), "cache_gb")),
        Just((Some("disk"), "cache_blocks")),
        Just((Some("disk"), "dir")),
        Just((Some("disk"), "min_frequency")),
        Just((Some("disk"), "direct_io")),
        Just((Some("disk"), "persist")),
        Just((Some("disk"), "max_in_flight")),
        Just((Some("disk"), "io")),
        Just((Some("transfer"), "max_concurrency")),
        Just((Some("transfer"), "batch_blocks")),
        Just((Some("tcp"), "leader_addr")),
        Just((Some("tcp"), "auth_token")),
        Just((Some("remote"), "dir")),
        Just((Some("remote"), "instance")),
        Just((Some("remote"), "publish_every")),
        Just((Some("nope"), "x")),
    ]
}

/// A TOML document of `entries`, top-level keys first, each table once.
fn document(entries: &[((Option<&'static str>, &'static str), String)]) -> String {
    let mut out = String::new();
    let mut tables: Vec<&str> = Vec::new();
    for ((table, key), value) in entries {
        match table {
            None => out.push_str(&format!("{key} = {value}\n")),
            Some(t) if !tables.contains(t) => tables.push(t),
            Some(_) => {}
        }
    }
    for t in tables {
        out.push_str(&format!("[{t}]\n"));
        let mut seen = Vec::new();
        for ((table, key), value) in entries {
            if *table == Some(t) && !seen.contains(key) {
                seen.push(*key);
                out.push_str(&format!("{key} = {value}\n"));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    /// Arbitrary text as a file.
    #[test]
    fn arbitrary_text(text in ".{0,160}") {
        match Config::from_toml_str(&text) {
            Ok(c) => check_loaded(&c),
            Err(e) => check_refused(&e),
        }
    }

    /// Every key, values of any type and size.
    #[test]
    fn near_valid_files(entries in proptest::collection::vec((toml_key(), toml_value()), 0..8)) {
        let text = document(&entries);
        match Config::from_toml_str(&text) {
            Ok(c) => check_loaded(&c),
            Err(e) => check_refused(&e),
        }
    }

    /// Any variables of `ENV_VARS` set to any text: the error names the variable.
    #[test]
    fn arbitrary_environment(
        vars in proptest::collection::vec(
            (0..ENV_VARS.len(), prop_oneof![
                ".{0,12}",
                "[0-9.e+-]{0,24}",
                Just(String::new()),
                Just("1e300".to_string()),
                Just("18446744073709551616".to_string()),
            ]),
            0..5,
        )
    ) {
        let env: Vec<(&str, String)> =
            vars.iter().map(|(i, v)| (ENV_VARS[*i].name, v.clone())).collect();
        let lookup = |k: &str| {
            env.iter().rev().find(|(name, _)| *name == k).map(|(_, v)| v.clone())
        };
        let mut c = Config::default();
        match c.apply_env(lookup) {
            Ok(()) => check_loaded(&c),
            Err(e) => {
                check_refused(&e);
                let named = env.iter().any(|(name, _)| e.to_string().contains(name));
                prop_assert!(named, "{e} names no variable of {env:?}");
            }
        }
    }
}

/// The cases fixed by issue 13, item 11, pinned.
#[test]
fn empty_dir_and_huge_sizes_are_refused_naming_the_setting() {
    let e = Config::from_toml_str("[disk]\ndir = \"\"\n").unwrap_err();
    assert_eq!(e.context_value("setting"), Some("disk.dir"), "{e}");
    let c = Config::from_toml_str("[host]\ncache_gb = 1e300\n").expect("finite");
    let e = c.block_counts(65_536).unwrap_err();
    assert_eq!(e.context_value("setting"), Some("host.cache_gb"), "{e}");
    let c = Config::from_toml_str("[disk]\ncache_blocks = 9223372036854775807\n").expect("parses");
    let e = c.block_counts(2).unwrap_err();
    assert_eq!(e.context_value("setting"), Some("disk.cache_blocks"), "{e}");
}
