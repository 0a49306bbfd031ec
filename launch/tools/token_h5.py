"""Writes hotpath's HDF5 token files (the layout framework/data/token_files.h reads).

A file holds /tokens (uint32, 1-D), /doc_offsets (int64, n_docs + 1 entries from 0 to
len(/tokens)) and optionally /loss_mask (uint8, one 0/1 per token). Files are written in the
HDF5 1.10 format, as hotpath's own writer and checkpoints are: the superblock, object headers and
B-trees carry checksums, so damaged metadata fails a check instead of being read. Needs h5py and
numpy. Used by sft_data.py and corpus.py.
"""
import hashlib
import os
import tempfile


class OutputAppeared(Exception):
    """The final path came into being while the file was written (and force was not given)."""


def write_tokens(path, tokens, offsets, mask=None):
    """Writes the datasets to `path` as given (the caller picks a temporary name) and fsyncs it.
    Returns the file's size in bytes."""
    import h5py
    import numpy as np
    with h5py.File(path, "w", libver=("v110", "v110")) as h:
        h.create_dataset("tokens", data=np.asarray(tokens, dtype=np.uint32))
        h.create_dataset("doc_offsets", data=np.asarray(offsets, dtype=np.int64))
        if mask is not None:
            h.create_dataset("loss_mask", data=np.asarray(mask, dtype=np.uint8))
    fsync_path(path)
    return os.path.getsize(path)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path):
    """Flushes a directory's entries (a rename into it); file systems that refuse are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def commit(tmp, path, force):
    """Renames the complete file tmp to path. Without force, through a hard link that fails if
    path appeared meanwhile (OutputAppeared); with it, replacing path."""
    if force:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise OutputAppeared(path)
        except OSError:  # a file system without hard links
            if os.path.lexists(path):
                raise OutputAppeared(path)
            os.replace(tmp, path)
        else:
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_file(path, tokens, offsets, mask=None, force=False):
    """Writes one token file under a temporary name beside path, then renames it to path (see
    commit). The temporary never outlives a failure. Returns the file's size in bytes."""
    out_dir = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")
    os.close(fd)
    try:
        size = write_tokens(tmp, tokens, offsets, mask)
        commit(tmp, path, force)
        return size
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
