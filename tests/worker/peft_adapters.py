"""Random LoRA adapters made with real `peft` on a tiny checkpoint, and peft's own outputs
as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_adapter(checkpoint: Path, directory: Path, r: int, target_modules: list[str], seed: int,
                 alpha: int = 16, use_rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter for `checkpoint` with random A and B (PEFT starts B at zero,
    which would make the adapter a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora,
                        lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(str(directory))
    return directory


_MODELS: dict[tuple[Path, Path | None], Any] = {}


def peft_model(checkpoint: Path, adapter: Path | None) -> Any:
    """transformers' model with the adapter applied by peft (None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = (checkpoint, adapter)
    if key not in _MODELS:
        # eager: transformers' SDPA path drops Gemma 2's attention soft-cap; eager is its reference.
        model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        model.generation_config.eos_token_id = None
        _MODELS[key] = model.eval()
    return _MODELS[key]


def peft_greedy(checkpoint: Path, adapter: Path | None, prompt: list[int],
                max_new_tokens: int) -> tuple[list[int], Any]:
    """peft's greedy continuation (never stopping at EOS) and the logits of each generated token."""
    import torch

    model = peft_model(checkpoint, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack(out.logits)[:, 0].numpy()
