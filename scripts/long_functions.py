#!/usr/bin/env python3
"""List the functions of the library, the tool and the bindings longer than a limit.

Usage: scripts/long_functions.py [--limit N] [--span] [PATH ...]

Scans `src/`, `backends/`, `frameworks/` and `tool/` (or the paths given) for Rust `fn` items
with a body and prints `path:line name length`, longest first, for those over the limit (80 by
default).

The length is the number of *code lines* of the function, from the line of `fn` to the line of
its closing brace, not counting blank lines and lines holding only a comment (doc comments
inside the body included). `--span` prints the plain line span instead (closing line minus
`fn` line plus one), which is what an editor shows.

Test code is left out: any item under `#[cfg(test)]` (an inline `mod tests { … }`, a test-only
helper), the files such an attribute mounts (`#[cfg(test)] mod tests;` → `tests.rs` or
`tests/…`), and every file named `tests.rs` or under a `tests/` folder. Nested functions are
listed on their own and also counted in the function around them.

The lexer strips comments, strings (plain, byte, raw), and char literals, and tells a char
literal from a lifetime, so braces inside them do not count; it does not expand macros, so a
`fn` written inside a `macro_rules!` body is listed like any other.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOTS = ["src", "backends", "frameworks", "tool"]


def strip(text: str) -> str:
    """Return `text` with comments, strings and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_") and text[i - 1] != "b"):
            m = re.match(r'r(#*)"', text[i:])
            close = '"' + m.group(1)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2 : j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2 : j]))
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F}', '{') or a lifetime ('a, 'static).
            if nxt == "\\":
                j = text.find("'", i + 2 if text[i + 2 : i + 3] != "'" else i + 3)
                j = n if j < 0 else j + 1
                out.append(" " * (j - i))
                i = j
            elif i + 2 < n and text[i + 2] == "'":
                out.append("   ")
                i += 3
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def match_brace(code: str, open_at: int) -> int:
    """Index of the brace closing the one at `open_at`."""
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code) - 1


CFG_TEST = re.compile(r"#\[cfg\(\s*test\s*\)\]")
FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def test_spans(code: str) -> tuple[list[tuple[int, int]], list[str]]:
    """Spans of items under `#[cfg(test)]`, and the module names it mounts from other files."""
    spans, mounted = [], []
    for m in CFG_TEST.finditer(code):
        k = m.end()
        # Skip further attributes and whitespace to the item.
        while True:
            rest = code[k:]
            ws = len(rest) - len(rest.lstrip())
            k += ws
            if code.startswith("#[", k):
                depth = 0
                for j in range(k + 1, len(code)):
                    if code[j] == "[":
                        depth += 1
                    elif code[j] == "]":
                        depth -= 1
                        if depth == 0:
                            k = j + 1
                            break
                continue
            break
        semi = code.find(";", k)
        brace = code.find("{", k)
        if semi >= 0 and (brace < 0 or semi < brace):
            mm = re.match(r"(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", code[k:])
            if mm:
                mounted.append(mm.group(1))
            spans.append((m.start(), semi))
        elif brace >= 0:
            spans.append((m.start(), match_brace(code, brace)))
    return spans, mounted


def functions(path: str):
    """Yield (line, name, code_lines, span) for every non-test function with a body in `path`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    code = strip(text)
    lines = code.split("\n")
    skip, _ = test_spans(code)
    for m in FN.finditer(code):
        if any(a <= m.start() <= b for a, b in skip):
            continue
        # The body opens at the first `{` after the signature unless a `;` comes first.
        depth_paren = 0
        k = m.end()
        body = -1
        while k < len(code):
            ch = code[k]
            if ch in "(<[":
                depth_paren += 1
            elif ch in ")>]":
                depth_paren -= 1 if ch != ">" or code[k - 1] != "-" else 0
            elif ch == ";" and depth_paren <= 0:
                break
            elif ch == "{" and depth_paren <= 0:
                body = k
                break
            k += 1
        if body < 0:
            continue
        end = match_brace(code, body)
        first = code.count("\n", 0, m.start())
        last = code.count("\n", 0, end)
        counted = sum(1 for ln in lines[first : last + 1] if ln.strip())
        yield first + 1, m.group(1), counted, last - first + 1


def rust_files(roots: list[str]):
    """Every Rust source file under `roots`, less test files and `#[cfg(test)]` mounts."""
    excluded = set()
    files = []
    for root in roots:
        if os.path.isfile(root):
            files.append(root)
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "tests")
            for name in sorted(filenames):
                if name.endswith(".rs") and name != "tests.rs":
                    files.append(os.path.join(dirpath, name))
    for path in files:
        with open(path, encoding="utf-8") as f:
            _, mounted = test_spans(strip(f.read()))
        base = path[:-3] if not path.endswith(("mod.rs", "lib.rs", "main.rs")) else os.path.dirname(path)
        for name in mounted:
            excluded.add(os.path.normpath(os.path.join(base, name + ".rs")))
            excluded.add(os.path.normpath(os.path.join(base, name)))
    for path in files:
        norm = os.path.normpath(path)
        if norm in excluded or any(norm.startswith(e + os.sep) for e in excluded):
            continue
        yield path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=80, help="list functions longer than this (default 80)")
    ap.add_argument("--span", action="store_true", help="measure the plain line span, blanks and comments included")
    ap.add_argument("paths", nargs="*", help=f"files or folders (default: {' '.join(ROOTS)})")
    args = ap.parse_args()
    roots = args.paths or ROOTS
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not args.paths:
        os.chdir(here)
    rows = []
    for path in rust_files(roots):
        for line, name, counted, span in functions(path):
            length = span if args.span else counted
            if length > args.limit:
                rows.append((length, path, line, name))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    for length, path, line, name in rows:
        print(f"{path}:{line} {name} {length}")
    measure = "line span" if args.span else "code lines (blank and comment-only lines not counted)"
    print(f"{len(rows)} functions over {args.limit} {measure}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
