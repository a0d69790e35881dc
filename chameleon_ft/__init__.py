"""chameleon-ft: adaptive fault tolerance for data-parallel and pipelined training.

The engine (``workload``, ``cluster``, ``plan``, ``perf``, ``calibrate``, ``planner``,
``restorer``, ``selector``, ``rehab``, ``stragglers``, ``failures``, ``sim``) is pure Python
plus numpy/scipy/networkx and never imports ``torch.distributed``.  ``chameleon_ft.runtime``
carries out the engine's decisions on real process groups.
"""

__version__ = "0.1.0"
