#!/usr/bin/env bash
# The compatibility job (README, "Compatibility"; QEMU's migration-compat in spirit): builds the
# previous release from the commit CHANGELOG.md names (cached between runs), then, against this
# checkout's build:
#   - restores the previous release's snapshots (flat: full, map and lazy; store: full and
#     lazy) with this build;
#   - migrates a running guest previous -> this and this -> previous, pre-copy (memory digests
#     at switch-over compared by both sides, and here), post-copy and hybrid, the guest going on
#     each time (a destination of this build also checks every page against the guest's
#     counters), and checks the negotiated protocol on this build's side;
#   - checks that the previous release refuses this build's snapshots by their version.
# Its closing line `compat: N passed, N failed, N skipped` counts in CI's total.
#
# Usage: scripts/compat.sh [--release vX.Y.Z] [--out DIR]
#   --release  the release to test against (default: the newest one in CHANGELOG.md that is
#              not this build's version)
#   --out      where the runs' outputs go (default target/compat)
# Environment: GUESTMEM_RELEASES, the cache of built releases (default
# ~/.cache/guestmem/releases; one directory per release, holding its `guestmem` and `commit`).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
release=""
out="$root/target/compat"
while [ $# -gt 0 ]; do
    case "$1" in
        --release) release=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "compat: unknown argument $1" >&2; exit 2 ;;
    esac
done

this_version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
# "## v0.1.0 — commit <40 hex> (date)": newest first.
releases=$(sed -n 's/^## v\([0-9][0-9.]*\) — commit \([0-9a-f]\{40\}\).*/\1 \2/p' CHANGELOG.md)
if [ -z "$release" ]; then
    release=v$(echo "$releases" | awk -v this="$this_version" '$1 != this { print $1; exit }')
fi
commit=$(echo "$releases" | awk -v r="${release#v}" '$1 == r { print $2; exit }')
if [ -z "$commit" ]; then
    echo "compat: CHANGELOG.md names no commit for release $release" >&2
    exit 2
fi
cache=${GUESTMEM_RELEASES:-$HOME/.cache/guestmem/releases}/$release
old=$cache/guestmem
echo "compat: this build $this_version against $release (commit ${commit:0:12})"

# The previous release, built once from its commit in a worktree of this clone.
if [ -x "$old" ] && [ "$(cat "$cache/commit" 2>/dev/null)" = "$commit" ]; then
    echo "compat: $release is cached in $cache"
else
    if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
        echo "compat: this clone lacks commit $commit of $release: git fetch the project's history" >&2
        exit 2
    fi
    mkdir -p "$cache"
    src=$(mktemp -d "${TMPDIR:-/tmp}/guestmem-$release-XXXXXX")
    git worktree add --detach "$src" "$commit" >/dev/null
    started=$(date +%s)
    echo "compat: building $release from $commit (a full release build; minutes)"
    (cd "$src" && CARGO_TARGET_DIR="$cache/target" nice cargo build --release -p guestmem)
    cp "$cache/target/release/guestmem" "$old.tmp" && mv "$old.tmp" "$old"
    echo "$commit" > "$cache/commit"
    echo "compat: built $release in $(( $(date +%s) - started )) s"
    git worktree remove --force "$src"
    rm -rf "$cache/target"
fi

cargo build --release -p guestmem
new=$root/target/release/guestmem
echo "compat: $("$new" --version); previous: $("$old" --version)"

rm -rf "$out"
mkdir -p "$out"
passed=0
failed=0
pass() { passed=$((passed + 1)); echo "compat: ok   $*"; }
fail() { failed=$((failed + 1)); echo "compat: FAIL $*"; }
json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

"$new" migrate keys --out "$out/keys" >/dev/null

