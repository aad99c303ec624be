#!/usr/bin/env bash
# Boots guestmem's guest payload under QEMU (Debian's qemu-system-x86) through its PVH entry and
# shows the guest's `dirty` workload making progress: the same workload guestmem runs, in
# another VMM. Not a CI test: SeaBIOS alone takes ~10-20 s here (CPL0 code is slow on kvm_pvm).
# Usage: scripts/qemu-pvh-check.sh [memory, default 2G]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v qemu-system-x86_64 >/dev/null || { apt-get update -qq && apt-get install -y -qq qemu-system-x86 >/dev/null; }
elf=$(mktemp --suffix=.elf)
trap 'rm -f "$elf"' EXIT
cargo run --release -q -p guestmem -- payload --pvh-elf "$elf"
# vCPU 0's control block is at 0x400000: state at +0x80, pages done at +0x88, passes at +0x90.
{ sleep 25; echo 'xp /3gx 0x400080'; sleep 2; echo 'xp /3gx 0x400080'; echo quit; } |
  timeout 120 qemu-system-x86_64 -accel kvm -cpu host -m "${1:-2G}" -kernel "$elf" \
    -display none -nodefaults -serial none -monitor stdio 2>&1 |
  python3 -c '
import re, sys
rows = [l.split() for l in sys.stdin if l.startswith(("0000000000400080", "0000000000400090"))]
vals = [int(v, 16) for r in rows for v in r[1:]]
if len(vals) < 6:
    sys.exit("no answer from the QEMU monitor")
(state, pages1, passes1), (_, pages2, passes2) = vals[0:3], vals[3:6]
print(f"guest under QEMU: {pages1} pages written, {passes1} passes; 2 s later {pages2} pages, {passes2} passes")
if state != 1 or pages2 <= pages1:
    sys.exit("the guest made no progress")
print("the payload runs under QEMU")
'
