#!/usr/bin/env python3
"""Turns a text corpus into hotpath token files; trains a small BPE tokenizer on a corpus.

  corpus.py bpe      --in PATH|GLOB [--in ...] --vocab_size N --out tokenizer.json
  corpus.py tokenize --in PATH|GLOB [--in ...] --tokenizer tokenizer.json --out DIR
                     [--val_fraction F | --val_docs N] [--seed S]

Inputs (--in, repeatable: a path or a glob, a glob's matches in sorted order; --format picks the
kind, by default from the extension):
  text     (any other extension) one document per file, or with --delimiter documents separated
           by that string (backslash escapes \\n \\t \\r \\\\ are read: --delimiter '\\n\\n'
           splits at blank lines). Documents are the pieces as they are, newlines included.
  jsonl    (.jsonl .ndjson .json) one JSON object per line, the document in --text_field
           (default "text"); blank lines are skipped
  parquet  (.parquet .pq) the document in the string column --text_field (needs pyarrow)
Documents are numbered 0, 1, ... in input order (empty ones included); that index names them.

tokenize: every document is encoded with the Hugging Face tokenizer.json (no special tokens
added) and followed by the end-of-text id: --eot_token (a token of the tokenizer or an id), else
the tokenizer's '<|endoftext|>'. A document with no tokens is skipped and counted as empty. Every
id must be below --vocab_size (default: the tokenizer's size, added tokens included) or the
run stops naming the document. The held-out split is by document: document i is held out when
splitmix64(splitmix64(--seed) xor i) / 2^64 < --val_fraction, or, with --val_docs N, the N
non-empty documents with the smallest such hash are; the split and the output bytes depend only
on the inputs, the tokenizer and the flags, never on --workers. DIR receives
  train-00000.h5 ...  val-00000.h5 ...  manifest.json
token files in the layout of docs/data.md (HDF5 1.10, checksummed metadata; a document never
spans two files; a file is closed once the next document would take it past --shard_tokens)
and a manifest with the counts, the flags and every file's size and SHA-256 (`corpus.py verify
DIR` checks them). Train with --data='DIR/train-*.h5' --eval_data='DIR/val-*.h5'
--vocab_size=V --eot_token=E (the summary prints the values).

bpe: trains a byte-level BPE tokenizer (every byte is a token, so any text encodes) of
--vocab_size entries, the --special tokens first (default '<|endoftext|>', id 0), and writes it
as tokenizer.json. The same corpus and flags give the same file.

Outputs are written under temporary names beside their final ones and renamed when complete; a
failure or a signal removes them. An existing output is refused without --force (tokenize:
--force replaces only a directory this tool wrote, or an empty one; an input is never replaced).
Input mistakes (not UTF-8 -- or --errors=replace --, invalid or cut-off JSON, a missing field or
column, a token id beyond the vocabulary) are reported as FILE:LINE: ... (Parquet: FILE: row R,
counted from 0) and end with exit status 2, nothing written. Needs tokenizers, h5py, numpy
(and pyarrow for Parquet).
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import token_h5  # noqa: E402
from tool_cli import fail  # noqa: E402
import tool_cli  # noqa: E402

MAX_REPORTED = 20  # input mistakes listed before the run stops
BATCH_DOCS = 256  # documents per unit of work
FORMAT = "hotpath-corpus-tokens"
GOLDEN = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1




def need(*modules):
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            fail(f"needs the Python package '{m}' (pip install {m})")


def type_name(v):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def unescape(s):
    table = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}

    def sub(m):
        c = m.group(1)
        if c not in table:
            fail(f"--delimiter '{s}': unknown escape '\\{c}' (known: \\n \\t \\r \\\\)")
        return table[c]
    return re.sub(r"\\(.)", sub, s)


# ---- inputs -------------------------------------------------------------------------------------

def expand_inputs(patterns):
    """The files named by --in, in order; a glob's matches sorted. A file named again (or
