#!/usr/bin/env python3
"""Scaling sweeps of `hotpath bench step`: run the points of a sweep file, collect their JSON into
one CSV, plot it, and write a Markdown report.

    python3 examples/scaling/sweep.py run SWEEP.ini --out DIR [--hotpath PATH] [--retry-failed]
    python3 examples/scaling/sweep.py plot DIR/results.csv [--out DIR]
    python3 examples/scaling/sweep.py report DIR/results.csv [--md docs/scaling.md]
    python3 examples/scaling/sweep.py submit SWEEP.ini --out DIR [--sbatch-args "..."]
    python3 examples/scaling/sweep.py list SWEEP.ini

The sweep file format is described in examples/scaling/README.md. `run` writes DIR/results.csv
(one row per point, appended as each point ends), DIR/points/<key>.json (each point's own
--bench_json) and DIR/points/<key>.log, then the PNG plots (`plot`). A point already in the CSV
is not run again, so a killed sweep resumes where it stopped; a failed point is recorded with its
error and the sweep goes on. Standard library only, except matplotlib for the plots.
"""

import argparse
import configparser
import csv
import hashlib
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PHASES = ["forward", "loss", "backward", "grad_sync", "optimizer", "other"]
FAMILIES = ["attention", "dense_gemm", "expert_gemm", "routing", "norms_elementwise", "embedding",
            "cross_entropy", "optimizer", "copies", "comm", "other"]
LAUNCHERS = ["local", "mpirun", "srun", "sbatch"]
AXES = ["config", "gpus", "layout", "n_experts", "top_k", "tokens_per_gpu", "global_tokens"]
SWEEP_KEYS = set(AXES) | {"name", "launcher", "args", "bench_steps", "bench_warmup", "timeout_s",
                          "gpus_per_node", "mpirun_args", "srun_args", "sbatch_args", "env",
                          "title"}

COLUMNS = (["key", "series", "status", "error", "model", "launcher", "layout", "dp", "ep", "gpus",
            "nodes", "n_experts", "top_k", "scaling", "tokens_per_gpu", "global_tokens",
            "ms_per_step", "tok_s", "tok_s_per_gpu", "mfu", "gpu_busy", "idle_share"]
           + [f"phase_{p}_share" for p in PHASES] + [f"family_{f}_share" for f in FAMILIES]
           + ["mem_per_rank_max_mib", "mem_per_rank_min_mib", "mem_kind", "syncs_per_step",
              "backend", "wall_s", "finished_at"])


class SweepError(Exception):
    """A mistake in a sweep file or the command line: the message names the file and key."""


def log(*parts):
    print("[sweep]", *parts, file=sys.stderr, flush=True)


# ---- the sweep file ---------------------------------------------------------------------------

def split_list(text):
    return [v.strip() for v in re.split(r"[,\s]+", text.strip()) if v.strip()]


def parse_ints(values, where, key, minimum=1):
    out = []
    for v in values:
        try:
            n = int(v.lower().replace("k", "")) * (1024 if v.lower().endswith("k") else 1)
        except ValueError:
            raise SweepError(f"{where}: key '{key}': '{v}' is not an integer (e.g. 4096 or 4k)")
        if n < minimum:
            raise SweepError(f"{where}: key '{key}': {n} is below {minimum}")
        out.append(n)
    return out


def parse_layout(value, gpus, where):
    """A layout name to (dp, ep): dp (ep 1), ep (ep = gpus), epN, or dpMxepN."""
    v = value.strip().lower()
    if v == "dp":
        return gpus, 1
    if v == "ep":
        return 1, gpus
    m = re.fullmatch(r"ep(\d+)", v)
    if m:
        ep = int(m.group(1))
        if ep < 1 or gpus % ep:
            raise SweepError(f"{where}: key 'layout': ep{ep} does not divide {gpus} GPUs")
        return gpus // ep, ep
    m = re.fullmatch(r"dp(\d+)x?ep(\d+)", v)
    if m:
        dp, ep = int(m.group(1)), int(m.group(2))
        if dp * ep != gpus:
            raise SweepError(f"{where}: key 'layout': {value} is {dp * ep} GPUs, not {gpus}")
        return dp, ep
    raise SweepError(f"{where}: key 'layout': '{value}' is not a layout; valid: dp, ep, epN, "
                     "dpMxepN")


