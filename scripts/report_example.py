"""The Data Monitor report of docs/telemetry.md: reads that decompress in the workers.

A map-style dataset whose ``__getitem__`` decompresses 48 MB with zlib (CPU work in the read,
as a ``.nii.gz`` is), two worker processes with the read fused into them (the default), batch
2, a 100 ms sleep as the training step, 4 epochs of 24 samples, a report every 4 s and one at
the end. Run: ``python scripts/report_example.py`` (about 10 s on 2 cores).
"""

import logging
import sys
import time
import zlib

import numpy as np

from autominato import Loader

BLOB = zlib.compress(
    np.random.default_rng(0).integers(0, 4, size=24_000_000, dtype=np.uint8).tobytes())


class Compressed:
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> np.ndarray:
        for _ in range(2):
            raw = zlib.decompress(BLOB)
        return np.frombuffer(raw, np.uint8)[:4096].astype(np.float32)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    loader = Loader(Compressed(), batch_size=2, num_workers=2, autotune=False, seed=0,
                    monitor_interval=4.0)
    for epoch in range(4):
        loader.set_epoch(epoch)
        for _batch in loader:
            time.sleep(0.1)  # the training step
    loader.close()  # the end-of-run report