reached again through a link) is read once, where first named."""
    paths = []
    for p in patterns:
        if any(c in p for c in "*?["):
            matches = sorted(m for m in glob.glob(p, recursive=True) if not os.path.isdir(m))
            if not matches:
                fail(f"--in {p}: no file matches the pattern")
            paths.extend(matches)
            continue
        if not os.path.exists(p):
            fail(f"--in {p}: no such file")
        if os.path.isdir(p):
            fail(f"--in {p}: is a directory; give its files or a glob such as '{p}/*.txt'")
        paths.append(p)
    seen, unique, again = {}, [], []
    for p in paths:
        key = os.path.realpath(p)
        if key in seen:
            again.append(f"{p} (= {seen[key]})")
            continue
        seen[key] = p
        unique.append(p)
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            fail(f"--in {p}: cannot be read: {e.strerror}")
    if again:
        print(f"note: read once, where first named: {', '.join(again)}", file=sys.stderr)
    return unique


def kind_of(path, fmt):
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext in (".parquet", ".pq"):
        return "parquet"
    return "text"


class Reader:
    """Yields (location, text) of every document of the inputs, in order. Mistakes go to
    self.errors; reading stops once MAX_REPORTED of them are known."""

    def __init__(self, paths, a):
        self.paths = paths
        self.a = a
        self.errors = []
        self.delimiter = None if a.delimiter is None else unescape(a.delimiter)
        if self.delimiter == "":
            fail("--delimiter is empty: give the string between documents (e.g. '\\n\\n')")

    def full(self):
        return len(self.errors) >= MAX_REPORTED

    def error(self, msg):
        if not self.full():
            self.errors.append(msg)

    def __iter__(self):
        for path in self.paths:
            if self.full():
                return
            kind = kind_of(path, self.a.format)
            if kind == "jsonl":
                yield from self.jsonl(path)
            elif kind == "parquet":
                yield from self.parquet(path)
            else:
                yield from self.text(path)

    def bad_utf8(self, path, lineno, raw, e):
        self.error(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                   "--errors=replace reads such bytes as U+FFFD")

    def text(self, path):
        with open(path, "rb") as f:
            data = f.read()
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            if self.a.errors != "replace":
                # UTF-8 never uses byte 0x0a inside a character: lines can be checked one by one.
                for lineno, raw in enumerate(data.split(b"\n"), 1):
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        self.bad_utf8(path, lineno, raw, e)
                return
            text = data.decode("utf-8", errors="replace")
        if self.delimiter is None:
            yield path, text
            return
        lineno, step = 1, self.delimiter.count("\n")
        for piece in text.split(self.delimiter):
            yield f"{path}:{lineno}", piece
            lineno += piece.count("\n") + step

    def jsonl(self, path):
        field = self.a.text_field
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if self.full():
                    return
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    if self.a.errors != "replace":
                        self.bad_utf8(path, lineno, raw, e)
                        continue
                    line = raw.decode("utf-8", errors="replace")
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    msg = getattr(e, "msg", str(e))
                    if not raw.endswith(b"\n"):
                        self.error(f"{path}:{lineno}: the last line is cut off: it has no newline "
                                   f"at its end and is not complete JSON ({msg}); the file was "
                                   "not completely written")
                    else:
                        col = getattr(e, "colno", None)
                        self.error(f"{path}:{lineno}: invalid JSON: {msg}"
                                   + (f" (column {col})" if col else ""))
                    continue
                if not isinstance(obj, dict):
                    self.error(f"{path}:{lineno}: expected an object with a string \"{field}\", "
                               f"got {type_name(obj)}")
                    continue
                if field not in obj:
                    keys = ", ".join(f"\"{k}\"" for k in list(obj)[:8]) or "none"
                    self.error(f"{path}:{lineno}: no \"{field}\" field (fields: {keys}); "
                               "--text_field names the field that holds the text")
                    continue
                text = obj[field]
                if not isinstance(text, str):
                    self.error(f"{path}:{lineno}: \"{field}\" is {type_name(text)}, expected a "
                               "string")
                    continue
                if b"\\u" in raw or b"\\U" in raw:  # an escaped lone surrogate is not Unicode
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        if self.a.errors != "replace":
                            self.error(f"{path}:{lineno}: \"{field}\" holds the lone surrogate "
                                       f"U+{ord(text[e.start]):04X} (not Unicode); "
                                       "--errors=replace reads it as U+FFFD")
                            continue
                        text = re.sub("[\ud800-\udfff]", "\ufffd", text)
                yield f"{path}:{lineno}", text

    def parquet(self, path):
        need("pyarrow")
        import pyarrow as pa
        import pyarrow.parquet as pq
        field = self.a.text_field
        try:
            pf = pq.ParquetFile(path)
            schema = pf.schema_arrow
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            self.error(f"{path}: not a readable Parquet file: {first_line(e)}")
            return
        if field not in schema.names:
            cols = ", ".join(f"\"{n}\"" for n in schema.names[:8]) or "none"
            self.error(f"{path}: no column \"{field}\" (columns: {cols}); --text_field names the "
                       "column that holds the text")
            return
        typ = schema.field(field).type
        is_str = pa.types.is_string(typ) or pa.types.is_large_string(typ)
        is_bin = pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
        if not (is_str or is_bin):
            self.error(f"{path}: column \"{field}\" holds {typ}, expected strings")
            return
        row = 0
        try:
            for batch in pf.iter_batches(columns=[field], batch_size=1024):
                for v in batch.column(0).to_pylist():
                    if self.full():
                        return
                    loc = f"{path}: row {row}"
                    row += 1
                    if v is None:
                        self.error(f"{loc}: \"{field}\" is null, expected a string")
                        continue
                    if is_bin:
                        try:
                            v = v.decode("utf-8")
                        except UnicodeDecodeError as e:
                            if self.a.errors != "replace":
                                self.error(f"{loc}: not UTF-8 (byte 0x{v[e.start]:02x} at byte "
                                           f"{e.start}); --errors=replace reads such bytes as "
                                           "U+FFFD")
                                continue
                            v = v.decode("utf-8", errors="replace")
                    yield loc, v
        except Exception as e:  # a damaged page, invalid UTF-8 in a string column, ...
            self.error(f"{path}: row {row}: cannot be read: {first_line(e)}")


def first_line(e):
    s = str(e)
    return s.splitlines()[0] if s else type(e).__name__


def report(errors, what):
    shown = errors[:MAX_REPORTED]
    tail = "\n(the first mistakes; there may be more)" if len(errors) >= MAX_REPORTED else ""
    fail("\n".join(shown) + tail + f"\n{len(shown)} mistake(s) in the input; {what}")


# ---- tokenizer ----------------------------------------------------------------------------------

def load_tokenizer(path):
    need("tokenizers")
    from tokenizers import Tokenizer
    if not os.path.exists(path):
        fail(f"--tokenizer {path}: no such file")
    if os.path.isdir(path):
        fail(f"--tokenizer {path}: is a directory, expected a tokenizer.json file")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exceptions for any malformed file
        fail(f"--tokenizer {path}: not a Hugging Face tokenizer.json: {first_line(e)}")


def eot_id(tok, a, vocab):
    """The end-of-text id and how it was chosen."""
    if a.eot_token is None:
        eot = tok.token_to_id("<|endoftext|>")
        if eot is None:
            fail(f"--tokenizer {a.tokenizer} has no token '<|endoftext|>': name the end-of-text "
                 "token with --eot_token (a token of the tokenizer or an id)")
        how = "the tokenizer's '<|endoftext|>'"
    elif a.eot_token.isascii() and a.eot_token.isdigit():
        eot = int(a.eot_token)
        how = f"--eot_token {eot}"
    else:
        eot = tok.token_to_id(a.eot_token)
        if eot is None:
            fail(f"--eot_token '{a.eot_token}' is not a token of {a.tokenizer} (give a token of "
                 f"its vocabulary such as '<|endoftext|>', or an id in 0..{vocab - 1})")
        how = f"--eot_token '{a.eot_token}'"
    if eot >= vocab:
        fail(f"--eot_token: the end-of-text id {eot} is not below the vocabulary size {vocab} "
             f"(valid: 0..{vocab - 1})")
    return eot, how


_worker_tok = None


def worker_init(path):
    global _worker_tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from tokenizers import Tokenizer
    _worker_tok = Tokenizer.from_file(path)


def encode(tok, texts):
    """(lengths, ids) of the texts encoded without special tokens, ids concatenated."""
    import numpy as np
    encs = tok.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    ids = np.fromiter((i for e in encs for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
    return lengths, ids


def worker_encode(texts):
    return encode(_worker_tok, texts)


def splitmix64(z):
    """splitmix64 of the uint64 values z (numpy arrays wrap modulo 2^64)."""
    import numpy as np
    z = z + np.uint64(GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_hash(n, seed):
    """splitmix64(splitmix64(seed) xor i) of every document index i < n, as uint64."""
    import numpy as np
    key = splitmix64(np.array([seed & MASK64], dtype=np.uint64))[0]
    return splitmix64(np.arange(n, dtype=np.uint64) ^ key)


# ---- output directory ---------------------------------------------------------------------------

def is_within(path, directory):
    p, d = os.path.realpath(path), os.path.realpath(directory)
    return p == d or p.startswith(d.rstrip(os.sep) + os.sep)


def previous_output(out):
    """The files of an earlier output of this tool in out, or None if out holds anything else."""
    try:
        with open(os.path.join(out, "manifest.json")) as f:
            m = json.load(f)
        files = {s["file"] for s in m["shards"]} | {"manifest.json"}
        if m.get("format") != FORMAT:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files


def prepare_output(a, inputs):
    """Checks --out and creates the temporary directory beside it; returns its path."""
    out = a.out.rstrip(os.sep) or a.out
    for p in inputs + [a.tokenizer]:
        if is_within(p, out):
            fail(f"--out {a.out} holds the input {p}: choose another output directory "
                 "(--force never removes an input)")
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            fail(f"--out {a.out} exists and is not a directory: choose another name")
        entries = os.listdir(out)
        if entries:
            ours = previous_output(out)
            foreign = sorted(set(entries) - ours) if ours is not None else sorted(entries)
            if foreign:
                fail(f"--out {a.out} holds files this tool did not write ({', '.join(foreign[:5])}"
                     f"{', ...' if len(foreign) > 5 else ''}): choose another directory")
            if not a.force:
                fail(f"--out {a.out} holds an earlier output: pass --force to replace it, or "
                     "choose another directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        fail(f"--out {a.out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"--out {a.out}: directory {parent} is not writable")
    return tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(os.path.abspath(out))
                            + ".tmp-")


def publish(tmp, out, force):
    """Renames the complete directory tmp to out; an earlier out (empty, or with --force an
    earlier output) is removed only once the new one is in place."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    if not os.path.lexists(out):
        try:
            os.rename(tmp, out)
        except OSError:
            if os.path.lexists(out):
                fail(f"--out {out} appeared while writing: pass --force or choose another name")
            raise
    else:
        entries = os.listdir(out)
        if entries and (not force or previous_output(out) is None or
                        set(entries) - previous_output(out)):
            fail(f"--out {out} changed while writing: it now holds other files; nothing replaced")
        aside = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(out) + ".old-")
        old = os.path.join(aside, "previous")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            os.rename(old, out)
            os.rmdir(aside)
            raise
        shutil.rmtree(aside)
    token_h5.fsync_dir(parent)