def read_sweep(path):
    """The sweep file as (settings, [point dict, ...]) in file order, duplicates merged."""
    if not os.path.isfile(path):
        raise SweepError(f"sweep file '{path}' not found")
    cp = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"))
    cp.optionxform = str
    try:
        cp.read(path)
    except configparser.Error as e:
        raise SweepError(f"{path}: {e}".replace("\n", " "))
    if not cp.has_section("sweep"):
        raise SweepError(f"{path}: no [sweep] section (it holds the base config and launcher)")
    base_dir = os.path.dirname(os.path.abspath(path))
    for sec in cp.sections():
        for k in cp[sec]:
            if k not in SWEEP_KEYS:
                raise SweepError(f"{path}: [{sec}] key '{k}' is not a sweep key; valid: "
                                 + ", ".join(sorted(SWEEP_KEYS)))
    base = dict(cp["sweep"])
    series_secs = [s for s in cp.sections() if s.startswith("series ")]
    if not series_secs:
        series_secs = ["sweep"]
    for s in cp.sections():
        if s != "sweep" and not s.startswith("series "):
            raise SweepError(f"{path}: section [{s}] is neither [sweep] nor [series NAME]")
    settings = {
        "name": base.get("name", os.path.splitext(os.path.basename(path))[0]),
        "title": base.get("title", ""),
        "path": os.path.abspath(path),
    }
    points = {}
    for sec in series_secs:
        where = f"{path}: [{sec}]"
        s = dict(base)
        s.update(dict(cp[sec]) if sec != "sweep" else {})
        series = sec[len("series "):].strip() if sec != "sweep" else settings["name"]
        launcher = LAUNCHER_OVERRIDE or s.get("launcher", "local")
        if launcher not in LAUNCHERS:
            raise SweepError(f"{where}: key 'launcher': '{launcher}' is not one of "
                             + ", ".join(LAUNCHERS))
        configs = split_list(s.get("config", ""))
        if not configs:
            raise SweepError(f"{where}: key 'config' is missing (a hotpath config file, or a list)")
        resolved = []
        for c in configs:
            cands = [c if os.path.isabs(c) else os.path.join(ROOT, c), os.path.join(base_dir, c)]
            found = next((x for x in cands if os.path.isfile(x)), None)
            if not found:
                raise SweepError(f"{where}: key 'config': '{c}' not found (paths are relative to "
                                 "the repository root or the sweep file)")
            resolved.append((c, found))
        gpus_l = parse_ints(split_list(s.get("gpus", "1")), where, "gpus")
        layouts = split_list(s.get("layout", "dp"))
        experts = parse_ints(split_list(s.get("n_experts", "0")), where, "n_experts", 0)
        topks = parse_ints(split_list(s.get("top_k", "0")), where, "top_k", 0)
        if "tokens_per_gpu" in s and "global_tokens" in s:
            raise SweepError(f"{where}: keys 'tokens_per_gpu' (weak scaling) and 'global_tokens' "
                             "(strong scaling) exclude each other")
        if "global_tokens" in s:
            scaling, toks = "strong", parse_ints(split_list(s["global_tokens"]), where,
                                                 "global_tokens")
        else:
            scaling, toks = "weak", parse_ints(split_list(s.get("tokens_per_gpu", "4096")), where,
                                               "tokens_per_gpu")
        gpn = parse_ints([s.get("gpus_per_node", "8")], where, "gpus_per_node")[0]
        args = shlex.split(s.get("args", ""))
        for a in args:
            if re.match(r"--(n_experts|top_k|ep_size|batch_tokens|bench_json|config)=", a):
                raise SweepError(f"{where}: key 'args': '{a}' is set by the sweep's axes")
        for bk in ("bench_steps", "bench_warmup", "timeout_s"):
            if bk in s:
                parse_ints([s[bk]], where, bk, 0)
        env = {}
        for item in shlex.split(s.get("env", "")):
            if "=" not in item:
                raise SweepError(f"{where}: key 'env': '{item}' is not NAME=VALUE")
            k, v = item.split("=", 1)
            env[k] = v
        for (cname, cpath) in resolved:
            model = os.path.splitext(os.path.basename(cname))[0]
            for gpus in gpus_l:
                for lay in layouts:
                    dp, ep = parse_layout(lay, gpus, where)
                    for ne in experts:
                        if ne and ep > 1 and ne % ep:
                            raise SweepError(f"{where}: {ne} experts do not split over ep={ep} "
                                             f"(layout {lay} on {gpus} GPUs)")
                        for k in topks:
                            if ne and k > ne:
                                raise SweepError(f"{where}: top_k {k} exceeds {ne} experts")
                            for t in toks:
                                tpg = t if scaling == "weak" else t // gpus
                                glob = t * gpus if scaling == "weak" else t
                                if launcher == "local" and gpus > 1:
                                    raise SweepError(f"{where}: launcher 'local' runs one "
                                                     f"process; {gpus} GPUs need mpirun, srun or "
                                                     "sbatch")
                                p = {
                                    "series": series, "model": model, "config": cpath,
                                    "launcher": launcher, "layout": lay.lower(), "dp": dp,
                                    "ep": ep, "gpus": gpus,
                                    "nodes": max(1, math.ceil(gpus / gpn)), "gpus_per_node": gpn,
                                    "n_experts": ne, "top_k": k, "scaling": scaling,
                                    "tokens_per_gpu": tpg, "global_tokens": glob, "args": args,
                                    "bench_steps": int(s.get("bench_steps", "3")),
                                    "bench_warmup": int(s.get("bench_warmup", "1")),
                                    "timeout_s": int(s.get("timeout_s", "600")),
                                    "mpirun_args": shlex.split(s.get("mpirun_args", "")),
                                    "srun_args": shlex.split(s.get("srun_args", "")),
                                    "sbatch_args": shlex.split(s.get("sbatch_args", "")),
                                    "env": env,
                                }
                                p["key"] = point_key(p)
                                if p["key"] in points:
                                    old = points[p["key"]]
                                    if series not in old["series"].split():
                                        old["series"] += " " + series
                                else:
                                    points[p["key"]] = p
    return settings, list(points.values())


