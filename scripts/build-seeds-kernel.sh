#!/bin/sh
# Builds the seeds kernel: a Linux source (by default Debian's linux-source-7.3 from
# trixie-backports, pinned to one upload), the ported KVM Userfault, guest_memfd write() and
# guest_memfd userfaultfd patches of kernel/seeds/patches/, and a minimal configuration for the
# kernel lab (`make tinyconfig` plus kernel/seeds/config.fragment: KVM and KVM_AMD built in,
# NUMA, userfaultfd, what a busybox initramfs needs; no modules).
#
# The image is cached under $GUESTMEM_CACHE/kernels/seeds-<hash>/bzImage (default
# ~/.cache/guestmem), the hash covering the base source, the patches, the fragment and the
# recipe version below: a second run with nothing changed builds nothing. The last line of
# stdout is the image's path.
#
#   apt-get install -y flex bison bc libelf-dev       # what the kernel build needs
#   scripts/build-seeds-kernel.sh [--source TARBALL|DEB|DIR] [--jobs N] [--keep-tree]
#
# --source: a kernel source tarball (.tar.xz/.tar.gz), a Debian linux-source-*.deb or an
# unpacked source directory; without it the pinned Debian package is downloaded with a private
# apt list (this machine's apt configuration is left alone). Patches that do not apply stop the
# build, naming the patch.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SEEDS="$ROOT/kernel/seeds"
CACHE=${GUESTMEM_CACHE:-$HOME/.cache/guestmem}
RECIPE=1
DEB_PACKAGE=linux-source-7.3
DEB_VERSION=7.3.4-1~bpo13+1
DEB_SHA256=703e369ddd4cce971452f5a593ee55df3a5c10c83caf0fa0df039633ed181ee3
DEB_SUITE="deb http://deb.debian.org/debian trixie-backports main"

SOURCE=
JOBS=$(nproc)
KEEP_TREE=0
while [ $# -gt 0 ]; do
    case "$1" in
        --source) SOURCE=$2; shift 2 ;;
        --jobs) JOBS=$2; shift 2 ;;
        --keep-tree) KEEP_TREE=1; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "build-seeds-kernel: unknown argument $1" >&2; exit 2 ;;
    esac
done

log() { echo "build-seeds-kernel: $*" >&2; }
die() { log "$*"; exit 1; }

for tool in gcc make flex bison bc perl xz gzip patch sha256sum; do
    command -v "$tool" >/dev/null || die "missing $tool: apt-get install -y flex bison bc libelf-dev xz-utils patch"
done
[ -e /usr/include/libelf.h ] || [ -e /usr/include/elfutils/libelf.h ] \
    || die "missing libelf headers (objtool needs them): apt-get install -y libelf-dev"

# The base source, as a file (tarball or .deb) or a directory.
if [ -z "$SOURCE" ]; then
    APT="$CACHE/apt"
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$CACHE/src"
    echo "$DEB_SUITE" > "$APT/sources.list"
    DEB="$CACHE/src/${DEB_PACKAGE}_$(echo "$DEB_VERSION" | sed 's/:/%3a/')_all.deb"
    if [ ! -s "$DEB" ]; then
        log "downloading $DEB_PACKAGE=$DEB_VERSION from trixie-backports"
        set -- -o Dir::Etc::SourceList="$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null \
            -o Dir::State::Lists="$APT/lists" -o Dir::Cache="$APT/cache"
        apt-get "$@" update >&2 || die "apt-get update of the private trixie-backports list failed"
        (cd "$CACHE/src" && apt-get "$@" download "$DEB_PACKAGE=$DEB_VERSION" >&2) \
            || die "$DEB_PACKAGE=$DEB_VERSION is not in trixie-backports any more: pass --source"
    fi
    echo "$DEB_SHA256  $DEB" | sha256sum -c --quiet >&2 \
        || die "$DEB does not have the pinned sha256 $DEB_SHA256: remove it, or pass --source"
    SOURCE=$DEB
fi
[ -e "$SOURCE" ] || die "no such source: $SOURCE"
SOURCE=$(cd "$(dirname "$SOURCE")" && pwd)/$(basename "$SOURCE")
if [ -d "$SOURCE" ]; then
    [ -f "$SOURCE/Makefile" ] && [ -d "$SOURCE/virt/kvm" ] || die "$SOURCE is not a kernel source tree"
    # A directory is named by its file list with sizes and modification times.
    BASE_ID=$(cd "$SOURCE" && find . -type f ! -path './.git/*' -printf '%P %s %T@\n' | LC_ALL=C sort | sha256sum | cut -c1-64)
