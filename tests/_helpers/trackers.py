"""An Accelerate tracker for the worker scripts: one JSON line per ``log`` call, appended to a
file by whichever worker is the main process (so a test can see who logged what, on which step)."""

from __future__ import annotations

import json
import os

from accelerate.tracking import GeneralTracker


class JsonlTracker(GeneralTracker):
    """A file tracker: one JSON line per log call, with the logging worker's id."""
    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path):
        super().__init__()
        self.path = path

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "worker": int(os.environ.get("CHAMELEON_FT_WORKER_ID", -1)),
                                **{k: float(v) for k, v in values.items()}}) + "\n")
