#!/usr/bin/env python3
"""The kernel lab's record (scripts/kernel-lab.sh): parses the markers the guest wrote on its
second serial port into docs/results/lab-NAME.json, prints each test's result and one closing
line `lab: N passed, N failed, N skipped`, and exits non-zero if a test failed or the run did
not complete (then with the console's last lines)."""
import argparse
import os
import datetime
import json
import subprocess
import sys


def blocks(lines):
    """`@@BEGIN name` ... `@@END name` sections, as text by name."""
    out, name, acc = {}, None, []
    for line in lines:
        if line.startswith("@@BEGIN "):
            name, acc = line[len("@@BEGIN "):], []
        elif line.startswith("@@END ") and name is not None:
            out[name] = "\n".join(acc)
            name = None
        elif name is not None:
            acc.append(line)
    return out


def as_json(text):
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return {"unparsed": text}


def main():
    ap = argparse.ArgumentParser()
    for a in ["results", "console", "out", "kernel", "image", "suite", "timeout", "seconds",
              "qemu-exit", "attempts", "retry-reason", "commit", "tcg-thread", "cpus"]:
        ap.add_argument("--" + a, default="")
    args = ap.parse_args()
    try:
        raw = open(args.results, encoding="utf-8", errors="replace").read()
    except OSError:
        raw = ""
    lines = [l.rstrip("\r") for l in raw.split("\n")]
    try:
        console = open(args.console, encoding="utf-8", errors="replace").read().split("\n")
    except OSError:
        console = []
    sections = blocks(lines)
    lab = {}
    modules = []
    tests = []
    for line in lines:
        if line.startswith("@@LAB "):
            parts = line.split(" ", 2)
            key, value = parts[1], parts[2] if len(parts) > 2 else ""
            if key == "module":
                modules.append(value)
            else:
                lab[key] = value
        elif line.startswith("@@TEST "):
            parts = line.split(" ", 4)
            test = {"name": parts[1], "result": parts[2],
                    "seconds": float(parts[3]) if len(parts) > 3 else None}
            if len(parts) > 4:
                test["reason"] = parts[4]
            out = sections.get("output " + parts[1])
            if out:
                test["output_tail"] = out.split("\n")
            tests.append(test)
    completed = "done" in lab
    probe = as_json(sections.get("probe"))
    # The probe answers every needs= of the suite: one that could not run, or whose JSON is not
    # the probe's, fails the run (the guest's init fails the tests that needed it).
    probe_error = lab.get("probe-error")
    if probe_error is None and completed and (not isinstance(probe, dict) or "unparsed" in probe):
        probe_error = "`guestmem probe --json` gave no JSON: " + str(probe.get("unparsed", probe))[-300:]
    passed = sum(t["result"] == "ok" for t in tests)
    failed = sum(t["result"] == "failed" for t in tests)
    # Skipped: only where a probe that ran says the kernel lacks what the test needs (the
    # reason names it); any other result is a failure.
    skipped = sum(t["result"] == "skipped" for t in tests)
    failed += sum(t["result"] not in ("ok", "failed", "skipped") for t in tests)
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True)
    record = {
        "what": "guestmem's lab suite on another kernel, in a QEMU TCG guest with KVM "
                "(nested SVM+NPT) and two NUMA nodes (scripts/kernel-lab.sh)",
        "measured_under": "QEMU TCG (full emulation): every time here is TCG time, "
                          "never to be compared with host figures",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": args.commit,
        "tree_dirty": subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                      ".", ":!docs/results"],
                                     capture_output=True, text=True).stdout.strip() != "",
        "kernel": args.kernel,
        "kernel_image": args.image,
        "kernel_release": lab.get("kernel"),
        "qemu": qemu.stdout.split("\n")[0] if qemu.returncode == 0 else None,
        "qemu_machine": (
            "q35, -cpu EPYC,+svm,+npt, 2 vCPUs (one socket each), 2 GiB in two NUMA nodes of 1 GiB"
            if (args.cpus or "2") != "1"
            else "q35, -cpu EPYC,+svm,+npt, 1 vCPU (in node 0), 2 GiB in two NUMA nodes of 1 GiB"
        ),
        "tcg_thread": args.tcg_thread,
        "guest_nodes_with_memory": lab.get("nodes"),
        "kvm_modules": modules,
        "dev_kvm": lab.get("kvm") == "yes",
        "suite": args.suite,
        # The experiment variables a suite's prepare script passes into the lab (LAB_BACKEND,
        # LAB_CMDLINE_EXTRA, ...): a run with them is not the suite's default run.
        "lab_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LAB_")},
        "completed": completed,
        "boot_attempts": int(args.attempts or 1),
        "retried_because": args.retry_reason or None,
        "run_seconds_tcg": int(args.seconds or 0),
        "time_limit_seconds": int(args.timeout or 0),
        "qemu_exit": int(args.qemu_exit or 0),
        "passed": passed,
        "failed": failed,
        "skipped": skipped,
        "tests": tests,
        "probe": probe,
        "probe_error": probe_error,
    }
    if "populate" in sections:
        record["populate_gmem_64mib_tcg"] = as_json(sections["populate"])
    if "transport" in sections:
        record["transport_tls_64mib_tcg"] = as_json(sections["transport"])
    numa = {k[len("numa "):]: as_json(v) for k, v in sections.items() if k.startswith("numa ")}
    if numa:
        record["numa_gmem_64mib"] = numa
    refusals = {k[len("refusal "):]: v.split("\n") for k, v in sections.items()
                if k.startswith("refusal ")}
    if refusals:
        record["gmem_paths_refused_or_not"] = refusals
    if not completed:
        record["console_tail"] = [l.rstrip("\r") for l in console[-40:]]
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for t in tests:
        extra = f" ({t['reason']})" if "reason" in t else ""
        print(f"lab test {t['name']} ... {t['result']} {t['seconds']} s (TCG){extra}")
        for l in t.get("output_tail", [])[-25:]:
            print("    " + l)
    if args.retry_reason:
        print(f"lab: {args.retry_reason}; booted {args.attempts} times")
    if not completed:
        print(f"lab: the run did not complete (QEMU exit {args.qemu_exit} after {args.seconds} s, "
              f"limit {args.timeout} s); the console's last lines:")
        for l in console[-40:]:
            print("    " + l.rstrip("\r"))
    if probe_error:
        print(f"lab: the probe failed: {probe_error}")
    print(f"lab: kernel {lab.get('kernel')}, record {args.out}")
    print(f"lab: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if completed and failed == 0 and tests and not probe_error else 1)


if __name__ == "__main__":
    main()
