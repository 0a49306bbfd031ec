#!/usr/bin/env python3
"""The `sweep` tests of examples/scaling/sweep.py, each a subcommand:

  demo HOTPATH WORK      the CPU demo sweep: every point in the CSV, its numbers those of the
                         point's own JSON; PNGs valid with the expected series counts; the report
  resume HOTPATH WORK    a sweep killed after two points, run again: it finishes, runs no finished
                         point twice, and records its failing point with the error
  errors WORK            mistakes in sweep files (numbers included) name the file, line and key
                         and exit 2
  interrupt HOTPATH WORK a sweep stopped by SIGINT, then SIGTERM, while a point runs: the signal
                         reaches the point, nothing of it outlives the runner, the CSV stays
                         whole, exit 130 / 143 and one line saying how to resume
  torn HOTPATH WORK      a torn last CSV line is dropped with a warning and its point run again;
                         a damaged line elsewhere is refused naming it
  report WORK            `report` writes next to the CSV by default (never into the repository),
                         replaces nothing it did not write without --force; document tokens and
                         padding in its tables
  series WORK            a plot's line joins only points that differ in its axis alone (args
                         included), and its legend names the key
  loss_report WORK       a loss point's CSV numbers from its JSONL (a run without the final
                         eval_loss or flops is failed); loss.png's series keyed by every key but
                         the budget, the best point of each budget; `table` and the report
  loss HOTPATH WORK      the CPU loss demo end to end: held-out data split off, every point
                         trained on its budget, finite held-out loss, FLOPs growing with the
                         budget, hotpath's parameter counts, loss.png and the table

Exit 77 (skipped) with the reason when matplotlib is missing for the tests that plot.
"""

import csv
import io
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
        # The run's own JSON: world and positions are the point's; every CSV number is the JSON's.
        # positions_per_step counts the padded positions (batch_tokens); a hotpath whose JSON
        # predates it gives them as tokens_per_step.
        check(j["world"] == p["gpus"], p["key"], "world", j["world"])
        positions = j.get("positions_per_step", j["tokens_per_step"])
        check(positions == p["global_tokens"], p["key"], "positions per step", positions)
        pad = j.get("padding", 0.0)
        check(0 <= pad < 1, p["key"], "padding", pad, "is not in [0, 1)")
        check(float(row["padding"]) == pad, p["key"], "CSV padding", row["padding"], "JSON", pad)
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
    # The report: a table row per point, every plot linked; throughput in document tokens.
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
    check("| doc tok/s | padding | doc tok/s/GPU |" in text, "the report's throughput columns "
          "are not document tokens with padding")
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


CFG = "[sweep]\nconfig = examples/configs/tiny-moe.ini\n"
ERRORS = [
    (CFG + "launchr = mpirun\n", ":3: [sweep] key 'launchr'"),
    (CFG + "launcher = pbs\n",
     ":3: [sweep] key 'launcher': 'pbs' is not one of local, mpirun, srun, sbatch"),
    ("[sweep]\nconfig = nowhere.ini\n", ":2: [sweep] key 'config': 'nowhere.ini' not found"),
    (CFG + "launcher = mpirun\ngpus = 2\nlayout = ep3\n",
     ":5: [sweep] key 'layout': ep3 does not divide 2 GPUs"),
    (CFG + "gpus = 2\n", "launcher 'local' runs one"),
    (CFG + "tokens_per_gpu = lots\n", ":3: [sweep] key 'tokens_per_gpu': 'lots' is not an integer"),
    (CFG + "args = --top_k=3\n", ":3: [sweep] key 'args': '--top_k=3' is set by the sweep's axes"),
    (CFG + "args = --seq_len='128\n", ":3: [sweep] key 'args': No closing quotation"),
    ("[points]\nconfig = x\n", "no [sweep] section"),
    # Numbers: digits with an optional k (x 1024), nothing else, in every numeric key; the line
    # named is the one the value comes from (a series inherits [sweep]'s).
    (CFG + "tokens_per_gpu = 1k5\n", ":3: [sweep] key 'tokens_per_gpu': '1k5' is not an integer"),
    (CFG + "global_tokens = 16k, 32kk\n", ":3: [sweep] key 'global_tokens': '32kk' is not an"),
    (CFG + "launcher = mpirun\ngpus = 1, 2x\n", ":4: [sweep] key 'gpus': '2x' is not an integer"),
    (CFG + "n_experts = -8\n", ":3: [sweep] key 'n_experts': '-8' is not an integer"),
    (CFG + "top_k = 2.0\n", ":3: [sweep] key 'top_k': '2.0' is not an integer"),
    (CFG + "top_k = \u0663\n", ":3: [sweep] key 'top_k': '\u0663' is not an integer"),
    (CFG + "bench_steps = 3_000\n", ":3: [sweep] key 'bench_steps': '3_000' is not an integer"),
    (CFG + "bench_warmup = +1\n", ":3: [sweep] key 'bench_warmup': '+1' is not an integer"),
    (CFG + "timeout_s = 1e3\n", ":3: [sweep] key 'timeout_s': '1e3' is not an integer"),
    (CFG + "gpus_per_node = 0\n", ":3: [sweep] key 'gpus_per_node': 0 is below 1"),
    (CFG + "bench_steps = 0\n", ":3: [sweep] key 'bench_steps': 0 is below 1"),
    (CFG + "tokens_per_gpu =\n", ":3: [sweep] key 'tokens_per_gpu' is empty"),
    (CFG + "top_k = 2k2\n\n[series a]\nn_experts = 8\n", ":3: [sweep] key 'top_k': '2k2'"),
    (CFG + "\n[series a]\nn_experts = 8\nbench_steps = 2.5\n",
     ":6: [series a] key 'bench_steps': '2.5' is not an integer"),
    # Loss sweeps: one mode per file, a budget of one kind, data given or written, no flag the
    # runner sets, FLOP budgets whole numbers.
    (CFG + "mode = accuracy\n", ":3: [sweep] key 'mode': 'accuracy' is not one of throughput, "
     "loss"),
    (CFG + "budget_tokens = 64k\n", ":3: [sweep] key 'budget_tokens' belongs to mode = loss"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --docs=10\nbench_steps = 2\n",
     ":6: [sweep] key 'bench_steps' belongs to mode = throughput"),
    (CFG + "mode = loss\nsynth_data = --docs=10\n", "needs one of 'budget_tokens' (tokens each "
     "point trains on) and 'budget_flops'"),
    (CFG + "mode = loss\nsynth_data = --docs=10\nbudget_tokens = 64k\nbudget_flops = 1e12\n",
     "and 'budget_flops' (model FLOPs each point spends), not both"),
    (CFG + "mode = loss\nbudget_tokens = 64k\n", "a loss sweep needs 'data' and 'eval_data'"),
    (CFG + "mode = loss\nbudget_tokens = 64k\ndata = a.bin\n",
     "a loss sweep needs 'data' and 'eval_data'"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --docs=10\ndata = a.bin\n",
     "it excludes 'data' and 'eval_data'"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --docs 10\n",
     ":5: [sweep] key 'synth_data': '--docs' is not --key=value"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --docs=many\n",
     ":5: [sweep] key 'synth_data --docs': 'many' is not an integer"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --out=x.bin\n",
     ":5: [sweep] key 'synth_data': '--out=x.bin': the runner names the files"),
    (CFG + "mode = loss\nbudget_flops = 1e-3\nsynth_data = --docs=10\n",
     ":4: [sweep] key 'budget_flops': '1e-3' is not an integer"),
    (CFG + "mode = loss\nbudget_flops = 1.25e1\nsynth_data = --docs=10\n",
     ":4: [sweep] key 'budget_flops': '1.25e1' is not a whole number of FLOPs"),
    (CFG + "mode = loss\nbudget_tokens = 1k\ntokens_per_gpu = 2k\nsynth_data = --docs=10\n",
     ":4: [sweep] key 'budget_tokens': 1024 is less than one step's 2048 tokens"),
    (CFG + "mode = loss\nbudget_tokens = 64k\nsynth_data = --docs=10\nargs = --steps=5\n",
     ":6: [sweep] key 'args': '--steps=5' is set by the sweep's axes and loss keys"),
    (CFG + "mode = loss\nbudget_tokens = 64k\neval_data = b.bin\ndata = a.bin\n"
     "args = --eval_every=5\n", ":7: [sweep] key 'args': '--eval_every=5' is set by"),
    (CFG + "d_model = 64\nargs = --d_model=32\n", ":4: [sweep] key 'args': '--d_model=32' and "
     "the axis 'd_model'"),
    (CFG + "\n[series a]\nmode = loss\n", ":5: [series a] key 'mode': set it in [sweep]"),
]


