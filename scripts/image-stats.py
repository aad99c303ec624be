#!/usr/bin/env python3
"""What a guest memory image contains (issue 19): zero, dense and duplicate pages, compression,
and how two captures of the same guest differ. Standard library only; .zst images are read
through the `zstd` command, compression is measured with the `zstd` and `lz4` commands when
installed.

  image-stats.py IMAGE                  one capture (raw or .zst, a whole number of 4 KiB pages)
  image-stats.py IMAGE LATER_IMAGE      both, and the pages LATER_IMAGE changed against IMAGE
  image-stats.py --json ...             the same as one JSON object
  image-stats.py --excerpt OUT.raw.zst [--excerpt-size 8M] IMAGE
      cuts a small excerpt for the test suite: IMAGE's 64 KiB chunks, ~80% taken evenly over the
      whole image (its mix of zero, sparse and dense pages) and ~20% as pairs of chunks that hold
      the same pages, other than pages of one repeated byte (so the excerpt has duplicates), in
      address order; writes OUT (zstd -19)
      and OUT's metadata beside it (.json: the source, chunk offsets, sha256 and stats).

Terms: a page is zero when all its 4096 bytes are; a non-zero page is dense when all its 64
64-byte lines are non-zero; a duplicate is a non-zero page equal to an earlier page of the image
(dedup could drop it). Compression ratios are over the concatenated non-zero pages, as a stream.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading

PAGE = 4096
LINE = 64
ZERO_PAGE = bytes(PAGE)
ZERO_LINE = bytes(LINE)
CHUNK_PAGES = 16  # excerpt granularity: 64 KiB
BUCKETS = [(1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 63), (64, 64)]


def open_image(path):
    """Yields the image's content in pieces that are whole pages."""
    if path.endswith(".zst"):
        if not shutil.which("zstd"):
            sys.exit("image-stats: reading .zst needs the zstd command (apt-get install zstd)")
        proc = subprocess.Popen(["zstd", "-dcq", path], stdout=subprocess.PIPE)
        stream = proc.stdout
    else:
        proc, stream = None, open(path, "rb")
    try:
        rest = b""
        while True:
            block = stream.read(1 << 22)
            if not block:
                break
            block = rest + block
            whole = len(block) - len(block) % PAGE
            rest = block[whole:]
            yield block[:whole]
        if rest:
            sys.exit(f"image-stats: {path} is not a whole number of 4 KiB pages")
    finally:
        stream.close()
        if proc and proc.wait() != 0:
            sys.exit(f"image-stats: zstd could not read {path}")


def pages(path):
    for block in open_image(path):
        view = memoryview(block)
        for off in range(0, len(block), PAGE):
            yield view[off:off + PAGE].tobytes()


def nonzero_lines(page):
    if ZERO_LINE not in page:  # fast path: no 64 zero bytes anywhere, so no zero line
        return LINE
    return sum(1 for i in range(0, PAGE, LINE) if page[i:i + LINE] != ZERO_LINE)


def differing_lines(a, b):
    return sum(1 for i in range(0, PAGE, LINE) if a[i:i + LINE] != b[i:i + LINE])


class Compressor:
    """Pipes data through a compression command and counts what comes out."""

    def __init__(self, name, argv):
        self.name, self.out = name, 0
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.reader = threading.Thread(target=self._count)
        self.reader.start()

    def _count(self):
        while True:
            chunk = self.proc.stdout.read(1 << 20)
            if not chunk:
                return
            self.out += len(chunk)

    def write(self, data):
        self.proc.stdin.write(data)

    def finish(self):
        self.proc.stdin.close()
        self.reader.join()
        self.proc.wait()
        return self.out


def compressors():
    found = []
    if shutil.which("lz4"):
        found.append(Compressor("lz4", ["lz4", "-1", "-q", "-c"]))
    if shutil.which("zstd"):
        found.append(Compressor("zstd-1", ["zstd", "-1", "-q", "-c"]))
        found.append(Compressor("zstd-3", ["zstd", "-3", "-q", "-c"]))
    return found


