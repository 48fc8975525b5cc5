"""Batch assembly: collate agrees with torch's default_collate (tensor subclasses, bfloat16),
writes into pooled buffers, and the pool stays within its byte budget."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from autominato.pipeline.collate import BatchPool, collate
from autominato.pipeline.shm import SlotPool, pack, packed_nbytes, unpack


class TaggedTensor(torch.Tensor):
    """A user's tensor subclass."""


def test_collate_keeps_a_tensor_subclass_as_default_collate_does_and_writes_into_the_pool():
    pool = BatchPool(max_per_key=1)
    samples = [torch.full((2, 3), float(i)).as_subclass(TaggedTensor) for i in range(4)]
    batch = collate(samples, pool)
    expected = default_collate(samples)
    assert type(batch) is type(expected) is TaggedTensor
    assert torch.equal(batch.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor))
    pooled = pool._bufs[((4, 2, 3), "<f4")][0].ctypes.data  # (a reference would keep it in use)
    assert batch.data_ptr() == pooled  # the pooled buffer, re-wrapped
    # In use while the batch lives; free again once it is dropped.
    other = collate(samples, pool)
    assert other.data_ptr() != batch.data_ptr() and pool.allocations == 2
    del batch, other
    gc.collect()
    assert collate(samples, pool).data_ptr() == pooled and pool.reuses == 1


def test_collate_of_monai_meta_tensors_matches_monai_list_data_collate_into_the_pool():
    import monai.data as monai_data  # the test extra installs MONAI
    samples = [
        monai_data.MetaTensor(torch.rand(1, 4, 4), affine=torch.eye(4) * (i + 1), meta={"filename_or_obj": f"case_{i}.nii.gz"})
        for i in range(3)
    ]
    pool = BatchPool()
    batch = collate(samples, pool)
    expected = monai_data.list_data_collate(samples)
    assert type(batch) is type(expected) is monai_data.MetaTensor
    assert torch.equal(batch.as_tensor(), expected.as_tensor())
    assert batch.meta["filename_or_obj"] == expected.meta["filename_or_obj"] == [f"case_{i}.nii.gz" for i in range(3)]
    assert torch.equal(batch.affine, expected.affine) and batch.affine.shape == (3, 4, 4)
    assert batch.is_batch and expected.is_batch and batch.spatial_ndim == expected.spatial_ndim
    assert batch.data_ptr() == pool._bufs[((3, 1, 4, 4), "<f4")][0].ctypes.data  # pooled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2])
def test_collate_stacks_dtypes_numpy_lacks_bit_exact(dtype):
    samples = [(torch.randn(3, 4) * 10).to(dtype) for _ in range(3)]
    batch = collate([(s, i) for i, s in enumerate(samples)], BatchPool())
    assert batch[0].dtype == dtype and batch[0].shape == (3, 3, 4)
    assert torch.equal(batch[0].view(torch.uint8), torch.stack(samples).view(torch.uint8))
    assert torch.equal(batch[1], torch.tensor([0, 1, 2]))


def test_samples_unpacked_from_slots_collate_to_their_subclass_and_dtype():
    """The loader's path: pack in a worker, unpack views in the main process, collate."""
    slots = SlotPool(max_slots=2, budget_bytes=1 << 20)
    try:
        samples = [(torch.randn(2, 2).as_subclass(TaggedTensor), torch.randn(3).bfloat16()) for _ in range(2)]
        held, views = [], []
        for s in samples:
            slot = slots.acquire(packed_nbytes(s))
            desc, _ = pack(s, slot.mmap)
            held.append(slot)
            views.append(unpack(desc, slot.mmap))
        batch = collate(views, BatchPool())
        del views
        for slot in held:
            slots.release(slot)
        assert type(batch[0]) is TaggedTensor and batch[1].dtype == torch.bfloat16
        assert torch.equal(batch[1], torch.stack([s[1] for s in samples]))
    finally:
        slots.close()


