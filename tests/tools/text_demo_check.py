#!/usr/bin/env python3
"""Checks what examples/text_demo/run_demo.sh left in WORKDIR:

  - the token files: 100 held-out documents and more than 500 for training, vocabulary 512 and
    end of text 0 in the manifest, every file matching its size and SHA-256;
  - the metrics JSONL has an eval_loss every 25 steps, and its last record is the last step's
    with the final evaluation (eval_loss, eval_tokens > 0);
  - the held-out loss fell: the last eval_loss is below the first by more than --drop;
  - the Hugging Face export holds config.json (the model's vocabulary), the safetensors and
    tokenizer.json, and, imported back, evaluates to the final held-out loss exactly (fp32).

  python3 tests/tools/text_demo_check.py WORKDIR [--drop 1.0] [--steps 200]
"""
import argparse
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

_checks = Checks("text_demo_check")
check, done = _checks.check, _checks.done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--drop", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args()
    w = a.work

    with open(os.path.join(w, "tokens", "manifest.json")) as f:
        m = json.load(f)
    check(m["documents"]["val"] == 100 and m["documents"]["train"] > 500, "documents",
          m["documents"])
    check(m["vocab_size"] == a.vocab and m["eot_token"] == 0, "vocab/eot", m["vocab_size"],
          m["eot_token"])
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch", "tools",
                        "corpus.py")
    r = subprocess.run([sys.executable, tool, "verify", os.path.join(w, "tokens")],
                       capture_output=True, text=True)
    check(r.returncode == 0, "corpus.py verify of the demo's token files:", r.stderr)

    recs = [json.loads(line) for line in open(os.path.join(w, "metrics.jsonl"))]
    evals = [(x["step"], x["eval_loss"]) for x in recs if "eval_loss" in x]
    last = recs[-1]
    check(last["step"] == a.steps and "eval_loss" in last, "the last record is not the last "
          "step's with the final evaluation:", last)
    check(last.get("eval_tokens", 0) > 0, "eval_tokens", last.get("eval_tokens"))
    check([s for s, _ in evals] == list(range(25, a.steps + 1, 25)), "evaluated steps",
          [s for s, _ in evals])
    check(len(evals) >= 2, "fewer than two evaluations", evals)
    if len(evals) >= 2:
        (s0, first), (s1, final) = evals[0], evals[-1]
        print(f"[text_demo_check] held-out loss: step {s0} {first:.4f} -> step {s1} {final:.4f}")
        check(s1 == a.steps, "the last evaluation is not of the last step", s1)
        check(final < first - a.drop, f"held-out loss fell by less than {a.drop}:", first, final)

        hf = os.path.join(w, "hf")
        with open(os.path.join(hf, "config.json")) as f:
            cfg = json.load(f)
        check(cfg.get("vocab_size") == a.vocab, "config.json vocab_size", cfg.get("vocab_size"))
        check(cfg.get("architectures") == ["LlamaForCausalLM"], "architectures",
              cfg.get("architectures"))
        check(glob.glob(os.path.join(hf, "*.safetensors")), "no safetensors in", hf)
        check(os.path.exists(os.path.join(hf, "tokenizer.json")), "no tokenizer.json in", hf)
        with open(os.path.join(w, "hf_eval.json")) as f:
            got = json.load(f)["eval_loss"]
        check(got == final, "the imported export's held-out loss", got, "is not the final one",
              final)
    return done("held-out loss fell; export written and loaded back")


if __name__ == "__main__":
    sys.exit(main())
