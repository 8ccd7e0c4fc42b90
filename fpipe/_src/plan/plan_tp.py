"""Planning around tensor parallelism: tp from the parameters' layout, cuts between blocks.

# NOTE [planning with tensor parallelism]
fpipe cannot shard an arbitrary function: a model is tensor-parallel because its author
parallelized it (`parallelize_module(model, mesh["tp"], plan)`), and `fpipe.plan` takes tp from
the parameters. DTensor parameters on one 1-D mesh named "tp" give tp = its size, and the layouts
enumerated are every dp x pp = world_size / tp around it (`tp_layout`); a model with plain
parameters plans tp = 1. With `plan(..., tensor_parallel=build)`, `build(tp_mesh) -> (f, params)`
parallelizes a fresh model on a ("rest", "tp") mesh of (world_size // tp, tp) for every tp > 1
dividing world_size (`plan_measure.tp_builds`; a tp whose build raises on any rank is dropped,
saying why), and those tps are planned with tp = 1 and ranked together; each candidate carries
its model (`Plan.function`, `Plan.params`). The tp mesh must hold consecutive ranks,
(world_size // tp, tp) with tp last, because `pipeline(plan=p)` builds its ("dp", "pp", "tp")
mesh that way, over the parameters' own tp group (plan.py `_mesh`: `DeviceMesh.from_group`);
any other is refused before anything is measured.

Cuts. fpipe does not choose operation-level cuts of a tensor-parallel function (its joint is
traced from the function again, so a cut must be a module path: compiler.py `_cut`). The planner
cuts at the entries of the model's longest ModuleList (`blocks.1`, `blocks.2`, ...: `entries`,
read from the parameter names). A local pipeline with one stage per entry -- every rank running
its shard, every tp group at once, as in the job -- times each segment's forward and backward
(the first segment holds what comes before the list, the last what comes after it: a heavy head
weighs on the last); each candidate's stages are then contiguous runs of segments, the slowest
run as fast as it can be (`group`), and the candidate is timed as any other. `Plan.cuts` are those
paths, and `pipeline(plan=p)` passes them as `cuts=`.
"""

from __future__ import annotations

import re
from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from ..parallel import Groups
from ..runtime import group_of

__all__ = ["tp_layout", "entries", "group", "tp_groups"]

_ENTRY = re.compile(r"^(.*?)\.(\d+)\.")


def tp_layout(call: str, params: Any, world_size: int) -> tuple[int, Any]:
    """(tp, the parameters' "tp" mesh) -- (1, None) without DTensor parameters -- or a
    ValueError saying why the layout cannot be planned (NOTE [planning with tensor parallelism])."""
    meshes: list[Any] = []
    for p in tree_flatten(params)[0]:
        if isinstance(p, DTensor) and not any(p.device_mesh is m for m in meshes):
            meshes.append(p.device_mesh)
    if not meshes:
        return 1, None
    mesh = meshes[0]
    if any(m != mesh for m in meshes[1:]) or mesh.ndim != 1 or mesh.mesh_dim_names != ("tp",):
        names = sorted({str(m.mesh_dim_names) for m in meshes})
        raise ValueError(
            f"{call}: the DTensor parameters lie on mesh(es) {', '.join(names)}; fpipe.plan plans "
            "around tensor parallelism on one mesh's 'tp' dimension: parallelize the model on "
            "init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=('rest', 'tp'))['tp']."
        )
    if not isinstance(params, dict):
        raise ValueError(
            f"{call}: tensor-parallel parameters must come as a dict (as fpipe.functionalize "
            f"returns them): the planner cuts by their module paths; got {type(params).__name__}."
        )
    tp = mesh.size()
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    first = ranks[0] - ranks[0] % tp
    if world_size % tp or ranks != list(range(first, first + tp)):
        raise ValueError(
            f"{call}: the parameters' tp mesh holds ranks {ranks} (tp={tp}) of world_size="
            f"{world_size}; fpipe.plan needs tp to divide the world and each tp group to be "
            "consecutive ranks, as pipeline(plan=p) builds its ('dp', 'pp', 'tp') mesh: "
            "init_device_mesh(device, (world_size // tp, tp), mesh_dim_names=('rest', 'tp'))['tp']."
        )
    return tp, mesh


def entries(params: dict[str, Any]) -> list[str]:
    """The module paths of the entries of the model's longest ModuleList, in order
    (["blocks.0", "blocks.1", ...]), read from the parameter names; [] without one."""
    found: dict[str, set[int]] = {}
    for key in params:
        m = _ENTRY.match(str(key))
        if m:
            found.setdefault(m[1], set()).add(int(m[2]))
    if not found:
        return []
    name = max(found, key=lambda k: (len(found[k]), -len(k)))
    return [f"{name}.{i}" for i in sorted(found[name])]


def group(weights: list[float], n: int) -> list[int]:
    """Where each of `n` contiguous runs of `weights` begins (the first at 0), the heaviest run
    as light as it can be (ties: the earliest cut)."""
    k = len(weights)
    if not 1 <= n <= k:
        raise ValueError(f"cannot group {k} segments into {n} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: the least heaviest run grouping the first i segments into j runs
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    start = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for s in range(j - 1, i):
                v = max(best[j - 1][s], prefix[i] - prefix[s])
                if v < best[j][i]:
                    best[j][i], start[j][i] = v, s
    out, i = [], k
    for j in range(n, 0, -1):
        i = start[j][i]
        out.append(i)
    return out[::-1]


def tp_groups(tp_mesh: Any, timeout: float) -> Groups:
    """The `Groups` of a local pipeline whose programs run their tp collectives on `tp_mesh`."""
    return Groups(None, None, tp=group_of(tp_mesh.get_group()), tp_mesh=tp_mesh, timeout=timeout)
