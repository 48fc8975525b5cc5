"""MONAI as a first-class user: Randomizable transforms reseeded per sample (distinct crops,
reproducible with any worker count, thread or process), MetaTensor batches with MONAI's batch
metadata."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from monai.data import Dataset as MonaiDataset
from monai.data import MetaTensor, decollate_batch, list_data_collate
from monai.transforms import Compose, OneOf, RandFlipd, RandSpatialCropd

from autominato import Loader

SIDE, ROI, N = 12, 6, 24


def volume(index: int) -> np.ndarray:
    """(1, SIDE, SIDE, SIDE) float32 whose voxel values say where a crop came from."""
    return (np.arange(SIDE**3, dtype=np.float32).reshape(1, SIDE, SIDE, SIDE) + 10_000 * index)


class Volumes:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        v = volume(i)
        return {"image": v, "label": v.copy(), "index": i}


def pipeline() -> Compose:
    keys = ["image", "label"]
    return Compose([
        RandSpatialCropd(keys=keys, roi_size=(ROI,) * 3, random_size=False),
        OneOf([RandFlipd(keys=keys, prob=1.0, spatial_axis=0),
               RandFlipd(keys=keys, prob=1.0, spatial_axis=1)]),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=2),
    ])


def crops(loader: Loader) -> dict[int, np.ndarray]:
    """index -> the image crop, over one epoch."""
    out = {}
    with loader:
        for batch in loader:
            images = torch.as_tensor(batch["image"]).numpy()
            assert np.array_equal(images, torch.as_tensor(batch["label"]).numpy())  # keys crop alike
            for i, img in zip(batch["index"].tolist(), images, strict=True):
                assert i not in out
                out[i] = img.copy()
    assert sorted(out) == list(range(N))
    return out


def signature(index: int, img: np.ndarray) -> tuple:
    """What was drawn for a sample: the crop's voxel set (its origin) and its flips."""
    local = img - 10_000 * index
    return (int(local.min()), tuple(local.ravel()[:2].astype(int)), int(local[0, 0, 0, 0]))


@pytest.mark.parametrize("embedded", [False, True], ids=["loader_transform", "monai_dataset"])
def test_monai_dict_pipeline_is_distinct_per_sample_and_reproducible_across_worker_counts(embedded):
    def make(seed: int, **kw) -> Loader:
        if embedded:  # MONAI's own idiom: the transform inside monai.data.Dataset
            data = MonaiDataset([{"image": volume(i), "label": volume(i), "index": i} for i in range(N)],
                                transform=pipeline())
            return Loader(data, batch_size=4, seed=seed, autotune=False, **kw)
        return Loader(Volumes(), batch_size=4, transform=pipeline(), seed=seed, autotune=False, **kw)

    one = crops(make(7, workers=1))
    three = crops(make(7, workers=3))
    others = [crops(make(7, workers=3, worker_kind="thread")),  # thread workers, own copies
              crops(make(7, workers=2, fuse_read=False)),  # read threads, then processes
              crops(make(7, workers=0))]  # no worker process
    for i in range(N):
        assert np.array_equal(one[i], three[i]), i
        assert all(np.array_equal(one[i], other[i]) for other in others), i
    # Distinct per sample: before per-sample seeding, the k-th sample of each of 3 workers got
    # the same crop (forked workers started from one RandomState), at most N/3 distinct ones.
    draws = {signature(i, one[i]) for i in range(N)}
    assert len(draws) > N * 3 // 4
    other = crops(make(8, workers=3))
    assert sum(np.array_equal(one[i], other[i]) for i in range(N)) < N // 4


