"""autominato: an adaptive, self-tuning data loader for PyTorch training on heavy samples."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Loader", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `autominato --help` and light tools do not import torch.
    if name == "Loader":
        from autominato.loader import Loader

        return Loader
    raise AttributeError(name)