def cmd_errors(work):
    os.makedirs(work, exist_ok=True)
    for i, (text, want) in enumerate(ERRORS):
        path = os.path.join(work, f"bad{i}.ini")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        r = subprocess.run([sys.executable, SWEEP, "list", path], capture_output=True, text=True)
        check(r.returncode == 2, path, "exit", r.returncode, "expected 2")
        need = path + want if want.startswith(":") else want
        check(need in r.stderr and path in r.stderr, path, "says", repr(r.stderr.strip()),
              "expected it to name the file (and line) and", repr(want))
        check("Traceback" not in r.stderr, path, "prints a traceback")
    # What the numbers may be: 16k and 16K are 16384, plain digits are themselves.
    path = os.path.join(work, "good.ini")
    with open(path, "w") as f:
        f.write(CFG + "tokens_per_gpu = 16k, 4K, 512\nbench_steps = 2\ntimeout_s = 0\n")
    _, points = sweep.read_sweep(path)
    check(sorted(p["tokens_per_gpu"] for p in points) == [512, 4096, 16384],
          "16k, 4K, 512 read as", sorted(p["tokens_per_gpu"] for p in points))
    check(all(p["bench_steps"] == 2 and p["timeout_s"] == 0 for p in points),
          "bench_steps/timeout_s read as", [(p["bench_steps"], p["timeout_s"]) for p in points])
    # M is x 1048576; a FLOP budget may carry a decimal exponent; token budgets give the steps.
    with open(path, "w") as f:
        f.write(CFG + "mode = loss\ntokens_per_gpu = 1k\nbudget_tokens = 2M, 64k\n"
                "synth_data = --docs=10\n")
    _, points = sweep.read_sweep(path)
    check(sorted((p["budget"], p["steps"]) for p in points) == [(65536, 64), (2097152, 2048)],
          "budget_tokens 2M, 64k at 1k tokens a step read as",
          [(p["budget"], p.get("steps")) for p in points])
    with open(path, "w") as f:
        f.write(CFG + "mode = loss\nbudget_flops = 3e12, 1.5e13, 4096\nsynth_data = --docs=10\n")
    _, points = sweep.read_sweep(path)
    check(sorted(p["budget"] for p in points) == [4096, 3 * 10 ** 12, 15 * 10 ** 12],
          "budget_flops 3e12, 1.5e13, 4096 read as", sorted(p["budget"] for p in points))
    return done(f"{len(ERRORS)} bad sweep files refused, each naming its file, line and key")


# ---- report outputs, document tokens, series keys (no hotpath needed) --------------------------

def fake_bench_json(world, tokens, padding, ms, with_new_fields=True):
    """A `hotpath bench step --bench_json` object as hotpath writes it."""
    wall = 10.0
    fam = {f: 0.0 for f in sweep.FAMILIES}
    fam["dense_gemm"] = 6.0
    fam["attention"] = 3.0
    ph = {p: 0.0 for p in sweep.PHASES}
    ph["forward"], ph["backward"] = 3.0, 6.0
    doc = tokens * (1 - padding)
    j = {"world": world, "backend": "cpu-f32", "ms_per_step": ms, "tokens_per_step": doc,
         "tokens_per_s": doc / ms * 1000, "mfu": 0.0, "gpu_busy_fraction": 1.0,
         "syncs_per_step": 2.0,
         "profile": {"wall_ms": wall, "idle_ms": 1.0, "by_phase_ms": ph, "by_family_ms": fam},
         "memory": {"kind": "host_peak_rss", "per_rank_bytes": [1 << 20] * world}}
    if with_new_fields:
        j.update({"positions_per_step": tokens, "positions_per_s": tokens / ms * 1000,
                  "padding": padding})
    else:
        j["tokens_per_step"] = tokens
    return j


