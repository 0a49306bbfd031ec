#!/usr/bin/env python3
"""Turns JSONL conversations into a hotpath token file with a loss mask (SFT data).

Each input line is one conversation:

  {"messages": [{"role": "system", "content": "..."},
                {"role": "user", "content": "..."},
                {"role": "assistant", "content": "..."}, ...]}

Every conversation becomes one document: each message rendered by the template, tokenized with a
Hugging Face tokenizer.json, then the end-of-text token. The loss mask is 1 on the tokens of the
assistant messages' content and their end-of-message marker (what the model should learn to
write) and 0 on everything else (system and user turns, role headers, the final end-of-text), so
`hotpath train --data FILE.h5` counts only answer tokens.

Templates (--template):
  chatml  <|im_start|>ROLE\\nCONTENT<|im_end|>\\n per message (Qwen-style)
  plain   ROLE: CONTENT\\n\\n per message, the header and separators as plain text

Output: HDF5 /tokens (uint32), /doc_offsets (int64, n_docs + 1), /loss_mask (uint8) in the
checksummed HDF5 1.10 format (token_h5.py, the writer corpus.py shares), written under a
temporary name in --out's directory and renamed to --out once complete. An existing
--out is refused unless --force; --out is never one of the input files, --force or not.
Input mistakes (a line that is not UTF-8 or not JSON, a message without a string role and
content, no token counted by the loss, an --eot outside the vocabulary) are reported as
FILE:LINE: ... and end with exit status 2, nothing written. Needs the `tokenizers`, `h5py` and
`numpy` packages.

  python3 launch/tools/sft_data.py --tokenizer tokenizer.json --eot "<|endoftext|>" \\
      --in chats.jsonl --out sft.h5
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tool_cli import fail  # noqa: E402
import tool_cli  # noqa: E402

MAX_REPORTED = 20  # input errors listed before the rest are counted




def render(template, role, content):
    """(header, body, footer) strings of one message; the body and footer of answers count."""
    if template == "chatml":
        return f"<|im_start|>{role}\n", content, "<|im_end|>\n"
    return f"{role}: ", content, "\n\n"


def type_name(v):
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def same_file(a, b):
    """Whether paths a and b name one file (b existing), through links and spellings alike."""
    try:
        if os.path.exists(a) and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_input(flag, path):
    if not os.path.exists(path):
        fail(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        fail(f"{flag} {path}: is a directory, expected a file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        fail(f"{flag} {path}: cannot be read: {e.strerror}")


def check_output(a):
    """Refuses an --out that is an input, an existing file without --force, a directory, or in a
    directory that cannot be written; returns its directory."""
    out = a.out
    for flag, path in (("--in", a.inp), ("--tokenizer", a.tokenizer)):
        if same_file(out, path):
            fail(f"--out {out} is the {flag} file: choose another output name (--force never "
                 "writes over an input)")
    if os.path.isdir(out):
        fail(f"--out {out}: is a directory, expected the .h5 file to write")
    if os.path.lexists(out) and not a.force:
        fail(f"--out {out} exists: pass --force to replace it, or choose another name")
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        fail(f"--out {out}: directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK):
        fail(f"--out {out}: directory {d} is not writable")
    return d


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail("needs the Python package 'tokenizers' (pip install tokenizers)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exceptions for any malformed file
        fail(f"--tokenizer {path}: not a Hugging Face tokenizer.json: "
             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")


def eot_id(tok, a):
    n = tok.get_vocab_size(with_added_tokens=True)
    if a.eot.isascii() and a.eot.isdigit():
        eot = int(a.eot)
        if eot >= n:
            fail(f"--eot {a.eot}: not a token id of {a.tokenizer} (valid: 0..{n - 1}, or a token "
                 "such as '<|endoftext|>')")
        return eot
    eot = tok.token_to_id(a.eot)
    if eot is None:
        fail(f"--eot '{a.eot}' is not a token of {a.tokenizer} (give a token of its vocabulary "
             f"such as '<|endoftext|>', or an id in 0..{n - 1})")
    return eot


def conversations(path, errors):
    """(line number, messages) of every valid non-blank line; the mistakes go to errors."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                              f"{e.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                conv = json.loads(line)
            except ValueError as e:
                msg = getattr(e, "msg", str(e))
                col = getattr(e, "colno", None)
                errors.append(f"{path}:{lineno}: invalid JSON: {msg}"
                              + (f" (column {col})" if col else ""))
                continue
            if not isinstance(conv, dict):
                errors.append(f"{path}:{lineno}: expected an object {{\"messages\": [...]}}, got "
                              f"{type_name(conv)}")
                continue
            if "messages" not in conv:
                keys = ", ".join(f"'{k}'" for k in list(conv)[:5]) or "none"
                errors.append(f"{path}:{lineno}: no \"messages\" key (keys: {keys})")
                continue
            messages = conv["messages"]
            if not isinstance(messages, list):
                errors.append(f"{path}:{lineno}: \"messages\" is {type_name(messages)}, expected a "
                              "list of {\"role\": ..., \"content\": ...} objects")
                continue
            if not messages:
                errors.append(f"{path}:{lineno}: \"messages\" is empty")
                continue
            bad = None
            for k, m in enumerate(messages):
                if not isinstance(m, dict):
                    bad = f"message {k} is {type_name(m)}, expected an object with string " \
                          "\"role\" and \"content\""
                else:
                    for field in ("role", "content"):
                        if field not in m:
                            bad = f"message {k} has no \"{field}\""
                        elif not isinstance(m[field], str):
                            bad = f"message {k}: \"{field}\" is {type_name(m[field])}, expected " \
                                  "a string"
                        if bad:
                            break
                if bad:
                    break
            if bad:
                errors.append(f"{path}:{lineno}: {bad}")
                continue
            yield lineno, messages


def role_counts(counter):
    return ", ".join(f"{r} ({n})" for r, n in counter.most_common()) or "none"


def write_h5(path, tokens, offsets, mask, force):
    """Writes under a temporary name beside path and renames it to path (token_h5.write_file):
    without force through a link that fails if path appeared meanwhile."""
    import token_h5
    try:
        token_h5.write_file(path, tokens, offsets, mask, force)
    except token_h5.OutputAppeared:
        fail(f"--out {path} appeared while writing: pass --force to replace it")


def run(a):
    train_roles = [r.strip() for r in a.train_roles.split(",") if r.strip()]
    if not train_roles:
        fail(f"--train_roles '{a.train_roles}': no role given (e.g. assistant)")
    check_input("--in", a.inp)
    check_input("--tokenizer", a.tokenizer)
    check_output(a)
    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        fail(f"needs the Python package '{e.name}' (pip install {e.name})")
    tok = load_tokenizer(a.tokenizer)
    eot = eot_id(tok, a)

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids if text else []

    trained = set(train_roles)
    tokens, mask, offsets = [], [], [0]
    seen = collections.Counter()
    errors = []
    for _, messages in conversations(a.inp, errors):
        if errors:
            continue  # keep reading for more mistakes, tokenize nothing more
        for m in messages:
            seen[m["role"]] += 1
            header, body, footer = render(a.template, m["role"], m["content"])
            counts = 1 if m["role"] in trained else 0
            for text, bit in ((header, 0), (body, counts), (footer, counts)):
                ids = encode(text)
                tokens.extend(ids)
                mask.extend([bit] * len(ids))
        tokens.append(eot)
        mask.append(0)
        offsets.append(len(tokens))
    if errors:
        shown = errors[:MAX_REPORTED]
        more = len(errors) - len(shown)
        fail("\n".join(shown) + (f"\n... and {more} more" if more else "")
             + f"\n{a.inp}: {len(errors)} line(s) with mistakes; nothing written")
    if len(offsets) == 1:
        fail(f"{a.inp} holds no conversations")
    counted = sum(mask)
    if counted == 0:
        fail(f"no token is counted by the loss: {a.inp} has the roles {role_counts(seen)}, and "
             f"--train_roles trains on {', '.join(train_roles)}; pass --train_roles with the "
             "role(s) whose replies the model should learn (e.g. --train_roles gpt); nothing "
             "written")
    write_h5(a.out, tokens, offsets, mask, a.force)
    print(f"wrote {a.out}: {len(offsets) - 1} conversations, {len(tokens)} tokens, "
          f"{counted} counted by the loss (vocab {tok.get_vocab_size(with_added_tokens=True)}, "
          f"eot {eot})")
    print(f"roles seen: {role_counts(seen)}; trained: {', '.join(train_roles)}"
          + ("" if trained <= set(seen) else
             f" ({', '.join(r for r in train_roles if r not in seen)} never seen)"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    ap.add_argument("--in", dest="inp", required=True, help="JSONL conversations")
    ap.add_argument("--out", required=True, help="the .h5 token file to write")
    ap.add_argument("--eot", required=True,
                    help="end-of-text: a token of the tokenizer (e.g. '<|endoftext|>') or an id")
    ap.add_argument("--template", choices=["chatml", "plain"], default="chatml")
    ap.add_argument("--train_roles", default="assistant",
                    help="comma-separated roles whose content the loss counts")
    ap.add_argument("--force", action="store_true",
                    help="replace an existing --out (never an input file)")
    a = ap.parse_args(argv)
    return tool_cli.run("sft_data", lambda: run(a))


if __name__ == "__main__":
    sys.exit(main())
