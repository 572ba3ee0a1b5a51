//! The dependency rules of docs/architecture.md, checked on the source text:
//!
//! * the core (`src/`, except `src/lib.rs` which mounts everything, the tool and the bindings)
//!   names no backend, no engine adapter, not the tool and not the bindings;
//! * backends (`backends/`) name no engine adapter, not the tool and not the bindings;
//! * engine adapters (`frameworks/`) name neither the tool nor the bindings, except each engine's
//!   own Python binding (`frameworks/<engine>/python.rs`, mounted only with the `python` feature),
//!   which names neither the tool nor another engine.
//!
//! "Names" means a path through the module (`crate::backends::…`, `backends::disk`, a `use` of
//! it, or an intra-doc link to it), in code or comments: a doc comment that links a backend
//! makes the core's docs depend on it too.

use std::path::{Path, PathBuf};

/// Where the tool and the bindings live (either under `src/` or in a folder of their own).
const TOOL_AND_BINDINGS: &[&str] = &["src/cli", "src/bin", "src/python", "tool", "python"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `file:line: text` under `dir` (minus `skip`) that names one of `forbidden` as a module
/// path.
fn violations(dir: &str, skip: &[&str], forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join(dir), &mut files);
    let skip: Vec<PathBuf> = skip.iter().map(|s| root.join(s)).collect();
    let mut found = Vec::new();
    for f in files {
        if skip.iter().any(|s| f.starts_with(s)) {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read a source file");
        for (n, line) in text.lines().enumerate() {
            if forbidden.iter().any(|m| names_module(line, m)) {
                let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
                found.push(format!("{rel}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    found
}

/// Whether `line` uses `module` as a path segment: `module::`, `crate::module`,
/// `kvbm_connector::module`, `mod module` or a `#[path]` into its folder.
fn names_module(line: &str, module: &str) -> bool {
    let bytes = line.as_bytes();
    let mut from = 0;
    while let Some(i) = line[from..].find(module) {
        let start = from + i;
        let end = start + module.len();
        from = end;
        let before = if start == 0 {
            None
        } else {
            Some(bytes[start - 1])
        };
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
            continue; // part of a longer word
        }
        let rest = &line[end..];
        let prefix = &line[..start];
        if rest.starts_with("::")
            || prefix.ends_with("::")
            || prefix.trim_end().ends_with("mod")
            || (prefix.ends_with("../") && rest.starts_with('/'))
        {
            return true;
        }
    }
    false
}

#[test]
fn the_core_names_no_backend_adapter_tool_or_bindings() {
    let mut skip = vec!["src/lib.rs"];
    skip.extend(TOOL_AND_BINDINGS);
    let v = violations("src", &skip, &["backends", "frameworks", "cli", "python"]);
    assert!(
        v.is_empty(),
        "the core names an outer layer:\n{}",
        v.join("\n")
    );
}

#[test]
fn backends_name_no_adapter_tool_or_bindings() {
    let v = violations("backends", &[], &["frameworks", "cli", "python"]);
    assert!(
        v.is_empty(),
        "a backend names an outer layer:\n{}",
        v.join("\n")
    );
}

/// An engine's Python binding inside its folder: `frameworks/<engine>/python.rs` and
/// `frameworks/<engine>/python/`.
fn is_engine_binding(violation: &str) -> bool {
    let path = violation.split(':').next().unwrap_or("");
    let parts: Vec<&str> = path.split('/').collect();
    parts.len() >= 3
        && parts[0] == "frameworks"
        && (parts[2] == "python.rs" || (parts.len() >= 4 && parts[2] == "python"))
}

/// `mod python;` in an engine's `mod.rs`, mounted only with the `python` feature (the line
/// before is `#[cfg(feature = "python")]`, or the engine's whole folder is mounted so).
fn is_feature_gated_mount(violation: &str) -> bool {
    let mut it = violation.splitn(3, ':');
    let (Some(path), Some(line), Some(text)) = (it.next(), it.next(), it.next()) else {
        return false;
    };
    if !text.trim().ends_with("mod python;") || !path.ends_with("/mod.rs") {
        return false;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Ok(n) = line.parse::<usize>() else {
        return false;
    };
    let src = std::fs::read_to_string(root.join(path)).unwrap_or_default();
    let lines: Vec<&str> = src.lines().collect();
    let gated = |l: &str| l.trim() == "#[cfg(feature = \"python\")]";
    if n >= 2 && lines.get(n - 2).is_some_and(|l| gated(l)) {
        return true;
    }
    // The engine's folder itself mounted under the feature in frameworks/mod.rs.
    let engine = path.split('/').nth(1).unwrap_or("");
    let parent = std::fs::read_to_string(root.join("frameworks/mod.rs")).unwrap_or_default();
    let pl: Vec<&str> = parent.lines().collect();
    pl.iter()
        .enumerate()
        .any(|(i, l)| l.trim().ends_with(&format!("mod {engine};")) && i > 0 && gated(pl[i - 1]))
}

#[test]
fn adapters_name_neither_the_tool_nor_the_bindings() {
    // An engine's folder holds its adapter and its Python binding (`python.rs`, built with the
    // `python` feature): only the binding uses the bindings' building blocks, and the adapter
    // only mounts it, under that feature.
    let v: Vec<String> = violations("frameworks", &[], &["cli", "python"])
        .into_iter()
        .filter(|v| !is_engine_binding(v) && !is_feature_gated_mount(v))
        .collect();
    assert!(
        v.is_empty(),
        "an adapter names an outer layer:\n{}",
        v.join("\n")
    );
}

#[test]
fn an_engines_binding_names_neither_the_tool_nor_another_engine() {
    let v: Vec<String> = violations("frameworks", &[], &["cli", "tool"])
        .into_iter()
        .filter(|v| is_engine_binding(v))
        .collect();
    assert!(v.is_empty(), "a binding names the tool:\n{}", v.join("\n"));
    for engine in ["vllm", "trtllm", "sglang"] {
        let others: Vec<&str> = ["vllm", "trtllm", "sglang"]
            .into_iter()
            .filter(|e| *e != engine)
            .collect();
        let v: Vec<String> = violations(&format!("frameworks/{engine}"), &[], &others)
            .into_iter()
            .filter(|v| is_engine_binding(v))
            .collect();
        assert!(
            v.is_empty(),
            "{engine}'s binding names another engine:\n{}",
            v.join("\n")
        );
    }
}

#[test]
fn the_binding_exceptions_see_only_bindings_and_gated_mounts() {
    assert!(is_engine_binding(
        "frameworks/vllm/python.rs:3: use crate::python::x;"
    ));
    assert!(is_engine_binding(
        "frameworks/vllm/python/read.rs:3: use crate::python::x;"
    ));
    assert!(!is_engine_binding(
        "frameworks/vllm/mod.rs:3: use crate::python::x;"
    ));
    assert!(!is_engine_binding(
        "frameworks/detect.rs:3: use crate::python::x;"
    ));
    // frameworks/vllm/mod.rs mounts its binding under the feature; its first line does not.
    let v = violations("frameworks/vllm", &[], &["python"]);
    let mount = v.iter().find(|l| l.trim_end().ends_with("mod python;"));
    assert!(mount.is_some_and(|m| is_feature_gated_mount(m)), "{v:?}");
    assert!(!is_feature_gated_mount(
        "frameworks/vllm/mod.rs:1: pub(crate) mod python;"
    ));
}

#[test]
fn the_check_sees_each_way_of_naming_a_module() {
    for line in [
        "use crate::backends::disk::DiskTier;",
        "    crate::backends::cuda::copy_batch(src, dst, pairs)",
        "/// see [`backends::nixl::VerifiedRemote`]",
        "#[path = \"../backends/mod.rs\"]",
        "pub mod backends;",
        "use kvbm_connector::backends::memory::MemoryTier;",
    ] {
        assert!(names_module(line, "backends"), "{line}");
    }
    for line in [
        "// the storage backends live elsewhere",
        "let mybackends::x = 1;",
        "/// built by the Python package",
        "my_cli::run()",
    ] {
        assert!(
            !names_module(line, "backends") && !names_module(line, "cli"),
            "{line}"
        );
    }
}