def stats(path, keep_digests=False, compress=True):
    total = zero = dense = dup = in_group = 0
    seen = {}  # digest -> count
    digests = [] if keep_digests else None
    comps = compressors() if compress else []
    nonzero_bytes = 0
    for page in pages(path):
        total += 1
        if page == ZERO_PAGE:
            zero += 1
            if digests is not None:
                digests.append(None)
            continue
        if nonzero_lines(page) == LINE:
            dense += 1
        d = hashlib.blake2b(page, digest_size=16).digest()
        n = seen.get(d, 0)
        if n:
            dup += 1
        seen[d] = n + 1
        if digests is not None:
            digests.append(d)
        nonzero_bytes += PAGE
        for c in comps:
            c.write(page)
    nonzero = total - zero
    in_group = sum(n for n in seen.values() if n > 1)
    pct = lambda a, b: round(100.0 * a / b, 2) if b else 0.0
    result = {
        "image": os.path.basename(path),
        "pages": total,
        "bytes": total * PAGE,
        "zero_pages": zero,
        "zero_pages_percent": pct(zero, total),
        "nonzero_pages": nonzero,
        "dense_of_nonzero_percent": pct(dense, nonzero),
        "duplicate_of_nonzero_percent": pct(dup, nonzero),
        "in_duplicate_groups_of_nonzero_percent": pct(in_group, nonzero),
    }
    for c in comps:
        out = c.finish()
        result[f"{c.name}_ratio_nonzero"] = round(nonzero_bytes / out, 2) if out else None
    return result, digests


def diff(path_a, path_b):
    total = changed = 0
    kinds = {"zero->nonzero": 0, "nonzero->zero": 0, "nonzero->nonzero": 0}
    hist = [0] * (LINE + 1)
    for a, b in zip(pages(path_a), pages(path_b)):
        total += 1
        if a == b:
            continue
        changed += 1
        if a == ZERO_PAGE:
            kinds["zero->nonzero"] += 1
        elif b == ZERO_PAGE:
            kinds["nonzero->zero"] += 1
        else:
            kinds["nonzero->nonzero"] += 1
        hist[differing_lines(a, b)] += 1
    buckets = {}
    for lo, hi in BUCKETS:
        n = sum(hist[lo:hi + 1])
        buckets[f"{lo}" if lo == hi else f"{lo}-{hi}"] = round(100.0 * n / changed, 2) if changed else 0.0
    return {
        "pages": total,
        "changed_pages": changed,
        "changed_percent": round(100.0 * changed / total, 3) if total else 0.0,
        "changed_kinds": kinds,
        "differing_lines_percent_of_changed": buckets,
        "median_differing_lines": median(hist),
    }


def median(hist):
    n = sum(hist)
    if not n:
        return None
    acc = 0
    for lines, count in enumerate(hist):
        acc += count
        if acc * 2 >= n:
            return lines


def print_stats(s):
    print(f"{s['image']}: {s['pages']} pages ({s['bytes'] >> 20} MiB)")
    print(f"  zero pages                        {s['zero_pages_percent']:6.2f} %")
    print(f"  non-zero pages                    {s['nonzero_pages']}")
    print(f"    all 64 lines non-zero (dense)   {s['dense_of_nonzero_percent']:6.2f} %")
    print(f"    duplicates of an earlier page   {s['duplicate_of_nonzero_percent']:6.2f} %"
          f"  (in groups of equal pages: {s['in_duplicate_groups_of_nonzero_percent']:.2f} %)")
    for k, v in s.items():
        if k.endswith("_ratio_nonzero"):
            print(f"    {k[:-len('_ratio_nonzero')]:<8} ratio                  {v}x")


def print_diff(d, a, b):
    print(f"{os.path.basename(b)} against {os.path.basename(a)}:")
    print(f"  changed pages                     {d['changed_pages']} ({d['changed_percent']:.3f} % of all)")
    print("  " + ", ".join(f"{k} {v}" for k, v in d["changed_kinds"].items()))
    print(f"  differing 64-byte lines per changed page (median {d['median_differing_lines']}):")
    for k, v in d["differing_lines_percent_of_changed"].items():
        print(f"    {k:>6} lines  {v:6.2f} %")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1:].upper()]
    return int(text)


