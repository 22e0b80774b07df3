"""attnscale.kernels.team: pieces of CPU work on the calling thread's OpenMP team (PyTorch's own
threads), with the contract of attnscale.workers.parallel_map."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.testing import assert_close

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
    assert_close(torch.stack(got), a @ b, rtol=1e-5, atol=1e-5)


def test_a_forked_child_uses_the_pool_of_python_threads():
    # GNU OpenMP's team does not survive a fork; the child gets the same answers from the pool.
    import multiprocessing as mp

    team_map(lambda x: x, range(4), 2)  # the parent's team has threads now
    with mp.get_context("fork").Pool(1) as child:
        usable, got = child.apply_async(_in_child).get(timeout=60)
    assert not usable and got == [x + 1 for x in range(6)]


def _in_child():
    return team.usable(), team_map(lambda x: x + 1, range(6), 2)


def test_without_openmp_the_c_loops_deal_their_blocks_to_the_pool(monkeypatch):
    # A build without OpenMP runs each C block loop as one single-threaded call per worker, on
    # the pool of Python threads; every block is one call's from start to end, so the bits match.
    from attnscale.kernels import softmax_rows
    from attnscale.kernels.peak import head_peaks
    from attnscale.workers import num_threads

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 300, 16, generator=g) for _ in range(3))

    def both():
        found = torch.zeros(2, 3, 300, 7, dtype=torch.float64)
        with torch.no_grad():
            out = softmax_rows.softmax_rows_attention(q, k, v, 0.3, None, True, found)
        return out, found, head_peaks(q, k, 0.3, causal=True, screen=False)

    with num_threads(2):
        want = both()
        calls = []
        real = native.softmax_rows_attention

        def record(*args, threads, **kwargs):
            calls.append((len(args[7]), threads))
            return real(*args, threads=threads, **kwargs)

        monkeypatch.setattr(native, "openmp", lambda: False)
        monkeypatch.setattr(native, "softmax_rows_attention", record)
        got = both()
    assert_close(got, want, rtol=0, atol=0)
    blocks = 2 * 3 * 5                      # 300 queries in blocks of 64
    assert sorted(calls) == [(blocks // 2, 1), (blocks // 2, 1)]
