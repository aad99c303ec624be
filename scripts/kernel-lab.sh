#!/usr/bin/env bash
# The kernel lab: runs guestmem's tests on a kernel other than the host's, inside a QEMU TCG
# guest with emulated AMD SVM and nested paging (so KVM's modules load and /dev/kvm works), two
# vCPUs and two NUMA nodes. It fetches the kernel (Debian's packages, unpacked here, nothing
# installed), builds an initramfs (busybox, the kernel's KVM modules, guestmem, the suite's test
# binaries and the libraries they need), boots it, runs the suite's tests one by one, and writes
# every test's result with the kernel's probe into docs/results/lab-NAME.json. Bounded: QEMU is
# killed at the time limit; a panic, a hang or a missing end marker is a failed run, with the
# console's last lines; a guest that stops early with nothing on its console is booted again
# (the record says so). Exits non-zero if a test failed or the run did not complete.
#
#   scripts/kernel-lab.sh [--kernel debian-7.3|debian-6.1|PATH/bzImage] [--modules DIR]
#                         [--suite gmem] [--timeout SECONDS] [--name NAME] [--out FILE]
#                         [--tcg-thread single|multi] [--cpus 1|2] [--module-param MODULE.ko:PARAMS]
#                         [--fetch-only] [--package-only]
#
# --package-only builds and checks the initramfs, then stops without booting (CI runs it from
# a checkout under /tmp, the directory the guest's init mounts a tmpfs over).
# --kernel PATH boots any kernel image (KVM built in, or its modules in --modules DIR, a
# lib/modules/RELEASE tree). Times measured in the lab are under TCG: never compare them with
# host figures. Needs qemu-system-x86, busybox-static, cpio, xz-utils (scripts/setup.sh).
# --tcg-thread: TCG runs both vCPUs on one host thread (`single`, the default but for the linux
# suites): with a thread per vCPU (`multi`), QEMU 7.2 once let one vCPU run a kernel text site
# another had just patched (an `Oops: int3` in a kernel thread, then a panic). The linux suites
# run `multi`: on one thread TCG switches between the CPUs on a timer (every 10 ms) by asking
# the running one to exit, and QEMU's emulated VMRUN leaves the vector of the interrupt it
# injected as the CPU's pending exception, so an exit request before the next VM exit delivers
# that interrupt a second time wherever the nested guest is; a Linux guest hit in its entry code
# before `swapgs` oopses (`BUG: ENTRY_TRAMPOLINE stack guard page was hit`; docs/linux-guest.md).
# --cpus 1|2 (2): one CPU has no such timer either, but its lab hung now and then.
# A lab that hung (QEMU idle for LAB_IDLE_LIMIT seconds, 300) or whose kernel panicked is booted
# again (LAB_BOOTS_MAX boots in all, 3), and its record says why.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KERNEL=debian-7.3
MODULES=""
SUITE=gmem
TIMEOUT=1500
NAME=""
OUT=""
FETCH_ONLY=no
PACKAGE_ONLY=no
TCG_THREAD=
LAB_CPUS=
MODULE_PARAMS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --kernel) KERNEL=$2; shift 2 ;;
        --modules) MODULES=$2; shift 2 ;;
        --suite) SUITE=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --name) NAME=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --fetch-only) FETCH_ONLY=yes; shift ;;
        --package-only) PACKAGE_ONLY=yes; shift ;;
        --tcg-thread) TCG_THREAD=$2; shift 2 ;;
        --cpus) LAB_CPUS=$2; shift 2 ;;
        --module-param) MODULE_PARAMS="$MODULE_PARAMS${2%%:*} ${2#*:}
"; shift 2 ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "kernel-lab: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
# The Linux guest's suites run a host thread per lab CPU (see the header), the others one.
if [ -z "$TCG_THREAD" ]; then
    case "$SUITE" in linux*) TCG_THREAD=multi ;; *) TCG_THREAD=single ;; esac
fi
LAB_CPUS=${LAB_CPUS:-2}
case "$LAB_CPUS" in 1|2) ;; *) echo "kernel-lab: --cpus takes 1 or 2, not '$LAB_CPUS'" >&2; exit 2 ;; esac
case "$TCG_THREAD" in single|multi) ;; *) echo "kernel-lab: --tcg-thread takes single or multi, not '$TCG_THREAD'" >&2; exit 2 ;; esac
SUITE_FILE="$ROOT/scripts/lab-suites/$SUITE"
[ -f "$SUITE_FILE" ] || { echo "kernel-lab: no suite '$SUITE' ($SUITE_FILE)" >&2; exit 2; }
for tool in qemu-system-x86_64 busybox cpio xz dpkg-deb apt-get depmod python3; do
    command -v "$tool" >/dev/null || {
        echo "kernel-lab: $tool is missing: run scripts/setup.sh" >&2; exit 2; }
