#!/usr/bin/env python3
"""Failure cases of import-hf, export-hf and init_from/resume with imported weights
(tests/hf/CMakeLists.txt registers each as hf.guard.CASE).

  hf_guard.py --hotpath BIN --fixtures DIR --work DIR CASE

Each case builds its inputs under WORK/CASE (removed first), runs hotpath and checks the exit
status, the message (it names the flag, file, field or tensor; never raw library text) and the
files left behind: an existing file is byte-for-byte unchanged, no temporary remains. Prints
"[hf_guard] FAILED ..." and exits 1 on a mismatch, exits 77 when the case cannot run here.
Inputs are damaged copies of the fixtures, written with the standard library only.
"""
import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys

A = None  # the parsed arguments
SKIP = 77
# Text that must never reach the user: raw library errors and crashes.
RAW = re.compile(r"HDF5-DIAG|H5F|filesystem error|json\.exception|type_error|"
                 r"terminate called|Segmentation|Traceback|std::")


def fail(msg):
    print(f"[hf_guard] FAILED {msg}")
    sys.exit(1)


def work(case):
    d = os.path.join(A.work, case)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def run(args, exit_code, pattern=None, shell_prefix=None):
    """Runs hotpath ARGS; checks the exit status and that the output matches `pattern`."""
    cmd = [A.hotpath] + [str(a) for a in args]
    if shell_prefix:
        cmd = ["sh", "-c", shell_prefix + ' && exec "$@"', "sh"] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out = p.stdout + p.stderr
    print(f"$ {' '.join(cmd)}\n{out.rstrip()}\n(exit {p.returncode})")
    if p.returncode != exit_code:
        fail(f"exit status {p.returncode}, expected {exit_code}")
    if pattern and not re.search(pattern, out, re.S):
        fail(f"the output does not match {pattern!r}")
    if exit_code != 0 and RAW.search(out):
        fail(f"raw library text in the message: {RAW.search(out).group(0)!r}")
    return out


def write(path, data):
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def same_bytes(path, data):
    if not os.path.exists(path):
        fail(f"{path} was removed")
    if read(path) != data:
        fail(f"{path} was changed")


def listing(d, want):
    got = sorted(os.listdir(d))
    if got != sorted(want):
        fail(f"{d} holds {got}, expected {sorted(want)} (a temporary or partial output remained)")


def fx(name):
    return os.path.join(A.fixtures, name)


# ---- safetensors, written and damaged by hand ---------------------------------------------------

def st_read(path):
    b = read(path)
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]


def st_bytes(header_text, data):
    h = header_text.encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def hf_dir(case, model="llama", header=None, data=None, header_text=None, config=None):
    """A copy of fixture `model` in WORK/case/in, with its header, data or config replaced."""
    d = os.path.join(work(case), "in")
    os.makedirs(d)
    h, blob = st_read(os.path.join(fx(model), "model.safetensors"))
    if header is not None:
        h = header(h)
    if data is not None:
        blob = data(h, blob)
    write(os.path.join(d, "model.safetensors"),
          st_bytes(header_text(h) if header_text else json.dumps(h), blob))
    cfg = json.loads(read(os.path.join(fx(model), "config.json")))
    if config is not None:
        cfg = config(cfg)
    write(os.path.join(d, "config.json"), cfg if isinstance(cfg, str) else json.dumps(cfg))
    return d


def import_fails(case, pattern, **kw):
    d = hf_dir(case, **kw)
    out = os.path.join(os.path.dirname(d), "out")
    os.makedirs(out)
    run(["import-hf", d, "--out", os.path.join(out, "m.h5")], 2, pattern)
    listing(out, [])


def set_offsets(name, begin, end):
    def f(h):
        h[name]["data_offsets"] = [begin, end]
        return h
    return f


def first_tensor(h):
    return min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


EMB = "model.embed_tokens.weight"
NORM = "model.norm.weight"


def case_st_offsets_wrap():
    # A begin of 2^64 - n and an end of 0: as int64 the range is [-n, 0), n bytes before the
    # data section (a read there crashed); refused.
    def f(h):
        n = h[EMB]["data_offsets"][1] - h[EMB]["data_offsets"][0]
        h[EMB]["data_offsets"] = [2**64 - n, 0]
        return h
    import_fails("st_offsets_wrap", rf"model.safetensors.*tensor '{re.escape(EMB)}'.*data_offsets",
                 header=f)


