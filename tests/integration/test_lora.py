"""LoRA adapters through the service, with real processes: two workers holding different
adapters (made with real `peft`), a gateway with its HTTP front. A request naming an
adapter gives what the in-process LLM gives under it, whichever way it comes (the
ZeroMQ client, HTTP, the jobs queue); adapters load and unload at run time."""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import protocol
from clients.cli import main as tokenwire
from clients.client import Client, RequestError
from clients.jobs import JobQueue, JobStatus
from clients.llm import LLM
from clients.lora_control import LoraControlError, change_lora, registered_workers
from tests.conftest import RedisServer
from tests.integration.test_jobs import Consumer
from tests.integration.wire import WireClient
from tests.procs import CLIENT_OPTIONS, Stack, free_port
from tests.worker.peft_adapters import make_adapter

pytest.importorskip("peft")

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
# Greedy and of a known length: outputs compare token for token.
FIXED: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "a": make_adapter(service_model, root / "a", r=4, target_modules=["q_proj", "v_proj"], seed=1),
        "b": make_adapter(service_model, root / "b", r=8, target_modules=ALL_MODULES, seed=2),
        "c": make_adapter(service_model, root / "c", r=2, target_modules=["o_proj", "down_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def llm(service_model: Path, adapters: dict[str, Path]) -> Iterator[LLM]:
    """The oracle: the in-process LLM holding every adapter, on the workers' backend."""
    from worker.executor import ExecutorConfig

    with LLM(service_model, ExecutorConfig(backend="numpy"), lora={k: v for k, v in adapters.items() if k != "c"},
             max_loras=2) as model:  # fmt: skip
        yield model


@pytest.fixture(scope="module")
def service(service_model: Path, adapters: dict[str, Path], redis_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # fmt: skip
    """worker0 holds adapter a, worker1 adapter b; one gateway with HTTP."""
    s = Stack(service_model, redis_server.url, tmp_path_factory.mktemp("lora-service"))
    try:
        s.worker("--lora", f"a={adapters['a']}", "--max-loras", "2")
        s.worker("--lora", f"b={adapters['b']}", "--max-loras", "2")
        s.http_port = free_port()  # type: ignore[attr-defined]
        s.gateway("--http-port", str(s.http_port))  # type: ignore[attr-defined]
        s.gateways[0].wait_workers(2)
        yield s
    finally:
        s.close()


@pytest.fixture
def client(service: Stack) -> Iterator[Client]:
    with Client([service.gateways[0].endpoint], **CLIENT_OPTIONS) as c:
        yield c


def expected(llm: LLM, lora: str | None) -> list[int]:
    return llm.generate(PROMPT, lora=lora, **FIXED)[0].token_ids


def test_requests_run_under_their_adapter_on_a_worker_holding_it(service: Stack, client: Client, llm: LLM):
    base, under_a, under_b = expected(llm, None), expected(llm, "a"), expected(llm, "b")
    assert len({tuple(base), tuple(under_a), tuple(under_b)}) == 3  # each adapter changes the output
    futures = {(lora, i): client.submit(PROMPT, lora=lora, request_id=f"route-{lora}-{i}", **FIXED)
               for lora in ("a", "b", None) for i in range(4)}  # fmt: skip
    for (lora, _), future in futures.items():
        assert future.result(timeout=60).token_ids == {None: base, "a": under_a, "b": under_b}[lora]
    # Each adapter's requests ran on the worker holding it (random among equals would miss 1 - 2^-8 times).
    for (lora, i) in futures:
        if lora is not None:
            stats = service.request_stats(f"route-{lora}-{i}")
            assert stats["worker"] == {"a": "worker0", "b": "worker1"}[lora]


def test_the_openai_model_field_may_name_an_adapter(service: Stack, llm: LLM):
    url = f"http://127.0.0.1:{service.http_port}/v1"  # type: ignore[attr-defined]
    body = {"model": "b", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reply = _post(f"{url}/completions", body)
    assert reply["model"] == "b"
    assert reply["choices"][0]["text"] == llm.generate(PROMPT, lora="b", **FIXED)[0].text
    with urllib.request.urlopen(f"{url}/models", timeout=10) as r:
        models = {m["id"]: m for m in json.load(r)["data"]}
    assert models["a"]["parent"] == models["b"]["parent"] == service_model_name(service)
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(f"{url}/completions", {**body, "model": "zzz"})
    assert info.value.code == 404
    assert "LoRA adapters: ['a', 'b']" in json.load(info.value)["error"]["message"]


def test_tokenwire_generate_takes_an_adapter(service: Stack, llm: LLM, capsys: pytest.CaptureFixture[str]):
    prompt = "The quick brown fox"
    args = ["generate", prompt, "--gateway", service.gateways[0].endpoint, "--max-tokens", "8", "--temperature", "0"]
    assert tokenwire([*args, "--lora", "b"]) == 0
    under_b = llm.generate(prompt, lora="b", max_tokens=8, temperature=0.0)[0]
    assert under_b.text and under_b.text != llm.generate(prompt, max_tokens=8, temperature=0.0)[0].text
    assert capsys.readouterr().out == under_b.text + "\n"
    assert tokenwire([*args, "--lora", "zzz"]) == 1
    assert "unknown LoRA adapter 'zzz'" in capsys.readouterr().err


def test_an_unknown_adapter_fails_that_request_alone(service: Stack, client: Client, llm: LLM):
    with pytest.raises(RequestError, match="unknown LoRA adapter 'zzz'") as info:
        client.generate(PROMPT, lora="zzz", timeout=30, **FIXED)
    assert info.value.code == protocol.ErrorCode.UNKNOWN_MODEL
    # Past the gateway (straight to worker0, which does not hold b): the executor's error, for that request.
    wire = WireClient(service.workers[0].endpoint)
    try:
        wire.send(protocol.Submit(request_id="stray", input_token_ids=PROMPT, max_tokens=4,
                                  lora_config=protocol.LoraConfig(name="b")))  # fmt: skip
        wire.send(protocol.Submit(request_id="fine", input_token_ids=PROMPT, max_tokens=4,
                                  lora_config=protocol.LoraConfig(name="a")))  # fmt: skip
        wire.wait(["stray", "fine"], timeout=30)
        (stray,) = wire.responses["stray"]
        assert stray.error_msg is not None and stray.error_msg.startswith("unknown LoRA adapter 'b'")
        assert "a" in stray.error_msg  # it lists the adapters held
        assert wire.responses["fine"][-1].result is not None
    finally:
        wire.close()
    assert client.generate(PROMPT, lora="a", timeout=30, **FIXED).token_ids == expected(llm, "a")


def test_the_model_may_name_an_adapter_over_zeromq_too(client: Client, llm: LLM):
    assert client.generate(PROMPT, model="b", timeout=30, **FIXED).token_ids == expected(llm, "b")
    with pytest.raises(RequestError, match="no worker serves model 'zzz'"):
        client.generate(PROMPT, model="zzz", timeout=30, **FIXED)


def test_adapters_load_and_unload_at_run_time(service: Stack, client: Client, llm: LLM, adapters: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]):  # fmt: skip
    worker0 = service.workers[0]
    load = protocol.LoraLoad(request_id="load-c", name="c", path=str(adapters["c"]))
    assert change_lora(worker0.endpoint, load, timeout_s=60) == ["a", "c"]
    service.gateways[0].wait_log("worker0 holds LoRA adapters ['a', 'c']")
    llm.load_lora("c", adapters["c"])
    under_c = expected(llm, "c")
    assert under_c != expected(llm, None)
    assert client.generate(PROMPT, lora="c", timeout=60, **FIXED).token_ids == under_c
    _wait_registry(service, "worker0", ["a", "c"])
    assert tokenwire(["lora", "list", "--redis", service.redis_url]) == 0
    assert "worker0" in (listed := capsys.readouterr().out) and "a,c" in listed and "b" in listed

    # A bad adapter is refused with the reason, and the worker serves on.
    bad = protocol.LoraLoad(request_id="load-bad", name="bad", path=str(adapters["c"].parent / "missing"))
    with pytest.raises(LoraControlError, match=r"cannot load LoRA adapter 'bad': .*adapter_config\.json is missing"):
        change_lora(worker0.endpoint, bad, timeout_s=60)

    assert tokenwire(["lora", "unload", "c", "--worker", "worker0", "--redis", service.redis_url]) == 0
    assert "unloaded c; holds a" in capsys.readouterr().out
    service.gateways[0].wait_log("worker0 holds LoRA adapters ['a']")
    with pytest.raises(RequestError, match="unknown LoRA adapter 'c'"):
        client.generate(PROMPT, lora="c", timeout=30, **FIXED)
    _wait_registry(service, "worker0", ["a"])
    assert client.generate(PROMPT, lora="a", timeout=30, **FIXED).token_ids == expected(llm, "a")


def test_a_request_sent_right_after_a_load_runs_under_it(service: Stack, llm: LLM, adapters: dict[str, Path]):
    llm.load_lora("c", adapters["c"])
    wire = WireClient(service.workers[1].endpoint)
    try:  # no wait for the load's answer: the worker keeps the order they were sent in
        wire.send(protocol.LoraLoad(request_id="load-now", name="c-now", path=str(adapters["c"])))
        wire.send(protocol.Submit(request_id="right-after", input_token_ids=PROMPT, max_tokens=8, end_id=-1,
                                  sampling_config=protocol.SamplingConfig(temperature=0.0),
                                  lora_config=protocol.LoraConfig(name="c-now")))  # fmt: skip
        wire.wait(["right-after"], timeout=60)
        (response,) = wire.responses["right-after"]
        assert response.result is not None, response.error_msg
        assert response.result.output_token_ids[0] == expected(llm, "c")
        deadline = time.monotonic() + 10  # the load's answer may be sent just after a short request's result
        while not any(isinstance(m, protocol.LoraAdapters) for m in wire.other) and time.monotonic() < deadline:
            wire.pump(0.05)
        assert [m.adapters for m in wire.other if isinstance(m, protocol.LoraAdapters)] == [["b", "c-now"]]
    finally:
        wire.close()
    assert change_lora(service.workers[1].endpoint, protocol.LoraUnload(request_id="u", name="c-now")) == ["b"]


def test_a_job_runs_under_its_adapter(service: Stack, llm: LLM):
    consumer = Consumer("lora-consumer", service.gateways[0].endpoint, service.redis_url, service.log_dir)
    try:
        with JobQueue(service.redis_url) as queue:
            job_id = queue.submit(PROMPT, lora="b", **FIXED)
            result = queue.result(job_id, timeout=90)
        assert result.status is JobStatus.DONE, result.error
        assert list(result.outputs[0].token_ids) == expected(llm, "b")
    finally:
        consumer.stop()


def service_model_name(service: Stack) -> str:
    return service.model.name


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r)


def _wait_registry(service: Stack, worker_id: str, adapters: list[str], timeout: float = 10.0,
                   loadable: list[str] | None = None) -> None:  # fmt: skip
    """Until the worker's registry entry names these adapters held (and these loadable, when
    given; it is rewritten each heartbeat)."""
    deadline = time.monotonic() + timeout
    while True:
        held = {w.worker_id: (w.lora_adapters, w.lora_loadable) for w in registered_workers(service.redis_url)}
        if worker_id in held and held[worker_id][0] == adapters and loadable in (None, held[worker_id][1]):
            return
        assert time.monotonic() < deadline, f"registry: {held}"
        time.sleep(0.05)


def test_loads_reach_a_curve_worker_with_a_key_it_accepts(service_model: Path, adapters: dict[str, Path],
                                                          redis_server_factory: Any, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]):  # fmt: skip
    from tests.integration.test_curve import _keys

    root = _keys(tmp_path / "keys")
    s = Stack(service_model, redis_server_factory().url, tmp_path)  # a Redis of its own: the module's stack is up
    try:
        worker = s.worker("--curve-secret-key-file", str(root / "pairs" / "worker.key_secret"),
                          "--curve-allowed-keys-dir", str(root / "gateways"), "--max-loras", "2")  # fmt: skip
        worker.wait_log("serving")
        _wait_registry(s, worker.worker_id, [])
        load = ["lora", "load", "c", str(adapters["c"]), "--worker", worker.worker_id, "--redis", s.redis_url]
        assert tokenwire([*load, "--timeout", "2"]) == 1  # no key: the handshake never completes
        assert "did not answer" in capsys.readouterr().err
        assert tokenwire([*load, "--curve-secret-key-file", str(root / "pairs" / "other-gateway.key_secret")]) == 0
        assert "loaded c; holds c" in capsys.readouterr().out
    finally:
        s.close()


@pytest.fixture(scope="module")
def dir_service(service_model: Path, adapters: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # fmt: skip
    """worker0 holds a; worker1 holds nothing but has b (and a broken adapter) in its --lora-dir.
    A Redis of its own: the module's other stack is up beside it."""
    root = tmp_path_factory.mktemp("lora-dir")
    shutil.copytree(adapters["b"], root / "b")
    (root / "broken").mkdir()  # a config, but no weights
    shutil.copy(adapters["c"] / "adapter_config.json", root / "broken")
    (root / "notes").mkdir()  # no adapter_config.json: not an adapter
    redis_server = RedisServer(tmp_path_factory.mktemp("lora-dir-redis"))
    redis_server.start()
    s = Stack(service_model, redis_server.url, tmp_path_factory.mktemp("lora-dir-service"))
    try:
        s.worker("--lora", f"a={adapters['a']}", "--max-loras", "2")
        s.worker("--lora-dir", str(root), "--max-loras", "1")
        s.gateway()
        s.gateways[0].wait_workers(2)
        yield s
    finally:
        s.close()
        redis_server.kill()


def test_a_request_for_an_adapter_in_a_lora_dir_goes_there_and_loads_it(dir_service: Stack, llm: LLM):
    worker1 = dir_service.workers[1]
    _forget(dir_service, "b")
    loads = worker1.log().count("loading LoRA adapter 'b'")
    with Client([dir_service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        under_b = client.generate(PROMPT, lora="b", request_id="first-b", timeout=60, **FIXED)
        assert under_b.token_ids == expected(llm, "b")
        assert dir_service.request_stats("first-b")["worker"] == "worker1"
        worker1.wait_log("loading LoRA adapter 'b'", loads + 1)
        _wait_registry(dir_service, "worker1", ["b"], loadable=["broken"])
        dir_service.gateways[0].wait_log("worker1 holds LoRA adapters ['b'], can load ['broken']")

        # Held now: the next requests run on it without a load, several at once.
        futures = [client.submit(PROMPT, lora="b", request_id=f"held-b-{i}", **FIXED) for i in range(3)]
        assert all(f.result(timeout=60).token_ids == expected(llm, "b") for f in futures)
        assert {dir_service.request_stats(f"held-b-{i}")["worker"] for i in range(3)} == {"worker1"}
        assert worker1.log().count("loading LoRA adapter 'b'") == loads + 1

        with pytest.raises(RequestError, match=r"unknown LoRA adapter 'zzz': no worker .*holds it or can load it; "
                           r"held: \['a', 'b'\]; loadable: \['broken'\]") as info:  # fmt: skip
            client.generate(PROMPT, lora="zzz", timeout=30, **FIXED)
        assert info.value.code == protocol.ErrorCode.UNKNOWN_MODEL
        assert client.generate(PROMPT, lora="a", timeout=30, **FIXED).token_ids == expected(llm, "a")


def test_an_adapter_that_does_not_load_fails_that_request_alone(dir_service: Stack, llm: LLM,
                                                                capsys: pytest.CaptureFixture[str]):  # fmt: skip
    wire = WireClient(dir_service.workers[1].endpoint)
    try:  # straight to worker1: a plain request beside the one whose adapter does not load
        greedy = protocol.SamplingConfig(temperature=0.0)
        wire.send(protocol.Submit(request_id="plain", input_token_ids=PROMPT, max_tokens=8, end_id=-1,
                                  sampling_config=greedy))  # fmt: skip
        wire.send(protocol.Submit(request_id="broken", input_token_ids=PROMPT, max_tokens=8, end_id=-1,
                                  sampling_config=greedy, lora_config=protocol.LoraConfig(name="broken")))  # fmt: skip
        wire.wait(["plain", "broken"], timeout=60)
        (broken,) = wire.errors["broken"]  # refused by the worker, as a request it cannot take
        assert re.match(r"cannot load LoRA adapter 'broken': .*adapter_model", broken.message), broken.message
        assert broken.code == protocol.ErrorCode.INVALID_REQUEST
        (plain,) = wire.responses["plain"]
        assert plain.result is not None and plain.result.output_token_ids[0] == expected(llm, None)
    finally:
        wire.close()
    with Client([dir_service.gateways[0].endpoint], **CLIENT_OPTIONS) as client:
        with pytest.raises(RequestError, match=r"cannot load LoRA adapter 'broken': .*adapter_model"):
            client.generate(PROMPT, lora="broken", timeout=60, **FIXED)
        # Still announced as loadable (its files may be fixed), and the worker serves on.
        (entry,) = [w for w in registered_workers(dir_service.redis_url) if w.worker_id == "worker1"]
        assert "broken" in entry.lora_loadable and "broken" not in entry.lora_adapters
        assert tokenwire(["lora", "list", "--redis", dir_service.redis_url]) == 0
        listed = capsys.readouterr().out
        assert "loadable (--lora-dir)" in listed and "broken" in listed
        assert client.generate(PROMPT, lora="b", timeout=60, **FIXED).token_ids == expected(llm, "b")
        assert client.generate(PROMPT, timeout=60, **FIXED).token_ids == expected(llm, None)


def test_a_request_waiting_for_its_adapter_to_load_can_be_cancelled(dir_service: Stack, llm: LLM):
    _forget(dir_service, "b")
    wire = WireClient(dir_service.workers[1].endpoint)
    try:  # in one socket turn: the cancel finds the request waiting for the load
        wire.send(protocol.Submit(request_id="waits", input_token_ids=PROMPT, max_tokens=8,
                                  lora_config=protocol.LoraConfig(name="b")))  # fmt: skip
        wire.send(protocol.Cancel(request_id="waits"))
        wire.wait(["waits"], timeout=60)
        assert not wire.errors["waits"]
        final = wire.responses["waits"][-1]
        assert final.result is not None and final.result.finish_reasons == [protocol.FinishReason.CANCELLED]
    finally:
        wire.close()
    _wait_registry(dir_service, "worker1", ["b"], loadable=["broken"])  # the load itself went on


def _forget(service: Stack, name: str) -> None:
    """Unload `name` from worker1 if it holds it: its --lora-dir makes it loadable again."""
    endpoint = service.workers[1].endpoint
    if any(w.worker_id == "worker1" and name in w.lora_adapters for w in registered_workers(service.redis_url)):
        change_lora(endpoint, protocol.LoraUnload(request_id=f"forget-{name}", name=name), timeout_s=30)
    _wait_registry(service, "worker1", [], loadable=["b", "broken"])
