#!/usr/bin/env python3
"""The module graph of the crate's `src/`, and the layer order it must follow.

Reads every non-test source file under `src/` (comments, `#[cfg(test)]` items and test
files left out), resolves each `crate::`, `super::`, `self::` and child-module path to the
file that defines the name (following `pub use` re-exports; an inline `mod x { ... }` is
a module of its own, in its file, so its `super::` is the module around it), and prints

- the file-level graph's cycles,
- the graph with each top-level module (a folder taken whole) as one node, and its cycles,
- whether every import obeys the layer order written in `src/lib.rs`'s module doc: a block
  of lines `//! - layer N: a, b, c` (bottom = 1); a module may import modules of its own
  layer or below, never above.

Exit status 1 on a cycle at either level or an import against the layer order, 0
otherwise. `--dot` prints the folder-level graph in Graphviz form instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ITEM_RE = re.compile(
    r"\b(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|async\s+|const\s+|extern\s+\"C\"\s+)*"
    r"(fn|struct|enum|trait|type|const|static|mod|union)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MACRO_RE = re.compile(r"macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)")
USE_RE = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
PATH_RE = re.compile(r"\b((?:crate|super|self)(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")
INLINE_MOD_RE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*\{")


def strip_comments_and_strings(src: str) -> str:
    """Source with comments removed and string/char literal contents blanked."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + len(m.group(0)))
            out.append('""')
            i = n if j < 0 else j + len(end)
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", src[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def skip_item(src: str, i: int) -> int:
    """End of the item starting at `i` (after its attributes): past `;` or its block."""
    depth = 0
    while i < len(src):
        c = src[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth == 0:
            return i + 1
        elif c == "{" and depth == 0:
            d = 0
            while i < len(src):
                if src[i] == "{":
                    d += 1
                elif src[i] == "}":
                    d -= 1
                    if d == 0:
                        return i + 1
                i += 1
        i += 1
    return i


TEST_CFG = re.compile(r"#\[cfg\((?:test|all\(test\b[^\]]*|all\([^\]]*\btest\b[^\]]*)\)\]")


def drop_test_items(src: str) -> tuple[str, set[str]]:
    """Removes `#[cfg(test)]` (and `#[cfg(all(test, ..))]`) items; returns the names of
    the child modules declared test-only (`#[cfg(test)] mod tests;`)."""
    test_mods: set[str] = set()
    while True:
        m = TEST_CFG.search(src)
        if not m:
            return src, test_mods
        j = m.end()
        while True:  # further attributes
            k = re.match(r"\s*#\[[^\]]*\]", src[j:])
            if not k:
                break
            j += len(k.group(0))
        md = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*;", src[j:])
        if md:
            test_mods.add(md.group(1))
        end = skip_item(src, j)
        src = src[: m.start()] + src[end:]


def expand_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d as e, *}}` -> [[a, b], [a, c, d], [a, c, *]] (aliases dropped)."""
    tree = re.sub(r"\s+", " ", tree)
    tree = re.sub(r"\s*(::|\{|\}|,)\s*", r"\1", tree).strip()

    def parse(s: str, prefix: list[str]) -> list[list[str]]:
        if "{" not in s:
            s = s.split(" as ")[0]
            return [prefix + [p for p in s.split("::") if p]]
        head, rest = s.split("{", 1)
        rest = rest[: rest.rfind("}")]
        base = prefix + [p for p in head.split("::") if p]
        parts, depth, cur = [], 0, ""
        for ch in rest:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        if cur:
            parts.append(cur)
        res = []
        for p in parts:
            res.extend(parse(p, base))
        return res

    return parse(tree, [])


class Module:
    def __init__(self, path: tuple[str, ...], file: Path):
        self.path = path
        self.file = file
        self.children: set[str] = set()
        self.items: set[str] = set()
        self.reexports: dict[str, list[str]] = {}  # name -> absolute path
        self.globs: list[list[str]] = []  # absolute module paths re-exported with *
        self.refs: list[list[str]] = []  # absolute paths referenced
        self.code = ""
        self.test_mods: set[str] = set()


def split_inline(mods, m: Module) -> None:
    """Makes each inline module (`mod name { ... }`) of `m`'s code a module of its own,
    in the same file: its `self`, `super` and `pub use` are relative to it. Its body is
    blanked in `m.code` (`mod name;` stays, an item of `m`). Two of one name (under
    different `cfg`s) are one module."""
    while True:
        found = INLINE_MOD_RE.search(m.code)
        if not found:
            return
        name, open_at = found.group(1), found.end() - 1
        close_at = skip_item(m.code, open_at)
        body = m.code[open_at + 1: close_at - 1]
        m.code = m.code[:open_at] + ";" + " " * (close_at - open_at - 1) + m.code[close_at:]
        m.children.add(name)
        path = m.path + (name,)
        inner = mods.get(path)
        if inner is None:
            inner = mods[path] = Module(path, m.file)
        inner.code += "\n" + body
        split_inline(mods, inner)


def load(src_root: Path) -> dict[tuple[str, ...], Module]:
    mods: dict[tuple[str, ...], Module] = {}

    def visit(path: tuple[str, ...], file: Path):
        raw = file.read_text()
        code, test_mods = drop_test_items(strip_comments_and_strings(raw))
        m = Module(path, file)
        m.code, m.test_mods = code, test_mods
        mods[path] = m
        # Inline modules (`mod imp { ... }`) are modules of their own, in this file.
        split_inline(mods, m)
        for decl in re.finditer(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*;", code):
            name = decl.group(1)
            if name in test_mods:
                continue
            pre = code[max(0, decl.start() - 200): decl.start()]
            if re.search(r"#\[cfg\([^\]]*loom[^\]]*\)\]\s*$", pre):
                continue
            base = file.parent if file.name in ("mod.rs", "lib.rs") else file.parent / file.stem
            cand = [base / f"{name}.rs", base / name / "mod.rs"]
            child = next((c for c in cand if c.exists()), None)
            if child is None:
                continue
            m.children.add(name)
            visit(path + (name,), child)

    visit((), src_root / "lib.rs")
    return mods


def absolutize(mod: Module, segs: list[str], mods) -> list[str] | None:
    if not segs:
        return None
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("self", "super"):
        cur = list(mod.path)
        i = 0
        while i < len(segs) and segs[i] in ("self", "super"):
            if segs[i] == "super":
                if not cur:
                    return None
                cur.pop()
            i += 1
        return cur + segs[i:]
    if segs[0] in mod.children:
        return list(mod.path) + segs
    return None


def analyse(mods):
    for m in mods.values():
        for it in ITEM_RE.finditer(m.code):
            m.items.add(it.group(2))
        for it in MACRO_RE.finditer(m.code):
            m.items.add(it.group(1))
        for u in USE_RE.finditer(m.code):
            is_pub = bool(u.group(1))
            for p in expand_use_tree(u.group(2)):
                a = absolutize(m, p, mods)
                if a is None:
                    continue
                m.refs.append(a)
                if is_pub:
                    if a and a[-1] == "*":
                        m.globs.append(a[:-1])
                    elif a:
                        m.reexports[a[-1]] = a
        code_wo_use = USE_RE.sub(" ", m.code)
        for pm in PATH_RE.finditer(code_wo_use):
            segs = [s.strip() for s in pm.group(1).split("::")]
            a = absolutize(m, segs, mods)
            if a:
                m.refs.append(a)
        # child-module-relative paths in code: `builder::HeaderBuilder`
        for child in m.children:
            for cm in re.finditer(rf"(?<![:\w]){child}((?:\s*::\s*\w+)+)", code_wo_use):
                segs = [child] + [s.strip() for s in cm.group(1).split("::") if s.strip()]
                m.refs.append(list(m.path) + segs)


def resolve(abs_path: list[str], mods, depth: int = 0) -> Module | None:
    """The module (file) that defines what `abs_path` names."""
    if depth > 20:
        return None
    i = 0
    cur = mods[()]
    while i < len(abs_path) and cur.path + (abs_path[i],) in mods:
        cur = mods[cur.path + (abs_path[i],)]
        i += 1
    if i == len(abs_path) or abs_path[i] == "*":
        return cur
    name = abs_path[i]
    if name in cur.reexports and cur.reexports[name] != abs_path[: i + 1]:
        tgt = resolve(cur.reexports[name] + abs_path[i + 1:], mods, depth + 1)
        if tgt is not None:
            return tgt
    if name in cur.items:
        return cur
    for g in cur.globs:
        tgt_mod = resolve(g, mods, depth + 1)
        if tgt_mod is not None and (name in tgt_mod.items or name in tgt_mod.reexports):
            return resolve(list(tgt_mod.path) + abs_path[i:], mods, depth + 1)
    return cur


def rel(m: Module, root: Path) -> str:
    return str(m.file.relative_to(root.parent))


def top(m: Module) -> str:
    return m.path[0] if m.path else "lib"


def scc(nodes, edges):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            strong(v)
    return out


def layer_order(lib: Path) -> dict[str, int]:
    ranks = {}
    for line in lib.read_text().splitlines():
        m = re.match(r"//!\s*-\s*layer\s+(\d+):\s*(.+)$", line)
        if m:
            for name in re.split(r"[,\s]+", m.group(2).strip().rstrip(".")):
                name = name.strip("`[]")
                if name:
                    ranks[name] = int(m.group(1))
    return ranks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=str(Path(__file__).resolve().parent.parent / "src"))
    ap.add_argument("--dot", action="store_true", help="print the folder-level graph (Graphviz)")
    ap.add_argument("--edges", action="store_true", help="print every file-level edge")
    args = ap.parse_args()
    root = Path(args.src)
    mods = load(root)
    analyse(mods)

    file_edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], set[str]] = {}
    top_edges: dict[str, set[str]] = {}
    top_why: dict[tuple[str, str], set[str]] = {}
    for m in mods.values():
        a = rel(m, root)
        file_edges.setdefault(a, set())
        for ref in m.refs:
            t = resolve(ref, mods)
            if t is None or t.file == m.file or not t.path:
                continue
            # `mod x;` plus `use x::...` in the parent is the parent reaching into its
            # child; an item of a parent used by a child is the child depending on it.
            b = rel(t, root)
            file_edges[a].add(b)
            why.setdefault((a, b), set()).add("::".join(ref))
            ta, tb = top(m), top(t)
            if ta != tb and ta != "lib":
                top_edges.setdefault(ta, set()).add(tb)
                top_why.setdefault((ta, tb), set()).add(f"{a} -> {'::'.join(ref)}")

    if args.dot:
        print("digraph src {")
        for a in sorted(top_edges):
            for b in sorted(top_edges[a]):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    if args.edges:
        for a in sorted(file_edges):
            for b in sorted(file_edges[a]):
                print(f"{a} -> {b}: {', '.join(sorted(why[(a, b)]))}")

    status = 0
    file_cycles = scc(file_edges.keys(), file_edges)
    print(f"files: {len(file_edges)}, file-level imports: {sum(len(v) for v in file_edges.values())}")
    for c in file_cycles:
        status = 1
        print(f"file-level cycle: {' <-> '.join(c)}")
        for a in c:
            for b in sorted(file_edges[a]):
                if b in c:
                    print(f"    {a} -> {b}: {', '.join(sorted(why[(a, b)])[:4])}")
    tops = {top(m) for m in mods.values()} - {"lib"}
    top_cycles = scc(tops, top_edges)
    print(f"top-level modules: {len(tops)}, imports between them: {sum(len(v) for v in top_edges.values())}")
    for c in top_cycles:
        status = 1
        print(f"module-level cycle: {' <-> '.join(c)}")
        for a in c:
            for b in sorted(top_edges.get(a, ())):
                if b in c:
                    print(f"    {a} -> {b}: {'; '.join(sorted(top_why[(a, b)])[:3])}")
    ranks = layer_order(root / "lib.rs")
    if ranks:
        missing = sorted(tops - set(ranks))
        if missing:
            status = 1
            print(f"modules missing from lib.rs's layer order: {', '.join(missing)}")
        for a in sorted(top_edges):
            for b in sorted(top_edges[a]):
                if a in ranks and b in ranks and ranks[a] < ranks[b]:
                    status = 1
                    print(f"against the layer order: {a} (layer {ranks[a]}) imports {b} "
                          f"(layer {ranks[b]}): {'; '.join(sorted(top_why[(a, b)])[:3])}")
    else:
        print("lib.rs states no layer order (`//! - layer N: a, b`)")
        status = 1
    if status == 0:
        print("no cycle; every import follows the layer order in src/lib.rs")
    return status


if __name__ == "__main__":
    sys.exit(main())
