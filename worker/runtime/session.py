"""Session: one run of the model over named inputs (the Python runtime's Session,
which runs a TensorRT engine once). tokenwire's engine is the EngineCore, and a
run is a context pass: every prompt's logits, computed by the core's own path
(context logits of a one-token request)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from worker.executor import EngineCore, ExecutorConfig, OutputConfig, Request
from worker.runtime.generation import split_batch


class Session:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    @classmethod
    def from_engine(cls, engine: EngineCore) -> Session:
        return cls(engine)

    @classmethod
    def from_serialized_engine(cls, path: str | Path, config: ExecutorConfig | None = None) -> Session:
        """tokenwire's serialized engine is a checkpoint directory or .gguf file."""
        return cls(EngineCore.from_model(path, config))

    def run(self, inputs: dict[str, Any], outputs: dict[str, Any], stream: Any = None) -> bool:
        """inputs: "input_ids" (a batch as GenerationSession.decode takes it) and
        "context_lengths" (for padded or packed tensors). Sets outputs["logits"]
        [batch, vocab] (each prompt's last position) and outputs["context_logits"]
        (one [length, vocab] array per prompt). `stream` is accepted for TensorRT-LLM's
        signature: the run is synchronous. True when every prompt ran."""
        prompts = split_batch(inputs["input_ids"], inputs.get("context_lengths"))
        ids = list(range(len(prompts)))
        core = self.engine
        core.add_requests([(i, Request(input_token_ids=p, max_tokens=1, end_id=-1,
                                       output_config=OutputConfig(return_context_logits=True)))
                           for i, p in zip(ids, prompts, strict=True)])  # fmt: skip
        logits: dict[int, np.ndarray] = {}
        errors: list[str] = []
        while len(logits) + len(errors) < len(prompts) and core.has_work:
            for response in core.step().all_responses():
                if response.error_msg is not None:
                    errors.append(response.error_msg)
                elif response.result is not None and response.result.is_final:
                    logits[response.request_id] = np.asarray(response.result.context_logits)
        if errors or len(logits) < len(prompts):
            return False
        outputs["context_logits"] = [logits[i] for i in ids]
        outputs["logits"] = np.stack([logits[i][-1] for i in ids])
        return True
