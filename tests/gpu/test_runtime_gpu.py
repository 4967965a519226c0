"""worker/runtime on CUDA (the torch backend, float32, overlap scheduling on):
ModelRunner's greedy, beam, stopping-criterion and logits-processor outputs
against transformers on the CPU, and decode_stream against decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import make_checkpoint
from worker.runtime import LogitsProcessor, ModelRunner, StoppingCriteria

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen2_bias", tmp_path_factory.mktemp("runtime_gpu") / "qwen2")


@pytest.fixture(scope="module")
def runner(checkpoint: Path) -> ModelRunner:
    r = ModelRunner.from_dir(checkpoint, backend="torch", dtype="float32", max_batch_size=4, max_beam_width=2,
                             kv_cache_max_tokens=8192)
    assert r.session.core.backend.name == "torch-cuda"
    return r


def hf(checkpoint: Path, prompt: list[int], **kw: Any) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kw)
    return [row[len(prompt) :] for row in out.tolist()]


def generated(out: dict[str, Any]) -> list[list[list[int]]]:
    ids, lengths = out["output_ids"], out["sequence_lengths"]
    return [[ids[i, b, len(p) : lengths[i, b]].tolist() for b in range(ids.shape[1])] for i, p in enumerate(PROMPTS)]


def test_greedy_and_streaming(runner: ModelRunner, checkpoint: Path) -> None:
    out = runner.generate(PROMPTS, max_new_tokens=10, end_id=-1, pad_id=0, return_dict=True)
    assert [g[0] for g in generated(out)] == [hf(checkpoint, p, max_new_tokens=10)[0] for p in PROMPTS]
    *_, last = runner.generate(PROMPTS, max_new_tokens=10, end_id=-1, pad_id=0, streaming=True)
    assert torch.equal(last, out["output_ids"])


def test_beams(runner: ModelRunner, checkpoint: Path) -> None:
    p = PROMPTS[0]
    want = hf(checkpoint, p, max_new_tokens=8, num_beams=2, num_return_sequences=2, length_penalty=1.0,
              early_stopping=True)
    out = runner.generate([p], max_new_tokens=8, num_beams=2, length_penalty=1.0, early_stopping=1, end_id=-1,
                          return_dict=True)
    ids = out["output_ids"][0, :, len(p) :].tolist()
    assert ids == want


class Ban(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        scores[:, self.token] = float("-inf")
        return scores


class EndAt(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, step: int, input_ids: Any, scores: Any) -> Any:
        return input_ids[:, -1] == self.token


def test_logits_processor_and_stopping_criterion(runner: ModelRunner, checkpoint: Path) -> None:
    free = [hf(checkpoint, p, max_new_tokens=8)[0] for p in PROMPTS]
    token = free[0][1]
    banned = runner.generate(PROMPTS, max_new_tokens=8, end_id=-1, logits_processor=Ban(token), return_dict=True)
    assert [g[0] for g in generated(banned)] == [hf(checkpoint, p, max_new_tokens=8, bad_words_ids=[[token]])[0]
                                                 for p in PROMPTS]
    stopped = runner.generate(PROMPTS, max_new_tokens=8, end_id=-1, stopping_criteria=EndAt(token), return_dict=True)
    assert [g[0] for g in generated(stopped)] == [f[: f.index(token) + 1] if token in f else f for f in free]