def point_key(p):
    """A point's identity in the CSV: everything that changes what is measured (not the launcher,
    so `submit`, which runs the points through srun, resumes a sweep `run` started)."""
    parts = [p["model"], f"g{p['gpus']}", p["layout"], f"dp{p['dp']}",
             f"ep{p['ep']}", f"e{p['n_experts']}", f"k{p['top_k']}", f"t{p['global_tokens']}"]
    if p["args"]:
        parts.append("a" + hashlib.sha1(" ".join(p["args"]).encode()).hexdigest()[:8])
    return "_".join(str(x) for x in parts)


# ---- running one point ------------------------------------------------------------------------

def hotpath_args(p, hotpath, json_path):
    a = [hotpath, "bench", "step", "--config", p["config"], f"--batch_tokens={p['global_tokens']}",
         f"--ep_size={p['ep']}", f"--bench_steps={p['bench_steps']}",
         f"--bench_warmup={p['bench_warmup']}", f"--bench_json={json_path}"]
    if p["n_experts"]:
        a.append(f"--n_experts={p['n_experts']}")
    if p["top_k"]:
        a.append(f"--top_k={p['top_k']}")
    return a + p["args"]


def launch_command(p, hotpath, json_path, job_script):
    """The command line that runs point p, and (for sbatch) the batch script to write first."""
    inner = hotpath_args(p, hotpath, json_path)
    n = p["gpus"]
    if p["launcher"] == "local":
        return inner, None
    if p["launcher"] == "mpirun":
        flags = ["-np", str(n)]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        if n > (os.cpu_count() or 1):
            flags += ["--oversubscribe", "--bind-to", "none"]
        for e in sorted(set(["OMP_NUM_THREADS"] + list(p["env"]))):
            flags += ["-x", e]
        return ["mpirun"] + flags + p["mpirun_args"] + inner, None
    srun = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", f"--nodes={p['nodes']}",
            f"--ntasks={n}"] + p["srun_args"]
    if p["launcher"] == "srun":
        return srun + inner, None
    # sbatch: one job per point; --wait returns when it has ended, with its exit status.
    script = "#!/bin/bash\n" + " ".join(shlex.quote(x) for x in srun + inner) + "\n"
    return (["sbatch", "--wait", "--parsable", f"--job-name=sweep-{p['key']}"[:120],
             f"--nodes={p['nodes']}", f"--ntasks={n}",
             f"--output={job_script}.out"] + p["sbatch_args"] + [job_script]), script


def short_error(text, rc):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errs = [l for l in lines if re.search(r"error|Error|ERROR|FAILED|Traceback|what\(\)", l)]
    msg = (errs[-1] if errs else lines[-1] if lines else "no output")
    msg = re.sub(r"\s+", " ", msg)[:400]
    return f"exit {rc}: {msg}"


def run_point(p, hotpath, out_dir):
    pdir = os.path.join(out_dir, "points")
    os.makedirs(pdir, exist_ok=True)
    json_path = os.path.join(pdir, p["key"] + ".json")
    log_path = os.path.join(pdir, p["key"] + ".log")
    job_script = os.path.join(pdir, p["key"] + ".sbatch")
    for f in (json_path, json_path + ".tmp"):
        if os.path.exists(f):
            os.remove(f)
    cmd, script = launch_command(p, hotpath, json_path, job_script)
    if script:
        write_atomic(job_script, script)
        os.chmod(job_script, 0o755)
    env = dict(os.environ)
    env.update(p["env"])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p["gpus"])))
    with open(os.path.join(out_dir, "launches.log"), "a") as f:
        f.write(p["key"] + "\n")
    t0 = time.time()
    rc, text = None, ""
    with open(log_path, "w") as lf:
        lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        lf.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        except OSError as e:
            return {"status": "failed", "error": f"cannot start {cmd[0]}: {e}"}, time.time() - t0
        try:
            rc = proc.wait(timeout=p["timeout_s"] or None)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    wall = time.time() - t0
    with open(log_path, errors="replace") as lf:
        text = lf.read()
    if script and os.path.exists(job_script + ".out"):
        with open(job_script + ".out", errors="replace") as jf:
            text += jf.read()
    if rc == "timeout":
        return {"status": "failed", "error": f"timed out after {p['timeout_s']} s (timeout_s)"}, wall
    if rc != 0:
        return {"status": "failed", "error": short_error(text, rc)}, wall
    try:
        with open(json_path) as jf:
            j = json.load(jf)
    except (OSError, ValueError) as e:
        return {"status": "failed", "error": f"exit 0 but no valid {json_path}: {e}"}, wall
    return row_from_json(j), wall