def test_monai_crops_change_with_the_epoch_and_repeat_with_it():
    loader = Loader(Volumes(), batch_size=4, transform=pipeline(), seed=3, workers=2, autotune=False)
    with loader:
        def epoch(e: int) -> dict:
            loader.set_epoch(e)
            out = {}
            for batch in loader:
                for i, img in zip(batch["index"].tolist(), torch.as_tensor(batch["image"]).numpy(), strict=True):
                    out[i] = img.copy()
            return out

        e0, e1, again = epoch(0), epoch(1), epoch(0)
    assert all(np.array_equal(e0[i], again[i]) for i in range(N))
    assert sum(np.array_equal(e0[i], e1[i]) for i in range(N)) < N // 4


class MetaVolumes:
    """Samples as MONAI's LoadImaged gives them: MetaTensors with an affine and a file name."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        affine = torch.diag(torch.tensor([1.0 + i, 2.0, 3.0, 1.0]))
        img = MetaTensor(torch.full((1, 4, 4, 4), float(i)), affine=affine,
                         meta={"filename_or_obj": f"case_{i:05d}.nii.gz", "spacing": i})
        return {"image": img, "case": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_meta_tensor_batches_carry_monai_batch_metadata_like_list_data_collate(workers):
    ds = MetaVolumes()
    with Loader(ds, batch_size=3, workers=workers, in_order=True, autotune=False) as loader:
        batches = list(loader)
    assert len(batches) == 2
    for b, batch in enumerate(batches):
        expected = list_data_collate([ds[i] for i in range(3 * b, 3 * b + 3)])
        got, want = batch["image"], expected["image"]
        assert type(got) is type(want) is MetaTensor
        assert torch.equal(got.as_tensor(), want.as_tensor())
        assert got.is_batch and want.is_batch
        assert got.meta["filename_or_obj"] == want.meta["filename_or_obj"]
        assert torch.equal(got.meta["spacing"], want.meta["spacing"])
        assert torch.equal(got.affine, want.affine) and got.affine.shape == (3, 4, 4)
        assert got.applied_operations == want.applied_operations
        # MONAI's inverse path starts from decollate_batch: one MetaTensor per sample back.
        items = decollate_batch(batch)
        assert [it["image"].meta["filename_or_obj"] for it in items] == want.meta["filename_or_obj"]
        assert all(torch.equal(it["image"].affine, ds[3 * b + k]["image"].affine) for k, it in enumerate(items))


def test_each_worker_thread_gets_its_own_randomizables_and_shares_the_data():
    """MONAI's Randomizable is thread-unsafe: a thread other than the main one works on its
    own copies of them (and of the objects leading to them); the data list stays shared. The
    walk reaches the array transform inside a dictionary transform (RandSpatialCropd.cropper)."""
    import threading

    from autominato.pipeline import random_state
    from autominato.pipeline.worker import WorkSpec, reseed_parts

    ds = MonaiDataset([{"image": volume(i)} for i in range(3)], transform=pipeline())
    spec = WorkSpec(ds, None, False, 0)
    mine = random_state.plan(spec)
    names = ["Compose", "RandSpatialCropd", "RandSpatialCrop", "OneOf", "RandFlipd", "RandFlipd", "RandFlipd"]
    assert mine.dataset is ds and [type(p).__name__ for p in mine.dataset_parts] == names
    assert random_state.plan(spec) is mine  # found once per thread
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(random_state.plan(spec)))
    t.start()
    t.join()
    other = theirs[0]
    assert other.dataset is not ds and other.dataset.data is ds.data
    assert [type(p).__name__ for p in other.dataset_parts] == names
    assert not {id(p) for p in other.dataset_parts} & {id(p) for p in mine.dataset_parts}
    # Reseeding is in place (no new RandomState per sample) and gives equal draws to equal keys.
    states = [p.R for p in mine.dataset_parts]
    reseed_parts(mine.dataset_parts, 5, 1, 2, 0)
    reseed_parts(other.dataset_parts, 5, 1, 2, 0)
    assert all(p.R is s for p, s in zip(mine.dataset_parts, states, strict=True))
    assert [p.R.randint(1 << 30) for p in mine.dataset_parts] == [p.R.randint(1 << 30) for p in other.dataset_parts]


def test_an_index_the_sampler_repeats_gets_a_crop_of_its_own_each_time():
    """``WeightedRandomSampler(replacement=True)`` oversamples: each repeat of an index is
    cropped anew, as the DataLoader's workers draw anew from their streams (before, the
    reseeding key was (seed, epoch, index) only and every repeat was a copy)."""
    order = [3, 5, 3, 3, 1, 5, 3, 0]

    def epoch(**kw) -> list:
        with Loader(Volumes(), batch_size=2, sampler=order, transform=pipeline(), seed=4,
                    in_order=True, autotune=False, **kw) as loader:
            return [(i, img.copy()) for b in loader
                    for i, img in zip(b["index"].tolist(), torch.as_tensor(b["image"]).numpy(),
                                      strict=True)]

    got = epoch(workers=2)
    assert [i for i, _ in got] == order
    threes = [signature(3, img) for i, img in got if i == 3]
    assert len(set(threes)) >= 3, threes  # (the old key: one crop; 343 origins x flips here)
    for other in (epoch(workers=0), epoch(workers=2, worker_kind="thread")):
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, other, strict=True))


def test_an_error_of_a_monai_file_dataset_names_the_sample_and_its_file(tmp_path):
    """MONAI's idiom (``Dataset(data=[{"image": path}], transform=LoadImaged(...))``) has no
    ``sample_path``: the error names the file from the sample's item, and keeps its type."""
    from monai.transforms import LoadImaged

    good = tmp_path / "case_00000.npy"
    np.save(good, np.zeros((4, 4, 4), np.float32))
    bad = tmp_path / "case_00001.npy"
    bad.write_bytes(b"not a numpy file")
    # (and a file that is missing, the commonest bad input: review 127)
    for wrong in (bad, tmp_path / "case_00002.npy"):
        ds = MonaiDataset([{"image": str(good)}, {"image": str(wrong)}],
                          transform=LoadImaged(keys="image", image_only=True))
        with Loader(ds, batch_size=1, workers=1, autotune=False) as loader:
            with pytest.raises(RuntimeError) as err:
                list(loader)
        assert err.value.sample_index == 1 and err.value.sample_path == str(wrong)
        notes = getattr(err.value, "__notes__", [])
        assert any(wrong.name in n for n in notes), err.value
    # An item whose label exists and whose image is missing or broken names the image, not
    # the label (trial 155), with process workers and with none.
    label = tmp_path / "label_00001.npy"
    np.save(label, np.zeros((4, 4, 4), np.float32))
    for wrong in (tmp_path / "case_00002.npy", bad):
        for workers in (1, 0):
            ds = MonaiDataset([{"image": str(wrong), "label": str(label)}],
                              transform=LoadImaged(keys=["label", "image"], image_only=True))
            with Loader(ds, batch_size=1, workers=workers, autotune=False) as loader:
                with pytest.raises(RuntimeError) as err:
                    list(loader)
            assert err.value.sample_path == str(wrong), (workers, err.value.sample_path)


