"""The worker of test_guard's data-parallel check: one gloo rank (kept apart from test_guard so a
spawned process imports torch and attnscale only, not transformers)."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

import attnscale
from attnscale import MultiHeadAttention


@contextlib.contextmanager
def gloo(rank: int, port: int):
    """Rank ``rank`` of a two-process gloo group for the block, one thread; a collective that
    waits a minute for the other rank fails rather than hanging the test."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    # Once the block is done (its results on disk), the rank leaves without PyTorch's teardown:
    # freeing DistributedDataParallel's reducer destroys the gloo group under the GIL, and its
    # destructor joins a run-loop thread that may be waiting for the GIL to free a tensor (a
    # deadlock seen in about 1 run in 2 to 10 on torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input in :func:`worker`: rank 1's is 3x, so it sees the larger logits."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(10 + rank))
    return x * (3.0 if rank == 1 else 1.0)


def worker(rank: int, port: int, out: str) -> None:
    with gloo(rank, port):
        torch.manual_seed(0)
        mha = MultiHeadAttention(16, 2)
        opt = torch.optim.SGD(mha.parameters(), lr=0.0)  # the clip is the only change
        with attnscale.guard(mha, optimizer=opt, qk_clip=0.5, every=1, alarm_logit=None) as g:
            mha(worker_batch(rank)).sum().backward()
            opt.step()
            g.step(0)
        torch.save({"w_q": mha.w_q.weight.detach(), "w_k": mha.w_k.weight.detach(),
                    "s_max": [r["s_max"] for r in g.records]}, f"{out}/rank{rank}.pt")


def fsdp_worker(rank: int, port: int, out: str) -> None:
    """FSDP2 (fully_shard) on gloo: each rank holds half of W_Q's and W_K's rows, so with 3
    heads of 4 channels (12 rows) rank 0 holds heads 0 and half of 1, rank 1 the rest."""
    from torch.distributed.fsdp import fully_shard

    with gloo(rank, port):
        torch.manual_seed(0)
        mha = MultiHeadAttention(12, 3, bias=True)
        fully_shard(mha)
        x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(10 + rank)) * 3
        opt = torch.optim.SGD(mha.parameters(), lr=0.0)
        with attnscale.guard(mha, optimizer=opt, qk_clip=0.5, every=1, alarm_logit=None) as g:
            mha(x).sum().backward()
            opt.step()
            g.step(0)
        full = {name: p.full_tensor().detach() for name, p in mha.named_parameters()}
        if rank == 0:
            torch.save(full, f"{out}/fsdp.pt")


def records_worker(rank: int, port: int, out: str) -> None:
    """DistributedDataParallel, each rank its own batch (rank 1's logits larger), a log and a
    stop alarm that only rank 1's batch would fire: the records, the alarm and the log are the
    global batch's, on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    with gloo(rank, port):
        torch.manual_seed(0)
        mha = MultiHeadAttention(16, 2)
        ddp = DistributedDataParallel(mha)
        opt = torch.optim.SGD(mha.parameters(), lr=0.1)
        with attnscale.guard(mha, optimizer=opt, qk_clip=2.0, every=1, alarm_logit=ALARM,
                             on_alarm="stop", log=f"{out}/guard.jsonl") as g:
            for step in range(2):
                rank_batch(rank, step, ddp).sum().backward()
                opt.step()
                opt.zero_grad()
                g.step(step)
        torch.save({"records": g.records, "stop": g.should_stop,
                    "w": {k: v.detach() for k, v in mha.state_dict().items()}},
                   f"{out}/records{rank}.pt")


# Above rank 0's largest logit, below rank 1's.
ALARM = 3.0


def rank_batch(rank: int, step: int, model):
    """Rank ``rank``'s batch at ``step`` through ``model``: (2, 8 or 12, 16)."""
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randn(2, 8 + 4 * rank, 16, generator=g)
    return model(x * (3.0 if rank == 1 else 1.0))
