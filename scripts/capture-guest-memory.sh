#!/usr/bin/env bash
# Captures real Linux guest memory for guestmem's benchmarks and tests (issue 19).
#
# Boots Debian's cloud kernel under QEMU TCG (a stock kernel does not boot under this host's KVM)
# with an initramfs built here from busybox-static and an /init script, whose workload resembles a
# server guest: a root file system of kernel modules, generated log/CSV text and a gzipped
# database table in page cache, busybox syslogd/klogd/crond/httpd running; then (after the boot
# capture) in tmpfs a copy of the modules, rotated logs, the database unpacked (slotted 4 KiB
# pages, partly empty) and a /dev/urandom blob; anonymous heap (busybox awk holding a log in
# arrays, sort holding its lines, dd processes holding file data in their buffers); and a loop
# that keeps rewriting a little of it (log appends, patches of 1-25 64-byte lines at random
# offsets, awk entries). Under load the guest uses ~70% of its RAM; the sizes scale with -m.
# Over QMP (scripts/qmp-capture.py) it saves the whole RAM (`pmemsave`, guest-physical 0..RAM)
#   boot   when the init prints GUESTMEM-BOOTED (services up, nothing else yet),
#   load   --load-seconds after boot, once the init has printed GUESTMEM-LOADED,
#   load2  --gap seconds after load (what the rewriting loop and the kernel re-dirtied).
# Each is stored zstd-compressed (zstd -3 -T2) with a JSON metadata file beside it, in
# $GUESTMEM_IMAGES or ~/.cache/guestmem/images/: linux-2G-boot.raw.zst, linux-2G-boot.json, ...,
# and the guest's console as linux-2G-console.log.
# Nothing is downloaded but the Debian packages it installs when missing (qemu-system-x86,
# linux-image-cloud-amd64, busybox-static, zstd, cpio). Safe to re-run: captures are replaced.
# `scripts/image-stats.py IMAGE [IMAGE2]` prints what a capture contains.
#
# `--workload app` runs another kind of guest instead (scripts/capture-app-workload.py, with
# Debian's python3 and its standard library copied into the initramfs): an application server's
# managed heap (CPython objects, rendered JSON) beside an embedded SQLite database on tmpfs and
# its page cache; its captures are named linux-2G-app-boot.raw.zst, linux-2G-app-load.raw.zst, ...
#
# Usage:
#   scripts/capture-guest-memory.sh [-m 2G|1G|512M] [--workload server|app] [--load-seconds 40]
#                                   [--gap 5] [--no-load2] [--out DIR]
#   scripts/capture-guest-memory.sh --excerpt FROM.raw.zst TO.raw.zst [--size 8M]
#       cuts a small excerpt of a capture for the test suite (tests/data/linux-8M.raw.zst): a mix
#       of regions spread over the whole image, see `image-stats.py --help` (excerpt).
# A 2G run takes a few minutes (a TCG boot is ~5 s; filling the guest's memory ~30-60 s; saving
# and compressing the captures the rest) and needs ~3x RAM of free disk space meanwhile.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

mem=2G workload=server load_seconds=40 gap=5 no_load2="" out=${GUESTMEM_IMAGES:-$HOME/.cache/guestmem/images}
excerpt_from="" excerpt_to="" excerpt_size=8M
while [ $# -gt 0 ]; do
  case "$1" in
    -m|--mem) mem=${2:?-m takes a size}; shift 2 ;;
    --workload) workload=${2:?--workload takes server or app}; shift 2 ;;
    --load-seconds) load_seconds=${2:?--load-seconds takes seconds}; shift 2 ;;
    --gap) gap=${2:?--gap takes seconds}; shift 2 ;;
    --no-load2) no_load2=--no-load2; shift ;;
    --out) out=${2:?--out takes a directory}; shift 2 ;;
    --excerpt) excerpt_from=${2:?--excerpt takes FROM.raw.zst TO.raw.zst}
               excerpt_to=${3:?--excerpt takes FROM.raw.zst TO.raw.zst}; shift 3 ;;
    --size) excerpt_size=${2:?--size takes a size like 8M}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "capture-guest-memory: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ -n "$excerpt_from" ]; then
  exec python3 "$here/image-stats.py" --excerpt "$excerpt_to" --excerpt-size "$excerpt_size" "$excerpt_from"