else
    BASE_ID=$(sha256sum "$SOURCE" | cut -c1-64)
fi

PATCHES=$(ls "$SEEDS"/patches/*.patch | LC_ALL=C sort)
[ -n "$PATCHES" ] || die "no patches in $SEEDS/patches"
HASH=$( {
    echo "recipe $RECIPE"
    echo "base $BASE_ID"
    for p in $PATCHES; do echo "patch $(basename "$p") $(sha256sum < "$p" | cut -c1-64)"; done
    echo "config $(sha256sum < "$SEEDS/config.fragment" | cut -c1-64)"
} | sha256sum | cut -c1-16)
OUT="$CACHE/kernels/seeds-$HASH"
if [ -s "$OUT/bzImage" ]; then
    log "cached: nothing changed since $(cat "$OUT/built-at" 2>/dev/null || echo 'the last build')"
    echo "$OUT/bzImage"
    exit 0
fi

WORK="$CACHE/kbuild/seeds-$HASH"
rm -rf "$WORK" && mkdir -p "$WORK/src"
log "unpacking $SOURCE into $WORK/src"
case "$SOURCE" in
    *.deb)
        mkdir -p "$WORK/deb"
        dpkg-deb -x "$SOURCE" "$WORK/deb"
        TARBALL=$(ls "$WORK"/deb/usr/src/linux-source-*.tar.* | head -n 1)
        [ -n "$TARBALL" ] || die "$SOURCE holds no usr/src/linux-source-*.tar.*"
        tar -xf "$TARBALL" -C "$WORK/src" --strip-components=1
        rm -rf "$WORK/deb" ;;
    *.tar.*|*.tgz) tar -xf "$SOURCE" -C "$WORK/src" --strip-components=1 ;;
    *) [ -d "$SOURCE" ] || die "$SOURCE: give a .tar.xz, .tar.gz, .deb or a directory"
       cp -a "$SOURCE/." "$WORK/src/" && rm -rf "$WORK/src/.git" ;;
esac
SRC="$WORK/src"
for p in $PATCHES; do
    log "applying $(basename "$p")"
    patch -d "$SRC" -p1 --forward --batch --no-backup-if-mismatch -F0 -s < "$p" \
        || die "$(basename "$p") does not apply to $SOURCE (see the rejects under $SRC)"
done

BUILD="$WORK/build"
mkdir -p "$BUILD"
make -C "$SRC" O="$BUILD" tinyconfig >/dev/null
"$SRC/scripts/kconfig/merge_config.sh" -m -O "$BUILD" "$BUILD/.config" "$SEEDS/config.fragment" >/dev/null
make -C "$SRC" O="$BUILD" olddefconfig >/dev/null
# Every option of the fragment must have survived Kconfig's dependency resolution.
grep -E '^CONFIG_[A-Z0-9_]+=' "$SEEDS/config.fragment" | while IFS='=' read -r key want; do
    got=$(grep -E "^$key=" "$BUILD/.config" | cut -d= -f2- || true)
    if [ "$want" = n ]; then
        [ -z "$got" ] || die "$key is $got in the configuration, the fragment wants it off"
    else
        [ "$got" = "$want" ] || die "$key is '${got:-not set}' in the configuration, the fragment wants $want (a dependency is missing)"
    fi
done

log "building bzImage with $JOBS jobs (log: $WORK/build.log)"
START=$(date +%s)
if ! nice -n 10 make -C "$SRC" O="$BUILD" -j"$JOBS" bzImage > "$WORK/build.log" 2>&1; then
    grep -E 'error|Error' "$WORK/build.log" | head -n 20 >&2
    die "the kernel build failed (log: $WORK/build.log)"
fi
SECONDS_TAKEN=$(( $(date +%s) - START ))

mkdir -p "$OUT"
cp "$BUILD/arch/x86/boot/bzImage" "$OUT/bzImage.tmp"
cp "$BUILD/.config" "$OUT/config"
{
    echo "base: $SOURCE"
    echo "base_sha256: $BASE_ID"
    for p in $PATCHES; do echo "patch: $(basename "$p")"; done
    echo "kernel_release: $(cat "$BUILD/include/config/kernel.release")"
    echo "build_seconds: $SECONDS_TAKEN"
    echo "jobs: $JOBS"
} > "$OUT/build-info"
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/built-at"
mv "$OUT/bzImage.tmp" "$OUT/bzImage"
[ "$KEEP_TREE" = 1 ] || rm -rf "$WORK"
log "built in ${SECONDS_TAKEN}s"
echo "$OUT/bzImage"
