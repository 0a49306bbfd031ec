#!/usr/bin/env python3
"""The `sweep` tests of examples/scaling/sweep.py, each a subcommand:

  demo HOTPATH WORK      the CPU demo sweep: every point in the CSV, its numbers those of the
                         point's own JSON; PNGs valid with the expected series counts; the report
  resume HOTPATH WORK    a sweep killed after two points, run again: it finishes, runs no finished
                         point twice, and records its failing point with the error
  errors WORK            mistakes in sweep files name the file and key and exit 2

Exit 77 (skipped) with the reason when matplotlib is missing for the tests that plot.
"""

import csv
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "examples", "scaling", "sweep.py")
sys.path.insert(0, os.path.dirname(SWEEP))
import sweep  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from checks import Checks  # noqa: E402

_checks = Checks("check_sweep")
check, done = _checks.check, _checks.done


def need_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"[check_sweep] SKIPPED: {sys.executable} has no matplotlib (launch/setup.sh "
              "installs it: hp_python_matplotlib)", flush=True)
        sys.exit(77)


def png_size(path):
    """(width, height) of a PNG file, or None when it is not one."""
    with open(path, "rb") as f:
        head = f.read(33)
    if len(head) < 33 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def run_sweep(sweep_file, out, hotpath, *extra):
    return subprocess.run([sys.executable, SWEEP, "run", sweep_file, "--out", out, "--hotpath",
                           hotpath, *extra], capture_output=True, text=True)