fi

case "$mem" in
  *G) ram_mib=$(( ${mem%G} * 1024 )) ;;
  *M) ram_mib=${mem%M} ;;
  *) echo "capture-guest-memory: -m takes a size like 2G or 512M, not $mem" >&2; exit 2 ;;
esac
case "$workload" in
  server|app) ;;
  *) echo "capture-guest-memory: --workload takes server or app, not $workload" >&2; exit 2 ;;
esac
if [ "$ram_mib" -lt 256 ] || [ "$ram_mib" -gt 2048 ]; then
  # Above 2 GiB the PC machine may split RAM around the PCI hole; pmemsave 0..RAM would be wrong.
  echo "capture-guest-memory: -m must be between 256M and 2G (got $mem)" >&2; exit 2
fi

# --- What it needs -----------------------------------------------------------------------------
need=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
ls /boot/vmlinuz-*-cloud-amd64 >/dev/null 2>&1 || need+=(linux-image-cloud-amd64)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
command -v zstd >/dev/null 2>&1 || need+=(zstd)
command -v cpio >/dev/null 2>&1 || need+=(cpio)
if [ ${#need[@]} -gt 0 ]; then
  echo "capture-guest-memory: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
command -v python3 >/dev/null 2>&1 || { echo "capture-guest-memory: python3 is missing (apt-get install python3)" >&2; exit 1; }
kernel=$(ls /boot/vmlinuz-*-cloud-amd64 2>/dev/null | sort -V | tail -n 1)
[ -n "$kernel" ] || { echo "capture-guest-memory: no /boot/vmlinuz-*-cloud-amd64 (linux-image-cloud-amd64)" >&2; exit 1; }
kver=${kernel#/boot/vmlinuz-}
busybox=/bin/busybox
[ -x "$busybox" ] || { echo "capture-guest-memory: no $busybox (busybox-static)" >&2; exit 1; }
qemu_version=$(qemu-system-x86_64 --version | head -n 1)

# The captures are made in a staging directory beside their final place and moved there only
# when all of them are compressed: an interrupted run leaves the previous captures as they were.
stage=$out/.linux-$mem-$workload.partial
rm -rf "$stage"
mkdir -p "$out" "$stage"
work=$(mktemp -d "${TMPDIR:-/tmp}/guestmem-capture.XXXXXX")
qemu_pid="" driver_pid=""
prefix="linux-$mem"; [ "$workload" = server ] || prefix="linux-$mem-$workload"
cleanup() {
  for pid in $driver_pid $qemu_pid; do
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$work" "$stage"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- The initramfs -----------------------------------------------------------------------------
# Root file system: busybox, the kernel's modules (up to ~4.5% of RAM: real binaries), generated
# text (~3.5% of RAM: web/auth/application logs and a metrics table), a gzipped database table
# (7% of RAM unpacked) and a few /etc files.
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,srv,run,tmp,var/log,etc/crontabs,www,data/text}
cp "$busybox" "$root/bin/busybox"
mod_budget=$(( ram_mib * 1024 * 1024 * 45 / 1000 ))
if [ -d "/lib/modules/$kver" ]; then
  (cd / && find "lib/modules/$kver" -type f | sort) |
    python3 -c '
import os, sys
budget, total = int(sys.argv[1]), 0
for p in sys.stdin.read().split():
    total += os.path.getsize("/" + p)
    if total > budget:
        break
    print(p)' "$mod_budget" > "$work/modules.list"
  (cd / && cpio -pdm --quiet "$root" < "$work/modules.list")
fi
python3 - "$root/data" $(( ram_mib * 1024 * 1024 * 35 / 1000 )) $(( ram_mib * 1024 * 1024 * 7 / 100 )) <<'PY'
# Deterministic log-like text (data/text): an nginx access log, auth/syslog lines, JSON
# application logs and a CSV metrics table, about the given number of bytes in all; and a
# database table file (data/db/orders.db.gz, unpacked in tmpfs by the workload): 4 KiB slotted
# pages of 96-byte order records, each page filled 35-98% and zero after its last record.
import gzip, os, random, struct, sys
out, budget, db_bytes = sys.argv[1] + "/text", int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(19)
paths = ["/", "/index.html", "/api/v1/users", "/api/v1/orders", "/static/app.js", "/static/style.css",
         "/login", "/logout", "/api/v1/cart", "/healthz", "/metrics", "/images/logo.png", "/search"]
agents = ["Mozilla/5.0 (X11; Linux x86_64; rv:120.0) Gecko/20100101 Firefox/120.0",
          "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/119.0 Safari/537.36",
          "curl/7.88.1", "Prometheus/2.45.0", "python-requests/2.31.0", "kube-probe/1.28"]
users = [f"user{i:03d}" for i in range(200)]
services = ["orders", "billing", "auth", "search", "inventory", "gateway"]
levels = ["INFO"] * 8 + ["DEBUG"] * 4 + ["WARN", "ERROR"]
def ip():
    return f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
def ts(i):
    s = 1732450000 + i // 7
    return f"2026-11-{24 + s // 86400 % 5:02d}T{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}.{rng.randrange(10**6):06d}Z"
def access(i):
    return (f'{ip()} - - [{ts(i)}] "{rng.choice(["GET"] * 6 + ["POST", "PUT", "DELETE"])} {rng.choice(paths)}'
            f'?id={rng.randrange(10**6)} HTTP/1.1" {rng.choice([200] * 12 + [301, 304, 404, 500])} '
            f'{rng.randrange(100, 60000)} "-" "{rng.choice(agents)}" rt={rng.random():.3f}\n')
def auth(i):
    pid = rng.randrange(1000, 40000)
    return rng.choice([
        f"{ts(i)} web{rng.randrange(8)} sshd[{pid}]: Accepted publickey for {rng.choice(users)} from {ip()} port {rng.randrange(1024, 65535)} ssh2: ED25519 SHA256:{rng.getrandbits(128):032x}\n",
        f"{ts(i)} web{rng.randrange(8)} sshd[{pid}]: pam_unix(sshd:session): session opened for user {rng.choice(users)}(uid={rng.randrange(1000, 1200)}) by (uid=0)\n",
        f"{ts(i)} web{rng.randrange(8)} CRON[{pid}]: (root) CMD (/usr/local/bin/backup --incremental --target=/srv/backup)\n",
        f"{ts(i)} web{rng.randrange(8)} kernel: [{rng.randrange(10**6)}.{rng.randrange(10**6):06d}] nf_conntrack: table full, dropping packet\n"])
def app(i):
    svc = rng.choice(services)
    return (f'{{"ts":"{ts(i)}","level":"{rng.choice(levels)}","service":"{svc}","trace_id":"{rng.getrandbits(64):016x}",'
            f'"span_id":"{rng.getrandbits(32):08x}","user":"{rng.choice(users)}","latency_ms":{rng.randrange(1, 2000)},'
            f'"msg":"{rng.choice(["request served", "cache miss", "retrying upstream", "order created", "payment authorized", "token refreshed"])}"}}\n')
def metrics(i):
    return (f"{1732450000 + i},{rng.choice(services)},{rng.randrange(8)},{rng.random() * 100:.2f},{rng.randrange(10**9)},"
            f"{rng.randrange(10**6)},{rng.choice(['ok', 'ok', 'ok', 'degraded'])}\n")
kinds = [("access.log", access, 0.35), ("auth.log", auth, 0.15), ("app.jsonl", app, 0.35), ("metrics.csv", metrics, 0.15)]
for name, make, share in kinds:
    target, lines, size, i = int(budget * share), [], 0, 0
    if name == "metrics.csv":
        lines.append("time,service,node,cpu_percent,bytes,requests,state\n")
    while size < target:
        line = make(i); lines.append(line); size += len(line); i += 1
    with open(os.path.join(out, name), "w") as f:
        f.writelines(lines)
names = [f"{a} {b}".encode() for a in ("Ada", "Alan", "Grace", "Linus", "Ken", "Barbara", "Edsger", "Donald")
         for b in ("Lovelace", "Turing", "Hopper", "Torvalds", "Thompson", "Liskov", "Dijkstra", "Knuth")]
pages, rid = [], 1
for page_no in range(db_bytes // 4096):
    nrec = rng.randrange(15, 43)  # (4096 - 24) // 96 = 42 records fit
    recs = [struct.pack("<IIQHHI", 0x31424447, page_no, 1000 + page_no * 7, nrec, 24 + 96 * nrec, 0)]
    for _ in range(nrec):
        name = rng.choice(names)
        recs.append(struct.pack("<QIIIBB2x16s24s32s", rid, rng.randrange(1, 50000), 1732450000 + rid // 3,
                                rng.randrange(100, 10**6), rng.randrange(5), rng.randrange(4),
                                f"SKU-{rng.randrange(10**8):08d}".encode(), name,
                                name.replace(b" ", b".").lower() + b"@example.com"))
        rid += 1
    pages.append(b"".join(recs).ljust(4096, b"\0"))
os.makedirs(sys.argv[1] + "/db", exist_ok=True)
with gzip.open(sys.argv[1] + "/db/orders.db.gz", "wb", compresslevel=6) as f:
    f.write(b"".join(pages))
PY
if [ "$workload" = app ]; then
  # Debian's python3 (not a pyenv or venv one), its libraries and standard library, SQLite.
  py=/usr/bin/python3.11
  [ -x "$py" ] || { echo "capture-guest-memory: --workload app needs $py (apt-get install python3)" >&2; exit 1; }
  mkdir -p "$root/app" "$root/usr/bin"
  cp "$py" "$root/usr/bin/python3"
  cp "$here/capture-app-workload.py" "$root/app/workload.py"
  mkdir -p "$root/data"
  "$py" "$here/capture-app-workload.py" --build-db "$root/data/app.db" "$ram_mib"
  (cd / && find usr/lib/python3.11 \( -name test -o -name tests -o -name idlelib -o -name tkinter \
      -o -name turtledemo -o -name ensurepip -o -name lib2to3 -o -name site-packages \
      -o -name dist-packages \) -prune -o -print | cpio -pdm --quiet "$root")
  for bin in "$py" /usr/lib/python3.11/lib-dynload/_sqlite3.*.so; do
    for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
      mkdir -p "$root$(dirname "$lib")" && cp -L "$lib" "$root$lib"
    done
  done
fi
echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"
echo "*/1 * * * * date >> /var/log/cron.log" > "$root/etc/crontabs/root"
printf '<html><body><h1>guestmem capture guest</h1></body></html>\n' > "$root/www/index.html"
cat > "$root/init" <<'INIT'
#!/bin/busybox sh
# guestmem capture guest: a server-like workload, then GUESTMEM-LOADED and a rewriting loop.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs -o size=95% tmpfs /srv; mount -t tmpfs tmpfs /run
hostname guest; ip link set lo up; ip addr add 127.0.0.1/8 dev lo
syslogd -O /var/log/messages -s 4096; klogd; crond -c /etc/crontabs; httpd -h /www -p 127.0.0.1:80
mb=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 ))
echo "GUESTMEM-BOOTED mem_mib=$mb kernel=$(uname -r)"
logger -t guestmem "boot marker printed"
sleep 1
if [ -f /app/workload.py ]; then
  # The application guest (--workload app): it prints GUESTMEM-LOADED itself.
  /usr/bin/python3 /app/workload.py &
  while :; do sleep 3600; done
fi
pct() { echo $(( mb * $1 / 100 )); }   # MiB for a share of RAM
t0=$(date +%s)

# Page cache (tmpfs): an exact copy of the root file system's modules (duplicates), the
# database unpacked, rotated logs made of the text in other orders behind headers of other
# lengths (same kind of data, not page-aligned: not duplicates), and a random blob.
mkdir -p /srv/copy /srv/log /srv/blob /srv/db
cp -a /lib/modules /srv/copy/
gunzip -c /data/db/orders.db.gz > /srv/db/orders.db
i=0
while [ $(( $(du -sm /srv/log | cut -f1) )) -lt $(pct 16) ]; do
  { echo "# rotated $i on $(date) by logrotate$(seq -s. 1 $((i % 23)))"
    case $((i % 4)) in
      0) cat /data/text/access.log /data/text/app.jsonl ;;
      1) cat /data/text/app.jsonl /data/text/auth.log /data/text/access.log ;;
      2) cat /data/text/metrics.csv /data/text/access.log ;;
      3) cat /data/text/auth.log /data/text/app.jsonl /data/text/metrics.csv ;;
    esac; } > /srv/log/app.log.$i
  i=$((i + 1))
