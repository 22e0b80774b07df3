"""The single-head recall model: a plain module, and a fast batched forward over several of them.

Model (the essay's training demo, written out; what the essay leaves open is documented on the
fields of :class:`~attnscale.experiments.recall.config.RecallConfig`)::

    x_i = (E[k_i] + E[n_keys + v_i]) / sqrt(2)        pair embedding, (B, P, d_model)
    x_q = E[q]                                          query embedding, (B, d_model)
    q, k_i, v_i = W_Q x_q, W_K x_i, W_V x_i             (B, d_k), (B, P, d_k), (B, P, d_k)
    z = mechanism.logits(q, k)                          (B, P), the temperature under study
    y = W_out sum_i softmax(z)_i v_i                    (B, n_values) readout logits
    loss = cross_entropy(y, target)

Initialisation (drawn in this order from ``torch.manual_seed(seed)`` inside ``fork_rng``, so equal
seeds give equal weights for every mechanism and the global RNG is left untouched): E ~ N(0, 1);
W_Q, W_K, W_V ~ N(0, 1/d_model), so q and k have unit-variance coordinates at step 0, the premise of
the variance argument; W_out ~ N(0, 1/d_k).  Then the mechanism acts on W_Q and W_K
(:meth:`~attnscale.mechanisms.Mechanism.init_projections`: init-reparam rescales them by d^-1/4,
sigma-reparam reparametrises them), exactly as in :class:`attnscale.attention.MultiHeadAttention`.

Fast path
---------
:meth:`RecallNet.forward` embeds and projects every token, O(B P d_model d_k) per step.  But x_i is a
linear function of two table rows, so projecting the (n_keys + n_values)-row table once is exact:
``k_i = (T_K[k_i] + T_K[n_keys + v_i]) / sqrt(2)`` with ``T_K = E W_K^T``.  The readout is linear too,
so the value vectors are only needed through ``T_R = E (W_out W_V)^T``, n_values wide.  For
mechanisms whose logits are a temperature on the plain dot product (``prepare`` returns q and k
untouched: scaled, unscaled, mup, softcap, ...), even the logits come from a table of every
(query token, pair token) score, ``S = T_Q T_K^T``, so nothing d_k-wide is formed per token at all.
Mechanisms that transform q and k (qknorm, cosine, ...) run once on the n_keys x n_values distinct
pair vectors instead of on the B x P pairs of a batch (:func:`_pair_logits`), while there are no
more of those than of the batch's pairs; else on the batch's own keys (:func:`_row_logits`).
:class:`StackedRecall` runs M models (mechanisms or seeds) as one: their weights are stacked on a
leading model axis, so every matmul is one ``bmm`` and the optimiser sees five tensors, not 5 M.

Mechanisms with a logit bias read the order of the pairs: the query sits after the P pairs, at
position P, and a pair has a query of its own (W_Q of its embedding) for selective attention's
selection.  FoX adds Σ_{j<l≤P} log f_l (each pair's forget gate, from its embedding, and the
query's own, which cancels in the softmax); selective attention subtracts F_Pj = Σ_{j<k<P}
max(0, s q_k·k_j), the selections of the pairs after j (pair 0 is never selected, as a first
token).  Differential attention's logits are its two maps side by side (2P wide; in a stack with
other mechanisms, their logits are padded to that width with -inf, masked keys), and its output
is normalised before the readout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnscale.attention import attention
from attnscale.kernels.biased import ForgetBias, SelectBias, selection
from attnscale.mechanisms import Mechanism, build_mechanism
from attnscale.pipeline import normalise, observe_logits, temper
from attnscale.experiments.recall.config import RecallConfig
from attnscale.experiments.recall.task import RecallBatch

# x_i = (E[k_i] + E[v_i]) / sqrt(2) keeps unit-variance coordinates for independent embeddings.
PAIR_NORM = 1.0 / math.sqrt(2.0)


@dataclass(frozen=True)
class RecallOutput:
    """What one forward pass returns; ``...`` is () for one model, (M,) for a batched forward."""
    loss: Tensor     # (...) mean cross-entropy per model, nats
    z: Tensor        # (..., B, P) attention logits after the mechanism (2P: see the module doc)
    logits: Tensor   # (..., B, n_values) readout logits


class RecallNet(nn.Module):
    """One single-head attention model; :meth:`forward` is the straightforward implementation."""

    def __init__(self, config: RecallConfig):
        super().__init__()
        c = config
        self.config = c
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            self.embed = nn.Embedding(c.n_keys + c.n_values, c.d_model)  # rows: keys, then values
            self.w_q = nn.Linear(c.d_model, c.d_k, bias=False)
            self.w_k = nn.Linear(c.d_model, c.d_k, bias=False)
            self.w_v = nn.Linear(c.d_model, c.d_k, bias=False)
            self.readout = nn.Linear(c.d_k, c.n_values, bias=False)
            with torch.no_grad():
                self.embed.weight.normal_(0.0, 1.0)
                for w in (self.w_q, self.w_k, self.w_v):
                    w.weight.normal_(0.0, 1.0 / math.sqrt(c.d_model))
                self.readout.weight.normal_(0.0, 1.0 / math.sqrt(c.d_k))
            self.mechanism: Mechanism = build_mechanism(c.mechanism, c.d_k, 1, **dict(c.options))
            self.mechanism.init_projections(self.w_q, self.w_k)
        self.bilinear = _is_bilinear(self.mechanism, c.d_k)

    def forward(self, batch: RecallBatch) -> RecallOutput:
        """Loss on ``batch`` of shape (B,), embedding and projecting every token."""
        nk = self.config.n_keys
        x = (self.embed(batch.keys) + self.embed(nk + batch.values)) * PAIR_NORM  # (B, P, d_model)
        x_q = self.embed(batch.query)                                           # (B, d_model)
        q = self.w_q(x_q)                                                       # (B, d_k)
        k, v = self.w_k(x), self.w_v(x)                                         # (B, P, d_k)
        # A gating mechanism's output gate σ(x W_g) reads the query's embedding, the layer input.
        gate = self.mechanism.gate_values(x_q[:, None, :]) if self.mechanism.gate else None
        if self.mechanism.logit_bias is not None:
            z, o = self._ordered(x, x_q)
        else:
            trace = attention(q[:, None, None, :], k[:, None], v[:, None], self.mechanism,
                              trace=True, gate=gate)
            z, o = trace.logits[:, 0, 0], trace.out[:, 0, 0]                   # (B, P), (B, d_k)
        logits = self.readout(o)                                                # (B, n_values)
        return RecallOutput(F.cross_entropy(logits, batch.target), z, logits)


    def _ordered(self, x: Tensor, x_q: Tensor) -> tuple[Tensor, Tensor]:
        """A logit bias's model: the pairs then the query as one causal sequence, every token
        with its q, k, v, the query's row attending the pairs only: logits (B, P), output
        (B, d_k)."""
        seq = torch.cat([x, x_q[:, None, :]], dim=1)                            # (B, P + 1, d)
        q, k, v = (w(seq)[:, None] for w in (self.w_q, self.w_k, self.w_v))      # (B, 1, P+1, d)
        n = seq.shape[1]
        pairs = torch.arange(n) < n - 1                                          # keys: the pairs
        log_forget = (self.mechanism.forget_gates(seq)
                      if self.mechanism.logit_bias == "forget" else None)         # (B, 1, P + 1)
        trace = attention(q, k, v, self.mechanism, mask=pairs, causal=True, trace=True,
                          log_forget=log_forget)
        return trace.logits[:, 0, -1, :-1], trace.out[:, 0, -1]


def _is_bilinear(mechanism: Mechanism, d_k: int) -> bool:
    """Whether the logits are ``cap(scale * q.k + offset)`` of the *unmodified* q and k.

    True when the mechanism keeps the base ``logits`` and declares itself ``bilinear`` (its
    ``prepare`` hands q and k back and its scale depends on parameters or the number of keys
    only).  Only then may the logits be gathered from the score table; the others go through
    :func:`_pair_logits` (or, when not ``per_key``, through the keys of each sequence).
    """
    return type(mechanism).logits is Mechanism.logits and mechanism.bilinear


@dataclass(frozen=True)
class BatchIndex:
    """A batch with a leading model axis, as rows of the per-model token tables (see
    :class:`StackedRecall`); built once per chunk of steps, sliced per step."""
    tokens: Tensor   # (M, ..., 2P) table rows of the pair halves: k_1..k_P, then n_keys + v_1..v_P
    pairs: Tensor    # (M, ..., P) pair ids k_i * n_values + v_i, rows of the pair table
    query: Tensor    # (M, ...) table row of the query key
    target: Tensor   # (M, ...) the value to recall

    @staticmethod
    def build(batch: RecallBatch, n_keys: int, n_values: int) -> BatchIndex:
        """Index a batch whose tensors have a leading model axis M (and any batch shape after)."""
        return BatchIndex(torch.cat([batch.keys, n_keys + batch.values], -1),
                          batch.keys * n_values + batch.values, batch.query, batch.target)

    def step(self, t: int) -> BatchIndex:
        """Step ``t`` of an index built over (M, steps, B): the (M, B) batch of that step."""
        return BatchIndex(self.tokens[:, t], self.pairs[:, t], self.query[:, t],
                          self.target[:, t])


class StackedRecall(nn.Module):
    """M recall models trained as one: each weight is stacked on a leading model axis.

    Built from :class:`RecallNet` instances (which fix each run's init), it owns copies of their
    weights as (M, ...) parameters and shares their mechanisms.  A parametrisation a mechanism put on
    W_Q or W_K (sigma-reparam) is applied per model to its slice, with the net's own state (gamma and
    the power-iteration vectors).  The models never interact: the loss is a sum over models, and
    Adam and SGD act elementwise, so each slice trains exactly as its model would alone.

    Its logits come from score tables, not from an attention call, so each forward hands every
    model's (B, P) logits to :func:`attnscale.pipeline.observe_logits` as one call of one head
    (with its output gate): model m is the m-th call a monitor or guard sees, and a qk-clip
    model's S_max folds them in training.
    """

    def __init__(self, nets: list[RecallNet]):
        super().__init__()
        self.config = nets[0].config  # shapes are shared; per-model fields live in the nets
        self.configs = [n.config for n in nets]

        def stacked(get) -> nn.Parameter:
            return nn.Parameter(torch.stack([get(n).detach() for n in nets]).contiguous())

        # Weights are stored in the layout the matmuls read (W^T), so that neither the forward
        # nor the gradient accumulation has to transpose-copy them.
        self.embed = stacked(lambda n: n.embed.weight)                      # (M, T, d_model)
        self.w_q_t = stacked(lambda n: _raw_weight(n.w_q).mT)               # (M, d_model, d_k)
        self.w_k_t = stacked(lambda n: _raw_weight(n.w_k).mT)               # (M, d_model, d_k)
        self.w_v_t = stacked(lambda n: n.w_v.weight.mT)                     # (M, d_model, d_k)
        self.readout_t = stacked(lambda n: n.readout.weight.mT)             # (M, d_k, n_values)
        self.mechanisms = nn.ModuleList(n.mechanism for n in nets)
        # Per model, the parametrisations of W_Q and W_K (empty for most mechanisms).
        self.q_maps = nn.ModuleList(_weight_maps(n.w_q) for n in nets)
        self.k_maps = nn.ModuleList(_weight_maps(n.w_k) for n in nets)
        # Per model: whether its logits can be read off the token-pair score table.
        self.bilinear = tuple(n.bilinear for n in nets)
        # Whether per-key mechanisms score the table of every pair vector: None decides by size
        # per batch (see forward); True or False forces it (to test both paths).
        self.pair_table: bool | None = None

    def __len__(self) -> int:
        return self.embed.shape[0]

    def qk_weights(self) -> tuple[Tensor, Tensor]:
        """The effective W_Q^T and W_K^T, (M, d_model, d_k) each, after any parametrisation."""
        return _mapped(self.w_q_t, self.q_maps), _mapped(self.w_k_t, self.k_maps)

    def _tables(self, qk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Projected token tables T_Q (M, n_keys, d_k), T_K (M, T, d_k), T_R (M, T, n_values),
        from the effective W_Q^T and W_K^T ``qk`` (:meth:`qk_weights`, computed once per
        forward: a parametrisation's power iteration steps each time it runs)."""
        W_q_t, W_k_t = self.qk_weights() if qk is None else qk
        E = self.embed                                                       # (M, T, d_model)
        T_q = E[:, :self.config.n_keys] @ W_q_t                              # (M, n_keys, d_k)
        T_k = E @ W_k_t                                                      # (M, T, d_k)
        T_r = E @ (self.w_v_t @ self.readout_t)                              # (M, T, n_values)
        return T_q, T_k, T_r

    def forward(self, idx: BatchIndex) -> RecallOutput:
        """The M models' losses on their (M, B) batches; equals each :meth:`RecallNet.forward`
        up to float rounding."""
        M, B, P2 = idx.tokens.shape
        P = P2 // 2
        qk = self.qk_weights()
        T_q, T_k, T_r = self._tables(qk)
        # unbind, not T_q[m]: indexing model by model would make backward add M full-size zero
        # gradients (one per select), O(M^2) work; unbind's backward stacks the M slices once.
        T_qs, T_ks = T_q.unbind(0), T_k.unbind(0)                            # M x (n_keys|T, d_k)
        if any(self.bilinear):
            dots = _gather_dots(T_q, T_k, idx).unbind(0)                     # M x (B, P) = q.k_i
        # A per-key mechanism runs on the table of every distinct pair vector while that table
        # is no larger than the batch's pairs (32 x 32 = 1024 vs 96 x 16 at the recall study's
        # defaults); with more key tokens (512 in the length study) the batch's own B x P key
        # vectors are far fewer than the n_keys x n_values pairs, each scored by n_keys queries.
        pair_table = self.pair_table if self.pair_table is not None else \
            self.config.n_keys * self.config.n_values <= B * P
        z = []
        for m, mech in enumerate(self.mechanisms):
            if self.bilinear[m]:
                z.append(_temper(mech, T_qs[m], T_ks[m], dots[m], P))          # (B, P)
            elif mech.per_key and pair_table and mech.logit_bias is None:
                z.append(_pair_logits(mech, T_qs[m], T_ks[m], idx.query[m], idx.pairs[m],
                                      self.config.n_keys, P))                # (B, P or 2P)
            else:  # the whole row, or a pair table larger than the batch: the batch's own keys
                z.append(_row_logits(mech, T_qs[m], T_ks[m], idx.query[m], idx.tokens[m]))
            if mech.logit_bias is not None:  # the pairs' order: FoX's decay, the selection
                z[-1] = z[-1] + self._bias(m, mech, idx, qk)
        widths = [t.shape[-1] for t in z]
        z = torch.stack([F.pad(t, (0, max(widths) - t.shape[-1]), value=float("-inf"))
                         for t in z])                                        # (M, B, P or 2P)
        # each model's own logits, contiguous (a strided slice would change float rounding)
        own = [z[m] if widths[m] == z.shape[-1] else z[m][..., :widths[m]].contiguous()
               for m in range(M)]
        gates = self._gates(idx)
        for m, mech in enumerate(self.mechanisms):
            # each model's logits as one attention call: its qk-clip's S_max in training, and
            # the monitor or guard, which see no attention call here otherwise
            observe_logits(own[m][:, None, None, :], mech,
                           gate=None if m not in gates else gates[m][:, None, None, :])
        p = torch.stack([_weights(mech, own[m]) for m, mech in enumerate(self.mechanisms)])
        # The readout is linear: W_out sum_i p_i v_i = sum_t mass_t T_R[t], where mass_t is the
        # attention on token t (p_i / sqrt(2) on both halves of pair i).  A scatter and a bmm
        # replace gathering (B, P, n_values) readout rows, whose backward is a slow index_put.
        mass = p.new_zeros(M, B, T_r.shape[1]).scatter_add(-1, idx.tokens, p.repeat(1, 1, 2))
        logits = (mass * PAIR_NORM) @ T_r                                    # (M, B, n_values)
        if gates:
            logits = self._gated(logits, mass, idx, gates)
        if any(mech.normalises_output for mech in self.mechanisms):
            logits = self._normalised(logits, mass)
        loss = F.cross_entropy(logits.flatten(0, 1), idx.target.flatten(), reduction="none")
        return RecallOutput(loss.view(M, B).mean(-1), z, logits)

    def _gates(self, idx: BatchIndex) -> dict[int, Tensor]:
        """The output gate σ(x_q W_g) of each gating model m (x_q the query's embedding, the
        layer input), (B, 1 or d_k)."""
        gates = {}
        for m, mech in enumerate(self.mechanisms):
            if mech.gate:
                x_q = self.embed[m][idx.query[m]]                            # (B, d_model)
                gates[m] = mech.gate_values(x_q[:, None, :])[:, 0, 0, :]
        return gates

    def _gated(self, logits: Tensor, mass: Tensor, idx: BatchIndex,
               gates: dict[int, Tensor]) -> Tensor:
        """The readout of gating models with their output ``gates``: a gate per head scales the
        readout logits, which are linear in the output; a gate per coordinate multiplies the
        output itself, formed from the value table."""
        out = list(logits.unbind(0))
        for m, g in gates.items():
            if g.shape[-1] == 1:
                out[m] = g * out[m]
            else:
                o = (mass[m] * PAIR_NORM) @ (self.embed[m] @ self.w_v_t[m])   # (B, d_k)
                out[m] = (g * o) @ self.readout_t[m]
        return torch.stack(out)

    def _normalised(self, logits: Tensor, mass: Tensor) -> Tensor:
        """The readout of models that normalise their output (differential attention): the
        output formed from the value table, normalised, then read out."""
        out = list(logits.unbind(0))
        for m, mech in enumerate(self.mechanisms):
            if mech.normalises_output:
                o = (mass[m] * PAIR_NORM) @ (self.embed[m] @ self.w_v_t[m])   # (B, d_k)
                o = mech.normalise_output(o[:, None, None, :])[:, 0, 0, :]
                out[m] = o @ self.readout_t[m]
        return torch.stack(out)

    def _bias(self, m: int, mech: Mechanism, idx: BatchIndex,
              qk: tuple[Tensor, Tensor]) -> Tensor:
        """Model m's logit bias (B, P) on the ordered sequence of the module doc: FoX's decay
        from the forget gates of the pairs' and the query's embeddings, or minus the pairs'
        selection (their own queries against the keys before them)."""
        E = self.embed[m]                                                     # (T, d_model)
        B, P = idx.pairs[m].shape
        pairs = E[idx.tokens[m]].view(B, 2, P, -1).sum(1) * PAIR_NORM        # (B, P, d_model)
        if mech.logit_bias == "forget":
            seq = torch.cat([pairs, E[idx.query[m]][:, None, :]], dim=1)      # (B, P + 1, d)
            c = torch.cumsum(mech.forget_gates(seq).double(), dim=-1)         # (B, 1, P + 1)
            return ForgetBias(c).dense(P + 1, P)[:, 0, -1].to(E.dtype)         # c_P − c_j
        W_q_t, W_k_t = (w[m] for w in qk)
        q, k = pairs @ W_q_t, pairs @ W_k_t                                   # (B, P, d_k) each
        _, _, scale = mech.prepare(q[:, None], k[:, None], P)
        # the query's row only: F_Pj = Σ_{j<k<P} S_kj, every pair k before the query selecting
        z0 = scale * (q @ k.transpose(-2, -1))                                # (B, P, P)
        return -selection(z0, SelectBias(None).valid_dense(P, P, z0.device)).sum(-2)

    @torch.no_grad()
    def qk_dots(self, idx: BatchIndex) -> Tensor:
        """Raw q.k_i before any temperature, (M, B, P): the variance argument's quantity."""
        T_q, T_k, _ = self._tables()
        return _gather_dots(T_q, T_k, idx)


