"""attnscale: measure, compare and swap the mechanisms that set the attention-softmax temperature."""

from __future__ import annotations

__version__ = "0.1.0"

from attnscale.errors import ConfigError  # noqa: E402
from attnscale.stats import (  # noqa: E402
    entropy, jacobian_fro, logit_std, max_weight, row_stats, softmax_stats,
)
from attnscale.measure.montecarlo import saturation, variance  # noqa: E402
from attnscale.report.reproduce import reproduce  # noqa: E402
from attnscale.measure.monitor import monitor  # noqa: E402
from attnscale.guard import guard  # noqa: E402
from attnscale.mechanisms import MECHANISMS, build_mechanism  # noqa: E402
from attnscale.attention import (  # noqa: E402
    AttentionTrace, MultiHeadAttention, attention, attention_reference,
)
from attnscale.measure.gradient import (  # noqa: E402
    gradient_path_sweep, gradient_paths, init_reparam_checks,
)
from attnscale.experiments.recall import RecallConfig, compare, train  # noqa: E402
from attnscale import study  # noqa: E402  (the studies: attnscale.study.launcher.run, ...)

__all__ = [
    "__version__", "ConfigError",
    "entropy", "jacobian_fro", "logit_std", "max_weight", "softmax_stats", "row_stats",
    "saturation", "variance", "reproduce", "monitor", "guard",
    "MECHANISMS", "build_mechanism", "MultiHeadAttention", "attention", "attention_reference",
    "AttentionTrace",
    "gradient_paths", "gradient_path_sweep", "init_reparam_checks",
    "RecallConfig", "train", "compare", "study",
]