def case_st_offsets_huge():
    import_fails("st_offsets_huge", rf"model.safetensors.*tensor '{re.escape(NORM)}'.*data_offsets",
                 header=set_offsets(NORM, 2**63 + 8, 2**63 + 264))


def case_st_offsets_negative():
    import_fails("st_offsets_negative", rf"tensor '{re.escape(NORM)}'.*data_offsets",
                 header=set_offsets(NORM, -128, 0))


def case_st_offsets_into_header():
    # [begin, end] moved before the first tensor's bytes (overlapping it): refused.
    def f(h):
        first = first_tensor(h)
        n = h[NORM]["data_offsets"][1] - h[NORM]["data_offsets"][0]
        b = h[first]["data_offsets"][0]
        h[NORM]["data_offsets"] = [b, b + n]
        return h
    import_fails("st_offsets_into_header", r"tensor '.*'.*overlap", header=f)


def case_st_duplicate_tensor():
    def text(h):
        t = json.dumps(h)
        dup = json.dumps({NORM: h[NORM]})[1:-1]
        return t[:-1] + ", " + dup + "}"
    import_fails("st_duplicate_tensor", rf"model.safetensors.*key '{re.escape(NORM)}' appears twice",
                 header_text=text)


def case_st_shape_overflow():
    def f(h):
        h[NORM]["shape"] = [2**62, 2**62]
        return h
    import_fails("st_shape_overflow", rf"tensor '{re.escape(NORM)}'.*more than 2\^64", header=f)


def case_st_trailing_bytes():
    import_fails("st_trailing_bytes", r"model.safetensors.*cover .* data bytes",
                 data=lambda h, b: b + b"\0" * 64)


def case_st_nan_weight():
    def f(h, b):
        s = h[NORM]["data_offsets"][0]
        assert h[NORM]["dtype"] == "F32"
        b = bytearray(b)
        b[s + 12:s + 16] = struct.pack("<f", math.nan)
        return bytes(b)
    import_fails("st_nan_weight", rf"tensor '{re.escape(NORM)}'.* nan at flat index 3", data=f)


def case_st_inf_weight():
    def f(h, b):
        s = h[EMB]["data_offsets"][0]
        b = bytearray(b)
        b[s:s + 4] = struct.pack("<f", -math.inf)
        return bytes(b)
    import_fails("st_inf_weight", rf"tensor '{re.escape(EMB)}'.* -inf at flat index 0", data=f)


def case_mxfp4_nan_scale():
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def f(h, b):
        s = h[name]["data_offsets"][0]
        b = bytearray(b)
        b[s + 5] = 0xFF
        return bytes(b)
    import_fails("mxfp4_nan_scale", rf"tensor '{re.escape(name)}'.*0xFF \(NaN\) at flat index 5",
                 model="gptoss-mxfp4", data=f)


# ---- config.json --------------------------------------------------------------------------------

def cfg(**fields):
    def f(c):
        c.update(fields)
        return c
    return f


def case_cfg_hidden_size_huge():
    import_fails("cfg_hidden_size_huge",
                 r"config.json: field 'hidden_size' is 1099511627776; it must be an integer in "
                 r"\[1, 1048576\]", config=cfg(hidden_size=2**40))


def case_cfg_string_number():
    import_fails("cfg_string_number", r"config.json: field 'num_hidden_layers' is \"2\"",
                 config=cfg(num_hidden_layers="2"))


def case_cfg_rope_type_number():
    def f(c):
        c["rope_parameters"]["rope_type"] = 3
        return c
    import_fails("cfg_rope_type_number", r"config.json: field 'rope_parameters.rope_type' is 3",
                 config=f)


def case_cfg_layer_types():
    import_fails("cfg_layer_types", r"config.json: field 'layer_types' is 5", model="gptoss",
                 config=cfg(layer_types=5))


