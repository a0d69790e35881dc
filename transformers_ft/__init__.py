"""chameleon-ft for the HuggingFace ``Trainer``: ``FaultTolerantTrainer`` (docs/transformers.md)."""

from transformers_ft.trainer import FaultTolerantTrainer

__all__ = ["FaultTolerantTrainer"]