# ---- tokenize -----------------------------------------------------------------------------------

class Progress:
    def __init__(self, every):
        self.every = every
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def show(self, docs, tokens, chars, final=False):
        now = time.monotonic()
        if not final and (self.every <= 0 or now - self.last < self.every):
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        line = (f"tokenize: {docs} documents, {tokens} tokens, {chars / 1e6:.2f}M characters, "
                f"{tokens / dt:.4g} tokens/s, {docs / dt:.4g} documents/s")
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def tokenize_all(a, reader, tok, vocab, flat_path, progress):
    """Reads and encodes every document into flat_path (uint32, no EOT), in document order.
    Returns the per-document token counts and the number of characters read."""
    import numpy as np
    lengths = []
    counts = {"tokens": 0, "chars": 0}
    pending = collections.deque()  # (result, or its future under a pool; locations)
    pool = None
    workers = a.workers if a.workers > 0 else len(os.sched_getaffinity(0))
    if workers > 1:
        import multiprocessing
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
        pool = multiprocessing.get_context("fork").Pool(workers, worker_init, (a.tokenizer,))
    ok = False
    try:
        with open(flat_path, "wb") as flat:
            def drain(limit):
                while len(pending) > limit:
                    res, locs = pending.popleft()
                    lens, ids = res.get() if pool else res
                    if reader.errors:
                        continue  # tokenize nothing more once the input is known to be bad
                    over = np.nonzero(ids >= vocab)[0]
                    if over.size:
                        ends = np.cumsum(lens)
                        seen = set()
                        for k in over:
                            d = int(np.searchsorted(ends, k, side="right"))
                            if d in seen:
                                continue
                            seen.add(d)
                            t = int(ids[k])
                            piece = tok.id_to_token(t)
                            reader.error(
                                f"{locs[d]}: token id {t}"
                                + (f" ('{piece}')" if piece is not None else "")
                                + f" is not below the vocabulary size {vocab} (--vocab_size, "
                                "default the tokenizer's size): the tokenizer does not fit the "
                                "vocabulary")
                        continue
                    flat.write(ids.astype(np.uint32).tobytes())
                    lengths.extend(lens.tolist())
                    counts["tokens"] += int(ids.size)
                    progress.show(len(lengths), counts["tokens"], counts["chars"])

            texts, locs = [], []

            def submit():
                if not reader.errors:
                    work = pool.apply_async(worker_encode, (texts,)) if pool else encode(tok, texts)
                    pending.append((work, locs))
                drain(2 * workers if pool else 0)

            for loc, text in reader:
                counts["chars"] += len(text)
                texts.append(text)
                locs.append(loc)
                if len(texts) == BATCH_DOCS:
                    submit()
                    texts, locs = [], []
            if texts:
                submit()
            drain(0)
        ok = True
    finally:
        if pool:
            if ok:
                pool.close()
            else:
                pool.terminate()
            pool.join()
    return lengths, counts["chars"]


