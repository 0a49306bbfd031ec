#!/usr/bin/env python3
"""Checks for the whole-program tests (tests/cli/CMakeLists.txt): they compare what hotpath
writes for machines -- the metrics JSONL (one strict JSON object per step), `bench --bench_json`
files, `hotpath inspect` dataset digests and layout, checkpoint directories -- never log wording.

  hp_check.py run [--clean PATH]... [--exit N|nonzero] [--need-gpus N] -- CMD...
                  (runs CMD and checks its status; exits 77, "skipped", with fewer than N GPUs)
  hp_check.py losses RUN[,RUN...] REF [--rel R] [--steps N] [--first S] [--same-steps]
                     [--field NAME]   (another per-step number instead of loss, e.g. grad_norm)
                     [--window W]     (with --rel: the means of every W consecutive steps)
  hp_check.py jsonl FILE [--lines N] [--all EXPR]... [--last EXPR]... [--first EXPR]...
  hp_check.py json FILE --expect EXPR...
  hp_check.py compare FILE_A FILE_B [--step N] --expect EXPR...
                     (a, b: the last records, or those of step N, of two JSONL files)
  hp_check.py digests --hotpath EXE CKPT_A CKPT_B
  hp_check.py inspect --hotpath EXE CKPT --expect EXPR...
  hp_check.py dir DIR [--latest NAME | --latest-of METRICS [--below N]] [--present NAME]...
                      [--absent NAME]...
  hp_check.py derive SRC [--head BYTES DST]... [--patch OFFSET HEX DST]...
  hp_check.py damage SRC DST (--flip FILE | --truncate FILE BYTES | --latest TEXT)
  hp_check.py params --total N --active N [--rel R] -- CMD...
  hp_check.py signal --signal NAME --metrics FILE --after N [--rank R] --exit N -- CMD...
  hp_check.py fs --at DIR (--size SIZE | --readonly) [--seed SRC]... [--keep DST] [--as-nobody]
                 [--exit N|nonzero] [--forbid REGEX]... -- CMD...
                  (runs CMD with a small tmpfs mounted at DIR -- full at SIZE, or read-only --
                  holding copies of SRC, then copies DIR to DST and unmounts; --as-nobody runs
                  CMD as user nobody; exits 77, "skipped", where mounting is not permitted)

EXPR is a Python expression over one record's keys (e.g. 'syncs["routing"] == 4'); `r` is the
whole record, `ceil` and `MiB` are at hand. Every check prints what it compared; exit status 0
means it held.
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

MARK = "[hp_check]"


def say(*parts):
    print(MARK, *parts, flush=True)


def fail(*parts):
    say("FAILED:", *parts)
    sys.exit(1)


def strict_json(text, where):
    def bad_constant(name):
        raise ValueError(f"non-finite number {name} (not JSON)")
    try:
        return json.loads(text, parse_constant=bad_constant)
    except ValueError as e:
        fail(f"{where}: not valid JSON: {e}: {text[:200]!r}")


def read_jsonl(path):
    if not os.path.exists(path):
        fail(f"{path} does not exist")
    records = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                records.append(strict_json(line, f"{path}:{i}"))
    return records


def evaluate(expr, record, where):
    env = {"ceil": math.ceil, "MiB": 1 << 20, "r": record, "len": len, "all": all, "any": any,
           "sum": sum, "min": min, "max": max, "abs": abs}
    scope = dict(record) if isinstance(record, dict) else {}
    try:
        return eval(expr, env, scope)  # noqa: S307 - expressions come from the test definitions
    except Exception as e:  # a missing key is a failed check, not a crash
        fail(f"{where}: {expr}: {type(e).__name__}: {e}")


# ---- run ----------------------------------------------------------------------------------------

def remove(path):
    """Removes PATH (a file or a tree) and makes sure its directory exists."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


SKIP = 77  # SKIP_RETURN_CODE of the tests that need GPUs


def gpu_count():
    """CUDA devices this process may use: the driver's list, limited by CUDA_VISIBLE_DEVICES."""
    n = 0
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    if n == 0 and shutil.which("nvidia-smi"):
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        n = sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]))
    return n