done
BUSYBOX=$(command -v busybox)
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    echo "kernel-lab: $BUSYBOX is dynamically linked: install busybox-static" >&2; exit 2
fi
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/guestmem/kernels"
mkdir -p "$CACHE"

# --- The kernel: an image, and (for Debian's) the tree its modules come from. ---------------
# Debian's packages through a private sources list: nothing of the host's apt state is touched.
apt_private() {
    local dir=$CACHE/apt
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    cat > "$dir/sources.list" <<EOF
deb http://deb.debian.org/debian trixie-backports main
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian-security bookworm-security main
deb http://deb.debian.org/debian bookworm-updates main
EOF
    APT_OPTS=(-o "Dir::Etc::SourceList=$dir/sources.list" -o "Dir::State::Lists=$dir/lists"
              -o "Dir::Cache=$dir/cache" -o "Dir::Etc::SourceParts=/dev/null"
              -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
    if [ -z "$(find "$dir/lists" -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
        apt-get "${APT_OPTS[@]}" update -qq
    fi
}
# fetch NAME PACKAGE... : downloads and unpacks the packages into $CACHE/NAME/root once.
fetch() {
    local name=$1; shift
    local dir=$CACHE/$name
    if [ -f "$dir/.complete" ]; then return; fi
    rm -rf "$dir" && mkdir -p "$dir/debs" "$dir/root"
    (cd "$dir/debs" && apt-get "${APT_OPTS[@]}" download "$@")
    for deb in "$dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
    printf '%s\n' "$@" > "$dir/packages"
    touch "$dir/.complete"
}
case "$KERNEL" in
    debian-7.3)
        NAME=${NAME:-debian-7.3}
        if [ ! -f "$CACHE/debian-7.3/.complete" ]; then
            apt_private
            img=linux-binary-unsigned-7.3.4+deb13-cloud-amd64
            apt-cache "${APT_OPTS[@]}" show "$img" >/dev/null 2>&1 || img=linux-binary-7.3.4+deb13-cloud-amd64
            fetch debian-7.3 "$img" linux-modules-7.3.4+deb13-cloud-amd64
        fi
        KROOT=$CACHE/debian-7.3/root
        IMAGE=$(find "$KROOT" -path '*/modules/*' -name 'vmlinuz*' | head -1)
        ;;
    debian-6.1)
        NAME=${NAME:-debian-6.1}
        if [ ! -f "$CACHE/debian-6.1/.complete" ]; then
            apt_private
            # The cloud kernel bookworm's metapackage points at now.
            pkg=$(apt-cache "${APT_OPTS[@]}" depends linux-image-cloud-amd64 2>/dev/null |
                  awk '/Depends: linux-image-6\.1/ { print $2; exit }')
            [ -n "$pkg" ] || { echo "kernel-lab: no bookworm 6.1 cloud kernel in Debian's archive" >&2; exit 1; }
            fetch debian-6.1 "$pkg-unsigned"
        fi
        KROOT=$CACHE/debian-6.1/root
        IMAGE=$(find "$KROOT/boot" -name 'vmlinuz-*' | head -1)
        ;;
    *)
        [ -f "$KERNEL" ] || { echo "kernel-lab: --kernel '$KERNEL' is neither debian-7.3, debian-6.1 nor a file" >&2; exit 2; }
        IMAGE=$(readlink -f "$KERNEL")
        NAME=${NAME:-$(basename "$(dirname "$IMAGE")")}
        KROOT=${MODULES:-}
        ;;
esac
[ -n "${IMAGE:-}" ] && [ -f "$IMAGE" ] || { echo "kernel-lab: no kernel image found for '$KERNEL'" >&2; exit 1; }
if [ $FETCH_ONLY = yes ]; then echo "kernel-lab: $IMAGE"; exit 0; fi
OUT=${OUT:-$ROOT/docs/results/lab-$NAME.json}
WORK="$ROOT/target/kernel-lab/$NAME"
rm -rf "$WORK" && mkdir -p "$WORK"
echo "kernel-lab: kernel $IMAGE ($NAME), suite $SUITE"

