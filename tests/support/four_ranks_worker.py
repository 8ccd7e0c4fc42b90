"""One 4-rank torchrun launch for four test modules (a process group costs seconds to start, and
4 processes importing torch, transformers and fpipe on 2 cores cost more):

    torchrun --standalone --nproc-per-node 4 tests/support/four_ranks_worker.py \
        --trust-out DIR1 --hf-out DIR2 --dp-out DIR3 --generate-out DIR4

In one process group, in this order: the (dp=2, pp=2) mesh cases of `trust_dist_worker`
(tests/runtime/test_trust_dist.py), every case of `hf_dist_worker` (tests/pipeline/test_hf_dist.py), every case of
`dp_worker` (tests/parallel/test_dp.py), then
`generate_worker`'s (tests/generate/test_generate_cache.py), whose last case makes a rank fail, breaks the
group and ends every process. Each part writes its own folder, as its worker alone would; each
pipeline has its own store namespace, so one part's failure reports are not another's.
"""

from __future__ import annotations

import argparse

import dp_worker
import generate_worker
import hf_dist_worker
import torch
import torch.distributed as dist
import trust_dist_worker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trust-out", required=True)
    ap.add_argument("--hf-out", required=True)
    ap.add_argument("--dp-out", required=True)
    ap.add_argument("--generate-out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    trust_dist_worker.mesh(args.trust_out)
    dist.barrier()
    hf_dist_worker.run(args.hf_out)
    dist.barrier()
    dp_worker.run(args.dp_out)
    dist.barrier()
    generate_worker.run(args.generate_out)  # last: ends the process


if __name__ == "__main__":
    main()
