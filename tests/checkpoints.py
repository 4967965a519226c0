"""Tiny random-weight Hugging Face checkpoints, made with transformers' own config
classes and `save_pretrained`, so tests load exactly what real checkpoints look like.

Each directory holds config.json, safetensors weights, tokenizer.json and a
tokenizer_config.json with a chat template. The weights are random, so outputs are
gibberish, but they are deterministic (fixed seed) and transformers is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    # bf16 on disk and sharded: exercises the bf16 widening and the safetensors index.
    "mistral_bf16_sharded": (
        "MistralConfig",
        {"tie_word_embeddings": False, "sliding_window": 12},  # short, so tests cross it
        {"max_shard_size": "100KB", "dtype": "bfloat16"},
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


def make_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Write the named tiny checkpoint into `directory` (created) and return it."""
    import torch
    import transformers

    class_name, overrides, save_kwargs = CHECKPOINTS[name]
    save_kwargs = dict(save_kwargs)
    config = getattr(transformers, class_name)(**{**_BASE, **overrides})
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
