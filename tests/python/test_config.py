"""Configuration: the same ``Config::load`` as the Rust side -- defaults, the TOML file
(``$KVBM_CONFIG`` or a path), then ``DYN_KVBM_*`` and ``KVBM_*`` variables (ours win)."""

from __future__ import annotations

import json

import pytest

import _engines as E
from kvbm_connector import Config, KvbmError, env_vars, load_config, vllm


def as_dict(c: Config) -> dict:
    return json.loads(c.to_json())


def test_environment_variables_apply(monkeypatch):
    monkeypatch.setenv("KVBM_HOST_CACHE_GB", "2.5")
    monkeypatch.setenv("KVBM_DISK_MIN_FREQUENCY", "3")
    # The default is SHA-256 (collision-resistant keys); the variable opts into xxh3.
    assert as_dict(load_config())["hash"] == "sha256"
    monkeypatch.setenv("KVBM_HASH", "xxh3")
    c = as_dict(load_config())
    assert c["host"]["cache_gb"] == 2.5
    assert c["host"]["cache_blocks"] == 16  # from the fixture
    assert c["disk"]["min_frequency"] == 3
    assert c["hash"] == "xxh3"


def test_dynamo_names_are_accepted_and_ours_win(monkeypatch):
    monkeypatch.delenv("KVBM_HOST_CACHE_BLOCKS")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "1")
    assert as_dict(load_config())["host"]["cache_gb"] == 1.0
    monkeypatch.setenv("KVBM_HOST_CACHE_GB", "3")
    assert as_dict(load_config())["host"]["cache_gb"] == 3.0


def test_config_file_then_environment(monkeypatch, tmp_path):
    f = tmp_path / "kvbm.toml"
    f.write_text('hash = "xxh3"\n[host]\ncache_blocks = 99\n[transfer]\nbatch_blocks = 5\n')
    monkeypatch.delenv("KVBM_HOST_CACHE_BLOCKS")
    monkeypatch.setenv("KVBM_CONFIG", str(f))
    c = as_dict(load_config())
    assert (c["hash"], c["host"]["cache_blocks"], c["transfer"]["batch_blocks"]) == ("xxh3", 99, 5)
    monkeypatch.setenv("KVBM_TRANSFER_BATCH_BLOCKS", "7")
    assert as_dict(load_config())["transfer"]["batch_blocks"] == 7
    g = tmp_path / "other.toml"
    g.write_text("[host]\ncache_blocks = 3\n")
    assert as_dict(load_config(g))["host"]["cache_blocks"] == 3  # a path wins over $KVBM_CONFIG


def test_invalid_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("KVBM_HASH", "md5")
    with pytest.raises(KvbmError) as ei:
        load_config()
    assert ei.value.kind == "invalid_config"
    assert "KVBM_HASH" in str(ei.value) and "md5" in str(ei.value)


def test_a_remote_url_is_checked_by_its_store_when_the_configuration_loads(monkeypatch):
    """Issue 27 item 2: the core checks a URL's form; the store its scheme names checks the
    rest (Redis: host, port, database; TLS files with rediss:// only), when the configuration
    loads, before an engine starts; a scheme no store serves is refused naming what is known."""
    monkeypatch.setenv("KVBM_REMOTE_URL", "http://kvbm:hunter2@10.0.0.5:6379")
    with pytest.raises(KvbmError) as ei:
        load_config()
    assert ei.value.kind == "invalid_config"
    text = str(ei.value)
    assert "KVBM_REMOTE_URL" in text and "http://" in text and "redis://" in text, text
    assert "hunter2" not in text
    monkeypatch.setenv("KVBM_REMOTE_URL", "redis://h:99999")
    with pytest.raises(KvbmError) as ei:
        load_config()
    assert ei.value.kind == "invalid_config" and "port" in str(ei.value)
    monkeypatch.setenv("KVBM_REMOTE_URL", "memory://a-plan")
    assert as_dict(load_config())["remote"]["url"] == "memory://a-plan"


def test_invalid_file_is_refused(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[host]\ncache_blokcs = 3\n")
    with pytest.raises(KvbmError) as ei:
        load_config(f)
    assert ei.value.kind == "invalid_config"
    with pytest.raises(KvbmError) as ei:
        load_config(tmp_path / "missing.toml")
    assert ei.value.kind in ("invalid_config", "io")


def test_env_vars_lists_what_rust_reads():
    names = {name for name, _, _ in env_vars()}
    assert {"KVBM_HOST_CACHE_GB", "KVBM_DISK_CACHE_DIR", "DYN_KVBM_CPU_CACHE_GB"} <= names
    assert all(alias == name.startswith("DYN_") for name, _, alias in env_vars())


def test_toml_round_trip():
    c = Config.from_toml('[disk]\ncache_blocks = 12\n')
    assert as_dict(Config.from_toml(c.to_toml())) == as_dict(c)
    assert Config.defaults().init_timeout_secs == 60.0


def test_vllm_extra_config_names_the_file(vllm_engine, tmp_path, monkeypatch):
    f = tmp_path / "kvbm.toml"
    f.write_text("[host]\ncache_blocks = 2\n")
    monkeypatch.delenv("KVBM_HOST_CACHE_BLOCKS")
    e = vllm_engine(extra={"config": str(f)})
    a = E.prompt(1, 16)
    e.add("a", a)
    e.run()
    e.add("b", a + [1])
    e.run()
    # Only 2 host blocks: the rest of the prefix comes from disk or not at all.
    assert e.matches["b"][0] <= 16
    assert as_dict(e.sched._config)["host"]["cache_blocks"] == 2


def test_no_tier_sized_uses_the_default_host_tier_and_warns(monkeypatch, caplog, vllm_engine):
    """Bug: with no host/disk size the connector silently did nothing. Now the host tier gets a
    default size and start-up says so on the ``kvbm_connector`` logger; a 0 size is respected
    and warned about (stores nothing)."""
    for name in ("KVBM_HOST_CACHE_BLOCKS", "KVBM_DISK_CACHE_BLOCKS"):
        monkeypatch.delenv(name)
    # The default tier (up to 4 GB) holds ~33 million of this test's 128-byte blocks: building
    # that pool in the debug test build took past the fixture's 20 s start-up deadline with two
    # busy processes per core (a fresh-clone run of scripts/test.sh). Real blocks are 10^3-10^5
    # times larger; the deadline is a bound, not a timing.
    monkeypatch.setenv("KVBM_INIT_TIMEOUT_SECS", "300")
    assert "default host tier" in load_config().tier_warning()
    with caplog.at_level("WARNING", logger="kvbm_connector"):
        e = vllm_engine()
    assert any("default host tier" in r.getMessage() for r in caplog.records), caplog.text
    # The default host tier stores a prompt's full blocks (before the fix: none).
    e.add("a", E.prompt(7, 16), max_tokens=2)
    e.run()
    assert sum(
        t["blocks"] for t in e.sched.metrics()["transfers"]
        if (t["src"], t["dst"]) == ("device", "host")
    ) == 4
    monkeypatch.setenv("KVBM_HOST_CACHE_GB", "0")
    assert "nothing" in load_config().tier_warning()
    monkeypatch.setenv("KVBM_HOST_CACHE_GB", "1")
    assert load_config().tier_warning() is None