def row_from_json(j):
    """The CSV numbers of one point, all taken from its bench step JSON."""
    prof = j["profile"]
    wall = prof["wall_ms"]
    world = j["world"]
    share = (lambda v: v / wall) if wall > 0 else (lambda v: 0.0)
    r = {
        "status": "ok", "error": "",
        "ms_per_step": j["ms_per_step"],
        "tok_s": j["tokens_per_s"],
        "tok_s_per_gpu": j["tokens_per_s"] / world,
        "mfu": j["mfu"],
        "gpu_busy": j["gpu_busy_fraction"],
        "idle_share": share(prof["idle_ms"]),
        "syncs_per_step": j["syncs_per_step"],
        "backend": j["backend"],
    }
    for ph in PHASES:
        r[f"phase_{ph}_share"] = share(prof["by_phase_ms"][ph])
    for fa in FAMILIES:
        r[f"family_{fa}_share"] = share(prof["by_family_ms"][fa])
    mem = j.get("memory")
    if mem and mem.get("per_rank_bytes"):
        r["mem_per_rank_max_mib"] = max(mem["per_rank_bytes"]) / 1048576.0
        r["mem_per_rank_min_mib"] = min(mem["per_rank_bytes"]) / 1048576.0
        r["mem_kind"] = mem["kind"]
    return r


# ---- the CSV ----------------------------------------------------------------------------------

def fmt(v):
    if isinstance(v, float):
        return repr(v)
    return "" if v is None else str(v)


def append_row(csv_path, row):
    """One whole line per write with O_APPEND: a kill leaves whole rows (or none) behind."""
    new = not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if new:
        w.writerow(COLUMNS)
    w.writerow([fmt(row.get(c)) for c in COLUMNS])
    fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, buf.getvalue().encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_csv(csv_path):
    """Rows by key, the last row of a key winning; a torn last line (no newline) is ignored."""
    if not os.path.exists(csv_path):
        return {}
    with open(csv_path, newline="") as f:
        text = f.read()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows or text:
        header = text.split("\n", 1)[0].split(",")
        if header != COLUMNS:
            missing = [c for c in COLUMNS if c not in header]
            raise SweepError(f"{csv_path}: not a results CSV of this runner (columns differ"
                             + (f"; missing {', '.join(missing[:5])}" if missing else "") + ")")
    out = {}
    for r in rows:
        out[r["key"]] = r
    return out


def write_atomic(path, data, mode="w"):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ---- commands ---------------------------------------------------------------------------------

