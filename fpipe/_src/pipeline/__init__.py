"""The pipeline: `pipeline(f)`, `Pipelined` and the data path of one call.

Above `memory`, `parallel`, `runtime`, `stages`, `schedules` and `tracing`. `api` (`pipeline`,
`Pipelined`, the facade), `autodiff` (`value_and_grad`, `grad`), `config` (the arguments,
checked), `inputs` (a call flattened, keyed and split), `compiler` (a signature -> a cached plan:
trace, cut, reductions, joint, split, schedule, runner), `out_reduce` (how each output combines over microbatches, read off the forward graph with
`parallel`'s `reduction`), `execute` (one step; the checks run before every call), `outputs`
(reduced outputs and gradients; who owns what), `materialize` (only this rank's parameters of a
meta model) and `transforms` with `transforms_fns` and `transforms_vjp` (a torch.func transform
around a call in a process group: one pipelined call of an equivalent plain function).
"""

from .api import Pipelined, pipeline
from .autodiff import grad, value_and_grad
from .execute import check_before_calls
from .materialize import materialize_module
from .outputs import local_inputs

__all__ = [
    "Pipelined",
    "check_before_calls",
    "grad",
    "local_inputs",
    "materialize_module",
    "pipeline",
    "value_and_grad",
]
