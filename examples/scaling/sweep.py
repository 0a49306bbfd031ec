#!/usr/bin/env python3
"""Scaling sweeps of `hotpath bench step`: run the points of a sweep file, collect their JSON into
one CSV, plot it, and write a Markdown report.

    python3 examples/scaling/sweep.py run SWEEP.ini --out DIR [--hotpath PATH] [--retry-failed]
    python3 examples/scaling/sweep.py plot DIR/results.csv [--out DIR] [--force]
    python3 examples/scaling/sweep.py report DIR/results.csv [--md FILE] [--images DIR] [--force]
    python3 examples/scaling/sweep.py submit SWEEP.ini --out DIR [--sbatch-args "..."]
    python3 examples/scaling/sweep.py list SWEEP.ini

The sweep file format is described in examples/scaling/README.md. `run` writes DIR/results.csv
(one row per point, appended as each point ends), DIR/points/<key>.json (each point's own
--bench_json) and DIR/points/<key>.log, then the PNG plots (`plot`). A point already in the CSV
is not run again, so a killed sweep resumes where it stopped; a failed point is recorded with its
error and the sweep goes on. SIGINT (Ctrl-C) or SIGTERM stops `run`: the signal is forwarded to
the running point's process group, which is waited for (SIGKILL after 30 s or a second signal),
the point is not recorded, and the exit status is 130 or 143. A torn last CSV line (a run killed
while writing it) is dropped with a warning and its point runs again. `report` writes
DIR/report.md (and the plots) next to the CSV unless --md says otherwise, and replaces an
existing file only when it is an earlier report in the CSV's directory, or with --force. Mistakes
in the sweep file or the command line name the file, line and key; exit status 2. Standard
library only, except matplotlib for the plots.
"""

import argparse
import array
import configparser
import csv
import errno
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PHASES = ["forward", "loss", "backward", "grad_sync", "optimizer", "other"]
FAMILIES = ["attention", "dense_gemm", "expert_gemm", "routing", "norms_elementwise", "embedding",
            "cross_entropy", "optimizer", "copies", "comm", "other"]
LAUNCHERS = ["local", "mpirun", "srun", "sbatch"]
AXES = ["config", "gpus", "layout", "n_experts", "top_k", "d_model", "n_layers", "expert_ffn_dim",
        "tokens_per_gpu", "global_tokens", "budget_tokens", "budget_flops"]
# The keys of a loss sweep (mode = loss) only, and of a throughput sweep only.
LOSS_KEYS = {"budget_tokens", "budget_flops", "data", "eval_data", "synth_data", "eval_docs",
             "eval_batches", "eval_every"}
THROUGHPUT_KEYS = {"bench_steps", "bench_warmup"}
SWEEP_KEYS = set(AXES) | LOSS_KEYS | THROUGHPUT_KEYS | {
    "name", "launcher", "args", "timeout_s", "gpus_per_node", "mpirun_args", "srun_args",
    "sbatch_args", "env", "title", "mode"}
MODES = ["throughput", "loss"]
# Model axes: 0 or absent is the config's value; set, the flag is the axis's, not args'.
MODEL_AXES = ["d_model", "n_layers", "expert_ffn_dim"]

# The point's mode and model axes, and what a loss point measures (empty in a throughput row).
LOSS_COLUMNS = ["mode", "d_model", "n_layers", "expert_ffn_dim", "budget_kind", "budget", "steps",
                "tokens", "flops", "params_total", "params_active", "eval_loss", "eval_tokens",
                "train_loss"]
THROUGHPUT_COLUMNS = (
    ["key", "series", "status", "error", "model", "launcher", "layout", "dp", "ep", "gpus",
     "nodes", "n_experts", "top_k", "scaling", "tokens_per_gpu", "global_tokens", "args",
     "ms_per_step", "tok_s", "padding", "tok_s_per_gpu", "mfu", "gpu_busy", "idle_share"]
    + [f"phase_{p}_share" for p in PHASES] + [f"family_{f}_share" for f in FAMILIES]
    + ["mem_per_rank_max_mib", "mem_per_rank_min_mib", "mem_kind", "syncs_per_step", "backend",
       "wall_s", "finished_at"])
COLUMNS = THROUGHPUT_COLUMNS[:THROUGHPUT_COLUMNS.index("args") + 1] + LOSS_COLUMNS \
    + THROUGHPUT_COLUMNS[THROUGHPUT_COLUMNS.index("args") + 1:]
# The columns of CSVs written before the loss columns (THROUGHPUT_COLUMNS), and before `args` and
# `padding` (LEGACY_COLUMNS): still read (report, plot) and appended to by a throughput sweep in
# their own layout, so a sweep resumes across the change.
LEGACY_COLUMNS = [c for c in THROUGHPUT_COLUMNS if c not in ("args", "padding")]
LAYOUTS = [COLUMNS, THROUGHPUT_COLUMNS, LEGACY_COLUMNS]
# What a key column reads as in a row of an older layout: the config's model, a throughput point.
KEY_DEFAULTS = {"mode": "throughput", "d_model": "0", "n_layers": "0", "expert_ffn_dim": "0"}
# Where a stopped point's hotpath gets to end after the forwarded signal, before SIGKILL.
STOP_GRACE_S = 30


class SweepError(Exception):
    """A mistake in a sweep file or the command line: the message names the file and key."""


def log(*parts):
    print("[sweep]", *parts, file=sys.stderr, flush=True)


# ---- the sweep file ---------------------------------------------------------------------------

# A number of the sweep file: digits, optionally followed by k or K (x 1024) or M (x 1048576):
# 4096, 4k, 16K, 2M. A FLOP budget may also be written as digits with a decimal exponent (3e12).
INT_RE = re.compile(r"([0-9]+)([kKM]?)")
NUMBER_RULE = "digits, optionally with the suffix k = x1024 or M = x1048576 (e.g. 4096, 4k, 2M)"
FLOPS_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?[eE]([0-9]+)")


def split_list(text):
    return [v.strip() for v in re.split(r"[,\s]+", text.strip()) if v.strip()]


def parse_int(v, at, key, minimum=1):
    """One number of the sweep file, or a SweepError naming the file, line, key and value."""
    m = INT_RE.fullmatch(v)
    if not m:
        raise SweepError(f"{at} key '{key}': '{v}' is not an integer ({NUMBER_RULE})")
    n = int(m.group(1)) * {"": 1, "k": 1024, "K": 1024, "M": 1048576}[m.group(2)]
    if n < minimum:
        raise SweepError(f"{at} key '{key}': {v} is below {minimum}")
    return n


def parse_flops(v, at, key):
    """A FLOP budget: a number of the sweep file, or digits with a decimal exponent (3e12,
    1.5e13) that make a whole number."""
    m = FLOPS_RE.fullmatch(v)
    if not m:
        return parse_int(v, at, key)
    digits, frac, exp = m.group(1), m.group(2) or "", int(m.group(3))
    if len(frac) > exp:
        raise SweepError(f"{at} key '{key}': '{v}' is not a whole number of FLOPs")
    n = int(digits + frac) * 10 ** (exp - len(frac))
    if n < 1:
        raise SweepError(f"{at} key '{key}': {v} is below 1")
    return n


def parse_ints(text, at, key, minimum=1):
    """A comma- or space-separated list of numbers; an empty list is a mistake."""
    values = split_list(text)
    if not values:
        raise SweepError(f"{at} key '{key}' is empty (give a number or a list of numbers)")
    return [parse_int(v, at, key, minimum) for v in values]


