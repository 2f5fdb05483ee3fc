"""The torch.compile backend: Inductor with ckpt's partitioner."""
from __future__ import annotations

from partitioners import _torch_compat as compat
from partitioners.config import Config
from partitioners.partition import CkptPartitioner
from partitioners.plan import Plan


class CkptBackend:
    """A torch.compile backend; ``plans`` lists the Plan of every graph it
    partitioned, and ``reports`` the report of each when ``report_dir`` is set.

    A graph served from Inductor's cache was partitioned in an earlier
    process and adds no Plan.
    """

    def __init__(self, config: Config | None = None):
        self._config = config
        self.plans: list[Plan] = []
        self.reports: list[dict] = []

    @property
    def config(self) -> Config:
        # The default backend reads the environment at each compile, so a
        # variable set after import still takes effect.
        return self._config if self._config is not None else Config.from_env()

    def __call__(self, gm, example_inputs):
        partitioner = CkptPartitioner(
            self.config, on_plan=self.plans.append, on_report=self.reports.append
        )
        return compat.compile_fx(
            gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner}
        )

    def __repr__(self) -> str:
        return f"CkptBackend({self._config!r})"


def make_backend(config: Config | None = None, **overrides) -> CkptBackend:
    """A backend with ``config`` (default: ``Config.from_env()``) and field overrides.

    >>> torch.compile(model, backend=make_backend(strict=True))
    """
    base = config if config is not None else Config.from_env()
    return CkptBackend(base.replace(**overrides))


ckpt_backend = CkptBackend()
"""The default backend: settings from ``CKPT_*`` environment variables."""