def fake_results(csv_path, points):
    """A results CSV of rows (model, n_experts, top_k, tokens_per_gpu, args, padding)."""
    os.makedirs(os.path.dirname(csv_path), exist_ok=True)
    for model, ne, k, tpg, args, pad in points:
        p = {"model": model, "gpus": 1, "layout": "dp", "dp": 1, "ep": 1, "n_experts": ne,
             "top_k": k, "global_tokens": tpg, "args": args.split()}
        row = {**p, "key": sweep.point_key(p), "series": "s", "launcher": "local", "nodes": 1,
               "scaling": "weak", "tokens_per_gpu": tpg, "args": args}
        row.update(sweep.row_from_json(fake_bench_json(1, tpg, pad, 50.0 + ne + k)))
        row["wall_s"], row["finished_at"] = 1.0, "2025-01-01T00:00:00"
        sweep.append_row(csv_path, row)


def sweep_cmd(*args):
    return subprocess.run([sys.executable, SWEEP, *args], capture_output=True, text=True)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def cmd_report(work):
    """`report` writes next to the CSV unless told otherwise, never into the repository by
    default, and replaces no file it did not write without --force; throughput is counted in
    document tokens, with the padding beside it."""
    shutil.rmtree(work, ignore_errors=True)
    res = os.path.join(work, "res")
    csv_path = os.path.join(res, "results.csv")
    fake_results(csv_path, [("m", 8, 2, 4096, "--n_layers=1", 0.25),
                            ("m", 16, 2, 4096, "--n_layers=1", 0.0)])
    with open(csv_path) as f:
        header = f.readline().strip().split(",")
    check("padding" in header and header.index("padding") == header.index("tok_s") + 1,
          "no padding column after tok_s:", header)
    # Before the JSON had padding: 0, not a failure.
    check(sweep.row_from_json(fake_bench_json(1, 4096, 0.0, 50, False)).get("padding") == 0.0,
          "a JSON without padding does not give padding 0")
    docs = os.path.join(ROOT, "docs", "scaling.md")
    docs_before = read_bytes(docs) if os.path.exists(docs) else None
    r = sweep_cmd("report", csv_path)
    check(r.returncode == 0, "report without --md exit", r.returncode, r.stderr[-600:])
    check((read_bytes(docs) if os.path.exists(docs) else None) == docs_before,
          "report without --md changed", docs)
    md = os.path.join(res, "report.md")
    text = open(md).read() if check(os.path.exists(md), "report without --md wrote no", md) else ""
    check(text.startswith(sweep.REPORT_MARK + "\n"), "the report does not start with its mark")
    check("| doc tok/s | padding | doc tok/s/GPU |" in text, "no document-token columns:",
          [l for l in text.splitlines() if l.startswith("| model")][:1])
    check(" | 25.0% | " in text and " | 0.0% | " in text, "the padding of the points (25%, 0%) "
          "is not in the table")
    check("document tokens per second" in text, "the report does not say tok/s counts document "
          "tokens")
    # Its own earlier report in the CSV's directory is replaced; anything else is not.
    r = sweep_cmd("report", csv_path)
    check(r.returncode == 0, "a second report exit", r.returncode, r.stderr[-600:])
    notes = os.path.join(res, "notes.md")
    with open(notes, "w") as f:
        f.write("my notes\n")
    r = sweep_cmd("report", csv_path, "--md", notes)
    check(r.returncode == 2 and f"--md {notes} exists" in r.stderr and "--force" in r.stderr,
          "a foreign --md: exit", r.returncode, r.stderr.strip())
    check(read_bytes(notes) == b"my notes\n", "a foreign --md was changed")
    r = sweep_cmd("report", csv_path, "--md", notes, "--force")
    check(r.returncode == 0 and read_bytes(notes).startswith(sweep.REPORT_MARK.encode()),
          "--force did not replace --md:", r.returncode, r.stderr[-400:])
    # An earlier report outside the CSV's directory (a committed docs page) needs --force too.
    other = os.path.join(work, "docs", "scaling.md")
    os.makedirs(os.path.dirname(other))
    shutil.copy(md, other)
    before = read_bytes(other)
    r = sweep_cmd("report", csv_path, "--md", other)
    check(r.returncode == 2 and "outside the CSV's directory" in r.stderr,
          "a report outside the CSV's directory replaced without --force:", r.returncode,
          r.stderr.strip())
    check(read_bytes(other) == before, "the outside report changed without --force")
    r = sweep_cmd("report", csv_path, "--md", other, "--force")
    check(r.returncode == 0, "--md outside --force exit", r.returncode, r.stderr[-400:])
    check("--force`" in open(other).read(), "the report does not give the --force it needs to be "
          "written again")
    # The CSV itself is never the report.
    csv_before = read_bytes(csv_path)
    r = sweep_cmd("report", csv_path, "--md", csv_path, "--force")
    check(r.returncode == 2 and "that is the results CSV" in r.stderr, "--md = the CSV: exit",
          r.returncode, r.stderr.strip())
    check(read_bytes(csv_path) == csv_before, "--md = the CSV changed the CSV")
    # Plots in another directory replace nothing there without --force (report and plot).
    img = os.path.join(work, "img")
    os.makedirs(img)
    with open(os.path.join(img, "memory.png"), "wb") as f:
        f.write(b"not mine")
    for args in (("report", csv_path, "--md", os.path.join(work, "r2.md"), "--images", img),
                 ("plot", csv_path, "--out", img)):
        r = sweep_cmd(*args)
        check(r.returncode == 2 and "memory.png already there" in r.stderr, args[0],
              "over a foreign plot: exit", r.returncode, r.stderr.strip())
        check(read_bytes(os.path.join(img, "memory.png")) == b"not mine", args[0],
              "replaced a foreign plot without --force")
        check("Traceback" not in r.stderr, args[0], "prints a traceback")
    check(not os.path.exists(os.path.join(work, "r2.md")), "a refused report wrote its markdown")
    return done("report: next to the CSV by default, nothing replaced without --force, document "
                "tokens and padding")