def test_collate_matches_default_collate_on_nested_samples_and_rejects_ragged_shapes():
    samples = [{"image": np.full((2, 2), i, np.float32), "label": i, "name": f"c{i}", "pair": (torch.tensor(i), 0.5)} for i in range(3)]
    got, want = collate(samples, BatchPool()), default_collate(samples)
    assert torch.equal(got["image"], want["image"]) and torch.equal(got["label"], want["label"])
    assert got["name"] == want["name"] and torch.equal(got["pair"][0], want["pair"][0])
    # A flipped array (negative strides), which default_collate refuses, stacks as its values.
    assert torch.equal(collate([np.arange(3)[::-1]] * 2), torch.tensor([[2, 1, 0]] * 2))
    # default_collate's error type (RuntimeError), and ValueError, autominato's before
    for bad in ([torch.zeros(2), torch.zeros(3)], [np.zeros(2), np.zeros(3)]):
        with pytest.raises(RuntimeError, match="shapes differ") as info:
            collate(bad, BatchPool())
        assert isinstance(info.value, ValueError)
    # the field whose shapes differ is named, nested ones from the inside out (trial 179)
    nested = [{"meta": {"img": np.zeros((4, 4 + i))}, "i": i} for i in range(2)]
    with pytest.raises(RuntimeError, match="shapes differ") as info:
        collate(nested, BatchPool())
    assert info.value.__notes__ == ["[autominato] in the samples' field 'img'",
                                    "[autominato] in the samples' field 'meta'"]


@pytest.mark.parametrize("samples", [
    [np.full(2, 1, np.float32), np.full(2, 2, np.float64)],
    [torch.full((2,), 1, dtype=torch.int32), torch.full((2,), 2.5)],
    [{"x": np.zeros(2, np.int64)}, {"x": np.ones(2, np.float16)}],
    [1, 0.5],
    [0.5, 1],
    [np.float32(1), np.float32(2)],
    [True, False],
], ids=["f32-f64", "i32-f32-tensors", "dict-i64-f16", "int-then-float", "float-then-int",
        "np-scalars", "bools"])
def test_dtypes_that_differ_and_scalars_collate_as_default_collate(samples):
    """Review 100: arrays of one shape in mixed dtypes were refused (default_collate promotes
    them) and ``[1, 0.5]`` gave float64 (default_collate: float32)."""
    got, want = collate(samples, BatchPool()), default_collate(samples)
    if isinstance(want, dict):
        got, want = got["x"], want["x"]
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_mapping_sample_keeps_its_type_as_default_collate_does():
    from collections import OrderedDict

    samples = [OrderedDict(b=np.full(2, i), a=i) for i in range(3)]
    got = collate(samples, BatchPool())
    assert type(got) is OrderedDict and list(got) == ["b", "a"]
    assert torch.equal(got["b"], default_collate(samples)["b"])
    with pytest.raises(RuntimeError, match="sequences of different lengths"):
        collate([(1, 2), (1, 2, 3)])


class Fields(list):
    """A user's list subclass: a sample type (and a batch type) of its own, built from its
    items as arguments and with an attribute (review 107)."""

    def __init__(self, *items, tag: str = "none") -> None:
        super().__init__(items)
        self.tag = tag


def test_a_list_subclass_sample_keeps_its_type_through_collate_transport_and_copies():
    from autominato.pipeline.collate import to_device
    from autominato.pipeline.tree import map_leaves

    samples = [Fields(np.full(2, i), i, tag="t") for i in range(3)]
    got, want = collate(samples, BatchPool()), default_collate(samples)
    assert type(got) is type(want) is Fields and len(got) == 2 and got.tag == want.tag == "t"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    moved = to_device(got, torch.device("cpu"))  # (pin() walks the batch the same way)
    assert type(moved) is Fields and moved.tag == "t" and torch.equal(moved[0], got[0])
    mapped = map_leaves(Fields(1, 2, tag="u"), str, lambda x: isinstance(x, int))
    assert type(mapped) is Fields and list(mapped) == ["1", "2"] and mapped.tag == "u"


def test_samples_that_need_grad_stack_into_a_batch_that_keeps_their_graph():
    """As default_collate (num_workers=0 or thread workers: samples made in this process);
    trial 108: they were detached."""
    w = torch.ones(3, requires_grad=True)
    samples = [w * i for i in range(4)]
    got, want = collate(samples, BatchPool()), default_collate(samples)
    assert got.requires_grad and want.requires_grad and torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 6.0))