done
dd if=/dev/urandom of=/srv/blob/random.bin bs=1M count=$(pct 8) 2>/dev/null
echo "guestmem: page cache filled after $(( $(date +%s) - t0 )) s" > /dev/console

# Anonymous heap: awk holding a log in arrays (and editing it forever), sort holding the lines
# of another, and dd processes blocked on a pipe nobody reads, each holding a buffer of file data.
head -c $(( $(pct 1) * 1048576 )) /data/text/app.jsonl > /run/awk.in
awk -v ready=/run/awk.ready '
  { n++; line[n] = $0; split($0, f, ","); svc[f[3]]++; trace[substr(f[4], 13)] = n }
  END {
    print n > ready; close(ready); srand()
    for (;;) {
      for (k = 0; k < 100; k++) { i = int(rand() * n) + 1; sub(/"latency_ms":[0-9]+/, "\"latency_ms\":" int(rand() * 2000), line[i]) }
      system("sleep 1")
    }
  }' /run/awk.in &
# sort's reader takes its first line (sorting is over) and then reads no more.
head -c $(( $(pct 1) * 1048576 )) /srv/log/app.log.2 | sort -t, -k4 |
  { read -r first; echo "$first" > /run/sort.ready; sleep 2000000; } &
# (dd's buffer is page-aligned: a header of odd length keeps it from repeating the file's pages)
hold() { mib=$1; shift; { echo "holder of $# files"; cat "$@" 2>/dev/null; } |
  dd bs=${mib}M count=1 iflag=fullblock 2>/dev/null | sleep 2000000 & }