# The KVM modules and kernel TLS's with its AES-GCM of the CPU's instructions (migration
# connections hand their records to the kernel where it has both) in load order (dependencies first), from modules.dep (made with depmod when
# the package carries none), decompressed here: the guest's busybox insmod takes plain .ko.
MODDIR=""
if [ -n "$KROOT" ]; then
    MODDIR=$(find "$KROOT" -maxdepth 4 -type d -path '*/lib/modules/*' | head -1)
fi
mkdir -p "$WORK/initramfs/lab/modules"
: > "$WORK/initramfs/lab/modules.order"
# Parameters for a module, a line each: MODULE.ko PARAMS (--module-param kvm-amd.ko:npt=0).
printf '%s' "$MODULE_PARAMS" > "$WORK/initramfs/lab/module-params"
if [ -n "$MODDIR" ] && [ -d "$MODDIR" ]; then
    release=$(basename "$MODDIR")
    if [ ! -f "$MODDIR/modules.dep" ]; then
        depmod -b "$(dirname "$(dirname "$(dirname "$MODDIR")")")" "$release" 2>/dev/null
    fi
    python3 - "$MODDIR/modules.dep" kvm-amd tls aesni-intel > "$WORK/modules.list" <<'PY'
import sys
dep = {}
for line in open(sys.argv[1]):
    mod, _, deps = line.partition(":")
    dep[mod.strip()] = deps.split()
names = sys.argv[2:]
want = [m for m in dep if m.rsplit("/", 1)[-1].split(".ko")[0].replace("_", "-") in names]
order = []
def visit(m):
    for d in dep.get(m, []):
        visit(d)
    if m not in order:
        order.append(m)
for m in want:
    visit(m)
print("\n".join(order))
PY
    while read -r rel; do
        [ -n "$rel" ] || continue
        base=$(basename "$rel"); plain=${base%.xz}; plain=${plain%.zst}; plain=${plain%.gz}
        case "$rel" in
            *.xz) xz -dc "$MODDIR/$rel" > "$WORK/initramfs/lab/modules/$plain" ;;
            *.zst) zstd -dcq "$MODDIR/$rel" > "$WORK/initramfs/lab/modules/$plain" ;;
            *.gz) gzip -dc "$MODDIR/$rel" > "$WORK/initramfs/lab/modules/$plain" ;;
            *) cp "$MODDIR/$rel" "$WORK/initramfs/lab/modules/$plain" ;;
        esac
        echo "$plain" >> "$WORK/initramfs/lab/modules.order"
    done < "$WORK/modules.list"
    echo "kernel-lab: modules $(tr '\n' ' ' < "$WORK/initramfs/lab/modules.order")"
fi

# --- guestmem and the suite's test binaries. --------------------------------------------
# The suite file: one test a line, `PACKAGE TARGET TEST [needs=guest_memfd]`. Built as the
# README's `cargo test --workspace --release` builds them (the same features: after it, as in
# CI, nothing is rebuilt); guestmem's binary comes with them.
cd "$ROOT"
nice -n 10 cargo test --workspace --release --no-run --message-format=json |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["package_id"], m["target"]["name"], m["executable"])
' > "$WORK/all-executables"
GUESTMEM_BIN="$ROOT/target/release/guestmem"
[ -x "$GUESTMEM_BIN" ] || { echo "kernel-lab: $GUESTMEM_BIN was not built" >&2; exit 1; }
awk '!/^#/ && NF >= 3 { print $1, $2 }' "$SUITE_FILE" | sort -u | while read -r pkg target; do
    # package_id names the package: `path+file:///…/crates/cli#guestmem@0.1.0` (or `…#0.1.0`
    # when the directory is the package's name).
    exe=$(awk -v p="$pkg" -v t="$target" '$2 == t && ($1 ~ ("#" p "@") || $1 ~ ("/" p "#")) { print $3; exit }' "$WORK/all-executables")
    [ -n "$exe" ] || { echo "kernel-lab: suite target $pkg/$target was not built" >&2; exit 1; }
    echo "$target $exe"
done > "$WORK/executables"
I="$WORK/initramfs"
mkdir -p "$I/bin" "$I/lab/bin" "$I/proc" "$I/sys" "$I/dev" "$I/tmp" "$I/root" "$I/etc"
cp "$BUSYBOX" "$I/bin/busybox"
# guestmem at a path of the lab's own, whatever the checkout's: the init points the CLI's tests
# at it (GUESTMEM_BIN).
strip --strip-debug -o "$I/bin/guestmem" "$GUESTMEM_BIN"
bins=("$GUESTMEM_BIN")
while read -r target exe; do
    strip --strip-debug -o "$I/lab/bin/$target" "$exe"
    bins+=("$exe")
