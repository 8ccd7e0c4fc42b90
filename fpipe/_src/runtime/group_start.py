"""Starting the default process group from torchrun's environment, for `pipeline` and `plan`.

# NOTE [restarted attempts]
Under torchrun the workers share the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE), which
outlives an attempt: after `--max-restarts` restarts the job, a plain `init_process_group` finds
the dead attempt's keys (its ranks' gloo addresses) and fails to connect ("connectFullMesh ...
Connection refused") or hangs. fpipe starts the group over that store under a prefix of the
attempt's number (TORCHELASTIC_RESTART_COUNT), so each attempt meets only its own ranks. A script
that starts the group itself (or a DeviceMesh) must do the same to survive a restart.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["start_group"]


def _init_from_env(timeout: float) -> None:
    """Start the default process group from torchrun's variables (NOTE [restarted attempts])."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    delta = datetime.timedelta(seconds=max(timeout, 60.0))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=delta)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world, is_master=False, timeout=delta)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"fpipe/attempt/{attempt}", agent)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)


def start_group(timeout: float) -> bool:
    """Whether a default process group is up, starting it from torchrun's environment if it is not
    yet (`pipeline`'s first call, `plan`); False in one process."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return False
    _init_from_env(timeout)
    return True