def test_batch_pool_stays_within_its_budget_over_60_shapes_and_reuses_repeating_ones():
    """Whole-volume validation: batch size 1, a new shape almost every batch."""
    budget = 1 << 20
    pool = BatchPool(max_per_key=2, budget_bytes=budget)
    shapes = [(1, 16, 16, 8 + d) for d in range(60)]  # 40 KiB to 240 KiB each, 8 MiB in all
    for shape in shapes:
        batch = collate([np.ones(shape[1:], np.float32)], pool)
        assert batch.shape == shape and pool.bytes <= budget
        del batch
    assert pool.evictions > 0 and pool.allocations == 60 and pool.reuses == 0
    # The most recent shapes are still held: repeating them allocates nothing.
    for shape in shapes[-3:] * 2:
        collate([np.zeros(shape[1:], np.float32)], pool)
    assert pool.allocations == 60 and pool.reuses == 6 and pool.bytes <= budget


def test_batch_pool_never_evicts_a_buffer_in_use_and_hands_out_what_it_cannot_keep():
    pool = BatchPool(max_per_key=4, budget_bytes=3 * 4096)
    kept = collate([np.full(1024, 7, np.float32)], pool)  # 4 KiB, in use throughout
    for n in range(1025, 1045):  # other shapes push the pool to evict
        collate([np.zeros(n, np.float32)], pool)
        assert pool.bytes <= 3 * 4096
    assert torch.all(kept == 7) and pool.evictions > 0
    assert collate([np.zeros(1024, np.float32)], pool).data_ptr() != kept.data_ptr()
    big = collate([np.zeros(8192, np.float32)], pool)  # larger than the budget: not kept
    assert big.shape == (1, 8192) and pool.bytes <= 3 * 4096


def test_the_default_budget_follows_the_batches_in_flight():
    """No budget given: idle buffers are bounded by the working set, and a steady training
    loop (fixed shapes, two fields, three batches in flight) stops allocating."""
    pool = BatchPool(max_per_key=5)
    for d in range(60):  # validation: one new shape per batch, each dropped before the next
        collate([np.ones((16, 16, 8 + d), np.float32)], pool)
        assert pool.bytes <= pool.budget <= 2 * 4 * 16 * 16 * 67
    in_flight = []
    for i in range(20):
        in_flight.append(collate([(np.full((4, 4), i, np.float32), np.full(2, i, np.uint8))] * 2, pool))
        if len(in_flight) > 3:
            in_flight.pop(0)
    before = pool.allocations
    for i in range(10):
        in_flight.append(collate([(np.full((4, 4), i, np.float32), np.full(2, i, np.uint8))] * 2, pool))
        in_flight.pop(0)
    assert pool.allocations == before and torch.all(in_flight[-1][0][0] == 9)


def test_an_idle_batch_buffer_gives_its_pages_back_after_the_decay_time_and_is_reused(
        monkeypatch):
    import time

    import psutil

    from autominato.pipeline import shm
    from autominato.pipeline.collate import BatchPool

    monkeypatch.setattr(shm, "DECAY_S", 0.2)
    me = psutil.Process()
    pool = BatchPool()
    shape = (2, 64, 256, 256)  # 32 MiB of float32
    a = pool.acquire(shape, np.float32)
    b = pool.acquire(shape, np.float32)  # a is still held: a second buffer
    a.fill(1)
    b.fill(2)
    view = a[0]  # a view of a batch holds its buffer too
    time.sleep(0.3)
    # Held for longer than the decay time (a batch in the prefetch queue, a long step): kept.
    assert pool.decay() == 0
    del a
    assert pool.decay() == 0 and view[0, 0, 0] == 1
    del view
    assert pool.decay() == 0  # idle from now on
    time.sleep(0.3)
    rss = me.memory_info().rss
    assert pool.resident_bytes() == 2 * (32 << 20)
    assert pool.decay() == 1  # idle for 0.3 s: its pages go back
    assert rss - me.memory_info().rss >= (32 << 20) * 0.9
    assert pool.resident_bytes() == 32 << 20 and pool.bytes == 2 * (32 << 20)
    del b  # b goes idle now: the warm one is taken first, the cold one next
    again, c = pool.acquire(shape, np.float32), pool.acquire(shape, np.float32)
    assert again[0, 0, 0, 0] == 2 and c[0, 0, 0, 0] == 0
    assert pool.allocations == 2 and pool.reuses == 2 and pool.released == 1


