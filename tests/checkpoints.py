"""Tiny random-weight Hugging Face checkpoints, made with transformers' own config
classes and `save_pretrained`, so tests load exactly what real checkpoints look like.

Each directory holds config.json, safetensors weights, tokenizer.json and a
tokenizer_config.json with a chat template. The weights are random, so outputs are
gibberish, but they are deterministic (fixed seed) and transformers is the oracle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

VOCAB_SIZE = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "tokenwire streams tokens from workers to gateways over ZeroMQ.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "héllo wörld — ünïcode text, emojis 🙂 and numbers 12345.",
]

_BASE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,  # big enough that logits, and so argmax ties, are not all near zero
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}

# name -> (transformers config class name, overrides, save_pretrained kwargs)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama_gqa": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 10000.0}, {}),
    "llama_untied_llama3": (
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {},
    ),
    "llama_linear_mha": (
        "LlamaConfig",
        {
            "num_key_value_heads": 4,
            "head_dim": 24,  # differs from hidden_size // num_heads on purpose
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        {},
    ),
    "qwen2_bias": ("Qwen2Config", {"tie_word_embeddings": False, "rope_theta": 1000000.0}, {}),
    # One KV head: fewer than tensor-parallel ranks, so every rank holds a copy of it.
    "qwen2_mqa": ("Qwen2Config", {"num_key_value_heads": 1, "tie_word_embeddings": True}, {}),
    # bf16 on disk and sharded: exercises the bf16 widening and the safetensors index.
    "mistral_bf16_sharded": (
        "MistralConfig",
        {"tie_word_embeddings": False, "sliding_window": 12},  # short, so tests cross it
        {"max_shard_size": "100KB", "dtype": "bfloat16"},
    ),
}


# The families beyond Llama, Qwen2 and Mistral (worker/models/families), each in shapes
# that exercise its variant: windows shorter than the test prompts, head_dim other than
# hidden / heads, tied and untied heads, scales and caps that change the result.
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "original_max_position_embeddings": 64,
}
FAMILY_CHECKPOINTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen3_head_dim": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False}, {}),
    "qwen3_tied_window": (
        "Qwen3Config",
        {"head_dim": 16, "tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": 6,
         "max_window_layers": 1},
        {},
    ),
    "gemma2_capped": (
        "Gemma2Config",
        {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 3.0,
         "final_logit_softcapping": 4.0, "tie_word_embeddings": True},
        {},
    ),
    "gemma2_untied_mha": (
        "Gemma2Config",
        {"head_dim": 24, "num_key_value_heads": 4, "query_pre_attn_scalar": 24, "sliding_window": 6,
         "tie_word_embeddings": False, "num_hidden_layers": 3},
        {},
    ),
    "gemma3_local_global": (
        "Gemma3TextConfig",
        {"head_dim": 24, "query_pre_attn_scalar": 16, "sliding_window": 6, "num_hidden_layers": 3,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}},
        {},
    ),
    # Mistral-NeMo's shape: head_dim other than hidden / heads, no window.
    "mistral_nemo_head_dim": ("MistralConfig", {"head_dim": 24, "sliding_window": None}, {}),
    # Mistral 7B's layer: a sliding window on every layer, shorter than the prompts.
    "mistral_window": ("MistralConfig", {"sliding_window": 6}, {}),
    "phi3_window": ("Phi3Config", {"sliding_window": 6, "tie_word_embeddings": False}, {}),
    "phi3_longrope": (
        "Phi3Config",
        {"rope_parameters": _LONGROPE, "original_max_position_embeddings": 64, "tie_word_embeddings": True},
        {},
    ),
    # SmolLM3: layers 1 and 3 without RoPE, and (use_sliding_window) those layers slide.
    "smollm3_nope_window": (
        "SmolLM3Config",
        {"num_hidden_layers": 4, "no_rope_layers": [1, 0, 1, 0], "use_sliding_window": True, "sliding_window": 6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False},
        {},
    ),
    # Mixtures of experts: top-1, 2 and 4 of 4 to 8 experts, renormalised or not, a window,
    # and dense MLP layers among the MoE ones.
    "mixtral_top2_window": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6, "tie_word_embeddings": False},
        {},
    ),
    "qwen3_moe_top4_dense_layer": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "num_hidden_layers": 3, "mlp_only_layers": [1], "head_dim": 24, "tie_word_embeddings": False},
        {},
    ),
    # Attention sinks, q/k/v/o biases, local and global layers in turn, YaRN, a biased
    # router picking 2 of 4 experts, clamped SwiGLU experts with biases.
    "gpt_oss_sinks": (
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 6,
         "intermediate_size": 64, "tie_word_embeddings": False},
        {},
    ),
    "qwen3_moe_top1_sparse_step": (
        "Qwen3MoeConfig",
        {"num_experts": 6, "num_experts_per_tok": 1, "moe_intermediate_size": 48, "norm_topk_prob": False,
         "decoder_sparse_step": 2, "tie_word_embeddings": True},
        {},
    ),
}


def build_tokenizer() -> Any:
    """A byte-level BPE trained on a few sentences: complete, tiny, and round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    return tok


