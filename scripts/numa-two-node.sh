#!/bin/sh
# Proves NUMA placement on two nodes, which this host does not have: boots a two-node QEMU TCG
# guest (Debian's qemu-system-x86 and kernel, a busybox initramfs built here) and runs
# `guestmem numa` inside it for anon and memfd under interleave:0-1, bind:0 and bind:1.
# The guest has no /dev/kvm, so guest_memfd is not checked there.
#
#   apt-get install -y --no-install-recommends qemu-system-x86 busybox-static linux-image-amd64 cpio
#   scripts/numa-two-node.sh            # prints the guest's tables; log in target/numa-two-node/
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="$ROOT/target/numa-two-node"
SIZE=${SIZE:-128M}

KERNEL=${KERNEL:-$(ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -n 1)}
[ -n "$KERNEL" ] || { echo "no kernel in /boot: apt-get install linux-image-amd64" >&2; exit 1; }
BUSYBOX=$(command -v busybox) || { echo "no busybox: apt-get install busybox-static" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || { echo "no qemu-system-x86_64: apt-get install qemu-system-x86" >&2; exit 1; }
command -v cpio >/dev/null || { echo "no cpio: apt-get install cpio" >&2; exit 1; }

(cd "$ROOT" && cargo build --release -p guestmem)
BIN="$ROOT/target/release/guestmem"

rm -rf "$OUT/root" && mkdir -p "$OUT/root/bin" "$OUT/root/proc" "$OUT/root/sys" "$OUT/root/dev"
cp "$BUSYBOX" "$OUT/root/bin/busybox"
cp "$BIN" "$OUT/root/bin/guestmem"
# guestmem's shared libraries, at the paths the dynamic loader expects.
for lib in $(ldd "$BIN" | grep -o '/[^ ]*'); do
    mkdir -p "$OUT/root$(dirname "$lib")" && cp -L "$lib" "$OUT/root$lib"
done
cat > "$OUT/root/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
echo "guest nodes with memory: \$(cat /sys/devices/system/node/has_memory)"
for backend in anon memfd; do
    for policy in interleave:0-1 bind:0 bind:1; do
        echo "=== guestmem numa --size $SIZE --backend \$backend --numa \$policy"
        /bin/guestmem numa --size $SIZE --backend \$backend --numa \$policy
    done
done
echo "=== a missing node"
/bin/guestmem numa --size $SIZE --backend memfd --numa bind:2 || true
poweroff -f
INIT
chmod +x "$OUT/root/init"
(cd "$OUT/root" && find . | cpio -o -H newc --quiet | gzip -1) > "$OUT/initramfs.cpio.gz"

timeout 600 qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m 1G \
    -object memory-backend-ram,id=m0,size=512M -object memory-backend-ram,id=m1,size=512M \
    -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,cpus=1,memdev=m1 \
    -kernel "$KERNEL" -initrd "$OUT/initramfs.cpio.gz" \
    -append "console=ttyS0 quiet panic=-1" -nographic -no-reboot | tee "$OUT/guest.log"
