"""The small classification data set the Lightning and Accelerate worker scripts train on."""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """``n`` samples of ``dim`` features around ``classes`` Gaussian centers; item ``(x, y)``.

    ``seed`` draws the centers, labels and noise; ``centers_seed`` (when given) draws the
    centers instead, so that a validation or test set of another seed has the training
    distribution."""

    def __init__(self, n: int = 256, dim: int = 16, classes: int = 4, seed: int = 1234,
                 centers_seed: Optional[int] = None):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(classes, dim, generator=g) * 2
        if centers_seed is not None:
            centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(centers_seed)) * 2
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centers[self.y] + torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
