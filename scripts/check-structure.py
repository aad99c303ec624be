#!/usr/bin/env python3
"""The workspace's structure, as evidence for its crate boundaries.

Prints each crate's share of the workspace's Rust lines, the import cycles between the files
of each crate (strongly connected components of the module graph, from `crate::`, `super::`
and `self::` paths outside `#[cfg(test)]` modules) and the non-test functions over 120 lines.
Exits non-zero if a crate holds an import cycle.

Usage: scripts/check-structure.py [--max-share PCT] [--max-fn LINES]
"""
import argparse
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rust_files(path):
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d != "target"]
        for f in filenames:
            if f.endswith(".rs"):
                yield os.path.join(dirpath, f)


def crates():
    base = os.path.join(ROOT, "crates")
    return sorted(
        d for d in os.listdir(base) if os.path.isfile(os.path.join(base, d, "Cargo.toml"))
    )


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def without_tests(text):
    """The text without its `#[cfg(test)]` items (a test module, a test-only function)."""
    out = []
    i = 0
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        j = m.end()
        # The item: up to its `;` or its balanced braces.
        depth = 0
        while j < len(text):
            c = text[j]
            if c == ";" and depth == 0:
                j += 1
                break
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    j += 1
                    break
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def module_of(src, path):
    """A file's module path (a tuple) within its crate's src/."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)


def expand_use(tree):
    """The paths of a `use` tree: `a::{b, c::{d, e}}` -> a::b, a::c::d, a::c::e."""
    tree = re.sub(r"\s+", "", tree)
    m = re.match(r"^([^{]*)\{(.*)\}$", tree)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for c in inner:
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += c == "{"
        depth -= c == "}"
        cur += c
    if cur:
        parts.append(cur)
    return [p for part in parts if part for p in expand_use(prefix + part)]


def paths_in(text):
    found = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        found.extend(expand_use(m.group(1)))
    for m in re.finditer(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text):
        found.append(m.group(1))
    return found


def resolve(path, here, is_mod_file, modules):
    segs = path.split("::")
    if segs[0] == "crate":
        base, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = here if is_mod_file else here[:-1]
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
    else:
        return None
    full = base + tuple(s for s in segs if s not in ("*", "self"))
    # The longest prefix that is a module file.
    for n in range(len(full), -1, -1):
        if full[:n] in modules:
            return full[:n]
    return None


def module_graph(crate_dir):
    src = os.path.join(crate_dir, "src")
    modules = {}
    for path in rust_files(src):
        if os.path.relpath(path, src).split(os.sep)[0] == "bin":
            continue
        modules[module_of(src, path)] = path
    edges = {m: set() for m in modules}
    for mod, path in modules.items():
        is_mod_file = os.path.basename(path) in ("lib.rs", "main.rs", "mod.rs")
        text = without_tests(strip_comments(open(path, encoding="utf-8").read()))
        for p in paths_in(text):
            target = resolve(p, mod, is_mod_file, modules)
            # A module's own parent (lib.rs, a mod.rs) declares it; a path to the parent only
            # is an edge, a path through it to a sibling is resolved to the sibling.
            if target is not None and target != mod and target != ():
                edges[mod].add(target)
    return modules, edges


def sccs(edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def long_functions(path, limit):
    lines = open(path, encoding="utf-8").read().split("\n")
    text = "\n".join(lines)
    kept = without_tests(text)
    found = []
    fn_re = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")
    depth_at_start = None
    i = 0
    while i < len(lines):
        m = fn_re.match(lines[i])
        if m:
            # Skip test functions: those not in the text without tests.
            start = i
            depth, seen_brace, j = 0, False, i
            while j < len(lines):
                code = re.sub(r"//.*", "", lines[j])
                code = re.sub(r'"(?:\\.|[^"\\])*"', '""', code)
                code = re.sub(r"'(?:\\.|[^'\\])'", "''", code)
                if not seen_brace and ";" in code and "{" not in code:
                    break
                for c in code:
                    if c == "{":
                        depth += 1
                        seen_brace = True
                    elif c == "}":
                        depth -= 1
                if seen_brace and depth <= 0:
                    break
                j += 1
            length = j - start + 1
            body = "\n".join(lines[start : j + 1])
            if seen_brace and length > limit and body in kept:
                found.append((m.group(1), start + 1, length))
            i = j + 1 if seen_brace else i + 1
            continue
        i += 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-share", type=float, default=25.0)
    ap.add_argument("--max-fn", type=int, default=120)
    args = ap.parse_args()

    names = crates()
    lines = {}
    for c in names:
        lines[c] = sum(
            open(p, encoding="utf-8").read().count("\n")
            for p in rust_files(os.path.join(ROOT, "crates", c))
        )
    total = sum(lines.values())
    print(f"crate lines (all crates: {total})")
    over = []
    for c in sorted(names, key=lambda c: -lines[c]):
        share = 100.0 * lines[c] / total
        mark = "  over" if share > args.max_share else ""
        if mark:
            over.append(c)
        print(f"  {c:<12} {lines[c]:>6}  {share:5.1f}%{mark}")

    print("\nimport cycles between files (strongly connected components)")
    cycles = 0
    for c in names:
        modules, edges = module_graph(os.path.join(ROOT, "crates", c))
        for comp in sccs(edges):
            cycles += 1
            files = sorted(os.path.relpath(modules[m], ROOT) for m in comp)
            print(f"  {c}: {len(files)} files: {', '.join(files)}")
    if not cycles:
        print("  none")

    print(f"\nnon-test functions over {args.max_fn} lines")
    longs = []
    for c in names:
        for p in sorted(rust_files(os.path.join(ROOT, "crates", c))):
            # Integration tests (a crate's tests/) are test functions throughout.
            if "tests" in os.path.relpath(p, os.path.join(ROOT, "crates", c)).split(os.sep)[:-1]:
                continue
            for name, line, length in long_functions(p, args.max_fn):
                longs.append((length, f"{os.path.relpath(p, ROOT)}:{line} {name}"))
    for length, where in sorted(longs, reverse=True):
        print(f"  {length:>4}  {where}")
    if not longs:
        print("  none")

    print(
        f"\nsummary: {len(over)} crate(s) over {args.max_share:g}%, {cycles} cycle(s), "
        f"{len(longs)} function(s) over {args.max_fn} lines"
    )
    return 1 if cycles or over else 0


if __name__ == "__main__":
    sys.exit(main())
