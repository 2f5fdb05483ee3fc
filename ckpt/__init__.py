"""ckpt: compile-time activation checkpointing for torch.compile.

    from ckpt import ckpt_backend
    model = torch.compile(model, backend=ckpt_backend)   # or backend="ckpt"
"""
from partitioners.config import Config, ConfigError, MemoryBudget
from partitioners.plan import Decision, Plan

from .backend import CkptBackend, ckpt_backend, make_backend

__all__ = [
    "CkptBackend",
    "Config",
    "ConfigError",
    "MemoryBudget",
    "Decision",
    "Plan",
    "ckpt_backend",
    "make_backend",
]
