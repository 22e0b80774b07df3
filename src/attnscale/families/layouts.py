"""Where an attention layer's W_Q, W_K and W_V live, per projection layout: the head counts they
hold, the modules whose outputs are q, k and v, and the rows of each tensor that belong to each
head (what QK-Clip rescales).

A layout is named by the family table (:mod:`attnscale.families.table`), never guessed from
attribute names; it reads the attributes the table names, and a layer that lacks one is a table
error (:class:`~attnscale.errors.ConfigError` naming the attribute).

The layouts (their names are the table's ``layout`` values):

* ``separate``: three projections ``q``, ``k``, ``v`` (Linear, or transposed GPT-2 ``Conv1D``)
  whose output rows are heads of ``d`` contiguous features, query head h at rows
  ``h d ... (h + 1) d - 1`` (Llama, BERT's ``query``/``key``/``value``, T5's ``q``/``k``/``v``).
* ``fused``: one projection ``qkv`` whose rows are ``[q (H d); k (Hk d); v (Hk d)]`` (Phi-3's
  ``qkv_proj``, GPT-2's ``c_attn``, ViT-style ``qkv``).
* ``interleaved``: one projection whose rows are ``groups`` blocks, each holding the q, k and v
  features of ``H / groups`` heads in the order ``order`` (GPT-NeoX and Persimmon: one head per
  block, q k v; CodeGen: four blocks, q v k).
* ``latent``: multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434): q from ``q_proj``
  or ``q_b_proj`` (rows per head ``[q_nope (d_nope); q_pe (d_rope)]``), the per-head ``k_nope`` and
  v from ``kv_b_proj`` (rows per head ``[k_nope (d_nope); v (d_v)]``), and one rotary key shared by
  every head from ``kv_a_proj_with_mqa``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnscale.errors import ConfigError

# What the attention function sees of a layer: H query heads, Hk key/value heads (H % Hk == 0),
# q/k head size d and value head size d_v.


@dataclass(frozen=True)
class Heads:
    """A layer's head counts and sizes, as its attention call will see them."""
    n_heads: int     # H, query heads
    n_kv_heads: int  # Hk, key/value heads (grouped-query attention when Hk < H)
    d_head: int      # d, the size of each q and k head
    d_value: int     # d_v, the size of each v head


@dataclass(frozen=True)
class ClipTarget:
    """Rows of one tensor that QK-Clip rescales, head by head.

    ``rows[i]`` is the head (query head on the query side, key head on the key side) that
    feature ``i`` along ``dim`` of ``tensor`` belongs to, or -1 for a feature left alone (the
    value rows of a fused projection, the shared rotary key).  ``power``: ``"side"`` for the
    side's share of the factor (η^α on the query side, η^(1-α) on the key side), ``"full"`` for
    η itself (multi-head latent attention's q_pe, whose key is not rescaled).  A gain written
    ``1 + w`` (Gemma's RMSNorm) has ``offset = 1`` and is scaled as ``w <- c (1 + w) - 1``.
    """
    tensor: Tensor
    dim: int
    rows: Tensor          # int64 (tensor.shape[dim],): head index, or -1
    power: str = "side"
    offset: float = 0.0


