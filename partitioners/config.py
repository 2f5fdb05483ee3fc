"""The one configuration object that travels down a ckpt compile."""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping

ENV_PREFIX = "CKPT_"

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting has a value ckpt cannot use; the message names the fix."""


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
    raise AssertionError(f"no parser for settings of type {type_name}")
