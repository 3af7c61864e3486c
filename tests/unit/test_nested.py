"""pyreducer.wrapper.nested, the one walker of forward inputs and outputs: every container type
keeps its type and structure, tensors come out depth first, and replacing them round-trips."""
import collections
import dataclasses
from typing import NamedTuple

import pytest
import torch

from pyreducer.wrapper import nested


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: dict
    note: str = "x"
    derived: int = dataclasses.field(init=False, default=0)


def _example():
    a, b, c, d, e = (torch.full((2,), float(i)) for i in range(5))
    return [a, (b, "label", 3), Pair(c, {"k": d}), Output(e, {"z": None}),
            collections.OrderedDict(x=a), collections.defaultdict(list, y=[b])], [a, b, c, d, e, a, b]


def test_tensors_come_out_depth_first():
    obj, expected = _example()
    found = nested.tensors(obj)
    assert len(found) == len(expected) and all(x is y for x, y in zip(found, expected))


def test_map_keeps_every_container_type():
    obj, _ = _example()
    out = nested.map_tensors(obj, lambda t: t + 1)
    assert type(out[1]) is tuple and out[1][1:] == ("label", 3)
    assert type(out[2]) is Pair and type(out[2].second) is dict
    assert type(out[3]) is Output and out[3].note == "x" and out[3].extras == {"z": None}
    assert type(out[4]) is collections.OrderedDict
    assert type(out[5]) is collections.defaultdict and out[5].default_factory is list
    assert all(torch.equal(t, s + 1) for t, s in zip(nested.tensors(out), nested.tensors(obj)))
    assert torch.equal(obj[0], torch.zeros(2))  # the input is not modified


def test_replace_round_trips_and_checks_the_count():
    obj, _ = _example()
    replacements = [torch.ones(1) * i for i in range(7)]
    out = nested.replace_tensors(obj, replacements)
    assert all(x is y for x, y in zip(nested.tensors(out), replacements))
    with pytest.raises(ValueError, match="more replacements"):
        nested.replace_tensors(obj, replacements + [torch.ones(1)])
    with pytest.raises(ValueError, match="3 replacements for more"):
        nested.replace_tensors(obj, replacements[:3])


def test_leaves_come_back_unchanged():
    for leaf in (None, 3, "text", Output):  # a dataclass type is a leaf, not an instance
        assert nested.map_tensors(leaf, lambda t: t) is leaf


def test_packed_sequences_move_whole_with_batch_sizes_on_the_cpu():
    """As torch DDP moves inputs: PackedSequence.to(), never its fields one by one (an RNN
    rejects batch_sizes off the CPU). 'meta' stands in for a GPU here."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    packed = pack_padded_sequence(torch.randn(3, 4, 2), torch.tensor([4, 2, 1]),
                                  batch_first=True, enforce_sorted=False)
    moved = nested.to_device({"x": packed, "mask": torch.ones(3)}, torch.device("meta"))
    assert isinstance(moved["x"], PackedSequence)
    assert moved["x"].data.device.type == "meta" and moved["mask"].device.type == "meta"
    assert moved["x"].batch_sizes.device.type == "cpu"
    assert torch.equal(moved["x"].batch_sizes, packed.batch_sizes)
    assert nested.to_device(packed, torch.device("cpu")) is packed  # already there: no copy


def test_outputs_walk_into_packed_sequences():
    """Forward outputs: a PackedSequence's data is a tensor like any other (for the sink node)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    packed = pack_padded_sequence(torch.randn(2, 3, 2), torch.tensor([3, 1]), batch_first=True)
    found = nested.tensors((packed,))
    assert found[0] is packed.data and len(found) == 2  # data, batch_sizes (indices are None)
    rebuilt = nested.replace_tensors((packed,), [packed.data * 2, packed.batch_sizes])
    assert type(rebuilt[0]) is type(packed) and torch.equal(rebuilt[0].data, packed.data * 2)