def cmd_series(work):
    """A line of a plot joins only points that differ in the plot's axis alone: points that
    differ in any flag (args included) are on lines of their own, and the legend names the key."""
    shutil.rmtree(work, ignore_errors=True)
    csv_path = os.path.join(work, "results.csv")
    # Like the GPT-OSS-20b points of docs/scaling: a tokens series on two layers, and an experts
    # series on one layer whose 32-expert point has the tokens series' 16K tokens per GPU.
    two, one = "--n_layers=2", "--n_layers=1"
    fake_results(csv_path, [("m", 32, 4, t, two, 0.1) for t in (4096, 8192, 16384, 32768)]
                 + [("m", e, 4, 16384, one, 0.1) for e in (8, 16, 32)]
                 + [("m", 32, k, 16384, two, 0.1) for k in (1, 2)])
    rows = sweep.ok_rows(csv_path)
    specs = sweep.plot_lines(rows)
    check(set(specs) == {"tokens.png", "experts.png", "topk.png"}, "plots", sorted(specs))
    for name, spec in specs.items():
        for kd, g in spec["lines"]:
            xs = [int(r[spec["axis"]]) for r in g]
            check(len(xs) == len(set(xs)), name, "line", kd, "has a repeated", spec["axis"], xs)
            for c in sweep.KEY_COLS:
                if c in kd:
                    check(len({r[c] for r in g}) == 1, name, "line", kd, "joins points whose",
                          c, "differ:", sorted({r[c] for r in g}))
    tokens = specs.get("tokens.png", {"lines": []})["lines"]
    check([[int(r["tokens_per_gpu"]) for r in g] for _, g in tokens] == [[4096, 8192, 16384,
                                                                          32768]],
          "tokens.png lines", [[(r["tokens_per_gpu"], r["args"]) for r in g] for _, g in tokens])
    experts = specs.get("experts.png", {"lines": []})["lines"]
    check([[(int(r["n_experts"]), r["args"]) for r in g] for _, g in experts]
          == [[(8, one), (16, one), (32, one)]], "experts.png lines",
          [[(r["n_experts"], r["args"]) for r in g] for _, g in experts])
    topk = specs.get("topk.png", {"lines": []})["lines"]
    check([[int(r["top_k"]) for r in g] for _, g in topk] == [[1, 2, 4]], "topk.png lines",
          [[(r["top_k"], r["args"]) for r in g] for _, g in topk])
    # Two lines that differ only in args: the legend is keyed by args and says so.
    fake_results(csv_path, [("m", 32, 4, t, "--n_layers=3", 0.1) for t in (4096, 8192)])
    specs = sweep.plot_lines(sweep.ok_rows(csv_path))
    spec = specs.get("tokens.png")
    if check(spec and len(spec["lines"]) == 2, "tokens.png with a 3-layer series:", spec):
        check(spec["varying"] == ["args"], "the lines differ in", spec["varying"])
        labels = [sweep.line_label(kd, spec["varying"]) for kd, _ in spec["lines"]]
        check(labels == ["args --n_layers=2", "args --n_layers=3"], "labels", labels)
        check(sweep.legend_title(spec) == "a line per args", "legend title",
              sweep.legend_title(spec))
        check("experts 32" in sweep.shared_caption(spec), "the caption does not say what the lines "
              "share:", sweep.shared_caption(spec))
    # The same in plots.json, where matplotlib draws them.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return done("series keyed by every differing flag (plots.json not checked: no "
                    "matplotlib)")
    r = sweep_cmd("plot", csv_path)
    check(r.returncode == 0, "plot exit", r.returncode, r.stderr[-500:])
    with open(os.path.join(work, "plots.json")) as f:
        plots = json.load(f)
    lines = plots.get("tokens.png", {}).get("lines", [])
    check([l["x"] for l in lines] == [[4096, 8192, 16384, 32768], [4096, 8192]],
          "plots.json tokens.png lines", [(l["label"], l["x"]) for l in lines])
    check(plots.get("tokens.png", {}).get("line_key") == ["args"], "plots.json line_key",
          plots.get("tokens.png", {}).get("line_key"))
    return done("series keyed by every differing flag, args included; the legend names the key")


# ---- loss sweeps ------------------------------------------------------------------------------

def fake_loss_point(n_experts, d_model, budget, top_k=2, args=""):
    """A loss point as read_sweep makes it (token budget, 1024 tokens a step)."""
    p = {"model": "m", "gpus": 1, "layout": "dp", "dp": 1, "ep": 1, "n_experts": n_experts,
         "top_k": top_k, "global_tokens": 1024, "args": args.split(), "d_model": d_model,
         "n_layers": 2, "expert_ffn_dim": 0, "mode": "loss", "budget_kind": "tokens",
         "budget": budget, "steps": budget // 1024, "synth": ["--docs=100"], "eval_docs": 10,
         "eval_batches": 2, "eval_every": 0}
    p["key"] = sweep.point_key(p)
    return p


