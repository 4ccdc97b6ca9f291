"""The restricted unpickler of a checkpoint's ``.metadata`` (services/state/chunk_reader.py)
and of inference's (services/compute/inference.py): Debian 12's Python 3.11.2 pickles an enum
member as ``getattr(cls, name)``, so a checkpoint written in the compose image could not be
loaded back in it ("refusing to load builtins.getattr", found by `make test-compose`). Only a
member of an allowed Enum may come through that getattr."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from services.compute import inference
from services.state import chunk_reader


class _AsGetattr:
    """Pickles as ``getattr(target, name)``, as those Python releases write an enum member."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


UNPICKLERS = [chunk_reader._MetadataUnpickler, inference._MetadataUnpickler]


@pytest.mark.parametrize("unpickler", UNPICKLERS, ids=["chunk_reader", "inference"])
def test_an_enum_member_pickled_as_getattr_loads(unpickler):
    data = pickle.dumps({"fmt": _AsGetattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")})
    assert b"getattr" in data
    assert unpickler(io.BytesIO(data)).load() == {"fmt": _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT}


@pytest.mark.parametrize("unpickler", UNPICKLERS, ids=["chunk_reader", "inference"])
@pytest.mark.parametrize(
    "target, name",
    [
        (_MEM_FORMAT_ENCODING, "__class__"),  # an attribute that is not a member
        (_MEM_FORMAT_ENCODING, "NO_SUCH_MEMBER"),
        (torch.Size, "__new__"),  # an allowed class that is not an Enum
    ],
)
def test_any_other_getattr_is_refused(unpickler, target, name):
    data = pickle.dumps(_AsGetattr(target, name))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        unpickler(io.BytesIO(data)).load()