def split_args(text, at, key):
    """A shell-quoted list of words (args, env, the launchers' flags)."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise SweepError(f"{at} key '{key}': {e} in {text!r}")


def parse_layout(value, gpus, at):
    """A layout name to (dp, ep): dp (ep 1), ep (ep = gpus), epN, or dpMxepN."""
    v = value.strip().lower()
    if v == "dp":
        return gpus, 1
    if v == "ep":
        return 1, gpus
    m = re.fullmatch(r"ep([0-9]+)", v)
    if m:
        ep = int(m.group(1))
        if ep < 1 or gpus % ep:
            raise SweepError(f"{at} key 'layout': ep{ep} does not divide {gpus} GPUs")
        return gpus // ep, ep
    m = re.fullmatch(r"dp([0-9]+)x?ep([0-9]+)", v)
    if m:
        dp, ep = int(m.group(1)), int(m.group(2))
        if dp * ep != gpus:
            raise SweepError(f"{at} key 'layout': {value} is {dp * ep} GPUs, not {gpus}")
        return dp, ep
    raise SweepError(f"{at} key 'layout': '{value}' is not a layout; valid: dp, ep, epN, "
                     "dpMxepN")


def line_numbers(path):
    """{(section, key): line} and {(section, None): line of its header} of an INI file."""
    lines, sec = {}, None
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"\[(.+)\]\s*(?:[#;].*)?$", line.rstrip("\n"))
            if m:
                sec = m.group(1)
                lines.setdefault((sec, None), n)
                continue
            m = re.match(r"([^\s=:#;\[][^=:]*?)\s*[=:]", line)
            if m and sec is not None:
                lines.setdefault((sec, m.group(1).strip()), n)
    return lines


def read_sweep(path):
    """The sweep file as (settings, [point dict, ...]) in file order, duplicates merged."""
    if not os.path.isfile(path):
        raise SweepError(f"sweep file '{path}' not found")
    cp = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=("#", ";"))
    cp.optionxform = str
    try:
        with open(path, encoding="utf-8") as f:
            cp.read_file(f)
    except UnicodeDecodeError as e:
        raise SweepError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})")
    except configparser.Error as e:
        raise SweepError(f"{path}: {e}".replace("\n", " "))
    lines = line_numbers(path)

    def loc(sec, key=None):
        n = lines.get((sec, key)) or lines.get((sec, None))
        return f"{path}:{n}: [{sec}]" if n else f"{path}: [{sec}]"

    if not cp.has_section("sweep"):
        raise SweepError(f"{path}: no [sweep] section (it holds the base config and launcher)")
    base_dir = os.path.dirname(os.path.abspath(path))
    for sec in cp.sections():
        for k in cp[sec]:
            if k not in SWEEP_KEYS:
                raise SweepError(f"{loc(sec, k)} key '{k}' is not a sweep key; valid: "
                                 + ", ".join(sorted(SWEEP_KEYS)))
    base = dict(cp["sweep"])
    series_secs = [s for s in cp.sections() if s.startswith("series ")]
    if not series_secs:
        series_secs = ["sweep"]
    for s in cp.sections():
        if s != "sweep" and not s.startswith("series "):
            raise SweepError(f"{loc(s)} section [{s}] is neither [sweep] nor [series NAME]")
    settings = {
        "name": base.get("name", os.path.splitext(os.path.basename(path))[0]),
        "title": base.get("title", ""),
        "path": os.path.abspath(path),
    }
    mode = base.get("mode", "throughput").strip()
    if mode not in MODES:
        raise SweepError(f"{loc('sweep', 'mode')} key 'mode': '{mode}' is not one of "
                         + ", ".join(MODES))
    settings["mode"] = mode
    other = "throughput" if mode == "loss" else "loss"
    for sec in cp.sections():
        for k in cp[sec]:
            if k == "mode" and sec != "sweep":
                raise SweepError(f"{loc(sec, k)} key 'mode': set it in [sweep] (one mode per "
                                 "sweep file)")
            if k in (THROUGHPUT_KEYS if mode == "loss" else LOSS_KEYS):
                raise SweepError(f"{loc(sec, k)} key '{k}' belongs to mode = {other} sweeps; "
                                 f"this one is mode = {mode}")
    points = {}
    for sec in series_secs:
        s = dict(base)
        s.update(dict(cp[sec]) if sec != "sweep" else {})

        def at(key, sec=sec):
            """Where key's value comes from: this series, or [sweep] it inherits from."""
            return loc(sec if sec != "sweep" and key in cp[sec] else "sweep", key)

        where = loc(sec)
        series = sec[len("series "):].strip() if sec != "sweep" else settings["name"]
        launcher = LAUNCHER_OVERRIDE or s.get("launcher", "local")
        if launcher not in LAUNCHERS:
            raise SweepError(f"{at('launcher')} key 'launcher': '{launcher}' is not one of "
                             + ", ".join(LAUNCHERS))
        configs = split_list(s.get("config", ""))
        if not configs:
            raise SweepError(f"{at('config')} key 'config' is missing (a hotpath config file, or "
                             "a list)")
        resolved = []
        for c in configs:
            cands = [c if os.path.isabs(c) else os.path.join(ROOT, c), os.path.join(base_dir, c)]
            found = next((x for x in cands if os.path.isfile(x)), None)
            if not found:
                raise SweepError(f"{at('config')} key 'config': '{c}' not found (paths are "
                                 "relative to the repository root or the sweep file)")
            resolved.append((c, found))
        gpus_l = parse_ints(s.get("gpus", "1"), at("gpus"), "gpus")
        layouts = split_list(s.get("layout", "dp"))
        if not layouts:
            raise SweepError(f"{at('layout')} key 'layout' is empty (dp, ep, epN or dpMxepN)")
        experts = parse_ints(s.get("n_experts", "0"), at("n_experts"), "n_experts", 0)
        topks = parse_ints(s.get("top_k", "0"), at("top_k"), "top_k", 0)
        if "tokens_per_gpu" in s and "global_tokens" in s:
            raise SweepError(f"{where} keys 'tokens_per_gpu' (weak scaling, "
                             f"{at('tokens_per_gpu')}) and 'global_tokens' (strong scaling, "
                             f"{at('global_tokens')}) exclude each other")
        if "global_tokens" in s:
            scaling, toks = "strong", parse_ints(s["global_tokens"], at("global_tokens"),
                                                 "global_tokens")
        else:
            scaling, toks = "weak", parse_ints(s.get("tokens_per_gpu", "4096"),
                                               at("tokens_per_gpu"), "tokens_per_gpu")
        gpn = parse_int(s.get("gpus_per_node", "8"), at("gpus_per_node"), "gpus_per_node")
        bench_steps = parse_int(s.get("bench_steps", "3"), at("bench_steps"), "bench_steps")
        bench_warmup = parse_int(s.get("bench_warmup", "1"), at("bench_warmup"), "bench_warmup",
                                 0)
        timeout_s = parse_int(s.get("timeout_s", "600"), at("timeout_s"), "timeout_s", 0)
        args = split_args(s.get("args", ""), at("args"), "args")
        model_axes = {k: parse_ints(s.get(k, "0"), at(k), k, 0) for k in MODEL_AXES}
        runner_flags = "n_experts|top_k|ep_size|batch_tokens|bench_json|config"
        if mode == "loss":
            runner_flags += "|steps|data|eval_data|eval_every|eval_batches|metrics_path|dry-run"
        for a in args:
            if re.match(rf"--({runner_flags})(=|$)", a):
                raise SweepError(f"{at('args')} key 'args': '{a}' is set by the sweep's axes"
                                 + (" and loss keys" if mode == "loss" else ""))
            for k in MODEL_AXES:
                if a.startswith(f"--{k}=") and any(model_axes[k]):
                    raise SweepError(f"{at('args')} key 'args': '{a}' and the axis '{k}' "
                                     f"({at(k)}) both set {k}: keep one")
        loss = loss_settings(s, at, where) if mode == "loss" else None
        launch_flags = {k: split_args(s.get(k, ""), at(k), k)
                        for k in ("mpirun_args", "srun_args", "sbatch_args")}
        env = {}
        for item in split_args(s.get("env", ""), at("env"), "env"):
            if "=" not in item:
                raise SweepError(f"{at('env')} key 'env': '{item}' is not NAME=VALUE")
            k, v = item.split("=", 1)
            env[k] = v
        for (cname, cpath) in resolved:
            model = os.path.splitext(os.path.basename(cname))[0]
            for gpus in gpus_l:
                for lay in layouts:
                    dp, ep = parse_layout(lay, gpus, at("layout"))
                    for ne in experts:
                        if ne and ep > 1 and ne % ep:
                            raise SweepError(f"{where} {ne} experts do not split over ep={ep} "
                                             f"(layout {lay} on {gpus} GPUs)")
                        for k in topks:
                            if ne and k > ne:
                                raise SweepError(f"{where} top_k {k} exceeds {ne} experts")
                            for t, dm, nl, ff, budget in itertools.product(
                                    toks, *(model_axes[a] for a in MODEL_AXES),
                                    loss["budgets"] if loss else [None]):
                                tpg = t if scaling == "weak" else t // gpus
                                glob = t * gpus if scaling == "weak" else t
                                if launcher == "local" and gpus > 1:
                                    raise SweepError(f"{where} launcher 'local' runs one "
                                                     f"process; {gpus} GPUs need mpirun, srun or "
                                                     "sbatch")
                                p = {
                                    "series": series, "model": model, "config": cpath,
                                    "launcher": launcher, "layout": lay.lower(), "dp": dp,
                                    "ep": ep, "gpus": gpus,
                                    "nodes": max(1, math.ceil(gpus / gpn)), "gpus_per_node": gpn,
                                    "n_experts": ne, "top_k": k, "scaling": scaling,
                                    "tokens_per_gpu": tpg, "global_tokens": glob, "args": args,
                                    "d_model": dm, "n_layers": nl, "expert_ffn_dim": ff,
                                    "mode": mode, "bench_steps": bench_steps,
                                    "bench_warmup": bench_warmup,
                                    "timeout_s": timeout_s,
                                    "mpirun_args": launch_flags["mpirun_args"],
                                    "srun_args": launch_flags["srun_args"],
                                    "sbatch_args": launch_flags["sbatch_args"],
                                    "env": env,
                                }
                                if loss:
                                    p.update({k: v for k, v in loss.items() if k != "budgets"})
                                    p["budget"] = budget
                                    if loss["budget_kind"] == "tokens" and budget < glob:
                                        raise SweepError(
                                            f"{at('budget_tokens')} key 'budget_tokens': {budget} "
                                            f"is less than one step's {glob} tokens "
                                            "(batch_tokens)")
                                    if loss["budget_kind"] == "tokens":
                                        p["steps"] = budget // glob
                                p["key"] = point_key(p)
                                if p["key"] in points:
                                    old = points[p["key"]]
                                    if series not in old["series"].split():
                                        old["series"] += " " + series
                                else:
                                    points[p["key"]] = p
    return settings, list(points.values())