def cmd_run(a):
    if a.need_gpus:
        have = gpu_count()
        if have < a.need_gpus:
            say(f"skipped: needs {a.need_gpus} CUDA device(s), {have} visible")
            sys.exit(SKIP)
    for p in a.clean:
        remove(p)
    sys.stdout.flush()
    rc = subprocess.call(a.cmd, stderr=subprocess.STDOUT)
    if a.exit is None:
        sys.exit(rc)
    ok = rc != 0 if a.exit == "nonzero" else rc == int(a.exit)
    if not ok:
        fail(f"exit status {rc}, expected {a.exit}")
    say(f"exit status {rc} as expected")


# ---- metrics ------------------------------------------------------------------------------------

def losses_of(paths, field="loss"):
    out = []
    for p in paths:
        for i, r in enumerate(read_jsonl(p), 1):
            if "step" not in r or field not in r:
                fail(f"{p}:{i}: no step/{field}: {r}")
            if not isinstance(r[field], (int, float)) or isinstance(r[field], bool):
                fail(f"{p}:{i}: {field} is {r[field]!r}")
            out.append((r["step"], float(r[field])))
    return out


def cmd_losses(a):
    if a.need_gpus and gpu_count() < a.need_gpus:
        say(f"skipped: needs {a.need_gpus} CUDA device(s), {gpu_count()} visible")
        sys.exit(SKIP)
    f = a.field
    run = losses_of(a.run.split(","), f)
    ref = dict(losses_of([a.ref], f))
    steps = [s for s, _ in run]
    if a.steps is not None and len(run) != a.steps:
        fail(f"{a.run}: {len(run)} steps, expected {a.steps}: {steps}")
    if steps != list(range(steps[0], steps[0] + len(steps))) if steps else False:
        fail(f"{a.run}: steps not consecutive: {steps}")
    if a.first is not None and (not steps or steps[0] != a.first):
        fail(f"{a.run}: first step {steps[:1]}, expected {a.first}")
    if a.same_steps and sorted(ref) != steps:
        fail(f"{a.run} has steps {steps}, {a.ref} {sorted(ref)}")
    for s, _ in run:
        if s not in ref:
            fail(f"step {s} of {a.run} is not in {a.ref}")
    if a.window is not None:
        if a.rel == 0 or a.window < 1 or a.window > len(run):
            fail(f"--window {a.window} needs --rel and 1..{len(run)} steps of {a.run}")
        # Windows of W consecutive steps, compared by their means: a change at the level of
        # rounding moves single steps of a small model's loss by several percent, its means of
        # a few steps far less (docs/testing.md, "Comparing losses").
        w = a.window
        vals = [l for _, l in run]
        starts = range(len(run) - w + 1)
        ref = {steps[i]: sum(ref[t] for t in steps[i:i + w]) / w for i in starts}
        run = [(steps[i], sum(vals[i:i + w]) / w) for i in starts]
    worst = 0.0
    for s, loss in run:
        want = ref[s]
        if a.rel == 0:
            if loss != want:
                fail(f"step {s}: {f} {loss!r} differs from {want!r} in {a.ref}")
        else:
            rel = abs(loss - want) / max(abs(want), 1e-300)
            worst = max(worst, rel)
            if rel > a.rel:
                where = f"step {s}" if a.window is None else f"steps {s}..{s + a.window - 1}"
                what = f if a.window is None else f"mean {f}"
                fail(f"{where}: {what} {loss!r} vs {want!r}: relative difference {rel:.3g} > "
                     f"{a.rel}")
    how = "bitwise equal" if a.rel == 0 else f"max relative difference {worst:.3g} <= {a.rel}"
    if a.window is not None:
        how += f" (means of {a.window} steps)"
    say(f"{len(steps)} steps ({steps[0] if steps else '-'}..{steps[-1] if steps else '-'}): "
        f"{f} {how} to {os.path.basename(a.ref)}")


