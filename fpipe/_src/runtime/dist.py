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
are waited on by a background thread (`SendReaper`), which also keeps their tensors alive. NCCL
works are polled (`wait_polling`) against the same deadline while the store is read for reports
(their `wait()` only orders streams: it would neither time out nor see a report).

Store keys are per pipeline: "fpipe/<group>/<n>/failed/<call>" and ".../waits/<rank>", so two
pipelines in one group, or dp replicas of one, never read each other's failures. A failure does
not end the process: a script that catches it goes on and exits as it chooses; one that does not
exits with status 1 right after the traceback and its atexit handlers (`exit_hard_after_failure`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .exiting import EXITING, exit_hard_after_failure, settle_at_exit
from .group_start import start_group

__all__ = ["PPGroup", "pp_group", "PeerFailure", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
_SEQ: dict[str, int] = {}  # pipelines called so far per process group (by its global ranks)
_SEQ_LOCK = threading.Lock()
_REPORT_GRACE_S = 2.0  # how long a rank that saw a peer vanish waits for that peer's own report
_WATCH_LOCK = threading.Lock()
_SETTLE_S = 3.0  # at exit, how long a send to a lower rank may still take (NOTE [threads at exit])


class PeerFailure(RuntimeError):
    """Another rank failed (or stopped answering); this rank stops too."""


@dataclasses.dataclass
class PPGroup:
    group: Any
    rank: int  # rank in the pipeline group
    size: int
    device: torch.device
    store: Any

    # this pipeline's store keys: "fpipe/<group>/<n>" for the n-th pipeline of a group to be
    # called (`name_at_first_call`); failure reports and wait records of others are never read
    namespace: str = ""
    generation: int = 0  # calls of the pipeline (equal on every rank); failure reports are per call

    @property
    def me(self) -> str:
        """This rank in messages: "rank R", R its rank in the group, with its global rank where
        the two differ (with dp or tp, several groups number the same process differently)."""
        g = self.global_rank(self.rank)
        return f"rank {self.rank}" if g == self.rank else f"rank {self.rank} (global rank {g})"

    def global_rank(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _failed_key(self) -> str:
        return f"{self.namespace or 'fpipe'}/failed/{self.generation}"

    def waits_key(self, rank: int) -> str:
        """Where `rank` records whom it waits for (`_WaitWatch`)."""
        return f"{self.namespace or 'fpipe'}/waits/{rank}"

    def name_at_first_call(self) -> None:
        """Give the pipeline its store namespace (`namespace_for`) before its first collective."""
        if not self.namespace:
            self.namespace = namespace_for(self.group)

    def begin_call(self) -> None:
        """Before anything in a pipeline call can fail: name the pipeline's store keys (first
        call), and start a new generation of failure reports -- a report written during this
        call is read during this call, one from an earlier call (caught) is never read."""
        self.name_at_first_call()
        self.generation += 1

    def broadcast(self, t: torch.Tensor, src: int, timeout: float, what: str) -> torch.Tensor:
        """`t` from pipeline rank `src` to every rank of the group, in place (`t` contiguous)."""
        work = dist.broadcast(t, self.global_rank(src), group=self.group, async_op=True)
        self.wait_all([work], timeout, functools.partial(str, what), poll=True)
        return t

    def all_reduce(self, t: torch.Tensor, timeout: float, what: str, op: Any = None) -> torch.Tensor:
        """The sum (or `op`) of `t` over the group's ranks, in place (`t` contiguous)."""
        work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.wait_all([work], timeout, functools.partial(str, what), poll=True)
        return t

    def gather_objects(self, obj: Any, timeout: float, what: str) -> list[Any]:
        """Every rank's picklable `obj`, by two all-gathers (sizes, then bytes) under the deadline
        (torch's all_gather_object waits without one)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self._gather(sizes, size, timeout, what)
        padded = torch.zeros(int(max(sizes)), dtype=torch.uint8, device=self.device)
        padded[: data.numel()] = data.to(self.device)
        every = [torch.empty_like(padded) for _ in range(self.size)]
        self._gather(every, padded, timeout, what)
        return [pickle.loads(e[: int(n)].cpu().numpy().tobytes()) for e, n in zip(every, sizes)]

    def _gather(self, out: list[torch.Tensor], t: torch.Tensor, timeout: float, what: str) -> None:
        work = dist.all_gather(out, t, group=self.group, async_op=True)
        self.wait_all([work], timeout, functools.partial(str, what), poll=True)

    def report_failure(self, message: str) -> None:
        """Tell the other ranks why this one is stopping (first report of this call wins)."""
        if self.store is None or EXITING.is_set():  # at exit the store may be gone: no wait on it
            return
        try:
            self.store.compare_set(self._failed_key(), "", message)
        except Exception:  # the store may be gone already; the raise on this rank is what matters
            pass

    def failure(self) -> str | None:
        if self.store is None or EXITING.is_set():
            return None
        try:
            if self.store.check([self._failed_key()]):
                return self.store.get(self._failed_key()).decode()
        except Exception:
            return None
        return None

    def wait_all(
        self,
        works: list[Any],
        timeout: float,
        what: Callable[[], str],
        peer: int | None = None,
        *,
        poll: bool | None = None,
    ) -> None:
        """Wait for works; a dead peer, a reported failure or `timeout` becomes an error.

        `peer` is the rank waited on; a long wait is recorded in the store (`_WaitWatch`) so a
        rank that times out can follow who waits for whom to the rank that stopped. Gloo p2p
        works are waited on blocking, with the deadline. NCCL works, and any work when `poll`
        (gloo collectives complete by themselves), are polled (`wait_polling`), so a failure
        another rank reports ends the wait at once; then waited on, which orders the streams.
        """
        poll = self.device.type == "cuda" if poll is None else poll
        deadline = time.monotonic() + timeout
        watch = self._watch(timeout)
        watch.begin(peer)
        try:
            if poll:
                wait_polling(works, deadline, self.failure)
            for w in works:
                if poll:
                    w.wait()  # completed: returns at once, or raises the work's error
                else:
                    w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as err:
            # the record of this wait stays: a neighbour timing out at the same moment
            # follows it to the rank that stopped
            self._raise_for(err, timeout, what(), peer)
        watch.end()

    def _watch(self, timeout: float) -> _WaitWatch:
        with _WATCH_LOCK:  # the main thread and the send reaper may both be first
            if getattr(self, "_wait_watch", None) is None:
                self._wait_watch = _WaitWatch(self, record_after=min(5.0, timeout / 4))
        return self._wait_watch

    def _raise_for(self, err: BaseException, timeout: float, what: str, peer: int | None) -> None:
        exit_hard_after_failure()  # gloo threads may stay blocked on the vanished peer
        msg = self.failure()
        if msg is not None and msg.startswith(f"fpipe {self.me}: timed out"):
            raise TimeoutError(msg) from err  # this rank timed out first, in its send thread
        text_err = str(err).lower()
        if msg is None and ("timeout" in text_err or "timed out" in text_err):
            chain = self._wait_chain(peer)
            culprit = f"rank {chain[-1]}" if chain else "that rank"
            via = f" (waited on through ranks {chain[:-1]})" if len(chain) > 1 else ""
            text = (
                f"fpipe {self.me}: timed out after {timeout:g} s {what}; {culprit}{via} is not "
                "responding (stopped, stuck, or far slower). Raise pipeline(..., timeout=...) if it "
                "is only slow."
            )
            self.report_failure(text)
            raise TimeoutError(text) from err
        if msg is None and not EXITING.is_set():
            # a closed connection is not always a crash: a peer whose own wait timed out has its
            # connections torn down by gloo a moment before it reports why; give it that moment
            msg = self._failure_within(_REPORT_GRACE_S)
        if msg is None:  # the first to see a peer vanish says so, for ranks further away
            self.report_failure(
                f"{self.me} lost its peer while {what}; that peer crashed or was killed ({err})"
            )
        reason = msg or f"the peer closed the connection; did it crash or get killed? ({err})"
        raise PeerFailure(f"fpipe {self.me}: stopping while {what}: {reason}") from err

    def _failure_within(self, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while (msg := self.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return msg

    def _wait_chain(self, peer: int | None) -> list[int]:
        """Follow the recorded waits from `peer`: [peer, whom peer waits for, ...]."""
        chain: list[int] = []
        cur = peer
        while cur is not None and cur not in chain and self.store is not None and not EXITING.is_set():
            chain.append(cur)
            try:
                key = self.waits_key(cur)
                cur = int(self.store.get(key).decode()) if self.store.check([key]) else None
            except Exception:
                break
        return chain


def _set_value(store: Any, key: str, value: str) -> None:
    store.set(key, value)


class WaitTimedOut(RuntimeError):
    """`wait_polling`'s deadline passed (worded like gloo's own timeout, which `_raise_for` reads)."""


class PeerReported(RuntimeError):
    """`wait_polling` found a failure report in the store while waiting."""


_POLL_FIRST_S, _POLL_MAX_S, _STORE_EVERY_S = 50e-6, 1e-3, 0.1


def wait_polling(works: list[Any], deadline: float, failure: Callable[[], str | None]) -> None:
    """Poll `works` (anything with a non-blocking `is_completed()`) until all are done.

    Raises `WaitTimedOut` at `deadline` (a `time.monotonic()` value) and `PeerReported` as soon
    as `failure()` returns a report (it asks the store: every 0.1 s, and not at all in a wait
    shorter than that, the common case). Between polls it sleeps, backing off from 50 us to
    1 ms, so a long wait costs little CPU.
    """
    pending, pause = list(works), _POLL_FIRST_S
    next_check = time.monotonic() + _STORE_EVERY_S
    while pending:
        pending = [w for w in pending if not w.is_completed()]
        now = time.monotonic()
        if not pending:
            return
        if now >= next_check:
            if (msg := failure()) is not None:
                raise PeerReported(msg)
            next_check = now + _STORE_EVERY_S
        if now >= deadline:
            raise WaitTimedOut(f"timed out: {len(pending)} of {len(works)} transfers not completed")
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(pause * 2, _POLL_MAX_S)


class _WaitWatch:
    """A background thread that records in the store, for waits longer than `record_after`
    seconds, which rank this one is waiting for (the oldest such wait of any thread: the main
    thread's receives or the send reaper's sends), and clears it when no long wait is left."""

    def __init__(self, pg: PPGroup, record_after: float) -> None:
        self.pg, self.record_after = pg, record_after
        self.lock = threading.Lock()
        self.waits: dict[int, tuple[int, float]] = {}  # thread id -> (peer, since)
        self.recorded: int | None = None
        self.thread = threading.Thread(target=self._loop, name="fpipe-wait-watch", daemon=True)
        self.thread.start()
        settle_at_exit(functools.partial(self.thread.join, 2.0))  # NOTE [threads at exit]

    def begin(self, peer: int | None) -> None:
        if peer is not None:
            with self.lock:
                self.waits[threading.get_ident()] = (peer, time.monotonic())

    def end(self) -> None:
        with self.lock:
            self.waits.pop(threading.get_ident(), None)
            self._sync()

    def _loop(self) -> None:
        while not EXITING.wait(0.5):
            with self.lock:
                self._sync()

    def _sync(self) -> None:
        """Make the store say whom the oldest long wait is for (or nothing)."""
        now = time.monotonic()
        long = sorted((since, peer) for peer, since in self.waits.values() if now - since > self.record_after)
        peer = long[0][1] if long else None
        if peer == self.recorded:
            return
        self.recorded = peer
        if peer is None:
            self._store(lambda st, key: st.delete_key(key))
        else:
            self._store(functools.partial(_set_value, value=str(peer)))

    def _store(self, op: Callable[[Any, str], Any]) -> None:
        if self.pg.store is not None and not EXITING.is_set():
            try:
                op(self.pg.store, self.pg.waits_key(self.pg.rank))
            except Exception:  # the store may be gone; the wait itself still times out
                pass


class SendReaper:
    """Holds sent tensors until their sends complete (gloo's send waits for the receiver), on a
    background thread, so the main thread never blocks on a send -- unless it asks to
    (`settled`: a pipeline under a memory limit bounds how long sent values live)."""

    def __init__(self, pg: PPGroup, timeout: float) -> None:
        self.pg, self.timeout = pg, timeout
        self.queue: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.peer: int | None = None  # whom the send being waited on goes to
        self.submitted = 0  # sends submitted, and of them completed (in order: one thread)
        self._done = 0
        self._cv = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="fpipe-send-reaper", daemon=True)
        self.thread.start()
        settle_at_exit(self._settle)

    def submit(
        self, works: list[Any], tensors: list[torch.Tensor], what: str, peer: int | None = None
    ) -> None:
        self.submitted += 1
        self.queue.put((works, tensors, what, peer))

    def settled(self, n: int) -> None:
        """Block until the first `n` submitted sends have completed (their tensors let go); a
        send's failure is raised here. Each send's own wait is bounded by the timeout, so this
        wait is too."""
        with self._cv:
            self._cv.wait_for(lambda: self._done >= n)
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _loop(self) -> None:
        while True:
            works, tensors, what, peer = self.queue.get()
            self.peer = peer
            try:
                if works is not None and self.error is None:
                    self.pg.wait_all(works, self.timeout, functools.partial(str, what), peer)
            except BaseException as err:  # surfaced by drain() on the main thread
                self.error = err
            finally:
                del works, tensors
                with self._cv:
                    self._done += 1
                    self._cv.notify_all()
                self.queue.task_done()

    def _settle(self) -> None:
        """At exit: let pending sends and their error handling finish (NOTE [threads at exit])."""
        start = time.monotonic()
        while self.queue.unfinished_tasks:
            higher = self.peer is not None and self.peer > self.pg.rank
            if time.monotonic() - start > (self.timeout if higher else _SETTLE_S):
                return
            time.sleep(0.01)

    def drain(self) -> None:
        """Block until every submitted send completed; re-raise a send's failure."""
        self.queue.join()
        if self.error is not None:
            err, self.error = self.error, None
            raise err


def pp_group(mesh: Any = None, timeout: float = DEFAULT_TIMEOUT) -> PPGroup | None:
    """The pipeline group: the mesh's "pp" dimension, else all ranks; None in one process."""
    if mesh is not None:
        if "pp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                f"pipeline(mesh=...): the mesh has dimensions {mesh.mesh_dim_names}; it needs one named 'pp'."
            )
        group = mesh.get_group("pp")
    else:
        if not start_group(timeout):
            return None
        group = dist.group.WORLD
    return group_of(group)


def group_of(group: Any) -> PPGroup | None:
    """A `PPGroup` over a process group (a dimension of the pipeline's mesh); None at size 1."""
    size = dist.get_world_size(group)
    if size == 1:
        return None
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    return PPGroup(group, dist.get_rank(group), size, device, store)


def namespace_for(group: Any) -> str:
    """Store keys of a new pipeline in `group`: "fpipe/<hash of the group's global ranks>/<n>",
    n counting the pipelines of that group this process has called. Every rank of the group
    makes its pipelines' first calls in the same order (their collectives match by order), so
    the n-th pipeline has the same keys on every rank; dp replicas (other pp groups) never
    share them."""
    ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
    gid = hashlib.blake2b(ranks.encode(), digest_size=6).hexdigest()
    with _SEQ_LOCK:
        n = _SEQ[gid] = _SEQ.get(gid, -1) + 1
    return f"fpipe/{gid}/{n}"
