"""Place: which process runs which stage, and how ranks learn that one of them failed.

fpipe adds no launcher and no transport: torchrun starts the processes, torch.distributed
carries the tensors (gloo on CPU, NCCL on GPU). A `PPGroup` is the pipeline dimension: the
default process group, or the "pp" dimension of a user's DeviceMesh.

# NOTE [failures never hang]
A rank that fails writes why into the c10d store ("rank 1 failed at F1.3: ...") before it
raises; its process exits, its sockets close, and every peer blocked on it gets an error at once,
reads the store and raises naming the failing rank (torchrun then ends the rest). A peer that is
alive but stopped is caught by the deadline on every wait (`pipeline(timeout=...)`). Gloo p2p
works never report completion until waited on, so waits are blocking with a timeout, and sends
are waited on by a background thread (`SendReaper`), which also keeps their tensors alive.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PPGroup", "pp_group", "PeerFailure", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
_FAILED_KEY = "fpipe/failed"


class PeerFailure(RuntimeError):
    """Another rank failed (or stopped answering); this rank stops too."""


@dataclasses.dataclass
class PPGroup:
    group: Any
    rank: int  # rank in the pipeline group
    size: int
    device: torch.device
    store: Any

    def global_rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def report_failure(self, message: str) -> None:
        """Tell the other ranks why this one is stopping (first report wins)."""
        if self.store is None:
            return
        try:
            self.store.compare_set(_FAILED_KEY, "", message)
        except Exception:  # the store may be gone already; the raise on this rank is what matters
            pass

    def failure(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([_FAILED_KEY]):
                return self.store.get(_FAILED_KEY).decode()
        except Exception:
            return None
        return None

    def wait_all(self, works: list[Any], timeout: float, what: Callable[[], str]) -> None:
        """Wait for p2p works; a dead peer, a reported failure or `timeout` becomes an error."""
        if self.device.type == "cuda":  # NCCL works are stream-ordered; the host does not block
            for w in works:
                w.wait()
            return
        deadline = time.monotonic() + timeout
        for w in works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                w.wait(datetime.timedelta(seconds=left))
            except RuntimeError as err:
                self._raise_for(err, timeout, what())

    def _raise_for(self, err: BaseException, timeout: float, what: str) -> None:
        msg = self.failure()
        text_err = str(err).lower()
        if msg is None and ("timeout" in text_err or "timed out" in text_err):
            text = (
                f"fpipe rank {self.rank}: timed out after {timeout:g} s {what}; that rank is not "
                "responding (stopped, stuck, or far slower). Raise pipeline(..., timeout=...) if "
                "it is only slow."
            )
            self.report_failure(text)
            raise TimeoutError(text) from err
        if msg is None:  # the first to see a peer vanish says so, for ranks further away
            self.report_failure(
                f"rank {self.rank} lost its peer while {what}; that peer crashed or was killed ({err})"
            )
        reason = msg or f"the peer closed the connection; did it crash or get killed? ({err})"
        raise PeerFailure(f"fpipe rank {self.rank}: stopping while {what}: {reason}") from err


class SendReaper:
    """Holds sent tensors until their sends complete (gloo's send waits for the receiver), on a
    background thread, so the main thread never blocks on a send."""

    def __init__(self, pg: PPGroup, timeout: float) -> None:
        self.pg, self.timeout = pg, timeout
        self.queue: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="fpipe-send-reaper", daemon=True)
        self.thread.start()

    def submit(self, works: list[Any], tensors: list[torch.Tensor], what: str) -> None:
        self.queue.put((works, tensors, what))

    def _loop(self) -> None:
        while True:
            works, tensors, what = self.queue.get()
            try:
                if works is not None and self.error is None:
                    self.pg.wait_all(works, self.timeout, functools.partial(str, what))
            except BaseException as err:  # surfaced by drain() on the main thread
                self.error = err
            finally:
                del works, tensors
                self.queue.task_done()

    def drain(self) -> None:
        """Block until every submitted send completed; re-raise a send's failure."""
        self.queue.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def _init_from_env(timeout: float) -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout, 60.0)))


def pp_group(mesh: Any = None, timeout: float = DEFAULT_TIMEOUT) -> PPGroup | None:
    """The pipeline group: the mesh's "pp" dimension, else all ranks; None in one process."""
    if mesh is not None:
        if "pp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                f"pipeline(mesh=...): the mesh has dimensions {mesh.mesh_dim_names}; it needs one named 'pp'."
            )
        group = mesh.get_group("pp")
    else:
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
                return None
            _init_from_env(timeout)
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    if size == 1:
        return None
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    return PPGroup(group, dist.get_rank(group), size, device, store)