# migrate NAME SRC DST MODE [ARGS]: one migration over a Unix socket, outputs in $out/NAME.*
migrate() {
    local name=$1 src=$2 dst=$3 mode=$4
    shift 4
    local sock=$out/$name.sock d s=0 r=0
    "$dst" migrate receive --listen "unix:$sock" --keys "$out/keys" --run-for 1 --json \
        >"$out/$name.dst.json" 2>"$out/$name.dst.err" &
    d=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    timeout 120 "$src" migrate send --to "unix:$sock" --keys "$out/keys" --mode "$mode" \
        --memory 256M --vcpus 2 --after 0.5 "$@" --json \
        >"$out/$name.src.json" 2>"$out/$name.src.err" || s=$?
    wait "$d" || r=$?
    if [ "$s" != 0 ] || [ "$r" != 0 ]; then
        fail "$name: send exit $s, receive exit $r: $(tail -n 3 "$out/$name.src.err" "$out/$name.dst.err" | tr '\n' ' ')"
        return
    fi
    local cont sd dd pages
    cont=$(json "$out/$name.dst.json" "d['guest_continued']")
    sd=$(json "$out/$name.src.json" "d.get('digest')")
    dd=$(json "$out/$name.dst.json" "d['report'].get('digest')")
    # A destination of this build also checks every page against the guest's counters after
    # the run (post-copy's check of the memory that came; the previous release does not).
    pages=$(json "$out/$name.dst.json" "d.get('pages_consistent', 'not checked')")
    if [ "$cont" != True ]; then
        fail "$name: the guest did not go on on the destination"
    elif [ "$mode" = precopy ] && { [ "$sd" = None ] || [ "$sd" != "$dd" ]; }; then
        fail "$name: memory digests at switch-over differ (source $sd, destination $dd)"
    elif [ "$pages" = False ]; then
        fail "$name: the destination's memory disagrees with the guest's counters"
    else
        pass "$name: the guest went on; memory digests at switch-over source $sd, destination $dd; pages agree with the guest's counters: $pages"
    fi
}

# protocol NAME SIDE: the protocol this build's side negotiated (1 with the previous release).
protocol() {
    local f=$out/$1.$2.json
    if [ "$2" = src ]; then
        json "$f" "d['negotiated']['protocol']"
    else
        json "$f" "d['report']['negotiated']['protocol']"
    fi
}

for mode in precopy postcopy hybrid; do
    verify=()
    [ "$mode" = precopy ] && verify=(--verify)
    migrate "old-to-new-$mode" "$old" "$new" "$mode" "${verify[@]}"
    migrate "new-to-old-$mode" "$new" "$old" "$mode" "${verify[@]}"
    for case in "old-to-new-$mode dst" "new-to-old-$mode src"; do
        set -- $case
        p=$(protocol "$1" "$2" 2>/dev/null || echo none)
        if [ "$p" = 1 ]; then
            pass "$1: this build negotiated protocol 1 with $release"
        else
            fail "$1: this build negotiated protocol '$p' with $release (1 expected)"
        fi
    done
done
migrate "new-to-new-precopy" "$new" "$new" precopy --verify

# restore NAME SNAPSHOT MODE: this build restores the previous release's snapshot.
restore() {
    local name=$1 snap=$2 mode=$3
    if ! "$new" restore "$snap" --mode "$mode" --run-for 0.5 --json >"$out/$name.json" 2>"$out/$name.err"; then
        fail "$name: $(tail -n 3 "$out/$name.err" | tr '\n' ' ')"
        return
    fi
    local cont digests
    cont=$(json "$out/$name.json" "d['guest_continued']")
    digests=$(json "$out/$name.json" "d.get('memory_digests_match')")
    if [ "$cont" != True ] || [ "$digests" = False ]; then
        fail "$name: guest went on: $cont, memory digests match: $digests"
    else
        pass "$name: the guest went on; memory digests match the snapshot's: $digests"
    fi
}

"$old" snapshot --out "$out/old-flat" --vcpus 2 --memory 64M --after 0.5 >"$out/old-flat.log" 2>&1
"$old" snapshot --out "store:$out/old-store/vm" --vcpus 2 --memory 64M --after 0.5 >"$out/old-store.log" 2>&1
for mode in full lazy; do
    restore "old-flat-$mode" "$out/old-flat" "$mode"
    restore "old-store-$mode" "store:$out/old-store/vm" "$mode"
done
restore "old-flat-map" "$out/old-flat" map

# The previous release refuses this build's snapshots by their version, and this build's
# `snapshot info` names the writer of each.
"$new" snapshot --out "$out/new-flat" --vcpus 1 --memory 16M --after 0.2 >/dev/null 2>&1
if "$old" restore "$out/new-flat" --run-for 0.1 >"$out/old-restores-new.out" 2>&1; then
    fail "$release restored a snapshot of this build's newer format"
elif grep -q "version" "$out/old-restores-new.out"; then
    pass "$release refuses this build's snapshot by its version: $(tail -n 1 "$out/old-restores-new.out")"
else
    fail "$release refused this build's snapshot, not by its version: $(tail -n 1 "$out/old-restores-new.out")"
fi
if "$new" snapshot info "$out/old-flat" | grep -q "restores it"; then
    pass "snapshot info of $release's snapshot: $("$new" snapshot info "$out/old-flat" | sed -n 3p)"
else
    fail "snapshot info of $release's snapshot"
fi

echo "compat: $passed passed, $failed failed, 0 skipped"
[ "$failed" = 0 ]
