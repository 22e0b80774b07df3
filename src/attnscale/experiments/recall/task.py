"""The associative-recall task: sequences of key-value pairs and one query key.

A sequence holds ``pairs`` (key, value) tokens.  Keys are a uniformly random subset of the
``n_keys`` key tokens (drawn without replacement, so the query has exactly one match); values are
drawn independently and uniformly from the ``n_values`` value tokens, *with* replacement (the essay
leaves this open; repeated values do not make the task ambiguous, since the query names a key).
The query is one of the sequence's keys, chosen uniformly, and the target is that key's value.
Attention has no positional signal, so the order of the pairs does not matter.

Determinism
-----------
Every batch comes from ``numpy.random.default_rng([seed, stream, chunk])``: the training stream is
cut into chunks of :data:`CHUNK_STEPS` steps, each from its own generator, so step ``t`` sees the same
batch whatever the total number of steps, and runs with the same seed (any mechanism) see the same
data.  The evaluation set uses a different ``stream``, i.e. a separate seed, so it is held out
(a repeat of a training sequence has probability ~ steps * batch / (C(32,16) 32^16) ~ 1e-27).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from attnscale.experiments.recall.config import RecallConfig

# Stream ids of the two uses of a seed.
TRAIN_STREAM = 0
EVAL_STREAM = 1
# Training steps sampled per generator chunk (bounds the memory of the pre-sampled stream).
CHUNK_STEPS = 256


@dataclass(frozen=True)
class RecallBatch:
    """Token ids of a batch of sequences; ``...`` is any leading batch shape."""
    keys: Tensor     # (..., P) key token ids, distinct within a sequence
    values: Tensor   # (..., P) value token ids
    query: Tensor    # (...) the queried key, one of ``keys``
    target: Tensor   # (...) the value paired with ``query``

    def __getitem__(self, index) -> RecallBatch:
        return RecallBatch(self.keys[index], self.values[index], self.query[index],
                           self.target[index])

    def __len__(self) -> int:
        return self.query.shape[0]


def sample(rng: np.random.Generator, count: int, pairs: int, n_keys: int,
           n_values: int) -> RecallBatch:
    """``count`` independent sequences, as a batch of shape (count,)."""
    keys = rng.random((count, n_keys)).argsort(axis=1)[:, :pairs]   # (count, P) a random subset
    values = rng.integers(0, n_values, size=(count, pairs))         # (count, P)
    pos = rng.integers(0, pairs, size=count)                        # (count,) queried pair
    rows = np.arange(count)
    return RecallBatch(*(torch.from_numpy(np.ascontiguousarray(a)).long()
                         for a in (keys, values, keys[rows, pos], values[rows, pos])))


def _config_rng(config: RecallConfig, stream: int, chunk: int = 0) -> np.random.Generator:
    return np.random.default_rng([config.seed, stream, chunk])


def train_chunk(config: RecallConfig, chunk: int) -> RecallBatch:
    """Steps ``[chunk * CHUNK_STEPS, (chunk + 1) * CHUNK_STEPS)`` of the stream: (CHUNK_STEPS, B)."""
    batch = sample(_config_rng(config, TRAIN_STREAM, chunk), CHUNK_STEPS * config.batch_size,
                   config.pairs, config.n_keys, config.n_values)
    shape = (CHUNK_STEPS, config.batch_size)
    return RecallBatch(batch.keys.view(*shape, -1), batch.values.view(*shape, -1),
                       batch.query.view(shape), batch.target.view(shape))


def eval_set(config: RecallConfig) -> RecallBatch:
    """The held-out evaluation set of ``config.eval_size`` sequences, shape (eval_size,)."""
    return sample(_config_rng(config, EVAL_STREAM), config.eval_size, config.pairs,
                  config.n_keys, config.n_values)
