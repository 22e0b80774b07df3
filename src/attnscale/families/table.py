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
    scaling_attr: str | None = "scaling"  # layer attribute of the scale it passes (None: 1)
    softcap: str | None = None           # config attribute of the logit soft-cap it passes
    sinks: str | None = None             # layer attribute of its learned per-head sink logits
    window: str | None = "sliding_window"  # layer attribute of its sliding window (None: none)
    position_bias: str | None = None     # one of POSITION_BIASES, or None
    mask: str = "boolean"                # one of MASK_KINDS
    temperature_tuning: bool = False     # Llama 4's query scaling on its NoPE layers
    calls: int = 1                       # attention calls per forward (DiffLlama: 2)
    # How its heads' maps become the output, as attnscale.stats.NORMALISERS names it:
    # "differential" for DiffLlama (two calls on the same q and k, the outputs of head pairs
    # subtracted with a learned λ, Ye et al. 2024, arXiv 2410.05258).
    normaliser: str = "softmax"
    positions_after: str | None = None   # config attribute p: learned positions count from p + 1
    own_attention: tuple[str, ...] = ()  # classes of its attention that bypass the interface
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
            "aria_text", "audioflamingo3_encoder", "bart", "biogpt", "bitnet",
            "blenderbot", "blenderbot-small", "blt_global_transformer", "blt_local_decoder",
            "blt_local_encoder", "blt_patcher", "chinese_clip_vision_model", "clip_text_model",
            "clip_vision_model", "clipseg_text_model", "clipseg_vision_model", "cohere",
            "cohere2", "cohere2_moe", "cwm", "dia_decoder", "dia_encoder", "ernie4_5",
            "ernie4_5_moe", "exaone", "gemma", "git_vision_model", "glm4_moe",
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
            "muse_glimmer_vision", "nemotron_h",
            "nllb-moe", "nomic_bert", "olmo", "omniasr_audio", "opt", "ovis2_vision",
            "owlv2_text_model", "owlv2_vision_model", "owlvit_text_model",
            "owlvit_vision_model", "paddleocr_vl_text", "paddleocr_vl_vision", "pegasus",
            "pegasus_x", "phi", "phimoe", "pixtral", "plbart", "qianfan_ocr_vision", "qwen2",
            "qwen2_5_omni_audio_encoder", "qwen2_5_omni_text", "qwen2_5_vl_text",
            "qwen2_audio_encoder", "qwen2_moe", "qwen2_vl_text", "qwen3_asr_encoder",
            "qwen3_omni_moe_audio_encoder", "seed_oss",
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
    **_rows(LLAMA.with_(qk_norm=GEMMA_NORM), "minimax_m3_vl_text", "step3p5"),
    # Qwen3-Next and Qwen3.5: gated attention (q_proj holds each head's q and output gate) and
    # Gemma's (1 + w) RMSNorm on q and k.
    **_rows(Family(Separate(gated=True), qk_norm=GEMMA_NORM),
            "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next"),
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
    "diffllama": LLAMA.with_(calls=2, normaliser="differential"),
    **_rows(LLAMA,
            "canary_decoder", "cosmos3_edge_text", "cosmos3_edge_vision",
            "csm_depth_decoder_model", "emu3_text_model", "eurobert", "glm", "glm4",
            "granite_docling_text", "higgs_audio_v2", "hy_v4_vl_vision", "marian",
            "ministral", "mllama_text_model", "mllama_vision_model", "modernbert-decoder",
            "phi4_multimodal_audio", "phi4_multimodal_vision", "smollm3"),
    "granite4_vision_text": LLAMA.with_(scaling="attention_multiplier (granite)"),
    **_rows(LLAMA.with_(qk_norm=OVER_MODEL), "flex_olmo", "olmo_hybrid"),
    **_rows(LLAMA.with_(qk_norm=PER_HEAD), "lfm3", "lfm3_vl_vision"),
    **_rows(LLAMA.with_(qk_norm=QKNorm("head", q="query_layernorm", k="key_layernorm")),
            "hunyuan_v1_dense", "hunyuan_v1_moe"),
    # Muse: one RMSNorm without a gain on q and k, q then times qk_scale_factor.
    **_rows(LLAMA.with_(qk_norm=QKNorm("head", "rmsnorm", None, "qk_norm", "qk_norm")),
            "muse_glimmer_text", "muse_spark_text"),
    # The privacy filter scales q and k by d^-1/4 each before the call, which passes 1.
    "openai_privacy_filter": LLAMA.with_(sinks="sinks", scaling="d^-1/4 on q and on k",
                                         scaling_attr=None),
    "modernbert": Family(Fused("head_dim", "Wqkv", "num_attention_heads")),
    **_rows(Family(Fused("head_dim", "qkv_proj", "num_attention_heads", "num_key_value_heads")),
            "phi3", "phi4_multimodal"),
    "glm5_next_vision": VISION_QKV.with_(qk_norm=PER_HEAD),
    # SeamlessM4T: BART-style text layers, and a conformer speech encoder whose layers name
    # their projections linear_q, linear_k, linear_v and their head size head_size.
    **_rows(LLAMA.with_(by_class={"SeamlessM4TConformerSelfAttention": Family(
                Separate("head_size", "linear_q", "linear_k", "linear_v")),
                                  "SeamlessM4Tv2ConformerSelfAttention": Family(
                Separate("head_size", "linear_q", "linear_k", "linear_v"))}),
            "seamless_m4t", "seamless_m4t_v2"),
    # Refused: attnscale cannot place their W_Q, W_K rows per head.
    "jetmoe": Family(None, refusal="JetMoE's queries come from a mixture of attention experts "
                                   "(JetMoeMoA), not one projection with rows per head."),
    "zaya": Family(None, refusal="ZAYA's q and k come from a convolutional projection "
                                 "(ZayaCCAProjection) that mixes positions, not rows per head."),
    "florence_vision": Family(None, refusal="Florence-2's vision attention keeps no head size, "
                                            "and its channel attention attends over channels."),
    # DeepSeek-V4: one shared key-value head (K = V) after a gained RMSNorm, q normalised per
    # head without a gain, learned sinks; it concatenates 0/-inf blocks onto eager's float mask.
    "deepseek_v4": Family(Separate("head_dim", "q_b_proj", "kv_proj", "kv_proj"),
                          sinks="sinks", mask="additive",
                          clip_refusal="DeepSeek-V4 normalises q without a gain and reads its "
                                       "key as its value (K = V), so no rescaling of its "
                                       "weights bounds its logits and leaves its values be."),
    # Models whose other attention forms its softmax itself, adding the mask as eager's float
    # one: that mask stays eager's, and a swap or clip of the interface layers alone is refused.
    "bigbird_pegasus": LLAMA.with_(
        mask="additive", own_attention=("BigBirdPegasusSelfAttention",),
        refusal="BigBirdPegasus's encoder attention (BigBirdPegasusSelfAttention) forms its "
                "softmax itself, not through the AttentionInterface, so it would keep its "
                "native temperature."),
    "evolla": LLAMA.with_(
        own_attention=("EvollaSequenceCompressorAttention",),
        refusal="Evolla's sequence compressor (EvollaSequenceCompressorAttention) forms its "
                "softmax itself, not through the AttentionInterface, so it would keep its "
                "native temperature."),
    "deepseek_vl_hybrid": Family(None, own_attention=("SamVisionAttention",),
                                 refusal="its SAM vision encoder (SamVisionAttention) forms its "
                                         "softmax itself, not through the AttentionInterface."),
    **_rows(Family(None, own_attention=("GraniteSpeechConformerAttention",
                                        "GraniteSpeechPlusConformerAttention"),
                   refusal="its speech encoder's conformer attention forms its softmax itself, "
                           "not through the AttentionInterface."),
            "granite_speech", "granite_speech_plus"),
    "got_ocr2": Family(None, own_attention=("GotOcr2VisionAttention",),
                       refusal="its vision encoder (GotOcr2VisionAttention) forms its softmax "
                               "itself, not through the AttentionInterface."),
    "git": Family(None, mask="additive", own_attention=("GitSelfAttention",),
                  refusal="GIT's text attention (GitSelfAttention) forms its softmax itself, not "
                          "through the AttentionInterface, so it would keep its native "
                          "temperature."),
    # Separate query / key / value, heads of attention_head_size rows: the BERT layout.
    **_rows(BERT,
            "albert", "align_text_model", "bert", "bert-generation", "blip_2_qformer",
            "chinese_clip_text_model", "dpr", "electra", "ernie", "instructblip_qformer",
            "instructblipvideo_qformer", "layoutlm", "mobilebert", "roc_bert", "splinter"),
    # ... counting learned positions from pad_token_id + 1 (RoBERTa's
    # create_position_ids_from_input_ids, HF modeling_roberta.py), so the first pad_token_id + 1
    # rows of the position table are never a position.
    **_rows(BERT.with_(positions_after="pad_token_id"),
            "altclip_text_model", "bridgetower_text_model", "camembert", "clap_text_model",
            "data2vec-text", "esm", "layoutlmv3", "markuplm", "roberta", "roberta-prelayernorm",
            "xlm-roberta", "xlm-roberta-xl", "xmod"),
    "distilbert": Family(Separate("attention_head_size", "q_lin", "k_lin", "v_lin")),
    "ctrl": Family(Separate("head_dim", "Wq", "Wk", "Wv")),
    "kosmos_2_5_vision_model": Family(Separate("head_dim", "query", "key", "value")),
    "qwen2_5_omni_vision_encoder": Family(Separate("head_dim", "q", "k", "v")),
    # T5: q, k, v without the 1/sqrt(d), a learned relative position bias.
    **_rows(T5, "mt5", "switch_transformers", "t5", "udop", "umt5"),
    # LongT5's encoder attends locally (or with transient global tokens) in attention of its
    # own; its decoder goes through the interface.
    "longt5": T5.with_(
        own_attention=("LongT5LocalAttention", "LongT5TransientGlobalAttention"),
        refusal="LongT5's encoder attention (LongT5LocalAttention, LongT5TransientGlobalAttention) "
                "forms its softmax itself, not through the AttentionInterface, so it would keep "
                "its native temperature."),
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
    "axk2": Family(None, refusal="AXK2's queries come from one fused query-and-gate projection "
                                 "of two latents (q_gate_proj), which attnscale's latent layout "
                                 "does not place."),
    **_rows(MLA, "axk1", "bailing_hybrid", "kimi_linear", "deepseek_v2", "deepseek_v3",
            "deepseek_v32", "dots3_note_text", "glm4_moe_lite", "glm5_next_text",
            "glm_moe_dsa", "hy_v4", "hy_v4_vl_text", "longcat_flash", "minicpm3", "mistral4",
            "mistral_large4_text", "sarvam_mla", "youtu"),
}

FAMILIES: Mapping[str, Family] = MappingProxyType(_TABLE)
# Attention classes that form their softmax themselves, by class name -> their family: a model
# holding one cannot have its temperature swapped or clipped whole.
OWN_ATTENTION: Mapping[str, str] = MappingProxyType(
    {cls: family for family, row in _TABLE.items() for cls in row.own_attention})


def text_config(config):
    """The config of a model's language part: a composite's text sub-config
    (``get_text_config``), else ``config`` itself."""
    if callable(getattr(config, "get_text_config", None)):
        try:
            return config.get_text_config()
        except ValueError:  # transformers cannot tell which sub-config is the text one
            pass
    return config


def max_positions(config) -> int | None:
    """The longest sequence a model of ``config`` can place: ``max_position_embeddings`` of its
    text config, less the rows its family never uses as positions (``positions_after``: RoBERTa
    counts from pad_token_id + 1, so 514 rows hold 512 positions); None where the config sets
    no limit."""
    text = text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    row = _TABLE.get(getattr(text, "model_type", None) or "")
    if row is not None and row.positions_after is not None:
        start = getattr(text, row.positions_after, None)
        limit -= (start if isinstance(start, int) else 0) + 1
    return limit
