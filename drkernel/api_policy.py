"""An OpenAI-compatible chat endpoint as the policy of `rollout()` (evaluation only).

`rollout()` speaks token ids: it renders each conversation with `tokenizer.apply_chat_template`,
encodes it, hands the ids to a `generator`, and decodes the response ids. A chat endpoint
speaks messages. Two small adapters let the endpoint run through that very loop, so an
API model is prompted, truncated, evaluated and given feedback exactly like our own policy:

- `MessageCodec` stands in for the tokenizer. Its "chat template" is the JSON list of the
  messages, and its ids are the Unicode code points of the text, so decoding is exact and
  `ChatGenerator` recovers the messages from the prompt ids. Lengths are therefore counted
  in characters: `prompt_budget(max_prompt_tokens)` converts a token budget with
  `chars_per_token` (about 4 for code with common BPE tokenizers; an estimate, not a count).
- `ChatGenerator` is `rollout()`'s `generator`: prompt ids -> messages -> one request per
  trajectory (`concurrency` daemon threads keep requests in flight) -> the reply's code
  points as `response_ids`. Log-probs are not requested (zeros): evaluation does not need them.

`OpenAIChatClient` posts to `<base_url>/chat/completions` with urllib (no extra dependency).
Failures are sorted into three kinds:

- transient (a time-out, a refused or reset connection, HTTP 408/425/429/5xx, a reply that is
  not JSON or not a chat completion): retried up to `max_attempts` times with exponential
  backoff and jitter (a server's Retry-After is honoured), one line on stderr per retry;
- the endpoint is unusable (HTTP 401/403/404: wrong key, URL or model; any other 4xx, or
  retries run out, before the endpoint has answered once): `ApiError`, which stops the run;
- one request failed (retries ran out, or a 4xx other than 429 after the endpoint has
  answered, e.g. a prompt over the server's context limit): a `Completion` with `error` set.
  `ChatGenerator` records it as that trajectory's `Failure` and requests nothing more for the
  trajectory in this rollout; the caller decides what a failed turn means (generate.py writes
  a failure row and generates the round again on resume).

`RequestProgress` counts requests, retries and failures, on a tqdm bar when one is attached.
"""

from __future__ import annotations

import dataclasses
import email.utils
import http.client
import json
import os
import queue
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any, Callable, Protocol, Sequence

from tqdm import tqdm

from drkernel.config import COUNT, NON_NEGATIVE, POSITIVE
from drkernel.generation import GenerationConfig, GenOutput

TRANSIENT_HTTP = (408, 425, 429)  # and every 5xx
FATAL_HTTP = (401, 403, 404)  # wrong key, URL or model: no request can succeed
READ_CHUNK = 65536  # bytes of a reply read at a time (between checks of the request's deadline)


class ApiError(RuntimeError):
    """The endpoint cannot be used: bad URL, key or model, or it never answered."""


@dataclasses.dataclass
class ApiConfig:
    # the values each setting accepts; a script config that mirrors one checks it (drkernel.config)
    LIMITS = {"timeout": POSITIVE, "max_attempts": COUNT, "backoff_s": NON_NEGATIVE, "max_backoff_s": NON_NEGATIVE,
              "concurrency": COUNT, "chars_per_token": POSITIVE}

    base_url: str = ""  # e.g. http://localhost:8000/v1 (vLLM, SGLang, any OpenAI-compatible server)
    model: str = ""  # the served model's name
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key; unset: no auth header
    timeout: float = 180.0  # seconds a request may wait for the server, per socket operation and in all
    max_attempts: int = 5  # tries per request, the first included
    backoff_s: float = 2.0  # wait before the 2nd attempt; doubles after each, with jitter
    max_backoff_s: float = 60.0  # longest wait between attempts (a Retry-After is capped here too)
    concurrency: int = 8  # requests in flight
    chars_per_token: float = 4.0  # prompt characters per token (`prompt_budget`)


@dataclasses.dataclass
class Completion:
    text: str
    finished: bool  # the reply ended by itself (finish_reason "stop"), not at max_tokens
    error: str | None = None  # the request failed: why (text is empty)


@dataclasses.dataclass
class Failure:
    """A trajectory whose request failed: at which rollout turn (1-based, as `TurnSample.turn`) and why."""

    turn: int
    error: str


