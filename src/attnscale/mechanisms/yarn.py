"""``yarn``: the YaRN attention temperature for context extension (Peng et al. 2023).

YaRN multiplies both q and k by m = 0.1 · ln(factor) + 1 (its "sqrt(1/t)"), so the logits are
m² · qᵀk / √d; ``factor`` is the context-extension ratio (new length / trained length) and m = 1
for factor <= 1, where nothing is extended.

Option ``mscale_all_dim`` (DeepSeek-V3's ``rope_scaling.mscale_all_dim``; HF transformers
``modeling_deepseek_v3.py``, ``yarn_get_mscale`` and ``yarn_apply_mscale``): the softmax scale
itself is multiplied by mscale², mscale = 0.1 · mscale_all_dim · ln(factor) + 1 (1 for
factor <= 1), and a value of 0 leaves the scale alone, as there.  DeepSeek-V3 also divides the
rotary embedding's own multiplier by that mscale, which attnscale leaves to the position encoding
it does not own; so with the option set, the logits are mscale² · qᵀk / √d (DeepSeek-V3 ships
mscale_all_dim = 1, which gives the same m² as the plain option).
"""

from __future__ import annotations

import math

from torch import Tensor

from attnscale.errors import ConfigError, check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register

# Default context-extension ratio: 1 means no extension, where YaRN reduces to ``scaled``.
DEFAULT_FACTOR = 1.0
# m = YARN_SLOPE · ln(factor) + 1 (Peng et al. 2023, eq. 22).
YARN_SLOPE = 0.1


def yarn_m(factor: float, mscale: float = 1.0) -> float:
    """YaRN's per-vector multiplier m = 0.1 · mscale · ln(factor) + 1, and 1 for factor <= 1
    (``mscale`` = 1 in YaRN; DeepSeek-V3's yarn_get_mscale takes it as an argument)."""
    return YARN_SLOPE * mscale * math.log(factor) + 1.0 if factor > 1.0 else 1.0


@register("yarn")
class YaRN(Mechanism):
    """z = m² qᵀk / √d, m = 0.1 ln(factor) + 1 (with ``mscale_all_dim`` = a: m = 0.1 a ln(factor)
    + 1, DeepSeek-V3).  Source: Peng et al. 2023, "YaRN"; DeepSeek-V3 (HF
    modeling_deepseek_v3.py)."""

    def __init__(self, d_head: int, n_heads: int, *, factor: float = DEFAULT_FACTOR,
                 mscale_all_dim: float | None = None):
        super().__init__(d_head, n_heads)
        self.factor = check_float("factor", factor, positive=True)
        self.mscale_all_dim = None
        if mscale_all_dim is not None:
            self.mscale_all_dim = check_float("mscale_all_dim", mscale_all_dim)
            if self.mscale_all_dim < 0:
                raise ConfigError(f"mscale_all_dim must be >= 0, got {mscale_all_dim!r}.")

    def multiplier(self) -> float:
        """The factor on the logits: m², or DeepSeek-V3's mscale² (1 for mscale_all_dim = 0)."""
        if self.mscale_all_dim is None:
            return yarn_m(self.factor) ** 2
        if self.mscale_all_dim == 0:  # DeepSeek-V3: a falsy mscale_all_dim leaves the scale
            return 1.0
        return yarn_m(self.factor, self.mscale_all_dim) ** 2

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, self.multiplier() * inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        extra = "" if self.mscale_all_dim is None else f", mscale_all_dim={self.mscale_all_dim:g}"
        return f"{super().extra_repr()}, factor={self.factor:g}{extra}"
