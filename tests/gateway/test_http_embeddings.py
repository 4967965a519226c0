"""POST /v1/embeddings through the official `openai` SDK against a real gateway and
worker (processes, Redis, the tiny checkpoint), with transformers as the oracle."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway import embeddings_api
from tests.checkpoints import VOCAB_SIZE
from tests.gateway.http_service import http_service
from tests.worker.executor.test_embeddings import TOL, hf_embedding

openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
MAX_SEQ_LEN = 512  # the tiny checkpoint's context
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "héllo wörld"]


@pytest.fixture(scope="module")
def service(service_model: Path, redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with http_service(service_model, redis_server.url, tmp_path_factory.mktemp("http")) as s:
        yield s


@pytest.fixture(scope="module")
def client(service: Any) -> Any:
    with openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def token_ids(model_dir: Path, text: str) -> list[int]:
    """The text's tokens as the gateway makes them (the model's tokenizer, special tokens added)."""
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)


def test_float_and_base64_agree_and_match_transformers(client: Any, service_model: Path) -> None:
    inputs = [[5, 6, 7], list(range(10, 60))]
    as_floats = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=inputs, encoding_format="base64").parse()
    assert as_floats.object == "list" and as_floats.model == MODEL
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == 53
    for i, (item, tokens) in enumerate(zip(as_floats.data, inputs, strict=True)):
        assert item.object == "embedding" and item.index == i
        vector = np.asarray(item.embedding, dtype=np.float32)
        # The SDK hands a base64 answer back decoded; the bytes are read here as OpenAI defines them.
        encoded = raw.data[i].embedding
        decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4") if isinstance(encoded, str) else encoded
        # Two requests, so two forwards whose batches may differ: float32 sums in another order
        # (1e-7 here), not the encoding, which test_the_two_encodings_carry_the_same_bits holds exact.
        np.testing.assert_allclose(np.asarray(decoded, dtype=np.float32), vector, atol=1e-6, rtol=0)
        np.testing.assert_allclose(vector, hf_embedding(service_model, tokens, "last"), atol=TOL, rtol=0)


def test_the_two_encodings_carry_the_same_bits() -> None:
    vector = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    floats = embeddings_api.response("m", [vector], "float", 3)["data"][0]["embedding"]
    encoded = embeddings_api.response("m", [vector], "base64", 3)["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), vector)
    np.testing.assert_array_equal(np.asarray(json.loads(json.dumps(floats)), dtype=np.float32), vector)


def test_a_batch_of_texts_answers_each_in_order(client: Any, service_model: Path) -> None:
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 by default
    assert [d.index for d in batch.data] == [0, 1, 2]
    tokens = [token_ids(service_model, t) for t in TEXTS]
    assert batch.usage.prompt_tokens == sum(map(len, tokens))
    for item, text, ids in zip(batch.data, TEXTS, tokens, strict=True):
        (alone,) = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data
        np.testing.assert_allclose(np.asarray(item.embedding, dtype=np.float32), alone.embedding, atol=1e-6, rtol=0)
        np.testing.assert_allclose(alone.embedding, hf_embedding(service_model, ids, "last"), atol=TOL, rtol=0)


def test_mean_pooling_and_dimensions(client: Any, service_model: Path) -> None:
    ids = token_ids(service_model, TEXTS[1])
    (mean,) = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                       extra_body={"pooling": "mean"}).data  # fmt: skip
    np.testing.assert_allclose(mean.embedding, hf_embedding(service_model, ids, "mean"), atol=TOL, rtol=0)
    (short,) = client.embeddings.create(model=MODEL, input=ids, encoding_format="float", dimensions=16).data
    full = hf_embedding(service_model, ids, "last")[:16]
    assert len(short.embedding) == 16
    np.testing.assert_allclose(short.embedding, full / np.linalg.norm(full), atol=TOL, rtol=0)


@pytest.mark.parametrize(("body", "words"), [
    ({"input": []}, "input must not be empty"),
    ({"input": ["fine", ""]}, "input[1] is empty: an empty string"),
    ({"input": [[5, 6], []]}, "input[1] is empty"),
    ({"input": [5] * (MAX_SEQ_LEN + 1)}, f"input[0] is {MAX_SEQ_LEN + 1} tokens; the model's context is"),
    ({"input": [[5, VOCAB_SIZE]]}, f"token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 65}, "exceeds the model's embedding size (64)"),
    ({"input": "x", "pooling": "max"}, "pooling"),
    ({"input": "x", "no_such_option": 1}, "no_such_option"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_problem(client: Any, body: dict[str, Any], words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", body={"model": MODEL, **body}, cast_to=object)
    assert words in str(e.value.body), e.value.body


def test_an_unknown_model_is_a_404(client: Any) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
