#!/usr/bin/env bash
# Installs what guestmem needs to build and test on a fresh Debian machine of this project's kind:
# libclang (userfaultfd-sys generates its bindings at build time), binutils (the guest payload is
# assembled at build time), iproute2 (`ip` and `tc`: `bench migrate --link` runs the two sides in
# network namespaces joined by a shaped veth pair), QEMU and zstd (the QEMU peer of
# `bench migrate`, and scripts/capture-guest-memory.sh), busybox-static, cpio and xz-utils (the
# kernel lab, scripts/kernel-lab.sh), flex, bison, bc, libelf-dev and patch (the seeds kernel's
# build, scripts/build-seeds-kernel.sh), python3-matplotlib (scripts/bench-charts) and the Rust
# components the checks use.
# Safe to run again.
set -euo pipefail
need=()
command -v as >/dev/null 2>&1 || need+=(binutils)
command -v ld >/dev/null 2>&1 || need+=(binutils)
ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need+=(libclang-dev)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
# The kernel lab (scripts/kernel-lab.sh): a static busybox for its initramfs, cpio to pack it,
# xz to unpack Debian's kernel modules, kmod's depmod to order them.
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || need+=(busybox-static)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
command -v xz >/dev/null 2>&1 || need+=(xz-utils)
# The seeds kernel's build (scripts/build-seeds-kernel.sh, which CI runs): flex, bison, bc,
# libelf's headers (objtool), patch.
for tool in flex bison bc patch; do command -v $tool >/dev/null 2>&1 || need+=($tool); done
[ -e /usr/include/libelf.h ] || [ -e /usr/include/elfutils/libelf.h ] || need+=(libelf-dev)
# matplotlib for scripts/bench-charts (the SVG charts of docs/benchmarks.md), in the system Python.
/usr/bin/python3 -c 'import matplotlib' >/dev/null 2>&1 || need+=(python3-matplotlib)
# depmod, for Debian's kernel modules in the lab (/usr/sbin, not always on a user's PATH).
command -v depmod >/dev/null 2>&1 || [ -x /usr/sbin/depmod ] || [ -x /sbin/depmod ] || need+=(kmod)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo is missing; install Rust (rustup) first" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# MinIO: the S3 server the chunk store's tests and benches start on loopback (crates/store),
# built from source with Go into ~/.cache/guestmem/bin (about 3-4 minutes; skipped when built).
minio_dir="$HOME/.cache/guestmem/bin"
if [ ! -x "$minio_dir/minio" ]; then
  go=$(command -v go || echo /usr/local/go/bin/go)
  if [ ! -x "$go" ]; then
    echo "setup: Go is missing (needed to build MinIO for the store's tests): install it" >&2
    exit 1
  fi
  mkdir -p "$minio_dir"
  echo "setup: building MinIO into $minio_dir (about 3-4 minutes)"
  GOBIN="$minio_dir" "$go" install github.com/minio/minio@latest
fi
