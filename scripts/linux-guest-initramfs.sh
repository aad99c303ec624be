#!/usr/bin/env bash
# Builds the initramfs of the Linux guest that guestmem boots in the kernel lab (issue 42):
# busybox-static and an init that prints `counter N UPTIME` on the console every 100 ms, so
# that a test sees the guest go on (past its value at a pause) across a restore or a migration.
#
#   scripts/linux-guest-initramfs.sh OUT.cpio.gz
#
# Needs busybox-static, cpio and gzip (scripts/setup.sh installs them).
set -euo pipefail
OUT=${1:?usage: linux-guest-initramfs.sh OUT.cpio.gz}
BUSYBOX=$(command -v busybox) || { echo "linux-guest-initramfs: busybox is missing" >&2; exit 2; }
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    echo "linux-guest-initramfs: $BUSYBOX is dynamically linked: install busybox-static" >&2; exit 2
fi
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
mkdir -p "$DIR/bin" "$DIR/proc" "$DIR/sys" "$DIR/dev" "$DIR/tmp"
cp "$BUSYBOX" "$DIR/bin/busybox"
cat > "$DIR/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
echo "guest: init up at $(cut -d' ' -f1 /proc/uptime) s, $(grep -c ^processor /proc/cpuinfo) CPUs"
i=0
while true; do
    echo "counter $i $(cut -d' ' -f1 /proc/uptime)"
    i=$((i + 1))
    usleep 100000
done
INIT
chmod +x "$DIR/init"
(cd "$DIR" && find . | cpio -o -H newc --quiet) | gzip -9 > "$OUT"
