#!/usr/bin/env python3
"""A bad value is refused the same way by `hotpath train --dry-run` and by a real run.

usage: both_ways.py HOTPATH CONFIG REGEX -- ARGS...

Runs `HOTPATH train --config CONFIG BASE ARGS --dry-run` and the same without --dry-run (a run of
one step on the CPU backend), where BASE are small-run settings that ARGS may override. Both must
exit with status 2, print the same error line, and that line must match REGEX (which names the
key). Prints what differs and exits 1 otherwise.
"""
import re
import subprocess
import sys

BASE = ["--seq_len=128", "--batch_tokens=1024", "--log_every=100", "--device=cpu", "--steps=1"]


def key_of(arg):
    return arg.split("=", 1)[0]


def error_lines(text):
    return [l for l in text.splitlines() if " error: " in l or l.startswith("error: ")]


def main():
    if len(sys.argv) < 5 or sys.argv[4] != "--":
        print(__doc__, file=sys.stderr)
        return 64
    hotpath, config, regex, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5:]
    given = {key_of(a) for a in args}
    base = [a for a in BASE if key_of(a) not in given]
    command = [hotpath, "train", "--config", config] + base + args
    results = {}
    for name, cmd in (("dry-run", command + ["--dry-run"]), ("run", command)):
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=60)
        results[name] = (p.returncode, error_lines(p.stderr), p.stdout + p.stderr)
    ok = True
    for name, (rc, errors, out) in results.items():
        if rc != 2 or len(errors) != 1 or not re.search(regex, errors[0]):
            print(f"[both_ways] FAILED: {name}: exit {rc}, error lines {errors}, expected exit 2 "
                  f"and one error line matching {regex!r}\n{out[-2000:]}")
            ok = False
    if ok and results["dry-run"][1] != results["run"][1]:
        print(f"[both_ways] FAILED: the messages differ:\n  dry-run: {results['dry-run'][1][0]}\n"
              f"  run:     {results['run'][1][0]}")
        ok = False
    if ok:
        print(f"[both_ways] ok: both exit 2 with: {results['run'][1][0]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
