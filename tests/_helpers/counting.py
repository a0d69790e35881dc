"""A store client that counts its requests (what a test asserts a part of the runtime sends)."""

from __future__ import annotations


class CountingStore:
    """Forwards every method call to ``inner`` and counts it in ``n``."""

    def __init__(self, inner) -> None:
        self.inner, self.n = inner, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def call(*args, **kwargs):
            self.n += 1
            return attr(*args, **kwargs)
        return call
