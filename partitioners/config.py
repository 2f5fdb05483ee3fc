"""The one configuration object that travels down a ckpt compile."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Mapping

ENV_PREFIX = "CKPT_"

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting has a value ckpt cannot use; the message names the fix."""


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BUDGET_FORMS = (
    "a fraction 0.0..1.0 of the runtime-optimal saved bytes (1.0 = fastest plan, "
    "0.0 = save as little as possible), or bytes such as 512MiB, 2GB, 1.5e9"
)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """Bytes of activations one compiled graph may save for backward: a
    ``fraction`` of the runtime-optimal plan's, or absolute ``nbytes``."""

    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, value, name: str = "memory_budget") -> "MemoryBudget":
        """``0.5``, ``"0.5"``, ``"512MiB"``, ``"2GB"``, ``1.5e9``; anything else is a ConfigError."""
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{name}={value!r} is not a memory budget; use {_BUDGET_FORMS}")
        if isinstance(value, str):
            match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", value)
            unit = match.group(2).lower() if match else None
            if unit not in _BYTE_UNITS:
                raise ConfigError(f"{name}={value!r} is not a memory budget; use {_BUDGET_FORMS}")
            try:
                number = float(match.group(1))
            except ValueError:
                raise ConfigError(
                    f"{name}={value!r} is not a memory budget; use {_BUDGET_FORMS}"
                ) from None
            if unit:
                return cls._bytes(number * _BYTE_UNITS[unit], name, value)
            value = number
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}={value!r} is not a memory budget; use {_BUDGET_FORMS}")
        if value <= 1:
            return cls(fraction=float(value))
        return cls._bytes(value, name, value)

    @classmethod
    def _bytes(cls, number: float, name: str, text) -> "MemoryBudget":
        if not math.isfinite(number) or number < 0:
            raise ConfigError(f"{name}={text!r} is not a memory budget; use {_BUDGET_FORMS}")
        return cls(nbytes=int(number))

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of runtime-optimal"
        return f"{self.nbytes} bytes"


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the ckpt partitioner.

    Build one with ``Config.from_env()`` (reads ``CKPT_*`` variables) or
    directly; every field has a safe default.
    """

    strict: bool = False
    """Raise when the partitioner fails instead of warning and falling back to
    PyTorch's partitioner. For tests and debugging (``CKPT_STRICT``)."""

    report_dir: str | None = dataclasses.field(default=None, metadata={"env": "CKPT_REPORT"})
    """Folder to write a report (markdown and JSON) for every graph compiled
    (``CKPT_REPORT``). Reports compare each decision with PyTorch's
    partitioner; graphs are then not served from Inductor's cache."""

    memory_budget: MemoryBudget | None = None
    """Bytes of activations each compiled graph may save for backward
    (``CKPT_MEMORY_BUDGET``): a fraction ``0.0``..``1.0`` of the runtime-optimal
    plan's saved bytes, or bytes such as ``512MiB``, ``2GB``, ``1.5e9``. Within
    it ckpt picks the plan with the least estimated recompute time. None: the
    runtime-optimal plan. Strings and numbers given here are parsed alike."""

    device_profile: str | None = None
    """Device whose speed the recompute cost model assumes (``CKPT_DEVICE_PROFILE``):
    one of partitioners.cost.DEVICE_PROFILES. None: from the graph's device."""

    def __post_init__(self):
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", MemoryBudget.parse(self.memory_budget))
        if self.device_profile is not None:
            from .cost import DEVICE_PROFILES  # cost imports torch; config stays light

            if self.device_profile not in DEVICE_PROFILES:
                raise ConfigError(
                    f"device_profile={self.device_profile!r} is unknown; "
                    f"use one of {', '.join(DEVICE_PROFILES)}"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Config":
        """Read ``CKPT_<FIELD>`` variables; the only place ckpt reads the environment."""
        environ = os.environ if environ is None else environ
        known = {env_variable(f): f for f in dataclasses.fields(cls)}
        values = {}
        for variable, text in environ.items():
            if not variable.startswith(ENV_PREFIX):
                continue
            field = known.get(variable)
            if field is None:
                warnings.warn(
                    f"{variable} is not a ckpt setting and is ignored; "
                    f"known settings: {', '.join(sorted(known))}",
                    stacklevel=2,
                )
                continue
            values[field.name] = _parse(variable, text, field.type)
        return cls(**values)

    def replace(self, **overrides) -> "Config":
        """A copy with some fields changed; an unknown field name is a clear error."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(
                f"unknown ckpt setting(s) {unknown}; valid settings: {sorted(names)}"
            )
        return dataclasses.replace(self, **overrides)


def env_variable(field: dataclasses.Field) -> str:
    """The environment variable that sets a Config field."""
    return field.metadata.get("env", ENV_PREFIX + field.name.upper())


def _parse(variable: str, text: str, type_name: str):
    if type_name == "bool":
        word = text.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise ConfigError(
            f"{variable}={text!r} is not a boolean; use one of "
            f"{', '.join(_TRUE_WORDS)} or {', '.join(_FALSE_WORDS)}"
        )
    if type_name == "str | None":
        return text.strip() or None
    if type_name == "MemoryBudget | None":
        return MemoryBudget.parse(text, name=variable) if text.strip() else None
    raise AssertionError(f"no parser for settings of type {type_name}")