def fake_metrics(path, p, active, eval_loss, drop=None):
    """The JSONL of a training run of p: one record per step, the last with eval_loss; numbers
    that differ from step to step. `drop` leaves a field out of every record."""
    recs = []
    for s in range(1, p["steps"] + 1):
        doc = 1000 + s % 7
        r = {"step": s, "loss": 3.0 - 0.001 * s, "tokens": doc, "positions": 1024,
             "ms": 10.0 + s % 5, "tokens_per_s": doc / (10.0 + s % 5) * 1000,
             "flops": 6.0 * active * doc + 1000.0 * (s % 3), "syncs": {"routing": 2, "loss": 1}}
        if s == p["steps"] or (s % 16 == 0):
            r.update({"eval_loss": eval_loss + (0.5 if s != p["steps"] else 0.0),
                      "eval_tokens": 2000, "eval_ms": 5.0})
        if drop:
            r.pop(drop, None)
        recs.append(r)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def fake_loss_results(csv_path, specs):
    """A results CSV of loss points (n_experts, d_model, budget, eval_loss); returns the rows."""
    os.makedirs(os.path.dirname(csv_path), exist_ok=True)
    for ne, dm, budget, ev in specs:
        p = fake_loss_point(ne, dm, budget)
        active = 1000 * dm + 10 * ne
        jp = os.path.join(os.path.dirname(csv_path), p["key"] + ".jsonl")
        fake_metrics(jp, p, active, ev)
        row = {**p, "series": "s", "launcher": "local", "nodes": 1, "scaling": "weak",
               "tokens_per_gpu": 1024, "args": ""}
        row.update(sweep.row_from_metrics(jp, p, {"params_total": 3 * active,
                                                  "params_active": active}, "backend=cpu-f32"))
        row["wall_s"], row["finished_at"] = 1.0, "2025-01-01T00:00:00"
        sweep.append_row(csv_path, row)
    return sweep.ok_rows(csv_path)