def test_an_error_of_a_monai_image_dataset_names_its_file(tmp_path):
    """MONAI's ``ImageDataset(image_files, seg_files)`` lists its files in two attributes
    (trial 165: its errors named no file): the error names the image or the segmentation
    that failed, whichever it was."""
    from monai.data import ImageDataset

    good = tmp_path / "case_00000.npy"
    np.save(good, np.zeros((4, 4, 4), np.float32))
    missing = tmp_path / "case_00001.npy"
    seg_missing = tmp_path / "seg_00000.npy"
    for images, segs, wrong in (([good, missing], [good, good], missing),
                                ([good], [seg_missing], seg_missing)):
        ds = ImageDataset([str(p) for p in images], seg_files=[str(p) for p in segs],
                          image_only=True)
        with Loader(ds, batch_size=1, workers=1, autotune=False) as loader:
            with pytest.raises(Exception) as err:
                list(loader)
        assert err.value.sample_index == len(images) - 1
        assert err.value.sample_path == str(wrong), err.value


@pytest.mark.parametrize("kind", [
    {"multiprocessing_context": "spawn"},  # workers that unpickle the dataset
    {"multiprocessing_context": "spawn", "persistent_workers": False},  # sent again each epoch
    {"worker_kind": "thread"},  # each thread's own copies of the random transforms
    {"num_workers": 0, "from_a_thread": True},  # the same, the training loop in a thread
])
def test_batches_from_workers_that_copied_the_transforms_invert_in_the_training_process(kind):
    # Trial 141: MONAI's invertible transforms record id(self); Invertd in the training
    # process refused the records of copies ("getting the most recently applied invertible
    # transform CenterSpatialCrop 1400... != 1403..."), so a Loader whose workers do not fork
    # from the training process (built while another thread ran: a validation Loader beside
    # a training one) gave batches no one could invert. The records now carry the ids of the
    # training process's transforms, and the transforms themselves are left untouched
    # (review 143: an attribute written on them changed their pickle, which MONAI's
    # PersistentDataset hashes).
    import threading

    from monai.transforms import CenterSpatialCropd, EnsureTyped, Invertd

    kind = dict(kind)
    in_thread = kind.pop("from_a_thread", False)
    keys = ["image", "label"]
    val = Compose([EnsureTyped(keys=keys), RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
                   CenterSpatialCropd(keys=keys, roi_size=(ROI,) * 3)])
    from autominato.pipeline.random_state import find_parts, traceable_class

    def attributes() -> set:
        return {k for p in find_parts(val, traceable_class()) for k in vars(p)}
    data = [{"image": volume(i), "label": volume(i)} for i in range(4)]
    kind.setdefault("num_workers", 2)
    loader = Loader(MonaiDataset(data, transform=val), batch_size=2, **kind)
    invert = Invertd(keys="pred", transform=val, orig_keys="image")
    other = Compose([EnsureTyped(keys=keys), RandFlipd(keys=keys, prob=0.5),
                     CenterSpatialCropd(keys=keys, roi_size=(ROI,) * 3)])
    seen: list = []

    def epochs() -> None:
        for _ in range(2):
            inverted, item = 0, None
            for batch in loader:
                batch["pred"] = batch["image"].clone()
                for item in decollate_batch(batch):
                    out = invert(item)["pred"]
                    assert tuple(out.shape) == (1, SIDE, SIDE, SIDE)
                    # the crop's voxels back where they were, the rest padded
                    assert np.asarray(out).sum() == pytest.approx(
                        np.asarray(item["image"]).sum(), rel=1e-6)
                    inverted += 1
            seen.append(inverted)
            # the check MONAI makes is still made: another Compose's records are refused
            with pytest.raises(RuntimeError) as refused:
                Invertd(keys="pred", transform=other, orig_keys="image")(item)
            assert "applied invertible transform" in str(refused.value.__cause__)
            if not loader.persistent_workers:
                # a dataset changed between epochs: persistent_workers=False sends it again
                data.append({"image": volume(len(data)), "label": volume(len(data))})

    with loader:
        if in_thread:
            failed: list = []
            t = threading.Thread(target=lambda: (failed.append(None), epochs(), failed.pop()))
            t.start()
            t.join(60)
            assert not failed, "the loop in the thread failed (see its traceback above)"
        else:
            epochs()
    assert seen == ([4, 4] if loader.persistent_workers else [4, 5])
    assert not [k for k in attributes() if "autominato" in k]