def _head_rows(heads: int, d: int, *, start: int = 0, period: int | None = None,
               heads_per_block: int = 1, length: int) -> Tensor:
    """Row -> head map of ``heads`` heads of ``d`` rows: block b (of ``heads_per_block`` heads)
    starts at ``start + b · period``; every other row is -1."""
    rows = torch.full((length,), -1, dtype=torch.int64)
    period = heads_per_block * d if period is None else period
    for h in range(heads):
        first = start + (h // heads_per_block) * period + (h % heads_per_block) * d
        rows[first:first + d] = h
    return rows


def _child(module: nn.Module, attr: str, family: str) -> nn.Module:
    """``module.<attr>`` (a projection the table names), or a ConfigError naming it."""
    child = getattr(module, attr, None)
    if not isinstance(child, nn.Module):
        raise ConfigError(f"{type(module).__name__} ({family}) has no projection {attr!r}, "
                          "which attnscale's family table names for it.")
    return child


def _int_attr(module: nn.Module, attr: str, family: str, minimum: int = 1) -> int:
    value = getattr(module, attr, None)
    if value is None:
        value = getattr(getattr(module, "config", None), attr, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{type(module).__name__} ({family}) has no integer {attr!r}, which "
                          "attnscale's family table names for its heads.")
    return value


def _out_features(proj: nn.Module) -> int:
    """Output features of a Linear, or of a transposed GPT-2 Conv1D (weight (in, out))."""
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ConfigError(f"projection {type(proj).__name__} has no single 2-D weight, so "
                          "attnscale cannot read its heads' rows.")
    return weight.shape[1] if _transposed(proj) else weight.shape[0]


def _transposed(proj: nn.Module) -> bool:
    """GPT-2's Conv1D stores its weight as (in, out); a Linear as (out, in)."""
    return not isinstance(proj, nn.Linear) and hasattr(proj, "nf")


def _projection_targets(proj: nn.Module, rows: Tensor, power: str = "side"
                        ) -> list[ClipTarget]:
    """The weight (and bias) rows of ``proj`` along its output axis."""
    out = [ClipTarget(proj.weight, 1 if _transposed(proj) else 0, rows, power)]
    if getattr(proj, "bias", None) is not None:  # q = W x + b: b scales with its rows
        out.append(ClipTarget(proj.bias, 0, rows, power))
    return out


@dataclass(frozen=True)
class Layout:
    """Base of the layouts: ``head_dim`` names the layer attribute holding d (q/k head size)."""
    name = ""
    head_dim: str = "head_dim"

    def heads(self, module: nn.Module, family: str) -> Heads:
        raise NotImplementedError

    def projections(self, module: nn.Module, family: str) -> dict[str, nn.Module]:
        """``{"q": ..., "k": ..., "v": ...}`` or ``{"qkv": ...}``: the modules whose outputs are
        the layer's q, k and v before any norm or rotation."""
        raise NotImplementedError

    def clip_targets(self, module: nn.Module, family: str
                     ) -> tuple[list[ClipTarget], list[ClipTarget]]:
        """(query-side, key-side) rows QK-Clip rescales when q and k are linear in them."""
        raise NotImplementedError


@dataclass(frozen=True)
class Separate(Layout):
    """``separate``: projections ``q``, ``k``, ``v``, heads of d contiguous rows each."""
    name = "separate"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    gated: bool = False  # q's rows per head are [q (d); output gate (d)] (Qwen3-Next)

    def heads(self, module: nn.Module, family: str) -> Heads:
        d = _int_attr(module, self.head_dim, family)
        q, k, v = (_out_features(_child(module, a, family)) for a in (self.q, self.k, self.v))
        per_q = 2 * d if self.gated else d
        if q % per_q or k % d or (k // d and v % (k // d)):
            raise ConfigError(f"{type(module).__name__} ({family}): projections of {q}, {k}, {v} "
                              f"features do not split into heads of {self.head_dim} = {d}.")
        return Heads(q // per_q, k // d, d, v // (k // d))

    def projections(self, module: nn.Module, family: str) -> dict[str, nn.Module]:
        if self.gated:
            raise ConfigError(f"{type(module).__name__} ({family}): its {self.q} also holds the "
                              "output gate, which a clamp of q would change too.")
        return {side: _child(module, a, family)
                for side, a in (("q", self.q), ("k", self.k), ("v", self.v))}

    def clip_targets(self, module, family):
        heads = self.heads(module, family)
        d, sides = heads.d_head, []
        for attr, n, period in ((self.q, heads.n_heads, 2 * d if self.gated else d),
                                (self.k, heads.n_kv_heads, d)):
            proj = _child(module, attr, family)
            rows = _head_rows(n, d, period=period, length=_out_features(proj))
            sides.append(_projection_targets(proj, rows))
        return sides[0], sides[1]


@dataclass(frozen=True)
class Fused(Layout):
    """``fused``: one projection ``qkv`` with rows ``[q (H d); k (Hk d); v (Hk d_v)]``; H is
    the layer attribute ``n_heads`` (Hk = H unless ``n_kv_heads`` is named)."""
    name = "fused"
    qkv: str = "qkv"
    n_heads: str = "num_heads"
    n_kv_heads: str | None = None

    def heads(self, module: nn.Module, family: str) -> Heads:
        d = _int_attr(module, self.head_dim, family)
        h = _int_attr(module, self.n_heads, family)
        hk = h if self.n_kv_heads is None else _int_attr(module, self.n_kv_heads, family)
        out = _out_features(_child(module, self.qkv, family))
        d_v, rest = divmod(out - (h + hk) * d, hk) if out > (h + hk) * d else (0, 1)
        if rest or not d_v:
            raise ConfigError(f"{type(module).__name__} ({family}): a fused projection of {out} "
                              f"features does not hold {h} query and {hk} key heads of {d}.")
        return Heads(h, hk, d, d_v)

    def projections(self, module: nn.Module, family: str) -> dict[str, nn.Module]:
        return {"qkv": _child(module, self.qkv, family)}

    def clip_targets(self, module, family):
        heads = self.heads(module, family)
        proj = _child(module, self.qkv, family)
        n, d = _out_features(proj), heads.d_head
        q = _head_rows(heads.n_heads, d, length=n)
        k = _head_rows(heads.n_kv_heads, d, start=heads.n_heads * d, length=n)
        return _projection_targets(proj, q), _projection_targets(proj, k)


@dataclass(frozen=True)
class Interleaved(Layout):
    """``interleaved``: one projection ``qkv`` of ``groups`` blocks (``None``: one per head), each
    the q, k and v features of its heads in the order ``order`` (H = ``n_heads``, or read off
    the projection as rows / 3d when one block per head)."""
    name = "interleaved"
    qkv: str = "query_key_value"
    n_heads: str | None = None
    groups: int | None = None
    order: str = "qkv"

    def heads(self, module: nn.Module, family: str) -> Heads:
        d = _int_attr(module, self.head_dim, family)
        out = _out_features(_child(module, self.qkv, family))
        h = out // (3 * d) if self.n_heads is None else _int_attr(module, self.n_heads, family)
        if out != 3 * h * d or (self.groups and h % self.groups):
            raise ConfigError(f"{type(module).__name__} ({family}): an interleaved projection of "
                              f"{out} features does not hold {h} heads of q, k and v of {d}.")
        return Heads(h, h, d, d)

    def projections(self, module: nn.Module, family: str) -> dict[str, nn.Module]:
        return {"qkv": _child(module, self.qkv, family)}

    def clip_targets(self, module, family):
        heads = self.heads(module, family)
        proj = _child(module, self.qkv, family)
        h, d = heads.n_heads, heads.d_head
        per_block = h // (self.groups or h)
        period = 3 * per_block * d
        sides = []
        for side in "qk":
            rows = _head_rows(h, d, start=self.order.index(side) * per_block * d, period=period,
                              heads_per_block=per_block, length=_out_features(proj))
            sides.append(_projection_targets(proj, rows))
        return sides[0], sides[1]


@dataclass(frozen=True)
class Latent(Layout):
    """``latent``: multi-head latent attention (see the module doc); d = ``qk_head_dim``."""
    name = "latent"
    head_dim: str = "qk_head_dim"

    def _q(self, module: nn.Module, family: str) -> nn.Module:
        proj = getattr(module, "q_b_proj", None)
        if proj is None:  # without a query LoRA (q_lora_rank None), q comes from q_proj
            proj = getattr(module, "q_proj", None)
        if not isinstance(proj, nn.Module):
            raise ConfigError(f"{type(module).__name__} ({family}) has neither q_b_proj nor "
                              "q_proj, which multi-head latent attention needs.")
        return proj

    def _sizes(self, module: nn.Module, family: str) -> tuple[int, int, int]:
        # a latent attention without RoPE has qk_rope_head_dim = 0 (GLM-5-Next)
        return tuple(_int_attr(module, a, family, minimum=0 if a == "qk_rope_head_dim" else 1)
                     for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))

    def heads(self, module: nn.Module, family: str) -> Heads:
        d = _int_attr(module, self.head_dim, family)
        nope, rope, d_v = self._sizes(module, family)
        h = _out_features(self._q(module, family)) // d
        kv = _out_features(_child(module, "kv_b_proj", family))
        if nope + rope != d or kv != h * (nope + d_v):
            raise ConfigError(f"{type(module).__name__} ({family}): q of {d} per head and "
                              f"kv_b_proj of {kv} features do not fit {h} latent-attention "
                              "heads.")
        return Heads(h, h, d, d_v)

    def projections(self, module: nn.Module, family: str) -> dict[str, nn.Module]:
        raise ConfigError(f"{type(module).__name__} ({family}) is multi-head latent attention: "
                          "its k and v come out of one latent projection (kv_b_proj) after a "
                          "norm, so there are no q, k and v projection outputs to act on.")

    def clip_targets(self, module, family):
        # Megatron Core's rule (SelfAttention.clip_qk for MLA): per head, q_nope by η^α, q_pe by
        # η (its key is shared by every head and left alone), k_nope by η^(1-α); every logit
        # q_nope·k_nope + q_pe·k_pe is then multiplied by η.
        heads = self.heads(module, family)
        nope, rope, d_v = self._sizes(module, family)
        q_proj, kv_b = self._q(module, family), _child(module, "kv_b_proj", family)
        n_q, n_kv = _out_features(q_proj), _out_features(kv_b)
        h, d = heads.n_heads, heads.d_head
        q_nope = _head_rows(h, nope, period=d, length=n_q)
        q_pe = _head_rows(h, rope, start=nope, period=d, length=n_q)
        k_nope = _head_rows(h, nope, period=nope + d_v, length=n_kv)
        return (_projection_targets(q_proj, q_nope) + _projection_targets(q_proj, q_pe, "full"),
                _projection_targets(kv_b, k_nope))


def targets_of(targets: list[ClipTarget]) -> Iterator[Tensor]:
    """The tensors of ``targets`` (each once), for checks on them (parametrisations...)."""
    seen = set()
    for t in targets:
        if id(t.tensor) not in seen:
            seen.add(id(t.tensor))
            yield t.tensor
