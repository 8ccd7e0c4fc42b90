"""fpipe: JAX-style functional staging for PyTorch pipeline parallelism.

The public API is this import list; everything else lives in `fpipe._src`.
"""

from . import schedules as schedules
from ._src.generate.generate import generate as generate
from ._src.pipeline.api import Pipelined as Pipelined
from ._src.pipeline.api import pipeline as pipeline
from ._src.pipeline.autodiff import grad as grad
from ._src.pipeline.autodiff import value_and_grad as value_and_grad
from ._src.plan.plan import Plan as Plan
from ._src.plan.plan import plan as plan
from ._src.runtime.precision import Precision as Precision
from ._src.serve.generator import Generator as Generator
from ._src.serve.generator import Request as Request
from ._src.tracing.functionalize import functionalize as functionalize
from ._src.tracing.marker import stage_boundary as stage_boundary
from ._src.training.checkpoint import AsyncCheckpoint as AsyncCheckpoint
from ._src.training.checkpoint import async_save as async_save
from ._src.training.checkpoint import save as save
from ._src.training.checkpoint_files import CheckpointError as CheckpointError
from ._src.training.checkpoint_load import load as load
from ._src.training.checkpoint_manager import CheckpointManager as CheckpointManager
from ._src.training.checkpoint_manager import Restored as Restored
from ._src.training.optim import clip_grad_norm_ as clip_grad_norm_
from ._src.training.optim import set_grads as set_grads
from ._src.training.scaler import LossScaler as LossScaler

__version__ = "0.1.0"
