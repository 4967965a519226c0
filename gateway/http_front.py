"""The gateway's HTTP front: OpenAI's API (gateway/openai_api.py), /health and
/metrics, for every tool that speaks OpenAI-style HTTP.

Stack: Starlette on uvicorn. Both are widely used and maintained (FastAPI is
built on them), small (no code generation, no dependency injection we would
not use), and speak ASGI, so server-sent events are an async generator and a
client that goes away cancels it. uvicorn speaks HTTP/1.1 with httptools (a
dependency: wheels for every CPython we support) and falls back to h11 where
it is missing: httptools' path for a body write is a few lines where h11's is a
state machine, and an SSE stream makes one write per step, so per token.

It must not slow the ZeroMQ path, so it runs on a thread of its own with its
own asyncio loop, and reaches the gateway as one more ZeroMQ client: a DEALER
on the gateway's in-process endpoint (gateway/server.py binds it beside its
TCP one). Everything the gateway does for clients (routing, stop strings,
text, back-pressure, cancels, heartbeats) the HTTP front gets unchanged, and
the gateway's I/O thread never waits on it. Its listening socket is bound when
the front is made, before the gateway serves: a port in use fails at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, Any

import redis
import uvicorn
import zmq
import zmq.asyncio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

import protocol
from gateway import embeddings_api, reasoning, responses_api
from gateway import openai_api as api
from gateway.chat_output import ChatStream, OutputRules
from gateway.http_auth import ApiKeyAuth, Usage, usage_of
from gateway.response_store import ResponseStore
from gateway.responses_api import ResponsesRequest
from gateway.tokenize_api import DetokenizeRequest, TokenizeRequest
from gateway.workers import adapter_models
from protocol import tool_calls
from protocol.chat_template import ChatTemplateError
from protocol.keys import RESPONSE_TTL_S
from protocol.tool_calls import ToolUse

if TYPE_CHECKING:
    from gateway.server import Gateway

log = logging.getLogger(__name__)

_HEARTBEAT_S = 1.0

# What a request needs once prepared: its model's name as answered, the Submit, the prompt's
# length where known here, and what of the prompt a completion's choices repeat, or how a
# chat's output is read for tool calls.
_Prepared = tuple[str, protocol.Submit, int | None, api.Echo | OutputRules | None]


class _Call:
    """One HTTP request in flight: what the bridge hands its handler, in order, and
    the future the handler waits on while there is nothing.

    A plain streamed step (sequence 0, text alone, not final: almost every event) is
    queued as its text, with its token count added to `step_tokens`, so that a token
    costs no Result here; results with more in them, and errors, are queued as they are.
    Not an asyncio.Queue: the handler takes everything queued at once when it wakes."""

    __slots__ = ("events", "step_tokens", "waiter")

    def __init__(self) -> None:
        self.events: deque[str | protocol.Result | api.ApiError] = deque()
        self.step_tokens = 0
        self.waiter: asyncio.Future[None] | None = None

    def put(self, event: str | protocol.Result | api.ApiError) -> None:
        self.events.append(event)
        waiter = self.waiter
        if waiter is not None:  # woken once, however many events this batch brings
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Return once an event is queued."""
        while not self.events:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter


