"""torch's thread count for a block (mlcomp.hardware.threads), shared by the torch and TVM targets."""
from __future__ import annotations

import pytest
import torch

from mlcomp.hardware.threads import threads


def test_the_count_is_set_inside_and_put_back_after_an_error_too():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pytest.raises(RuntimeError, match="inside"):
        with threads(other):
            assert torch.get_num_threads() == other
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("n", [None, 0])
def test_no_count_leaves_torchs_own(n):
    before = torch.get_num_threads()
    with threads(n):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
