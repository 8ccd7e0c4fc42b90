"""Worker for `tests/runtime/test_exit.py`: two ranks each leave a send the other never receives (what a
pipeline failure leaves behind) in fpipe's send reaper, then both end normally at the same moment.

Without NOTE [threads at exit] (fpipe/_src/runtime/exiting.py), one rank's exit ends the other's send
wait while that process is tearing down, and it aborts ("terminate called without an active
exception"); most launches of this pair abort one rank.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fpipe._src.runtime import dist as fdist
from fpipe._src.runtime.run_dist import send_reaper


def main() -> None:
    pg = fdist.pp_group()
    assert pg is not None and pg.size == 2
    peer = 1 - pg.rank
    t = torch.zeros(4)
    reaper = send_reaper(pg, 60.0)
    reaper.submit([dist.isend(t, peer, tag=7)], [t], "sending a value that is never received", peer)
    dist.barrier()
    time.sleep(0.2)  # the send is posted on both ranks; now both end
    print(f"rank {pg.rank} ends", flush=True)


if __name__ == "__main__":
    main()