def rows_of(csv_path):
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def cmd_demo(hotpath, work):
    need_matplotlib()
    out = os.path.join(work, "demo")
    shutil.rmtree(out, ignore_errors=True)
    sweep_file = os.path.join(ROOT, "examples", "scaling", "sweeps", "cpu-demo.ini")
    _, points = sweep.read_sweep(sweep_file)
    check(len(points) == 12, "cpu-demo has", len(points), "points, expected 3 GPU counts x 2 "
          "layouts x 2 expert counts = 12")
    # First a host "of 2 GPUs": the 4-rank points are left out and not recorded; the full run
    # after it runs just those.
    r = run_sweep(sweep_file, out, hotpath, "--max-gpus", "2", "--no-plots")
    sys.stderr.write(r.stderr[-1500:])
    check(r.returncode == 0, "the sweep with --max-gpus 2 exited", r.returncode)
    check("4 points need more than 2 GPUs and are left out" in r.stderr,
          "--max-gpus 2 does not say it leaves out the 4 four-rank points")
    first = rows_of(os.path.join(out, "results.csv"))
    check(len(first) == 8 and all(int(row["gpus"]) <= 2 for row in first),
          "--max-gpus 2 recorded", [(row["key"], row["gpus"]) for row in first])
    r = run_sweep(sweep_file, out, hotpath)
    sys.stderr.write(r.stderr[-3000:])
    check(r.returncode == 0, "the demo sweep exited", r.returncode)
    check("8 already in" in r.stderr and "4 to run" in r.stderr,
          "the full run does not pick up the 4 points left out")
    check(f"12/12 done" in r.stderr, "no '12/12 done' progress line")
    check("ETA" in r.stderr, "no ETA in the progress lines")
    rows = rows_of(os.path.join(out, "results.csv"))
    by_key = {row["key"]: row for row in rows}
    check(len(rows) == len(points) == len(by_key), "CSV has", len(rows), "rows,", len(by_key),
          "keys, for", len(points), "points")
    for p in points:
        row = by_key.get(p["key"])
        if not check(row is not None, "point missing from the CSV:", p["key"]):
            continue
        check(row["status"] == "ok", p["key"], "status", row["status"], row["error"])
        for k in ("gpus", "dp", "ep", "n_experts", "top_k", "tokens_per_gpu", "global_tokens"):
            check(int(row[k]) == p[k], p["key"], k, row[k], "!=", p[k])
        jpath = os.path.join(out, "points", p["key"] + ".json")
        if not check(os.path.exists(jpath), "no JSON for", p["key"]):
            continue
        with open(jpath) as f:
            j = json.load(f)
        # The run's own JSON: world and tokens are the point's; every CSV number is the JSON's.
        check(j["world"] == p["gpus"], p["key"], "world", j["world"])
        check(j["tokens_per_step"] == p["global_tokens"], p["key"], "tokens", j["tokens_per_step"])
        check(len(j["memory"]["per_rank_bytes"]) == p["gpus"], p["key"], "memory of",
              len(j["memory"]["per_rank_bytes"]), "ranks")
        check(all(b > 0 for b in j["memory"]["per_rank_bytes"]), p["key"], "a rank's memory is 0")
        want = sweep.row_from_json(j)
        for k, v in want.items():
            got = row[k]
            ok = (got == sweep.fmt(v)) and (not isinstance(v, float) or float(got) == v)
            check(ok, p["key"], k, "CSV", got, "JSON", v)
        check(float(row["tok_s"]) == j["tokens_per_s"], p["key"], "tok_s")
        check(float(row["tok_s_per_gpu"]) == j["tokens_per_s"] / j["world"], p["key"], "tok/s/GPU")
        shares = [float(row[f"family_{f}_share"]) for f in sweep.FAMILIES] + [float(row["idle_share"])]
        check(abs(sum(shares) - 1) < 1e-6, p["key"], "family shares sum to", sum(shares))
        phases = [float(row[f"phase_{ph}_share"]) for ph in sweep.PHASES] + [float(row["idle_share"])]
        check(abs(sum(phases) - 1) < 1e-6, p["key"], "phase shares sum to", sum(phases))
    # Plots: valid PNGs; the series each must have follow from the sweep's axes.
    with open(os.path.join(out, "plots.json")) as f:
        plots = json.load(f)
    stacked = [c for c in [f"family_{f}_share" for f in sweep.FAMILIES] + ["idle_share"]
               if any(float(row[c]) > 0 for row in rows)]
    expected = {
        "scaling.png": 2 * 2,        # a line per (layout, experts) over 1, 2, 4 GPUs
        "experts.png": 2 * 3,        # a line per (layout, GPUs) over 8, 16 experts
        "breakdown.png": len(stacked),  # the families (and idle) that took any time
        "memory.png": 2,             # largest and smallest rank
    }
    check(set(plots) == set(expected), "plots", sorted(plots), "expected", sorted(expected))
    for name, n in expected.items():
        path = os.path.join(out, name)
        size = png_size(path) if os.path.exists(path) else None
        check(size is not None and size[0] > 100 and size[1] > 100, name, "is not a valid PNG",
              size)
        check(plots.get(name, {}).get("series") == n, name, "has", plots.get(name), "series, "
              "expected", n)
        check(plots.get(name, {}).get("points") == 12, name, "points", plots.get(name))
    check(not [f for f in os.listdir(out) if f.endswith(".tmp")], "temporary files left in", out)
    # The report: a table row per point, every plot linked.
    md = os.path.join(out, "report", "scaling.md")
    r = subprocess.run([sys.executable, SWEEP, "report", os.path.join(out, "results.csv"), "--md",
                        md], capture_output=True, text=True)
    check(r.returncode == 0, "report exited", r.returncode, r.stderr[-500:])
    text = open(md).read() if os.path.exists(md) else ""
    for name in expected:
        check(f"](../{name})" in text, "the report does not link", name)
    table = [l for l in text.splitlines() if l.startswith("| tiny-moe |")]
    check(len(table) == 3 * 12, "report has", len(table), "point rows, expected 12 in each of 3 "
          "tables")
    return done("cpu demo sweep: 12 points, CSV = JSON, 4 plots, report")


RESUME_SWEEP = """
[sweep]
name = resume
config = examples/configs/tiny-moe.ini
launcher = local
args = --seq_len=128 --log_every=1000 --n_layers=1
bench_steps = 1
bench_warmup = 0
tokens_per_gpu = 256
top_k = 2

[series main]
n_experts = 4, 8, 16, 32, 64

# A point that cannot run: hotpath rejects its config (a key it does not know).
[series bad]
args = --seq_len=128 --log_every=1000 --n_layers=1 --n_experts_per_token_check=1
n_experts = 4
"""