def cmd_jsonl(a):
    recs = read_jsonl(a.file)
    if a.lines is not None and len(recs) != a.lines:
        fail(f"{a.file}: {len(recs)} records, expected {a.lines}")
    if not recs:
        fail(f"{a.file}: no records")
    for expr in a.all:
        for i, r in enumerate(recs, 1):
            if not evaluate(expr, r, f"{a.file}:{i}"):
                fail(f"{a.file}:{i}: not {expr}: {json.dumps(r)}")
    for expr in a.last:
        if not evaluate(expr, recs[-1], f"{a.file}:{len(recs)}"):
            fail(f"{a.file}: last record: not {expr}: {json.dumps(recs[-1])}")
    for expr in a.first:
        if not evaluate(expr, recs[0], f"{a.file}:1"):
            fail(f"{a.file}: first record: not {expr}: {json.dumps(recs[0])}")
    say(f"{a.file}: {len(recs)} records;", "; ".join(
        [f"all: {e}" for e in a.all] + [f"last: {e}" for e in a.last] +
        [f"first: {e}" for e in a.first]))


def cmd_compare(a):
    pair = {}
    for k, path in (("a", a.a), ("b", a.b)):
        recs = read_jsonl(path)
        if a.step is not None:
            recs = [r for r in recs if r.get("step") == a.step]
        if not recs:
            fail(f"{path}: no record" + (f" of step {a.step}" if a.step is not None else "s"))
        pair[k] = recs[-1]
    for expr in a.expect:
        if not evaluate(expr, pair, f"{a.a} vs {a.b}"):
            fail(f"not {expr}: a={json.dumps(pair['a'])} b={json.dumps(pair['b'])}")
    say(f"{os.path.basename(a.a)} (a) vs {os.path.basename(a.b)} (b):", "; ".join(a.expect))


def cmd_json(a):
    if not os.path.exists(a.file):
        fail(f"{a.file} does not exist")
    with open(a.file) as f:
        doc = strict_json(f.read(), a.file)
    for expr in a.expect:
        if not evaluate(expr, {"d": doc} if not isinstance(doc, dict) else dict(doc, d=doc), a.file):
            fail(f"{a.file}: not {expr}")
    say(f"{a.file}:", "; ".join(a.expect))


# ---- checkpoints --------------------------------------------------------------------------------

