"""fpipe: JAX-style functional staging for PyTorch pipeline parallelism.

The public API is this import list; everything else lives in `fpipe._src`.
"""

from . import schedules as schedules
from ._src.api import Pipelined as Pipelined
from ._src.api import pipeline as pipeline
from ._src.autodiff import grad as grad
from ._src.autodiff import value_and_grad as value_and_grad
from ._src.checkpoint import AsyncCheckpoint as AsyncCheckpoint
from ._src.checkpoint import async_save as async_save
from ._src.checkpoint import save as save
from ._src.checkpoint_files import CheckpointError as CheckpointError
from ._src.checkpoint_load import load as load
from ._src.checkpoint_manager import CheckpointManager as CheckpointManager
from ._src.checkpoint_manager import Restored as Restored
from ._src.functionalize import functionalize as functionalize
from ._src.generate import generate as generate
from ._src.generator import Generator as Generator
from ._src.generator import Request as Request
from ._src.marker import stage_boundary as stage_boundary
from ._src.optim import clip_grad_norm_ as clip_grad_norm_
from ._src.optim import set_grads as set_grads
from ._src.plan import Plan as Plan
from ._src.plan import plan as plan
from ._src.precision import Precision as Precision
from ._src.scaler import LossScaler as LossScaler

__version__ = "0.1.0"