def cmd_loss_report(work):
    """A loss point's CSV numbers are its JSONL's (FLOPs and tokens summed, the final eval_loss,
    medians of the steady steps); a run without the final eval_loss or flops is a failed point;
    the loss plot's series are keyed by every key but the budget, the best of each budget is
    marked; report and table print the loss table."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    p = fake_loss_point(8, 64, 16384)
    jp = os.path.join(work, "one.jsonl")
    recs = fake_metrics(jp, p, 5000, 1.75)
    row = sweep.row_from_metrics(jp, p, {"params_total": 15000, "params_active": 5000}, "")
    check(row["status"] == "ok", "row_from_metrics:", row)
    check(row.get("flops") == sum(r["flops"] for r in recs), "flops", row.get("flops"), "is not "
          "the sum of the steps'", sum(r["flops"] for r in recs))
    check(row.get("tokens") == sum(r["tokens"] for r in recs), "tokens", row.get("tokens"))
    check(row.get("eval_loss") == 1.75, "eval_loss", row.get("eval_loss"), "is not the last "
          "record's 1.75")
    check(row.get("steps") == 16 and row.get("params_active") == 5000
          and row.get("params_total") == 15000, "steps and params", row)
    steady = [r for r in recs[1:] if "eval_loss" not in r]
    check(row.get("ms_per_step") == sweep.median([r["ms"] for r in steady]), "ms_per_step",
          row.get("ms_per_step"))
    check(row.get("syncs_per_step") == 3, "syncs_per_step", row.get("syncs_per_step"))
    check(abs(row.get("padding", -1) - (1 - row["tokens"] / (16 * 1024))) < 1e-12, "padding",
          row.get("padding"))
    # What makes a point failed, with the reason.
    for drop, want in (("eval_loss", "has no eval_loss"), ("flops", "have no 'flops'")):
        fake_metrics(jp, p, 5000, 1.75, drop=drop)
        r = sweep.row_from_metrics(jp, p, {"params_total": 1, "params_active": 1}, "")
        check(r["status"] == "failed" and want in r["error"], "without", drop, r)
    fake_metrics(jp, dict(p, steps=8), 5000, 1.75)
    r = sweep.row_from_metrics(jp, p, {"params_total": 1, "params_active": 1}, "")
    check(r["status"] == "failed" and "expected steps 1..16" in r["error"], "a short run:", r)

    # Series: experts x d_model, two budgets; the best of each budget is the least eval_loss.
    csv_path = os.path.join(work, "res", "results.csv")
    losses = {(4, 64, 16384): 2.0, (4, 64, 65536): 1.8, (8, 64, 16384): 1.9,
              (8, 64, 65536): 1.85, (4, 128, 16384): 1.95, (4, 128, 65536): 1.7,
              (8, 128, 16384): 2.1, (8, 128, 65536): 1.75}
    rows = fake_loss_results(csv_path, [(ne, dm, b, ev) for (ne, dm, b), ev in losses.items()])
    spec = sweep.loss_spec(rows)
    if check(spec is not None, "no loss series"):
        check(spec["varying"] == ["n_experts", "d_model"], "the series differ in",
              spec["varying"])
        got = sorted((kd["n_experts"], kd["d_model"], tuple(int(r["budget"]) for r in g))
                     for kd, g in spec["lines"])
        check(got == sorted((ne, dm, (16384, 65536)) for ne in ("4", "8") for dm in ("64", "128")),
              "series", got)
        for kd, g in spec["lines"]:
            check(len({(r["n_experts"], r["d_model"], r["top_k"], r["args"]) for r in g}) == 1,
                  "a series joins different configurations:", [r["key"] for r in g])
            check([float(r["flops"]) for r in g] == sorted(float(r["flops"]) for r in g),
                  "a series is not in FLOP order")
        best = {b: (int(r["n_experts"]), int(r["d_model"])) for (_, b), r in spec["best"].items()}
        check(best == {16384: (8, 64), 65536: (4, 128)}, "best of each budget", best)
    # A point that differs in args is a series of its own, and the legend says args.
    fake_loss_results(csv_path, [])
    p2 = fake_loss_point(4, 64, 16384, args="--lr=1e-3")
    jp2 = os.path.join(work, "res", p2["key"] + ".jsonl")
    fake_metrics(jp2, p2, 64040, 1.5)
    row = {**p2, "series": "s", "launcher": "local", "nodes": 1, "scaling": "weak",
           "tokens_per_gpu": 1024, "args": "--lr=1e-3"}
    row.update(sweep.row_from_metrics(jp2, p2, {"params_total": 3, "params_active": 2}, ""))
    sweep.append_row(csv_path, row)
    spec = sweep.loss_spec(sweep.ok_rows(csv_path))
    if spec:
        check(len(spec["lines"]) == 5 and spec["varying"] == ["n_experts", "args", "d_model"],
              "with an args point:", len(spec["lines"]), spec["varying"])
        check(spec["best"][("tokens", 16384)]["args"] == "--lr=1e-3", "the args point (1.5) is "
              "not the best of its budget")
    # table prints the loss points; report adds them with the plot.
    r = sweep_cmd("table", csv_path)
    lines = [l for l in r.stdout.splitlines() if l.startswith("| m |")]
    check(r.returncode == 0 and len(lines) == 9, "table exit", r.returncode, "rows", len(lines),
          r.stderr[-400:])
    check(sum(l.endswith("| ★ |") for l in lines) == 2, "table: stars", lines)
    check(any("| 1.5000 | ★ |" in l for l in lines), "table: the best 16K point", lines)
    r = sweep_cmd("report", csv_path)
    check(r.returncode == 0, "report exit", r.returncode, r.stderr[-600:])
    text = open(os.path.join(work, "res", "report.md")).read()
    check("## Held-out loss against compute" in text and text.count("| ★ |") == 2,
          "report: no loss section with 2 stars")
    # A page's part below the keep mark survives the report written again.
    md = os.path.join(work, "res", "report.md")
    with open(md, "a") as f:
        f.write("\n" + sweep.KEEP_MARK + "\n\n## Measured elsewhere\n\n| a | 1 |\n")
    r = sweep_cmd("report", csv_path)
    text2 = open(md).read()
    check(r.returncode == 0 and text2.endswith("\n" + sweep.KEEP_MARK + "\n\n## Measured "
                                               "elsewhere\n\n| a | 1 |\n")
          and text2.count(sweep.KEEP_MARK) == 1 and text2.startswith(text.rstrip("\n")),
          "the kept part of the page is not kept once after the report:", text2[-300:])
    r = sweep_cmd("table", os.path.join(work, "nothing.csv"))
    check(r.returncode == 2 and "no such results CSV" in r.stderr, "table of no CSV:",
          r.returncode, r.stderr)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return done("loss points from their JSONL, failed runs, series and best points (plots "
                    "not checked: no matplotlib)")
    check("](loss.png)" in text, "the report does not show loss.png")
    with open(os.path.join(work, "res", "plots.json")) as f:
        plots = json.load(f)
    lp = plots.get("loss.png", {})
    size = png_size(os.path.join(work, "res", "loss.png"))
    check(size is not None and size[0] > 100, "loss.png is not a PNG", size)
    check(lp.get("series") == 5 and lp.get("points") == 9, "plots.json loss.png", lp.get("series"),
          lp.get("points"))
    check(lp.get("line_key") == ["experts", "args", "d_model"], "loss.png line_key",
          lp.get("line_key"))
    check([b["budget"] for b in lp.get("best", [])] == [16384, 65536], "loss.png best",
          lp.get("best"))
    check(all(l["x"] == sorted(l["x"]) for l in lp.get("lines", [])), "loss.png x not sorted")
    return done("loss points from their JSONL, failed runs, series keyed by all but the budget, "
                "best of each budget, table, report, loss.png")


def cmd_loss(hotpath, work):
    """The CPU loss demo end to end: data written and split, every point trained on its budget
    with a finite held-out loss, FLOPs summed from its JSONL growing with the budget, hotpath's
    parameter counts, the table, and the plot where matplotlib is installed."""
    out = os.path.join(work, "loss")
    shutil.rmtree(out, ignore_errors=True)
    sweep_file = os.path.join(ROOT, "examples", "scaling", "sweeps", "cpu-loss.ini")
    _, points = sweep.read_sweep(sweep_file)
    check(len(points) == 8, "cpu-loss has", len(points), "points, expected 2 x 2 x 2")
    r = run_sweep(sweep_file, out, hotpath)
    sys.stderr.write(r.stderr[-3000:])
    check(r.returncode == 0, "the loss demo exited", r.returncode)
    csv_path = os.path.join(out, "results.csv")
    rows = {row["key"]: row for row in rows_of(csv_path)} if os.path.exists(csv_path) else {}
    check(len(rows) == 8, "CSV rows", len(rows))
    # The data: the first 4000 documents to train on, the 256 after them held out.
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(out, "data")) for f in fs]
    check(sorted(os.path.basename(f) for f in files) == ["eval.bin", "train.bin"], "data files",
          files)
    docs = {}
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        head = struct.unpack("<3i", raw[:12])
        toks = raw[1024:]
        check(head[0] == 20240520 and head[2] * 2 == len(toks), f, "header", head)
        # Documents end with the EOT token, 15 (tiny-moe's vocabulary of 16).
        docs[os.path.basename(f)] = sum(1 for i in range(0, len(toks), 2)
                                        if toks[i] == 15 and toks[i + 1] == 0)
    check(docs == {"train.bin": 4000, "eval.bin": 256}, "documents", docs)
    by_series = {}
    for p in points:
        row = rows.get(p["key"])
        if not check(row is not None and row["status"] == "ok", p["key"], "not ok:",
                     row and row["error"]):
            continue
        ev, flops = float(row["eval_loss"]), float(row["flops"])
        total, active = int(row["params_total"]), int(row["params_active"])
        check(math.isfinite(ev) and 0 < ev < math.log(16), p["key"], "eval_loss", ev,
              "is not finite and below ln 16 (uniform over the vocabulary)")
        check(flops > 0 and 0 < active <= total, p["key"], "flops", flops, "params", total,
              active)
        # The steps: the FLOP budget over 6 x active parameters x 1024 tokens a step.
        steps = max(1, round(p["budget"] / (6 * active * 1024)))
        check(int(row["steps"]) == steps, p["key"], "steps", row["steps"], "expected", steps)
        # Every number is the run's own: the JSONL's sums and last record, the dry run's counts.
        with open(os.path.join(out, "points", p["key"] + ".jsonl")) as f:
            recs = [json.loads(l) for l in f if l.strip()]
        check(len(recs) == steps, p["key"], "JSONL records", len(recs))
        check(flops == float(sum(x["flops"] for x in recs)), p["key"], "flops != the JSONL's sum")
        check(int(row["tokens"]) == sum(x["tokens"] for x in recs), p["key"], "tokens")
        check(ev == recs[-1]["eval_loss"], p["key"], "eval_loss != the last record's")
        with open(os.path.join(out, "points", p["key"] + ".log")) as f:
            log_text = f.read()
        m = sweep.PARAMS_RE.search(log_text)
        check(m and (int(m.group(1)), int(m.group(2))) == (total, active), p["key"],
              "params are not the dry run's")
        # 6 x active x document tokens is most of hotpath's count; attention adds the rest.
        check(6 * active * int(row["tokens"]) <= flops < 2 * 6 * active * int(row["tokens"]),
              p["key"], "flops", flops, "vs 6 N D", 6 * active * int(row["tokens"]))
        # Rounded steps and attention: near the budget, not equal to it.
        check(0.8 * p["budget"] <= flops <= 1.5 * p["budget"], p["key"], "spent", flops,
              "FLOPs on a budget of", p["budget"])
        by_series.setdefault((p["n_experts"], p["d_model"]), []).append(
            (p["budget"], flops, ev))
    for s, pts in by_series.items():
        pts.sort()
        check([f for _, f, _ in pts] == sorted(f for _, f, _ in pts) and len(pts) == 2
              and pts[0][1] < pts[1][1], s, "flops do not grow with the budget", pts)
        check(pts[1][2] < pts[0][2], s, "4x the FLOPs does not lower the held-out loss", pts)
    check("| held-out loss | best |" in r.stdout and r.stdout.count("| ★ |") == 2,
          "run does not print the loss table:", r.stdout[-800:])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return done("cpu loss demo: 8 points trained on their budgets, held-out loss, FLOPs, "
                    "params, table (plots not checked: no matplotlib)")
    with open(os.path.join(out, "plots.json")) as f:
        plots = json.load(f)
    lp = plots.get("loss.png", {})
    size = png_size(os.path.join(out, "loss.png")) if os.path.exists(
        os.path.join(out, "loss.png")) else None
    check(size is not None and size[0] > 100, "loss.png is not a PNG", size)
    check(lp.get("series") == 4 and lp.get("points") == 8 and len(lp.get("best", [])) == 2,
          "plots.json loss.png", {k: lp.get(k) for k in ("series", "points", "best")})
    check(lp.get("line_key") == ["experts", "d_model"], "loss.png line_key", lp.get("line_key"))
    for b in lp.get("best", []):
        same = [float(x["eval_loss"]) for x in rows.values() if int(x["budget"]) == b["budget"]]
        check(b["eval_loss"] == min(same), "best of", b["budget"], b, same)
    return done("cpu loss demo: 8 points trained on their budgets, held-out loss, FLOPs, params, "
                "loss.png, table")


# ---- a stopped sweep, a torn CSV (real runs of tiny CPU points) -------------------------------

STOP_SWEEP = """
[sweep]
name = stop
config = examples/configs/tiny-moe.ini
launcher = local
args = --seq_len=128 --log_every=1000 --n_layers=1
bench_warmup = 0
tokens_per_gpu = 256
top_k = 2
timeout_s = 0

