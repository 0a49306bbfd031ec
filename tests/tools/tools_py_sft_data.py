#!/usr/bin/env python3
"""Failure cases of launch/tools/sft_data.py, one group per subcommand (each in its own WORKDIR):

  output WORKDIR  --out never replaces an input (not even with --force) nor, without --force, any
                  existing file; a failed run leaves neither the output nor a temporary behind
  roles WORKDIR   conversations whose roles the loss does not train on (ShareGPT's human/gpt)
                  are refused naming the roles seen and trained; the summary names them
  eot WORKDIR     --eot outside the tokenizer's vocabulary is refused naming the valid range
  input WORKDIR   input mistakes are FILE:LINE: messages with exit status 2 and no traceback; a
                  missing or broken tokenizer file names the flag and the path

Needs tokenizers, h5py and numpy (the tool's own needs).
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "launch", "tools", "sft_data.py")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks  # noqa: E402

_checks = Checks("tools_py_sft_data")
check, done = _checks.check, _checks.done

WORDS = ["<eot>", "user:", "assistant:", "hi", "there", "how", "are", "you", "fine", "thanks",
         "system:", "human:", "gpt:", "\n\n"]
CHATS = [
    {"messages": [{"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "how are you"},
                  {"role": "assistant", "content": "fine thanks"}]},
]


def setup(work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eot>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eot>"])
    path = os.path.join(work, "tokenizer.json")
    tok.save(path)
    return path


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (line + "\n").encode())
    return path


def chats_file(work, chats=CHATS, name="chats.jsonl"):
    return write_lines(os.path.join(work, name), [json.dumps(c) for c in chats])


def tool(tok, inp, out, *extra, eot="<eot>"):
    r = subprocess.run([sys.executable, TOOL, "--tokenizer", tok, "--eot", eot, "--in", inp,
                        "--out", out, "--template", "plain", *extra],
                       capture_output=True, text=True)
    return r


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def leftovers(work, keep):
    """Files in work besides those named in keep (a temporary left by a failed run)."""
    return sorted(set(os.listdir(work)) - set(keep))


def refused(r, what, *needles):
    """Exit 2, every needle in stderr, no traceback."""
    ok = check(r.returncode == 2, what, "exit", r.returncode, "expected 2;", r.stderr.strip())
    for n in needles:
        ok = check(n in r.stderr, what, "does not say", repr(n), "in", repr(r.stderr.strip())) \
            and ok
    ok = check("Traceback" not in r.stderr, what, "prints a traceback:", r.stderr[-800:]) and ok
    return ok


def is_token_file(path):
    try:
        with h5py.File(path, "r") as h:
            return len(h["tokens"]) > 0 and len(h["loss_mask"]) == len(h["tokens"])
    except OSError:
        return False


def cmd_output(work):
    tok = setup(work)
    inp = chats_file(work)
    inp_bytes, tok_bytes = read_bytes(inp), read_bytes(tok)
    # The input as the output: refused with and without --force, the input untouched.
    for extra in ((), ("--force",)):
        r = tool(tok, inp, inp, *extra)
        refused(r, f"--out = --in {extra}", "--out", "is the --in file")
        check(read_bytes(inp) == inp_bytes, "--out = --in", extra, "changed the input")
    # Another spelling of the input, and a link to it.
    r = tool(tok, inp, os.path.join(work, ".", "..", os.path.basename(work), "chats.jsonl"),
             "--force")
    refused(r, "--out = --in spelled differently", "is the --in file")
    link = os.path.join(work, "link.h5")
    os.symlink(inp, link)
    r = tool(tok, inp, link, "--force")
    refused(r, "--out a link to --in", "is the --in file")
    check(read_bytes(inp) == inp_bytes, "a link to the input as --out changed the input")
    os.remove(link)
    # The tokenizer as the output.
    r = tool(tok, inp, tok, "--force")
    refused(r, "--out = --tokenizer", "is the --tokenizer file")
    check(read_bytes(tok) == tok_bytes, "--out = --tokenizer changed the tokenizer")
    # An existing file: refused without --force, replaced with it.
    out = os.path.join(work, "sft.h5")
    with open(out, "wb") as f:
        f.write(b"someone's file")
    r = tool(tok, inp, out)
    refused(r, "existing --out", f"--out {out} exists", "--force")
    check(read_bytes(out) == b"someone's file", "an existing --out was changed without --force")
    r = tool(tok, inp, out, "--force")
    check(r.returncode == 0, "--force exit", r.returncode, r.stderr.strip())
    check(is_token_file(out), "--force did not write a token file")
    # A failed run (a mistake on line 2) leaves nothing under the new name nor a temporary.
    bad = write_lines(os.path.join(work, "bad.jsonl"), [json.dumps(CHATS[0]), "{oops"])
    new = os.path.join(work, "new.h5")
    r = tool(tok, bad, new)
    refused(r, "bad input", "bad.jsonl:2:")
    check(not os.path.exists(new), "a failed run left", new)
    # A directory that does not exist, and a directory as --out.
    r = tool(tok, inp, os.path.join(work, "nowhere", "x.h5"))
    refused(r, "--out in a missing directory", "--out", os.path.join(work, "nowhere"),
            "does not exist")
    r = tool(tok, inp, work)
    refused(r, "--out a directory", f"--out {work}", "is a directory")
    check(leftovers(work, ["tokenizer.json", "chats.jsonl", "sft.h5", "bad.jsonl"]) == [],
          "left behind in", work, leftovers(work, ["tokenizer.json", "chats.jsonl", "sft.h5",
                                                  "bad.jsonl"]))
    return done("--out never replaces an input or, without --force, an existing file")


def cmd_roles(work):
    tok = setup(work)
    sharegpt = [{"messages": [{"role": "human", "content": "hi there"},
                              {"role": "gpt", "content": "hi"}]},
                {"messages": [{"role": "human", "content": "how are you"},
                              {"role": "gpt", "content": "fine thanks"}]}]
    inp = chats_file(work, sharegpt, "sharegpt.jsonl")
    out = os.path.join(work, "sft.h5")
    r = tool(tok, inp, out)
    refused(r, "ShareGPT roles", "no token is counted by the loss", "human (2)", "gpt (2)",
            "trains on assistant", "--train_roles")
    check(not os.path.exists(out), "a refused run wrote", out)
    # The roles it saw, trained with --train_roles: written, the summary naming them.
    r = tool(tok, inp, out, "--train_roles", "gpt")
    check(r.returncode == 0, "--train_roles gpt exit", r.returncode, r.stderr.strip())
    check("roles seen: human (2), gpt (2); trained: gpt" in r.stdout, "summary:", r.stdout)
    with h5py.File(out, "r") as h:
        check(int(h["loss_mask"][...].sum()) == 3, "gpt answers counted:",
              int(h["loss_mask"][...].sum()), "expected 3 (hi; fine thanks)")
    # Everyday roles: the summary names them too, and a trained role never seen.
    out2 = os.path.join(work, "sft2.h5")
    r = tool(tok, chats_file(work), out2, "--train_roles", "assistant,bot")
    check(r.returncode == 0, "assistant,bot exit", r.returncode, r.stderr.strip())
    check("roles seen: user (2), assistant (2); trained: assistant, bot (bot never seen)"
          in r.stdout, "summary:", r.stdout)
    # Trained roles whose messages are all empty count nothing either (plain: the separator is
    # blank, which this tokenizer drops).
    empty = [{"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": ""}]}]
    out3 = os.path.join(work, "sft3.h5")
    r = tool(tok, chats_file(work, empty, "empty.jsonl"), out3)
    refused(r, "empty answers", "no token is counted by the loss", "assistant (1)")
    check(not os.path.exists(out3), "a refused run wrote", out3)
    return done("no trainable token refused naming the roles seen and trained")


def cmd_eot(work):
    tok = setup(work)
    inp = chats_file(work)
    n = len(WORDS)
    for i, eot in enumerate((str(n), "99999", "4294967296")):
        out = os.path.join(work, f"e{i}.h5")
        r = tool(tok, inp, out, eot=eot)
        refused(r, f"--eot {eot}", f"--eot {eot}", f"0..{n - 1}")
        check(not os.path.exists(out), f"--eot {eot} wrote", out)
    r = tool(tok, inp, os.path.join(work, "e.h5"), eot="<nothing>")
    refused(r, "--eot <nothing>", "--eot '<nothing>' is not a token", f"0..{n - 1}")
    # The last id and a token name are fine.
    r = tool(tok, inp, os.path.join(work, "last.h5"), eot=str(n - 1))
    check(r.returncode == 0, f"--eot {n - 1} exit", r.returncode, r.stderr.strip())
    with h5py.File(os.path.join(work, "last.h5"), "r") as h:
        tokens = h["tokens"][...].tolist()
        offsets = h["doc_offsets"][...].tolist()
    check(all(tokens[o - 1] == n - 1 for o in offsets[1:]), "documents do not end in", n - 1)
    return done("--eot outside the vocabulary refused naming the valid range")


def cmd_input(work):
    tok = setup(work)
    good = json.dumps(CHATS[0])
    cases = [
        ("utf8", [good.encode() + b"\n", b'{"messages": [{"role": "user", "content": "\xff"}]}\n'],
         ":2: not UTF-8 (byte 0xff"),
        ("json", [good, good, '{"messages": [}'], ":3: invalid JSON"),
        ("toplevel", ['[{"role": "user", "content": "hi"}]'], ":1: expected an object"),
        ("nomessages", ['{"conversations": []}'], ":1: no \"messages\" key (keys: 'conversations')"),
        ("messages_type", ['{"messages": "hi"}'], ":1: \"messages\" is a string"),
        ("messages_empty", [good, '{"messages": []}'], ":2: \"messages\" is empty"),
        ("message_type", ['{"messages": [{"role": "user", "content": "hi"}, "hi"]}'],
         ":1: message 1 is a string"),
        ("no_role", ['{"messages": [{"role": "user", "content": "hi"}, {"content": "hi"}]}'],
         ":1: message 1 has no \"role\""),
        ("no_content", ['{"messages": [{"role": "user"}]}'], ":1: message 0 has no \"content\""),
        ("content_type", ['{"messages": [{"role": "user", "content": [{"text": "hi"}]}]}'],
         ":1: message 0: \"content\" is a list, expected a string"),
        ("role_type", ['{"messages": [{"role": null, "content": "hi"}]}'],
         ":1: message 0: \"role\" is null"),
    ]
    for name, lines, want in cases:
        inp = write_lines(os.path.join(work, f"{name}.jsonl"), lines)
        out = os.path.join(work, f"{name}.h5")
        r = tool(tok, inp, out)
        refused(r, name, inp + want)
        check(not os.path.exists(out), name, "wrote", out)
    # Every bad line is listed, each with its number.
    inp = write_lines(os.path.join(work, "many.jsonl"), [good, "{", good, '{"messages": 3}', ""])
    r = tool(tok, inp, os.path.join(work, "many.h5"))
    refused(r, "two bad lines", f"{inp}:2: invalid JSON", f"{inp}:4: \"messages\" is a number",
            "2 line(s) with mistakes")
    # A file of blank lines holds nothing.
    inp = write_lines(os.path.join(work, "blank.jsonl"), ["", "  "])
    refused(tool(tok, inp, os.path.join(work, "blank.h5")), "blank input", "holds no conversations")
    # Missing files name the flag and the path; a broken tokenizer file too.
    inp = chats_file(work)
    missing = os.path.join(work, "missing.json")
    refused(tool(missing, inp, os.path.join(work, "t.h5")), "missing tokenizer",
            f"--tokenizer {missing}: no such file")
    broken = write_lines(os.path.join(work, "broken.json"), ['{"version": "1.0"'])
    refused(tool(broken, inp, os.path.join(work, "t.h5")), "broken tokenizer",
            f"--tokenizer {broken}: not a Hugging Face tokenizer.json")
    refused(tool(tok, missing, os.path.join(work, "t.h5")), "missing input",
            f"--in {missing}: no such file")
    refused(tool(tok, work, os.path.join(work, "t.h5")), "directory input",
            f"--in {work}: is a directory")
    check(not [f for f in os.listdir(work) if f.endswith(".h5") or f.endswith(".tmp")],
          "files left behind:", [f for f in os.listdir(work) if f.endswith((".h5", ".tmp"))])
    # A byte order mark on the first line is fine.
    bom = write_lines(os.path.join(work, "bom.jsonl"), [b"\xef\xbb\xbf" + good.encode() + b"\n"])
    r = tool(tok, bom, os.path.join(work, "bom.h5"))
    check(r.returncode == 0, "BOM input exit", r.returncode, r.stderr.strip())
    return done(f"{len(cases) + 6} input mistakes reported as FILE:LINE: or naming the flag")


def main():
    cmds = {"output": cmd_output, "roles": cmd_roles, "eot": cmd_eot, "input": cmd_input}
    if len(sys.argv) != 3 or sys.argv[1] not in cmds:
        print(__doc__)
        return 2
    return cmds[sys.argv[1]](os.path.abspath(sys.argv[2]))


if __name__ == "__main__":
    sys.exit(main())
