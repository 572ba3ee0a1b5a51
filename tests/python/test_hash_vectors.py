"""The cross-check behind tests/hash_vectors.rs: the frozen keys there are recomputed here by an
independent implementation of the key definition (src/identity.rs, docs/architecture.md) on
Python's ``xxhash`` (xxh3-128) and ``hashlib`` (SHA-256), sharing no code with the crate. The expected values are read
out of the Rust test file itself, so the two cannot drift apart unnoticed: change a vector there
without changing the definition and this test fails; change the definition and both fail."""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import pytest
import xxhash  # a missing package fails the run (scripts/test.sh installs it)


RUST_VECTORS = Path(__file__).resolve().parents[1] / "hash_vectors.rs"
NONE_TAG = struct.pack("<I", 0xFFFFFFFF)


MASK64 = (1 << 64) - 1


def h(alg: str, seed: int, data: bytes) -> int:
    """The 128-bit H of the key definition."""
    if alg == "xxh3":
        return xxhash.xxh3_128_intdigest(data, seed=seed)
    digest = hashlib.sha256(struct.pack("<Q", seed) + data).digest()
    return int.from_bytes(digest[:16], "little")


def le128(x: int) -> bytes:
    return x.to_bytes(16, "little")


def salt(alg: str, cache_salt: str | None, lora: str | None) -> int:
    if cache_salt is None and lora is None:
        return 0
    buf = b""
    for field in (cache_salt, lora):
        if field is None:
            buf += NONE_TAG
        else:
            raw = field.encode()
            buf += struct.pack("<I", len(raw)) + raw
    # The salt is a 64-bit seed: the low half of H.
    return h(alg, 0, buf) & MASK64


def keys(alg: str, cache_salt: str | None, lora: str | None) -> list[int]:
    """Sequence hashes of tokens 0..63 in blocks of 16, as the Rust test's `keys` helper."""
    s = salt(alg, cache_salt, lora)
    out: list[int] = []
    tokens = list(range(64))
    for i in range(0, 64, 16):
        b = h(alg, s, struct.pack("<16I", *tokens[i : i + 16]))
        out.append(b if not out else h(alg, s, le128(out[-1]) + le128(b)))
    return out


def rust_assertions() -> list[tuple[str, str, list[int]]]:
    """`(call, args, expected)` for every `keys(...)` and `Salt::new(...)` assertion in the file."""
    text = RUST_VECTORS.read_text()
    found = []
    pattern = re.compile(
        r"assert_eq!\(\s*(keys|Salt::new)\((.*?)\),\s*(\[[^\]]*\]|Salt\(0x[0-9a-f]+\))\s*\);",
        re.S,
    )
    for m in pattern.finditer(text):
        values = [int(v, 16) for v in re.findall(r"0x[0-9a-f]+", m.group(3))]
        found.append((m.group(1), " ".join(m.group(2).split()), values))
    return found


def parse_args(args: str) -> tuple[str, str | None, str | None]:
    parts = [p.strip() for p in args.split(",")]
    alg = {"HashAlgorithm::Xxh3": "xxh3", "HashAlgorithm::Sha256": "sha256"}[parts[0]]

    def opt(p: str) -> str | None:
        return None if p == "None" else re.fullmatch(r'Some\("(.*)"\)', p).group(1)

    return alg, opt(parts[1]), opt(parts[2])


def test_the_rust_file_holds_the_vectors_we_expect():
    found = rust_assertions()
    # 3 key lists and 2 salts for SHA-256, 3 key lists and 1 salt for xxh3.
    assert len(found) == 9, found
    assert sum(1 for call, _, _ in found if call == "keys") == 6
    # Keys are 128 bits: at least one frozen key uses the high half.
    keys_found = [v for call, _, vs in found if call == "keys" for v in vs]
    assert any(v >> 64 for v in keys_found), keys_found


@pytest.mark.parametrize("call,args,expected", rust_assertions())
def test_independent_implementation_gives_the_frozen_keys(call, args, expected):
    alg, cache_salt, lora = parse_args(args)
    if call == "keys":
        assert keys(alg, cache_salt, lora) == expected
    else:
        assert [salt(alg, cache_salt, lora)] == expected


def test_the_check_can_fail():
    # One token changed: the same definition must give other keys, so equality above is not
    # vacuous.
    for alg in ("sha256", "xxh3"):
        s = salt(alg, None, None)
        assert h(alg, s, struct.pack("<16I", *range(1, 17))) != keys(alg, None, None)[0]
