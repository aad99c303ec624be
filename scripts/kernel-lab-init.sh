#!/bin/busybox sh
# The kernel lab's init (scripts/kernel-lab.sh): loads the KVM modules, runs the suite's tests
# one by one, and writes markers and JSON to the second serial port (ttyS1), which the host
# parses; the console (ttyS0) carries the kernel's messages and every test's own output.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o size=768m tmp /tmp
# GUESTMEM_BIN: the guestmem the CLI's tests run (crates/cli/tests/common), here at a path of
# the lab's own: the build's path may not exist in the guest, or be under a directory mounted
# over above (a checkout under /tmp).
export PATH=/bin:/sbin HOME=/root TMPDIR=/tmp RUST_BACKTRACE=1 GUESTMEM_BIN=/bin/guestmem
ip link set lo up
R=/dev/ttyS1
stty -F $R raw -echo 2>/dev/null
say() { echo "$*" > $R; }
now() { cut -d' ' -f1 /proc/uptime; }
LIMIT=$(cat /lab/test-timeout 2>/dev/null || echo 600)
# What a suite's prepare script gives its tests (scripts/lab-suites/SUITE.prepare).
[ -f /lab/env ] && . /lab/env

say "@@LAB start"
say "@@LAB kernel $(uname -r)"
say "@@LAB nodes $(cat /sys/devices/system/node/has_memory 2>/dev/null)"
for m in $(cat /lab/modules.order); do
    # Parameters for a module (kernel-lab.sh --module-param MODULE.ko:PARAMS), e.g. to try
    # kvm_amd without one of its nested-virtualization features.
    params=$(awk -v m="$m" '$1 == m { $1 = ""; print }' /lab/module-params 2>/dev/null)
    # shellcheck disable=SC2086 # the parameters are words
    if insmod "/lab/modules/$m" $params; then say "@@LAB module $m loaded$params"; else say "@@LAB module $m failed"; fi
done
if [ -e /dev/kvm ]; then say "@@LAB kvm yes"; else say "@@LAB kvm no"; fi

# The probe, once: its JSON goes into the record, its table answers the suite's needs= (need).
# A probe that cannot run fails the run; no test is skipped on its account.
guestmem probe --json > /tmp/probe.json 2>&1
json_rc=$?
guestmem probe > /tmp/probe.table 2>&1
table_rc=$?
say "@@BEGIN probe"
cat /tmp/probe.json > $R
say "@@END probe"
echo "=== guestmem probe"
cat /tmp/probe.table
PROBE_ERROR=""
if [ $json_rc -ne 0 ] || [ $table_rc -ne 0 ]; then
    PROBE_ERROR="guestmem probe could not run (exit $json_rc, table exit $table_rc): $(tail -n 3 /tmp/probe.table | tr '\n' ' ')"
    say "@@LAB probe-error $PROBE_ERROR"
fi

# probe_row NAME: the value and detail of the probe table's row NAME (empty when it has none).
probe_row() { awk -v n="$1" '$1 == n { sub(/^[^ ]+ +/, ""); gsub(/  +/, " "); print; exit }' /tmp/probe.table; }
# need NAME: what the probe says of a suite line's needs=NAME: `yes`; `no WHY` (the probe ran
# and says the kernel lacks it: the test is skipped, the record says which probe said so); or
# `error WHY` (the probe could not run, or answered what the lab does not expect: the test
# fails). A new need is one more case, reading its row of `guestmem probe`'s table.
need() {
    [ -z "$PROBE_ERROR" ] || { echo "error $PROBE_ERROR"; return; }
    case "$1" in
        guest_memfd)
            # Host-mapped guest_memfd: the MMAP flag among kvm.guest_memfd_flags' `0xN (A|B)`.
            row=$(probe_row kvm.guest_memfd_flags)
            case "$row" in
                0x*"(MMAP|"*|0x*"(MMAP)"*|0x*"|MMAP|"*|0x*"|MMAP)"*) echo yes ;;
                0x*) echo "no \`guestmem probe\` says kvm.guest_memfd_flags $row: host-mapped guest_memfd (MMAP) is absent (its refusal is tested by the gmem_ tests)" ;;
                *) echo "error \`guestmem probe\` gave kvm.guest_memfd_flags '$row', not flags (kvm: $(probe_row kvm))" ;;
            esac ;;
        *) echo "error the lab knows no need '$1' (scripts/kernel-lab-init.sh, need)" ;;
    esac
}

