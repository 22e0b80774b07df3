"""Facts about Hugging Face attention families: one table, read by every part that needs one.

attnscale serves a Hugging Face model layer by layer.  What it must know about a layer before any
forward pass -- where its W_Q, W_K and W_V are, how many heads they hold, which norm follows them,
what sets its softmax temperature -- is a *family fact*, kept in one table
(:data:`FAMILIES`, :mod:`attnscale.families.table`) keyed by the ``model_type`` of the config the
layer holds, as peft keeps its per-model-type target-module tables.  The ``"attnscale"`` attention
function (:mod:`attnscale.hf`), :func:`attnscale.hf.set_mechanism`, the ``clip-qkv`` hooks and
QK-Clip (:mod:`attnscale.guard.clip`) all read it; none guesses attribute names.  A family missing
from the table still runs on ``attn_implementation="attnscale"`` and is monitored (those need only
the tensors its attention calls carry); swapping its temperature and clipping it are refused,
naming the family.  This package imports neither transformers nor any other attnscale subsystem,
so the guard (which :mod:`attnscale.hf` builds on) can read it too.

Public API
----------
``facts(layer_or_model)``
    :class:`LayerFacts` of one attention layer, or ``{qualified name: LayerFacts}`` of every
    attention layer of a model.  Fields: ``family``, ``layer`` (class), ``layout``, ``n_heads``,
    ``n_kv_heads``, ``d_head``, ``d_value`` (read off the projections, before any forward);
    ``scaling`` (the softmax scale the layer passes) and ``scaling_rule`` (``"d^-1/2"``, Gemma's
    ``"query_pre_attn_scalar^-1/2"``, T5's ``"1 (in the initialisation)"``, latent attention's
    YaRN rule) with ``mscale`` (YaRN's mscale, scaling = mscale² / √d, latent attention);
    ``softcap``; ``sinks``; ``sliding_window``; ``position_bias`` (``"t5-relative"``,
    ``"alibi"`` or None); ``qk_norm_over`` (``"none"``, ``"head"``: one norm over each head's d
    channels, Qwen3 and Gemma 3; ``"model"``: one over all H · d channels before the head split,
    OLMo 2) with ``qk_norm`` (a :class:`QKNorm`: kind, gain, and ``.mechanism``, the registry
    mechanism it corresponds to, e.g. ``("qk-rmsnorm", {"over": "head"})``);
    ``temperature_tuning`` (Llama 4's, on its NoPE layers); ``mask``; ``calls`` (attention calls
    per forward: DiffLlama's two, on the same q and k); ``normaliser`` (``"differential"`` for
    DiffLlama's head pairs); ``refusal`` / ``clip_refusal`` (why set_mechanism / QK-Clip
    cannot serve the layer, or None).
``is_attention_layer(module)``
    Whether a module's forward dispatches through transformers' AttentionInterface.
``family_of(layer)`` / ``family_name(layer)``
    The table row (:class:`Family`) of an attention layer / its family name; ``family_of`` raises
    a one-line :class:`~attnscale.errors.ConfigError` for a family not in the table.
``bypassing_layers(model)``
    ``(qualified name, class)`` of the attention layers of ``model`` that the table knows form
    their softmax themselves (GIT's text attention...): a swap or clip of the rest would be
    partial, so both are refused.
``max_positions(config)``
    The longest sequence a model can place: ``max_position_embeddings``, less the rows a family
    that counts positions from ``pad_token_id + 1`` (RoBERTa, XLM-R) never uses.
``FAMILIES``, ``OWN_ATTENTION``
    The table itself (read-only mapping ``model_type -> Family``), and the classes of attention
    that bypasses the interface (``class name -> family``).
``Heads``, ``ClipTarget``, ``Layout`` and its kinds (``Separate``, ``Fused``, ``Interleaved``,
``Latent``)
    The projection layouts (:mod:`attnscale.families.layouts`): head counts, the q/k/v
    projection modules, and the rows QK-Clip rescales per head.

Example::

    from attnscale.families import facts
    for name, f in facts(model).items():
        print(name, f.family, f.n_heads, f.d_head, f.scaling_rule, f.qk_norm_over)
"""

from __future__ import annotations

from attnscale.families.facts import (
    INTERFACE_NAME, LayerFacts, TemperatureTuning, bypassing_layers, facts, family_name,
    family_of, is_attention_layer,
)
from attnscale.families.layouts import (
    ClipTarget, Fused, Heads, Interleaved, Latent, Layout, Separate,
)
from attnscale.families.table import (
    FAMILIES, MASK_KINDS, OWN_ATTENTION, POSITION_BIASES, QK_NORM_KINDS, QK_NORM_OVER, Family,
    QKNorm, max_positions,
)

__all__ = ["FAMILIES", "INTERFACE_NAME", "MASK_KINDS", "OWN_ATTENTION", "POSITION_BIASES",
           "QK_NORM_KINDS",
           "QK_NORM_OVER", "ClipTarget", "Family", "Fused", "Heads", "Interleaved", "Latent",
           "LayerFacts", "Layout", "QKNorm", "Separate", "TemperatureTuning", "bypassing_layers",
           "facts",
           "family_name", "family_of", "is_attention_layer", "max_positions"]
