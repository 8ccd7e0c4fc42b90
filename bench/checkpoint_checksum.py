"""What a checkpoint's checksums cost per GiB (issue 25): SHA-256 of every file, at save and at load.

    python bench/checkpoint_checksum.py                 # 1 GiB, 5 repeats, in a temporary folder
    python bench/checkpoint_checksum.py --gib 0.25 --repeats 3 --dir /scratch

fpipe hashes each byte twice: once as it writes a file (the hash of the bytes it hands the
file), once when `load` checks the file before using a value from it. Printed, per GiB, with the
minimum and median over `--repeats`: the hash alone (hashlib over bytes in memory), the check
`load` does (over the mapped file, from the page cache), and, for scale, a whole `fpipe.save`
(write, hash, fsync) and `fpipe.load` (map, check, copy) of one fp32 tensor of `--gib` GiB.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import fpipe
from fpipe._src.training import checkpoint_format


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _check(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        checkpoint_format.Mapped(fd, path).sha256()
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    params = {"w": torch.randn(n)}
    raw = params["w"].numpy().tobytes()
    d = tempfile.mkdtemp(dir=args.dir)
    try:
        rows = {"sha256 of bytes in memory": _timed(lambda: hashlib.sha256(raw).digest(), args.repeats)}
        rows["fpipe.save (write, hash, fsync)"] = _timed(lambda: fpipe.save(f"{d}/c", params), args.repeats)
        rows["load's check of the file"] = _timed(lambda: _check(f"{d}/c/rank0.safetensors"), args.repeats)
        into = {"w": torch.empty(n)}
        rows["fpipe.load (map, check, copy)"] = _timed(lambda: fpipe.load(f"{d}/c", into), args.repeats)
    finally:
        shutil.rmtree(d)
    print(
        f"{args.gib} GiB, {args.repeats} repeats, {torch.get_num_threads()} torch threads; seconds per GiB:"
    )
    for name, ts in rows.items():
        print(f"  {name:34s} min {min(ts) / args.gib:6.2f}   median {statistics.median(ts) / args.gib:6.2f}")


if __name__ == "__main__":
    main()