def test_random_transforms_inside_an_iterable_dataset_draw_per_sample_and_repeat_with_the_seed():
    # Trial 141: a GridPatchDataset's transform (MONAI's own RandomState) was not reseeded in
    # the workers: each worker drew the same sequence (every offset twice with 2 workers),
    # and two Loaders with seed=0 drew differently.
    from monai.data import GridPatchDataset, PatchIter
    from monai.transforms import RandShiftIntensity

    def offsets(seed: int) -> list[list[float]]:
        ds = GridPatchDataset(data=[np.zeros((1, 4, 4), np.float32)] * 2,
                              patch_iter=PatchIter(patch_size=(2, 2)),
                              transform=RandShiftIntensity(offsets=0.5, prob=1.0))
        with Loader(ds, batch_size=1, num_workers=2, seed=seed) as loader:
            # one offset a patch (the patch was zeros), 8 patches an epoch
            return [sorted(float(p[0].flatten()[0]) for p in loader) for _ in range(2)]

    first = offsets(0)
    for epoch in first:
        assert len(epoch) == 8 and len(set(epoch)) == 8, epoch
    assert first[0] != first[1]  # a new draw each epoch
    assert offsets(0) == first  # and the same with the same seed
    assert offsets(1) != first


def _adds_a_transform(_wid: int) -> None:
    import torch.utils.data as tud
    from monai.transforms import CenterSpatialCropd

    info = tud.get_worker_info()
    info.dataset.helper = CenterSpatialCropd(keys=["image"], roi_size=(2, 2, 2))  # never run