def test_idle_batch_buffers_give_their_pages_back_at_once_while_a_sample_is_held():
    """``decay(at_once=True)`` (the scheduler's tick while memory-aware dispatch holds a
    sample back, the private pool's memory counting in its budget): every idle buffer gives
    its pages back however recently freed; one a batch holds keeps them."""
    from autominato.pipeline.collate import BatchPool

    pool = BatchPool()
    shape = (2, 16, 256, 256)  # 8 MiB of float32
    held, idle = pool.acquire(shape, np.float32), pool.acquire(shape, np.float32)
    held.fill(1)
    idle.fill(2)
    del idle
    assert pool.decay() == 0 and pool.resident_bytes() == 2 * (8 << 20)  # freed just now
    assert pool.decay(at_once=True) == 1 and pool.resident_bytes() == 8 << 20
    assert held[1, 15, 255, 255] == 1 and pool.decay(at_once=True) == 0


def test_arrays_collated_as_a_list_are_copies_not_views_of_the_slot_they_came_in():
    # A field whose first value is a string is collated as a list (default_collate's rule);
    # its arrays came as views into a shared-memory slot that is reused once the batch is made.
    slot = np.arange(8, dtype=np.float32)
    out = collate([{"m": "a"}, {"m": slot[:4]}])
    slot[:] = -1  # the slot is written by its next sample
    assert out["m"][0] == "a" and out["m"][1].tolist() == [0, 1, 2, 3]


class _Opaque:
    pass


@pytest.mark.parametrize("samples", [[None, None], [{"k": None}, {"k": None}], [_Opaque()] * 2],
                         ids=["none", "none-in-a-dict", "an-object"])
def test_none_and_unknown_objects_raise_default_collates_type_error(samples):
    with pytest.raises(TypeError) as theirs:
        default_collate(samples)
    with pytest.raises(TypeError) as ours:
        collate(samples)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("value", [np.array(["a", "bc"]), np.array([b"ab"]),
                                   np.array([1, "x"], dtype=object)],
                         ids=["unicode", "bytes", "object"])
def test_numpy_arrays_of_strings_or_objects_raise_default_collates_type_error(value):
    # DataLoader's default_collate refuses them (np_str_obj_array_pattern, "[SaUO]") with a
    # TypeError naming the dtype; an object array used to come back as a list, a string one
    # with torch's "can't convert np.ndarray of type numpy.str_".
    samples = [value, value.copy()]
    with pytest.raises(TypeError) as theirs:
        default_collate(samples)
    with pytest.raises(TypeError) as ours:
        collate(samples)
    assert str(ours.value) == str(theirs.value)
    # Nested in a dict as well, and a NumPy string scalar still collates as a list of strings.
    with pytest.raises(TypeError, match="found"):
        collate([{"k": value}, {"k": value}])
    assert collate([np.str_("a"), np.str_("b")]) == default_collate([np.str_("a"), np.str_("b")])


@pytest.mark.parametrize("samples", [
    [torch.zeros(2), np.ones(2, np.float32)],
    [torch.zeros(2), torch.ones(2), np.ones(2, np.float32), np.ones(2)],
    [(torch.zeros(2), 1), (np.ones(2, np.float32), 2)],
    [torch.zeros(2), 3]], ids=["tensor-array", "arrays-after-tensors", "in-a-tuple", "a-number"])
def test_a_tensor_followed_by_an_array_raises_default_collates_type_error(samples):
    # Trial: a batch of a tensor and a NumPy array of one shape was stacked, where
    # default_collate's torch.stack refuses it ("expected Tensor as element 1 ..."): a dataset
    # that returns either trained under the Loader and failed under the DataLoader.
    with pytest.raises(TypeError) as theirs:
        default_collate(samples)
    with pytest.raises(TypeError) as ours:
        collate(samples, BatchPool())
    assert str(ours.value).startswith(str(theirs.value))  # torch's words, then which samples
    if isinstance(samples[1], np.ndarray):
        assert "sample 0 of the batch is a torch.Tensor" in str(ours.value)
        assert f"samples {[i for i, s in enumerate(samples) if isinstance(s, np.ndarray)]}" \
            f" of {len(samples)} are ['numpy.ndarray']" in str(ours.value)
    # An array first is made a tensor with the others and stacked, as default_collate does.
    flipped = samples[::-1] if isinstance(samples[1], np.ndarray) else None
    if flipped is not None:
        assert torch.equal(collate(flipped, BatchPool()), default_collate(flipped))
    else:  # (an array then a number: made a 0-d tensor, which does not stack: RuntimeError)
        for fn in (default_collate, collate):
            with pytest.raises(RuntimeError):
                fn([np.ones(2, np.float32), 3])


