#!/usr/bin/env python3
"""The `slurm` tests: real jobs on the single-node cluster of tests/slurm/cluster.sh.

  pmix HOTPATH MPIEXEC WORK    srun --mpi=pmix -n 2 tiny-moe: the same losses and gradient norms,
                               step for step, as mpirun -np 2
  plain HOTPATH WORK           srun -n 2 without MPI: every rank finds its place from SLURM_* and
                               the CPU backend refuses, exit status 2, saying how to launch
  requeue HOTPATH MPIEXEC WORK sbatch of launch/scripts/sbatch_cpu_example.sh with
                               --signal=B:USR1@110 --requeue: signalled, saves, exits 75, is
                               requeued, resumes (SLURM_RESTART_COUNT unset, then 1) and ends with
                               the losses of an uninterrupted run
  sweep HOTPATH WORK           examples/scaling/sweep.py with the srun and sbatch launchers (a
                               2-rank point each), and `submit` (the sweep as one job): every row
                               in the CSV with the JSON of a 2-rank job

The cluster is found through SLURM_CONF (tests/run.sh exports it) or HP_SLURM_DIR/slurm.conf.
Without one the test exits 77 (skipped) and says why. Every command has a time limit.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["train", "--config", os.path.join(ROOT, "examples", "configs", "tiny-moe.ini"),
        "--seq_len=128", "--batch_tokens=1024", "--log_every=1"]
sys.path.insert(0, os.path.join(ROOT, "tests", "tools"))
from checks import Checks  # noqa: E402

_checks = Checks("check_slurm")
check, done = _checks.check, _checks.done


def skip(why):
    print(f"[check_slurm] SKIPPED: {why}", flush=True)
    sys.exit(77)


def cluster_env():
    """The environment for Slurm commands, or a skip saying why there is no cluster."""
    env = dict(os.environ)
    conf = env.get("SLURM_CONF")
    if not conf and env.get("HP_SLURM_DIR"):
        conf = os.path.join(env["HP_SLURM_DIR"], "slurm.conf")
    if not conf or not os.path.isfile(conf):
        skip("no Slurm cluster (SLURM_CONF unset or missing); tests/run.sh starts one as root, "
             "or: tests/slurm/cluster.sh start DIR && export SLURM_CONF=DIR/slurm.conf")
    env["SLURM_CONF"] = conf
    if not shutil.which("srun"):
        skip("srun not found (Debian: slurm-client)")
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                           timeout=15)
    except subprocess.TimeoutExpired:
        skip(f"sinfo did not answer in 15 s (cluster of {conf} down?)")
    states = r.stdout.split()
    if r.returncode != 0 or not any(s.rstrip("*") in ("idle", "mixed", "allocated")
                                    for s in states):
        skip(f"the cluster of {conf} has no usable node: {(r.stdout + r.stderr).strip()[:200]}")
    for k in list(env):
        # A test run inside a Slurm job must not hand its own allocation to the new job steps.
        if k.startswith("SLURM_") and k != "SLURM_CONF":
            del env[k]
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(cmd, env, timeout, log):
    print("$", " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        with open(log, "w") as f:
            f.write(out)
        check(False, " ".join(cmd[:3]), f"did not end within {timeout} s")
        return None
    with open(log, "w") as f:
        f.write(r.stdout + r.stderr)
    return r


def metrics(path):
    out = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            out[j["step"]] = (j["loss"], j["grad_norm"], j.get("aux_loss"))
    return out


def cmd_pmix(hotpath, mpiexec, work):
    env = cluster_env()
    os.makedirs(work, exist_ok=True)
    steps = 4
    a, b = os.path.join(work, "srun.jsonl"), os.path.join(work, "mpirun.jsonl")
    for p in (a, b):
        if os.path.exists(p):
            os.remove(p)
    r = run(["srun", "--mpi=pmix", "-n", "2", "--kill-on-bad-exit=1", hotpath, *TINY,
             f"--steps={steps}", "--ep_size=2", f"--metrics_path={a}"], env, 180,
            os.path.join(work, "srun.log"))
    if r is not None:
        check(r.returncode == 0, "srun --mpi=pmix exited", r.returncode, (r.stdout + r.stderr)[-800:])
        check("srun-pmix" in r.stdout + r.stderr or "pmix" in (r.stdout + r.stderr).lower(),
              "the srun run does not say it was launched through PMIx")
    mflags = ["--oversubscribe", "--bind-to", "none"] + (["--allow-run-as-root"]
                                                       if os.geteuid() == 0 else [])
    menv = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMIX_"))}
    menv.setdefault("OMP_NUM_THREADS", "1")
    r = run([mpiexec, "-np", "2", *mflags, hotpath, *TINY, f"--steps={steps}", "--ep_size=2",
             f"--metrics_path={b}"], menv, 180, os.path.join(work, "mpirun.log"))
    if r is not None:
        check(r.returncode == 0, "mpirun exited", r.returncode, (r.stdout + r.stderr)[-800:])
    ma, mb = metrics(a), metrics(b)
    check(sorted(ma) == list(range(1, steps + 1)), "srun steps", sorted(ma))
    check(sorted(mb) == list(range(1, steps + 1)), "mpirun steps", sorted(mb))
    for s in sorted(mb):
        check(ma.get(s) == mb[s], "step", s, "srun", ma.get(s), "mpirun", mb[s])
    return done(f"srun --mpi=pmix -n 2 = mpirun -np 2, {steps} steps bitwise")


def cmd_plain(hotpath, work):
    env = cluster_env()
    os.makedirs(work, exist_ok=True)
    r = run(["srun", "-n", "2", hotpath, *TINY, "--steps=2"], env, 120,
            os.path.join(work, "plain.log"))
    if r is None:
        return done("")
    text = r.stdout + r.stderr
    check(r.returncode == 2, "srun -n 2 without MPI exited", r.returncode, "expected 2")
    for rank in (0, 1):
        check(f"rank {rank} of 2 (local {rank} of 2) via slurm-env" in text,
              f"rank {rank} does not report its place from SLURM_*:", text[-600:])
    check("the cpu backend moves tensors between ranks over MPI" in text and
          "srun --mpi=pmix" in text, "the refusal does not say how to launch:", text[-600:])
    check("step=" not in text, "a rank trained without MPI")
    return done("srun -n 2 without MPI: both ranks from SLURM_*, refused with exit 2")


# The requeued job: tiny-moe on 2 ranks, 60 steps. Its first start copies its activations over a
# slow simulated host link (the numbers do not change, the steps take about a second), so Slurm's
# signal, due 10 s after the start and sent within its next periodic check, lands mid-run; the
# second start runs at full speed.
REQUEUE_STEPS = 60
REQUEUE_ARGS = ["--seq_len=64", "--batch_tokens=256", "--n_layers=2", "--log_every=10",
                f"--steps={REQUEUE_STEPS}"]
SLOW_FIRST_START = "--offload=double --sim_link_gbps=0.0002"


def job_state(job, env):
    r = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                       timeout=15)
    fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
    return fields


def cmd_requeue(hotpath, mpiexec, work):
    env = cluster_env()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    config = os.path.join(ROOT, "examples", "configs", "tiny-moe.ini")
    script = os.path.join(ROOT, "launch", "scripts", "sbatch_cpu_example.sh")
    jenv = dict(env, HOTPATH=hotpath, CHECKPOINT_DIR=os.path.join(work, "ckpt"), METRICS_DIR=work,
                FIRST_START_ARGS=SLOW_FIRST_START)
    out = os.path.join(work, "job.out")
    r = run(["sbatch", "--parsable", "--signal=B:USR1@110", "--time=2", "--requeue",
             f"--output={out}", f"--chdir={ROOT}", script, config, *REQUEUE_ARGS], jenv, 30,
            os.path.join(work, "sbatch.log"))
    if r is None or not check(r.returncode == 0, "sbatch failed:", r.stderr[-500:]):
        return done("")
    job = r.stdout.strip().split(";")[0]
    print(f"[check_slurm] job {job} submitted; waiting for it to end (at most 400 s)", flush=True)
    # The reference meanwhile: the same 60 steps in one uninterrupted run.
    ref = os.path.join(work, "straight.jsonl")
    mflags = ["--oversubscribe", "--bind-to", "none"] + (["--allow-run-as-root"]
                                                       if os.geteuid() == 0 else [])
    menv = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMIX_"))}
    menv.setdefault("OMP_NUM_THREADS", "1")
    rr = run([mpiexec, "-np", "2", *mflags, hotpath, "train", "--config", config, *REQUEUE_ARGS,
              f"--metrics_path={ref}"], menv, 300, os.path.join(work, "straight.log"))
    check(rr is not None and rr.returncode == 0, "the uninterrupted run failed")
    deadline = time.time() + 400
    state = {}
    while time.time() < deadline:
        state = job_state(job, env)
        if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                     "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"):
            break
        time.sleep(2)
    else:
        subprocess.run(["scancel", job], env=env, timeout=15)
        check(False, f"job {job} did not end within 400 s; last state {state.get('JobState')}")
    text = open(out).read() if os.path.exists(out) else ""
    print(text[-4000:], flush=True)
    check(state.get("JobState") == "COMPLETED", "job state", state.get("JobState"),
          state.get("Reason"))
    starts = re.findall(r"start: SLURM_RESTART_COUNT=(\S+),", text)
    check(len(starts) >= 2 and starts[0] == "unset" and starts[1] == "1",
          "starts of the job (SLURM_RESTART_COUNT):", starts, "expected unset, then 1")
    check(int(state.get("Restarts", "0")) == len(starts) - 1, "Slurm counts",
          state.get("Restarts"), "restarts for", len(starts), "starts")
    check("signal USR1: passing it to the ranks" in text, "the script was not signalled")
    check("exit status 75" in text and "Exited with exit code 75" in text,
          "the ranks did not stop with status 75")
    check("requeueing job" in text, "the script did not requeue")
    check(re.search(r"resumed from .*step_0*(\d+)\.h5 at step", text) is not None,
          "the second start did not resume from the checkpoint")
    check(text.rstrip().endswith("ended: status 0"), "the last start did not end with status 0")
    # Losses: the starts' metrics, joined, are the uninterrupted run's, step for step.
    joined = {}
    for i in range(len(starts)):
        part = metrics(os.path.join(work, f"metrics-start{i}.jsonl"))
        check(part, "start", i, "wrote no metrics")
        check(not set(part) & set(joined), "starts overlap at steps", sorted(set(part) & set(joined)))
        joined.update(part)
    straight = metrics(ref)
    check(sorted(joined) == list(range(1, REQUEUE_STEPS + 1)), "steps of the requeued job",
          sorted(joined)[:3], "...", len(joined))
    check(sorted(straight) == list(range(1, REQUEUE_STEPS + 1)), "uninterrupted steps",
          len(straight))
    diff = [s for s in straight if joined.get(s) != straight[s]]
    check(not diff, "losses differ from the uninterrupted run at steps", diff[:10])
    first = metrics(os.path.join(work, "metrics-start0.jsonl"))
    return done(f"sbatch job signalled after step {max(first) if first else '?'}, saved, exited "
                f"75, requeued, resumed (starts: {', '.join(starts)}), {REQUEUE_STEPS} steps "
                "bitwise the uninterrupted run")


SWEEP_FILE = """
[sweep]
name = slurm
config = examples/configs/tiny-moe.ini
args = --seq_len=128 --log_every=1000 --n_layers=1
gpus = 2
top_k = 2
n_experts = 8
tokens_per_gpu = 256
bench_steps = 1
bench_warmup = 0
timeout_s = 240
env = OMP_NUM_THREADS=1