done < "$WORK/executables"
awk '!/^#/ && NF >= 3' "$SUITE_FILE" | while read -r pkg target test needs; do
    grep -q "^$target " "$WORK/executables" ||
        { echo "kernel-lab: suite target $pkg/$target was not built" >&2; exit 1; }
    echo "$target $test ${needs:-}"
done > "$I/lab/suite"
# The shared libraries every binary names, at the paths the dynamic loader expects.
for b in "${bins[@]}"; do ldd "$b" | grep -o '/[^ ]*'; done | sort -u | while read -r lib; do
    mkdir -p "$I$(dirname "$lib")" && cp -L "$lib" "$I$lib"
done
echo "root:x:0:0:root:/root:/bin/sh" > "$I/etc/passwd"
cp "$ROOT/scripts/kernel-lab-init.sh" "$I/init"
echo "${TEST_TIMEOUT:-600}" > "$I/lab/test-timeout"
# A suite's own files (scripts/lab-suites/SUITE.prepare INITRAMFS-DIR KERNEL-IMAGE), e.g. the
# linux suite's guest kernel and initramfs.
if [ -x "$SUITE_FILE.prepare" ]; then "$SUITE_FILE.prepare" "$I" "$IMAGE"; fi
chmod +x "$I/init"
# What the guest runs must be where the init finds it, and not under a directory the init mounts
# over (a `mount ... DIR` line of its own): there it would be hidden.
check_initramfs() {
    local dir target
    for dir in $(awk '$1 == "mount" { print $NF }' "$I/init"); do
        if [ -n "$(find "$I$dir" -mindepth 1 2>/dev/null | head -1)" ]; then
            echo "kernel-lab: the initramfs holds $(find "$I$dir" -mindepth 1 | head -1 | sed "s|^$I||")," \
                 "which the guest's init hides under the mount on $dir" >&2
            return 1
        fi
    done
    for target in guestmem $(cut -d' ' -f1 "$I/lab/suite" | sort -u); do
        [ "$target" = guestmem ] && target=/bin/guestmem || target=/lab/bin/$target
        [ -x "$I$target" ] || { echo "kernel-lab: the initramfs has no $target" >&2; return 1; }
    done
}
check_initramfs || exit 1
(cd "$I" && find . | cpio -o -H newc --quiet) > "$WORK/initramfs.cpio"
echo "kernel-lab: initramfs $(du -m "$WORK/initramfs.cpio" | cut -f1) MiB (checked: nothing under the init's mounts)"
if [ $PACKAGE_ONLY = yes ]; then echo "kernel-lab: packaged $WORK/initramfs.cpio from $ROOT"; exit 0; fi

