"""torchft's Rust side logs every quorum at INFO to stderr; keep it quiet unless the user set
``RUST_LOG`` (imported before torchft by the modules that use it)."""

import os

os.environ.setdefault("RUST_LOG", "warn")