[series srun]
launcher = srun
layout = ep

[series sbatch]
launcher = sbatch
layout = dp
sbatch_args = --time=5
"""


def cmd_sweep(hotpath, work):
    env = cluster_env()
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    sweep_file = os.path.join(work, "slurm.ini")
    with open(sweep_file, "w") as f:
        f.write(SWEEP_FILE)
    out = os.path.join(work, "out")
    r = run([sys.executable, os.path.join(ROOT, "examples", "scaling", "sweep.py"), "run",
             sweep_file, "--out", out, "--hotpath", hotpath, "--no-plots"], env, 400,
            os.path.join(work, "sweep.log"))
    if r is None:
        return done("")
    print(r.stderr[-2000:], flush=True)
    check(r.returncode == 0, "the sweep exited", r.returncode)
    import csv
    with open(os.path.join(out, "results.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    check(sorted(row["launcher"] for row in rows) == ["sbatch", "srun"], "rows:",
          [(row["launcher"], row["status"], row["error"]) for row in rows])
    for row in rows:
        check(row["status"] == "ok", row["key"], row["status"], row["error"])
        jpath = os.path.join(out, "points", row["key"] + ".json")
        if not check(os.path.exists(jpath), "no JSON for", row["key"]):
            continue
        with open(jpath) as f:
            j = json.load(f)
        check(j["world"] == 2 and len(j["memory"]["per_rank_bytes"]) == 2, row["key"], "world",
              j["world"], "memory of", len(j["memory"]["per_rank_bytes"]), "ranks")
        check(float(row["tok_s"]) == j["tokens_per_s"], row["key"], "tok_s", row["tok_s"],
              j["tokens_per_s"])
        with open(os.path.join(out, "points", row["key"] + ".log")) as f:
            cmdline = f.readline()
        want = "sbatch --wait" if row["launcher"] == "sbatch" else "srun --mpi=pmix"
        check(cmdline.startswith("$ " + want), row["key"], "ran", cmdline.strip()[:120])
    # The whole sweep as one job (`submit`): the runner inside the allocation, points by srun.
    out2 = os.path.join(work, "submitted")
    r = run([sys.executable, os.path.join(ROOT, "examples", "scaling", "sweep.py"), "submit",
             sweep_file, "--out", out2, "--hotpath", hotpath, "--sbatch-args=--time=5"], env, 60,
            os.path.join(work, "submit.log"))
    if r is not None and check(r.returncode == 0, "submit failed:", r.stderr[-500:]):
        job = r.stdout.strip().split(";")[0]
        deadline, state = time.time() + 300, {}
        while time.time() < deadline:
            state = job_state(job, env)
            if state.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING",
                                             "COMPLETING"):
                break
            time.sleep(1)
        check(state.get("JobState") == "COMPLETED", "the sweep job", job, "ended",
              state.get("JobState"))
        csv_path = os.path.join(out2, "results.csv")
        rows2 = []
        if os.path.exists(csv_path):
            with open(csv_path, newline="") as f:
                rows2 = list(csv.DictReader(f))
        check(len(rows2) == 2 and all(r2["status"] == "ok" and r2["launcher"] == "srun"
                                      for r2 in rows2),
              "the submitted sweep's rows:", [(r2["launcher"], r2["status"]) for r2 in rows2])
    return done("sweep points through srun --mpi=pmix and sbatch, and the whole sweep as one "
                "sbatch job: 2-rank JSON in every row")


def main():
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "pmix":
        return cmd_pmix(os.path.abspath(sys.argv[2]), sys.argv[3], sys.argv[4])
    if cmd == "requeue":
        return cmd_requeue(os.path.abspath(sys.argv[2]), sys.argv[3], sys.argv[4])
    if cmd == "sweep":
        return cmd_sweep(os.path.abspath(sys.argv[2]), sys.argv[3])
    if cmd == "plain":
        return cmd_plain(os.path.abspath(sys.argv[2]), sys.argv[3])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
