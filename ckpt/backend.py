"""The torch.compile backend: Inductor with ckpt's partitioner."""
from __future__ import annotations

import inspect
from collections.abc import Mapping

from partitioners import _torch_compat as compat
from partitioners.config import Config, ConfigError, as_config
from partitioners.partition import CkptPartitioner
from partitioners.plan import Plan


class CompileTimeConfigError(ConfigError, compat.ShortenTraceback):
    """A ConfigError found while Dynamo compiles a graph: a bad ``CKPT_*``
    variable.

    Dynamo re-raises this class as it is instead of wrapping it in
    BackendCompilerFailed, so the message is the first line the user reads.
    It is still a ConfigError (and a ValueError) for ``except`` clauses.
    """

    def __init__(self, message: str, first_useful_frame):
        # ValueError.__init__ takes no keywords: initialize through Dynamo's class.
        compat.ShortenTraceback.__init__(self, message, first_useful_frame=first_useful_frame)


class CkptBackend:
    """A torch.compile backend; ``plans`` lists the Plan of every graph it
    partitioned, and ``reports`` the report of each when ``report_dir`` is set.

    A graph served from Inductor's cache was partitioned in an earlier
    process and adds no Plan.
    """

    def __init__(self, config: Config | Mapping | None = None):
        self._config = None if config is None else as_config(config)
        self.plans: list[Plan] = []
        self.reports: list[dict] = []

    @property
    def config(self) -> Config:
        # The default backend reads the environment at each compile, so a
        # variable set after import still takes effect.
        return self._config if self._config is not None else Config.from_env()

    def __call__(self, gm, example_inputs):
        try:
            config = self.config
        except ConfigError as error:
            # Raised here, a setting error would reach the user as the second
            # line of Dynamo's BackendCompilerFailed; this class passes through.
            raise CompileTimeConfigError(str(error), inspect.currentframe()) from None
        partitioner = CkptPartitioner(config, on_plan=self.plans.append, on_report=self.reports.append)
        return compat.compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner})

    def __repr__(self) -> str:
        return f"CkptBackend({self._config!r})"


def make_backend(config: Config | Mapping | None = None, **overrides) -> CkptBackend:
    """A backend with ``config`` and field overrides.

    ``config`` is a Config, a dict of its fields (the rest keep their
    defaults), or None for ``Config.from_env()``.

    >>> torch.compile(model, backend=make_backend(strict=True))
    """
    base = Config.from_env() if config is None else as_config(config)
    return CkptBackend(base.replace(**overrides))


ckpt_backend = CkptBackend()
"""The default backend: settings from ``CKPT_*`` environment variables."""
