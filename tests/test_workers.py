"""attnscale.workers: the thread-count context every trainer runs under."""

from __future__ import annotations

import pytest
import torch

from attnscale.workers import num_threads


def test_num_threads_sets_and_restores_the_count_even_on_error():
    before = torch.get_num_threads()   # 1 (conftest's _one_thread)
    with num_threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), num_threads(before + 1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
