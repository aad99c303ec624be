#!/usr/bin/env bash
# Builds the initramfs of the Linux guest that guestmem boots in the kernel lab (issue 42):
# busybox-static and an init that prints `counter N UPTIME` on the console every 100 ms, so
# that a test sees the guest go on (past its value at a pause) across a restore or a migration;
# it keeps a 64 MiB tmpfs file whose MD5 it prints at boot (`data SUM`) and every 10 s (`check
# SUM date SECONDS uptime SECONDS`), and a process heap it rewrites all the time.
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
mkdir -p "$DIR/bin" "$DIR/proc" "$DIR/sys" "$DIR/dev" "$DIR/tmp" "$DIR/data"
cp "$BUSYBOX" "$DIR/bin/busybox"
cat > "$DIR/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs -o size=80m tmpfs /data 2>/dev/null || mkdir -p /data
echo "guest: init up at $(cut -d' ' -f1 /proc/uptime) s, $(grep -c ^processor /proc/cpuinfo) CPUs"
# 64 MiB of data that must survive every restore and migration: 64 distinct MiB (a random MiB,
# each copy shifted by its index), its MD5 printed once now and again every 10 s.
dd if=/dev/urandom of=/tmp/seed bs=1024 count=1024 2>/dev/null
i=0
while [ $i -lt 64 ]; do echo "$i"; cat /tmp/seed; i=$((i + 1)); done > /data/file
rm /tmp/seed
echo "data $(md5sum < /data/file | cut -c1-32)"
(while true; do
    sleep 10
    echo "check $(md5sum < /data/file | cut -c1-32) date $(date +%s) uptime $(cut -d' ' -f1 /proc/uptime)"
done) &
# A process whose heap (an array of 32768 numbers) is rewritten twice a second, at low
# priority: memory that changes while snapshots and migrations copy it.
awk 'BEGIN { for (n = 0; ; n++) { for (i = 0; i < 32768; i++) a[i] = n + i; system("usleep 500000") } }' &
renice -n 19 $! > /dev/null
i=0
while true; do
    echo "counter $i $(cut -d' ' -f1 /proc/uptime)"
    i=$((i + 1))
    usleep 100000
done
INIT
chmod +x "$DIR/init"
(cd "$DIR" && find . | cpio -o -H newc --quiet) | gzip -9 > "$OUT"
