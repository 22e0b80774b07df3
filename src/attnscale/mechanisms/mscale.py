"""``mscale``: DeepSeek's softmax scale under YaRN context extension (DeepSeek-V2, arXiv
2405.04434, and DeepSeek-V3, arXiv 2412.19437; HF transformers ``modeling_deepseek_v3.py``,
``yarn_get_mscale``): the softmax scale 1/√d is multiplied by mscale²,

    z = mscale² · qᵀk / √d,   mscale = 0.1 · mscale_all_dim · ln(factor) + 1   (1 for factor <= 1),

and ``mscale_all_dim = 0`` leaves the scale alone, as there.  ``factor`` is the context-extension
ratio (new length / trained length).  This is not YaRN's own temperature rule (``yarn``: m = 0.1
ln(factor) + 1 on q and k, Peng et al. 2023): DeepSeek puts the temperature on the softmax scale
with its own coefficient, and divides the rotary embedding's YaRN multiplier by the same mscale
(the position encoding's part, which attnscale leaves to the model).  DeepSeek-V3 ships
``mscale_all_dim = 1`` (the default here) at factor 40; DeepSeek-V2 ships 0.707.
"""

from __future__ import annotations

from torch import Tensor

from attnscale.errors import ConfigError, check_float
from attnscale.mechanisms.base import Mechanism, Scale, inv_sqrt, register
from attnscale.mechanisms.yarn import DEFAULT_FACTOR, yarn_m

# DeepSeek-V3's rope_scaling.mscale_all_dim (its config.json).
DEEPSEEK_V3_MSCALE_ALL_DIM = 1.0
# DeepSeek-V2's (its config.json: mscale = mscale_all_dim = 0.707).
DEEPSEEK_V2_MSCALE_ALL_DIM = 0.707


def deepseek_mscale(factor: float, mscale_all_dim: float) -> float:
    """DeepSeek's multiplier on the softmax scale, mscale²; 1 when ``mscale_all_dim`` is 0."""
    return 1.0 if mscale_all_dim == 0 else yarn_m(factor, mscale_all_dim) ** 2


@register("mscale")
class MScale(Mechanism):
    """z = mscale² qᵀk / √d, mscale = 0.1 · mscale_all_dim · ln(factor) + 1.
    Source: DeepSeek-V2/V3 (arXiv 2405.04434, 2412.19437; HF modeling_deepseek_v3.py)."""

    def __init__(self, d_head: int, n_heads: int, *, factor: float = DEFAULT_FACTOR,
                 mscale_all_dim: float = DEEPSEEK_V3_MSCALE_ALL_DIM):
        super().__init__(d_head, n_heads)
        self.factor = check_float("factor", factor, positive=True)
        self.mscale_all_dim = check_float("mscale_all_dim", mscale_all_dim)
        if self.mscale_all_dim < 0:
            raise ConfigError(f"mscale_all_dim must be >= 0, got {mscale_all_dim!r}.")

    def prepare(self, q: Tensor, k: Tensor, n_keys: int | Tensor) -> tuple[Tensor, Tensor, Scale]:
        return q, k, deepseek_mscale(self.factor, self.mscale_all_dim) * inv_sqrt(self.d_head)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, factor={self.factor:g}, "
                f"mscale_all_dim={self.mscale_all_dim:g}")