def loss_settings(s, at, where):
    """The keys of a loss series: its budgets, its data and its evaluation."""
    if ("budget_tokens" in s) == ("budget_flops" in s):
        raise SweepError(f"{where} a loss sweep needs one of 'budget_tokens' (tokens each point "
                         "trains on) and 'budget_flops' (model FLOPs each point spends)"
                         + (", not both" if "budget_tokens" in s else ""))
    if "budget_tokens" in s:
        kind, budgets = "tokens", parse_ints(s["budget_tokens"], at("budget_tokens"),
                                             "budget_tokens")
    else:
        values = split_list(s["budget_flops"])
        if not values:
            raise SweepError(f"{at('budget_flops')} key 'budget_flops' is empty (give a number or "
                             "a list of numbers, e.g. 1e12, 4e12)")
        kind, budgets = "flops", [parse_flops(v, at("budget_flops"), "budget_flops")
                                  for v in values]
    synth = s.get("synth_data")
    if synth is not None and ("data" in s or "eval_data" in s):
        raise SweepError(f"{where} 'synth_data' ({at('synth_data')}) writes the data itself; it "
                         "excludes 'data' and 'eval_data'")
    if synth is None and not (s.get("data", "").strip() and s.get("eval_data", "").strip()):
        raise SweepError(f"{where} a loss sweep needs 'data' and 'eval_data' (hotpath data specs: "
                         "training and held-out token files), or 'synth_data' (flags of hotpath "
                         "data synth, which the runner splits into both)")
    out = {"budget_kind": kind, "budgets": budgets,
           "eval_batches": parse_int(s.get("eval_batches", "8"), at("eval_batches"),
                                     "eval_batches"),
           "eval_every": parse_int(s.get("eval_every", "0"), at("eval_every"), "eval_every", 0)}
    if synth is not None:
        flags = split_args(synth, at("synth_data"), "synth_data")
        for f in flags:
            if not re.match(r"--[a-z_]+=\S", f):
                raise SweepError(f"{at('synth_data')} key 'synth_data': '{f}' is not --key=value "
                                 "(flags of hotpath data synth)")
            if f.startswith("--out="):
                raise SweepError(f"{at('synth_data')} key 'synth_data': '{f}': the runner names "
                                 "the files")
            if f.startswith("--docs="):
                parse_int(f[len("--docs="):], at("synth_data"), "synth_data --docs")
        out["synth"] = flags
        out["eval_docs"] = parse_int(s.get("eval_docs", "256"), at("eval_docs"), "eval_docs")
    else:
        out["data"], out["eval_data"] = s["data"].strip(), s["eval_data"].strip()
    return out


def data_id(p):
    """What a loss point's data and evaluation are, as one text (its hash is in the key)."""
    if "synth" in p:
        d = "synth " + " ".join(p["synth"]) + f" eval_docs={p['eval_docs']}"
    else:
        d = f"data={p['data']} eval_data={p['eval_data']}"
    return d + f" eval_batches={p['eval_batches']} eval_every={p['eval_every']}"


def short_int(n):
    """A whole number in few characters: 6000000000000000 as 6e15, 262144 as 262144."""
    m, e = n, 0
    while m and m % 10 == 0:
        m, e = m // 10, e + 1
    return f"{m}e{e}" if e >= 3 else str(n)


def point_key(p):
    """A point's identity in the CSV: everything that changes what is measured (not the launcher,
    so `submit`, which runs the points through srun, resumes a sweep `run` started)."""
    parts = [p["model"], f"g{p['gpus']}", p["layout"], f"dp{p['dp']}",
             f"ep{p['ep']}", f"e{p['n_experts']}", f"k{p['top_k']}", f"t{p['global_tokens']}"]
    for axis, tag in (("d_model", "d"), ("n_layers", "L"), ("expert_ffn_dim", "f")):
        if p.get(axis):
            parts.append(f"{tag}{p[axis]}")
    if p.get("mode") == "loss":
        parts.append(("bt" if p["budget_kind"] == "tokens" else "bf") + short_int(p["budget"]))
        parts.append("D" + hashlib.sha1(data_id(p).encode()).hexdigest()[:8])
    if p["args"]:
        parts.append("a" + hashlib.sha1(" ".join(p["args"]).encode()).hexdigest()[:8])
    return "_".join(str(x) for x in parts)


# ---- running one point ------------------------------------------------------------------------

def model_flags(p):
    """The flags that set a point's model and batch (the axes), before its args."""
    a = [f"--batch_tokens={p['global_tokens']}", f"--ep_size={p['ep']}"]
    for k in ["n_experts", "top_k"] + MODEL_AXES:
        if p.get(k):
            a.append(f"--{k}={p[k]}")
    return a


def hotpath_args(p, hotpath, out_path):
    """The hotpath command of a point: `bench step` writing out_path (its --bench_json), or for
    a loss point `train` for p["steps"] steps writing out_path (its --metrics_path JSONL)."""
    if p.get("mode") == "loss":
        a = [hotpath, "train", "--config", p["config"]] + model_flags(p) + [
            f"--steps={p.get('steps', '<from budget_flops>')}", f"--data={p['train_spec']}",
            f"--eval_data={p['eval_spec']}", f"--eval_batches={p['eval_batches']}",
            f"--eval_every={p['eval_every']}", f"--metrics_path={out_path}"]
        return a + p["args"]
    a = [hotpath, "bench", "step", "--config", p["config"]] + model_flags(p) + [
        f"--bench_steps={p['bench_steps']}", f"--bench_warmup={p['bench_warmup']}",
        f"--bench_json={out_path}"]
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


class Stop:
    """The first SIGINT or SIGTERM `run` received (None: none); `run_point` forwards it to the
    running point's process group, and a second one there becomes SIGKILL."""
    signum = None
    count = 0


def on_stop_signal(signum, _frame):
    if Stop.signum is None:
        Stop.signum = signum
    Stop.count += 1


def signal_name(signum):
    return signal.Signals(signum).name


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_point(proc, timeout_s):
    """Waits for a point's process, forwarding a stop signal to its group (SIGKILL after
    STOP_GRACE_S or at a second signal) and killing the group at timeout_s; then kills whatever
    of the group outlived its leader. Returns the exit status, or "timeout"."""
    t0 = time.time()
    forwarded, grace_end, killed, timed_out = 0, None, False, False
    while True:
        try:
            rc = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        if Stop.signum is not None and Stop.count > forwarded:
            if forwarded == 0:
                kill_group(proc.pid, Stop.signum)
                grace_end = now + STOP_GRACE_S
            else:
                kill_group(proc.pid, signal.SIGKILL)
                killed = True
            forwarded = Stop.count
        if grace_end is not None and now > grace_end and not killed:
            kill_group(proc.pid, signal.SIGKILL)
            killed = True
        if timeout_s and now - t0 > timeout_s and not timed_out:
            kill_group(proc.pid, signal.SIGKILL)
            timed_out = killed = True
    if forwarded or timed_out:
        kill_group(proc.pid, signal.SIGKILL)  # ranks or helpers its leader left behind
    return "timeout" if timed_out else rc


def run_point(p, hotpath, out_dir):
    pdir = os.path.join(out_dir, "points")
    os.makedirs(pdir, exist_ok=True)
    loss = p.get("mode") == "loss"
    json_path = os.path.join(pdir, p["key"] + (".jsonl" if loss else ".json"))
    log_path = os.path.join(pdir, p["key"] + ".log")
    job_script = os.path.join(pdir, p["key"] + ".sbatch")
    for f in (json_path, json_path + ".tmp"):
        if os.path.exists(f):
            os.remove(f)
    if os.path.exists(log_path):
        os.remove(log_path)
    t0 = time.time()
    params = None
    if loss:
        # The parameter counts are hotpath's own (train --dry-run); a FLOP budget needs them to
        # set the steps before the run.
        params, err = dry_run_params(p, hotpath, log_path)
        if err:
            return {"status": "failed", "error": err}, time.time() - t0
        p = dict(p, steps=loss_steps(p, params["params_active"]))
    cmd, script = launch_command(p, hotpath, json_path, job_script)
    if script:
        write_atomic(job_script, script)
        os.chmod(job_script, 0o755)
    env = dict(os.environ)
    env.update(p["env"])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // p["gpus"])))
    with open(os.path.join(out_dir, "launches.log"), "a") as f:
        f.write(p["key"] + "\n")
    rc, text = None, ""
    with open(log_path, "a") as lf:
        lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        lf.flush()
        try:
            # Its own session: a terminal's Ctrl-C reaches the runner only, which forwards it.
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        except OSError as e:
            return {"status": "failed", "error": f"cannot start {cmd[0]}: {e}"}, time.time() - t0
        rc = wait_point(proc, p["timeout_s"])
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
    if loss:
        return row_from_metrics(json_path, p, params, text), wall
    try:
        with open(json_path) as jf:
            j = json.load(jf)
    except (OSError, ValueError) as e:
        return {"status": "failed", "error": f"exit 0 but no valid {json_path}: {e}"}, wall
    return row_from_json(j), wall


PARAMS_RE = re.compile(r"params: total=([0-9]+) active=([0-9]+)")


def dry_run_params(p, hotpath, log_path):
    """({params_total, params_active}, None) from `hotpath train --dry-run` with the point's
    model flags, or (None, the error)."""
    cmd = ([hotpath, "train", "--dry-run", "--config", p["config"]] + model_flags(p)
           + [f"--plan_world={p['gpus']}"] + p["args"])
    env = dict(os.environ)
    env.update(p["env"])
    with open(log_path, "a") as lf:
        lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        lf.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env=env, start_new_session=True)
        except OSError as e:
            return None, f"cannot start {cmd[0]}: {e}"
        out, _ = proc.communicate()
        lf.write(out)
    if proc.returncode != 0:
        return None, "dry run: " + short_error(out, proc.returncode)
    m = PARAMS_RE.search(out)
    if not m:
        return None, "dry run: no 'params: total=N active=N' line in its output"
    return {"params_total": int(m.group(1)), "params_active": int(m.group(2))}, None