def write_tokenizer(directory: Path) -> None:
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
    )


def make_checkpoint(name: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the named tiny checkpoint into `directory` (created) and return it;
    `overrides` change its config (e.g. num_hidden_layers)."""
    import torch
    import transformers

    class_name, settings, save_kwargs = {**CHECKPOINTS, **FAMILY_CHECKPOINTS}[name]
    save_kwargs = dict(save_kwargs)
    config = getattr(transformers, class_name)(**{**_BASE, **settings, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            elif param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    dtype = save_kwargs.pop("dtype", None)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **save_kwargs)
    write_tokenizer(directory)
    return directory


def make_all(root: Path) -> dict[str, Path]:
    return {name: make_checkpoint(name, root / name) for name in CHECKPOINTS}


def _llama_cpp_permute(weight: Any, num_heads: int) -> Any:
    """llama.cpp's converter layout for Llama q/k rows: each head's two rotate-half
    halves interleaved row by row."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_GGUF_ATTENTION = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_LLAMA_LAYER = {
    **_GGUF_ATTENTION,
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
_GGUF_GEMMA_LAYER = {
    **_GGUF_ATTENTION,
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GGUF_PHI3_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # gate and up, fused as in the checkpoint
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Hugging Face layer tensor -> llama.cpp's name, per architecture.
_GGUF_LAYER_NAMES = {"llama": _GGUF_LLAMA_LAYER, "qwen2": _GGUF_LLAMA_LAYER, "qwen3": _GGUF_LLAMA_LAYER,
                     "gemma2": _GGUF_GEMMA_LAYER, "gemma3": _GGUF_GEMMA_LAYER, "phi3": _GGUF_PHI3_LAYER}  # fmt: skip
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                       "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}  # fmt: skip


def _write_gguf_metadata(writer: Any, cfg: dict[str, Any], arch: str) -> None:
    """The {arch}.* fields llama.cpp's converter writes for these architectures."""
    import gguf

    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":  # transformers 5: one entry per layer type; llama.cpp keeps the global one
        rope = rope.get("full_attention", rope)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim") is not None:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if arch != "gemma2":  # Gemma 2's converter leaves the base out (llama.cpp's default, 10000)
        writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":  # 0: no window
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if arch == "gemma3" and rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
        original = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def write_gguf(
    checkpoint: Path,
    path: Path,
    embedding_q8: bool = True,
    extra_fields: dict[str, int] | None = None,
    extra_tensors: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny llama, qwen2, qwen3, gemma2, gemma3_text or phi3 checkpoint as a GGUF
    file the way llama.cpp's converter lays it out: its tensor names, permuted Llama q/k
    rows, Gemma's norms as 1 + weight and no head (Gemma is tied), Phi-3's fused
    projections as they are and its LongRoPE factors as tensors, the head size where it is
    not hidden / heads, the tokenizer as metadata, and the token embedding quantized to
    Q8_0 unless `embedding_q8` is False (everything else float32). `extra_fields` (uint32)
    and `extra_tensors` are added as given, for files a loader should refuse."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = _GGUF_ARCHITECTURES[cfg["model_type"]]
    layer_names = _GGUF_LAYER_NAMES[arch]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(path, arch)
    _write_gguf_metadata(writer, cfg, arch)
    for key, number in (extra_fields or {}).items():
        writer.add_uint32(key, number)

    tok = json.loads(build_tokenizer().to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])
    writer.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)
    writer.add_pad_token_id(0)  # without one, transformers' Phi-3 config pads with id 32000
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    tensors: dict[str, Any] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    for name, value in tensors.items():
        if name == "model.embed_tokens.weight" and embedding_q8:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor("token_embd.weight", gguf.quants.quantize(value, q8), raw_dtype=q8)
            continue
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[rest]}"
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _llama_cpp_permute(value, heads if "q_proj" in name else kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1.0
        writer.add_tensor(gguf_name, value.astype("float32"))
    for gguf_name, value in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
