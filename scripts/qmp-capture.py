#!/usr/bin/env python3
"""Drives a running QEMU over QMP and saves the guest's RAM at the workload's markers.

Used by scripts/capture-guest-memory.sh (read its header first); standard library only.

  qmp-capture.py --qmp SOCK --serial LOG --ram-bytes N --out DIR --prefix linux-2G
                 [--load-seconds 40] [--gap 5] [--no-load2] [--meta KEY=VALUE ...]

It watches the serial log for the init's lines `GUESTMEM-BOOTED` and `GUESTMEM-LOADED`. At
`GUESTMEM-BOOTED` it captures "boot"; once `GUESTMEM-LOADED` has been printed and at least
--load-seconds have passed since the boot marker it captures "load"; --gap seconds after that
"load2" (skipped with --no-load2). Each capture is `stop`, `pmemsave` of guest-physical
0..ram-bytes into DIR/PREFIX-NAME.raw, `cont`, plus DIR/PREFIX-NAME.json with the metadata.
The caller compresses the .raw files after QEMU is gone.
"""
import argparse
import json
import os
import socket
import sys
import time


class Qmp:
    def __init__(self, path, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    sys.exit(f"qmp-capture: no QMP socket at {path} after {timeout} s")
                time.sleep(0.2)
        self.file = self.sock.makefile("rwb", buffering=0)
        greeting = self._read()
        if "QMP" not in greeting:
            sys.exit(f"qmp-capture: unexpected QMP greeting {greeting}")
        self.version = greeting["QMP"]["version"]["qemu"]
        self.execute("qmp_capabilities")

    def _read(self):
        line = self.file.readline()
        if not line:
            sys.exit("qmp-capture: QEMU closed the QMP socket (did it exit? see the serial log)")
        return json.loads(line)

    def execute(self, command, **arguments):
        message = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        self.file.write(json.dumps(message).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                continue
            if "error" in reply:
                sys.exit(f"qmp-capture: {command} failed: {reply['error']}")
            return reply.get("return")


def wait_for_marker(log, marker, deadline_s, qemu_pid):
    """Waits until `marker` appears at the start of a line of the serial log; returns the line."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with open(log, "rb") as f:
                for raw in f.read().splitlines():
                    line = raw.decode("utf-8", "replace").strip()
                    if marker in line:
                        return line
        except FileNotFoundError:
            pass
        if qemu_pid and not os.path.exists(f"/proc/{qemu_pid}"):
            sys.exit(f"qmp-capture: QEMU exited before the guest printed {marker}; see {log}")
        time.sleep(0.2)
    sys.exit(f"qmp-capture: the guest did not print {marker} within {deadline_s} s; see {log}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qmp", required=True)
    p.add_argument("--serial", required=True)
    p.add_argument("--ram-bytes", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--load-seconds", type=float, default=40)
    p.add_argument("--gap", type=float, default=5)
    p.add_argument("--no-load2", action="store_true")
    p.add_argument("--boot-timeout", type=float, default=300)
    p.add_argument("--load-timeout", type=float, default=900)
    p.add_argument("--qemu-pid", type=int, default=0)
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE added to every metadata file")
    a = p.parse_args()

    qmp = Qmp(a.qmp, 30)
    qemu_version = "{major}.{minor}.{micro}".format(**qmp.version)
    extra = dict(kv.split("=", 1) for kv in a.meta)

    def capture(name, booted_at, marker_line):
        raw = os.path.join(a.out, f"{a.prefix}-{name}.raw")
        t0 = time.monotonic()
        qmp.execute("stop")
        stopped_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        workload_s = 0.0 if booted_at is None else time.monotonic() - booted_at
        qmp.execute("pmemsave", val=0, size=a.ram_bytes, filename=raw)
        qmp.execute("cont")
        paused = time.monotonic() - t0
        meta = {
            "capture": name,
            "file": f"{a.prefix}-{name}.raw.zst",
            "ram_bytes": a.ram_bytes,
            "page_size": 4096,
            "layout": "guest-physical 0..ram_bytes, contiguous (RAM <= 2 GiB: no PCI hole)",
            "qemu_version": qemu_version,
            "captured_utc": stopped_utc,
            "workload_seconds": round(workload_s, 1),
            "guest_paused_seconds": round(paused, 2),
            "console_marker": marker_line,
        }
        meta.update(extra)
        with open(os.path.join(a.out, f"{a.prefix}-{name}.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        print(f"qmp-capture: {name}: {a.ram_bytes >> 20} MiB saved after {workload_s:.1f} s of workload "
              f"(guest paused {paused:.1f} s)", flush=True)

    line = wait_for_marker(a.serial, "GUESTMEM-BOOTED", a.boot_timeout, a.qemu_pid)
    booted_at = time.monotonic()
    capture("boot", None, line)
    line = wait_for_marker(a.serial, "GUESTMEM-LOADED", a.load_timeout, a.qemu_pid)
    loaded_after = time.monotonic() - booted_at
    if loaded_after > a.load_seconds:
        print(f"qmp-capture: the workload took {loaded_after:.0f} s to fill memory "
              f"(more than --load-seconds {a.load_seconds:.0f})", flush=True)
    time.sleep(max(0.0, booted_at + a.load_seconds - time.monotonic()))
    capture("load", booted_at, line)
    if not a.no_load2:
        time.sleep(a.gap)
        capture("load2", booted_at, line)
    qmp.execute("quit")


if __name__ == "__main__":
    main()