class ChatPolicy(Protocol):
    def complete(self, messages: list[dict], cfg: GenerationConfig, seed: int | None = None,
                 label: str = "request") -> Completion: ...


# ----------------------------------------------------------------------------- tokenizer stand-in

class MessageCodec:
    """A tokenizer for `rollout()` whose ids are code points and whose template is JSON."""

    eos_token_id = None
    pad_token_id = None
    eos_token = None

    def apply_chat_template(self, messages: Sequence[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, **_) -> str:
        text = json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False)
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def __call__(self, text: str, add_special_tokens: bool = False, **_) -> dict:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_) -> str:
        return "".join(map(chr, ids))

    def messages(self, ids: Sequence[int]) -> list[dict]:
        """The conversation that `apply_chat_template` rendered into these prompt ids."""
        return json.loads(self.decode(ids))

    def __len__(self) -> int:
        return 0x110000


def prompt_budget(max_prompt_tokens: int, chars_per_token: float = ApiConfig.chars_per_token) -> int:
    """`max_prompt_tokens` in the codec's unit (characters of the JSON-rendered conversation)."""
    return int(max_prompt_tokens * chars_per_token)


# ----------------------------------------------------------------------------- progress

class RequestProgress:
    """Requests done, retried and failed. Retries and failures print one line each on stderr;
    the counts show on a tqdm bar when one is attached (its total is the caller's estimate)."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.retries = 0
        self.failures = 0
        self._lock = threading.Lock()

    def attach(self, bar: tqdm) -> None:
        with self._lock:
            self.bar = bar
            self._show(None)

    def retried(self, line: str) -> None:
        with self._lock:
            self.retries += 1
            self._show(line)

    def finished(self, failure_line: str | None = None) -> None:
        """One request is over; `failure_line` says why it failed, None when it succeeded."""
        with self._lock:
            self.failures += failure_line is not None
            if self.bar is not None:
                self.bar.update(1)
            self._show(failure_line)

    def skipped(self, n: int) -> None:
        """`n` planned requests will not be made (their trajectory failed earlier)."""
        if n and self.bar is not None and self.bar.total is not None:
            with self._lock:
                self.bar.total -= n
                self.bar.refresh()

    def _show(self, line: str | None) -> None:
        if line:
            tqdm.write(line, file=sys.stderr)
        if self.bar is not None:
            self.bar.set_postfix({"retries": self.retries, "failed": self.failures})


# ----------------------------------------------------------------------------- HTTP client

def _chat_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


class _Transient(Exception):
    """A failure worth another attempt; `retry_after`: the wait the server asked for (s)."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.retry_after = retry_after


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header (seconds or an HTTP date) in seconds from now; None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _short(data: bytes | str, n: int = 200) -> str:
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def _read_by(resp: http.client.HTTPResponse, deadline: float) -> bytes:
    """The whole body of `resp`, or TimeoutError once `deadline` (`time.monotonic()`) has passed:
    the socket's timeout bounds each read only, so a server trickling a byte at a time would
    otherwise hold the request forever."""
    chunks = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the reply did not arrive in time")
        chunk = resp.read1(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


class OpenAIChatClient:
    """POST /chat/completions, one completion per call, retrying transient failures."""

    def __init__(self, cfg: ApiConfig, progress: RequestProgress | None = None):
        if not cfg.base_url or not cfg.model:
            raise ApiError("an API policy needs both a base URL (api_base_url) and a model name (api_model)")
        if not cfg.base_url.startswith(("http://", "https://")):
            raise ApiError(f"api_base_url must start with http:// or https://, not {cfg.base_url!r}")
        self.cfg = cfg
        self.url = _chat_url(cfg.base_url)
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.progress = progress or RequestProgress()
        # Before the first good reply a failure is the setup's (URL, model, server down) and
        # stops the run; afterwards it is that request's own.
        self.answered = False

    def _request(self, body: dict) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def _body(self, messages: list[dict], cfg: GenerationConfig, seed: int | None) -> dict:
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": int(cfg.max_new_tokens), "n": 1,
                "temperature": float(cfg.temperature) if cfg.do_sample else 0.0}
        if cfg.do_sample and cfg.top_p is not None and cfg.top_p < 1.0:
            body["top_p"] = float(cfg.top_p)
        if seed is not None:
            body["seed"] = int(seed)
        return body

    def complete(self, messages: list[dict], cfg: GenerationConfig, seed: int | None = None,
                 label: str = "request") -> Completion:
        """The reply, or a Completion with `error` once retries run out (`ApiError`: the
        endpoint is unusable). `label` names the request in the retry messages."""
        body = self._body(messages, cfg, seed)
        attempts = max(1, int(self.cfg.max_attempts))
        for attempt in range(1, attempts + 1):
            try:
                return self._attempt(body)
            except _Transient as exc:
                failure = exc
            if attempt < attempts:
                wait = self._wait(attempt, failure.retry_after)
                self.progress.retried(f"[api] {label}: {failure} (attempt {attempt}/{attempts}); "
                                      f"retrying in {wait:.1f} s")
                time.sleep(wait)
        if not self.answered:
            raise ApiError(f"{self.url} gave no usable answer in {attempts} attempts ({failure}); "
                           f"is the server up, and are api_base_url and api_timeout right?")
        return Completion("", False, error=f"{failure} (gave up after {attempts} attempts)")

    def _wait(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.cfg.max_backoff_s)
        backoff = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2 ** (attempt - 1))
        return backoff * random.uniform(0.5, 1.0)  # jitter: concurrent requests do not retry in lockstep

    def _attempt(self, body: dict) -> Completion:
        deadline = time.monotonic() + self.cfg.timeout
        try:
            with urllib.request.urlopen(self._request(body), timeout=self.cfg.timeout) as resp:
                payload = _read_by(resp, deadline)
        except urllib.error.HTTPError as exc:
            return self._http_error(exc)
        except (OSError, http.client.HTTPException) as exc:  # URLError, time-outs, resets, refusals
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise _Transient(f"no reply within {self.cfg.timeout:g} s (api_timeout)") from None
            raise _Transient(f"{type(reason).__name__}: {reason}") from None
        return self._parse(payload)

    def _http_error(self, exc: urllib.error.HTTPError) -> Completion:
        """Raise `_Transient` or `ApiError`, or return the failed Completion of this request."""
        try:
            detail = _short(exc.read())
        except (OSError, http.client.HTTPException):
            detail = ""
        if exc.code in TRANSIENT_HTTP or exc.code >= 500:
            raise _Transient(f"HTTP {exc.code}: {detail}", retry_after_s(exc.headers.get("Retry-After")))
        if exc.code in FATAL_HTTP:
            raise ApiError(f"{self.url} answered HTTP {exc.code} (check api_base_url, the key in "
                           f"${self.cfg.api_key_env} and api_model={self.cfg.model!r}): {detail}")
        if not self.answered:
            raise ApiError(f"{self.url} refused the first request with HTTP {exc.code} (check "
                           f"api_model={self.cfg.model!r} and the generation options): {detail}")
        return Completion("", False, error=f"HTTP {exc.code}: {detail}")

    def _parse(self, payload: bytes) -> Completion:
        try:
            choice = json.loads(payload)["choices"][0]
            text = choice["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):  # e.g. [[[[...]]]]
            raise _Transient(f"the reply is not a chat completion: {_short(payload, 120)!r}") from None
        if not isinstance(text, str):
            raise _Transient(f"the reply's content is not text: {_short(repr(text), 120)}")
        self.answered = True
        return Completion(text, choice.get("finish_reason") == "stop")


# ----------------------------------------------------------------------------- concurrent requests

def map_in_daemon_threads(fn: Callable[[Any], Any], jobs: Sequence, workers: int) -> list:
    """`[fn(job) for job in jobs]`, at most `workers` at a time, each in a daemon thread; the first
    exception a job raises is raised here. When the caller stops waiting (Ctrl-C, or a job raised),
    the jobs not started never start and the running ones are left behind: nothing joins a daemon
    thread, whereas a ThreadPoolExecutor joins its workers on exit, which for a hung endpoint takes
    up to api_timeout x max_attempts."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(jobs):
        todo.put(item)
    done: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(min(workers, len(jobs))):
        threading.Thread(target=_work_through, args=(fn, todo, done), daemon=True).start()
    results: list = [None] * len(jobs)
    try:
        for _ in jobs:
            index, result, error = done.get()
            if error is not None:
                raise error
            results[index] = result
    except BaseException:
        _drain(todo)
        raise
    return results


def _work_through(fn: Callable[[Any], Any], todo: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """A worker of `map_in_daemon_threads`: (index, result, exception) for each job it takes, until none is left."""
    while True:
        try:
            index, job = todo.get_nowait()
        except queue.Empty:
            return
        try:
            done.put((index, fn(job), None))
        except Exception as exc:  # handed to the caller, which raises it
            done.put((index, None, exc))


def _drain(todo: queue.SimpleQueue) -> None:
    """Take every job not started off the queue, so that no worker starts it."""
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            return


# ----------------------------------------------------------------------------- rollout generator

class ChatGenerator:
    """`rollout()`'s `generator` for a chat policy; pair it with a `MessageCodec` tokenizer.

    One rollout at a time: `begin(labels)` names its trajectories (for messages) and clears
    `failures` (trajectory index -> `Failure`). A failed trajectory gets empty responses and no
    further requests until the next `begin`."""

    def __init__(self, policy: ChatPolicy, concurrency: int = ApiConfig.concurrency, codec: MessageCodec | None = None,
                 seed: int | None = None, progress: RequestProgress | None = None):
        self.policy = policy
        self.concurrency = max(1, int(concurrency))
        self.codec = codec or MessageCodec()
        self.seed = seed  # None: the server samples freely; else request k gets seed + k
        self.progress = progress or RequestProgress()
        self.requests = 0
        self.begin()

    def begin(self, labels: Sequence[str] = (), first_turn: int = 0) -> None:
        """Start a rollout: trajectory i is `labels[i]`, its first turn is numbered `first_turn`."""
        self.labels = list(labels)
        self.first_turn = first_turn
        self.turn = 0  # rollout turns so far (1-based once called)
        self.failures: dict[int, Failure] = {}

    def label(self, index: int) -> str:
        name = self.labels[index] if index < len(self.labels) else f"trajectory {index}"
        return f"{name} turn {self.first_turn + self.turn - 1}"

    def __call__(self, model, tokenizer, prompts: list[list[int]], cfg: GenerationConfig) -> list[GenOutput]:
        self.turn += 1
        # a distinct seed per request: several samples share one prompt, and a seed repeated
        # at every turn would replay the same random draws
        base = self.seed if self.seed is not None else cfg.seed
        seeds = [None if base is None else int(base) + self.requests + i for i in range(len(prompts))]
        self.requests += len(prompts)
        live = [i for i in range(len(prompts)) if i not in self.failures]
        self.progress.skipped(len(prompts) - len(live))
        jobs = [(self.codec.messages(prompts[i]), seeds[i], self.label(i), cfg) for i in live]
        if len(jobs) <= 1 or self.concurrency == 1:
            done = [self._complete(job) for job in jobs]
        else:
            done = map_in_daemon_threads(self._complete, jobs, self.concurrency)
        outs = [GenOutput(response_ids=[], logprobs=[], finished=False) for _ in prompts]
        for i, c in zip(live, done):
            if c.error:
                self.failures[i] = Failure(self.turn, c.error)
                continue
            ids = self.codec.encode(c.text)
            outs[i] = GenOutput(response_ids=ids, logprobs=[0.0] * len(ids), finished=bool(c.finished))
        return outs

    def _complete(self, job: tuple[list[dict], int | None, str, GenerationConfig]) -> Completion:
        messages, seed, label, cfg = job
        c = self.policy.complete(messages, cfg, seed, label=label)
        self.progress.finished(f"[api] {label}: failed: {c.error}" if c.error else None)
        return c


def make_api_policy(cfg: ApiConfig, seed: int | None = None) -> tuple[MessageCodec, ChatGenerator]:
    """(tokenizer stand-in, generator) for `rollout(None, codec, ..., generator=generator)`."""
    codec = MessageCodec()
    progress = RequestProgress()
    return codec, ChatGenerator(OpenAIChatClient(cfg, progress), cfg.concurrency, codec, seed, progress)