def case_cfg_eos():
    import_fails("cfg_eos", r"config.json: field 'eos_token_id' is 1099511627776; it must be a token id",
                 config=cfg(eos_token_id=2**40))


def case_cfg_duplicate_field():
    def text(c):
        t = json.dumps(c)
        return t[:-1] + ', "hidden_size": 64}'
    import_fails("cfg_duplicate_field", r"config.json.*key 'hidden_size' appears twice",
                 config=text)


def case_no_config_json():
    d = os.path.join(work("no_config_json"), "in")
    os.makedirs(d)
    shutil.copy(os.path.join(fx("llama"), "model.safetensors"), d)
    run(["import-hf", d, "--out", os.path.join(d, "..", "m.h5")], 2, r"in has no config.json")
    # init_from names it too, rather than "no committed checkpoint".
    run(["train", "--config", os.path.join(A.work, "..", "llama.ini"), "--init_from", d,
         "--steps=1", "--device=cpu", "--data", os.path.join(fx("llama"), "tokens.h5"),
         "--seq_len=16", "--batch_tokens=32"], 2, r"holds safetensors but no config.json")


# ---- model.safetensors.index.json ---------------------------------------------------------------

def index_dir(case, target):
    d = hf_dir(case)
    h, _ = st_read(os.path.join(d, "model.safetensors"))
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "shard.safetensors"))
    m = {k: "shard.safetensors" for k in h if k != "__metadata__"}
    m[NORM] = target
    write(os.path.join(d, "model.safetensors.index.json"), json.dumps({"weight_map": m}))
    return d


def index_fails(case, target, pattern):
    d = index_dir(case, target)
    run(["import-hf", d, "--out", os.path.join(d, "..", "m.h5")], 2,
        rf"model.safetensors.index.json: weight_map entry '{re.escape(NORM)}'.*" + pattern)


def case_index_absolute():
    index_fails("index_absolute", os.path.abspath(os.path.join(fx("llama"), "model.safetensors")),
                "is an absolute path")


def case_index_dotdot():
    index_fails("index_dotdot", "../../llama/model.safetensors", "has a '..' component")


def case_index_symlink():
    d = index_dir("index_symlink", "link.safetensors")
    os.symlink(os.path.abspath(os.path.join(fx("llama"), "model.safetensors")),
               os.path.join(d, "link.safetensors"))
    run(["import-hf", d, "--out", os.path.join(d, "..", "m.h5")], 2,
        r"weight_map entry '.*'.*leads outside the directory")


# ---- import-hf outputs --------------------------------------------------------------------------

PRECIOUS = b"a training checkpoint that must survive\n"


def case_import_keeps_out():
    d = work("import_keeps_out")
    out = os.path.join(d, "run.h5")
    write(out, PRECIOUS)
    run(["import-hf", fx("llama"), "--out", out], 2, r"--out .*run.h5 exists.*--force")
    same_bytes(out, PRECIOUS)
    listing(d, ["run.h5"])


def case_import_keeps_ini():
    d = work("import_keeps_ini")
    ini = os.path.join(d, "m.ini")
    write(ini, PRECIOUS)
    run(["import-hf", fx("llama"), "--out", os.path.join(d, "m.h5")], 2,
        r"--config_out .*m.ini exists")
    same_bytes(ini, PRECIOUS)
    listing(d, ["m.ini"])


def case_import_out_is_ini():
    d = work("import_out_is_ini")
    run(["import-hf", fx("llama"), "--out", os.path.join(d, "model.ini")], 2,
        r"--out .*model.ini names a config file")
    listing(d, [])


def case_import_same_paths():
    d = work("import_same_paths")
    os.makedirs(os.path.join(d, "sub"))
    run(["import-hf", fx("llama"), "--out", os.path.join(d, "m.h5"), "--config_out",
         os.path.join(d, "sub", "..", "m.h5")], 2, r"--config_out .* and --out .* are the same file")
    listing(d, ["sub"])


def case_import_unwritable():
    d = work("import_unwritable")
    write(os.path.join(d, "file"), PRECIOUS)
    run(["import-hf", fx("llama"), "--out", os.path.join(d, "file", "m.h5")], 2,
        r"--out .*file/m.h5 cannot be written")
    listing(d, ["file"])