class _Mixed:
    """Odd samples are NumPy arrays, even ones tensors (one shape, one dtype)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return np.full(3, i, np.float32) if i % 2 else torch.full((3,), float(i))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_mixing_tensors_and_arrays_fails_as_the_dataloaders(workers):
    from test_parity import shut_down  # (pytest puts the tests' folder on sys.path)
    from torch.utils.data import DataLoader

    from autominato import Loader

    # (the DataLoader's worker processes fail earlier in default_collate, on x.numel():
    # AttributeError; the Loader collates in the training process, as default_collate there)
    dl_it = iter(DataLoader(_Mixed(), 2, num_workers=workers))
    with pytest.raises(TypeError if not workers else AttributeError,
                       match="expected Tensor as element 1" if not workers else "numel"):
        next(dl_it)
    if workers:  # (an iterator without workers has none to stop)
        shut_down(dl_it)
    with Loader(_Mixed(), 2, num_workers=workers, in_order=True, autotune=False) as L:
        it = iter(L)
        with pytest.raises(TypeError, match=r"expected Tensor as element 1 .* samples \[1\]"):
            next(it)
        with pytest.raises(TypeError, match="expected Tensor as element 1"):
            next(it)  # the next batch fails too, as its own error (the epoch goes on)
        assert next(it, None) is None


class _OneOddShape:
    """Index 3 loads with a wrong shape (no error until its batch collates); files i.npy."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return np.zeros(7 if i == 3 else 8, np.float32)

    def sample_path(self, i: int) -> str:
        return f"{i}.npy"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_that_fails_to_collate_names_its_samples(workers):
    # Trial 82: a file that loaded with a wrong shape failed its batch, naming no sample.
    from autominato import Loader

    with Loader(_OneOddShape(), 4, num_workers=workers, in_order=True, autotune=False) as L:
        it = iter(L)
        with pytest.raises(RuntimeError, match="cannot stack") as info:
            next(it)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "collating the batch of sample indices [0, 1, 2, 3]" in notes
        assert "'3.npy'" in notes
        assert next(it).shape == (4, 8)  # the next batch comes (as the DataLoader's)


def test_a_collate_fn_raising_one_instance_again_gets_one_note():
    # Review 83: a collate_fn that raises the same exception object each time gathered one
    # note per failed batch.
    from autominato import Loader

    boom = ValueError("boom")

    def collate_fn(samples):
        raise boom

    with Loader(_OneOddShape(), 4, num_workers=0, collate_fn=collate_fn, autotune=False) as L:
        it = iter(L)
        for _ in range(2):
            with pytest.raises(ValueError):
                next(it)
    assert [n for n in boom.__notes__ if "collating" in n] == [
        "[autominato] collating the batch of sample indices [0, 1, 2, 3] (files "
        "['0.npy', '1.npy', '2.npy', '3.npy']) failed"]


def test_an_iterable_datasets_batch_that_fails_to_collate_names_no_index():
    # Review 83: its samples have no index; the note named [-1, -1, -1, -1].
    from torch.utils.data import IterableDataset

    from autominato import Loader

    class Odd(IterableDataset):
        def __iter__(self):
            for i in range(4):
                yield np.zeros(7 if i == 3 else 8, np.float32)

    with Loader(Odd(), 4, num_workers=0, autotune=False) as L:
        with pytest.raises(RuntimeError, match="cannot stack") as info:
            next(iter(L))
    assert [n for n in info.value.__notes__ if "collating" in n] == [
        "[autominato] collating a batch failed"]


def test_pinning_calls_a_custom_batch_types_pin_memory_as_the_dataloader_does(monkeypatch):
    """The DataLoader's pin-memory thread calls ``pin_memory()`` on a batch object that has
    one (its documented "custom batch type" idiom); review 100 found only tensor leaves
    pinned. (No accelerator here: the check that pinning needs one is patched.)"""
    from autominato.pipeline.collate import pin

    class Custom:
        def __init__(self, pinned: bool = False) -> None:
            self.pinned = pinned

        def pin_memory(self):
            return Custom(pinned=True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = pin({"batch": Custom(), "names": ["a", "b"]})
    assert out["batch"].pinned and out["names"] == ["a", "b"]
    assert pin(Custom()).pinned