def write_split(tmp, name, docs, starts, lengths, flat, eot, shard_tokens):
    """Writes the documents docs (indices, in order) as NAME-00000.h5 ... in tmp; returns the
    shards' records."""
    import numpy as np
    shards = []
    pieces, offsets, n = [], [0], 0

    def flush():
        file = f"{name}-{len(shards):05d}.h5"
        path = os.path.join(tmp, file)
        size = token_h5.write_tokens(path, np.concatenate(pieces), offsets)
        shards.append({"file": file, "split": name, "documents": len(offsets) - 1,
                       "tokens": int(offsets[-1]), "bytes": size,
                       "sha256": token_h5.sha256_file(path)})

    eot_arr = np.array([eot], dtype=np.uint32)
    for d in docs:
        m = int(lengths[d]) + 1
        if n > 0 and n + m > shard_tokens:
            flush()
            pieces, offsets, n = [], [0], 0
        pieces.append(flat[starts[d]:starts[d] + lengths[d]])
        pieces.append(eot_arr)
        n += m
        offsets.append(n)
    if n > 0:
        flush()
    return shards


def run_tokenize(a):
    if a.val_fraction is not None and a.val_docs is not None:
        fail("--val_fraction and --val_docs both given: choose one way to hold documents out")
    if a.val_fraction is not None and not 0.0 <= a.val_fraction < 1.0:
        fail(f"--val_fraction {a.val_fraction}: must be in [0, 1)")
    if a.val_docs is not None and a.val_docs < 0:
        fail(f"--val_docs {a.val_docs}: must be >= 0")
    if a.shard_tokens < 1:
        fail(f"--shard_tokens {a.shard_tokens}: must be >= 1")
    if a.vocab_size is not None and not 1 <= a.vocab_size <= 2 ** 31:
        fail(f"--vocab_size {a.vocab_size}: must be in 1..2^31")
    if a.seed < 0:
        fail(f"--seed {a.seed}: must be >= 0")
    paths = expand_inputs(a.inputs)
    reader = Reader(paths, a)
    need("h5py", "numpy")
    import numpy as np
    tok = load_tokenizer(a.tokenizer)
    tok_size = tok.get_vocab_size(with_added_tokens=True)
    vocab = a.vocab_size if a.vocab_size is not None else tok_size
    eot, eot_how = eot_id(tok, a, vocab)
    if any(kind_of(p, a.format) == "parquet" for p in paths):
        need("pyarrow")
    tmp = prepare_output(a, paths)
    try:
        flat_path = os.path.join(tmp, ".tokens.u32")
        progress = Progress(a.progress_every)
        lengths, chars = tokenize_all(a, reader, tok, vocab, flat_path, progress)
        if reader.errors:
            report(reader.errors, "nothing written")
        lengths = np.asarray(lengths, dtype=np.int64)
        n_docs = int(lengths.size)
        progress.show(n_docs, int(lengths.sum()), chars, final=True)
        nonempty = lengths > 0
        n_nonempty = int(nonempty.sum())
        if n_nonempty == 0:
            fail(f"the input ({len(paths)} file(s), {n_docs} documents) holds no text: every "
                 "document is empty")
        h = split_hash(n_docs, a.seed)
        val = np.zeros(n_docs, dtype=bool)
        if a.val_fraction:
            # The top 53 bits as a double in [0, 1): exact, so the rule is the one documented.
            val = nonempty & ((h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53 < a.val_fraction)
            if not val.any():
                fail(f"--val_fraction {a.val_fraction} holds out none of the {n_nonempty} "
                     "non-empty documents: raise it, or give --val_docs N")
        elif a.val_docs:
            if a.val_docs >= n_nonempty:
                fail(f"--val_docs {a.val_docs}: the input has {n_nonempty} non-empty documents; "
                     "at least one must stay for training")
            cand = np.nonzero(nonempty)[0]
            chosen = cand[np.lexsort((cand, h[cand]))[:a.val_docs]]
            val[chosen] = True
        train = nonempty & ~val
        if not train.any():
            fail(f"--val_fraction {a.val_fraction} holds out every document: lower it")
        starts = np.zeros(n_docs, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        total = int(lengths.sum())
        flat = (np.memmap(flat_path, dtype=np.uint32, mode="r", shape=(total,)) if total
                else np.zeros(0, np.uint32))
        shards = []
        for name, sel in (("train", train), ("val", val)):
            shards += write_split(tmp, name, np.nonzero(sel)[0], starts, lengths, flat, eot,
                                  a.shard_tokens)
        del flat
        os.remove(flat_path)

        def totals(split):
            ss = [s for s in shards if s["split"] == split]
            return {"documents": sum(s["documents"] for s in ss),
                    "tokens": sum(s["tokens"] for s in ss), "shards": len(ss),
                    "bytes": sum(s["bytes"] for s in ss)}
        manifest = {
            "format": FORMAT,
            "tokenizer": os.path.abspath(a.tokenizer),
            "tokenizer_sha256": token_h5.sha256_file(a.tokenizer),
            "tokenizer_vocab_size": tok_size,
            "vocab_size": vocab,
            "eot_token": eot,
            "eot_from": eot_how,
            "inputs": [os.path.abspath(p) for p in paths],
            "format_args": {"format": a.format, "text_field": a.text_field,
                            "delimiter": a.delimiter, "errors": a.errors},
            "split": {"seed": a.seed, "val_fraction": a.val_fraction, "val_docs": a.val_docs,
                      "rule": "document i is held out when splitmix64(splitmix64(seed) xor i) "
                              "/ 2^64 < val_fraction, or is among the val_docs non-empty "
                              "documents of smallest hash"},
            "documents": {"read": n_docs, "empty": n_docs - n_nonempty,
                          "train": int(train.sum()), "val": int(val.sum())},
            "val_indices": np.nonzero(val)[0].tolist(),
            "train": totals("train"),
            "val": totals("val"),
            "shard_tokens": a.shard_tokens,
            "shards": shards,
        }
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        token_h5.fsync_dir(tmp)
        publish(tmp, a.out, a.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tr, va = manifest["train"], manifest["val"]
    print(f"wrote {a.out}: {n_docs} documents read ({n_docs - n_nonempty} empty, skipped); "
          f"train {tr['documents']} documents, {tr['tokens']} tokens in {tr['shards']} shard(s); "
          f"val {va['documents']} documents, {va['tokens']} tokens in {va['shards']} shard(s); "
          f"{tr['bytes'] + va['bytes']} bytes")
    print(f"end of text: id {eot} ({eot_how}) after every document; vocabulary {vocab}"
          + ("" if vocab == tok_size else f" (the tokenizer has {tok_size})"))
    out = a.out.rstrip(os.sep) or a.out
    hint = f"--data='{out}/train-*.h5' --vocab_size={vocab} --eot_token={eot}"
    if va["documents"]:
        hint += f" --eval_data='{out}/val-*.h5'"
    print(f"train with: hotpath train --config MODEL.ini {hint}")


# ---- verify -------------------------------------------------------------------------------------

def run_verify(a):
    path = os.path.join(a.dir, "manifest.json")
    try:
        with open(path) as f:
            m = json.load(f)
        if m.get("format") != FORMAT:
            fail(f"{path}: not a manifest of corpus.py tokenize (format {m.get('format')!r})")
        shards = m["shards"]
    except FileNotFoundError:
        fail(f"{a.dir}: no manifest.json (not an output of corpus.py tokenize)")
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{path}: damaged manifest: {first_line(e)}")
    bad = []
    for s in shards:
        p = os.path.join(a.dir, s["file"])
        if not os.path.exists(p):
            bad.append(f"{p}: missing")
        elif os.path.getsize(p) != s["bytes"]:
            bad.append(f"{p}: {os.path.getsize(p)} bytes, the manifest says {s['bytes']}")
        elif token_h5.sha256_file(p) != s["sha256"]:
            bad.append(f"{p}: SHA-256 differs from the manifest's: the file is damaged")
    if bad:
        fail("\n".join(bad) + f"\n{len(bad)} of {len(shards)} file(s) fail")
    print(f"verify: {len(shards)} file(s) of {a.dir} match the manifest (size and SHA-256)")


# ---- bpe ----------------------------------------------------------------------------------------

def run_bpe(a):
    specials = a.special or ["<|endoftext|>"]
    if len(set(specials)) != len(specials):
        fail(f"--special names a token twice: {specials}")
    low = 256 + len(specials)
    if not low <= a.vocab_size <= 1 << 20:
        fail(f"--vocab_size {a.vocab_size}: must be in {low}..{1 << 20} (the 256 byte tokens and "
             f"the {len(specials)} special token(s) come first)")
    if a.min_frequency < 1:
        fail(f"--min_frequency {a.min_frequency}: must be >= 1")
    paths = expand_inputs(a.inputs)
    for p in paths:
        if os.path.lexists(a.out) and os.path.samefile(a.out, p):
            fail(f"--out {a.out} is the input {p}: choose another name (--force never writes "
                 "over an input)")
    if os.path.isdir(a.out):
        fail(f"--out {a.out}: is a directory, expected the tokenizer.json file to write")
    if os.path.lexists(a.out) and not a.force:
        fail(f"--out {a.out} exists: pass --force to replace it, or choose another name")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):
        fail(f"--out {a.out}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        fail(f"--out {a.out}: directory {out_dir} is not writable")
    need("tokenizers")
    if any(kind_of(p, a.format) == "parquet" for p in paths):
        need("pyarrow")
    # A first pass finds every mistake before any training.
    reader = Reader(paths, a)
    n_docs = n_empty = 0
    for _, text in reader:
        n_docs += 1
        n_empty += not text
    if reader.errors:
        report(reader.errors, "no tokenizer written")
    if n_docs == n_empty:
        fail(f"the input ({len(paths)} file(s), {n_docs} documents) holds no text")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab_size, min_frequency=a.min_frequency,
                                  special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    again = Reader(paths, a)
    tok.train_from_iterator((t for _, t in again if t), trainer=trainer, length=n_docs - n_empty)
    if again.errors:
        report(again.errors, "the input changed while it was read; no tokenizer written")
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix="." + os.path.basename(a.out) + ".",
                               suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        token_h5.fsync_path(tmp)
        try:
            token_h5.commit(tmp, a.out, a.force)
        except token_h5.OutputAppeared:
            fail(f"--out {a.out} appeared while writing: pass --force to replace it")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    size = tok.get_vocab_size(with_added_tokens=True)
    ids = ", ".join(f"'{s}' = {tok.token_to_id(s)}" for s in specials)
    print(f"wrote {a.out}: byte-level BPE, vocabulary {size}"
          + ("" if size == a.vocab_size else
             f" (asked for {a.vocab_size}: the corpus has no more merges of frequency >= "
             f"{a.min_frequency})")
          + f", from {n_docs - n_empty} documents ({n_empty} empty); special: {ids}")


# ---- command line -------------------------------------------------------------------------------

def add_input_args(p):
    p.add_argument("--in", dest="inputs", action="append", required=True, metavar="PATH|GLOB",
                   help="input files (repeatable; quote globs)")
    p.add_argument("--format", choices=["auto", "text", "jsonl", "parquet"], default="auto",
                   help="the inputs' kind (auto: from the extension)")
    p.add_argument("--text_field", default="text",
                   help="JSONL field or Parquet column holding the text (default: text)")
    p.add_argument("--delimiter", default=None,
                   help="text files: the string between documents, backslash escapes read "
                        "(default: one document per file)")
    p.add_argument("--errors", choices=["strict", "replace"], default="strict",
                   help="bytes that are not UTF-8: strict = FILE:LINE error, replace = U+FFFD")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("tokenize", help="a corpus into token files",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_input_args(t)
    t.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    t.add_argument("--out", required=True, help="the output directory")
    t.add_argument("--eot_token", default=None,
                   help="end of text: a token of the tokenizer or an id (default: the "
                        "tokenizer's '<|endoftext|>')")
    t.add_argument("--vocab_size", type=int, default=None,
                   help="every id must be below it (default: the tokenizer's size)")
    t.add_argument("--val_fraction", type=float, default=None,
                   help="hold out this fraction of the documents (by hash)")
    t.add_argument("--val_docs", type=int, default=None,
                   help="hold out exactly this many documents (those of smallest hash)")
    t.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    t.add_argument("--shard_tokens", type=int, default=100_000_000,
                   help="tokens per output file (documents are never split)")
    t.add_argument("--workers", type=int, default=0,
                   help="tokenizing processes (0: one per available CPU)")
    t.add_argument("--progress_every", type=float, default=5.0,
                   help="seconds between progress lines on stderr (0: only the last)")
    t.add_argument("--force", action="store_true",
                   help="replace an earlier output directory of this tool")

    b = sub.add_parser("bpe", help="train a byte-level BPE tokenizer on a corpus",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_input_args(b)
    b.add_argument("--out", required=True, help="the tokenizer.json to write")
    b.add_argument("--vocab_size", type=int, required=True, help="entries, special tokens included")
    b.add_argument("--min_frequency", type=int, default=2,
                   help="a merge needs at least this many occurrences")
    b.add_argument("--special", action="append", default=None,
                   help="special token (repeatable; default '<|endoftext|>'); ids from 0")
    b.add_argument("--force", action="store_true", help="replace an existing --out")

    v = sub.add_parser("verify", help="check a tokenize output against its manifest")
    v.add_argument("dir", help="the output directory of corpus.py tokenize")

    a = ap.parse_args(argv)
    body = {"tokenize": run_tokenize, "bpe": run_bpe, "verify": run_verify}[a.cmd]
    return tool_cli.run(f"corpus {a.cmd}", lambda: body(a))


if __name__ == "__main__":
    sys.exit(main())
