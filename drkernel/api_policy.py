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
  trajectory (a thread pool keeps `concurrency` requests in flight) -> the reply's code
  points as `response_ids`. Log-probs are not requested (zeros): evaluation does not need them.

`OpenAIChatClient` posts to `<base_url>/chat/completions` with urllib (no extra dependency).
Network errors, HTTP 429 and 5xx are retried with exponential backoff; 401/403/404 (wrong
key, URL or model) raise `ApiError` at once; any other 4xx (e.g. a prompt over the server's
context limit) becomes an empty reply with `error` set, which the rollout scores as a
format error instead of stopping a long run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence

from drkernel.generation import GenerationConfig, GenOutput


class ApiError(RuntimeError):
    """The endpoint cannot be used: bad URL, key or model, or it kept failing."""


@dataclasses.dataclass
class ApiConfig:
    base_url: str  # e.g. http://localhost:8000/v1 (vLLM, SGLang, any OpenAI-compatible server)
    model: str  # the served model's name
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key; unset: no auth header
    timeout: float = 600.0  # seconds per request
    max_retries: int = 4
    backoff_s: float = 2.0  # first retry delay; doubles, at most 60 s
    concurrency: int = 8  # requests in flight
    chars_per_token: float = 4.0


@dataclasses.dataclass
class Completion:
    text: str
    finished: bool  # the reply ended by itself (finish_reason "stop"), not at max_tokens
    error: str | None = None


class ChatPolicy(Protocol):
    def complete(self, messages: list[dict], cfg: GenerationConfig, seed: int | None = None) -> Completion: ...


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


def prompt_budget(max_prompt_tokens: int, chars_per_token: float = 4.0) -> int:
    """`max_prompt_tokens` in the codec's unit (characters of the JSON-rendered conversation)."""
    return int(max_prompt_tokens * chars_per_token)


# ----------------------------------------------------------------------------- HTTP client

def _chat_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


class OpenAIChatClient:
    """POST /chat/completions, one completion per call, with bounded retries."""

    def __init__(self, cfg: ApiConfig):
        if not cfg.base_url or not cfg.model:
            raise ApiError("an API policy needs both a base URL (api_base_url) and a model name (api_model)")
        if not cfg.base_url.startswith(("http://", "https://")):
            raise ApiError(f"api_base_url must start with http:// or https://, not {cfg.base_url!r}")
        self.cfg = cfg
        self.url = _chat_url(cfg.base_url)
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None

    def _request(self, body: dict) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")

    def complete(self, messages: list[dict], cfg: GenerationConfig, seed: int | None = None) -> Completion:
        body = {"model": self.cfg.model, "messages": messages, "max_tokens": int(cfg.max_new_tokens), "n": 1,
                "temperature": float(cfg.temperature) if cfg.do_sample else 0.0}
        if cfg.do_sample and cfg.top_p is not None and cfg.top_p < 1.0:
            body["top_p"] = float(cfg.top_p)
        if seed is not None:
            body["seed"] = int(seed)
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(min(60.0, self.cfg.backoff_s * 2 ** (attempt - 1)))
            try:
                with urllib.request.urlopen(self._request(body), timeout=self.cfg.timeout) as resp:
                    payload = resp.read()
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:500].decode(errors="replace")
                if exc.code in (401, 403, 404):
                    raise ApiError(f"{self.url} answered HTTP {exc.code} (check api_base_url, the key in "
                                   f"${self.cfg.api_key_env} and api_model={self.cfg.model!r}): {detail}") from None
                if exc.code == 429 or exc.code >= 500:
                    last = f"HTTP {exc.code}: {detail}"
                    continue
                return Completion("", False, error=f"HTTP {exc.code}: {detail}")
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            return self._parse(payload)
        raise ApiError(f"{self.url}: no answer after {self.cfg.max_retries + 1} attempts ({last})")

    def _parse(self, payload: bytes) -> Completion:
        try:
            data = json.loads(payload)
            choice = data["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise ApiError(f"{self.url} did not answer with a chat completion: {payload[:300]!r}") from None
        return Completion(str(text), choice.get("finish_reason") == "stop")


# ----------------------------------------------------------------------------- rollout generator

class ChatGenerator:
    """`rollout()`'s `generator` for a chat policy; pair it with a `MessageCodec` tokenizer."""

    def __init__(self, policy: ChatPolicy, concurrency: int = 8, codec: MessageCodec | None = None,
                 seed: int | None = None):
        self.policy = policy
        self.concurrency = max(1, int(concurrency))
        self.codec = codec or MessageCodec()
        self.seed = seed  # None: the server samples freely; else request k gets seed + k
        self.requests = 0
        self.errors: list[str] = []  # replies that failed (empty responses), for the caller to report

    def __call__(self, model, tokenizer, prompts: list[list[int]], cfg: GenerationConfig) -> list[GenOutput]:
        conversations = [self.codec.messages(p) for p in prompts]
        # a distinct seed per request: several samples share one prompt, and a seed repeated
        # at every turn would replay the same random draws
        base = self.seed if self.seed is not None else cfg.seed
        seeds = [None if base is None else int(base) + self.requests + i for i in range(len(prompts))]
        self.requests += len(prompts)
        if len(prompts) <= 1 or self.concurrency == 1:
            done = [self.policy.complete(m, cfg, s) for m, s in zip(conversations, seeds)]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
                done = list(pool.map(lambda ms: self.policy.complete(ms[0], cfg, ms[1]), zip(conversations, seeds)))
        outs = []
        for c in done:
            if c.error:
                self.errors.append(c.error)
                print(f"[api_policy] empty reply: {c.error[:200]}", file=sys.stderr)
            ids = self.codec.encode(c.text)
            outs.append(GenOutput(response_ids=ids, logprobs=[0.0] * len(ids), finished=bool(c.finished)))
        return outs


def make_api_policy(cfg: ApiConfig, seed: int | None = None) -> tuple[MessageCodec, ChatGenerator]:
    """(tokenizer stand-in, generator) for `rollout(None, codec, ..., generator=generator)`."""
    codec = MessageCodec()
    return codec, ChatGenerator(OpenAIChatClient(cfg), cfg.concurrency, codec, seed)
