"""autominato: an adaptive, self-tuning data loader for PyTorch training on heavy samples."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Loader", "__version__", "get_worker_info"]


def __getattr__(name: str):
    # Lazy, so that `autominato --help` and light tools do not import torch.
    if name == "Loader":
        from autominato.loader import Loader

        return Loader
    if name == "get_worker_info":
        from autominato.pipeline.worker import get_worker_info

        return get_worker_info
    raise AttributeError(name)