class Bridge:
    """The HTTP front's ZeroMQ client of the gateway, on the front's event loop."""

    def __init__(self, ctx: zmq.Context, endpoint: str, api_key: str | None, identity: bytes, send_limit: int) -> None:
        """`send_limit`: events one request's HTTP client may leave unread before it is cut off."""
        self.api_key = api_key  # the gateway's own key for its HTTP front, which checks clients' keys
        self.sock = zmq.asyncio.Context.shadow(ctx).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)  # the gateway waits on it, never cuts it off
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sender_id = f"http-{os.getpid()}"
        self.calls: dict[str, _Call] = {}
        self.send_limit = send_limit
        self._tasks: list[asyncio.Task[None]] = []
        self._cancels: set[asyncio.Task[None]] = set()  # the cut-off requests' cancels being sent

    async def start(self) -> None:
        await self._send(protocol.Hello(sender_id=self.sender_id, role="client", heartbeat_interval_s=_HEARTBEAT_S,
                                        api_key=self.api_key))
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._beat())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if not self.sock.closed:
            self.sock.close(0)

    async def _send(self, msg: protocol.Message) -> None:
        await self.sock.send(protocol.encode(msg))

    async def submit(self, msg: protocol.Submit) -> _Call:
        call = self.calls[msg.request_id] = _Call()
        await self._send(msg)
        return call

    async def cancel(self, request_id: str) -> None:
        if self.calls.pop(request_id, None) is not None:
            await self._send(protocol.Cancel(request_id=request_id))

    def forget(self, request_id: str) -> None:
        self.calls.pop(request_id, None)

    async def _beat(self) -> None:
        beat = protocol.encode(protocol.Heartbeat(sender_id=self.sender_id))
        while True:
            await asyncio.sleep(_HEARTBEAT_S)
            await self.sock.send(beat)

    async def _receive(self) -> None:
        while True:
            payload = await self.sock.recv()
            try:
                msg = protocol.decode(payload)
            except protocol.ProtocolError as e:
                log.error("the gateway sent the HTTP front a bad message: %s", e)
                continue
            if isinstance(msg, protocol.ResultBatch):
                self._results(msg)
            elif isinstance(msg, protocol.ErrorReply):
                call = self.calls.pop(msg.request_id, None) if msg.request_id else None
                if call is not None:
                    call.put(api.ApiError.from_code(msg.code, msg.message))
            # recv returns at once while messages wait, without a turn of the loop: give the handlers
            # theirs, so that a stream's events pile up only while its client's connection does not drain.
            await asyncio.sleep(0)

    def _results(self, batch: protocol.ResultBatch) -> None:
        calls = self.calls
        streamed = batch.streamed
        if streamed is not None:  # the plain streamed steps: their text is all the front needs
            texts = streamed.text or [""] * len(streamed.request_ids)
            for request_id, n, text in zip(streamed.request_ids, streamed.counts, texts, strict=True):
                call = calls.get(request_id)
                if call is not None:
                    call.step_tokens += n
                    call.put(text)
                    if len(call.events) > self.send_limit:
                        self._cut_off(request_id, call)
        for response in batch.responses:
            call = calls.get(response.request_id)
            if call is None:
                continue
            if response.is_final:
                del calls[response.request_id]
            if response.result is None:
                call.put(api.ApiError(500, response.error_msg or "the worker failed", "server_error"))
            else:
                call.put(response.result)
                if len(call.events) > self.send_limit and not response.is_final:
                    self._cut_off(response.request_id, call)

    def _cut_off(self, request_id: str, call: _Call) -> None:
        """A stream whose HTTP client reads nothing (its connection does not drain, so its
        handler waits to write) holds at most `send_limit` events here: past that its request
        is cancelled and its events dropped, an error in their place for when it reads again."""
        del self.calls[request_id]
        why = (f"cut off: this HTTP client left {self.send_limit} of the stream's events unread (the "
               "gateway's --client-send-limit); the request was cancelled")  # fmt: skip
        log.warning("request %s %s", request_id, why)
        call.events.clear()
        call.put(api.ApiError.from_code(protocol.ErrorCode.OVERLOADED, why))
        task = asyncio.get_running_loop().create_task(self._send(protocol.Cancel(request_id=request_id)))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)


