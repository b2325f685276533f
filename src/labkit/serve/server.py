"""An OpenAI-compatible completions endpoint on localhost, standard library only.

``POST /v1/completions`` takes OpenAI's body (``prompt``, ``max_tokens``, ``temperature``,
``top_p``, ``n``, ``seed``, ``stream``) plus vLLM's extensions ``top_k`` and
``stop_token_ids``. A prompt is a string (encoded by :class:`ByteTokenizer`) or a list of
token ids; each choice carries its ``token_ids`` besides its ``text``. With ``stream: true``
the reply is server-sent events, one ``data: {json}`` chunk per step that produced tokens and
``data: [DONE]`` at the end, as OpenAI's and vLLM's servers send them. ``GET /v1/models``
lists the one model.

Two kinds of threads, as in vLLM v1's split between its API server and its engine core
(which vLLM runs as separate *processes*, talking over ZeroMQ, so that tokenization,
HTTP and streaming never take the GIL from the loop that feeds the GPU):

- HTTP handler threads (:class:`http.server.ThreadingHTTPServer`) parse a request,
  hand it to the engine thread through a queue and relay what comes back;
- one engine thread owns the :class:`~labkit.serve.LLM`: it admits new requests and aborts
  between steps, runs :meth:`~labkit.serve.LLM.step` while there is work, and after each step
  sends every request its new tokens (detokenized incrementally: a UTF-8 character split
  across tokens is held back until it is whole).

A bad request (malformed JSON, an unknown field value, a prompt the engine rejects) gets a
400 with an OpenAI-style error body and touches nothing else; a client that disconnects
mid-stream has its request aborted, freeing its blocks.

>>> with CompletionServer(llm) as server:
...     reply = complete(server.url, {"prompt": "Hello", "max_tokens": 8})
"""

from __future__ import annotations

import codecs
import itertools
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .engine import LLM, RequestOutput
from .sampler import SamplingParams

# OpenAI's defaults where ours differ (SamplingParams defaults to greedy for the book's tests).
OPENAI_DEFAULTS = {"max_tokens": 16, "temperature": 1.0}
ENGINE_FAILURE = "the engine failed a step"
FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop_token_ids"}
IGNORED = {"model", "user", "stream", "prompt", "stream_options"}


class ByteTokenizer:
    """Text as its UTF-8 bytes, one token per byte: the simplest tokenizer that round-trips.

    Ids of 256 and up (a model's vocabulary may be larger) have no text and decode to U+FFFD.
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self) -> _IncrementalText:
        """A fresh incremental decoder for one stream of tokens."""
        return _IncrementalText()


class _IncrementalText:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tokens: list[int], final: bool = False) -> str:
        pieces = [self._utf8.decode(bytes([t]) if t < 256 else b"\xff") for t in tokens]
        return "".join(pieces) + (self._utf8.decode(b"", final=True) if final else "")


class BadRequest(ValueError):
    """A request the server refuses with 400 and the message."""


def parse_request(body: bytes, tokenizer: ByteTokenizer) -> tuple[list[int], SamplingParams, bool]:
    """The prompt's token ids, the sampling parameters and whether to stream, from a JSON body."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body must be JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(request).__name__}")
    unknown = set(request) - FIELDS - IGNORED
    if unknown:
        raise BadRequest(f"unsupported fields {sorted(unknown)}; this server takes {sorted(FIELDS | IGNORED)}")
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    elif not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise BadRequest(f"prompt must be a string or a list of token ids, got {prompt!r}")
    stream = request.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, got {stream!r}")
    fields = {**OPENAI_DEFAULTS, **{k: v for k, v in request.items() if k in FIELDS and v is not None}}
    if isinstance(fields.get("stop_token_ids"), list):
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return prompt, params, stream


