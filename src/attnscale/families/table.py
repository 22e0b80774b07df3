"""The family table: what attnscale knows about each Hugging Face attention family, in one place.

A *family* is the ``model_type`` of the config an attention layer holds (``layer.config``): a
composite model is served layer by layer (Qwen2-VL's text layers are ``qwen2_vl_text``, its vision
layers ``qwen2_vl_vision``; CLIP's towers ``clip_text_model`` and ``clip_vision_model``).  Where one
family holds attention layers of different classes with different facts, ``by_class`` gives the
other classes' rows.

The table is checked against the models themselves by the family sweep in the test suite
(``tests/test_hf_families.py``): for every family transformers can build tiny from its config, the
head counts a row's layout reads equal those the layer hands its attention function, the q/k norm
it names has the shape its ``over`` says, and the clip it allows bounds the logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from attnscale.families.layouts import Fused, Interleaved, Latent, Layout, Separate

# The q/k normalisations a family applies after its projections (QKNorm.over).
QK_NORM_OVER = ("head", "model")
# Their kinds (QKNorm.kind): RMSNorm, LayerNorm, or an RMSNorm without a gain ("l2", Llama 4).
QK_NORM_KINDS = ("rmsnorm", "layernorm", "l2")
# Additive logit biases a family adds to q kᵀ (Family.position_bias): T5's bucketed relative
# position bias (Raffel et al. 2020, arXiv 1910.10683); ALiBi (Press et al. 2022, arXiv 2108.12409).
POSITION_BIASES = ("t5-relative", "alibi")
# How the family treats the mask its attention function receives (Family.mask): "boolean" (the
# mask function's own, True = attend), or "additive" for a model that edits its mask assuming
# eager's float one (it concatenates 0/-inf blocks onto it): it gets eager's float mask.
MASK_KINDS = ("boolean", "additive")


@dataclass(frozen=True)
class QKNorm:
    """A norm the family applies to q and k after the projections (before RoPE).

    ``over="head"``: one norm over each head's d channels, its gain (d,) shared by every head
    (Qwen3, Gemma 3); ``over="model"``: one norm over all H · d channels of q (and Hk · d of k)
    before the head split (OLMo 2), its gain per head and channel.  ``gain``: ``"w"`` (x · w),
    ``"1+w"`` (Gemma's x · (1 + w)) or None (no gain: Llama 4's L2 norm).
    """
    over: str = "head"
    kind: str = "rmsnorm"
    gain: str | None = "w"
    q: str = "q_norm"   # attribute of the layer holding the query norm
    k: str = "k_norm"   # ... and the key norm

    @property
    def mechanism(self) -> tuple[str, dict]:
        """The registry mechanism this norm corresponds to, with its options: ``("qk-rmsnorm",
        {"over": "head"})``...  (The registry's norm acts on rotated q and k under
        :func:`attnscale.hf.set_mechanism`, the family's before RoPE.)"""
        name = "qk-layernorm" if self.kind == "layernorm" else "qk-rmsnorm"
        return name, {"over": self.over}


@dataclass(frozen=True)
class Family:
    """One row of the table (see the module doc).  Every field has the plain Llama value as its
    default, so a row says only how its family differs."""
    layout: Layout | None                # where W_Q, W_K, W_V live; None: attnscale cannot tell
    qk_norm: QKNorm | None = None        # the family's q/k norm, if any
    scaling: str = "d^-1/2"              # the rule behind the scale the layer passes (facts doc)
    softcap: str | None = None           # config attribute of the logit soft-cap it passes
    sinks: str | None = None             # layer attribute of its learned per-head sink logits
    window: str | None = "sliding_window"  # layer attribute of its sliding window (None: none)
    position_bias: str | None = None     # one of POSITION_BIASES, or None
    mask: str = "boolean"                # one of MASK_KINDS
    temperature_tuning: bool = False     # Llama 4's query scaling on its NoPE layers
    calls: int = 1                       # attention calls per forward (DiffLlama: 2)
    refusal: str | None = None           # why set_mechanism and the clip cannot serve it
    clip_refusal: str | None = None      # why only QK-Clip cannot
    by_class: Mapping[str, Family] = field(default_factory=dict)  # other classes' rows

    def with_(self, **changes) -> Family:
        return replace(self, **changes)


# -- the layouts the rows use -------------------------------------------------------------------
LLAMA = Family(Separate())                                                 # q_proj, k_proj, v_proj
BERT = Family(Separate("attention_head_size", "query", "key", "value"))    # query, key, value
T5 = Family(Separate("key_value_proj_dim", "q", "k", "v"), position_bias="t5-relative",
            scaling="1 (in the initialisation)")
VISION_QKV = Family(Fused())                                               # qkv: [q; k; v]
YARN_SCALING = "d^-1/2 mscale^2 (YaRN's attention factor; 1 without YaRN)"
MLA = Family(Latent(), scaling=YARN_SCALING)                               # latent attention
PER_HEAD = QKNorm("head")
OVER_MODEL = QKNorm("model")
GEMMA_NORM = QKNorm("head", gain="1+w")
GEMMA_SCALING = "query_pre_attn_scalar^-1/2"


def _rows(row: Family, *families: str) -> dict[str, Family]:
    return dict.fromkeys(families, row)


_TABLE: dict[str, Family] = {
    # Separate q_proj / k_proj / v_proj, heads of head_dim rows: the Llama layout.
    **_rows(LLAMA,
            "aimv2_text_model", "aimv2_vision_model", "altclip_vision_model", "arcee",
            "aria_text", "audioflamingo3_encoder", "bart", "bigbird_pegasus", "biogpt", "bitnet",
            "blenderbot", "blenderbot-small", "blt_global_transformer", "blt_local_decoder",
            "blt_local_encoder", "blt_patcher", "chinese_clip_vision_model", "clip_text_model",
            "clip_vision_model", "clipseg_text_model", "clipseg_vision_model", "cohere",
            "cohere2", "cohere2_moe", "cwm", "dia_decoder", "dia_encoder", "ernie4_5",
            "ernie4_5_moe", "evolla", "exaone", "gemma", "git_vision_model", "glm4_moe",
            "glm4v_moe_text", "glm4v_text", "glm_ocr_text", "glmasr_encoder", "gptj", "granite",
            "granitemoe", "granitemoeshared", "gte", "helium", "hrm_text", "hyperclovax",
            "idefics", "idefics2_perceiver", "idefics2_vision", "idefics3_vision",
            "idefics_vision", "inkling2_vision", "internlm3", "internvl_vision", "iquestcoder",
            "jais2", "janus_vision_model", "jina_embeddings_v3", "kimi_k25_vision",
            "kosmos_2_5_text_model", "kosmos_2_text_model", "kosmos_2_vision_model",
            "llama", "llama4_vision_model", "m2m_100", "mbart", "metaclip_2_text_model",
            "metaclip_2_vision_model", "mimo_v2_flash", "minicpm_ocr_vision",
            "minicpmv4_6_vision", "minicpmv4_7_vision", "minimax", "minimax_m3_vl_vision",
            "ministral3", "mistral", "mixtral", "moshi", "moss_transcribe_diarize_audio",
            "muse_glimmer_text", "muse_glimmer_vision", "muse_spark_text", "nemotron_h",
            "nllb-moe", "nomic_bert", "olmo", "omniasr_audio", "opt", "ovis2_vision",
            "owlv2_text_model", "owlv2_vision_model", "owlvit_text_model",
            "owlvit_vision_model", "paddleocr_vl_text", "paddleocr_vl_vision", "pegasus",
            "pegasus_x", "phi", "phimoe", "pixtral", "plbart", "qianfan_ocr_vision", "qwen2",
            "qwen2_5_omni_audio_encoder", "qwen2_5_omni_text", "qwen2_5_vl_text",
            "qwen2_audio_encoder", "qwen2_moe", "qwen2_vl_text", "qwen3_asr_encoder",
            "qwen3_omni_moe_audio_encoder", "seamless_m4t", "seamless_m4t_v2", "seed_oss",
            "siglip2_text_model", "siglip2_vision_model", "siglip_text_model",
            "siglip_vision_model", "smolvlm_vision", "solar_open", "stablelm", "starcoder2",
            "step3p5_vision", "tipsv2_text_model", "tipsv2_vision_model", "ultrabert",
            "unlimited_ocr_text", "unlimited_ocr_vision_encoder", "video_llama_3_vision",
            "vit", "voxtral_encoder", "voxtral_realtime_encoder", "voxtral_realtime_text",
            "xclip", "xclip_text_model", "xclip_vision_model", "zamba2"),
    # ... with a per-head q/k RMSNorm whose gain every head shares (Qwen3).
    **_rows(LLAMA.with_(qk_norm=PER_HEAD),
            "afmoe", "apertus", "apertus1p5_text", "beam", "doge", "embedding_gemma2_text",
            "exaone4", "exaone_moe", "gemma4_text", "gemma4_unified_text", "hy_v3",
            "inkling_text", "kolibri1", "laguna", "lara_mini", "mellum", "molmo2_text",
            "qwen3", "qwen3_moe", "qwen3_omni_moe_text", "qwen3_vl_moe_text", "qwen3_vl_text",
            "sarvam_moe"),
    **_rows(LLAMA.with_(qk_norm=GEMMA_NORM),  # Qwen3-Next's and Qwen3.5's RMSNorm is Gemma's
            "minimax_m3_vl_text", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "step3p5"),
    # ... with one q/k RMSNorm over all heads' channels before the split (OLMo 2).
    **_rows(LLAMA.with_(qk_norm=OVER_MODEL), "minimax_m2", "olmo2", "olmo3", "olmoe"),
    "lfm2": LLAMA.with_(qk_norm=QKNorm("head", q="q_layernorm", k="k_layernorm")),
    "dory": LLAMA.with_(qk_norm=QKNorm("head", kind="l2", gain=None)),
    "nanochat": LLAMA.with_(qk_norm=QKNorm("head", gain=None)),
    "flint": LLAMA.with_(qk_norm=PER_HEAD, sinks="sinks"),
    "gpt_oss": LLAMA.with_(sinks="sinks"),
    **_rows(LLAMA.with_(sinks="sinks"), "granite_swa", "granitemoe_swa"),
    "gemma2": LLAMA.with_(scaling=GEMMA_SCALING, softcap="attn_logit_softcapping"),
    "vaultgemma": LLAMA.with_(scaling=GEMMA_SCALING, softcap="attn_logit_softcapping"),
    "gemma3_text": LLAMA.with_(scaling=GEMMA_SCALING, qk_norm=GEMMA_NORM),
    **_rows(LLAMA.with_(scaling=GEMMA_SCALING, qk_norm=GEMMA_NORM),
            "t5gemma2_decoder", "t5gemma2_text"),
    "t5_gemma_module": LLAMA.with_(scaling=GEMMA_SCALING, softcap="attn_logit_softcapping"),
    **_rows(LLAMA.with_(softcap="attn_logit_softcapping"),
            "videoprism_text_model", "videoprism_vision_model"),
    # Llama 4: one parameter-free L2 norm (after RoPE) on its RoPE layers, none on the others.
    "llama4_text": LLAMA.with_(qk_norm=QKNorm("head", "l2", None, "qk_norm", "qk_norm"),
                               temperature_tuning=True),
    "diffllama": LLAMA.with_(calls=2),
    # Separate query / key / value, heads of attention_head_size rows: the BERT layout.
    **_rows(BERT,
            "albert", "align_text_model", "altclip_text_model", "bert", "bert-generation",
            "blip_2_qformer", "camembert", "chinese_clip_text_model", "clap_text_model",
            "data2vec-text", "dpr", "electra", "ernie", "instructblip_qformer",
            "instructblipvideo_qformer", "layoutlm", "layoutlmv3", "markuplm", "mobilebert",
            "roberta", "roberta-prelayernorm", "roc_bert", "splinter", "xlm-roberta",
            "xlm-roberta-xl", "xmod"),
    "distilbert": Family(Separate("attention_head_size", "q_lin", "k_lin", "v_lin")),
    "ctrl": Family(Separate("head_dim", "Wq", "Wk", "Wv")),
    "kosmos_2_5_vision_model": Family(Separate("head_dim", "query", "key", "value")),
    "qwen2_5_omni_vision_encoder": Family(Separate("head_dim", "q", "k", "v")),
    # T5: q, k, v without the 1/sqrt(d), a learned relative position bias.
    **_rows(T5, "longt5", "mt5", "switch_transformers", "t5", "udop", "umt5"),
    # One fused projection: [q; k; v] row blocks.
    **_rows(VISION_QKV,
            "blip_2_vision_model", "glm4v_moe_vision", "glm4v_vision",
            "instructblip_vision_model", "instructblipvideo_vision_model", "qwen2_5_vl_vision",
            "qwen2_vl_vision", "qwen3_5_moe_vision", "qwen3_5_vision",
            "qwen3_omni_moe_vision_encoder", "qwen3_vl_moe_vision", "qwen3_vl_vision"),
    "glm_ocr_vision": VISION_QKV.with_(qk_norm=PER_HEAD),
    "gpt2": Family(Fused("head_dim", "c_attn")),
    "gpt_bigcode": Family(Fused("head_dim", "c_attn", n_kv_heads="num_key_value_heads")),
    "codegen": Family(Interleaved("head_dim", "qkv_proj", "num_attention_heads", groups=4,
                                  order="qvk")),
    # GPT-NeoX and Persimmon: q, k, v of each head side by side in one projection.
    "gpt_neox": Family(Interleaved("head_size")),
    "persimmon": Family(Interleaved("head_dim"),
                        qk_norm=QKNorm("head", "layernorm", q="q_layernorm", k="k_layernorm")),
    # Multi-head latent attention.
    **_rows(MLA, "axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
            "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "minicpm3", "mistral4",
            "mistral_large4_text", "sarvam_mla", "youtu"),
}

FAMILIES: Mapping[str, Family] = MappingProxyType(_TABLE)