class HttpFront:
    """The HTTP server of one gateway: `start()` serves on a thread, `stop()` ends it."""

    def __init__(self, gateway: Gateway, host: str, port: int, open_paths: frozenset[str] = frozenset(),
                 reasoning_parser: str | None = None, reuse_port: bool = False,
                 response_ttl_s: int = RESPONSE_TTL_S) -> None:  # fmt: skip
        self.gateway = gateway
        # None: the format each model's chat template teaches (tool calls: the gateway's --tool-parser).
        self.reasoning_parser = reasoning_parser
        # Bound now, so a port in use is an error at start-up rather than on a thread later.
        # `reuse_port`: gateway processes of one host serve one port, each taking the
        # connections the kernel hands it (one process's Python stays off the others' path).
        self.socket = socket.create_server((host, port), reuse_port=reuse_port)
        self.port: int = self.socket.getsockname()[1]
        self.host = host
        self.bridge: Bridge | None = None
        self.store = ResponseStore(gateway.discovery.redis, gateway.keys, response_ttl_s)
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        handlers = {HTTPException: _http_error, Exception: _server_error}
        self.app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=handlers)
        asgi: ASGIApp = self.app
        if gateway.api_keys is not None and gateway.key_limits is not None:  # one per gateway, for both fronts
            asgi = ApiKeyAuth(self.app, gateway.api_keys, open_paths, gateway.key_limits)
        config = uvicorn.Config(asgi, log_level="warning", access_log=False, http="auto", loop="asyncio",
                                lifespan="on", timeout_graceful_shutdown=2)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="gateway-http", daemon=True)  # fmt: skip

    def start(self) -> None:
        self.thread.start()
        log.info("HTTP front listening at http://%s:%d", self.host, self.port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.socket.close()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        from gateway.server import INPROC_ENDPOINT

        self.bridge = Bridge(self.gateway.ctx, INPROC_ENDPOINT, self.gateway.bridge_key, self.gateway.bridge_identity,
                             self.gateway.config.client_send_limit)
        await self.bridge.start()
        watch = asyncio.create_task(self._watch_gateway())
        try:
            yield
        finally:
            watch.cancel()
            await self.bridge.stop()

    async def _watch_gateway(self) -> None:
        """Close the bridge as soon as the gateway stops: it terminates the ZeroMQ
        context, which waits for every socket on it to close."""
        while not self.gateway.stop.is_set():
            await asyncio.sleep(0.05)
        assert self.bridge is not None
        await self.bridge.stop()
        self.server.should_exit = True

    # -- what the gateway knows (read from its thread's state: reads only) ----------------

    def _ready_models(self) -> dict[str, int | None]:
        """Model name -> its context length, over the ready workers."""
        models: dict[str, int | None] = {}
        for w in list(self.gateway.workers.values()):
            if w.ready and not w.draining:
                for m in w.models:
                    models[m] = w.max_seq_len
        return models

    def _vocab_size(self, model: str | None) -> int | None:
        """The model's vocabulary size, from a ready worker that serves it."""
        for w in list(self.gateway.workers.values()):
            if w.ready and model in w.models and w.vocab_size is not None:
                return w.vocab_size
        return None

    # -- endpoints -------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        # Served open under --insecure: said where operators look.
        insecure = {"insecure": self.gateway.config.insecure} if self.gateway.config.insecure else {}
        if not self.gateway.discovery.connected:
            return JSONResponse({"status": "unavailable", "reason": "Redis does not answer", **insecure}, 503)
        if not self._ready_models():
            return JSONResponse({"status": "unavailable", "reason": "no worker is ready", **insecure}, 503)
        return JSONResponse({"status": "ok", **insecure})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        data = [{"id": m, "object": "model", "created": now, "owned_by": "tokenwire", "max_model_len": n}
                for m, n in sorted(self._ready_models().items())]  # fmt: skip
        data += [{"id": a, "object": "model", "created": now, "owned_by": "tokenwire", "parent": m}  # LoRA, as vLLM
                 for a, m in sorted(adapter_models(list(self.gateway.workers.values())).items())]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._body(request, chat)
            # Several prompts (completions) are a request each, answered together.
            parts = body.each_prompt() if isinstance(body, api.CompletionRequest) else [body]
            # On a thread: a long prompt's tokenizing would hold up every other HTTP client.
            prepared = await asyncio.to_thread(lambda: [self._submit(part, chat) for part in parts])
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        assert self.bridge is not None
        model, submit, prompt_tokens, extra = prepared[0]
        tokenizer = self.gateway.tokenizers.get(submit.model or model)  # a LoRA adapter's: its model's
        text = api.TokenText(tokenizer)
        if not body.stream:
            answer = await self._answer_whole(request, body, prepared, text)
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        call = await self.bridge.submit(submit)
        await call.wait()
        first = call.events[0]  # an error before any output is still an HTTP error
        if isinstance(first, api.ApiError):
            return JSONResponse(first.body(), first.status)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        rules = extra if isinstance(extra, OutputRules) else None
        stream = self._sse(call, submit, model, chat, prompt_tokens, include_usage, text, usage_of(request.scope),
                           rules)  # fmt: skip
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _all_answers(self, request: Request, ids: list[str],
                           answers: list[Awaitable[Any]]) -> list[Any] | Response:  # fmt: skip
        """Requests `ids` answered side by side, all or none: their answers, or the response
        that ends them all, 499 when the client goes away meanwhile, the first failure's
        error otherwise (each time the rest are cancelled at the workers)."""
        assert self.bridge is not None
        each = [asyncio.ensure_future(a) for a in answers]
        whole = asyncio.gather(*each)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            whole.cancel()
            await self._cancel_all(ids)
            raise
        finally:
            gone.cancel()
        if not whole.done():
            whole.cancel()
            await self._cancel_all(ids)
            return Response(status_code=499)  # nobody reads it: the client is gone
        try:
            return list(whole.result())
        except api.ApiError as e:
            for task in each:  # the others wait on requests stopped here
                task.cancel()
            await self._cancel_all(ids)
            return JSONResponse(e.body(), e.status)
        finally:
            for request_id in ids:
                self.bridge.forget(request_id)

    async def _answer_whole(self, request: Request, body: api.CompletionRequest | api.ChatRequest,
                            prepared: list[_Prepared], text: api.TokenText) -> dict[str, Any] | Response:  # fmt: skip
        """A whole (not streamed) response: one request, or one for each of a completion's
        prompts, run side by side; choice k * n + i is prompt k's i-th, as OpenAI numbers
        them, and one failure fails the whole. Awaited here, not in a body iterator that
        ASGI would end: a client that goes away meanwhile is watched for, and its requests
        cancelled."""
        assert self.bridge is not None
        calls = [(await self.bridge.submit(submit), submit) for _, submit, _, _ in prepared]
        ids = [submit.request_id for _, submit in calls]
        answers = await self._all_answers(request, ids, [self._whole(call, submit) for call, submit in calls])
        if isinstance(answers, Response):
            return answers
        n = calls[0][1].num_return_sequences
        choices = []
        echoes: list[api.Echo | None] = []
        rules = prepared[0][3] if isinstance(prepared[0][3], OutputRules) else None
        chat = isinstance(body, api.ChatRequest)
        nothing_generated = body.max_tokens == 0  # the one token generated is left out
        for k, ((_, _, _, echo), answer) in enumerate(zip(prepared, answers, strict=True)):
            for choice in answer:
                choice.index += k * n
                choice.prompt_log_probs = answer[0].prompt_log_probs  # the prompt's, computed once
                if nothing_generated:
                    choice.text, choice.tokens, choice.logprobs, choice.finish_reason = "", 0, [], "length"
                choices.append(choice)
                echoes.append(echo if isinstance(echo, api.Echo) else None)
        counts = [tokens for _, _, tokens, _ in prepared]
        prompt_tokens = None if None in counts else sum(c for c in counts if c is not None)
        usage = usage_of(request.scope)  # counted for the API key
        usage.prompt_tokens, usage.completion_tokens = prompt_tokens or 0, sum(c.tokens for c in choices)
        return api.whole_response(chat, ids[0], prepared[0][0], choices, prompt_tokens, text, None if chat else echoes,
                                  rules)  # fmt: skip

    # -- embeddings ---------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        """One request to the workers per input, run side by side and answered together;
        one failure fails the whole, and a client gone cancels them, as for a completion's
        several prompts."""
        try:
            body = _validated(embeddings_api.EmbeddingRequest, await self._json(request))
            inputs = body.inputs()
            model, tokenizer, max_seq_len = self._tokenizer_of(body.model)
            vocab_size = self._vocab_size(model)
            # On a thread: long inputs' tokenizing would hold up every other HTTP client.
            token_ids = await asyncio.to_thread(self._embedding_tokens, inputs, model, tokenizer, max_seq_len)
            for i, ids in enumerate(token_ids):
                embeddings_api.check_tokens(ids, i, max_seq_len, vocab_size)
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        assert self.bridge is not None
        submits = [embeddings_api.submit_for(f"embd-{uuid.uuid4().hex}", model, ids, body.pooling) for ids in token_ids]
        calls = [await self.bridge.submit(submit) for submit in submits]
        results = await self._all_answers(request, [s.request_id for s in submits], [_final(call) for call in calls])
        if isinstance(results, Response):
            return results
        try:
            vectors = [embeddings_api.vector_of(result, body.dimensions) for result in results]
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        prompt_tokens = sum(len(t) for t in token_ids)
        usage_of(request.scope).prompt_tokens = prompt_tokens  # counted for the API key
        return JSONResponse(embeddings_api.response(model, vectors, body.encoding_format, prompt_tokens))

    def _embedding_tokens(self, inputs: list[str | list[int]], model: str, tokenizer: Any,
                          max_seq_len: int | None) -> list[list[int]]:  # fmt: skip
        ids = []
        for i, item in enumerate(inputs):
            if isinstance(item, list):
                ids.append(item)
                continue
            try:
                ids.append(self.gateway.tokenizers.prompt_ids(model, item, None, max_seq_len))
            except ValueError as e:  # PromptError: a text no context of the model could hold
                raise api.ApiError(400, f"input[{i}]: {e}", "invalid_request_error", "invalid_value",
                                   f"input[{i}]") from e  # fmt: skip
        return ids

    # -- tokenizing ---------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        try:
            body = _validated(TokenizeRequest, await self._json(request))
            model, tokenizer, max_len = self._tokenizer_of(body.model)
            ids = await asyncio.to_thread(self._tokens, body, model, tokenizer)
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = _validated(DetokenizeRequest, await self._json(request))
            _, tokenizer, _ = self._tokenizer_of(body.model)
            size = tokenizer.get_vocab_size(with_added_tokens=True)
            bad = [t for t in body.tokens if not 0 <= t < size]
            if bad:
                raise api.ApiError(400, f"tokens: {bad[0]} is outside the vocabulary (size {size})",
                                   "invalid_request_error", "invalid_value", "tokens")  # fmt: skip
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: Request) -> Response:
        """What a client needs to tokenize as the server does (?model=, else the default model)."""
        try:
            model, tokenizer, max_len = self._tokenizer_of(request.query_params.get("model"))
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        bos, eos = self.gateway.tokenizers.special_tokens(model)
        return JSONResponse({"model": model, "tokenizer_class": "PreTrainedTokenizerFast",
                             "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "max_model_len": max_len,
                             "bos_token": bos, "eos_token": eos,
                             "chat_template": self.gateway.tokenizers.chat_template(model)})  # fmt: skip

    def _tokenizer_of(self, model: str | None) -> tuple[str, Any, int | None]:
        served = self._ready_models()
        name = model or (min(served) if served else None)
        tokenizer = self.gateway.tokenizers.get(name) if name is not None else None
        if name is None or tokenizer is None:
            raise api.ApiError(404, f"no tokenizer for model {name!r} (served: {sorted(served)})", "not_found_error",
                               "model_not_found", "model")  # fmt: skip
        return name, tokenizer, served.get(name)

    def _tokens(self, body: TokenizeRequest, model: str, tokenizer: Any) -> list[int]:
        try:
            if body.messages is not None:
                chat = body.chat()
                return self.gateway.tokenizers.prompt_ids(model, None, chat.template_messages(), None,
                                                          chat.template_extra())  # fmt: skip
            return list(tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens).ids)
        except ValidationError as e:
            raise api.invalid(e) from e
        except ValueError as e:  # a template's failure, arguments that are not JSON
            raise api.invalid(e) from e

    # -- the Responses API ---------------------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        try:
            raw = await self._json(request)
            try:
                body = ResponsesRequest.model_validate(raw)
            except ValidationError as e:
                raise api.invalid(e) from e
            earlier = await self._earlier_turns(body.previous_response_id)
            try:
                chat = body.chat(earlier)
            except (ValidationError, ValueError) as e:
                raise api.invalid(e) from e
            prepared = await asyncio.to_thread(self._submit, chat, True)
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        model, submit, prompt_tokens, extra = prepared
        rules = extra if isinstance(extra, OutputRules) else None
        conversation = earlier + body.input_messages()
        text = api.TokenText(self.gateway.tokenizers.get(submit.model or model))
        if body.stream:
            assert self.bridge is not None
            call = await self.bridge.submit(submit)
            await call.wait()
            first = call.events[0]  # an error before any output is still an HTTP error
            if isinstance(first, api.ApiError):
                return JSONResponse(first.body(), first.status)
            events = self._response_events(call, submit, body, model, rules, conversation, prompt_tokens,
                                           usage_of(request.scope))  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answer = await self._answer_whole(request, chat, [prepared], text)
        if isinstance(answer, Response):
            return answer
        (choice,) = answer["choices"]
        output = responses_api.output_items(choice["message"])
        response = responses_api.response_object(responses_api.new_id("resp"), body, model, output, answer["usage"],
                                                 choice["finish_reason"])  # fmt: skip
        try:
            await self._store(body, response, conversation, choice["message"])
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse(response)

    async def stored_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            if request.method == "DELETE":
                if not await self._redis(self.store.delete, response_id):
                    raise _no_response(response_id)
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
            stored = await self._redis(self.store.get, response_id)
            if stored is None:
                raise _no_response(response_id)
        except api.ApiError as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse(stored["response"])

    async def _earlier_turns(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = await self._redis(self.store.get, previous_response_id)
        if stored is None:
            raise _no_response(previous_response_id, "previous_response_id")
        return list(stored["conversation"])

    async def _store(self, body: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]],
                     message: dict[str, Any]) -> None:  # fmt: skip
        if body.store:
            await self._redis(self.store.put, response, responses_api.conversation_after(conversation, message))

    async def _redis(self, fn: Any, *args: Any) -> Any:
        """A ResponseStore call, on a thread; Redis down is a 503 that says so."""
        try:
            return await asyncio.to_thread(fn, *args)
        except redis.RedisError as e:
            raise api.ApiError(503, f"stored responses are unavailable: Redis does not answer ({e})",
                               "service_unavailable") from e

    async def _response_events(self, call: _Call, submit: protocol.Submit, body: ResponsesRequest, model: str,
                               rules: OutputRules | None, conversation: list[dict[str, Any]],
                               prompt_tokens: int | None, usage: Usage) -> AsyncIterator[bytes]:  # fmt: skip
        """The Responses API's stream: created, the message's text deltas as they come, the
        output items once the output ends (calls, the whole message), completed."""
        assert self.bridge is not None
        events = responses_api.ResponseEvents(responses_api.new_id("resp"), body, model)
        splitter = ChatStream(rules) if rules is not None else None
        choices = [api.Choice(0)]
        full, done = "", False
        try:
            yield events.start().encode()
            while not done:
                await call.wait()
                out: list[str] = []
                while call.events and not done:
                    event = call.events.popleft()
                    if isinstance(event, api.ApiError):
                        yield events.error(event.message).encode()
                        return
                    deltas = [event] if isinstance(event, str) else [d for _, d, _, _ in _apply(choices, event, submit)]
                    for delta in deltas:
                        full += delta
                        pieces = splitter.feed(delta) if splitter is not None else [{"content": delta}]
                        out += [events.piece(p) for p in pieces]
                    if isinstance(event, protocol.Result) and event.is_final:
                        done = True
                        out += [events.piece(p) for p in (splitter.finish() if splitter is not None else [])]
                if out:
                    yield "".join(out).encode()
            message = rules.message(full)[0] if rules is not None else {"role": "assistant", "content": full}
            used = api.usage(prompt_tokens, choices[0].tokens + call.step_tokens)
            tail, response = events.end(message, used, choices[0].finish_reason)
            await self._store(body, response, conversation, message)
            yield tail.encode()
        finally:
            usage.prompt_tokens = prompt_tokens or 0  # counted for the API key, as a chat stream's
            usage.completion_tokens = choices[0].tokens + call.step_tokens
            if not done:
                with contextlib.suppress(Exception):
                    await self.bridge.cancel(submit.request_id)
            self.bridge.forget(submit.request_id)

    async def _cancel_all(self, request_ids: list[str]) -> None:
        assert self.bridge is not None
        for request_id in request_ids:
            with contextlib.suppress(Exception):
                await self.bridge.cancel(request_id)

    async def _json(self, request: Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.ApiError(400, f"the body is not JSON: {e}", "invalid_request_error") from e

    async def _body(self, request: Request, chat: bool) -> api.CompletionRequest | api.ChatRequest:
        raw = await self._json(request)
        try:
            return api.ChatRequest.model_validate(raw) if chat else api.CompletionRequest.model_validate(raw)
        except ValidationError as e:
            raise api.invalid(e) from e

    def _submit(self, body: api.CompletionRequest | api.ChatRequest, chat: bool) -> _Prepared:
        """The model, the Submit, the prompt's length where it is known here, and what of
        the prompt a completion's choices repeat."""
        served = self._ready_models()
        model = body.model or (min(served) if served else None)
        # As in vLLM, `model` may name a LoRA adapter: the request runs on its model, under it.
        adapters = adapter_models(list(self.gateway.workers.values()))
        lora = model if model not in served and model in adapters else None
        model = adapters[lora] if lora is not None else model
        if model is not None and served and model not in served:
            raise api.ApiError(404, f"the model {model!r} does not exist; served: {sorted(served)}"
                               + (f", LoRA adapters: {sorted(adapters)}" if adapters else ""),
                               "not_found_error", "model_not_found", "model")  # fmt: skip
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tokenizer = self.gateway.tokenizers.get(model) if model is not None else None
        prompt_ids: list[int] | None = None
        max_seq_len = served.get(model) if model else None
        try:
            # Tokenized here when the tokenizer is known (usage counts need the length, and the
            # gateway's I/O thread is spared the work); else the gateway does it once a worker is ready.
            if tokenizer is not None:
                if isinstance(body, api.ChatRequest):
                    prompt_ids = self.gateway.tokenizers.prompt_ids(model, None, body.template_messages(), max_seq_len,
                                                                    body.template_extra())  # fmt: skip
                elif isinstance(body.prompt, str):
                    prompt_ids = self.gateway.tokenizers.prompt_ids(model, body.prompt, None, max_seq_len)
                else:
                    prompt_ids = list(body.prompt)  # type: ignore[arg-type]
            vocab_size = self._vocab_size(model) if body.logit_bias else None
            submit = api.submit_for(body, request_id, model, prompt_ids, max_seq_len, lora, vocab_size)
            extra: api.Echo | OutputRules | None
            if isinstance(body, api.CompletionRequest):
                extra = api.echo_for(body, prompt_ids, tokenizer)
            else:
                extra = self._output_rules(body, model)
        except ValidationError as e:
            raise api.invalid(e) from e
        except (ValueError, ChatTemplateError) as e:
            raise api.invalid(e) from e
        return lora or model or "", submit, None if prompt_ids is None else len(prompt_ids), extra

    def _output_rules(self, body: api.ChatRequest, model: str | None) -> OutputRules | None:
        template = self.gateway.tokenizers.chat_template(model)
        choice = body.call_choice()
        parser = tool_calls.parser_for(template, self.gateway.config.tool_parser)
        tools = None if choice == "none" else ToolUse(parser, choice)
        thinking = reasoning.parser_for(template, self.reasoning_parser)
        return None if tools is None and thinking is None else OutputRules(tools, thinking)

    async def _whole(self, call: _Call, submit: protocol.Submit) -> list[api.Choice]:
        choices = [api.Choice(i) for i in range(submit.num_return_sequences)]
        events = call.events
        while True:
            await call.wait()
            while events:
                event = events.popleft()
                if isinstance(event, str):
                    choices[0].text += event
                    continue
                if isinstance(event, api.ApiError):
                    raise event
                _apply(choices, event, submit)
                if event.is_final:
                    choices[0].tokens += call.step_tokens
                    return choices

    async def _sse(self, call: _Call, submit: protocol.Submit, model: str, chat: bool, prompt_tokens: int | None,
                   include_usage: bool, text: api.TokenText, usage: Usage,
                   rules: OutputRules | None = None) -> AsyncIterator[bytes]:  # fmt: skip
        assert self.bridge is not None
        request_id = submit.request_id
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}  # fmt: skip
        before, after = _step_chunk(head, chat)
        choices = [api.Choice(i) for i in range(submit.num_return_sequences)]
        offsets = [0] * len(choices)
        # With tools or reasoning, a chat's text goes through a splitter: reasoning, content, tool_calls deltas.
        splitters = None if rules is None else [ChatStream(rules) for _ in choices]
        events = call.events
        done = False
        try:
            if chat:
                roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(choices))]  # fmt: skip
                yield _event({**head, "choices": roles}).encode()
            pending: list[str] = []  # what the events queued so far make: one write for all of them
            while True:
                if not events:
                    if pending:
                        yield "".join(pending).encode()
                        pending.clear()
                    await call.wait()
                event = events.popleft()
                if isinstance(event, str):  # a plain step: its chunk from the template
                    if splitters is not None:
                        pending += [_event({**head, "choices": [item]})
                                    for item in _tool_items(splitters[0], 0, event, None, None)]  # fmt: skip
                        continue
                    if event:
                        pending.append(before + encode_basestring_ascii(event) + after)
                        offsets[0] += len(event)
                    continue
                if isinstance(event, api.ApiError):
                    pending.append(_event(event.body()))
                    break
                out = []
                for index, delta, entries, reason in _apply(choices, event, submit):
                    if splitters is not None:
                        lp = api.chat_logprobs(entries, text) if entries else None
                        pending += [_event({**head, "choices": [item]})
                                    for item in _tool_items(splitters[index], index, delta, lp, reason)]  # fmt: skip
                        continue
                    if chat:
                        lp = api.chat_logprobs(entries, text) if entries else None
                        item = {"index": index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                                "finish_reason": reason}  # fmt: skip
                    else:
                        lp = api.completion_logprobs(entries, text, offsets[index]) if entries else None
                        item = {"index": index, "text": delta, "logprobs": lp, "finish_reason": reason}
                    offsets[index] += len(delta)
                    out.append(item)
                if out:
                    pending.append(_event({**head, "choices": out}))
                if event.is_final:
                    done = True
                    if include_usage:
                        used = api.usage(prompt_tokens, sum(c.tokens for c in choices) + call.step_tokens)
                        pending.append(_event({**head, "choices": [], "usage": used}))
                    break
            pending.append("data: [DONE]\n\n")
            yield "".join(pending).encode()
        finally:
            # What was generated, streamed whole or not, is counted for the API key.
            usage.prompt_tokens = prompt_tokens or 0
            usage.completion_tokens = sum(c.tokens for c in choices) + call.step_tokens
            if not done:  # the client went away (or the stream failed): stop the request
                with contextlib.suppress(Exception):
                    await self.bridge.cancel(request_id)
            self.bridge.forget(request_id)


