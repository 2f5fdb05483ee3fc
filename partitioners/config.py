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
    "0.0 = save as little as possible), bytes saved such as 512MiB, 2GB, 1.5e9, "
    "or a step peak such as peak:6GiB or peak:auto"
)
PEAK_PREFIX = "peak:"
# A bare number above 1 is a byte count only if it is a whole number of at
# least this many bytes: 1.5 or 80 are typos for a fraction or a unit, and
# read as bytes they would recompute every matmul without a word.
MIN_BARE_BYTES = 1024


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What one compiled graph may use: a ``fraction`` of the runtime-optimal
    plan's saved bytes, absolute saved ``nbytes``, or a step peak
    (``peak_bytes``, or ``peak_auto``: the CUDA device's free memory at compile
    time less PEAK_AUTO_MARGIN)."""

    fraction: float | None = None
    nbytes: int | None = None
    peak_bytes: int | None = None
    """Bytes the training step may allocate above what is live before it
    (parameters, optimizer state, inputs): ``peak:6GiB``."""
    peak_auto: bool = False
    pytorch_meaning: bool = False
    """A fraction from PyTorch's own settings (``region_activation_memory_budget``,
    functorch's ``activation_memory_budget``), kept in PyTorch's meaning: at
    most ``fraction`` of the runtime-optimal saved bytes, a hard limit like
    a byte budget (ckpt's own fraction instead stops at the plan of lowest
    predicted peak, below which saving less only raises the peak)."""

    regions: tuple[tuple[str, float], ...] = ()
    """Per-module fractions: ``(module path prefix, fraction)``, the longest
    prefix matching a node's module path wins (``"vision_tower=0.0"``). The
    fields above are then the rest of the graph's budget (``fraction`` or
    ``nbytes``; None: runtime-optimal) and the step's cap (``peak_bytes``)."""
    pytorch_regions: bool = False
    """The graph holds ``region_activation_memory_budget`` regions that do not
    cover it whole (or several budgets): each region gets its own budget, the
    fields above are the rest's (partitioners/regions.py)."""

    @property
    def is_peak(self) -> bool:
        return self.peak_bytes is not None or self.peak_auto

    @property
    def regional(self) -> bool:
        """Budgets differ by region of the graph (partitioners/regions.py)."""
        return bool(self.regions) or self.pytorch_regions

    @property
    def rest(self) -> "MemoryBudget | None":
        """The fraction or byte part alone (None: neither): a regional budget's rest."""
        if self.fraction is None and self.nbytes is None:
            return None
        return MemoryBudget(fraction=self.fraction, nbytes=self.nbytes, pytorch_meaning=self.pytorch_meaning)

    @property
    def cap(self) -> "MemoryBudget | None":
        """The ``peak:`` part alone (None: no cap)."""
        return MemoryBudget(peak_bytes=self.peak_bytes, peak_auto=self.peak_auto) if self.is_peak else None

    @classmethod
    def parse(cls, value, name: str = "memory_budget") -> "MemoryBudget":
        """``0.5``, ``"0.5"``, ``"512MiB"``, ``"2GB"``, ``1.5e9``, ``"peak:6GiB"``,
        ``"peak:auto"``; anything else is a ConfigError."""
        if isinstance(value, MemoryBudget):
            return value
        if isinstance(value, Mapping):
            return cls._regional(list(value.items()), name, value)
        if isinstance(value, str) and REGION_ASSIGN in value:
            entries = [_region_entry(entry) for entry in value.split(REGION_SEPARATOR) if entry.strip()]
            return cls._regional(entries, name, value)
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{name}={value!r} is not a memory budget; use {_BUDGET_FORMS}")
        if isinstance(value, str) and value.strip().lower().startswith(PEAK_PREFIX):
            return cls._peak(value, name)
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
        if value != int(value) or value < MIN_BARE_BYTES:
            raise ConfigError(
                f"{name}={value!r} is neither a fraction 0.0..1.0 nor a plausible byte count "
                f"(a whole number of at least {MIN_BARE_BYTES}, or a number with a unit); "
                f"use {_BUDGET_FORMS}"
            )
        return cls._bytes(value, name, value)

    @classmethod
    def _bytes(cls, number: float, name: str, text) -> "MemoryBudget":
        if not math.isfinite(number) or number < 0:
            raise ConfigError(f"{name}={text!r} is not a memory budget; use {_BUDGET_FORMS}")
        return cls(nbytes=int(number))

    @classmethod
    def _peak(cls, text: str, name: str) -> "MemoryBudget":
        rest = text.strip()[len(PEAK_PREFIX):].strip()
        if rest.lower() == "auto":
            return cls(peak_auto=True)
        try:
            nbytes = cls.parse(rest, name).nbytes
        except ConfigError:
            nbytes = None
        if nbytes is None:  # a fraction, or not a number
            raise ConfigError(
                f"{name}={text!r} is not a peak budget; after 'peak:' give bytes such as "
                "6GiB, 512MiB, 2e9, or 'auto' (CUDA: free device memory less a margin)"
            )
        return cls(peak_bytes=nbytes)

    @classmethod
    def _regional(cls, entries: list, name: str, given) -> "MemoryBudget":
        """Per-module fractions from ``(path prefix, budget)`` pairs; the empty
        prefix is the rest of the graph (a fraction or bytes) or the step's
        cap (``peak:...``)."""
        regions: dict[str, float] = {}
        rest = cap = None
        for key, value in entries:
            if not isinstance(key, str):
                raise ConfigError(f"{name}={given!r}: module path {key!r} is not a str; {_REGION_FORMS}")
            path = module_path_key(key)
            where = f"{name}[{path!r}]" if path else name
            if path and not _MODULE_PATH.fullmatch(key.strip()):
                raise ConfigError(
                    f"{where}: {key!r} is not a module path (names and indices joined by dots, as "
                    f"model.named_modules() lists them, e.g. 'language_model.layers.3'); {_REGION_FORMS}"
                )
            budget = cls.parse(value, where)
            if budget.regional:
                raise ConfigError(f"{where}={value!r}: a module's budget is one value; {_REGION_FORMS}")
            if path and budget.fraction is None:
                raise ConfigError(
                    f"{where}={value!r}: a module's budget is a fraction 0.0..1.0; bytes and peak: budgets "
                    f"are the whole step's, give them without a module path; {_REGION_FORMS}"
                )
            if path in regions or (not path and (cap if budget.is_peak else rest) is not None):
                what = repr(path) if path else "the step's cap" if budget.is_peak else "the rest of the graph"
                raise ConfigError(f"{name}={given!r} gives {what} two budgets; {_REGION_FORMS}")
            if path:
                regions[path] = budget.fraction
            elif budget.is_peak:
                cap = budget
            else:
                rest = budget
        if not regions:
            raise ConfigError(f"{name}={given!r} names no module; {_REGION_FORMS}")
        rest, cap = rest or cls(), cap or cls()
        return cls(
            fraction=rest.fraction, nbytes=rest.nbytes, peak_bytes=cap.peak_bytes, peak_auto=cap.peak_auto,
            regions=tuple(sorted(regions.items())),
        )

    def __str__(self) -> str:
        if self.regional:
            parts = [f"{path}={fraction:g}" for path, fraction in self.regions]
            if self.pytorch_regions:
                parts.append("region_activation_memory_budget regions")
            parts.append(f"rest: {self.rest or 'runtime-optimal'}")
            if self.cap is not None:
                parts.append(f"cap: {self.cap}")
            return ", ".join(parts)
        if self.fraction is not None:
            return f"{self.fraction:g} of runtime-optimal" + (" (PyTorch's meaning)" if self.pytorch_meaning else "")
        if self.peak_auto:
            return "peak:auto" + ("" if self.peak_bytes is None else f" ({self.peak_bytes} bytes)")
        if self.peak_bytes is not None:
            return f"peak {self.peak_bytes} bytes"
        return f"{self.nbytes} bytes"


