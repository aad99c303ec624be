#!/usr/bin/env python3
"""Benchmarks `guestmem snapshot --live` (issue 44) on real guest memory captures, per dirty
rate and live mode, each run beside a paused write of the same guest (`--compare-paused`):
pause, total time against the paused write, the guest's rate during the write against
undisturbed, stored bytes against the paused write's. Medians (and ranges) of `--repeat` runs;
each run records the host's steal time and load average, since the machine is shared.

Usage:
  scripts/bench-live-snapshot.py [--guestmem target/release/guestmem]
      [--images linux-2G-load,linux-2G-app-load] [--rates 16384,131072,max]
      [--modes copy-before-write,rounds] [--repeat 5] [--rounds-repeat 1]
      [--store-dir /tmp/guestmem-bench-live] [--out docs/results/live-snapshot-rates.json]

Rates are pages/s of the `rewrite` workload over both vCPUs (16384 = 64 MiB/s, 131072 =
512 MiB/s, max = unthrottled). `--after` is 2 s for a throttled guest and 8 s unthrottled (its
undisturbed rate is measured over the second half, past the first pass, whose every page
faults into KVM once after the image is loaded). Rounds runs take much longer at high rates:
`--rounds-repeat` of them per rate.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def steal_ticks():
    with open("/proc/stat") as f:
        parts = f.readline().split()
    total = sum(int(x) for x in parts[1:])
    return int(parts[8]), total


def others_building():
    """Processes of other builds and tests on this shared machine (rustc, cargo, qemu, ld)."""
    out = subprocess.run(["ps", "-eo", "comm"], capture_output=True, text=True).stdout.split()
    return sum(1 for c in out if c in ("rustc", "cargo", "cc1", "ld", "qemu-system-x86"))


def run_once(args, image, rate, mode):
    store = os.path.join(args.store_dir, "store")
    shutil.rmtree(args.store_dir, ignore_errors=True)
    os.makedirs(store)
    cmd = [args.guestmem, "snapshot", "--live", "--live-mode", mode, "--compare-paused",
           "--out", f"store:{store}/live", "--image", image, "--memory", "2G", "--rewrite",
           "--after", "8" if rate == "max" else "2", "--json"]
    if rate != "max":
        cmd += ["--pages-per-s", rate]
    load = os.getloadavg()[0]
    building = others_building()
    s0, t0 = steal_ticks()
    p = subprocess.run(cmd, capture_output=True, text=True)
    s1, t1 = steal_ticks()
    shutil.rmtree(args.store_dir, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr}")
    d = json.loads(p.stdout)
    live, paused = d["live"], d["paused"]
    return {
        "pause_ms": round(live["pause_ms"], 2),
        "stop_ms": round(live["stop_ms"], 2),
        "arm_ms": round(live["arm_ms"], 3),
        "pre_arm_ms": round(live["pre_arm_ms"], 1),
        "total_ms": round(live["total_ms"]),
        "paused_write_ms": round(paused["write_ms"]),
        "total_over_paused": round(paused["live_time_ratio"], 3),
        "guest_pages_per_s_undisturbed": round(d["guest_pages_per_s_undisturbed"]),
        "guest_pages_per_s_during": round(d["guest_pages_per_s_during"]),
        "guest_rate_ratio": round(d["guest_rate_ratio"], 3),
        "stored_over_paused": round(paused["live_stored_ratio"], 4),
        "mode": live["mode"],
        "rounds": len(live["rounds"]),
        "write_faults": live["write_faults"],
        "copied_before_write_pages": live["copied_before_write_pages"],
        "held_peak_mib": round(live["held_peak_bytes"] / 2**20, 1),
        "steal_percent": round(100 * (s1 - s0) / max(1, t1 - t0), 2),
        "load_avg_1m_before": round(load, 2),
        "other_build_processes_before": building,
    }


def summary(runs):
    out = {}
    for key in ("pause_ms", "stop_ms", "total_ms", "paused_write_ms", "total_over_paused",
                "guest_rate_ratio", "stored_over_paused", "copied_before_write_pages",
                "steal_percent", "load_avg_1m_before"):
        v = [r[key] for r in runs]
        out[key] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--guestmem", default="target/release/guestmem")
    ap.add_argument("--images", default="linux-2G-load,linux-2G-app-load")
    ap.add_argument("--image-dir", default=os.path.expanduser("~/.cache/guestmem/images"))
    ap.add_argument("--rates", default="16384,131072,max")
    ap.add_argument("--modes", default="copy-before-write,rounds")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds-repeat", type=int, default=1)
    ap.add_argument("--store-dir", default="/tmp/guestmem-bench-live")
    ap.add_argument("--out", default="docs/results/live-snapshot-rates.json")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    result = {
        "benchmark": "guestmem snapshot --live --live-mode MODE --compare-paused --json "
                     "(local store, rewrite workload, 2 vCPUs, 2 GiB)",
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "script": "scripts/bench-live-snapshot.py",
        "rows": [],
    }
    for image in args.images.split(","):
        path = os.path.join(args.image_dir, image + ".raw.zst")
        for rate in args.rates.split(","):
            for mode in args.modes.split(","):
                n = args.rounds_repeat if mode == "rounds" else args.repeat
                runs = []
                for i in range(n):
                    r = run_once(args, path, rate, mode)
                    print(f"{image} rate {rate} {mode} run {i + 1}/{n}: {r}", flush=True)
                    runs.append(r)
                result["rows"].append({
                    "image": image, "pages_per_s": rate,
                    "mib_per_s": "unthrottled" if rate == "max" else int(rate) * 4096 >> 20,
                    "mode": mode, "runs": runs, "summary": summary(runs),
                })
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
