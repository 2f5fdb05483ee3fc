"""ckpt: compile-time activation checkpointing for torch.compile.

    from ckpt import ckpt_backend
    model = torch.compile(model, backend=ckpt_backend)   # or backend="ckpt"

Names are loaded on first use: ``import ckpt`` (and the pytest plugin,
``ckpt.pytest_plugin``) imports no torch and changes nothing in the process.
"""
import importlib

_WHERE = {
    "CkptBackend": "ckpt.backend",
    "ckpt_backend": "ckpt.backend",
    "make_backend": "ckpt.backend",
    "Config": "partitioners.config",
    "ConfigError": "partitioners.config",
    "MemoryBudget": "partitioners.config",
    "Decision": "partitioners.plan",
    "Plan": "partitioners.plan",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
