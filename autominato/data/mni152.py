"""A real MRI volume with tissue labels from nilearn's bundled MNI152 templates, as a NIfTI folder.

``python -m autominato.data.mni152 OUT`` writes ``OUT/imagesTr/mni152.nii.gz`` (the ICBM 2009a
nonlinear symmetric T1 template, 197 x 233 x 189 at 1 mm) and ``OUT/labelsTr/mni152.nii.gz``
(0 background, 1 grey matter, 2 white matter) in the Decathlon layout that
:class:`~autominato.data.nifti.NiftiDataset` and ``autominato run --data OUT`` read. The volumes
ship inside the nilearn package (``load_mni152_template``, ``load_mni152_gm_template``,
``load_mni152_wm_template``): nothing is downloaded. nilearn is the ``mri`` extra.

A voxel is labelled with the tissue of the larger probability when that probability is at
least :data:`THRESHOLD`, else background.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

#: Minimum tissue probability for a voxel to be labelled grey or white matter.
THRESHOLD = 0.5


def tissue_labels(gm: np.ndarray, wm: np.ndarray, threshold: float = THRESHOLD) -> np.ndarray:
    """uint8 labels from grey/white matter probability maps of the same shape (values 0..1)."""
    labels = np.zeros(gm.shape, np.uint8)
    labels[(gm >= threshold) & (gm >= wm)] = 1
    labels[(wm >= threshold) & (wm > gm)] = 2
    return labels


def write_mni152_folder(out: str | Path) -> tuple[Path, Path]:
    """Write the T1 template and its tissue labels under ``out`` (see the module docstring).

    Returns:
        ``(image path, label path)``.

    Raises:
        ImportError: nilearn is not installed (``pip install autominato[mri]``).
    """
    import nibabel
    from nilearn import datasets

    out = Path(out)
    t1 = datasets.load_mni152_template(resolution=1)
    gm = np.asarray(datasets.load_mni152_gm_template(resolution=1).dataobj, np.float32)
    wm = np.asarray(datasets.load_mni152_wm_template(resolution=1).dataobj, np.float32)
    image = out / "imagesTr" / "mni152.nii.gz"
    label = out / "labelsTr" / "mni152.nii.gz"
    image.parent.mkdir(parents=True, exist_ok=True)
    label.parent.mkdir(parents=True, exist_ok=True)
    nibabel.save(nibabel.Nifti1Image(np.asarray(t1.dataobj, np.float32), t1.affine), image)
    nibabel.save(nibabel.Nifti1Image(tissue_labels(gm, wm), t1.affine), label)
    return image, label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autominato.data.mni152",
        description="write nilearn's MNI152 T1 template with grey/white-matter labels as a "
        "NIfTI folder for `autominato run --data`",
    )
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        image, label = write_mni152_folder(args.out)
    except ImportError as e:
        print(f"needs nilearn (pip install 'autominato[mri]'): {e}", file=sys.stderr)
        return 2
    print(f"wrote {image} and {label} (MNI152 2009a T1 template, real MRI; labels 1 = grey "
          "matter, 2 = white matter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