# The compact form of per-module budgets: "vision_tower=0.0,language_model.layers=0.5,peak:6GiB".
REGION_ASSIGN = "="
REGION_SEPARATOR = ","
_REGION_FORMS = (
    "per-module budgets map module path prefixes to fractions, e.g. "
    "{'vision_tower': 0.0, 'language_model.layers': 0.5} or CKPT_MEMORY_BUDGET="
    "'vision_tower=0.0,language_model.layers=0.5'; an entry without a path (the key '' "
    "in a mapping) is the rest of the graph's fraction or bytes, or a peak: cap on the step"
)
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+|\[\d+\])*")  # layers.3.mlp, layers[3].mlp
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_path_key(path: str) -> str:
    """A module path in the dotted form budgets match on: ``layers[0].mlp``
    and ``layers.0.mlp`` are both ``layers.0.mlp``."""
    return _INDEX.sub(r".\1", path.strip()).strip(".")


def _region_entry(entry: str) -> tuple[str, str]:
    path, assigned, value = entry.partition(REGION_ASSIGN)
    return (path, value) if assigned else ("", entry)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Warn with ``message`` the first time only (a model compiles many graphs)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _parse_bool(value, name: str) -> bool:
    """A bool, or one of the words the environment accepts ("false" -> False)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ConfigError(
        f"{name}={value!r} is not a boolean; use one of "
        f"{', '.join(_TRUE_WORDS)} or {', '.join(_FALSE_WORDS)} (or a Python bool)"
    )


def _parse_folder(value, name: str) -> str | None:
    """A folder path (str or os.PathLike) kept as a str; empty or None: no folder."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{name}={value!r} is not a folder path; use a str or pathlib.Path "
            "(or None for no reports)"
        )
    return value.strip() or None