class _CropAlsoHeld(MonaiDataset):
    """A dataset that holds one of its transform's steps in an attribute of its own too."""


@pytest.mark.parametrize("case", ["rebuilt", "worker_init_fn", "held_twice"])
def test_records_invert_when_the_transforms_are_rebuilt_added_or_held_twice(case):
    # Review 144: a deterministic transform built anew between epochs pickles as before, so
    # the dataset was not sent again and the records named the old objects; a transform a
    # worker_init_fn added, or one a thread's copy lists twice (reachable inside the copied
    # random Compose and, as the original, outside it), left every record unpaired.
    from monai.transforms import CenterSpatialCropd, EnsureTyped, Invertd

    keys = ["image", "label"]

    def make(random: bool) -> Compose:
        steps = [EnsureTyped(keys=keys), CenterSpatialCropd(keys=keys, roi_size=(ROI,) * 3)]
        if random:
            steps.insert(1, RandFlipd(keys=keys, prob=0.5, spatial_axis=0))
        return Compose(steps)

    data = [{"image": volume(i), "label": volume(i)} for i in range(4)]
    kind = {"rebuilt": {"multiprocessing_context": "spawn", "persistent_workers": False},
            "worker_init_fn": {"multiprocessing_context": "spawn",
                               "worker_init_fn": _adds_a_transform},
            "held_twice": {"worker_kind": "thread"}}[case]
    ds = _CropAlsoHeld(data, transform=make(random=case != "rebuilt").set_random_state(seed=0))
    if case == "held_twice":
        ds.crop = ds.transform.transforms[-1]
    with Loader(ds, batch_size=2, num_workers=2, **kind) as loader:
        for _ in range(2):
            if case == "rebuilt":
                # alike, its random state too (Compose draws from one of its own): the same
                # pickle, as after monai.utils.set_determinism
                ds.transform = make(random=False).set_random_state(seed=0)
            invert = Invertd(keys="pred", transform=ds.transform, orig_keys="image")
            inverted = 0
            for batch in loader:
                batch["pred"] = batch["image"].clone()
                for item in decollate_batch(batch):
                    assert tuple(invert(item)["pred"].shape) == (1, SIDE, SIDE, SIDE)
                    inverted += 1
            assert inverted == 4


# -- Random transforms reached through code: closures, partials, methods, globals ----------

_GLOBAL_PIPELINE = pipeline()


def _apply(tf, d):
    return tf(d)


def _via_global(d):
    return _GLOBAL_PIPELINE(d)


class _Holder:
    def __init__(self) -> None:
        self.tf = pipeline()

    def run(self, d):
        return self.tf(d)


class _CallsGlobal:
    def __call__(self, d):
        return _GLOBAL_PIPELINE(d)


