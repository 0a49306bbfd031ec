#!/usr/bin/env python3
"""Checks launch/tools/sft_data.py on a word-level tokenizer made here: the token ids, document
offsets and loss mask of two conversations, worked out by hand. Needs tokenizers, h5py, numpy.

  python3 tests/hf/sft_data_check.py WORKDIR
"""
import json
import os
import subprocess
import sys

import h5py
from tokenizers import Tokenizer, models, pre_tokenizers

work = sys.argv[1]
os.makedirs(work, exist_ok=True)
words = ["<eot>", "user:", "assistant:", "hi", "there", "how", "are", "you", "fine", "thanks",
         "system:", "be", "short", "\n\n"]
vocab = {w: i for i, w in enumerate(words)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<eot>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.add_special_tokens(["<eot>"])
tok_path = os.path.join(work, "tokenizer.json")
tok.save(tok_path)
chats = [
    {"messages": [{"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "be short"},
                  {"role": "user", "content": "how are you"},
                  {"role": "assistant", "content": "fine thanks"}]},
]
inp = os.path.join(work, "chats.jsonl")
with open(inp, "w") as f:
    for c in chats:
        f.write(json.dumps(c) + "\n")
out = os.path.join(work, "sft.h5")
if os.path.exists(out):  # this test's own output of an earlier run: the tool never replaces it
    os.remove(out)
tool = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "tools", "sft_data.py")
subprocess.run([sys.executable, tool, "--tokenizer", tok_path, "--eot", "<eot>", "--in", inp,
                "--out", out, "--template", "plain"], check=True)
with h5py.File(out, "r") as h:
    tokens = h["tokens"][...].tolist()
    offsets = h["doc_offsets"][...].tolist()
    mask = h["loss_mask"][...].tolist()
# WhitespaceSplit drops the "\n\n" separators: each message is its header word and its content.
want = ["user:", "hi", "there", "assistant:", "hi", "<eot>",
        "system:", "be", "short", "user:", "how", "are", "you", "assistant:", "fine", "thanks",
        "<eot>"]
want_mask = [0, 0, 0, 0, 1, 0,
             0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
assert tokens == [vocab[w] for w in want], tokens
assert offsets == [0, 6, 17], offsets
assert mask == want_mask, mask
assert not os.path.exists(out + ".tmp")
print("sft_data: tokens, offsets and loss mask as expected")
