"""Parallel dimensions beside the pipeline: dp replicas, sharded parameters, tensor parallelism,
and how outputs combine over the batch they divide.

Above `runtime` (their work runs from the runners' before/after-action hooks). `replicas`
(`mesh_groups`: the mesh's pp/dp/tp groups; `GradReducer`: gradient sums over dp in buckets),
`sharding` (ZeRO/FSDP-style `Shard(0)` parameters: `Gatherer`, reduce-scattered gradients),
`tp` (DTensor parameters traced into programs over local shards), `tp_collectives` (the
collectives those programs run, with failure-aware waits), and the batch dimension they divide:
`reduction` (how each output of a traced program combines over the examples, read off the graph,
tp collectives included) with `batch_moves` (the ops that move the batch axis).
"""

from .reduction import Reading, read_outputs
from .replicas import GradReducer, Groups, mean_of, mesh_groups, reduce_values
from .sharding import Gatherer, broadcast_shard, check_sharded, local_leaves
from .tp import (
    check_no_loss_parallel,
    plain_outputs,
    refusing_loss_parallel,
    split_params,
    trace_joint_tp,
    wrapping,
)
from .tp_collectives import rewrite, tp_all_gather, tp_all_reduce, tp_broadcast, tp_reduce_scatter

__all__ = [
    "Gatherer", "GradReducer", "Groups", "Reading", "broadcast_shard", "check_no_loss_parallel", "check_sharded",
    "local_leaves", "mean_of", "mesh_groups", "plain_outputs", "read_outputs", "reduce_values", "refusing_loss_parallel",
    "rewrite", "split_params", "tp_all_gather", "tp_all_reduce", "tp_broadcast", "tp_reduce_scatter",
    "trace_joint_tp", "wrapping",
]  # fmt: skip