def excerpt(path, out, size):
    chunk = CHUNK_PAGES * PAGE
    if size % chunk:
        sys.exit(f"image-stats: --excerpt-size must be a multiple of {chunk >> 10} KiB")
    _, digests = stats(path, keep_digests=True, compress=False)
    # Pages of one repeated byte (the kernel poisons freed init memory with 0xcc) are common
    # enough to land in the excerpt anyway; pairs are chosen for other content.
    uniform = {hashlib.blake2b(bytes([b]) * PAGE, digest_size=16).digest() for b in range(1, 256)}
    nchunks, want = len(digests) // CHUNK_PAGES, size // chunk
    if want > nchunks:
        sys.exit(f"image-stats: {path} is smaller than the excerpt")
    # Pairs of chunks sharing the most equal non-zero pages (first occurrence -> later copy).
    first, shared = {}, {}
    for i, d in enumerate(digests):
        if d is None or d in uniform:
            continue
        if d in first:
            pair = (first[d] // CHUNK_PAGES, i // CHUNK_PAGES)
            if pair[0] != pair[1]:
                shared[pair] = shared.get(pair, 0) + 1
        else:
            first[d] = i
    chosen = set()
    for (a, b), n in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) + 2 > want // 5:
            break
        if a not in chosen and b not in chosen and n >= CHUNK_PAGES // 2:
            chosen.update((a, b))
    # The rest evenly over the image, skipping chunks taken already.
    rest = want - len(chosen)
    step = nchunks / rest
    for k in range(rest):
        c = int(k * step + step / 2)
        while c in chosen:
            c = (c + 1) % nchunks
        chosen.add(c)
    chosen = sorted(chosen)
    raw = out[:-4] if out.endswith(".zst") else out
    wanted, index = set(chosen), 0
    with open(raw + ".part", "wb") as f:
        for block in open_image(path):
            for off in range(0, len(block), chunk):
                if index in wanted:
                    f.write(block[off:off + chunk])
                index += 1
    os.replace(raw + ".part", raw)
    sha = hashlib.sha256(open(raw, "rb").read()).hexdigest()
    s, _ = stats(raw)
    if out.endswith(".zst"):
        subprocess.run(["zstd", "-q", "-f", "-19", "-T2", "--rm", raw, "-o", out], check=True)
    meta_path = (out[:-len(".raw.zst")] if out.endswith(".raw.zst") else out) + ".json"
    src_meta = os.path.splitext(path[:-4] if path.endswith(".zst") else path)[0] + ".json"
    source = json.load(open(src_meta)) if os.path.exists(src_meta) else {}
    meta = {
        "file": os.path.basename(out),
        "bytes": size,
        "sha256_uncompressed": sha,
        "made_by": f"scripts/image-stats.py --excerpt {os.path.basename(out)} --excerpt-size {size >> 20}M "
                   f"{os.path.basename(path)}",
        "source": os.path.basename(path),
        "source_metadata": source,
        "chunk_bytes": chunk,
        "chunks_from_duplicate_pairs": sum(1 for _ in chosen) - rest,
        "source_chunk_offsets": [c * chunk for c in chosen],
        "stats": s,
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print_stats(s)
    print(f"excerpt: {out} ({os.path.getsize(out)} bytes), metadata {meta_path}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="+", help="one image, or an earlier and a later capture of the same guest")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-compress", action="store_true", help="skip the lz4/zstd ratios")
    p.add_argument("--excerpt", metavar="OUT")
    p.add_argument("--excerpt-size", default="8M")
    a = p.parse_args()
    for path in a.images:
        if not os.path.exists(path):
            sys.exit(f"image-stats: no such image {path}")
    if a.excerpt:
        return excerpt(a.images[0], a.excerpt, parse_size(a.excerpt_size))
    if len(a.images) > 2:
        sys.exit("image-stats: give one image, or two captures to compare")
    result = {"images": []}
    for path in a.images:
        s, _ = stats(path, compress=not a.no_compress)
        result["images"].append(s)
        if not a.json:
            print_stats(s)
    if len(a.images) == 2:
        d = diff(*a.images)
        result["diff"] = d
        if not a.json:
            print_diff(d, *a.images)
    if a.json:
        json.dump(result, sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