def cmd_resume(hotpath, work):
    out = os.path.join(work, "resume")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sweep_file = os.path.join(out, "resume.ini")
    with open(sweep_file, "w") as f:
        f.write(RESUME_SWEEP)
    _, points = sweep.read_sweep(sweep_file)
    check(len(points) == 6, "resume sweep has", len(points), "points")
    keys = [p["key"] for p in points]
    csv_path = os.path.join(out, "results.csv")
    # First run: killed (with the point it is running) once two points are in the CSV.
    proc = subprocess.Popen([sys.executable, SWEEP, "run", sweep_file, "--out", out, "--hotpath",
                             hotpath, "--no-plots"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(csv_path) and len(rows_of(csv_path)) >= 2:
            break
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    check(killed, "the sweep ended before it could be killed")
    before = {r["key"]: r for r in rows_of(csv_path)}
    check(len(before) >= 2, "only", len(before), "rows before the kill")
    check(len(before) < len(points), "every point finished before the kill")
    # Second run: picks up where the first stopped.
    r = run_sweep(sweep_file, out, hotpath, "--no-plots")
    sys.stderr.write(r.stderr[-3000:])
    check(r.returncode == 1, "a sweep with a failed point exits 1, got", r.returncode)
    check(f"{len(before)} already in" in r.stderr, "the resumed run does not say it skips",
          len(before), "points")
    rows = rows_of(csv_path)
    by_key = {row["key"]: row for row in rows}
    check(len(rows) == len(points) and set(by_key) == set(keys), "after resume: rows",
          len(rows), "keys", sorted(by_key), "expected", sorted(keys))
    for k, row in before.items():
        check(by_key.get(k) == row, "finished point", k, "changed on resume")
    with open(os.path.join(out, "launches.log")) as f:
        launches = f.read().split()
    for k in keys:
        n = launches.count(k)
        check(n == 1 if k in before else n in (1, 2), "point", k, "launched", n, "times",
              "(finished before the kill)" if k in before else "")
    bad = [row for row in rows if row["status"] != "ok"]
    check(len(bad) == 1 and "series" in bad[0] and bad[0]["series"] == "bad", "failed rows:",
          [(b["key"], b["series"]) for b in bad])
    if bad:
        check("n_experts_per_token_check" in bad[0]["error"] and bad[0]["error"].startswith("exit 2"),
              "the failed point's error does not name the bad key:", bad[0]["error"])
    ok = [row for row in rows if row["status"] == "ok"]
    check(len(ok) == 5, len(ok), "points ok, expected 5")
    # A third run has nothing left to do unless asked to retry the failed point.
    r = run_sweep(sweep_file, out, hotpath, "--no-plots")
    check(r.returncode == 0 and "0 to run" in r.stderr, "a finished sweep ran points again:",
          r.stderr[-500:])
    with open(os.path.join(out, "launches.log")) as f:
        check(len(f.read().split()) == len(launches), "the third run launched something")
    return done("killed sweep resumed: no finished point ran twice; failure recorded")


ERRORS = [
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\nlaunchr = mpirun\n", "key 'launchr'"),
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\nlauncher = pbs\n",
     "key 'launcher': 'pbs' is not one of local, mpirun, srun, sbatch"),
    ("[sweep]\nconfig = nowhere.ini\n", "key 'config': 'nowhere.ini' not found"),
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\nlauncher = mpirun\ngpus = 2\n"
     "layout = ep3\n", "key 'layout': ep3 does not divide 2 GPUs"),
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\ngpus = 2\n", "launcher 'local' runs one"),
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\ntokens_per_gpu = lots\n",
     "key 'tokens_per_gpu': 'lots' is not an integer"),
    ("[sweep]\nconfig = examples/configs/tiny-moe.ini\nargs = --top_k=3\n",
     "key 'args': '--top_k=3' is set by the sweep's axes"),
    ("[points]\nconfig = x\n", "no [sweep] section"),
]


def cmd_errors(work):
    os.makedirs(work, exist_ok=True)
    for i, (text, want) in enumerate(ERRORS):
        path = os.path.join(work, f"bad{i}.ini")
        with open(path, "w") as f:
            f.write(text)
        r = subprocess.run([sys.executable, SWEEP, "list", path], capture_output=True, text=True)
        check(r.returncode == 2, path, "exit", r.returncode, "expected 2")
        check(want in r.stderr and path in r.stderr, path, "says", repr(r.stderr.strip()),
              "expected it to name the file and", repr(want))
    return done(f"{len(ERRORS)} bad sweep files refused, each naming its file and key")


def main():
    cmd = sys.argv[1]
    if cmd == "demo":
        return cmd_demo(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "resume":
        return cmd_resume(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "errors":
        return cmd_errors(sys.argv[2])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
