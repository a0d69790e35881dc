"""HuggingFace Accelerate integration of chameleon-ft: swap ``Accelerator`` for
``FaultTolerantAccelerator`` (or ``wrap`` an existing one) and start the script with
``chameleon-ft run``; see docs/accelerate.md.

Importing this package in a worker started by ``chameleon-ft run`` hides torchrun's
variables from Accelerate (see ``_env.py``)."""

from accelerate_ft._env import capture as _capture

_capture()

from accelerate_ft.accelerator import (NOT_LAUNCHED, FaultTolerantAccelerator,  # noqa: E402
                                       LauncherError, wrap)
from accelerate_ft.data import ElasticEvalLoader, ElasticTrainLoader  # noqa: E402
from chameleon_ft.runtime.trainer import elastic_main as run  # noqa: E402

__all__ = ["FaultTolerantAccelerator", "wrap", "LauncherError", "NOT_LAUNCHED", "ElasticTrainLoader",
           "ElasticEvalLoader", "run"]
