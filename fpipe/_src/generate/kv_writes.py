"""The K/V cache writes of a traced decode step made in place (NOTE [a cache whose position is
data] in kv_cache.py). No transformers import here: `import fpipe` must not need it."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..tracing import writes

__all__ = ["inplace_cache_writes"]

# the cache writes (kv_cache.py: `index_copy` at one position; generator_cache.py: `scatter` at
# each row's own) and their in-place forms
_INPLACE = {
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
    torch.ops.aten.scatter.src: torch.ops.aten.scatter_.src,
}


def inplace_cache_writes(gm: fx.GraphModule) -> list[str]:
    """Make each `index_copy(buf, d, i, x)` (or `scatter(buf, d, i, x)`) of an input `buf` that
    nothing else reads an in-place `buf.index_copy_(d, i, x)` (`buf.scatter_(d, i, x)`): the buffer is the program's own state (NOTE [a cache
    whose position is data]), so the write lands in it and no step copies a whole cache.
    (A write the trace recorded in place comes out of functionalisation as that op plus a
    `copy_` back into `buf`; the `copy_` is then dropped.) Returns the buffers written."""
    written = []
    nodes = [n for op in _INPLACE for n in gm.graph.find_nodes(op="call_function", target=op)]
    for node in nodes:
        buf = node.args[0]
        if not isinstance(buf, fx.Node) or buf.op != "placeholder":
            continue
        back = [u for u in buf.users if writes(u) == [buf] and u.args[1:2] == (node,)]  # NOTE [effects]
        if set(buf.users) != {node, *back}:
            continue  # read elsewhere too: writing in place could change that reader's value
        node.target = _INPLACE[node.target]
        for copy in back:
            copy.replace_all_uses_with(node)
            gm.graph.erase_node(copy)
        written.append(buf.name)
    gm.graph.lint()
    gm.recompile()
    return written
