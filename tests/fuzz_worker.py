"""The torchrun script of the fuzzer's shared multi-rank launch (tests/fuzz/dist.py)."""

import sys

from fuzz.dist import worker_main

if __name__ == "__main__":
    worker_main(sys.argv[1:])