def _tool_items(splitter: ChatStream, index: int, delta: str, logprobs: dict[str, Any] | None,
                reason: str | None) -> list[dict[str, Any]]:
    """A chat choice's streamed items when its output is split (reasoning, tools): the
    splitter's deltas for this text, the log probs on the first, the finish reason
    ("tool_calls" once there are calls) on the last."""
    deltas = splitter.feed(delta) if delta else []
    if reason is not None:
        deltas += splitter.finish()
        if splitter.calls and (reason == "stop" or splitter.forced):
            reason = "tool_calls"
    if not deltas and (logprobs is not None or reason is not None):
        deltas = [{}]
    items: list[dict[str, Any]] = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                                   for d in deltas]  # fmt: skip
    if items:
        items[0]["logprobs"] = logprobs
        items[-1]["finish_reason"] = reason
    return items


async def _final(call: _Call) -> protocol.Result:
    """The final result of a request that streams nothing (an embedding's)."""
    while True:
        await call.wait()
        event = call.events.popleft()
        if isinstance(event, api.ApiError):
            raise event
        if isinstance(event, protocol.Result) and event.is_final:
            return event


def _validated(model: Any, raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise api.invalid(e) from e


def _no_response(response_id: str, param: str | None = None) -> api.ApiError:
    return api.ApiError(404, f"no stored response {response_id!r} (never stored, deleted, or expired)",
                        "not_found_error", "response_not_found", param)  # fmt: skip


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = api.ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail)), type_, str(exc.status_code))
    return JSONResponse(error.body(), exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("the HTTP front failed on %s %s", request.method, request.url.path, exc_info=exc)
    error = api.ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")
    return JSONResponse(error.body(), 500)


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (its body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict[str, Any]) -> str:
    """One server-sent event: compact JSON, ASCII only (as json.dumps makes it)."""
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


_MARK = "\x00text\x00"


def _step_chunk(head: dict[str, Any], chat: bool) -> tuple[str, str]:
    """The event of a plain step, around its text: `before + encode_basestring_ascii(text) + after`
    is `_event` of its chunk to the byte (it renders a JSON string as json.dumps does), with no
    dict built or dumped per token."""
    if chat:
        item = {"index": 0, "delta": {"content": _MARK}, "logprobs": None, "finish_reason": None}
    else:
        item = {"index": 0, "text": _MARK, "logprobs": None, "finish_reason": None}
    # The text is the last string of the chunk: whatever `head` holds comes before it.
    before, _, after = _event({**head, "choices": [item]}).rpartition(encode_basestring_ascii(_MARK))
    return before, after


def _apply(choices: list[api.Choice], r: protocol.Result,
           submit: protocol.Submit) -> list[tuple[int, str, list[Any], str | None]]:  # fmt: skip
    """Fold one result into the choices; what each changed: (index, new text, log
    prob entries, finish reason)."""
    if len(r.output_token_ids) > 1 or submit.sampling_config.beam_width > 1:
        # Beam search: whole beams, the best first (not streamed over HTTP, so this is the final).
        changed = []
        for i, ids in enumerate(r.output_token_ids[: len(choices)]):
            c = choices[i]
            c.text, c.tokens = r.text[i] if r.text else "", len(ids)
            c.finish_reason = api.finish_reason(r.finish_reasons[i]) if r.is_final else None
            c.logprobs = api.logprob_entries(r, i)
            changed.append((i, c.text, c.logprobs, c.finish_reason))
        return changed
    c = choices[r.sequence_index]
    if r.prompt_log_probs is not None:
        c.prompt_log_probs = r.prompt_log_probs
    delta = r.text[0] if r.text else ""
    entries = api.logprob_entries(r)
    c.text += delta
    c.tokens += len(r.output_token_ids[0])
    c.logprobs += entries
    reason = None
    if (r.is_sequence_final or r.is_final) and c.finish_reason is None:
        reason = c.finish_reason = api.finish_reason(r.finish_reasons[0]) or "stop"
    return [(c.index, delta, entries, reason)] if delta or entries or reason else []
