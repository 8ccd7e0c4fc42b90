"""The torchrun script of the fuzzer's shared multi-rank launch (tests/fuzz/dist.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fuzz package

from fuzz.dist import worker_main  # noqa: E402

if __name__ == "__main__":
    worker_main(sys.argv[1:])