def inspect(hotpath, ckpt):
    """inspect_uncached(), remembered per file version (path, size, mtime): several checks
    compare against the same reference checkpoint, and reading one costs a second or two."""
    import hashlib
    import tempfile
    target = os.path.realpath(ckpt)
    if os.path.isdir(target):
        return inspect_uncached(hotpath, ckpt)
    try:
        st = os.stat(target)
    except OSError:
        return inspect_uncached(hotpath, ckpt)
    key = hashlib.sha256(f"{target}|{st.st_size}|{st.st_mtime_ns}|{hotpath}".encode()).hexdigest()
    cache = os.path.join(tempfile.gettempdir(), f"hp_check_inspect_{os.getuid()}")
    path = os.path.join(cache, key + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    info = inspect_uncached(hotpath, ckpt)
    os.makedirs(cache, exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return info


def inspect_uncached(hotpath, ckpt):
    """Step, layout and dataset digests of a checkpoint, from `hotpath inspect` (--json when the
    program has it, else its table: one `  /name dtype [shape] N bytes fnv64=HEX ok` per dataset)."""
    p = subprocess.run([hotpath, "inspect", "--json", ckpt], capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.lstrip().startswith("{"):
        doc = strict_json(p.stdout, f"inspect --json {ckpt}")
        info = {"step": doc.get("step"), "layout": doc.get("layout"), "datasets": {}}
        stack = [doc]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                name = x.get("name")
                digest = next((x[k] for k in ("fnv64", "digest", "checksum") if k in x), None)
                if isinstance(name, str) and name.startswith("/") and digest is not None:
                    info["datasets"][name] = str(digest)
                stack.extend(x.values())
            elif isinstance(x, list):
                stack.extend(x)
        if isinstance(info["layout"], dict):
            info["layout"] = " ".join(f"{k}={v}" for k, v in info["layout"].items())
        return info
    p = subprocess.run([hotpath, "inspect", ckpt], capture_output=True, text=True)
    if p.returncode != 0:
        fail(f"hotpath inspect {ckpt}: exit {p.returncode}: {(p.stdout + p.stderr)[-500:]}")
    info = {"step": None, "layout": None, "datasets": {}, "skipped_steps": 0}
    for line in p.stdout.splitlines():
        m = re.match(r"^step: (\d+)$", line)
        if m:
            info["step"] = int(m.group(1))
        m = re.match(r"^skipped_steps: (\d+)$", line)
        if m:
            info["skipped_steps"] = int(m.group(1))
        m = re.match(r"^layout: (.*)$", line)
        if m:
            info["layout"] = m.group(1).strip()
        m = re.match(r"^\s+(/\S+) .*\bfnv64=([0-9a-f]+)\b", line)
        if m:
            info["datasets"][m.group(1)] = m.group(2)
    return info


def cmd_digests(a):
    da = inspect(a.hotpath, a.a)["datasets"]
    db = inspect(a.hotpath, a.b)["datasets"]
    keep = lambda d: {k: v for k, v in d.items() if k.startswith(("/params/", "/optim/"))}
    da, db = keep(da), keep(db)
    if not da:
        fail(f"{a.a}: no /params or /optim datasets listed")
    if sorted(da) != sorted(db):
        fail(f"dataset names differ: {sorted(set(da) ^ set(db))[:10]}")
    diff = [k for k in da if da[k] != db[k]]
    if diff:
        fail(f"{len(diff)} of {len(da)} datasets differ, e.g. {diff[:5]}")
    say(f"{len(da)} parameter and optimizer datasets byte-equal (digests) in {a.a} and {a.b}")


def cmd_inspect(a):
    info = inspect(a.hotpath, a.ckpt)
    for expr in a.expect:
        if not evaluate(expr, info, a.ckpt):
            fail(f"{a.ckpt}: not {expr}: step={info['step']} layout={info['layout']!r}")
    say(f"{a.ckpt}:", "; ".join(a.expect))


def cmd_dir(a):
    if not os.path.isdir(a.dir):
        fail(f"{a.dir} is not a directory")
    names = sorted(os.listdir(a.dir))
    if a.latest_of is not None:
        recs = read_jsonl(a.latest_of)
        if not recs:
            fail(f"{a.latest_of}: no records")
        step = recs[-1]["step"]
        if a.below is not None and not step < a.below:
            fail(f"{a.latest_of}: the last step is {step}, expected one before {a.below}")
        a.latest = f"step_{step:08d}.h5"
    if a.latest is not None:
        path = os.path.join(a.dir, "latest")
        got = open(path).read().strip() if os.path.exists(path) else None
        if got != a.latest:
            fail(f"{path} holds {got!r}, expected {a.latest!r} (directory: {names})")
    for n in a.present:
        if n not in names:
            fail(f"{a.dir}: no {n} (directory: {names})")
    for n in a.absent:
        if n in names:
            fail(f"{a.dir}: {n} exists (directory: {names})")
    say(f"{a.dir}: {names}")


def cmd_derive(a):
    with open(a.src, "rb") as f:
        data = f.read()
    for n, dst in a.head:
        with open(dst, "wb") as f:
            f.write(data[:int(n)])
        say(f"{dst}: the first {n} bytes of {a.src}")
    for off, hexbytes, dst in a.patch:
        b = bytearray(data)
        new = bytes.fromhex(hexbytes)
        b[int(off):int(off) + len(new)] = new
        with open(dst, "wb") as f:
            f.write(b)
        say(f"{dst}: {a.src} with bytes {off}.. set to {hexbytes}")


def cmd_damage(a):
    remove(a.dst)
    shutil.copytree(a.src, a.dst)
    if a.flip:
        f = os.path.join(a.dst, a.flip)
        with open(f, "r+b") as fh:
            size = os.path.getsize(f)
            fh.seek(size // 2)
            b = fh.read(1)[0]
            fh.seek(size // 2)
            fh.write(bytes([b ^ 0x5A]))
        say(f"{f}: byte {size // 2} of {size} flipped")
    elif a.truncate:
        f = os.path.join(a.dst, a.truncate[0])
        os.truncate(f, int(a.truncate[1]))
        say(f"{f}: truncated to {a.truncate[1]} bytes")
    elif a.latest is not None:
        with open(os.path.join(a.dst, "latest"), "wb") as fh:
            fh.write(a.latest.encode().decode("unicode_escape").encode("latin-1"))
        say(f"{a.dst}/latest: {a.latest!r}")


# ---- programs -----------------------------------------------------------------------------------

def cmd_params(a):
    p = subprocess.run(a.cmd, capture_output=True, text=True)
    out = p.stdout + p.stderr
    m = re.search(r"params: total=(\d+) active=(\d+)", out)
    if p.returncode != 0 or not m:
        fail(f"exit {p.returncode}, no parameter counts: {out[-500:]}")
    total, active = int(m.group(1)), int(m.group(2))
    for what, got, want in (("total", total, a.total), ("active", active, a.active)):
        if abs(got - want) > a.rel * want:
            fail(f"{what} parameters {got}, expected {want:.4g} within {a.rel:.0%}")
    say(f"total={total} active={active}: within {a.rel:.0%} of {a.total:.4g} and {a.active:.4g}")


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    for k in (b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK", b"PMI_RANK", b"RANK"):
        if k in env:
            return int(env[k])
    return None


def descendants(root):
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def count_lines(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def cmd_signal(a):
    remove(a.metrics)
    for p in a.clean:
        remove(p)
    sig = getattr(signal, "SIG" + a.signal)
    proc = subprocess.Popen(a.cmd, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + a.timeout
    target = None
    while time.monotonic() < deadline and proc.poll() is None:
        if count_lines(a.metrics) >= a.after:
            if a.rank is None:
                target = proc.pid
            else:
                target = next((p for p in descendants(proc.pid) if rank_of(p) == a.rank), None)
            if target is not None:
                break
        time.sleep(0.05)
    if target is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        fail(f"no process to signal ({count_lines(a.metrics)} metrics lines, exit {proc.returncode})")
    os.kill(target, sig)
    say(f"SIG{a.signal} sent to pid {target}" + (f" (rank {a.rank})" if a.rank is not None else "")
        + f" after {count_lines(a.metrics)} steps")
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        fail("the job did not end after the signal")
    if rc != a.exit:
        fail(f"exit status {rc}, expected {a.exit}")
    say(f"exit status {rc} as expected")


# ---- file systems -------------------------------------------------------------------------------

def as_nobody(cmd):
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"] + cmd


def cmd_fs(a):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        say("skipped: mounting a tmpfs needs root")
        sys.exit(SKIP)
    if a.as_nobody and shutil.which("setpriv") is None:
        say("skipped: setpriv (util-linux) is needed to run as nobody")
        sys.exit(SKIP)
    if a.as_nobody:
        # The program and the files it is given must be readable by nobody: a checkout under a
        # private directory (mktemp -d makes them 0700) is not, and the run would fail for that.
        for arg in a.cmd:
            path = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
            if not os.path.isfile(path):
                continue
            if subprocess.call(as_nobody(["test", "-r", path])) != 0:
                say(f"skipped: user nobody cannot read {path} (a parent directory is private)")
                sys.exit(SKIP)
    if os.path.ismount(a.at):
        subprocess.call(["umount", a.at])
    remove(a.at)
    os.makedirs(a.at)
    opts = "size=" + (a.size or "1m")
    if subprocess.call(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", a.at]) != 0:
        say(f"skipped: cannot mount a tmpfs at {a.at}")
        sys.exit(SKIP)
    try:
        for src in a.seed:
            dst = os.path.join(a.at, os.path.basename(src.rstrip("/")))
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
        if a.as_nobody:
            os.chmod(a.at, 0o755)
        if a.readonly and subprocess.call(["mount", "-o", "remount,ro", a.at]) != 0:
            fail(f"cannot remount {a.at} read-only")
        cmd = a.cmd
        if a.as_nobody:
            cmd = as_nobody(cmd)
        sys.stdout.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stdout.write(proc.stdout)
        rc = proc.returncode
        if a.keep:
            remove(a.keep)
            shutil.copytree(a.at, a.keep)
    finally:
        subprocess.call(["umount", a.at])
        try:
            os.rmdir(a.at)
        except OSError:
            pass
    for pattern in a.forbid:
        if re.search(pattern, proc.stdout):
            fail(f"the output matches {pattern!r}")
    if a.exit is not None:
        ok = rc != 0 if a.exit == "nonzero" else rc == int(a.exit)
        if not ok:
            fail(f"exit status {rc}, expected {a.exit}")
        say(f"exit status {rc} as expected")
    elif rc != 0:
        fail(f"exit status {rc}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)

    def with_cmd(p):
        p.add_argument("cmd", nargs=argparse.REMAINDER)

    p = sub.add_parser("run")
    p.add_argument("--clean", action="append", default=[])
    p.add_argument("--exit")
    p.add_argument("--need-gpus", type=int, default=0)
    with_cmd(p)
    p = sub.add_parser("losses")
    p.add_argument("run")
    p.add_argument("ref")
    p.add_argument("--rel", type=float, default=0.0)
    p.add_argument("--steps", type=int)
    p.add_argument("--first", type=int)
    p.add_argument("--same-steps", action="store_true")
    p.add_argument("--field", default="loss")
    p.add_argument("--window", type=int)
    p.add_argument("--need-gpus", type=int, default=0)
    p = sub.add_parser("jsonl")
    p.add_argument("file")
    p.add_argument("--lines", type=int)
    p.add_argument("--all", action="append", default=[])
    p.add_argument("--last", action="append", default=[])
    p.add_argument("--first", action="append", default=[])
    p = sub.add_parser("json")
    p.add_argument("file")
    p.add_argument("--expect", action="append", default=[])
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--step", type=int)
    p.add_argument("--expect", action="append", default=[])
    p = sub.add_parser("digests")
    p.add_argument("--hotpath", required=True)
    p.add_argument("a")
    p.add_argument("b")
    p = sub.add_parser("inspect")
    p.add_argument("--hotpath", required=True)
    p.add_argument("ckpt")
    p.add_argument("--expect", action="append", default=[])
    p = sub.add_parser("dir")
    p.add_argument("dir")
    p.add_argument("--latest")
    p.add_argument("--latest-of")
    p.add_argument("--below", type=int)
    p.add_argument("--present", action="append", default=[])
    p.add_argument("--absent", action="append", default=[])
    p = sub.add_parser("derive")
    p.add_argument("src")
    p.add_argument("--head", nargs=2, action="append", default=[])
    p.add_argument("--patch", nargs=3, action="append", default=[])
    p = sub.add_parser("damage")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--flip")
    p.add_argument("--truncate", nargs=2)
    p.add_argument("--latest")
    p = sub.add_parser("params")
    p.add_argument("--total", type=float, required=True)
    p.add_argument("--active", type=float, required=True)
    p.add_argument("--rel", type=float, default=0.02)
    with_cmd(p)
    p = sub.add_parser("signal")
    p.add_argument("--signal", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--after", type=int, default=2)
    p.add_argument("--rank", type=int)
    p.add_argument("--exit", type=int, required=True)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--clean", action="append", default=[])
    with_cmd(p)
    p = sub.add_parser("fs")
    p.add_argument("--at", required=True)
    p.add_argument("--size")
    p.add_argument("--readonly", action="store_true")
    p.add_argument("--seed", action="append", default=[])
    p.add_argument("--keep")
    p.add_argument("--as-nobody", action="store_true")
    p.add_argument("--exit")
    p.add_argument("--forbid", action="append", default=[])
    with_cmd(p)

    a = ap.parse_args()
    if hasattr(a, "cmd"):
        if a.cmd and a.cmd[0] == "--":
            a.cmd = a.cmd[1:]
        if not a.cmd:
            ap.error("no command after --")
    globals()["cmd_" + a.what](a)


if __name__ == "__main__":
    main()