def _raw_weight(linear: nn.Linear) -> Tensor:
    """The trained tensor behind ``linear.weight``: the weight, or the original under a
    parametrisation."""
    if hasattr(linear, "parametrizations"):
        return linear.parametrizations.weight.original
    return linear.weight


def _weight_maps(linear: nn.Linear) -> nn.ModuleList:
    return nn.ModuleList(linear.parametrizations.weight if hasattr(linear, "parametrizations")
                         else [])


def _mapped(w_t: Tensor, maps: nn.ModuleList) -> Tensor:
    """Apply each model's parametrisations (which act on W, (d_k, d_model)) to its slice of the
    stacked W^T (M, d_model, d_k); ``w_t`` itself when no model has any."""
    if all(len(chain) == 0 for chain in maps):
        return w_t
    out = list(w_t.unbind(0))  # one backward for all slices (see StackedRecall.forward)
    for m, chain in enumerate(maps):
        if len(chain):
            w = out[m].mT
            for f in chain:
                w = f(w)
            out[m] = w.mT
    return torch.stack(out)


def _gather_dots(T_q: Tensor, T_k: Tensor, idx: BatchIndex) -> Tensor:
    """q.k_i read off the table of every (query token, token) score S = T_Q T_K^T: (M, B, P)."""
    M, B, P2 = idx.tokens.shape
    S = T_q @ T_k.mT                                                         # (M, n_keys, T)
    S_q = S.gather(1, idx.query[..., None].expand(M, B, S.shape[-1]))        # (M, B, T) q's row
    return S_q.gather(-1, idx.tokens).view(M, B, 2, P2 // 2).sum(2) * PAIR_NORM


def _weights(mechanism: Mechanism, z: Tensor) -> Tensor:
    """The attention weights (B, P) of logits z (B, P; 2P for the differential normaliser) by
    the mechanism's normaliser (the pipeline's)."""
    sink = mechanism.sink_logits() if mechanism.normaliser == "sink" else None
    lam = mechanism.lam() if mechanism.normaliser == "differential" else None
    return normalise(z[:, None, None, :], mechanism.normaliser, sink, lam)[:, 0, 0, :]


def _row_logits(mechanism: Mechanism, T_q: Tensor, T_k: Tensor, query: Tensor,
                tokens: Tensor) -> Tensor:
    """Logits (B, P) on each sequence's own query and key vectors, O(B P d_k): for a mechanism
    that reads the whole row (not ``per_key``), or when the pair table would be larger."""
    B, P2 = tokens.shape
    q = T_q[query]                                                           # (B, d_k)
    k = T_k[tokens].view(B, 2, P2 // 2, -1).sum(1) * PAIR_NORM               # (B, P, d_k)
    return mechanism.logits(q[:, None, None, :], k[:, None])[:, 0, 0, :]


def _temper(mechanism: Mechanism, T_q: Tensor, T_k: Tensor, dots: Tensor, n_keys: int) -> Tensor:
    """A bilinear mechanism's logits from the plain dot products: ``cap(scale * q.k)``.

    The mechanism's ``prepare`` is called on its tables only to read the scale (it returns q and k
    unchanged, see :func:`_is_bilinear`); the pipeline's own step (:func:`attnscale.pipeline.temper`)
    turns the precomputed q.k into logits.
    """
    _, _, scale = mechanism.prepare(T_q[None, None], T_k[None, None], n_keys)
    if isinstance(scale, Tensor):
        scale = scale.reshape(())  # one head: (1, 1, 1) -> ()
    offset = mechanism.offset(n_keys) if mechanism.has_offset else 0.0
    return temper(dots, scale, mechanism.cap, offset)                        # (B, P)


def _pair_logits(mechanism: Mechanism, T_q: Tensor, T_k: Tensor, query: Tensor, pairs: Tensor,
                 n_keys: int, n_attended: int) -> Tensor:
    """Any mechanism's logits (B, P) via the table of every (query token, pair) combination.

    A pair's key vector depends only on its two tokens, so there are n_keys x n_values distinct
    k vectors (1024 at the defaults, fewer than the B P = 1536 of a batch).  The mechanism runs
    once on all of them against the n_keys possible queries, and each sequence gathers its own
    entries.  Exact because every mechanism's logit for (q, k_i) depends only on q, k_i and the
    number of keys attended, passed as ``n_attended``.
    """
    d_k = T_k.shape[-1]
    K = (T_k[:n_keys, None, :] + T_k[None, n_keys:, :]) * PAIR_NORM          # (n_keys, n_values, d_k)
    Z = mechanism.logits(T_q[None, None], K.reshape(1, 1, -1, d_k), n_attended)[0, 0]
    # Z: (n_keys, maps * n_keys * n_values), the logit of every query token against every pair,
    # one map (two for the differential normaliser, side by side)
    maps = Z.shape[1] // K.shape[0] // K.shape[1]
    return torch.cat([Zm.flatten()[query[:, None] * Zm.shape[1] + pairs]
                      for Zm in Z.chunk(maps, dim=1)], dim=-1)              # (B, P or 2P)
