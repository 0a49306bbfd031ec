#!/usr/bin/env python3
"""Cases of launch/tools/corpus.py, one group per subcommand (each in its own WORKDIR):

  text WORKDIR     text files, one document per file and split at a delimiter: every token of
                   the output equals the tokenizer's own encoding of each document plus EOT; a
                   file reached twice (a link, a repeated name) is read once;
                   empty documents skipped and counted; bytes that are not UTF-8 are a
                   FILE:LINE error, or U+FFFD with --errors=replace
  jsonl WORKDIR    JSONL with a text field: exact tokens; a missing field, a non-string field,
                   invalid JSON and a torn last line are FILE:LINE errors, exit status 2,
                   nothing written; a last line without newline that is complete JSON is read
  parquet WORKDIR  Parquet with a string (and a binary) column: exact tokens; a missing column,
                   a null and non-UTF-8 bytes are refused naming the file and row
  vocab WORKDIR    ids at or beyond the vocabulary (--vocab_size, or a tokenizer whose ids leave
                   gaps) are refused naming the document; --eot_token outside it too
  split WORKDIR    --val_fraction and --val_docs: held-out and training documents are disjoint
                   and together every non-empty document; the same seed gives byte-identical
                   files whatever --workers, another seed another split; shards keep documents
                   whole and close at --shard_tokens
  output WORKDIR   an existing output is kept without --force; --force replaces only an earlier
                   output of the tool; a failed run leaves no output and no temporary; verify
                   finds a damaged shard
  bpe WORKDIR      a trained tokenizer is byte-identical across runs, has the asked size and
                   '<|endoftext|>' = 0, encodes any byte and decodes back to the text

Needs tokenizers, h5py and numpy (the tool's own needs); the parquet group needs pyarrow.
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "launch", "tools", "corpus.py")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

_checks = Checks("tools_py_corpus")
check, done = _checks.check, _checks.done

# Random-looking but fixed text: words drawn from a small list by a fixed generator.
WORDS = ["the", "licence", "copy", "free", "software", "you", "may", "not", "and", "of", "to",
         "any", "work", "under", "terms", "ünïcödé", "naïve", "€uro", "日本"]


def sentences(rng, n, lo=3, hi=12):
    return [" ".join(rng.choice(WORDS, size=rng.integers(lo, hi))) for _ in range(n)]


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return path


def fresh(work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)


def bpe(work, rng, vocab=320):
    """A byte-level BPE trained by the tool on random text; its path."""
    corpus = write(os.path.join(work, "bpe_corpus.txt"), "\n".join(sentences(rng, 300)) + "\n")
    tok = os.path.join(work, "tok.json")
    r = run("bpe", "--in", corpus, "--vocab_size", str(vocab), "--out", tok)
    assert r.returncode == 0, r.stderr
    os.remove(corpus)
    return tok


def read_out(out):
    """{'train': [docs], 'val': [docs]} (each a list of ids) and the manifest of an output."""
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    docs = {"train": [], "val": []}
    for s in m["shards"]:
        with h5py.File(os.path.join(out, s["file"]), "r") as h:
            t = h["tokens"][...]
            o = h["doc_offsets"][...]
            check(h["tokens"].dtype == np.uint32 and h["doc_offsets"].dtype == np.int64,
                  s["file"], "dtypes", h["tokens"].dtype, h["doc_offsets"].dtype)
            check("loss_mask" not in h, s["file"], "has a loss mask")
        check(o[0] == 0 and o[-1] == len(t) and (np.diff(o) > 0).all(), s["file"], "offsets", o)
        check(s["tokens"] == len(t) and s["documents"] == len(o) - 1, s["file"],
              "manifest counts", s, len(t), len(o) - 1)
        docs[s["split"]] += [t[o[i]:o[i + 1]].tolist() for i in range(len(o) - 1)]
    return docs, m


def expect_docs(out, texts, tok_path, eot, what, val=()):
    """The output holds exactly the non-empty texts (val: the held-out indices), each encoded
    by the tokenizer itself and followed by eot, in index order."""
    tok = Tokenizer.from_file(tok_path)
    want = {"train": [], "val": []}
    for i, t in enumerate(texts):
        ids = tok.encode(t, add_special_tokens=False).ids if t else []
        if ids:
            want["val" if i in val else "train"].append(ids + [eot])
    got, m = read_out(out)
    for split in ("train", "val"):
        check(got[split] == want[split], what, split, "tokens differ from the tokenizer's:",
              f"{len(got[split])} documents, {sum(map(len, got[split]))} tokens; want",
              f"{len(want[split])} documents, {sum(map(len, want[split]))} tokens")
    n_tokens = sum(map(len, want["train"])) + sum(map(len, want["val"]))
    n_empty = len(texts) - len(want["train"]) - len(want["val"])
    check(m["documents"] == {"read": len(texts), "empty": n_empty,
                             "train": len(want["train"]), "val": len(want["val"])},
          what, "document counts", m["documents"])
    check(m["train"]["tokens"] + m["val"]["tokens"] == n_tokens, what, "token count",
          m["train"], m["val"], n_tokens)
    return m


def refused(r, what, *needles, out=None):
    check(r.returncode == 2, what, "exit status", r.returncode, r.stderr[-400:])
    check("Traceback" not in r.stderr, what, "traceback:", r.stderr[-800:])
    for n in needles:
        check(n in r.stderr, what, f"message lacks '{n}':", r.stderr[-400:])
    if out is not None:
        check(not os.path.exists(out), what, "left", out)
        parent = os.path.dirname(os.path.abspath(out))
        tmps = [e for e in os.listdir(parent) if ".tmp" in e]
        check(not tmps, what, "left temporaries", tmps)


def tokenize(inputs, tok, out, *extra):
    args = ["tokenize", "--tokenizer", tok, "--out", out, "--workers", "1"]
    for i in inputs:
        args += ["--in", i]
    return run(*args, *extra)


# ---- groups -------------------------------------------------------------------------------------

def case_text(work, rng):
    tok = bpe(work, rng)
    d = os.path.join(work, "docs")
    os.makedirs(d)
    texts = ["\n".join(sentences(rng, 3)) + "\n" for _ in range(5)]
    texts[2] = ""  # an empty file is an empty document
    for i, t in enumerate(texts):
        write(os.path.join(d, f"doc{i}.txt"), t)
    # A link to a file the glob also matches, and a file named twice: each read once.
    os.symlink("doc1.txt", os.path.join(d, "link.txt"))
    out = os.path.join(work, "out_files")
    r = tokenize([os.path.join(d, "*.txt"), os.path.join(d, "doc0.txt")], tok, out)
    check(r.returncode == 0, "files: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, texts, tok, 0, "files")
        check("read once, where first named" in r.stderr and "link.txt" in r.stderr,
              "no note of the file read once", r.stderr)
        check("1 empty, skipped" in r.stdout and "'<|endoftext|>'" in r.stdout, "files summary",
              r.stdout)
        check("tokenize:" in r.stderr and "tokens/s" in r.stderr, "progress line", r.stderr)

    # Paragraphs of one file, split at blank lines; consecutive delimiters give empty ones.
    paras = [" ".join(sentences(rng, 2)) for _ in range(6)]
    paras[3] = ""
    body = "\n\n".join(paras)
    path = write(os.path.join(work, "paras.txt"), body)
    out = os.path.join(work, "out_paras")
    r = tokenize([path], tok, out, "--delimiter", "\\n\\n")
    check(r.returncode == 0, "delimiter: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, paras, tok, 0, "delimiter")

    # Not UTF-8 on line 3 of the second paragraph file: FILE:LINE, nothing written.
    bad = write(os.path.join(work, "bad.txt"), b"fine line\nanother\nbad \xff byte\nok\n")
    out = os.path.join(work, "out_bad")
    r = tokenize([path, bad], tok, out, "--delimiter", "\\n\\n")
    refused(r, "non-UTF-8", f"{bad}:3: not UTF-8 (byte 0xff at column 5)", "--errors=replace",
            out=out)
    r = tokenize([bad], tok, out, "--errors=replace")
    check(r.returncode == 0, "--errors=replace exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, ["fine line\nanother\nbad \ufffd byte\nok\n"], tok, 0, "--errors=replace")
    refused(tokenize([os.path.join(d, "*.md")], tok, os.path.join(work, "o")), "no match",
            "no file matches")
    refused(tokenize([d], tok, os.path.join(work, "o")), "directory", "is a directory")
    refused(tokenize([path], tok, os.path.join(work, "o"), "--delimiter", "\\q"), "escape",
            "unknown escape")
    return "text files: exact tokens, empty documents, non-UTF-8 bytes"


def case_jsonl(work, rng):
    tok = bpe(work, rng)
    texts = [" ".join(sentences(rng, 2)) for _ in range(8)]
    texts[1] = ""
    texts[5] = "line one\nline \"two\"\t€"
    lines = [json.dumps({"id": i, "text": t}, ensure_ascii=i % 2 == 0) for i, t in enumerate(texts)]
    good = write(os.path.join(work, "good.jsonl"), "\n".join(lines[:4]) + "\n\n")
    # The second file's last line has no newline but is complete JSON: it is read.
    last = write(os.path.join(work, "last.jsonl"), "\n".join(lines[4:]))
    out = os.path.join(work, "out")
    r = tokenize([good, last], tok, out)
    check(r.returncode == 0, "jsonl: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, texts, tok, 0, "jsonl")

    # --text_field names another field.
    body = write(os.path.join(work, "body.jsonl"),
                 "".join(json.dumps({"body": t}) + "\n" for t in texts))
    out = os.path.join(work, "out_body")
    r = tokenize([body], tok, out, "--text_field", "body")
    check(r.returncode == 0, "text_field: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, texts, tok, 0, "text_field")

    out = os.path.join(work, "out_bad")
    bad = write(os.path.join(work, "missing.jsonl"),
                '{"text": "a"}\n{"content": "b", "id": 2}\n{"text": 3}\n[1]\n{"text": "c",}\n')
    r = tokenize([good, bad], tok, out)
    refused(r, "jsonl mistakes", f"{bad}:2: no \"text\" field (fields: \"content\", \"id\")",
            f"{bad}:3: \"text\" is a number, expected a string",
            f"{bad}:4: expected an object", f"{bad}:5: invalid JSON", out=out)
    torn = write(os.path.join(work, "torn.jsonl"), '{"text": "a"}\n{"text": "b"}\n{"text": "cu')
    refused(tokenize([torn], tok, out), "torn last line", f"{torn}:3: the last line is cut off",
            out=out)
    utf = write(os.path.join(work, "utf.jsonl"), b'{"text": "a"}\n{"text": "b\xc3("}\n')
    refused(tokenize([utf], tok, out), "jsonl non-UTF-8", f"{utf}:2: not UTF-8 (byte 0xc3 at "
            "column 12)", out=out)
    sur = write(os.path.join(work, "surrogate.jsonl"), '{"text": "x\\ud800y"}\n')
    refused(tokenize([sur], tok, out), "lone surrogate", f"{sur}:1: \"text\" holds the lone "
            "surrogate U+D800", out=out)
    r = tokenize([utf, sur], tok, out, "--errors=replace")
    check(r.returncode == 0, "jsonl --errors=replace exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, ["a", "b\ufffd(", "x\ufffdy"], tok, 0, "jsonl --errors=replace")
    return "JSONL: exact tokens, missing field, torn last line, non-UTF-8"


def case_parquet(work, rng):
    import pyarrow as pa
    import pyarrow.parquet as pq
    tok = bpe(work, rng)
    texts = [" ".join(sentences(rng, 2)) for _ in range(2500)]  # more than one record batch
    texts[7] = ""
    p1 = os.path.join(work, "a.parquet")
    pq.write_table(pa.table({"n": list(range(2000)), "text": texts[:2000]}), p1)
    p2 = os.path.join(work, "b.parquet")
    pq.write_table(pa.table({"text": pa.array([t.encode() for t in texts[2000:]], pa.binary())}),
                   p2)
    out = os.path.join(work, "out")
    r = tokenize([p1, p2], tok, out, "--workers", "2")  # the later flag wins
    check(r.returncode == 0, "parquet: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        expect_docs(out, texts, tok, 0, "parquet")
    out = os.path.join(work, "out_bad")
    refused(tokenize([p1], tok, out, "--text_field", "body"), "missing column",
            f"{p1}: no column \"body\" (columns: \"n\", \"text\")", out=out)
    refused(tokenize([p1], tok, out, "--text_field", "n"), "int column",
            f"{p1}: column \"n\" holds int64, expected strings", out=out)
    pn = os.path.join(work, "null.parquet")
    pq.write_table(pa.table({"text": ["a", None, "b"]}), pn)
    refused(tokenize([pn], tok, out), "null", f"{pn}: row 1: \"text\" is null", out=out)
    pb = os.path.join(work, "bytes.parquet")
    pq.write_table(pa.table({"text": pa.array([b"ok", b"x\xffz"], pa.binary())}), pb)
    refused(tokenize([pb], tok, out), "binary not UTF-8", f"{pb}: row 1: not UTF-8", out=out)
    garbage = write(os.path.join(work, "garbage.parquet"), b"not parquet at all")
    refused(tokenize([garbage], tok, out), "not parquet", f"{garbage}: not a readable Parquet",
            out=out)
    return "Parquet: exact tokens over record batches, string and binary columns, bad columns"


def case_vocab(work, rng):
    tok = bpe(work, rng, vocab=320)
    tk = Tokenizer.from_file(tok)
    texts = [" ".join(sentences(rng, 1)) for _ in range(10)]
    path = write(os.path.join(work, "docs.jsonl"), "".join(json.dumps({"text": t}) + "\n"
                                                           for t in texts))
    # The first document holding an id >= 300 is the one named.
    first = next(i for i, t in enumerate(texts) if max(tk.encode(t).ids) >= 300)
    out = os.path.join(work, "out")
    refused(tokenize([path], tok, out, "--vocab_size", "300"), "--vocab_size",
            f"{path}:{first + 1}: token id", "is not below the vocabulary size 300", out=out)
    # A tokenizer whose ids leave a gap: its size is 3, but "b" is 1000.
    gap = os.path.join(work, "gap.json")
    g = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 1000},
                                   unk_token="<|endoftext|>"))
    g.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    g.save(gap)
    ab = write(os.path.join(work, "ab.jsonl"), '{"text": "a a"}\n{"text": "a b"}\n')
    refused(tokenize([ab], gap, out), "gap", f"{ab}:2: token id 1000 ('b') is not below the "
            "vocabulary size 3", out=out)
    r = tokenize([ab], gap, out, "--vocab_size", "1001")
    check(r.returncode == 0, "gap with --vocab_size 1001: exit", r.returncode, r.stderr)
    if r.returncode == 0:
        got, m = read_out(out)
        check(got["train"] == [[1, 1, 0], [1, 1000, 0]], "gap tokens", got)
        check("--vocab_size=1001 --eot_token=0" in r.stdout, "hint", r.stdout)
    out2 = os.path.join(work, "out2")
    refused(tokenize([ab], gap, out2, "--eot_token", "7"), "eot id", "end-of-text id 7 is not "
            "below the vocabulary size 3", out=out2)
    refused(tokenize([ab], gap, out2, "--eot_token", "<eos>"), "eot token",
            "--eot_token '<eos>' is not a token", out=out2)
    r = tokenize([ab], gap, out2, "--eot_token", "a", "--vocab_size", "1001")
    check(r.returncode == 0 and read_out(out2)[0]["train"] == [[1, 1, 1], [1, 1000, 1]],
          "--eot_token a", r.stderr)
    return "ids beyond the vocabulary name the document; --eot_token checked"


def case_split(work, rng):
    tok = bpe(work, rng)
    texts = [" ".join(sentences(rng, 2)) for _ in range(400)]
    for i in (3, 50, 51, 399):
        texts[i] = ""
    path = write(os.path.join(work, "docs.jsonl"), "".join(json.dumps({"text": t}) + "\n"
                                                           for t in texts))
    nonempty = {i for i, t in enumerate(texts) if t}

    def split(name, *extra, workers="1"):
        out = os.path.join(work, name)
        r = run("tokenize", "--tokenizer", tok, "--in", path, "--out", out, "--workers", workers,
                *extra)
        check(r.returncode == 0, name, "exit", r.returncode, r.stderr)
        if r.returncode != 0:
            return None, None
        with open(os.path.join(out, "manifest.json")) as f:
            val = set(json.load(f)["val_indices"])
        m = expect_docs(out, texts, tok, 0, name, val)
        return out, (val, m)

    a, (va, ma) = split("frac_a", "--val_fraction", "0.1", "--seed", "7")
    b, (vb, mb) = split("frac_b", "--val_fraction", "0.1", "--seed", "7", "--shard_tokens",
                        "500", workers="3")
    c, (vc, _) = split("frac_c", "--val_fraction", "0.1", "--seed", "8")
    d, (vd, md) = split("docs", "--val_docs", "25", "--seed", "7")
    check(va <= nonempty and 20 <= len(va) <= 60, "val_fraction 0.1 of 396:", len(va))
    check(va == vb, "the same seed, other workers and shards: another split")
    check(va != vc, "seeds 7 and 8 give the same split")
    check(len(vd) == 25 and vd <= nonempty, "val_docs 25:", len(vd))
    # Each held-out set is disjoint from its training set by construction of expect_docs (every
    # non-empty index lands in exactly one); check it on the token files too.
    ga, _ = read_out(a)
    check(not {tuple(x) for x in ga["train"]} & {tuple(x) for x in ga["val"]},
          "a held-out document also in the training files")
    # Byte-identical files for the same flags, whatever --workers.
    e, _ = split("frac_e", "--val_fraction", "0.1", "--seed", "7", workers="2")
    for s in ma["shards"]:
        with open(os.path.join(a, s["file"]), "rb") as f1, open(os.path.join(e, s["file"]),
                                                                "rb") as f2:
            check(f1.read() == f2.read(), s["file"], "differs between --workers 1 and 2")
    # Shards: documents whole, each shard closed before the document that would pass 500 tokens.
    tr = [s for s in mb["shards"] if s["split"] == "train"]
    check(len(tr) > 3 and all(s["tokens"] <= 500 for s in tr), "shards", [s["tokens"] for s in tr])
    check(sum(s["tokens"] for s in tr) == ma["train"]["tokens"], "shard tokens add up")
    check(run("verify", b).returncode == 0, "verify of a good output")
    refused(run("tokenize", "--tokenizer", tok, "--in", path, "--out", os.path.join(work, "x"),
                "--val_docs", "396"), "val_docs all", "at least one must stay")
    refused(run("tokenize", "--tokenizer", tok, "--in", path, "--out", os.path.join(work, "x"),
                "--val_fraction", "0.2", "--val_docs", "3"), "both", "both given")
    refused(run("tokenize", "--tokenizer", tok, "--in", path, "--out", os.path.join(work, "x"),
                "--val_fraction", "1e-9"), "tiny fraction", "holds out none")
    return "held-out split disjoint, stable across runs and workers, seeded; shards"


def case_output(work, rng):
    tok = bpe(work, rng)
    path = write(os.path.join(work, "a.txt"), "some text here\n")
    out = os.path.join(work, "out")
    check(tokenize([path], tok, out).returncode == 0, "first write")
    with open(os.path.join(out, "manifest.json"), "rb") as f:
        before = f.read()
    write(path, "other text\n")
    refused(tokenize([path], tok, out), "existing output", "pass --force")
    with open(os.path.join(out, "manifest.json"), "rb") as f:
        check(f.read() == before, "the existing output was changed")
    r = tokenize([path], tok, out, "--force")
    check(r.returncode == 0, "--force", r.stderr)
    if r.returncode == 0:
        expect_docs(out, ["other text\n"], tok, 0, "--force")
    # A directory holding anything else is never replaced, --force or not.
    user = os.path.join(work, "user")
    os.makedirs(user)
    write(os.path.join(user, "notes.txt"), "mine")
    refused(tokenize([path], tok, user, "--force"), "foreign dir", "did not write (notes.txt)")
    check(os.listdir(user) == ["notes.txt"], "foreign directory changed", os.listdir(user))
    write(os.path.join(out, "extra.txt"), "mine too")
    refused(tokenize([path], tok, out, "--force"), "extra file", "did not write (extra.txt)")
    os.remove(os.path.join(out, "extra.txt"))
    inside = write(os.path.join(out, "input.txt"), "x")
    refused(tokenize([inside], tok, out, "--force"), "input inside", "holds the input")
    os.remove(inside)
    other = write(os.path.join(work, "other.txt"), "x")
    refused(tokenize([path], tok, other), "a file", "is not a directory")
    # An empty directory is filled.
    empty = os.path.join(work, "empty")
    os.makedirs(empty)
    check(tokenize([path], tok, empty).returncode == 0, "empty directory")
    # A failure after reading (an id beyond the vocabulary) leaves nothing behind.
    fail_out = os.path.join(work, "fail")
    refused(tokenize([path], tok, fail_out, "--vocab_size", "5"), "late failure",
            "not below the vocabulary size 5", out=fail_out)
    refused(run("tokenize", "--tokenizer", path, "--in", path, "--out", fail_out),
            "bad tokenizer", f"--tokenizer {path}: not a Hugging Face tokenizer.json",
            out=fail_out)
    # verify names a damaged shard.
    shard = os.path.join(out, "train-00000.h5")
    with open(shard, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    refused(run("verify", out), "verify damaged", f"{shard}: SHA-256 differs")
    return "outputs: kept without --force, only the tool's own replaced, nothing left on failure"


def case_bpe(work, rng):
    text = "\n\n".join(" ".join(sentences(rng, 3)) for _ in range(200))
    corpus = write(os.path.join(work, "corpus.txt"), text)
    outs = []
    for k in range(2):
        out = os.path.join(work, f"tok{k}.json")
        r = run("bpe", "--in", corpus, "--delimiter", "\\n\\n", "--vocab_size", "300",
                "--out", out)
        check(r.returncode == 0, "bpe exit", r.returncode, r.stderr)
        outs.append(out)
    with open(outs[0], "rb") as f1, open(outs[1], "rb") as f2:
        check(f1.read() == f2.read(), "two trainings differ")
    tok = Tokenizer.from_file(outs[0])
    check(tok.get_vocab_size() == 300, "vocab size", tok.get_vocab_size())
    check(tok.token_to_id("<|endoftext|>") == 0, "eot id", tok.token_to_id("<|endoftext|>"))
    sample = "naïve 日本 text never seen: \x01\x7f ✓"
    ids = tok.encode(sample).ids
    check(tok.decode(ids) == sample, "round trip", repr(tok.decode(ids)))
    check(len(ids) < len(sample.encode()), "merges shorten known words",
          len(ids), len(sample.encode()))
    refused(run("bpe", "--in", corpus, "--vocab_size", "300", "--out", outs[0]), "existing",
            "pass --force")
    refused(run("bpe", "--in", corpus, "--vocab_size", "100", "--out",
                os.path.join(work, "t.json")), "small vocab", "must be in 257..")
    refused(run("bpe", "--in", corpus, "--vocab_size", "300", "--out", corpus, "--force"),
            "over the input", "is the input")
    bad = write(os.path.join(work, "bad.jsonl"), '{"text": "a"}\n{"txt": "b"}\n')
    t2 = os.path.join(work, "t2.json")
    refused(run("bpe", "--in", bad, "--vocab_size", "300", "--out", t2), "bpe input mistake",
            f"{bad}:2: no \"text\" field", out=t2)
    return "BPE: deterministic, its size, eot 0, any byte round-trips"


CASES = {"text": case_text, "jsonl": case_jsonl, "parquet": case_parquet, "vocab": case_vocab,
         "split": case_split, "output": case_output, "bpe": case_bpe}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in CASES:
        print(f"usage: {sys.argv[0]} {{{'|'.join(CASES)}}} WORKDIR", file=sys.stderr)
        return 2
    work = os.path.abspath(sys.argv[2])
    fresh(work)
    what = CASES[sys.argv[1]](work, np.random.default_rng(12345))
    return done(what)


if __name__ == "__main__":
    sys.exit(main())