def case_import_force():
    d = work("import_force")
    out, ini = os.path.join(d, "m.h5"), os.path.join(d, "m.ini")
    write(out, PRECIOUS)
    write(ini, PRECIOUS)
    run(["import-hf", fx("llama"), "--out", out, "--force"], 0, r"imported LlamaForCausalLM")
    if read(out)[:4] != b"\x89HDF" or b"vocab_size = 96" not in read(ini):
        fail("--force did not write the checkpoint and the config")
    listing(d, ["m.h5", "m.ini"])


def no_space(blocks):
    # RLIMIT_FSIZE: a write beyond it fails (EFBIG) like a full disk once SIGXFSZ is ignored.
    return f"trap '' XFSZ; ulimit -f {blocks}"


def case_import_disk_full():
    d = work("import_disk_full")
    out = os.path.join(d, "m.h5")
    write(out, PRECIOUS)
    run(["import-hf", fx("llama"), "--out", out, "--force"], 1,
        r"writing --out .*m.h5 failed.*temporary files were removed", shell_prefix=no_space(64))
    same_bytes(out, PRECIOUS)
    listing(d, ["m.h5"])


# ---- export-hf ----------------------------------------------------------------------------------

def imported(model="llama"):
    return os.path.join(A.work, "..", f"{model}.h5")


def case_export_keeps_foreign_tmp():
    d = work("export_keeps_foreign_tmp")
    out = os.path.join(d, "hf")
    os.makedirs(out + ".tmp")
    write(os.path.join(out + ".tmp", "notes.txt"), PRECIOUS)
    run(["export-hf", imported(), "--out", out, "--dtype", "fp32"], 0, r"exported")
    same_bytes(os.path.join(out + ".tmp", "notes.txt"), PRECIOUS)
    listing(d, ["hf", "hf.tmp"])
    listing(out, ["config.json", "model-00001-of-00001.safetensors",
                  "model.safetensors.index.json"])


def case_export_keeps_out():
    d = work("export_keeps_out")
    out = os.path.join(d, "hf")
    os.makedirs(out)
    write(os.path.join(out, "notes.txt"), PRECIOUS)
    run(["export-hf", imported(), "--out", out], 2, r"--out .*hf exists.*--force")
    # --force replaces an earlier export only, not a directory of other files.
    run(["export-hf", imported(), "--out", out, "--force"], 2,
        r"--out .*hf is a directory without config.json")
    same_bytes(os.path.join(out, "notes.txt"), PRECIOUS)
    listing(d, ["hf"])
    listing(out, ["notes.txt"])


def case_export_force():
    d = work("export_force")
    out = os.path.join(d, "hf")
    run(["export-hf", imported(), "--out", out, "--shard_mib", "1"], 0, r"exported")
    write(os.path.join(out, "config.json"), "{}")
    run(["export-hf", imported(), "--out", out, "--force"], 0, r"exported")
    if json.loads(read(os.path.join(out, "config.json")))["architectures"] != ["LlamaForCausalLM"]:
        fail("--force did not replace the earlier export")
    listing(d, ["hf"])


def case_export_unwritable():
    d = work("export_unwritable")
    write(os.path.join(d, "file"), PRECIOUS)
    run(["export-hf", imported(), "--out", os.path.join(d, "file", "hf")], 2,
        r"--out .*file/hf cannot be written")
    same_bytes(os.path.join(d, "file"), PRECIOUS)
    listing(d, ["file"])


def case_export_disk_full():
    d = work("export_disk_full")
    run(["export-hf", imported(), "--out", os.path.join(d, "hf"), "--dtype", "fp32"], 1,
        r"writing --out .*hf failed.*partial export was removed", shell_prefix=no_space(64))
    listing(d, [])


def case_export_eot_outside_vocab():
    d = work("export_eot_outside_vocab")
    run(["export-hf", imported(), "--out", os.path.join(d, "hf"), "--eot_token", "96"], 2,
        r"--eot_token 96 is outside the vocabulary.*\[0, 95\]")
    listing(d, [])


