"""Example training scripts shipped with the package (the demo's embedded default)."""