def _closure():
    tf = pipeline()
    return lambda d: tf(d)


_REACHED = {
    "closure": _closure,
    "partial": lambda: functools.partial(_apply, pipeline()),
    "global": lambda: _via_global,
    "bound_method": lambda: _Holder().run,
    "class_method_global": _CallsGlobal,
}


@pytest.mark.parametrize("how", list(_REACHED))
def test_random_transforms_reached_through_code_are_reseeded_per_sample(how, caplog):
    """A ``Randomizable`` held by a closure, a ``functools.partial``, a bound method's object,
    or a global that a function or a class's ``__call__`` names is found and reseeded: crops
    distinct per sample, the same with 1 and 3 workers and with thread workers (trial 141:
    with a partial, 5 distinct crops of 8, different between runs with the same seed)."""
    def make(**kw) -> Loader:
        return Loader(Volumes(), batch_size=4, transform=_REACHED[how](), seed=7,
                      autotune=False, **kw)

    one, three = crops(make(workers=1)), crops(make(workers=3))
    assert all(np.array_equal(one[i], three[i]) for i in range(N))
    assert len({signature(i, one[i]) for i in range(N)}) > N * 3 // 4
    if how not in ("partial", "bound_method"):
        # code is not copied per thread (a copy of a module's globals would freeze them, and
        # global / nonlocal writes would miss the module: review 154): said
        with caplog.at_level("WARNING", logger="autominato"), make(workers=2,
                                                                  worker_kind="thread") as L:
            assert sum(len(b["index"]) for b in L) == N
        assert "shared by thread" in caplog.text
    else:
        threads = crops(make(workers=3, worker_kind="thread"))
        assert all(np.array_equal(one[i], threads[i]) for i in range(N))


def test_a_smart_cache_dataset_is_refused_by_worker_processes_and_replaced_under_threads(caplog):
    """``SmartCacheDataset`` replaces its cache in the training process (``update_cache()``):
    worker processes hold a copy and trained on its first cache for ever (trial 155), so they
    are refused by name; thread workers share it and see each epoch's cache, as with
    ``num_workers=0``, their random transforms their own (before: each thread deep-copied the
    whole dataset, lock included, and every sample failed)."""
    from monai.data import SmartCacheDataset

    data = [{"image": volume(i), "label": volume(i), "index": i} for i in range(8)]

    def seen(**kw) -> list[list[int]]:
        ds = SmartCacheDataset(data, transform=pipeline(), cache_num=4, replace_rate=0.5,
                               progress=False, num_init_workers=1, num_replace_workers=1)
        out = []
        ds.start()
        try:
            with Loader(ds, batch_size=2, seed=5, autotune=False, **kw) as loader:
                for e in range(3):
                    loader.set_epoch(e)
                    out.append(sorted(int(i) for b in loader for i in b["index"]))
                    ds.update_cache()
        finally:
            ds.shutdown()
        return out

    with pytest.raises(ValueError, match="worker_kind='process'.*worker_kind='thread'"):
        seen(num_workers=2)
    ds = SmartCacheDataset(data, transform=pipeline(), cache_num=4, progress=False)
    for wrapped in (torch.utils.data.Subset(ds, range(4)),  # (review 156: not seen inside)
                    torch.utils.data.ConcatDataset([ds, ds])):
        with pytest.raises(ValueError, match="SmartCacheDataset .* replaces its cache"):
            Loader(wrapped, batch_size=2, num_workers=2, start_method="fork", autotune=False)
    alone = seen(num_workers=0)
    assert [len(s) for s in alone] == [4, 4, 4] and len(set(map(tuple, alone))) == 3
    assert len(set(alone[0]) & set(alone[1])) == 2  # half of the cache replaced each epoch
    with caplog.at_level("WARNING", logger="autominato"):
        assert seen(num_workers=2, worker_kind="thread") == alone
    # each thread its own random transforms (review 156: a started dataset's replacement
    # thread led the walk back to the original's, shared by every thread)
    assert "shared by thread" not in caplog.text


