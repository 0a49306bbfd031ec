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

Output: HDF5 /tokens (uint32), /doc_offsets (int64, n_docs + 1), /loss_mask (uint8), written to
FILE.tmp and renamed to FILE. Needs the `tokenizers`, `h5py` and `numpy` packages.

  python3 launch/tools/sft_data.py --tokenizer tokenizer.json --eot "<|endoftext|>" \\
      --in chats.jsonl --out sft.h5
"""
import argparse
import json
import os
import sys


def fail(msg):
    print(f"sft_data: {msg}", file=sys.stderr)
    sys.exit(2)


def render(template, role, content):
    """(header, body, footer) strings of one message; the body and footer of answers count."""
    if template == "chatml":
        return f"<|im_start|>{role}\n", content, "<|im_end|>\n"
    return f"{role}: ", content, "\n\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    ap.add_argument("--in", dest="inp", required=True, help="JSONL conversations")
    ap.add_argument("--out", required=True, help="the .h5 token file to write")
    ap.add_argument("--eot", required=True,
                    help="end-of-text: a token of the tokenizer (e.g. '<|endoftext|>') or an id")
    ap.add_argument("--template", choices=["chatml", "plain"], default="chatml")
    ap.add_argument("--train_roles", default="assistant",
                    help="comma-separated roles whose content the loss counts")
    a = ap.parse_args()

    import h5py
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    eot = int(a.eot) if a.eot.isdigit() else tok.token_to_id(a.eot)
    if eot is None:
        fail(f"--eot '{a.eot}' is not a token of {a.tokenizer}")
    train_roles = set(a.train_roles.split(","))

    def encode(text):
        return tok.encode(text, add_special_tokens=False).ids if text else []

    tokens, mask, offsets = [], [], [0]
    with open(a.inp) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                conv = json.loads(line)
                messages = conv["messages"]
            except (ValueError, KeyError, TypeError) as e:
                fail(f"{a.inp}:{lineno}: expected {{\"messages\": [...]}}: {e}")
            for k, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                        not isinstance(m.get("content"), str):
                    fail(f"{a.inp}:{lineno}: message {k} needs string 'role' and 'content'")
                header, body, footer = render(a.template, m["role"], m["content"])
                counts = 1 if m["role"] in train_roles else 0
                for text, bit in ((header, 0), (body, counts), (footer, counts)):
                    ids = encode(text)
                    tokens.extend(ids)
                    mask.extend([bit] * len(ids))
            tokens.append(eot)
            mask.append(0)
            offsets.append(len(tokens))
    if len(offsets) == 1:
        fail(f"{a.inp} holds no conversations")
    tmp = a.out + ".tmp"
    try:
        with h5py.File(tmp, "w") as h:
            h["tokens"] = np.asarray(tokens, dtype=np.uint32)
            h["doc_offsets"] = np.asarray(offsets, dtype=np.int64)
            h["loss_mask"] = np.asarray(mask, dtype=np.uint8)
        os.replace(tmp, a.out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {a.out}: {len(offsets) - 1} conversations, {len(tokens)} tokens, "
          f"{sum(mask)} counted by the loss (vocab {tok.get_vocab_size()}, eot {eot})")


if __name__ == "__main__":
    main()