def case_export_shard_mib_overflow():
    d = work("export_shard_mib_overflow")
    run(["export-hf", imported(), "--out", os.path.join(d, "hf"), "--shard_mib",
         str(2**50)], 2, r"--shard_mib must be in \[1, 1048576\]")
    listing(d, [])


def case_export_dtype_spelling():
    # Dtypes are spelled fp32 and bf16; the old f32 is refused naming fp32, before any output.
    d = work("export_dtype_spelling")
    run(["export-hf", imported(), "--out", os.path.join(d, "hf"), "--dtype", "f32"], 2,
        r"--dtype f32 is spelled fp32")
    run(["export-hf", imported(), "--out", os.path.join(d, "hf"), "--dtype", "fp16"], 2,
        r"--dtype must be bf16 or fp32, got 'fp16'")
    listing(d, [])


# ---- imported checkpoints in runs ---------------------------------------------------------------

def run_args(model, *extra):
    return [*extra, "--config", os.path.join(A.work, "..", f"{model}.ini"), "--data",
            os.path.join(fx(model), "tokens.h5"), "--seq_len=16", "--batch_tokens=32",
            "--device=cpu", "--eot_token=95"]


def case_eval_other_rope_theta():
    run(run_args("llama", "eval", "--checkpoint", imported(), "--batches=1",
                 "--rope_theta=500"), 2,
        r"llama.h5 was saved with another model config: rope_theta=10000 -> 500")


def case_init_from_other_windows():
    d = work("init_from_other_windows")
    run(run_args("gptoss", "train", "--init_from", imported("gptoss"), "--steps=1",
                 "--window_layers=all", f"--checkpoint_dir={d}/ck"), 2,
        r"gptoss.h5 was saved with another model config: window_layers=even -> all")


def case_init_from_hf_other_rope_theta():
    d = work("init_from_hf_other_rope_theta")
    run(run_args("llama", "train", "--init_from", fx("llama"), "--steps=1", "--rope_theta=500",
                 f"--checkpoint_dir={d}/ck"), 2,
        r"Hugging Face checkpoint .*llama .*another model config: rope_theta=10000 -> 500.*"
        r"--allow_config_change=rope_theta")
    # allow_config_change names the exception, as on resume.
    run(run_args("llama", "train", "--init_from", fx("llama"), "--steps=1", "--rope_theta=500",
                 "--allow_config_change=rope_theta", f"--checkpoint_dir={d}/ck2"), 0,
        r"allowed by allow_config_change.*init_from: parameters from the Hugging Face")


def crc32c(data):
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    c = 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def case_init_from_nonfinite():
    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        print("h5py and numpy are needed to damage a checkpoint")
        sys.exit(SKIP)
    d = work("init_from_nonfinite")
    ck = os.path.join(d, "nan.h5")
    shutil.copy(imported(), ck)
    with h5py.File(ck, "r+") as f:
        ds = f["/params/layers.1.attn.wo"]
        v = ds[...]
        v[2, 3] = numpy.nan
        ds[...] = v
        # The per-chunk CRC-32C hotpath checks, recomputed: the file is intact, its values not.
        rows = ds.chunks[0]
        crc = ds.attrs["crc32c"].copy()
        for c in range(len(crc)):
            crc[c] = crc32c(v[c * rows:(c + 1) * rows].astype("<f4").tobytes())
        ds.attrs["crc32c"] = crc
    run(run_args("llama", "train", "--init_from", ck, "--steps=1",
                 f"--checkpoint_dir={d}/ck"), 2,
        r"init_from: checkpoint .*nan.h5 dataset '/params/layers.1.attn.wo' holds non-finite")


def case_resume_imported():
    d = work("resume_imported")
    run(run_args("llama", "train", f"--resume={imported()}", "--steps=1",
                 f"--checkpoint_dir={d}/ck"), 2,
        r"llama.h5 is an imported checkpoint.*Use init_from=")


def main():
    global A
    p = argparse.ArgumentParser()
    p.add_argument("--hotpath", required=True)
    p.add_argument("--fixtures", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("case")
    A = p.parse_args()
    fn = globals().get("case_" + A.case)
    if fn is None:
        fail(f"no case {A.case}")
    fn()
    print(f"[hf_guard] {A.case}: as expected")


if __name__ == "__main__":
    main()