hold $(pct 8) /srv/log/app.log.1 /srv/log/app.log.5 /srv/log/app.log.6
hold $(pct 4) /srv/log/app.log.3 $(find /srv/copy/modules -name "*.ko" | head -n 300)
dd if=/dev/urandom bs=$(pct 5)M count=1 2>/dev/null | sleep 2000000 &
while [ ! -s /run/awk.ready ] || [ ! -s /run/sort.ready ]; do sleep 1; done
echo "guestmem: heap filled after $(( $(date +%s) - t0 )) s" > /dev/console
sleep 2

# Rewriting, once a second and with few processes (each new one rewrites whole pages): a log
# line appended, patches of 1-25 lines at random offsets in the blob, the rotated logs and the
# database, a few bytes of a copied module, a syslog message every 5 s; awk edits 100 of its
# lines every second. Offsets: $RANDOM is 15 bits, two of them make 30.
blob=$(( $(pct 8) * 1048576 )) logs=$(( $(pct 16) * 1048576 / i )) db=$(stat -c %s /srv/db/orders.db)
set -- $(find /srv/copy/modules -name '*.ko' -size +16k | head -n 500)
patch() {  # patch FROM TO BYTES OFFSET
  dd if="$1" of="$2" bs=1 count="$3" skip=$(( RANDOM * 8 )) seek="$4" conv=notrunc 2>/dev/null
}
(
n=0
while :; do
  n=$((n + 1))
  echo "10.0.$((RANDOM % 256)).$((RANDOM % 256)) - - [$n] \"GET /api/v1/orders?id=$RANDOM HTTP/1.1\" 200 $RANDOM" >> /srv/log/access.log
  patch /dev/urandom /srv/blob/random.bin $(( 64 * (RANDOM % 25 + 1) )) $(( (RANDOM * 32768 + RANDOM) % blob ))
  patch /dev/urandom /srv/blob/random.bin $(( RANDOM % 200 + 8 )) $(( (RANDOM * 32768 + RANDOM) % blob ))
  patch /data/text/access.log /srv/log/app.log.$(( RANDOM % i )) $(( 64 * (RANDOM % 25 + 1) )) $(( (RANDOM * 32768 + RANDOM) % logs ))
  patch /data/text/app.jsonl /srv/db/orders.db $(( RANDOM % 300 + 16 )) $(( (RANDOM * 32768 + RANDOM) % db ))
  [ $# -gt 0 ] && eval "patch /dev/urandom \"\${$(( RANDOM % $# + 1 ))}\" $(( RANDOM % 60 + 4 )) $(( RANDOM % 16384 ))"
  [ $((n % 5)) -eq 0 ] && logger -t app "served $n requests"
  sleep 1
done
) &
sleep 1
echo "GUESTMEM-LOADED $(awk '/^(MemFree|Cached|AnonPages|Shmem):/ {printf "%s%s ", $1, $2}' /proc/meminfo)"
while :; do sleep 3600; done
INIT
chmod +x "$root/init"
(cd "$root" && find . | sort | cpio -o -H newc --quiet) | zstd -q -3 -T2 > "$work/initrd.cpio.zst"
echo "capture-guest-memory: initramfs $(( $(stat -c %s "$work/initrd.cpio.zst") >> 20 )) MiB compressed," \
     "kernel $kver, $qemu_version"

workload_desc="scripts/capture-guest-memory.sh (busybox init: page cache, heap, random, rewriting loop)"
[ "$workload" = app ] && workload_desc="scripts/capture-guest-memory.sh --workload app (CPython heap, SQLite database and cache, updating loop)"
# --- Boot and capture --------------------------------------------------------------------------
serial=$work/serial.log qmp=$work/qmp.sock
qemu-system-x86_64 -accel tcg -cpu max -smp 2 -m "$mem" -nodefaults -display none -no-reboot \
  -kernel "$kernel" -initrd "$work/initrd.cpio.zst" -append "console=ttyS0 quiet panic=-1" \
  -serial "file:$serial" -monitor none -qmp "unix:$qmp,server,nowait" &
qemu_pid=$!
started=$(date +%s)
# In the background so that a signal reaches this script's trap at once (bash runs traps only
# between foreground commands, but interrupts `wait`).
python3 "$here/qmp-capture.py" --qmp "$qmp" --serial "$serial" --ram-bytes $(( ram_mib << 20 )) \
  --out "$stage" --prefix "$prefix" --load-seconds "$load_seconds" --gap "$gap" $no_load2 \
  --qemu-pid "$qemu_pid" --meta "kernel=$kver" --meta "qemu=$qemu_version" \
  --meta "qemu_args=-accel tcg -cpu max -smp 2 -m $mem" --meta "ram=$mem" \
  --meta "workload=$workload_desc" &
driver_pid=$!
wait "$driver_pid" ||
  { echo "capture-guest-memory: capture failed; the guest's console said:" >&2; tail -n 20 "$serial" >&2; exit 1; }
driver_pid=""
wait "$qemu_pid" 2>/dev/null || true
qemu_pid=""
cp "$serial" "$stage/$prefix-console.log"
grep -a -e GUESTMEM -e guestmem: "$serial" || true
echo "capture-guest-memory: guest ran $(( $(date +%s) - started )) s; compressing"

names=(boot load); [ -n "$no_load2" ] || names+=(load2)
for name in "${names[@]}"; do
  zstd -q -f -3 -T2 --rm "$stage/$prefix-$name.raw" -o "$stage/$prefix-$name.raw.zst"
done
[ -n "$no_load2" ] && rm -f "$out/$prefix-load2.raw.zst" "$out/$prefix-load2.json"
mv -f "$stage"/* "$out"/
echo "capture-guest-memory: captures in $out:"
for name in "${names[@]}"; do
  stat -c '  %12s  %n' "$out/$prefix-$name.raw.zst" "$out/$prefix-$name.json"
done