# --- Boot, bounded. ----------------------------------------------------------------------
# The lab's CPUs and its two NUMA nodes of 1 GiB: a CPU in each node, or with `--cpus 1` the one
# CPU in node 0 and node 1 memory only.
numa_args() {
    local objects="-object memory-backend-ram,id=m0,size=1G -object memory-backend-ram,id=m1,size=1G"
    if [ "$LAB_CPUS" = 1 ]; then
        echo "-smp 1 $objects -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,memdev=m1"
    else
        echo "-smp 2,sockets=2,cores=1,threads=1 $objects -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,cpus=1,memdev=m1"
    fi
}
# A lab that hung: QEMU idle (under 0.2 s of CPU every 10 s) for IDLE_LIMIT seconds, its CPU
# halted with nothing to wake it (seen now and then on one lab CPU: the lab's kernel went silent,
# no timer of its own firing) or every test waiting at once. QEMU is killed and the lab booted
# once more (the record says why); no test waits that long on an idle lab by itself.
IDLE_LIMIT=${LAB_IDLE_LIMIT:-300}
watch_idle() {
    local parent=$1 start=$2 qpid="" ticks last=0 idle=0
    while kill -0 "$parent" 2>/dev/null; do
        sleep 10
        [ -n "$qpid" ] || qpid=$(pgrep -P "$parent" | head -n 1 || true)
        [ -n "$qpid" ] || continue
        ticks=$(awk '{ print $14 + $15 }' "/proc/$qpid/stat" 2>/dev/null) || return 0
        if [ $((ticks - last)) -lt 20 ]; then idle=$((idle + 10)); else idle=0; fi
        last=$ticks
        if [ "$idle" -ge "$IDLE_LIMIT" ]; then
            echo "the lab hung after $(( $(date +%s) - start )) s (QEMU idle for ${idle} s)" > "$WORK/hung"
            kill "$qpid" 2>/dev/null || true
            return 0
        fi
    done
}
boot() {
    rm -f "$WORK/console.log" "$WORK/results.log"
    local start rc=0 qemu watcher
    start=$(date +%s)
    rm -f "$WORK/hung"
    timeout --kill-after=15 "$TIMEOUT" qemu-system-x86_64 \
        -accel "tcg,thread=$TCG_THREAD" -machine q35 -cpu EPYC,+svm,+npt $(numa_args) -m 2048 \
        -kernel "$IMAGE" -initrd "$WORK/initramfs.cpio" \
        -append "console=ttyS0 loglevel=5 panic=-1 rdinit=/init" \
        -display none -monitor none -nic none -no-reboot \
        -serial "file:$WORK/console.log" -serial "file:$WORK/results.log" \
        2> "$WORK/qemu.stderr" &
    qemu=$!
    watch_idle "$qemu" "$start" &
    watcher=$!
    wait "$qemu" || rc=$?
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    HUNG=$(cat "$WORK/hung" 2>/dev/null || true)
    # QEMU's own complaints, without its warnings about CPUID bits TCG does not emulate.
    grep -v "TCG doesn't support requested feature" "$WORK/qemu.stderr" >&2 || true
    BOOT_SECONDS=$(( $(date +%s) - start ))
    QEMU_RC=$rc
}
# Why the last boot must be tried again (empty: it need not).
retry_reason() {
    if [ -n "$HUNG" ]; then
        echo "$HUNG"
    elif ! grep -q '^@@LAB done' "$WORK/results.log" 2>/dev/null \
        && grep -qaE "$LAB_PANIC" "$WORK/console.log" 2>/dev/null; then
        echo "the lab's kernel panicked after ${BOOT_SECONDS} s: $(grep -m1 -aE "$LAB_PANIC" "$WORK/console.log" | cut -c1-160)"
    elif ! grep -q '^@@LAB done' "$WORK/results.log" 2>/dev/null && [ ! -s "$WORK/console.log" ]; then
        echo "the boot stopped after ${BOOT_SECONDS} s (QEMU exit $QEMU_RC) with nothing on its console"
    fi
}
# The lab's own kernel's panic (a nested guest's, in a test's output, is prefixed `console:`).
LAB_PANIC='^\[ *[0-9]+\.[0-9]+\] Kernel panic - not syncing'
# At most LAB_BOOTS_MAX boots (3): with a thread per lab CPU, QEMU 7.2 now and then runs a
# kernel text site another CPU has just patched (`Oops: int3`, then a panic), early or late.
MAX_ATTEMPTS=${LAB_BOOTS_MAX:-3}
ATTEMPTS=1
RETRY_REASON=""
boot
reason=$(retry_reason)
while [ -n "$reason" ] && [ "$ATTEMPTS" -lt "$MAX_ATTEMPTS" ]; do
    RETRY_REASON="${RETRY_REASON:+$RETRY_REASON; }$reason"
    echo "kernel-lab: $reason; booting once more"
    cp "$WORK/console.log" "$WORK/console-boot-$ATTEMPTS.log" 2>/dev/null || true
    ATTEMPTS=$((ATTEMPTS + 1))
    boot
    reason=$(retry_reason)
done
if [ -n "$reason" ]; then echo "kernel-lab: again: $reason" >&2; fi
mkdir -p "$(dirname "$OUT")"
status=0
python3 "$ROOT/scripts/kernel-lab-record.py" \
    --results "$WORK/results.log" --console "$WORK/console.log" --out "$OUT" \
    --kernel "$NAME" --image "$IMAGE" --suite "$SUITE" --timeout "$TIMEOUT" \
    --seconds "$BOOT_SECONDS" --qemu-exit "$QEMU_RC" --attempts "$ATTEMPTS" \
    --retry-reason "$RETRY_REASON" --tcg-thread "$TCG_THREAD" --cpus "$LAB_CPUS" --commit "$(git -C "$ROOT" rev-parse --short HEAD)" || status=$?
exit "$status"
