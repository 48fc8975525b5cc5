"""The error a dataset raises for a sample it cannot read: it names the index and the file."""

from __future__ import annotations

from autominato.pipeline.errors import SampleError


class DatasetError(SampleError, ValueError):
    """A sample's file is missing, corrupt or has the wrong shape or dtype.

    A :class:`~autominato.pipeline.errors.SampleError` (so one ``except`` catches every failed
    sample) and a ``ValueError`` (bad input). The message starts with
    ``"sample <index> (<path>): "``.

    Attributes:
        sample_index: the dataset index.
        sample_path: the file at fault (``None`` when no single file is).
    """

    def __init__(self, index: int, path: str | None, message: str) -> None:
        where = f"sample {index}" + (f" ({path})" if path else "")
        super().__init__(f"{where}: {message}", sample_index=index, sample_path=path)
        self.detail = message

    def __reduce__(self):  # rebuild as DatasetError (SampleError's own rebuilds the base class)
        return (type(self), (self.sample_index, self.sample_path, self.detail))
