"""Pytree helpers: one registry (torch's, backed by optree) and one key order on every rank."""

from __future__ import annotations

from typing import Any

import torch.utils._cxx_pytree as _pytree

TreeSpec = _pytree.TreeSpec
flatten = _pytree.tree_flatten
unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map


def structure_str(spec: Any) -> str:
    return str(spec)


def broadcast_prefix(prefix: Any, full: Any) -> list[Any]:
    """Expand `prefix` (e.g. `in_axes`) to one entry per leaf of `full`."""
    return list(_pytree.broadcast_prefix(prefix, full, is_leaf=lambda x: x is None))
