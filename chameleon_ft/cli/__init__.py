"""The product shell: ``chameleon-ft run | demo | report | simulate | bench`` (``main``), the
launcher (``launch``: coordinator, workers, replacements), the live demo, run reports and the
local job driver the demo and benchmarks share.  The top layer: it imports the runtime, the
simulator and the engine; nothing below imports it."""

from chameleon_ft.cli.main import main

__all__ = ["main"]