# The suite: `TARGET TEST [needs=NAME] [ignored]` a line; each test alone, bounded;
# `ignored`: a test ignored elsewhere (it needs this lab's kernel), run with --include-ignored.
# A test that reports itself ignored all the same fails: the lab does not quietly test less.
while read -r target test flags; do
    [ -n "$target" ] || continue
    extra=""
    verdict=""
    for flag in $flags; do
        case "$flag" in
            ignored) extra=--include-ignored ;;
            needs=*) answer=$(need "${flag#needs=}")
                     case "$answer" in
                         yes) ;;
                         no\ *) [ -n "$verdict" ] || verdict="skipped ${answer#no }" ;;
                         *) verdict="failed ${answer#error }" ;;
                     esac ;;
            *) verdict="failed the suite line's '$flag' is neither ignored nor needs=NAME" ;;
        esac
    done
    if [ -n "$verdict" ]; then
        say "@@TEST $target::$test ${verdict%% *} 0 ${verdict#* }"
        continue
    fi
    echo "=== $target::$test"
    start=$(now)
    # --show-output: what a passing test prints (its TCG times) reaches the console too.
    # No stdin: a test's child (QEMU's -serial stdio) would eat the rest of the suite list.
    timeout -s KILL "$LIMIT" "/lab/bin/$target" --exact "$test" --test-threads=1 --show-output $extra < /dev/null > /tmp/test.out 2>&1
    rc=$?
    end=$(now)
    secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
    cat /tmp/test.out
    if [ $rc -eq 0 ] && grep -q '^test result: ok. 1 passed' /tmp/test.out; then
        say "@@TEST $target::$test ok $secs"
        # What a passing test measured (its TCG times) goes into the record too.
        if grep -qE '^TCG time|\(TCG|^boot [0-9]+ of|held in|downtime|all resident after' /tmp/test.out; then
            say "@@BEGIN output $target::$test"
            grep -E '^TCG time|\(TCG|^boot [0-9]+ of|held in|downtime|all resident after' /tmp/test.out > $R
            say "@@END output $target::$test"
        fi
    else
        why="exit $rc"
        grep -q '^test result: ok. 0 passed; 0 failed; 1 ignored' /tmp/test.out &&
            why="the test is ignored in its code: mark its suite line \`ignored\` to run it here"
        [ $rc -eq 137 ] && why="killed at the ${LIMIT} s limit"
        grep -q '^running 0 tests' /tmp/test.out && why="no such test"
        say "@@TEST $target::$test failed $secs $why"
        say "@@BEGIN output $target::$test"
        tail -n 60 /tmp/test.out > $R
        say "@@END output $target::$test"
    fi
done < /lab/suite

# A suite that asks for its tests only (/lab/tests-only) ends here.
if [ -f /lab/tests-only ]; then say "@@LAB done"; sync; poweroff -f; fi
GMEM=$(need guest_memfd)
if [ "$GMEM" = yes ]; then
    # Population of gmem by each method the kernel offers, beside mmap+memcpy (times: TCG).
    say "@@BEGIN populate"
    timeout -s KILL "$LIMIT" guestmem bench populate --size 64M --backend gmem --json > /tmp/b.out 2>&1
    cat /tmp/b.out > $R
    say "@@END populate"
    # Where a 64 MiB gmem region's pages sit under each policy (move_pages).
    for policy in bind:0 bind:1 interleave:0-1 preferred:1; do
        say "@@BEGIN numa $policy"
        timeout -s KILL "$LIMIT" guestmem numa --size 64M --backend gmem --numa $policy --json > $R 2>&1
        say "@@END numa $policy"
    done
fi
# What a migration connection's TLS costs each end, with rustls and with the kernel's TLS where
# this kernel has it (times: TCG, comparable with each other only).
say "@@BEGIN transport"
timeout -s KILL "$LIMIT" guestmem bench transport --size 64M --runs 3 --json > /tmp/b.out 2>&1
cat /tmp/b.out > $R
say "@@END transport"

# What each gmem path says on this kernel, for the record: where a path is refused, its message.
refusal() {
    name=$1; shift
    say "@@BEGIN refusal $name"
    echo "\$ guestmem $*" > $R
    timeout -s KILL "$LIMIT" guestmem "$@" > /tmp/r.out 2>&1
    echo "exit $?" > $R
    tail -n 5 /tmp/r.out > $R
    say "@@END refusal $name"
}
if [ "$GMEM" = yes ]; then
    guestmem snapshot --out /tmp/lab-snap --memory 16M --backend gmem --after 0.1 > /dev/null 2>&1
    refusal lazy-restore restore /tmp/lab-snap --mode lazy --run-for 0.1
    rm -rf /tmp/lab-snap
elif [ "${GMEM%% *}" = no ]; then
    refusal run run --memory 16M --backend gmem --workload touch
    refusal snapshot snapshot --out /tmp/lab-snap --memory 16M --backend gmem --after 0.1
    refusal numa numa --size 16M --backend gmem --numa bind:1
    refusal populate bench populate --size 16M --backend gmem
    guestmem migrate keys --out /tmp/lab-keys > /dev/null 2>&1
    refusal migrate-send migrate send --to tcp:127.0.0.1:9 --keys /tmp/lab-keys --memory 16M --backend gmem
fi
say "@@LAB done"
sync
poweroff -f