def _parse_budget(value, name: str) -> MemoryBudget | None:
    return None if value is None else MemoryBudget.parse(value, name=name)


def _parse_module_prefix(value, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"{name}={value!r} is not a module path; use a str such as 'layers.3'")
    return module_path_key(value)


def _parse_device_profile(value, name: str) -> str | None:
    """A name from partitioners.cost.DEVICE_PROFILES, in any case ("H100" -> "h100")."""
    from .cost import DEVICE_PROFILES  # cost imports torch; config stays light

    if value is None:
        return None
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in DEVICE_PROFILES:
        raise ConfigError(
            f"{name}={value!r} is unknown; use one of "
            f"{', '.join(DEVICE_PROFILES)} (any case), or leave it unset for the graph's device"
        )
    return key


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the ckpt partitioner.

    Build one with ``Config.from_env()`` (reads ``CKPT_*`` variables),
    ``Config.from_mapping({...})`` or directly; every field has a safe default.
    Every field is checked when the Config is made: a value ckpt cannot use is
    a ConfigError naming the field (or the variable) and the accepted forms.
    """

    strict: bool = dataclasses.field(default=False, metadata={"parse": _parse_bool})
    """Raise when the partitioner fails instead of warning and falling back to
    PyTorch's partitioner. For tests and debugging (``CKPT_STRICT``). Strings
    are read as the environment's are: ``"false"`` is False."""

    report_dir: str | None = dataclasses.field(
        default=None, metadata={"env": "CKPT_REPORT", "parse": _parse_folder}
    )
    """Folder to write a report (markdown and JSON) for every graph compiled
    (``CKPT_REPORT``); a str or pathlib.Path. Reports compare each decision with
    PyTorch's partitioner; graphs are then not served from Inductor's cache."""

    memory_budget: MemoryBudget | None = dataclasses.field(
        default=None, metadata={"parse": _parse_budget}
    )
    """What each compiled graph may use (``CKPT_MEMORY_BUDGET``): a fraction
    ``0.0``..``1.0`` of the runtime-optimal plan's saved bytes, saved bytes such
    as ``512MiB``, ``2GB``, ``1.5e9``, or the training step's peak such as
    ``peak:6GiB`` (``peak:auto`` on CUDA). Within it ckpt picks the plan with
    the least estimated recompute time. None: the runtime-optimal plan.
    Strings and numbers given here are parsed alike."""

    step_planning: bool = dataclasses.field(default=True, metadata={"parse": _parse_bool})
    """With a memory budget, plan each graph for its place in the training
    step (``CKPT_STEP_PLANNING``): the first step is learnt (which graphs run,
    how often), its graphs are planned again for the step's peak, and a
    dynamic graph gets one plan per size bucket. Off: each graph is planned
    as if it were the whole step (as before)."""

    measure_steps: bool = dataclasses.field(default=True, metadata={"parse": _parse_bool})
    """With step planning, measure the first steps' peak (CUDA's counter, on
    CPU the profiler's memory events) and correct the peak model by it where
    a ``peak:`` cap is broken (``CKPT_MEASURE_STEPS``). Off: the model alone."""

    module_prefix: str = dataclasses.field(default="", metadata={"parse": _parse_module_prefix})
    """The module path of the compiled module within the model, prepended to
    every node's path before per-module budgets match it
    (``CKPT_MODULE_PREFIX``): per-block compile gives each block's backend its
    path, e.g. ``make_backend(memory_budget={...}, module_prefix=f"layers.{i}")``.
    Empty: paths start at the compiled module (the whole model)."""

    device_profile: str | None = dataclasses.field(
        default=None, metadata={"parse": _parse_device_profile}
    )
    """Device whose speed the recompute cost model assumes (``CKPT_DEVICE_PROFILE``):
    one of partitioners.cost.DEVICE_PROFILES, in any case. None: from the graph's device."""

    def __post_init__(self):
        # One parser per field serves both the constructor and the environment,
        # so "false" means the same in make_backend(strict="false") and CKPT_STRICT.
        for field in dataclasses.fields(self):
            value = field.metadata["parse"](getattr(self, field.name), field.name)
            object.__setattr__(self, field.name, value)

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
            if not text.strip() and field.default is None:
                continue  # an empty variable leaves an optional setting unset
            # Parsed here under the variable's name, so an error names CKPT_...
            values[field.name] = field.metadata["parse"](text, variable)
        return cls(**values)

    @classmethod
    def from_mapping(cls, values: Mapping) -> "Config":
        """A Config from field names and values (``{"strict": True}``); an
        unknown name is a ConfigError listing the valid ones."""
        _check_names(values)
        return cls(**values)

    def replace(self, **overrides) -> "Config":
        """A copy with some fields changed; an unknown field name is a clear error."""
        _check_names(overrides)
        return dataclasses.replace(self, **overrides)


def as_config(value) -> Config:
    """``value`` as a Config: a Config itself, or a Mapping of field names."""
    if isinstance(value, Config):
        return value
    if isinstance(value, Mapping):
        return Config.from_mapping(value)
    raise ConfigError(
        f"config={value!r} is not a ckpt config; pass a ckpt.Config, a dict of "
        f"its fields ({', '.join(_field_names())}), or None for the CKPT_* environment"
    )


def env_variable(field: dataclasses.Field) -> str:
    """The environment variable that sets a Config field."""
    return field.metadata.get("env", ENV_PREFIX + field.name.upper())


def _field_names() -> list[str]:
    return sorted(f.name for f in dataclasses.fields(Config))


def _check_names(values: Mapping) -> None:
    names = _field_names()
    unknown = sorted(map(str, set(values) - set(names)))
    if unknown:
        raise ConfigError(f"unknown ckpt setting(s) {unknown}; valid settings: {names}")
