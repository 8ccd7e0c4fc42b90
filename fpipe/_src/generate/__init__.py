"""Generation: `fpipe.generate`, a causal LM's decode pipelined with a K/V cache per stage.

Above `runtime`, `stages`, `tracing`, `pipeline` (materialisation) and `training` (the checkpoint reader).
`generate` (the API; `fpipe.generate` is `generate.generate`, not re-exported here so that the
module keeps its name), `generate_check` (refusals), `generate_settings` (the settings
allowlist), `decode` (the step traced and cut at decoder blocks), `decode_traces` (traces kept
by key, the K/V layout), `kv_cache` (`SlotCache`; imports transformers, so nothing imports it at
`import fpipe`), `kv_writes` (cache writes in place), `decode_run` (the (step, microbatch) loop
over this rank's stages), `decode_walk` (the one order every rank walks its stages in),
`generate_sample` (argmax or seeded draws), `generator_cache` (a step with every cache row at its
own position, for the request loop) and `stage_weights` (a meta model's stage-local weights,
read through the checkpoint reader: hence above `training`). It offers the request loop (`serve`)
the step's traces, checks, sampling and stage channels.
"""

from .decode import Layout, Programs, Shapes, stage_cuts
from .decode_run import RankWalk, run_stage
from .decode_traces import StepTraces, kv_layout
from .generate import TRACES, group_of, seed_of
from .generate_check import check_call, eos_and_pad, refill_step, stage_count
from .generate_sample import Selector
from .generate_settings import resolve

__all__ = [
    "Layout", "Programs", "RankWalk", "Selector", "Shapes", "StepTraces", "TRACES", "check_call",
    "eos_and_pad", "group_of", "kv_layout", "refill_step", "resolve", "run_stage", "seed_of",
    "stage_count", "stage_cuts",
]  # fmt: skip