def find_hotpath(arg):
    if arg:
        return os.path.abspath(arg) if os.path.sep in arg else arg
    for c in (os.environ.get("HOTPATH"), os.path.join(ROOT, "build/cuda/bin/hotpath"),
              os.path.join(ROOT, "build/cpu/bin/hotpath")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    from shutil import which
    w = which("hotpath")
    if w:
        return w
    raise SweepError("no hotpath executable: pass --hotpath PATH or set HOTPATH")


def fmt_s(s):
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def cmd_run(a):
    settings, points = read_sweep(a.sweep)
    hotpath = find_hotpath(a.hotpath)
    if a.max_gpus is not None:
        if a.max_gpus < 1:
            raise SweepError(f"--max-gpus: must be >= 1, got {a.max_gpus}")
        left = [p["key"] for p in points if p["gpus"] > a.max_gpus]
        points = [p for p in points if p["gpus"] <= a.max_gpus]
        if left:
            log(f"{len(left)} points need more than {a.max_gpus} GPUs and are left out: "
                + ", ".join(left))
    os.makedirs(a.out, exist_ok=True)
    csv_path = os.path.join(a.out, "results.csv")
    done = read_csv(csv_path)
    todo = []
    for p in points:
        r = done.get(p["key"])
        if r and (r["status"] == "ok" or not a.retry_failed):
            continue
        todo.append(p)
    skipped = len(points) - len(todo)
    log(f"{settings['name']}: {len(points)} points, {skipped} already in {csv_path}, "
        f"{len(todo)} to run (hotpath: {hotpath})")
    write_atomic(os.path.join(a.out, "sweep.json"),
                 json.dumps({"name": settings["name"], "title": settings["title"],
                             "sweep_file": os.path.relpath(settings["path"], ROOT),
                             "points": [p["key"] for p in points]}, indent=1) + "\n")
    t_start, failed = time.time(), 0
    for i, p in enumerate(todo):
        log(f"[{skipped + i + 1}/{len(points)}] {p['key']}")
        res, wall = run_point(p, hotpath, a.out)
        row = {k: p[k] for k in ("key", "series", "model", "launcher", "layout", "dp", "ep",
                                 "gpus", "nodes", "n_experts", "top_k", "scaling",
                                 "tokens_per_gpu", "global_tokens")}
        row.update(res)
        row["wall_s"] = round(wall, 3)
        row["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        append_row(csv_path, row)
        if res["status"] != "ok":
            failed += 1
        elapsed = time.time() - t_start
        left = len(todo) - i - 1
        eta = elapsed / (i + 1) * left
        status = "ok" if res["status"] == "ok" else "FAILED: " + res["error"]
        log(f"{skipped + i + 1}/{len(points)} done ({failed} failed) {p['key']}: {status}; "
            f"{fmt_s(wall)}, ETA {fmt_s(eta)}")
    if not a.no_plots:
        plot(csv_path, a.out)
    ok = sum(1 for r in read_csv(csv_path).values() if r["status"] == "ok")
    log(f"{settings['name']}: {ok}/{len(points)} points ok, {failed} failed in this run; "
        f"CSV {csv_path}")
    return 0 if failed == 0 else 1


def cmd_list(a):
    _, points = read_sweep(a.sweep)
    hotpath = a.hotpath or "hotpath"
    for p in points:
        cmd, _ = launch_command(p, hotpath, f"points/{p['key']}.json", f"points/{p['key']}.sbatch")
        print(p["key"], "::", " ".join(shlex.quote(c) for c in cmd))
    print(f"{len(points)} points", file=sys.stderr)
    return 0


def cmd_submit(a):
    """One job for the whole sweep: the runner itself under sbatch, its points through srun."""
    settings, points = read_sweep(a.sweep)
    nodes = max(p["nodes"] for p in points)
    tasks = max(p["gpus"] for p in points)
    os.makedirs(a.out, exist_ok=True)
    script = os.path.join(os.path.abspath(a.out), "sweep.sbatch")
    hp = f" --hotpath {shlex.quote(os.path.abspath(a.hotpath))}" if a.hotpath else ""
    body = ("#!/bin/bash\n"
            f"# The whole sweep '{settings['name']}' in one allocation; points launch with srun.\n"
            f"exec python3 {shlex.quote(os.path.abspath(__file__))} run "
            f"{shlex.quote(os.path.abspath(a.sweep))} --out {shlex.quote(os.path.abspath(a.out))}"
            f" --launcher srun{hp}\n")
    write_atomic(script, body)
    os.chmod(script, 0o755)
    cmd = (["sbatch", "--parsable", f"--job-name=sweep-{settings['name']}", f"--nodes={nodes}",
            f"--ntasks={tasks}", f"--output={os.path.abspath(a.out)}/sweep-%j.out"]
           + shlex.split(a.sbatch_args or "") + [script])
    log(" ".join(shlex.quote(c) for c in cmd))
    return subprocess.call(cmd)


# ---- plots ------------------------------------------------------------------------------------

def num(r, k):
    try:
        return float(r[k])
    except (KeyError, ValueError, TypeError):
        return float("nan")


def ok_rows(csv_path):
    return [r for r in read_csv(csv_path).values() if r["status"] == "ok"]


def group_by(rows, keys):
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def label_of(keys, values):
    names = {"model": "", "layout": "", "n_experts": "E=", "top_k": "k=", "tokens_per_gpu": "T/GPU=",
             "global_tokens": "T=", "scaling": "", "gpus": "GPUs="}
    return " ".join(f"{names.get(k, k + '=')}{v}" for k, v in zip(keys, values))


def sweep_curves(rows, x, fixed):
    """Lines over axis x: rows grouped by the other axes, groups with 2+ values of x."""
    out = []
    for key, g in sorted(group_by(rows, fixed).items(), key=lambda kv: natural(kv[0])):
        xs = sorted({int(r[x]) for r in g})
        if len(xs) < 2:
            continue
        g = sorted(g, key=lambda r: int(r[x]))
        out.append((label_of(fixed, key), g))
    return out


def natural(values):
    """Sort key: numbers as numbers (8 before 16), the rest as text."""
    return tuple((0, int(v), "") if str(v).isdigit() else (1, 0, str(v)) for v in values)


def save_fig(fig, path):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plot(csv_path, out_dir):
    """PNG plots of the CSV's ok rows, and plots.json: each PNG's series and point counts."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (launch/setup.sh installs python3-matplotlib)")
        return {}
    rows = ok_rows(csv_path)
    os.makedirs(out_dir, exist_ok=True)
    made = {}

    # Scaling: tok/s/GPU and MFU vs GPUs, the ideal (flat at the smallest count) and efficiency.
    fixed = ["scaling", "model", "layout", "n_experts", "top_k", "tokens_per_gpu"]
    curves = []
    for scal in ("weak", "strong"):
        sub = [r for r in rows if r["scaling"] == scal]
        f = fixed if scal == "weak" else fixed[:-1] + ["global_tokens"]
        curves += sweep_curves(sub, "gpus", f)
    if curves:
        fig, axs = plt.subplots(1, 3, figsize=(16, 4.6))
        for label, g in curves:
            xs = [int(r["gpus"]) for r in g]
            tpg = [num(r, "tok_s_per_gpu") for r in g]
            line, = axs[0].plot(xs, tpg, "o-", label=label)
            axs[0].plot([xs[0], xs[-1]], [tpg[0], tpg[0]], ":", color=line.get_color(), lw=1)
            axs[1].plot(xs, [100 * num(r, "mfu") for r in g], "o-", color=line.get_color())
            axs[2].plot(xs, [100 * v / tpg[0] for v in tpg], "o-", color=line.get_color())
        axs[2].axhline(100, ls=":", color="gray", lw=1, label="ideal")
        for ax, t in zip(axs, ("tokens/s per GPU (dotted: ideal)", mfu_title(rows),
                               "scaling efficiency (%)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs (ranks)")
            ax.set_title(t)
            ax.grid(alpha=0.3)
        axs[0].legend(fontsize=7)
        save_fig(fig, os.path.join(out_dir, "scaling.png"))
        plt.close(fig)
        made["scaling.png"] = {"series": len(curves), "points": sum(len(g) for _, g in curves)}

    # Time breakdown per point: stacked shares of the profiled step by op family (+ idle).
    if rows:
        rows_sorted = sorted(rows, key=lambda r: (r["model"], r["layout"], int(r["gpus"]),
                                                  int(r["n_experts"]), int(r["top_k"]),
                                                  int(r["global_tokens"])))
        names = [f"family_{f}_share" for f in FAMILIES] + ["idle_share"]
        present = [n for n in names if any(num(r, n) > 0 for r in rows_sorted)]
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows_sorted) + 3), 5))
        bottom = [0.0] * len(rows_sorted)
        xs = range(len(rows_sorted))
        colors = plt.get_cmap("tab20").colors
        for i, n in enumerate(present):
            vals = [100 * num(r, n) for r in rows_sorted]
            ax.bar(xs, vals, bottom=bottom, color=colors[(2 * i) % 20 + (2 * i) // 20],
                   label=n.replace("family_", "").replace("_share", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(list(xs))
        ax.set_xticklabels([short_label(r) for r in rows_sorted], rotation=70, ha="right",
                           fontsize=7)
        ax.set_ylabel("% of the profiled step")
        ax.set_title("where the step's time goes (op families)")
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
        save_fig(fig, os.path.join(out_dir, "breakdown.png"))
        plt.close(fig)
        made["breakdown.png"] = {"series": len(present), "points": len(rows_sorted)}

        # Memory per rank: the largest rank's, per point, with the smallest as a marker.
        mem_rows = [r for r in rows_sorted if not math.isnan(num(r, "mem_per_rank_max_mib"))]
        if mem_rows:
            fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(mem_rows) + 3), 4.5))
            xs = range(len(mem_rows))
            ax.bar(xs, [num(r, "mem_per_rank_max_mib") for r in mem_rows], label="largest rank")
            ax.plot(xs, [num(r, "mem_per_rank_min_mib") for r in mem_rows], "k_", ms=14,
                    label="smallest rank")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([short_label(r) for r in mem_rows], rotation=70, ha="right",
                               fontsize=7)
            kinds = sorted({r["mem_kind"] for r in mem_rows})
            ax.set_ylabel("MiB per rank (" + ", ".join(kinds) + ")")
            ax.set_title("memory per rank")
            ax.legend(fontsize=7)
            save_fig(fig, os.path.join(out_dir, "memory.png"))
            plt.close(fig)
            made["memory.png"] = {"series": 2, "points": len(mem_rows)}

    # Expert count, top-k and tokens-per-GPU sweeps: tok/s/GPU and MFU along each axis.
    for axis, fname, xlabel in (("n_experts", "experts.png", "experts"),
                                ("top_k", "topk.png", "top-k"),
                                ("tokens_per_gpu", "tokens.png", "tokens per GPU")):
        others = [k for k in ("model", "layout", "gpus", "n_experts", "top_k", "tokens_per_gpu")
                  if k != axis]
        curves = sweep_curves(rows, axis, others)
        if not curves:
            continue
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.4))
        for label, g in curves:
            xs = [int(r[axis]) for r in g]
            line, = axs[0].plot(xs, [num(r, "tok_s_per_gpu") for r in g], "o-", label=label)
            axs[1].plot(xs, [100 * num(r, "mfu") for r in g], "o-", color=line.get_color())
        for ax, t in zip(axs, ("tokens/s per GPU", mfu_title(rows))):
            if axis != "top_k":
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_title(t if t.startswith("MFU (%):") else f"{t} vs {xlabel}")
            ax.grid(alpha=0.3)
        axs[0].legend(fontsize=7)
        save_fig(fig, os.path.join(out_dir, fname))
        plt.close(fig)
        made[fname] = {"series": len(curves), "points": sum(len(g) for _, g in curves)}

    for stale in ("scaling.png", "breakdown.png", "memory.png", "experts.png", "topk.png",
                  "tokens.png"):
        if stale not in made and os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    write_atomic(os.path.join(out_dir, "plots.json"), json.dumps(made, indent=1) + "\n")
    log(f"plots in {out_dir}: " + ", ".join(f"{k} ({v['series']} series)" for k, v in made.items()))
    return made


def mfu_title(rows):
    if rows and all(num(r, "mfu") == 0 for r in rows):
        return "MFU (%): not measured on the CPU backend"
    return "MFU (%)"


def short_label(r):
    s = f"{r['model']} {r['layout']} g{r['gpus']} E{r['n_experts']} k{r['top_k']}"
    return s + f" T{int(r['tokens_per_gpu']) // 1024}K" if int(r["tokens_per_gpu"]) >= 1024 \
        else s + f" T{r['tokens_per_gpu']}"


def cmd_plot(a):
    plot(a.csv, a.out or os.path.dirname(os.path.abspath(a.csv)))
    return 0


# ---- report -----------------------------------------------------------------------------------

def cmd_report(a):
    csv_path = os.path.abspath(a.csv)
    src_dir = os.path.dirname(csv_path)
    md_path = os.path.abspath(a.md)
    md_dir = os.path.dirname(md_path)
    img_dir = os.path.abspath(a.images) if a.images else src_dir
    made = plot(csv_path, img_dir)
    rows = list(read_csv(csv_path).values())
    meta = {}
    if os.path.exists(os.path.join(src_dir, "sweep.json")):
        with open(os.path.join(src_dir, "sweep.json")) as f:
            meta = json.load(f)
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] != "ok"]
    backends = sorted({r["backend"] for r in ok})
    out = []
    title = meta.get("title") or meta.get("name") or "Scaling"
    out.append(f"# Scaling experiments: {title}\n")
    out.append("Generated by `python3 examples/scaling/sweep.py report` from "
               f"`{os.path.relpath(csv_path, ROOT) if csv_path.startswith(ROOT) else os.path.basename(csv_path)}`"
               + (f" (sweep file `{meta['sweep_file']}`)" if meta.get("sweep_file") else "")
               + f": {len(ok)} points measured, {len(bad)} failed"
               + (f"; backend {', '.join(backends)}" if backends else "") + ".\n")
    out.append("Each point is one `hotpath bench step` run: the median of its timed steps (tok/s, "
               "ms, syncs), and the time breakdown from as many profiled steps again. tok/s/GPU "
               "is the job's tokens per second over its ranks; MFU is per GPU against the bf16 "
               "peak (0 on the CPU backend); busy is the device's busy fraction (1 on the CPU "
               "backend, which computes on the calling thread); memory is the largest rank's "
               "(`device_peak_allocated`: the caching allocator's peak on the GPU; "
               "`host_peak_rss`: the process's peak resident set on the CPU).\n")
    if any(m.get("series") for m in made.values()):
        out.append("## Plots\n")
        captions = {"scaling.png": "tok/s per GPU, MFU and scaling efficiency vs GPUs (dotted: "
                                   "ideal, flat at the smallest GPU count)",
                    "breakdown.png": "time breakdown per point by op family",
                    "memory.png": "memory per rank",
                    "experts.png": "expert-count sweep", "topk.png": "top-k sweep",
                    "tokens.png": "tokens-per-GPU sweep"}
        for name in ("scaling.png", "experts.png", "topk.png", "tokens.png", "breakdown.png",
                     "memory.png"):
            if name in made:
                rel = os.path.relpath(os.path.join(img_dir, name), md_dir)
                out.append(f"![{captions[name]}]({rel})\n")
    if ok:
        out.append("## Throughput\n")
        out.append("| model | layout | GPUs | dp×ep | experts | top-k | tokens/GPU | ms/step | tok/s "
                   "| tok/s/GPU | MFU | busy | syncs/step | memory/rank MiB |")
        out.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sort_rows(ok):
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['dp']}×{r['ep']} | "
                       f"{r['n_experts']} | {r['top_k']} | {r['tokens_per_gpu']} | "
                       f"{num(r, 'ms_per_step'):.1f} | {num(r, 'tok_s'):.0f} | "
                       f"{num(r, 'tok_s_per_gpu'):.0f} | {100 * num(r, 'mfu'):.1f}% | "
                       f"{100 * num(r, 'gpu_busy'):.0f}% | {num(r, 'syncs_per_step'):.0f} | "
                       f"{num(r, 'mem_per_rank_max_mib'):.0f} |")
        out.append("")
        out.append("## Where the time goes (% of the profiled step)\n")
        fams = [f for f in FAMILIES if any(num(r, f"family_{f}_share") > 0 for r in ok)]
        out.append("| model | layout | GPUs | experts | top-k | tokens/GPU | "
                   + " | ".join(f.replace("_", " ") for f in fams) + " | idle |")
        out.append("|---|---|---:|---:|---:|---:|" + "---:|" * (len(fams) + 1))
        for r in sort_rows(ok):
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                       f"{r['top_k']} | {r['tokens_per_gpu']} | "
                       + " | ".join(f"{100 * num(r, f'family_{f}_share'):.1f}" for f in fams)
                       + f" | {100 * num(r, 'idle_share'):.1f} |")
        out.append("")
        out.append("By phase:\n")
        out.append("| model | layout | GPUs | experts | top-k | tokens/GPU | "
                   + " | ".join(p.replace("_", " ") for p in PHASES) + " |")
        out.append("|---|---|---:|---:|---:|---:|" + "---:|" * len(PHASES))
        for r in sort_rows(ok):
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                       f"{r['top_k']} | {r['tokens_per_gpu']} | "
                       + " | ".join(f"{100 * num(r, f'phase_{p}_share'):.1f}" for p in PHASES)
                       + " |")
        out.append("")
    if bad:
        out.append("## Failed points\n")
        out.append("| point | error |")
        out.append("|---|---|")
        for r in bad:
            out.append(f"| {r['key']} | {r['error'].replace('|', '/')} |")
        out.append("")
    write_atomic(md_path, "\n".join(out) + "\n")
    log(f"wrote {md_path} ({len(ok)} points, {len(made)} plots)")
    return 0


def sort_rows(rows):
    return sorted(rows, key=lambda r: (r["model"], r["layout"], int(r["n_experts"]),
                                       int(r["top_k"]), int(r["tokens_per_gpu"]), int(r["gpus"])))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run a sweep's points (resuming), then plot")
    p.add_argument("sweep")
    p.add_argument("--out", required=True, help="directory for results.csv, points/, PNGs")
    p.add_argument("--hotpath", help="the hotpath executable (default: $HOTPATH, build/*/bin, PATH)")
    p.add_argument("--launcher", choices=LAUNCHERS, help="overrides the sweep file's launcher")
    p.add_argument("--retry-failed", action="store_true", help="run failed points again")
    p.add_argument("--max-gpus", type=int, help="leave out the points needing more GPUs than this "
                   "(they are not run and not recorded)")
    p.add_argument("--no-plots", action="store_true")
    p = sub.add_parser("list", help="print every point and its command line")
    p.add_argument("sweep")
    p.add_argument("--hotpath")
    p.add_argument("--launcher", choices=LAUNCHERS)
    p = sub.add_parser("plot", help="PNG plots from a results CSV")
    p.add_argument("csv")
    p.add_argument("--out", help="directory for the PNGs (default: the CSV's)")
    p = sub.add_parser("report", help="Markdown tables and plots from a results CSV")
    p.add_argument("csv")
    p.add_argument("--md", default=os.path.join(ROOT, "docs", "scaling.md"))
    p.add_argument("--images", help="directory for the PNGs (default: the CSV's)")
    p = sub.add_parser("submit", help="the whole sweep as one sbatch job (points via srun)")
    p.add_argument("sweep")
    p.add_argument("--out", required=True)
    p.add_argument("--hotpath")
    p.add_argument("--sbatch-args", help="extra sbatch flags, e.g. \"--time=02:00:00 -p gpu\"")
    a = ap.parse_args(argv)
    try:
        if getattr(a, "launcher", None):
            global LAUNCHER_OVERRIDE
            LAUNCHER_OVERRIDE = a.launcher
        return {"run": cmd_run, "list": cmd_list, "plot": cmd_plot, "report": cmd_report,
                "submit": cmd_submit}[a.cmd](a)
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2


LAUNCHER_OVERRIDE = None

if __name__ == "__main__":
    sys.exit(main())
