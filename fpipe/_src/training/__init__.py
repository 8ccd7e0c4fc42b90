"""Training: what a training loop uses around a pipeline step, and its checkpoints.

Above `pipeline`. `optim` (`clip_grad_norm_` over every rank, `set_grads`), `scaler` (fp16
loss scaling every rank agrees on), and the checkpoints: `checkpoint` (`save`, `async_save`),
`checkpoint_load` (`load`), `checkpoint_manager` (`CheckpointManager`), `checkpoint_job` (one
save's writing; registers its pipeline-call check), `checkpoint_files` (a directory refused
unless ours, published atomically), `checkpoint_format` (safetensors + JSON, no pickle) and
`checkpoint_hf` (Hugging Face directories read in place).
"""

from . import checkpoint_hf
from .checkpoint_load import read_into
from .optim import clip_grad_norm_, set_grads

__all__ = ["checkpoint_hf", "clip_grad_norm_", "read_into", "set_grads"]