[series quick]
n_experts = 4
bench_steps = 1

# Far more steps than a test waits for: it is stopped while it runs.
[series long]
n_experts = 8
bench_steps = 1000000
"""


def proc_stat(pid):
    """(state, ppid, pgid) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st and st[1] == pid and st[0] != "Z":
                out.append(int(d))
    return out


def group_members(pgid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = proc_stat(int(d))
            if st and st[2] == pgid and st[0] != "Z":
                out.append(int(d))
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def csv_lines_whole(csv_path):
    """Every line of the CSV ends in a newline and has the header's field count."""
    data = read_bytes(csv_path)
    if not data.endswith(b"\n"):
        return False
    rows = list(csv.reader(io.StringIO(data.decode(), newline="")))
    return all(len(r) == len(rows[0]) for r in rows)


def stop_once(sweep_file, out, hotpath, sig, long_key):
    """Starts the sweep, waits for the long point's hotpath, sends sig the way a terminal's
    Ctrl-C (the runner's process group) or `kill` (the runner) would; returns (rc, stderr, the
    hotpath's pid)."""
    proc = subprocess.Popen([sys.executable, SWEEP, "run", sweep_file, "--out", out, "--hotpath",
                             hotpath, "--no-plots"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    hp, deadline = None, time.time() + 120
    while hp is None and time.time() < deadline and proc.poll() is None:
        for c in children(proc.pid):
            if "bench" in cmdline(c) and "--n_experts=8" in cmdline(c):
                hp = c
        time.sleep(0.05)
    if not check(hp is not None, "the long point's hotpath never started"):
        proc.kill()
        proc.communicate()
        return None, "", None
    time.sleep(0.5)  # well inside its first step or setup: either way it is running
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        check(False, "the sweep did not end within 120 s of", sig.name)
    return proc.returncode, err, hp


def cmd_interrupt(hotpath, work):
    out = os.path.join(work, "interrupt")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sweep_file = os.path.join(out, "stop.ini")
    with open(sweep_file, "w") as f:
        f.write(STOP_SWEEP)
    _, points = sweep.read_sweep(sweep_file)
    quick = [p["key"] for p in points if p["n_experts"] == 4][0]
    long_key = [p["key"] for p in points if p["n_experts"] == 8][0]
    csv_path = os.path.join(out, "results.csv")
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        rc, err, hp = stop_once(sweep_file, out, hotpath, sig, long_key)
        if hp is None:
            continue
        sys.stderr.write(err[-1500:])
        check(rc == status, sig.name, "exit", rc, "expected", status)
        check("Traceback" not in err, sig.name, "prints a traceback")
        last = [l for l in err.splitlines() if l.strip()][-1:] or [""]
        check(f"stopped by {sig.name} at point 2/2 {long_key}" in last[0]
              and "resume with: python3" in last[0] and out in last[0], sig.name,
              "last line", repr(last[0]))
        check(sum("stopped by" in l for l in err.splitlines()) == 1, sig.name, "says 'stopped' "
              "other than once")
        # Nothing of the point outlives the runner: not its hotpath, not its process group.
        st = proc_stat(hp)
        check(st is None or st[0] == "Z", sig.name, "left the point's hotpath", hp, "running:", st)
        left = group_members(hp)
        check(left == [], sig.name, "left processes of the point's group:",
              [(m, cmdline(m)) for m in left])
        for m in left:
            os.kill(m, signal.SIGKILL)
        # The CSV: the finished quick point, whole lines, the stopped point not recorded.
        rows = rows_of(csv_path)
        check([r["key"] for r in rows] == [quick], sig.name, "CSV rows",
              [r["key"] for r in rows])
        check(csv_lines_whole(csv_path), sig.name, "left a torn CSV")
    with open(os.path.join(out, "launches.log")) as f:
        launches = f.read().split()
    check(launches == [quick, long_key, long_key], "launches", launches)
    return done("SIGINT and SIGTERM stop the sweep: the point's processes ended, CSV whole, "
                "130/143, one line saying how to resume")


TORN_SWEEP = """
[sweep]
name = torn
config = examples/configs/tiny-moe.ini
launcher = local
args = --seq_len=128 --log_every=1000 --n_layers=1
bench_steps = 1
bench_warmup = 0
tokens_per_gpu = 256
top_k = 2
n_experts = 4, 8
"""


def cmd_torn(hotpath, work):
    out = os.path.join(work, "torn")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sweep_file = os.path.join(out, "torn.ini")
    with open(sweep_file, "w") as f:
        f.write(TORN_SWEEP)
    csv_path = os.path.join(out, "results.csv")
    r = run_sweep(sweep_file, out, hotpath, "--no-plots")
    check(r.returncode == 0, "first run exit", r.returncode, r.stderr[-800:])
    rows = rows_of(csv_path)
    if not check(len(rows) == 2, "first run rows", len(rows)):
        return done("")
    # A kill while the second row was written: only its first 40 bytes reached the file.
    data = read_bytes(csv_path)
    cut = data.rindex(b"\n", 0, len(data) - 1) + 1
    torn_key = rows[1]["key"]
    with open(csv_path, "wb") as f:
        f.write(data[:cut + 40])
    torn = read_bytes(csv_path)
    # report and plot read around it, saying so, and leave the file as it is.
    r = subprocess.run([sys.executable, SWEEP, "report", csv_path], capture_output=True,
                       text=True)
    check(r.returncode == 0, "report of a torn CSV exit", r.returncode, r.stderr[-500:])
    check(f"{csv_path}:3: incomplete last line" in r.stderr, "report does not warn of line 3:",
          r.stderr[-500:])
    check(read_bytes(csv_path) == torn, "report changed the CSV")
    # run drops the torn line with a warning and runs that point again.
    r = run_sweep(sweep_file, out, hotpath, "--no-plots")
    check(r.returncode == 0, "run after a torn line exit", r.returncode, r.stderr[-800:])
    check(f"warning: {csv_path}:3: incomplete last line" in r.stderr and "runs again" in r.stderr,
          "run does not warn of the torn line:", r.stderr[-800:])
    check("1 already in" in r.stderr and "1 to run" in r.stderr, "the torn point is not run again")
    check(csv_lines_whole(csv_path), "the CSV is not whole lines after the repair")
    rows2 = rows_of(csv_path)
    check([x["key"] for x in rows2] == [rows[0]["key"], torn_key], "rows after the repair",
          [x["key"] for x in rows2])
    check(all(x["status"] == "ok" and x["tok_s"] for x in rows2), "rows after the repair",
          [(x["key"], x["status"], x["tok_s"]) for x in rows2])
    with open(os.path.join(out, "launches.log")) as f:
        check(f.read().split().count(torn_key) == 2, "the torn point was not launched again")
    # A damaged line that is not the last is refused, naming it.
    data = read_bytes(csv_path)
    lines = data.split(b"\n")
    lines[1] = lines[1][:30]
    with open(csv_path, "wb") as f:
        f.write(b"\n".join(lines))
    for cmd in ("run", "report"):
        args = ([sys.executable, SWEEP, "run", sweep_file, "--out", out, "--hotpath", hotpath,
                 "--no-plots"] if cmd == "run" else [sys.executable, SWEEP, "report", csv_path])
        r = subprocess.run(args, capture_output=True, text=True)
        check(r.returncode == 2 and f"{csv_path}:2:" in r.stderr and "fields, expected" in r.stderr
              and "Traceback" not in r.stderr, cmd, "on a damaged line 2: exit", r.returncode,
              r.stderr[-500:])
    return done("a torn last CSV line dropped with a warning and its point run again; a damaged "
                "line refused")


def main():
    cmd = sys.argv[1]
    if cmd == "demo":
        return cmd_demo(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "resume":
        return cmd_resume(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "errors":
        return cmd_errors(sys.argv[2])
    if cmd == "report":
        return cmd_report(sys.argv[2])
    if cmd == "interrupt":
        return cmd_interrupt(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "torn":
        return cmd_torn(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "series":
        return cmd_series(sys.argv[2])
    if cmd == "loss_report":
        return cmd_loss_report(sys.argv[2])
    if cmd == "loss":
        return cmd_loss(os.path.abspath(sys.argv[2]), sys.argv[3])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
