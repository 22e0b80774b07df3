"""attnscale.kernels.team: pieces of CPU work on the calling thread's OpenMP team (PyTorch's own
threads), with the contract of attnscale.workers.parallel_map."""

from __future__ import annotations

import threading

import pytest
import torch

from attnscale.kernels import native, team
from attnscale.kernels.team import team_map


def test_the_build_has_openmp_and_shares_pytorchs_runtime():
    # The speed figures of the blockwise kernels on 2 threads depend on it; on Linux both
    # libraries name libgomp.so.1 and the process maps one copy.
    assert native.openmp() and team.usable()
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1


def test_results_come_back_in_order():
    got = team_map(lambda x: (x * x, torch.is_grad_enabled()), range(50), 2)
    assert got == [(x * x, False) for x in range(50)]


def test_pieces_run_side_by_side_on_two_threads():
    # Two pieces that each wait for the other finish only if two threads run them at once.
    meet = threading.Barrier(2, timeout=30)
    idents = team_map(lambda _: (meet.wait(), threading.get_ident())[1], range(2), 2)
    assert len(set(idents)) == 2 and threading.get_ident() in idents


def test_the_first_error_is_raised_and_the_other_thread_stops_taking_pieces():
    ran = []

    def piece(x: int) -> int:
        ran.append(x)
        if x == 3:
            raise KeyError("piece 3")
        return x

    with pytest.raises(KeyError, match="piece 3"):
        team_map(piece, range(1000), 2)
    assert len(ran) < 1000


def test_torch_ops_inside_match_the_calling_thread():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 300, 200, generator=g), torch.randn(8, 200, 100, generator=g)
    got = team_map(lambda i: a[i] @ b[i], range(8), 2)
    torch.testing.assert_close(torch.stack(got), a @ b, rtol=1e-5, atol=1e-5)


def test_a_forked_child_uses_the_pool_of_python_threads():
    # GNU OpenMP's team does not survive a fork; the child gets the same answers from the pool.
    import multiprocessing as mp

    team_map(lambda x: x, range(4), 2)  # the parent's team has threads now
    with mp.get_context("fork").Pool(1) as child:
        usable, got = child.apply_async(_in_child).get(timeout=60)
    assert not usable and got == [x + 1 for x in range(6)]


def _in_child():
    return team.usable(), team_map(lambda x: x + 1, range(6), 2)
