"""Start multi-process workers for the tests: torchrun launches and bare per-rank processes.

Every launch has a hard deadline; whatever is still running then is SIGKILLed by process id
(a started process and its descendants, nothing else), so a hanging library fails a test
instead of hanging the suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent  # tests/support: the launch workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # the workers import fpipe from this checkout (a second worktree tests its own code)
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)
    return env


@dataclasses.dataclass
class Proc:
    """One started process (a torchrun or a bare rank): its output files and when it ended."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    ended: float | None = None  # wall time (time.time()) of the exit, as seen by polling

    @property
    def rc(self) -> int | None:
        return self.popen.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    env = _env() if env is None else env
    with open(log, "wb") as f:  # stdout and stderr together, in order
        popen = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Proc(name, popen, log)


def wait_all(procs: list[Proc], deadline_s: float) -> bool:
    """Poll until every process ended or `deadline_s` passed; True if all ended by themselves.
    Each process's `ended` is the wall time its exit was seen (polled every 50 ms)."""
    end = time.monotonic() + deadline_s
    while any(p.ended is None for p in procs) and time.monotonic() < end:
        for p in procs:
            if p.ended is None and p.popen.poll() is not None:
                p.ended = time.time()
        time.sleep(0.05)
    return all(p.ended is not None for p in procs)


def _descendants(pid: int) -> list[int]:
    """Process ids below `pid` (from /proc): torchrun starts each worker in its own session."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill(procs: list[Proc]) -> None:
    """End what is left of these launches: SIGKILL each process and everything it started
    (torchrun's workers too), by process id; a stopped process dies of SIGKILL as well."""
    for p in procs:
        if p.popen.poll() is None:
            for pid in [*_descendants(p.popen.pid), p.popen.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        p.popen.wait()
        if p.ended is None:
            p.ended = time.time()


def torchrun_cmd(
    script: str, nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, port: int | None = None,
    max_restarts: int = 0,
) -> list[str]:  # fmt: skip
    """A torchrun command line: standalone for one node, c10d rendezvous on loopback for several;
    with `max_restarts`, torchrun starts the whole job again after a rank fails (that often)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if nnodes == 1 and port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"fpipe-test-{port}"]
    return [*cmd, str(WORKERS / script), *args]


def run_torchrun(nodes: list[list[str]], out: Path, deadline_s: float) -> list[Proc]:
    """Start one torchrun per node concurrently; wait (hard deadline); return them ended."""
    out.mkdir(parents=True, exist_ok=True)
    procs = [start(f"node{i}", cmd, out / f"node{i}.log", _env()) for i, cmd in enumerate(nodes)]
    try:
        wait_all(procs, deadline_s)
    finally:
        kill(procs)
    return procs


class AgentStore:
    """A c10d TCPStore served from the test process, as torchrun's agent serves one: the workers
    connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True), so it outlives any rank."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.port = free_port()
        self.store = dist.TCPStore(
            "127.0.0.1",
            self.port,
            world,
            is_master=True,
            timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )

    def env(self, rank: int, world: int) -> dict[str, str]:
        return _env(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RESTART_COUNT="0",
        )  # fmt: skip


def start_ranks(script: str, world: int, out: Path, *args: str) -> tuple[list[Proc], AgentStore]:
    """Start `world` bare processes of `script` (no launcher: nothing ends them but themselves)."""
    out.mkdir(parents=True, exist_ok=True)
    store = AgentStore(world)
    cmd = [sys.executable, str(WORKERS / script), *args]
    procs = [start(f"rank{r}", cmd, out / f"rank{r}.log", store.env(r, world)) for r in range(world)]
    return procs, store


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def report(procs: list[Proc], tail: int = 4000) -> str:
    """Exit codes and the end of each process's output, for assertion messages."""
    return "\n".join(f"--- {p.name} rc={p.rc}\n{p.text()[-tail:]}" for p in procs)