_SHADOW = pipeline()  # a global with the name of _ShadowHolder's attribute


class _ShadowHolder:
    def __init__(self) -> None:
        self._SHADOW = pipeline()

    def run(self, d):
        return self._SHADOW(d)


def test_an_attribute_named_as_a_global_is_not_taken_for_it(caplog):
    """A method's ``self._SHADOW`` is an attribute, not the module's global ``_SHADOW``
    (trial 155: the walk read ``co_names`` as globals, and thread workers warned that a
    transform they had copied was shared)."""
    with caplog.at_level("WARNING", logger="autominato"), Loader(
            Volumes(), batch_size=4, transform=_ShadowHolder().run, seed=7, autotune=False,
            workers=2, worker_kind="thread") as L:
        assert sum(len(b["index"]) for b in L) == N
    assert "shared by thread" not in caplog.text


def test_the_file_an_error_names_is_a_whole_path_of_the_item(tmp_path):
    """The name the error mentions, as a whole path (review 156: ``"image"``, a modality
    string, was taken from "reading image file"; a relative name the error gives as an
    absolute path named the item's label instead)."""
    import os

    from autominato.pipeline.worker import sample_path

    ok = tmp_path / "ok.png"
    ok.write_bytes(b"x")
    ds = MonaiDataset([{"image": "corrupt.png", "modality": "image", "label": str(ok)}])
    err = RuntimeError("broken data stream when reading image file corrupt.png")
    assert sample_path(ds, 0, err) == "corrupt.png"
    rel = os.path.relpath(tmp_path / "sub" / "missing.png")
    ds = MonaiDataset([{"label": str(ok), "image": rel}])
    assert sample_path(ds, 0, FileNotFoundError(2, "No such file", os.path.abspath(rel))) == rel
    assert sample_path(ds, 0, None) == rel  # (no error: the listed name that is missing)


def test_thread_workers_see_a_dataset_attribute_rebound_between_epochs():
    """Thread workers hold a shallow copy of a dataset on the way to its random transforms;
    it is made again when the training process rebinds one of the dataset's attributes
    (review 156: after ``ds.data = new`` the threads served the old list)."""
    first = [{"image": volume(i), "label": volume(i), "index": i} for i in range(8)]
    second = [{"image": volume(i), "label": volume(i), "index": 100 + i} for i in range(8)]
    ds = MonaiDataset(first, transform=pipeline())
    with Loader(ds, batch_size=2, seed=3, workers=2, worker_kind="thread", autotune=False,
                prefetch_next_epoch=False) as L:
        assert sorted(int(i) for b in L for i in b["index"]) == list(range(8))
        ds.data = second
        assert sorted(int(i) for b in L for i in b["index"]) == list(range(100, 108))


class _TrackMeta(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        from monai.data import get_track_meta

        return torch.tensor(int(get_track_meta()))


@pytest.mark.parametrize("start_method", [None, "spawn"])  # None: the default (auto)
def test_set_track_meta_false_reaches_the_worker_processes(start_method):
    """Trial 165: set_track_meta(False) (MONAI's fast-training idiom, often after a first
    loader was built) did not reach workers forked from an earlier Loader's fork server, nor
    those of a new interpreter (a thread ran): they made MetaTensors all the same."""
    from monai.data import get_track_meta, set_track_meta

    kw = {} if start_method is None else {"start_method": start_method}
    first = Loader(_TrackMeta(), batch_size=2, num_workers=1, autotune=False, **kw)
    try:
        set_track_meta(False)
        with Loader(_TrackMeta(), batch_size=2, num_workers=2, autotune=False, **kw) as second:
            assert [int(x) for b in second for x in b] == [0, 0, 0, 0]
    finally:
        set_track_meta(True)
        first.close()
    assert get_track_meta()