class CompletionServer:
    """Serve ``llm`` on ``http://host:port`` (port 0: a free one) until :meth:`stop`.

    The engine thread is the only one that touches ``llm``. Use as a context manager, or
    call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, llm: LLM, *, host: str = "127.0.0.1", port: int = 0, model_name: str = "labkit-decoder",
                 tokenizer: ByteTokenizer | None = None) -> None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm must be a labkit.serve.LLM, got {type(llm).__name__}")
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = tokenizer or ByteTokenizer()
        self._commands: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._http = ThreadingHTTPServer((host, port), self._handler_class())
        self._http.daemon_threads = True
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> CompletionServer:
        if self._threads:
            raise RuntimeError("the server is already started")
        self._threads = [threading.Thread(target=self._engine_loop, name="engine-core", daemon=True),
                         threading.Thread(target=self._http.serve_forever, name="api-server", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, finish the engine thread, close the socket."""
        self._http.shutdown()
        self._stopping.set()
        for thread in self._threads:
            thread.join()
        self._http.server_close()

    def __enter__(self) -> CompletionServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the engine thread ------------------------------------------------------------------

    def _engine_loop(self) -> None:
        subscribers: dict[int, tuple[queue.Queue, list[int]]] = {}  # request id -> (events, tokens sent per sample)
        while not self._stopping.is_set():
            for kind, payload, events in self._pending_commands(wait=not self.llm.has_unfinished()):
                if kind == "add":
                    prompt, params = payload
                    request_id = self.llm.add_request(prompt, params)
                    subscribers[request_id] = (events, [0] * params.n)
                else:  # "abort": the client of this events queue left; its request may have finished meanwhile
                    for request_id, (queued, _) in subscribers.items():
                        if queued is events and self.llm.progress(request_id)[1] is None:
                            self.llm.abort(request_id)
            if self.llm.has_unfinished():
                try:
                    self.llm.step()
                except Exception as exc:  # a failing step must not leave its clients waiting forever
                    self._fail_all(subscribers, f"{ENGINE_FAILURE}: {type(exc).__name__}: {exc}")
                    continue
            for request_id in list(subscribers):
                events, sent = subscribers[request_id]
                samples, finished = self.llm.progress(request_id)
                deltas = [list(tokens[start:]) for tokens, start in zip(samples, sent)]
                if any(deltas) or finished is not None:
                    events.put((deltas, finished))
                    subscribers[request_id] = (events, [len(t) for t in samples])
                if finished is not None:
                    self.llm.take_output(request_id)
                    del subscribers[request_id]
        for request_id, (events, _) in subscribers.items():  # shutting down: end every open stream
            self.llm.abort(request_id)
            events.put(([], self.llm.take_output(request_id)))

    def _fail_all(self, subscribers: dict, message: str) -> None:
        """End every open request with ``message`` as its error (their blocks freed)."""
        for request_id, (events, _) in subscribers.items():
            if self.llm.progress(request_id)[1] is None:
                self.llm.abort(request_id)
            out = self.llm.take_output(request_id)
            events.put(([], replace(out, finish_reason="error", error=message)))
        subscribers.clear()

    def _pending_commands(self, wait: bool) -> list[tuple]:
        """Every command queued now; when idle, wait a little for the first one."""
        commands = []
        try:
            commands.append(self._commands.get(timeout=0.02) if wait else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    # -- the HTTP side ------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args) -> None:  # keep notebooks and test logs quiet
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    return self._send_error(HTTPStatus.NOT_FOUND, f"no route GET {self.path}")
                self._send_json({"object": "list", "data": [{"id": server.model_name, "object": "model"}]})

            def do_POST(self) -> None:
                if self.path != "/v1/completions":
                    return self._send_error(HTTPStatus.NOT_FOUND, f"no route POST {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    prompt, params, stream = parse_request(self.rfile.read(length), server.tokenizer)
                except BadRequest as exc:
                    return self._send_error(HTTPStatus.BAD_REQUEST, str(exc))
                events: queue.Queue = queue.Queue()
                server._commands.put(("add", (prompt, params), events))
                completion_id = f"cmpl-{next(server._ids)}"
                if stream:
                    self._stream(completion_id, params.n, events)
                else:
                    self._reply(completion_id, prompt, events)

            def _reply(self, completion_id: str, prompt: list[int], events: queue.Queue) -> None:
                while True:
                    _, finished = events.get()
                    if finished is not None:
                        break
                if finished.error is not None:
                    return self._send_error(error_status(finished), finished.error)
                samples = [finished, *finished.more_samples]
                choices = [choice(i, s.tokens, server.tokenizer.decoder().add(list(s.tokens), final=True),
                                  s.finish_reason) for i, s in enumerate(samples)]
                completion_tokens = sum(len(s.tokens) for s in samples)
                self._send_json({**header(completion_id, server.model_name), "choices": choices,
                                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                                           "total_tokens": len(prompt) + completion_tokens}})

            def _stream(self, completion_id: str, n: int, events: queue.Queue) -> None:
                deltas, finished = events.get()
                if finished is not None and finished.error is not None:  # refused (or failed) before any token
                    return self._send_error(error_status(finished), finished.error)
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                decoders = [server.tokenizer.decoder() for _ in range(n)]
                try:
                    while True:
                        reasons = stream_reasons(finished, n)
                        choices = [choice(i, delta, decoders[i].add(delta, final=reasons[i] is not None), reasons[i])
                                   for i, delta in enumerate(deltas) if delta or reasons[i] is not None]
                        if choices:
                            self._send_event({**header(completion_id, server.model_name), "choices": choices})
                        if finished is not None:
                            break
                        deltas, finished = events.get()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client left: free its blocks
                    server._commands.put(("abort", None, events))
                self.close_connection = True

            def _send_event(self, payload: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                self.wfile.flush()

            def _send_json(self, payload: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _send_error(self, status: HTTPStatus, message: str) -> None:
                kind = "invalid_request_error" if status == HTTPStatus.BAD_REQUEST else "server_error"
                self._send_json({"error": {"message": message, "type": kind, "code": status.value}}, status)

        return Handler


def error_status(finished: RequestOutput) -> HTTPStatus:
    """500 for a request that a failing engine step ended, 400 for one the engine refused."""
    if finished.error.startswith(ENGINE_FAILURE):
        return HTTPStatus.INTERNAL_SERVER_ERROR
    return HTTPStatus.BAD_REQUEST


def header(completion_id: str, model_name: str) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model_name}


def choice(index: int, tokens, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "token_ids": list(tokens), "logprobs": None, "finish_reason": finish_reason}


def stream_reasons(finished: RequestOutput | None, n: int) -> list[str | None]:
    """Each sample's finish reason once the request has finished (sent with its last chunk)."""
    if finished is None:
        return [None] * n
    return [finished.finish_reason, *(s.finish_reason for s in finished.more_samples)]


def complete(url: str, body: dict, *, timeout: float = 60.0) -> dict:
    """POST ``body`` to ``url``'s ``/v1/completions`` (not streamed); the JSON reply.
    An error reply raises :class:`urllib.error.HTTPError` with the server's message."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": False}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        message = json.loads(exc.read())["error"]["message"]
        raise urllib.error.HTTPError(exc.url, exc.code, message, exc.headers, None) from None


def stream(url: str, body: dict, *, timeout: float = 60.0) -> Iterator[dict]:
    """POST ``body`` with ``stream: true``; yield each server-sent event's JSON until ``[DONE]``."""
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        message = json.loads(exc.read())["error"]["message"]
        raise urllib.error.HTTPError(exc.url, exc.code, message, exc.headers, None) from None
    with response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line.removeprefix(b"data: ")
            if data == b"[DONE]":
                return
            yield json.loads(data)