def loss_steps(p, params_active):
    """A loss point's steps: its token budget over the tokens of a step (batch_tokens); or its
    FLOP budget over 6 x active parameters x batch_tokens, rounded (attention FLOPs are not in
    this estimate: the FLOPs spent, hotpath's count, exceed it by their share)."""
    if p["budget_kind"] == "tokens":
        return max(1, p["budget"] // p["global_tokens"])
    return max(1, round(p["budget"] / (6.0 * params_active * p["global_tokens"])))


def median(values):
    v = sorted(values)
    if not v:
        return float("nan")
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def row_from_metrics(jsonl_path, p, params, log_text):
    """The CSV numbers of one loss point: its steps' JSONL records (hotpath train
    --metrics_path) and the parameter counts of its dry run."""
    def failed(msg):
        return {"status": "failed", "error": f"exit 0 but {msg}"}

    recs = []
    try:
        with open(jsonl_path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        recs.append(json.loads(line))
                    except ValueError as e:
                        return failed(f"{jsonl_path}:{n}: not JSON: {e}")
    except OSError as e:
        return failed(f"no metrics file {jsonl_path}: {e.strerror}")
    if not recs:
        return failed(f"{jsonl_path} holds no step records")
    last = recs[-1]
    if last.get("step") != p["steps"] or len(recs) != p["steps"]:
        return failed(f"{jsonl_path} has {len(recs)} records ending at step {last.get('step')}, "
                      f"expected steps 1..{p['steps']}")
    if not is_number(last.get("eval_loss")):
        return failed(f"the last record of {jsonl_path} has no eval_loss (a hotpath without "
                      "held-out evaluation, eval_data?)")
    if not all(is_number(r.get("flops")) for r in recs):
        return failed(f"records of {jsonl_path} have no 'flops' (model FLOPs of the step)")
    tokens = sum(r.get("tokens", 0) for r in recs)
    positions = sum(r.get("positions", 0) for r in recs)
    # Throughput of the steady steps: not the first (warm-up), not those that also evaluated.
    steady = [r for r in recs[1:] if "eval_loss" not in r] or recs
    tok_s = median([r.get("tokens_per_s", float("nan")) for r in steady])
    m = re.search(r"backend=(\S+)", log_text)
    return {
        "status": "ok", "error": "", "steps": p["steps"], "tokens": tokens,
        "flops": float(sum(r["flops"] for r in recs)),
        "params_total": params["params_total"], "params_active": params["params_active"],
        "eval_loss": float(last["eval_loss"]), "eval_tokens": last.get("eval_tokens", ""),
        "train_loss": float(last["loss"]) if is_number(last.get("loss")) else float("nan"),
        "ms_per_step": median([r.get("ms", float("nan")) for r in steady]),
        "tok_s": tok_s, "tok_s_per_gpu": tok_s / p["gpus"],
        "padding": 1.0 - tokens / positions if positions else 0.0,
        "mfu": median([r.get("mfu", 0.0) for r in steady]),
        "syncs_per_step": median([sum(r["syncs"].values()) for r in steady
                                  if isinstance(r.get("syncs"), dict)]),
        "backend": m.group(1) if m else "",
    }


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
        # The padded fraction of the step's positions; tokens_per_s counts document tokens only.
        # 0 from a hotpath whose JSON predates the field.
        "padding": j.get("padding", 0.0),
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


def csv_header(csv_path):
    """The columns of an existing results CSV (one of LAYOUTS), or None when it is absent or
    empty."""
    if not os.path.exists(csv_path) or os.path.getsize(csv_path) == 0:
        return None
    with open(csv_path, newline="", errors="replace") as f:
        first = f.readline()
    header = first.rstrip("\r\n").split(",")
    if not first.endswith("\n"):
        return None  # a torn header: read_csv(repair=True) empties the file
    for layout in LAYOUTS:
        if header == layout:
            return layout
    missing = [c for c in COLUMNS if c not in header]
    raise SweepError(f"{csv_path}: not a results CSV of this runner (columns differ"
                     + (f"; missing {', '.join(missing[:5])}" if missing else "") + ")")


def append_row(csv_path, row):
    """One whole line per write with O_APPEND, then fsync: a kill leaves whole rows behind, or a
    torn last line that read_csv(repair=True) drops. A CSV of an older layout keeps it."""
    columns = csv_header(csv_path)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if columns is None:
        columns = COLUMNS
        w.writerow(columns)
    w.writerow([fmt(row.get(c)) for c in columns])
    data = buf.getvalue().encode()
    fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_csv(csv_path, repair=False):
    """Rows by key, the last row of a key winning; missing new columns read as "".

    A last line without its newline (or with NUL bytes) is a row torn by a kill while it was
    written: with repair (run) the file is cut back to its last whole line with a warning, so that
    point runs again; without (report, plot) the line is left out with a warning. Any other line
    whose field count is not the header's is refused naming the line."""
    if not os.path.exists(csv_path):
        return {}
    with open(csv_path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1  # the end of the last terminated line
    if end < len(data):
        keep = end  # an unterminated last line
    else:
        start = data.rfind(b"\n", 0, max(end - 1, 0)) + 1
        # A terminated last line with NULs: a crash left the file's size ahead of its data.
        keep = start if b"\0" in data[start:] else None
    if keep is not None:
        lineno = data.count(b"\n", 0, keep) + 1
        shown = data[keep:keep + 60].replace(b"\0", b"\\0").decode("utf-8", "replace").strip()
        if repair:
            with open(csv_path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            log(f"warning: {csv_path}:{lineno}: incomplete last line (a run stopped while writing "
                f"it) dropped: '{shown}...'; its point runs again")
        else:
            log(f"warning: {csv_path}:{lineno}: incomplete last line (a run stopped while writing "
                f"it) left out: '{shown}...'; `run` drops it and runs that point again")
        data = data[:keep]
    if not data:
        return {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise SweepError(f"{csv_path}:{lineno}: not UTF-8 text: the file is damaged")
    header = text.split("\n", 1)[0].split(",")
    if header not in LAYOUTS:
        missing = [c for c in COLUMNS if c not in header]
        raise SweepError(f"{csv_path}: not a results CSV of this runner (columns differ"
                         + (f"; missing {', '.join(missing[:5])}" if missing else "") + ")")
    out = {}
    reader = csv.reader(io.StringIO(text, newline=""))
    next(reader)
    for fields in reader:
        if not fields:
            continue
        if len(fields) != len(header):
            raise SweepError(f"{csv_path}:{reader.line_num}: {len(fields)} fields, expected "
                             f"{len(header)}: the line is damaged (remove it and its point runs "
                             "again)")
        r = dict(zip(header, fields))
        for c in COLUMNS:
            if not r.get(c):
                r[c] = KEY_DEFAULTS.get(c, "")
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


def make_out_dir(path, flag="--out"):
    if os.path.exists(path) and not os.path.isdir(path):
        raise SweepError(f"{flag} {path}: exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SweepError(f"{flag} {path}: cannot create the directory: {e.strerror}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SweepError(f"{flag} {path}: the directory is not writable")


def set_data_paths(points, out_dir):
    """Each loss point's training and held-out data specs: its data and eval_data, or the two
    files its synth_data makes in DIR/data/<hash of the flags>/."""
    for p in points:
        if p.get("mode") != "loss":
            continue
        if "synth" in p:
            h = hashlib.sha1((" ".join(p["synth"]) + f" eval_docs={p['eval_docs']}")
                             .encode()).hexdigest()[:8]
            d = os.path.join(out_dir, "data", h)
            p["train_spec"] = os.path.join(d, "train.bin")
            p["eval_spec"] = os.path.join(d, "eval.bin")
        else:
            p["train_spec"], p["eval_spec"] = p["data"], p["eval_data"]


BIN_HEADER_INTS = 256
BIN_MAGIC, BIN_VERSION = 20240520, 1


def write_bin(path, tokens):
    """An llm.c token shard (256 int32 header: magic, version, count; uint16 tokens), written
    under a temporary name and renamed."""
    header = array.array("i", [0] * BIN_HEADER_INTS)
    header[0], header[1], header[2] = BIN_MAGIC, BIN_VERSION, len(tokens)
    if sys.byteorder != "little":
        header.byteswap()
        tokens = array.array("H", tokens)
        tokens.byteswap()
    write_atomic(path, header.tobytes() + tokens.tobytes(), mode="wb")


def make_data(points, hotpath):
    """For each distinct synth_data: `hotpath data synth` writes its --docs documents plus
    eval_docs more (one source, one seed), and the runner splits them by document: the first
    --docs into train.bin, the rest into eval.bin (held out: no training document among them)."""
    done = set()
    for p in points:
        d = os.path.dirname(p["train_spec"])
        if d in done or (os.path.isfile(p["train_spec"]) and os.path.isfile(p["eval_spec"])):
            continue
        done.add(d)
        os.makedirs(d, exist_ok=True)
        flags = [f for f in p["synth"] if not f.startswith("--docs=")]
        docs_flag = [f for f in p["synth"] if f.startswith("--docs=")]
        train_docs = parse_int(docs_flag[-1].split("=", 1)[1], "synth_data", "--docs") \
            if docs_flag else 1000  # hotpath data synth's default
        total = train_docs + p["eval_docs"]
        all_path = os.path.join(d, "all.bin")
        cmd = [hotpath, "data", "synth", f"--out={all_path}", f"--docs={total}"] + flags
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SweepError("synth_data: " + " ".join(shlex.quote(c) for c in cmd) + ": "
                             + short_error(r.stdout + r.stderr, r.returncode))
        with open(all_path, "rb") as f:
            raw = f.read()
        os.remove(all_path)
        header = array.array("i", raw[:4 * BIN_HEADER_INTS])
        tokens = array.array("H", raw[4 * BIN_HEADER_INTS:])
        if sys.byteorder != "little":
            header.byteswap()
            tokens.byteswap()
        if header[0] != BIN_MAGIC or header[2] != len(tokens) or not tokens:
            raise SweepError(f"synth_data: {all_path} is not a whole token shard")
        eot = tokens[-1]  # every document ends with the end-of-text token
        n_docs = tokens.count(eot)
        if n_docs != total:
            raise SweepError(f"synth_data: {all_path} holds {n_docs} documents, expected {total}")
        cut = 0
        for _ in range(train_docs):
            cut = tokens.index(eot, cut) + 1
        write_bin(p["eval_spec"], tokens[cut:])
        write_bin(p["train_spec"], tokens[:cut])
        log(f"data: {p['train_spec']} ({train_docs} documents, {cut} tokens) and "
            f"{p['eval_spec']} ({p['eval_docs']} held-out documents, {len(tokens) - cut} tokens)")


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
    make_out_dir(a.out)
    csv_path = os.path.join(a.out, "results.csv")
    done = read_csv(csv_path, repair=True)
    layout = csv_header(csv_path)
    if layout not in (None, COLUMNS) and settings["mode"] == "loss":
        raise SweepError(f"{csv_path} has the columns of an earlier runner (no loss columns): a "
                         "loss sweep needs a new --out directory")
    if layout is not None and layout != COLUMNS:
        log(f"{csv_path} has the columns of an earlier runner (no "
            + ("args, padding, " if layout == LEGACY_COLUMNS else "") + "loss columns): new rows "
            "keep its layout; a new --out directory gets every column")
    todo = []
    for p in points:
        r = done.get(p["key"])
        if r and (r["status"] == "ok" or not a.retry_failed):
            continue
        todo.append(p)
    skipped = len(points) - len(todo)
    log(f"{settings['name']}: {len(points)} points, {skipped} already in {csv_path}, "
        f"{len(todo)} to run (hotpath: {hotpath})")
    set_data_paths(points, os.path.abspath(a.out))
    make_data([p for p in todo if "synth" in p], hotpath)
    write_atomic(os.path.join(a.out, "sweep.json"),
                 json.dumps({"name": settings["name"], "title": settings["title"],
                             "sweep_file": os.path.relpath(settings["path"], ROOT),
                             "points": [p["key"] for p in points]}, indent=1) + "\n")
    # SIGINT and SIGTERM stop the sweep: forwarded to the running point, which is not recorded.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop_signal)
    t_start, failed = time.time(), 0
    for i, p in enumerate(todo):
        if Stop.signum is not None:
            return stopped(f"before point {skipped + i + 1}/{len(points)} {p['key']}", csv_path)
        log(f"[{skipped + i + 1}/{len(points)}] {p['key']}")
        res, wall = run_point(p, hotpath, a.out)
        if Stop.signum is not None:
            return stopped(f"at point {skipped + i + 1}/{len(points)} {p['key']} (ended with the "
                           "signal, not recorded)", csv_path)
        row = {k: p[k] for k in ("key", "series", "model", "launcher", "layout", "dp", "ep",
                                 "gpus", "nodes", "n_experts", "top_k", "scaling",
                                 "tokens_per_gpu", "global_tokens", "mode", "d_model",
                                 "n_layers", "expert_ffn_dim")}
        if p["mode"] == "loss":
            row["budget_kind"], row["budget"] = p["budget_kind"], p["budget"]
        row["args"] = " ".join(shlex.quote(x) for x in p["args"])
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
    if Stop.signum is None and not a.no_plots:
        plot(csv_path, a.out)
    if Stop.signum is not None:
        return stopped(f"after its last point, {len(points)}/{len(points)}", csv_path)
    keys = {p["key"] for p in points}
    ok = sum(1 for k, r in read_csv(csv_path).items() if r["status"] == "ok" and k in keys)
    log(f"{settings['name']}: {ok}/{len(points)} points ok, {failed} failed in this run; "
        f"CSV {csv_path}")
    if settings["mode"] == "loss":
        rows = [r for k, r in read_csv(csv_path).items() if k in keys]
        print("\n".join(loss_table(rows)))
    return 0 if failed == 0 else 1


def stopped(where, csv_path):
    """The one line a stopped sweep prints; the exit status is 128 + the signal (130, 143)."""
    n = len(read_csv(csv_path))
    log(f"stopped by {signal_name(Stop.signum)} {where}; {n} point{'' if n == 1 else 's'} in "
        f"{csv_path}; resume with: "
        "python3 " + " ".join(shlex.quote(x) for x in sys.argv))
    return 128 + Stop.signum


def cmd_list(a):
    _, points = read_sweep(a.sweep)
    hotpath = a.hotpath or "hotpath"
    set_data_paths(points, "OUT")
    for p in points:
        ext = ".jsonl" if p["mode"] == "loss" else ".json"
        cmd, _ = launch_command(p, hotpath, f"points/{p['key']}{ext}", f"points/{p['key']}.sbatch")
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

# What identifies a point (its key's parts, args included). A line of an axis plot joins the
# points that agree on every one of these but the axis (and what the axis implies: along GPUs,
# global tokens under weak scaling and tokens per GPU under strong; along tokens per GPU, global
# tokens), so no two points of a line differ in anything but the axis.
KEY_COLS = ["scaling", "model", "layout", "gpus", "n_experts", "top_k", "tokens_per_gpu",
            "global_tokens", "args", "mode", "d_model", "n_layers", "expert_ffn_dim",
            "budget_kind", "budget"]
KEY_NAMES = {"scaling": "scaling", "model": "model", "layout": "layout", "gpus": "GPUs",
             "n_experts": "experts", "top_k": "top-k", "tokens_per_gpu": "tokens/GPU",
             "global_tokens": "global tokens", "args": "args", "mode": "mode",
             "d_model": "d_model", "n_layers": "layers", "expert_ffn_dim": "expert FFN",
             "budget_kind": "budget in", "budget": "budget"}
AXIS_PLOTS = [("gpus", "scaling.png", "GPUs (ranks)"), ("n_experts", "experts.png", "experts"),
              ("top_k", "topk.png", "top-k"), ("tokens_per_gpu", "tokens.png", "tokens per GPU")]
PLOT_FILES = ["scaling.png", "breakdown.png", "memory.png", "experts.png", "topk.png",
              "tokens.png", "loss.png", "plots.json"]
TOK_S_GPU = "document tokens/s per GPU"


def num(r, k):
    try:
        return float(r[k])
    except (KeyError, ValueError, TypeError):
        return float("nan")


def ok_rows(csv_path):
    rows = [r for r in read_csv(csv_path).values() if r["status"] == "ok"]
    fill_args(rows, os.path.dirname(os.path.abspath(csv_path)))
    return rows


def fill_args(rows, src_dir):
    """Rows of a CSV from before the args column: their args from the sweep file recorded in
    sweep.json where it still gives their keys, else 'args#HASH' from the key itself."""
    legacy = [r for r in rows if not r["args"] and re.search(r"_a[0-9a-f]{8}$", r["key"])]
    if not legacy:
        return
    known = {}
    try:
        with open(os.path.join(src_dir, "sweep.json")) as f:
            sweep_file = json.load(f).get("sweep_file") or ""
        path = sweep_file if os.path.isabs(sweep_file) else os.path.join(ROOT, sweep_file)
        if os.path.isfile(path):
            known = {p["key"]: " ".join(shlex.quote(x) for x in p["args"])
                     for p in read_sweep(path)[1]}
    except (OSError, ValueError, AttributeError, SweepError):
        pass
    for r in legacy:
        r["args"] = known.get(r["key"]) or "args#" + r["key"][-8:]


def line_key(axis, r):
    drop = {axis}
    if axis == "gpus":
        drop.add("global_tokens" if r["scaling"] == "weak" else "tokens_per_gpu")
    if axis == "tokens_per_gpu":
        drop.add("global_tokens")
    return tuple((c, r[c]) for c in KEY_COLS if c not in drop)


def natural(values):
    """Sort key: numbers as numbers (8 before 16), the rest as text."""
    return tuple((0, int(v), "") if str(v).isdigit() else (1, 0, str(v)) for v in values)


def key_value(c, v):
    if c == "args":
        return "none" if v == "" else v
    if c in MODEL_AXES and str(v) in ("", "0"):
        return "config's"
    return str(v)


def is_default(c, v):
    """A key value every point of an older sweep has: said nowhere unless it tells lines apart."""
    return str(v) in ("", KEY_DEFAULTS.get(c, ""))


def plot_lines(rows):
    """The lines of each axis plot: {png: {"axis", "lines": [(key dict, rows by axis)],
    "varying": the key columns that tell its lines apart, "fixed": the ones they share}}. A
    line is a group of 2+ points whose keys differ only in the axis."""
    out = {}
    for axis, fname, _ in AXIS_PLOTS:
        groups = {}
        for r in rows:
            groups.setdefault(line_key(axis, r), []).append(r)
        lines = []
        for k, g in sorted(groups.items(), key=lambda kv: natural([v for _, v in kv[0]])):
            if len({r[axis] for r in g}) < 2:
                continue
            lines.append((dict(k), sorted(g, key=lambda r: int(r[axis]))))
        if not lines:
            continue
        cols = [c for c in KEY_COLS if any(c in kd for kd, _ in lines)]
        varying = [c for c in cols if len({kd.get(c) for kd, _ in lines}) > 1]
        fixed = {c: lines[0][0][c] for c in cols if c not in varying}
        out[fname] = {"axis": axis, "lines": lines, "varying": varying, "fixed": fixed}
    return out


def budget_text(kind, budget):
    """A budget for people: 262144 tokens as 256K tokens, 3e12 FLOPs as 3e+12 FLOPs."""
    b = int(budget)
    if kind == "tokens":
        for n, suffix in ((1048576, "M"), (1024, "K")):
            if b >= n and b % n == 0:
                return f"{b // n}{suffix} tokens"
        return f"{b} tokens"
    return f"{b:.3g} FLOPs"


def loss_spec(rows):
    """The loss plot's series: the ok loss points grouped by every key column but the budget
    (the compute axis), each series sorted by the FLOPs spent; "varying"/"fixed" as in
    plot_lines; "best": the point of least held-out loss of each budget, {(kind, budget): row}.
    None when no loss point has a finite held-out loss."""
    lrows = [r for r in rows if r["mode"] == "loss" and math.isfinite(num(r, "eval_loss"))
             and math.isfinite(num(r, "flops"))]
    if not lrows:
        return None
    groups = {}
    for r in lrows:
        groups.setdefault(tuple((c, r[c]) for c in KEY_COLS if c != "budget"), []).append(r)
    lines = [(dict(k), sorted(g, key=lambda r: num(r, "flops")))
             for k, g in sorted(groups.items(), key=lambda kv: natural([v for _, v in kv[0]]))]
    cols = [c for c in KEY_COLS if c != "budget"]
    varying = [c for c in cols if len({kd[c] for kd, _ in lines}) > 1]
    fixed = {c: lines[0][0][c] for c in cols if c not in varying}
    best = {}
    for r in lrows:
        b = (r["budget_kind"], int(r["budget"]))
        if b not in best or num(r, "eval_loss") < num(best[b], "eval_loss"):
            best[b] = r
    return {"axis": "flops", "lines": lines, "varying": varying, "fixed": fixed,
            "best": dict(sorted(best.items()))}


def line_label(kd, varying):
    """A line's legend entry: the key columns that tell the plot's lines apart (all of its key
    for a plot of one line)."""
    cols = varying or [c for c in KEY_COLS if c in kd and not is_default(c, kd[c])]
    return ", ".join(f"{KEY_NAMES[c]} {key_value(c, kd[c])}" for c in cols)


def legend_title(spec):
    if not spec["varying"]:
        return "line: " + ", ".join(KEY_NAMES[c] for c, v in spec["fixed"].items()
                                    if not is_default(c, v))
    return "a line per " + ", ".join(KEY_NAMES[c] for c in spec["varying"])


def shared_caption(spec):
    """What every line of a plot shares (the rest of the line key), for its heading."""
    if not spec["varying"]:
        return ""
    return "every line: " + "; ".join(f"{KEY_NAMES[c]} {key_value(c, v)}"
                                      for c, v in spec["fixed"].items()
                                      if not is_default(c, v))


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


def check_plot_dir(out_dir, csv_path, force, flag):
    """Plots go to the CSV's own directory (the sweep's, whose plots `run` rewrites) freely;
    elsewhere they replace no file of PLOT_FILES without --force."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SweepError(f"{flag} {out_dir}: exists and is not a directory")
    own = os.path.realpath(os.path.dirname(os.path.abspath(csv_path)))
    if force or os.path.realpath(out_dir) == own:
        return
    there = [f for f in PLOT_FILES if os.path.lexists(os.path.join(out_dir, f))]
    if there:
        raise SweepError(f"{flag} {out_dir}: {', '.join(there)} already there: pass --force to "
                         "replace them (plots in the CSV's own directory are rewritten freely)")


def plot(csv_path, out_dir):
    """PNG plots of the CSV's ok rows, and plots.json: each PNG's series and point counts, and
    for the axis plots their lines (label, key, x values, points)."""
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
    specs = plot_lines(rows)
    tok_title = TOK_S_GPU if all(r["padding"] != "" for r in rows) else \
        "tokens/s per GPU (padding included)"

    def describe(spec):
        return {"series": len(spec["lines"]), "points": sum(len(g) for _, g in spec["lines"]),
                "axis": spec["axis"], "line_key": [KEY_NAMES[c] for c in spec["varying"]],
                "lines": [{"label": line_label(kd, spec["varying"]), "key": kd,
                           "x": [int(r[spec["axis"]]) for r in g],
                           "points": [r["key"] for r in g]} for kd, g in spec["lines"]]}

    def finish(fig, axs, spec):
        # Below the axes, where it hides no point; the heading says what the lines share.
        handles, labels = axs[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
                   title=legend_title(spec), title_fontsize=8, ncol=1 if len(labels) < 6 else 2)
        cap = shared_caption(spec)
        if cap:
            fig.suptitle("\n".join(textwrap.wrap(cap, 160)), fontsize=8, y=1.0)

    # Scaling: tok/s/GPU and MFU vs GPUs, the ideal (flat at the smallest count) and efficiency.
    spec = specs.get("scaling.png")
    if spec:
        fig, axs = plt.subplots(1, 3, figsize=(16, 4.6))
        for kd, g in spec["lines"]:
            xs = [int(r["gpus"]) for r in g]
            tpg = [num(r, "tok_s_per_gpu") for r in g]
            line, = axs[0].plot(xs, tpg, "o-", label=line_label(kd, spec["varying"]))
            axs[0].plot([xs[0], xs[-1]], [tpg[0], tpg[0]], ":", color=line.get_color(), lw=1)
            axs[1].plot(xs, [100 * num(r, "mfu") for r in g], "o-", color=line.get_color())
            axs[2].plot(xs, [100 * v / tpg[0] for v in tpg], "o-", color=line.get_color())
        axs[2].axhline(100, ls=":", color="gray", lw=1, label="ideal")
        for ax, t in zip(axs, (f"{tok_title} (dotted: ideal)", mfu_title(rows),
                               "scaling efficiency (%)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs (ranks)")
            ax.set_title(t)
            ax.grid(alpha=0.3)
        finish(fig, axs, spec)
        save_fig(fig, os.path.join(out_dir, "scaling.png"))
        plt.close(fig)
        made["scaling.png"] = describe(spec)

    # Time breakdown per point: stacked shares of the profiled step by op family (+ idle); only
    # points of `bench step` have a profile (a loss point's training run does not).
    profiled = [r for r in rows if r["idle_share"] != ""]
    if profiled:
        rows_sorted = sort_rows(profiled)
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
        ax.set_xticklabels(short_labels(rows_sorted), rotation=70, ha="right", fontsize=7)
        ax.set_ylabel("% of the profiled step")
        ax.set_title("where the step's time goes (op families)"
                     + ("\n" + args_legend(rows_sorted) if args_tags(rows_sorted) else ""),
                     fontsize=10)
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
            ax.set_xticklabels(short_labels(mem_rows), rotation=70, ha="right", fontsize=7)
            kinds = sorted({r["mem_kind"] for r in mem_rows})
            ax.set_ylabel("MiB per rank (" + ", ".join(kinds) + ")")
            ax.set_title("memory per rank" + ("\n" + args_legend(mem_rows)
                                              if args_tags(mem_rows) else ""), fontsize=10)
            ax.legend(fontsize=7)
            save_fig(fig, os.path.join(out_dir, "memory.png"))
            plt.close(fig)
            made["memory.png"] = {"series": 2, "points": len(mem_rows)}

    # Expert count, top-k and tokens-per-GPU sweeps: tok/s/GPU and MFU along each axis.
    for axis, fname, xlabel in AXIS_PLOTS[1:]:
        spec = specs.get(fname)
        if not spec:
            continue
        fig, axs = plt.subplots(1, 2, figsize=(12, 4.4))
        for kd, g in spec["lines"]:
            xs = [int(r[axis]) for r in g]
            line, = axs[0].plot(xs, [num(r, "tok_s_per_gpu") for r in g], "o-",
                                label=line_label(kd, spec["varying"]))
            axs[1].plot(xs, [100 * num(r, "mfu") for r in g], "o-", color=line.get_color())
        for ax, t in zip(axs, (tok_title, mfu_title(rows))):
            if axis != "top_k":
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_title(t if t.startswith("MFU (%):") else f"{t} vs {xlabel}")
            ax.grid(alpha=0.3)
        finish(fig, axs, spec)
        save_fig(fig, os.path.join(out_dir, fname))
        plt.close(fig)
        made[fname] = describe(spec)

    spec = loss_spec(rows)
    if spec:
        plot_loss(plt, spec, out_dir, finish)
        made["loss.png"] = describe_loss(spec)

    for stale in PLOT_FILES[:-1]:
        if stale not in made and os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    write_atomic(os.path.join(out_dir, "plots.json"), json.dumps(made, indent=1) + "\n")
    log(f"plots in {out_dir}: " + ", ".join(f"{k} ({v['series']} series)" for k, v in made.items()))
    return made


def describe_loss(spec):
    """loss.png in plots.json: its series (label, key, budgets, FLOPs, held-out losses, points)
    and the best point of each budget."""
    return {"series": len(spec["lines"]), "points": sum(len(g) for _, g in spec["lines"]),
            "axis": "flops", "line_key": [KEY_NAMES[c] for c in spec["varying"]],
            "lines": [{"label": line_label(kd, spec["varying"]), "key": kd,
                       "budget": [int(r["budget"]) for r in g],
                       "x": [num(r, "flops") for r in g],
                       "y": [num(r, "eval_loss") for r in g],
                       "points": [r["key"] for r in g]} for kd, g in spec["lines"]],
            "best": [{"budget_kind": kind, "budget": b, "point": r["key"],
                      "eval_loss": num(r, "eval_loss")}
                     for (kind, b), r in spec["best"].items()]}


def plot_loss(plt, spec, out_dir, finish):
    """loss.png: held-out loss against the FLOPs spent, a line per series (its points differ in
    the budget alone), and against the active parameters, a colour per budget (points not
    joined: they differ in more than one key); a star marks each budget's best point."""
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.8))
    color = {}
    for kd, g in spec["lines"]:
        line, = axs[0].plot([num(r, "flops") for r in g], [num(r, "eval_loss") for r in g], "o-",
                            label=line_label(kd, spec["varying"]))
        for r in g:
            color[r["key"]] = line.get_color()
    cmap = plt.get_cmap("viridis")
    budgets = list(spec["best"])
    for i, b in enumerate(budgets):
        pts = [r for _, g in spec["lines"] for r in g
               if (r["budget_kind"], int(r["budget"])) == b]
        c = cmap(i / max(1, len(budgets) - 1) * 0.85)
        axs[1].plot([num(r, "params_active") for r in pts], [num(r, "eval_loss") for r in pts],
                    "o", color=c, label=budget_text(*b))
    for i, (b, r) in enumerate(spec["best"].items()):
        c = cmap(i / max(1, len(budgets) - 1) * 0.85)
        axs[0].plot([num(r, "flops")], [num(r, "eval_loss")], "*", ms=18, mfc=color[r["key"]],
                    mec="black", zorder=5, label="best of its budget" if i == 0 else None)
        axs[1].plot([num(r, "params_active")], [num(r, "eval_loss")], "*", ms=18, mfc=c,
                    mec="black", zorder=5)
    axs[0].set_xscale("log")
    axs[0].set_xlabel("model FLOPs spent (hotpath's count, document tokens)")
    axs[0].set_title("held-out loss vs compute (a line per series, over its budgets)", fontsize=10)
    axs[1].set_xscale("log")
    axs[1].set_xlabel("active parameters")
    axs[1].set_title("held-out loss vs active parameters (a colour per budget)", fontsize=10)
    axs[1].legend(fontsize=7, title="budget", title_fontsize=7)
    for ax in axs:
        ax.set_ylabel("held-out loss (final evaluation)")
        ax.grid(alpha=0.3, which="both")
    finish(fig, axs, spec)
    save_fig(fig, os.path.join(out_dir, "loss.png"))
    plt.close(fig)


def loss_table(rows):
    """The loss points as Markdown table lines, by budget and then held-out loss; ★ marks the
    best of each budget. Failed points are listed with their error."""
    ok = [r for r in rows if r["mode"] == "loss" and r["status"] == "ok"]
    bad = [r for r in rows if r["mode"] == "loss" and r["status"] != "ok"]
    spec = loss_spec(ok)
    best = {r["key"] for r in spec["best"].values()} if spec else set()
    out = ["| model | layout | GPUs | experts | top-k | d_model | layers | budget | steps | "
           "tokens | FLOPs | params total | params active | train loss | held-out loss | best |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for r in sorted(ok, key=lambda r: (r["budget_kind"], int(r["budget"]), num(r, "eval_loss"))):
        out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                   f"{r['top_k']} | {key_value('d_model', r['d_model'])} | "
                   f"{key_value('n_layers', r['n_layers'])} | "
                   f"{budget_text(r['budget_kind'], r['budget'])} | {r['steps']} | "
                   f"{r['tokens']} | {num(r, 'flops'):.3e} | {r['params_total']} | "
                   f"{r['params_active']} | {num(r, 'train_loss'):.4f} | "
                   f"{num(r, 'eval_loss'):.4f} | {'★' if r['key'] in best else ''} |")
    for r in bad:
        out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                   f"{r['top_k']} | {key_value('d_model', r['d_model'])} | "
                   f"{key_value('n_layers', r['n_layers'])} | "
                   f"{budget_text(r['budget_kind'], r['budget'])} | failed: "
                   f"{r['error'].replace('|', '/')} | | | | | | | |")
    return out


def cmd_table(a):
    if not os.path.isfile(a.csv):
        raise SweepError(f"{a.csv}: no such results CSV")
    rows = list(read_csv(a.csv).values())
    if not any(r["mode"] == "loss" for r in rows):
        raise SweepError(f"{a.csv}: no loss points (a sweep of mode = loss writes them)")
    print("\n".join(loss_table(rows)))
    return 0


def mfu_title(rows):
    if rows and all(num(r, "mfu") == 0 for r in rows):
        return "MFU (%): not measured on the CPU backend"
    return "MFU (%)"


def args_tags(rows):
    """{args: a, b, ...} in first-seen order when the rows' args differ, else {}."""
    tags = {}
    for r in rows:
        tags.setdefault(r["args"], chr(ord("a") + len(tags) % 26))
    return tags if len(tags) > 1 else {}


def short_labels(rows):
    """A tick label per point: its key columns, and its args' tag where the rows' args differ."""
    tags = args_tags(rows)
    out = []
    for r in rows:
        s = f"{r['model']} {r['layout']} g{r['gpus']} E{r['n_experts']} k{r['top_k']}"
        s += f" T{int(r['tokens_per_gpu']) // 1024}K" if int(r["tokens_per_gpu"]) >= 1024 \
            else f" T{r['tokens_per_gpu']}"
        out.append(s + (f" args:{tags[r['args']]}" if tags else ""))
    return out


def args_legend(rows):
    """The args tags of short_labels spelled out, for a plot's heading ('' when none)."""
    return "\n".join(f"args:{t} = {key_value('args', a)}" for a, t in args_tags(rows).items())


def cmd_plot(a):
    out_dir = a.out or os.path.dirname(os.path.abspath(a.csv))
    if not os.path.isfile(a.csv):
        raise SweepError(f"{a.csv}: no such results CSV")
    check_plot_dir(out_dir, a.csv, a.force, "--out")
    plot(a.csv, out_dir)
    return 0


# ---- report -----------------------------------------------------------------------------------

# The first line of every report: an existing file in the CSV's directory that starts with it is
# a report of this runner, which `report` replaces without --force.
REPORT_MARK = ("<!-- Written by examples/scaling/sweep.py report; edits here are lost when it "
               "runs again. -->")
# A line of a report below which the text is not the runner's: `report` keeps it (from this line
# to the end) when it writes the report again, so a page can hold measurements of other sweeps.
KEEP_MARK = ("<!-- Below this line: not written by sweep.py report, which keeps it when it "
             "writes the page again. -->")


def check_report_path(md_path, csv_path, force):
    if os.path.realpath(md_path) == os.path.realpath(csv_path):
        raise SweepError(f"--md {md_path}: that is the results CSV")
    if os.path.isdir(md_path):
        raise SweepError(f"--md {md_path}: is a directory, expected the Markdown file to write")
    if not os.path.lexists(md_path) or force:
        return
    own = os.path.realpath(os.path.dirname(csv_path)) == \
        os.path.realpath(os.path.dirname(md_path))
    first = ""
    try:
        with open(md_path, errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        pass
    if own and first == REPORT_MARK:
        return
    raise SweepError(f"--md {md_path} exists" + ("" if own else " outside the CSV's directory")
                     + (" and is not a report of this runner" if first != REPORT_MARK else "")
                     + ": pass --force to replace it, or choose another --md")


def kept_part(md_path):
    """The text of an existing report from its KEEP_MARK line to the end, or ""."""
    try:
        with open(md_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    at = text.find("\n" + KEEP_MARK)
    return text[at + 1:] if at >= 0 else ""


def rel_to_root(path):
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def cmd_report(a):
    csv_path = os.path.abspath(a.csv)
    if not os.path.isfile(csv_path):
        raise SweepError(f"{a.csv}: no such results CSV")
    src_dir = os.path.dirname(csv_path)
    md_path = os.path.abspath(a.md) if a.md else os.path.join(src_dir, "report.md")
    md_dir = os.path.dirname(md_path)
    img_dir = os.path.abspath(a.images) if a.images else src_dir
    check_report_path(md_path, csv_path, a.force)
    check_plot_dir(img_dir, csv_path, a.force, "--images")
    rows = list(read_csv(csv_path).values())
    made = plot(csv_path, img_dir)
    fill_args(rows, src_dir)
    meta = {}
    if os.path.exists(os.path.join(src_dir, "sweep.json")):
        try:
            with open(os.path.join(src_dir, "sweep.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] != "ok"]
    backends = sorted({r["backend"] for r in ok})
    cmd = ["python3", "examples/scaling/sweep.py", "report", rel_to_root(csv_path)]
    if a.md:
        cmd += ["--md", rel_to_root(md_path)]
    if a.images:
        cmd += ["--images", rel_to_root(img_dir)]
    if os.path.realpath(md_dir) != os.path.realpath(src_dir) or \
            os.path.realpath(img_dir) != os.path.realpath(src_dir):
        cmd.append("--force")
    out = [REPORT_MARK, ""]
    title = meta.get("title") or meta.get("name") or "Scaling"
    out.append(f"# Scaling experiments: {title}\n")
    out.append("Generated by `" + " ".join(shlex.quote(c) for c in cmd) + "`"
               + (f" (sweep file `{meta['sweep_file']}`)" if meta.get("sweep_file") else "")
               + f": {len(ok)} points measured, {len(bad)} failed"
               + (f"; backend {', '.join(backends)}" if backends else "") + ".\n")
    legacy = any(r["padding"] == "" for r in ok)
    tok_h = "tok/s" if legacy else "doc tok/s"
    lossrows = [r for r in ok if r["mode"] == "loss"]
    if lossrows:
        out.append("A loss point trains with `hotpath train` on its budget: `budget_tokens` over "
                   "the tokens of a step (batch_tokens) gives its steps, or `budget_flops` over "
                   "6 x active parameters x batch_tokens (rounded; attention is not in this "
                   "estimate). After the last step the run evaluates the held-out data "
                   "(`eval_data`, its first `eval_batches` batches): that final `eval_loss` is "
                   "the point's held-out loss. FLOPs are the sum of the steps' `flops` in the "
                   "run's JSONL (hotpath's model FLOPs on document tokens, the count MFU uses); "
                   "parameters are hotpath's own count (`hotpath train --dry-run`). Its "
                   "throughput columns are medians over the training steps after the first that "
                   "did not evaluate.\n")
    bench_text = ("Each point of mode throughput is one `hotpath bench step` run: the median of "
                  "its timed steps (tok/s, ms, syncs), and the time breakdown from as many "
                  "more steps profiled back to back (busy: their busy time over their wall "
                  "time). " if any(r["mode"] != "loss" for r in ok) or not ok
                  else "")
    out.append(bench_text +
               f"{tok_h} counts document tokens per second, the positions a step pads to fill its "
               "rows left out; padding is the padded fraction of the step's positions. "
               f"{tok_h}/GPU is the job's {tok_h} over its ranks; MFU is per GPU against "
               "the bf16 peak (0 on the CPU backend); busy is the device's busy fraction (1 on the "
               "CPU backend, which computes on the calling thread); memory is the largest rank's "
               "(`device_peak_allocated`: the caching allocator's peak on the GPU; "
               "`host_peak_rss`: the process's peak resident set on the CPU)."
               + (" A padding of – marks a point measured before padding was recorded: its tok/s "
                  "counts every position, padding included." if legacy else "") + "\n")
    if any(m.get("series") for m in made.values()):
        out.append("## Plots\n")
        captions = {"scaling.png": "doc tok/s per GPU, MFU and scaling efficiency vs GPUs "
                                   "(dotted: ideal, flat at the smallest GPU count)",
                    "breakdown.png": "time breakdown per point by op family",
                    "memory.png": "memory per rank",
                    "experts.png": "expert-count sweep", "topk.png": "top-k sweep",
                    "tokens.png": "tokens-per-GPU sweep",
                    "loss.png": "held-out loss vs compute (★ the best of each budget)"}
        for name in ("loss.png", "scaling.png", "experts.png", "topk.png", "tokens.png",
                     "breakdown.png", "memory.png"):
            if name in made:
                rel = os.path.relpath(os.path.join(img_dir, name), md_dir)
                cap = captions[name]
                if made[name].get("line_key"):
                    cap += "; a line per " + ", ".join(made[name]["line_key"])
                out.append(f"![{cap}]({rel})\n")
    show_args = len({r["args"] for r in ok}) > 1
    if lossrows or any(r["mode"] == "loss" for r in bad):
        out.append("## Held-out loss against compute\n")
        out.append("★: the least held-out loss of its budget.\n")
        out += loss_table(rows)
        out.append("")
    if ok:
        out.append("## Throughput\n")
        extra = [c for c in ("d_model", "n_layers", "expert_ffn_dim", "budget")
                 if len({r[c] for r in ok}) > 1]
        out.append("| model | layout | GPUs | dp×ep | experts | top-k | tokens/GPU | "
                   + "".join(f"{KEY_NAMES[c]} | " for c in extra)
                   + ("args | " if show_args else "")
                   + f"ms/step | {tok_h} | padding | {tok_h}/GPU | MFU | busy | syncs/step "
                   "| memory/rank MiB |")
        out.append("|---|---|---:|---|---:|---:|---:|" + "---:|" * len(extra)
                   + ("---|" if show_args else "") + "---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sort_rows(ok):
            pad = "–" if r["padding"] == "" else f"{100 * num(r, 'padding'):.1f}%"
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['dp']}×{r['ep']} | "
                       f"{r['n_experts']} | {r['top_k']} | {r['tokens_per_gpu']} | "
                       + "".join(f"{budget_text(r['budget_kind'], r['budget'])} | "
                                 if c == "budget" else f"{key_value(c, r[c])} | " for c in extra)
                       + (f"`{key_value('args', r['args'])}` | " if show_args else "")
                       + f"{cell(r, 'ms_per_step', '.1f')} | {cell(r, 'tok_s', '.0f')} | "
                       f"{pad} | {cell(r, 'tok_s_per_gpu', '.0f')} | "
                       f"{cell(r, 'mfu', '.1f', 100, '%')} | "
                       f"{cell(r, 'gpu_busy', '.0f', 100, '%')} | "
                       f"{cell(r, 'syncs_per_step', '.0f')} | "
                       f"{cell(r, 'mem_per_rank_max_mib', '.0f')} |")
        out.append("")
    prof = [r for r in ok if r["idle_share"] != ""]
    if prof:
        out.append("## Where the time goes (% of the profiled step)\n")
        fams = [f for f in FAMILIES if any(num(r, f"family_{f}_share") > 0 for r in prof)]
        out.append("| model | layout | GPUs | experts | top-k | tokens/GPU | "
                   + ("args | " if show_args else "")
                   + " | ".join(f.replace("_", " ") for f in fams) + " | idle |")
        out.append("|---|---|---:|---:|---:|---:|" + ("---|" if show_args else "")
                   + "---:|" * (len(fams) + 1))
        for r in sort_rows(prof):
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                       f"{r['top_k']} | {r['tokens_per_gpu']} | "
                       + (f"`{key_value('args', r['args'])}` | " if show_args else "")
                       + " | ".join(f"{100 * num(r, f'family_{f}_share'):.1f}" for f in fams)
                       + f" | {100 * num(r, 'idle_share'):.1f} |")
        out.append("")
        out.append("By phase:\n")
        out.append("| model | layout | GPUs | experts | top-k | tokens/GPU | "
                   + ("args | " if show_args else "")
                   + " | ".join(p.replace("_", " ") for p in PHASES) + " |")
        out.append("|---|---|---:|---:|---:|---:|" + ("---|" if show_args else "")
                   + "---:|" * len(PHASES))
        for r in sort_rows(prof):
            out.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['n_experts']} | "
                       f"{r['top_k']} | {r['tokens_per_gpu']} | "
                       + (f"`{key_value('args', r['args'])}` | " if show_args else "")
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
    text = "\n".join(out) + "\n"
    kept = kept_part(md_path)
    if kept:
        text += "\n" + kept
    write_atomic(md_path, text)
    log(f"wrote {md_path} ({len(ok)} points, {len(made)} plots)")
    return 0


def cell(r, k, spec, scale=1, suffix=""):
    """A number of the table, or – where the point has none (a loss point has no memory)."""
    v = num(r, k)
    return "–" if math.isnan(v) else f"{scale * v:{spec}}{suffix}"


def sort_rows(rows):
    return sorted(rows, key=lambda r: (r["model"], r["layout"], int(r["n_experts"]),
                                       int(r["top_k"]), int(r["tokens_per_gpu"]), int(r["gpus"]),
                                       int(r["d_model"] or 0), int(r["n_layers"] or 0),
                                       int(r["expert_ffn_dim"] or 0), int(r["budget"] or 0),
                                       r["args"]))


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
    p.add_argument("--force", action="store_true",
                   help="replace plots in an --out directory other than the CSV's")
    p = sub.add_parser("report", help="Markdown tables and plots from a results CSV")
    p.add_argument("csv")
    p.add_argument("--md", help="the Markdown file to write (default: report.md next to the CSV)")
    p.add_argument("--images", help="directory for the PNGs (default: the CSV's)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --md that is not an earlier report in the CSV's "
                        "directory, and plots in an --images directory other than the CSV's")
    p = sub.add_parser("table", help="the loss points of a results CSV as a Markdown table")
    p.add_argument("csv")
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
                "table": cmd_table, "submit": cmd_submit}[a.cmd](a)
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sweep: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"sweep: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2 if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
                                errno.ENOTDIR, errno.EISDIR) else 1


LAUNCHER_OVERRIDE = None

if __name__ == "__main__":
    sys.exit(main())
