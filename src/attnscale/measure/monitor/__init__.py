"""Watch the attention temperature inside a running model: entropy, max weight and logit scale
per layer and head, without materialising the (B, H, N, N) attention matrix.

::

    with attnscale.monitor(model) as mon:
        model(inputs)
    mon.records      # one flat dict per (layer, head)
    mon.to_frame()   # the same as a pandas DataFrame

Where calls are observed (:mod:`~attnscale.measure.monitor.observer`): attnscale's own attention
through the pipeline's observer hook (:func:`attnscale.pipeline.add_observer`), which covers
:class:`~attnscale.attention.MultiHeadAttention`, bare mechanisms and Hugging Face models on
``attn_implementation="attnscale"``; foreign models calling
``torch.nn.functional.scaled_dot_product_attention`` (HF on ``"sdpa"``) through a tap on SDPA.
Every submodule of ``model`` gets a forward pre-hook and an always-called forward hook that keep a
stack of the modules currently running; an observation is attributed to the innermost one that is
not a mechanism, by its qualified name (``model.layers.3.self_attn``).  ``layer`` numbers modules in
the order of their first observation.  A forward pass that reaches neither gives a warning with a
hint (HF ``"eager"`` attention computes its softmax by hand and is not observed).

How statistics are taken (:mod:`~attnscale.measure.monitor.blocks`): row by row over the keys each
query may attend; masked keys are excluded and a query with no key at all is not counted.  The
logits are the ones after the mechanism (scale, normalisation, soft-cap) and before the mask; an
additive float mask's finite entries (ALiBi, relative position biases) are part of the logits,
entries at or below :data:`MASKED_BIAS` mark masked keys.  Dropout is not applied: the statistics
describe the distribution dropout samples from.  Everything is computed in float32 or better under
``torch.no_grad()`` from detached tensors, ``block`` queries at a time, so the model's outputs are
bit for bit the same as without the monitor and the extra memory is O(B·H·block·N).

A forward pass may enter the model at its root or at a submodule (a trainer calling
``model.encoder`` directly); ``every`` selects passes wherever they enter.  Gradient
checkpointing's recomputation during backward repeats a pass already observed and is never
observed again (:func:`~attnscale.measure.monitor.observer.recomputing`).  A ``torch.compile``-d
model or submodule is observed as the same model run eagerly: the hooks and observers are graph
breaks (``torch.compiler.disable``), and modules keep their uncompiled names.

Not observed: callers that bound ``scaled_dot_product_attention`` to a local name at import
time.  The pipeline observer is context-local; the SDPA tap is
process-wide but hands each call only to the monitors active in the calling thread's context.

Building on the monitor: its observer contract (:mod:`~attnscale.measure.monitor.observer`) is
a :class:`Watch` that hands each observed call, a :class:`Call`, to one function, with its owner's
choice of forward passes and attention modules, and :class:`Totals` of per-site statistics taken
and cleared per step; :class:`Monitor` and :func:`attnscale.guard` are both built on it.

Figures and summaries: :mod:`~attnscale.measure.monitor.plots`.
"""

from __future__ import annotations

from attnscale.measure.monitor.blocks import DEFAULT_BLOCK, HeadStats, head_stats
from attnscale.measure.monitor.observer import (RECORD_KEYS, SCALAR_KEYS, Call, Monitor, Totals,
                                                Watch, monitor, recomputing)
from attnscale.measure.monitor.plots import colour_limits, layer_summary, plot_entropy
from attnscale.pipeline import MASKED_BIAS

__all__ = ["DEFAULT_BLOCK", "MASKED_BIAS", "RECORD_KEYS", "SCALAR_KEYS", "Call", "HeadStats",
           "Monitor", "Totals", "Watch", "colour_limits", "head_stats", "layer_summary", "monitor",
           "plot_entropy", "recomputing"]
