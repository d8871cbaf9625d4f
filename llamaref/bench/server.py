r"""``llamaref bench-server``: an OpenAI-compatible server under load, ours beside mlx-lm's.

``llamaref bench`` times a forward; this module times what a user of a server sees. It starts
the servers as subprocesses on free localhost ports, waits for ``GET /health``, sends streaming
requests with the ``openai`` client (``AsyncOpenAI``, one ``asyncio`` task per client) and
stops the servers with SIGINT.

**What a request records** ([`RequestRecord`][]): the time it was sent, the time of each
*content chunk* (an SSE event whose delta carries text), the completion tokens (from the
``usage`` chunk that ``stream_options={"include_usage": True}`` asks for; without it, the
number of content chunks), and an error (the HTTP status, or the exception's class). From these:

- **TTFT**, time to first token: first content chunk minus send time.
- **ITL**, inter-token latency: the gap between consecutive content chunks of one stream. A
  chunk may carry more than one token (a server that batches its output), so ITL is per chunk.
- **TPOT**, time per output token: $(t_{\text{last}} - t_{\text{first}}) / (n_{\text{tokens}} - 1)$.

**What a load run reports** ([`summarize`][]): requests per second (requests that finished
without error or early close, over the wall time of the run), generated tokens per second
(every request's tokens over the same wall time), TTFT, ITL and TPOT percentiles (p50, p95,
p99; linear interpolation, NumPy's default), and errors counted by status.

Three tests (``--tests``):

- ``load`` ([`run_load`][]): $n$ clients each send ``--requests`` requests one after another.
  Rows: the client counts (``--clients 1,4,16,32``). ``--disconnect-prob p`` makes a client
  close a stream early after a random number of chunks, with probability $p$.
- ``arrivals`` ([`itl_under_arrivals`][]), *ITL while new prompts arrive*: $n$ clients stream
  long answers while another task sends a long new prompt every $k$ seconds. It reports the
  generating clients' ITL inside the window from the first arrival to the last one's answer,
  and outside it. mlx-lm's ``BatchGenerator`` alternates one decode step for the running
  streams with one prefill pass of up to 2048 prompt tokens, so a running stream waits for
  the whole pass; a server that mixes prompt chunks into the decode batch under a token
  budget keeps that gap to one step.
- ``prefix`` ([`prefix_cache_ttft`][]): a long prompt, then a second one with the same long
  prefix and another ending. Both servers keep a prompt cache; the second TTFT shows its use.

**Same weights.** mlx-lm's server reads a Hugging Face folder, so a GGUF model is converted
once with transformers (which dequantizes it to float32) into
``~/.cache/llamaref/hf-<name>`` ([`hf_dir_for`][]); both servers load that folder.

**Method.** Both servers run at once (an idle server polls its queue and costs nothing
measurable); their runs *alternate* (ours, the peer, ours, ...) at each client count and
repeat, so a drift of the machine's load hits them alike; each server answers one untimed
request first. Every run uses fresh random prompts, so no run hits a prompt cached by an
earlier one. A table cell is the median over ``--repeats`` runs; the ratio is ours / peer of
the medians (higher is better for req/s and tok/s, lower for latencies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import openai
from transformers import AutoModelForCausalLM, AutoTokenizer

from llamaref.common import CLIError
from reference.model_loader import default_model_path

__all__ = [
    "OURS_CMD", "PEER_CMD", "LoadResult", "RequestRecord", "ServerError", "ServerProcess",
    "add_arguments", "bench_load", "bench_scenarios", "draft_commands", "draft_hf_dir",
    "free_port", "hf_dir_for",
    "itl_under_arrivals", "longest_stall", "main", "make_prompts", "markdown_table",
    "median_summary", "percentile", "prefix_cache_ttft", "ratio_table", "report", "run", "run_load",
    "save_tokenizer_from_gguf", "scenario_table", "server_argv", "stream_request", "summarize",
    "window_itls",
]

OURS_CMD = ("{python} -m llamaref.cli serve -m {model} --host 127.0.0.1 --port {port} "
            "--backend accelerated -np {parallel} -kvu -c {ctx}")
"""Our server's command; ``{python}``, ``{model}``, ``{port}``, ``{parallel}`` (the most
clients of the run) and ``{ctx}`` (tokens for every slot's prompt and answer) are filled in."""

PEER_CMD = "{python} -m mlx_lm.server --model {model} --host 127.0.0.1 --port {port}"
"""mlx-lm's server with its defaults (32 decode streams, 2048-token prefill steps)."""

MODEL_NAME = "default_model"
"""The ``model`` field of every request: mlx-lm's name for the model given by ``--model``."""

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her "
    "two like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most "
    "know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part"
).split()
"""Common English words, about one token each with their leading space in a BPE vocabulary."""


class ServerError(CLIError):
    """A server did not start, did not answer ``/health`` in time, or died."""


def draft_hf_dir(hf_dir: Path, k: int, cache_root: str | Path | None = None) -> Path:
    """A HF folder of ``hf_dir``'s first ``k`` layers (its embeddings, final norm and
    output kept): the draft model both servers load for ``--draft-layers`` (cached).

    Raises:
        CLIError: ``k`` is not between 1 and the model's layer count.

    Examples:
        >>> import tempfile
        >>> import numpy as np
        >>> from safetensors.numpy import load_file, save_file
        >>> hf = Path(tempfile.mkdtemp()) / "tiny"
        >>> hf.mkdir()
        >>> _ = (hf / "config.json").write_text('{"num_hidden_layers": 3}')
        >>> w = {f"model.layers.{i}.w": np.zeros(2, np.float32) for i in range(3)}
        >>> save_file({**w, "lm_head.weight": np.ones(2, np.float32)},
        ...           str(hf / "model.safetensors"))
        >>> out = draft_hf_dir(hf, 2, cache_root=hf.parent)
        >>> out.name, sorted(load_file(str(out / "model.safetensors")))
        ('tiny-first2', ['lm_head.weight', 'model.layers.0.w', 'model.layers.1.w'])
        >>> json.loads((out / "config.json").read_text())["num_hidden_layers"]
        2
    """
    config = json.loads((hf_dir / "config.json").read_text())
    n_layer = int(config["num_hidden_layers"])
    if not 1 <= k <= n_layer:
        raise CLIError(f"--draft-layers = {k} must be between 1 and {n_layer}")
    root = Path(cache_root) if cache_root else Path.home() / ".cache" / "llamaref"
    out = root / f"{hf_dir.name}-first{k}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from safetensors.numpy import load_file, save_file
    tmp = root / f".{out.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: t for name, t in load_file(str(hf_dir / "model.safetensors")).items()
               if not name.startswith("model.layers.")
               or int(name.split(".")[2]) < k}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": k}, indent=2))
    for f in hf_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# Statistics: what one request saw, and what a run of them adds up to
# ---------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What one streaming request saw, in ``time.perf_counter`` seconds.

    Attributes:
        start: when the request was sent.
        chunk_times: when each content chunk arrived.
        end: when the stream ended (or was closed, or failed).
        usage_tokens: ``usage.completion_tokens`` of the stream, if the server sent it.
        error: the HTTP status (``"503"``) or the exception's class name; None if it went well.
        disconnected: the client closed the stream early on purpose.

    Examples:
        >>> r = RequestRecord(start=1.0, chunk_times=[1.5, 1.6, 1.8], end=1.8)
        >>> r.ttft, [round(x, 3) for x in r.itls], r.completion_tokens, round(r.tpot, 3)
        (0.5, [0.1, 0.2], 3, 0.15)
    """

    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float = math.nan
    usage_tokens: int | None = None
    error: str | None = None
    disconnected: bool = False

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first content chunk; None without one."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        """Seconds between consecutive content chunks."""
        return np.diff(self.chunk_times).tolist()

    @property
    def completion_tokens(self) -> int:
        """Tokens generated: the server's count when it sent one, else the content chunks."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two chunks."""
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


@dataclass
class LoadResult:
    """The records of one load run and its wall time.

    Attributes:
        records: every request of every client.
        wall_s: seconds from the first request sent to the last one ended.
        n_clients: concurrent clients.
    """

    records: list[RequestRecord]
    wall_s: float
    n_clients: int

    def summary(self) -> dict:
        """[`summarize`][] of this run."""
        return summarize(self.records, self.wall_s)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear interpolation); NaN when there are none.

    Args:
        values: samples.
        q: 0 to 100.

    Returns:
        The percentile, a float.

    Examples:
        >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 100), percentile([], 95)
        (2.5, 4.0, nan)
    """
    return float(np.percentile(values, q)) if len(values) else math.nan


def _ms_percentiles(name: str, seconds: list[float]) -> dict[str, float]:
    return {f"{name}_p{q}_ms": 1000 * percentile(seconds, q) for q in (50, 95, 99)}


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """Aggregate a run: throughput, latency percentiles (milliseconds), errors by status.

    Args:
        records: the run's requests.
        wall_s: the run's wall time in seconds.

    Returns:
        A dict: ``requests``, ``completed`` (no error, not closed early), ``disconnected``,
        ``tokens``, ``req_s``, ``tok_s``, ``ttft_p50_ms`` ... ``ttft_p99_ms``, the same for
        ``itl`` and ``tpot``, and ``errors`` (a dict status -> count).

    Examples:
        >>> a = RequestRecord(start=0.0, chunk_times=[0.1, 0.2, 0.3], end=0.3, usage_tokens=3)
        >>> b = RequestRecord(start=0.0, chunk_times=[0.2, 0.4], end=0.4, disconnected=True)
        >>> c = RequestRecord(start=0.0, end=0.1, error="503")
        >>> s = summarize([a, b, c], wall_s=0.5)
        >>> s["completed"], s["tokens"], s["req_s"], s["tok_s"], s["errors"]
        (1, 5, 2.0, 10.0, {'503': 1})
        >>> round(s["ttft_p50_ms"]), round(s["itl_p50_ms"]), round(s["itl_p99_ms"])
        (150, 100, 198)
    """
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.completion_tokens for r in ok)
    completed = sum(1 for r in ok if not r.disconnected)
    return {
        "requests": len(records),
        "completed": completed,
        "disconnected": sum(1 for r in ok if r.disconnected),
        "tokens": tokens,
        "wall_s": wall_s,
        "req_s": completed / wall_s if wall_s > 0 else math.nan,
        "tok_s": tokens / wall_s if wall_s > 0 else math.nan,
        **_ms_percentiles("ttft", ttfts),
        **_ms_percentiles("itl", itls),
        **_ms_percentiles("tpot", tpots),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
    }


def median_summary(summaries: list[dict]) -> dict:
    """The median of each number over several runs' summaries; errors are summed.

    Args:
        summaries: [`summarize`][] results of repeated runs.

    Returns:
        A dict with the same keys.

    Examples:
        >>> median_summary([{"tok_s": 1.0, "errors": {"500": 1}},
        ...                 {"tok_s": 3.0, "errors": {}}, {"tok_s": 2.0, "errors": {"500": 2}}])
        {'tok_s': 2.0, 'errors': {'500': 3}}
    """
    out: dict = {}
    for key in summaries[0]:
        if key == "errors":
            out[key] = dict(sum((Counter(s[key]) for s in summaries), Counter()))
        else:
            out[key] = statistics.median(s[key] for s in summaries)
    return out


def window_itls(records: list[RequestRecord], t0: float, t1: float) -> tuple[list, list]:
    """Split the streams' chunk gaps into those that end inside ``[t0, t1]`` and the rest.

    Args:
        records: generating streams.
        t0: the window's start, ``time.perf_counter`` seconds.
        t1: the window's end.

    Returns:
        ``(inside, outside)``: lists of gaps in seconds.

    Examples:
        >>> r = RequestRecord(start=0.0, chunk_times=[1.0, 1.1, 2.0, 2.1])
        >>> inside, outside = window_itls([r], 1.5, 2.05)
        >>> [round(x, 2) for x in inside], [round(x, 2) for x in outside]
        ([0.9], [0.1, 0.1])
    """
    inside, outside = [], []
    for r in records:
        for prev, t in zip(r.chunk_times[:-1], r.chunk_times[1:], strict=True):
            (inside if t0 <= t <= t1 else outside).append(t - prev)
    return inside, outside


def longest_stall(records: list[RequestRecord], t0: float, t1: float) -> float:
    """The longest time one client saw no content chunk within ``[t0, t1]``.

    The client's requests are back to back, so its chunks form one timeline; the window's
    edges count as chunks (a client silent for the whole window stalled ``t1 - t0``).

    Args:
        records: one client's requests, in order.
        t0: the window's start, ``time.perf_counter`` seconds.
        t1: the window's end.

    Returns:
        Seconds.

    Examples:
        >>> a = RequestRecord(start=0.0, chunk_times=[1.0, 1.1])
        >>> b = RequestRecord(start=1.2, chunk_times=[2.0, 2.1])
        >>> round(longest_stall([a, b], 0.5, 3.0), 3), round(longest_stall([], 0.5, 3.0), 3)
        (0.9, 2.5)
    """
    times = [t0] + [t for r in records for t in r.chunk_times if t0 < t < t1] + [t1]
    return float(np.max(np.diff(times)))


# ---------------------------------------------------------------------------------------------
# The client: streaming requests with the openai package
# ---------------------------------------------------------------------------------------------


def make_prompts(n: int, n_words: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``n_words`` random common words (about as many tokens).

    Args:
        n: how many prompts.
        n_words: words per prompt.
        seed: seed of the words; another seed gives prompts that share no cached prefix.

    Returns:
        The prompts.

    Examples:
        >>> ps = make_prompts(2, 5, seed=1)
        >>> len(ps), len(ps[0].split()), ps[0] != ps[1], ps == make_prompts(2, 5, seed=1)
        (2, 5, True, True)
    """
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() for _ in range(n)]


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                              timeout=600.0)


async def _open_stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int,
                       chat: bool, temperature: float):
    kwargs = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True,
                  stream_options={"include_usage": True})
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return await client.chat.completions.create(messages=messages, **kwargs)
    return await client.completions.create(prompt=prompt, **kwargs)


def _chunk_text(chunk, chat: bool) -> str:
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    return (choice.delta.content if chat else choice.text) or ""


async def stream_request(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int,
                         chat: bool, stop_after: int | None = None,
                         stop: asyncio.Event | None = None,
                         temperature: float = 0.0) -> RequestRecord:
    """Send one streaming completion and time its content chunks.

    Args:
        client: an ``openai.AsyncOpenAI`` client.
        model: the request's ``model`` field.
        prompt: the prompt (``/v1/completions``) or the one user message (chat).
        max_tokens: the answer's token limit.
        chat: ``/v1/chat/completions`` instead of ``/v1/completions``.
        stop_after: close the stream after this many content chunks (a client that leaves).
        stop: close the stream as soon as this event is set (checked at each chunk).
        temperature: sampling temperature (0: greedy).

    Returns:
        The [`RequestRecord`][]; failures are recorded in it, never raised.
    """
    record = RequestRecord(start=time.perf_counter())
    try:
        stream = await _open_stream(client, model, prompt, max_tokens, chat, temperature)
        try:
            async for chunk in stream:
                if chunk.usage is not None:
                    record.usage_tokens = chunk.usage.completion_tokens
                if _chunk_text(chunk, chat):
                    record.chunk_times.append(time.perf_counter())
                if (stop_after is not None and len(record.chunk_times) >= stop_after) or (
                        stop is not None and stop.is_set()):
                    record.disconnected = True
                    break
        finally:
            await stream.close()
    except openai.APIStatusError as e:
        record.error = str(e.status_code)
    except (openai.APIError, OSError, asyncio.TimeoutError) as e:
        record.error = type(e).__name__
    record.end = time.perf_counter()
    return record


def _plan(n_clients: int, n_requests: int, prompts: list[str], max_tokens: int,
          disconnect_prob: float, seed: int) -> list[list[tuple[str, int | None]]]:
    """Each client's ``(prompt, stop_after)`` list, drawn before the run starts."""
    rng = random.Random(seed)
    plan = []
    for c in range(n_clients):
        requests = []
        for i in range(n_requests):
            prompt = prompts[(c * n_requests + i) % len(prompts)]
            leave = rng.random() < disconnect_prob
            requests.append((prompt, rng.randint(1, max(1, max_tokens - 1)) if leave else None))
        plan.append(requests)
    return plan


async def _client_loop(client, model: str, requests: list, max_tokens: int,
                       chat: bool) -> list[RequestRecord]:
    return [await stream_request(client, model, prompt, max_tokens, chat, stop_after)
            for prompt, stop_after in requests]


async def run_load(base_url: str, model: str, n_clients: int, n_requests_per_client: int,
                   prompts: list[str], max_tokens: int, chat: bool,
                   disconnect_prob: float = 0.0, seed: int = 0) -> LoadResult:
    """``n_clients`` concurrent clients, each sending its streaming requests one after another.

    Args:
        base_url: ``http://host:port`` (without ``/v1``).
        model: the requests' ``model`` field.
        n_clients: concurrent clients.
        n_requests_per_client: requests each client sends in turn.
        prompts: used in order, client after client (cycled if too few).
        max_tokens: each answer's token limit.
        chat: ``/v1/chat/completions`` instead of ``/v1/completions``.
        disconnect_prob: probability that a request is closed early, after a random number
            of content chunks between 1 and ``max_tokens - 1``.
        seed: seed of those draws.

    Returns:
        [`LoadResult`][]: every record and the wall time.
    """
    plan = _plan(n_clients, n_requests_per_client, prompts, max_tokens, disconnect_prob, seed)
    async with _client(base_url) as client:
        t0 = time.perf_counter()
        per_client = await asyncio.gather(
            *(_client_loop(client, model, requests, max_tokens, chat) for requests in plan))
        wall = time.perf_counter() - t0
    return LoadResult([r for rs in per_client for r in rs], wall, n_clients)


async def _generate_until(client, model: str, prompt: str, max_tokens: int, chat: bool,
                          stop: asyncio.Event) -> list[RequestRecord]:
    """Stream answers to ``prompt`` back to back until ``stop`` is set."""
    records = []
    while not stop.is_set():
        records.append(await stream_request(client, model, prompt, max_tokens, chat, stop=stop))
        if records[-1].error is not None:
            break
    return records


async def _arrive(client, model: str, prompts: list[str], every_s: float,
                  chat: bool) -> list[RequestRecord]:
    """Send each prompt (an answer of 4 tokens) ``every_s`` seconds after the previous one."""
    tasks = []
    for i, prompt in enumerate(prompts):
        if i:
            await asyncio.sleep(every_s)
        tasks.append(asyncio.create_task(stream_request(client, model, prompt, 4, chat)))
    return list(await asyncio.gather(*tasks))


async def itl_under_arrivals(base_url: str, model: str, n_clients: int, prompts: list[str],
                             long_prompts: list[str], every_s: float, max_tokens: int,
                             chat: bool) -> dict:
    """ITL of streaming clients while long new prompts arrive every ``every_s`` seconds.

    ``n_clients`` clients stream answers (``max_tokens`` long, back to back) to ``prompts``;
    after ``every_s`` seconds of steady generation, one long prompt arrives every ``every_s``
    seconds; the window runs from the first arrival to the end of the last one's answer;
    generation goes on ``every_s`` seconds after it. Choose ``max_tokens`` so that an answer
    outlasts the window: a gap between two answers of a client is not an ITL (the next
    request may wait for the long prefill before it is admitted), which only
    ``stall_max_ms_during`` sees.

    Args:
        base_url: ``http://host:port``.
        model: the requests' ``model`` field.
        n_clients: generating clients.
        prompts: their prompts (cycled).
        long_prompts: the arriving prompts, one per arrival (distinct, so none is cached).
        every_s: seconds between arrivals, and before the first one.
        max_tokens: token limit of the generating clients' answers.
        chat: chat completions instead of completions.

    Returns:
        A dict: ``itl_p50_ms_during``, ``itl_p95_ms_during``, ``itl_max_ms_during``,
        ``itl_p95_ms_outside``, ``stall_max_ms_during`` (the longest time a generating client
        saw no content chunk in the window, across its back-to-back requests, see
        [`longest_stall`][]), ``gaps_during``, ``arrival_ttft_p50_ms``, ``window_s``,
        ``errors``.
    """
    stop = asyncio.Event()
    async with _client(base_url) as client:
        generators = [asyncio.create_task(_generate_until(
            client, model, prompts[i % len(prompts)], max_tokens, chat, stop))
            for i in range(n_clients)]
        await asyncio.sleep(every_s)
        arrivals = await _arrive(client, model, long_prompts, every_s, chat)
        await asyncio.sleep(every_s)
        stop.set()
        per_client = await asyncio.gather(*generators)
    streams = [r for rs in per_client for r in rs]
    t0, t1 = arrivals[0].start, max(r.end for r in arrivals)
    inside, outside = window_itls([r for r in streams if r.error is None], t0, t1)
    stalls = [longest_stall(rs, t0, t1) for rs in per_client]
    ttfts = [r.ttft for r in arrivals if r.ttft is not None]
    return {
        "itl_p50_ms_during": 1000 * percentile(inside, 50),
        "itl_p95_ms_during": 1000 * percentile(inside, 95),
        "itl_max_ms_during": 1000 * max(inside, default=math.nan),
        "itl_p95_ms_outside": 1000 * percentile(outside, 95),
        "stall_max_ms_during": 1000 * max(stalls, default=math.nan),
        "gaps_during": len(inside),
        "arrival_ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "window_s": t1 - t0,
        "errors": dict(Counter(r.error for r in streams + arrivals if r.error is not None)),
    }


async def prefix_cache_ttft(base_url: str, model: str, prefix: str, endings: tuple[str, str],
                            chat: bool) -> dict:
    """TTFT of a long prompt, then of one that shares its prefix and ends differently.

    Args:
        base_url: ``http://host:port``.
        model: the requests' ``model`` field.
        prefix: the long shared part (fresh, so that the first request finds no cache).
        endings: the two endings.
        chat: chat completions instead of completions.

    Returns:
        A dict: ``ttft_cold_ms``, ``ttft_cached_ms``, ``speedup`` (cold / cached), ``errors``.
    """
    async with _client(base_url) as client:
        cold = await stream_request(client, model, prefix + endings[0], 4, chat)
        warm = await stream_request(client, model, prefix + endings[1], 4, chat)
    ms = [1000 * r.ttft if r.ttft is not None else math.nan for r in (cold, warm)]
    return {"ttft_cold_ms": ms[0], "ttft_cached_ms": ms[1], "speedup": ms[0] / ms[1],
            "errors": dict(Counter(r.error for r in (cold, warm) if r.error is not None))}


# ---------------------------------------------------------------------------------------------
# Servers: subprocesses on free ports
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_argv(template: str, **fields: object) -> list[str]:
    """Split a command template as a shell would, then fill each word's ``{fields}``.

    Args:
        template: e.g. [`PEER_CMD`][]; ``{python}`` is always this interpreter.
        **fields: the other placeholders' values (``model``, ``port`` ...).

    Returns:
        The argv list; a value with spaces stays one argument.

    Examples:
        >>> server_argv("{python} -m x --model {model} --port {port}", model="/a b", port=8)[1:]
        ['-m', 'x', '--model', '/a b', '--port', '8']
    """
    return [word.format(python=sys.executable, **fields) for word in shlex.split(template)]


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


class ServerProcess:
    """A server subprocess on a free port, with its own ``TMPDIR`` and log file.

    Use as a context manager: ``__enter__`` starts it and waits until ``GET /health``
    answers 200, ``__exit__`` stops it (SIGINT, then SIGTERM, then SIGKILL).

    Args:
        name: shown in messages (``ours``, ``mlx-lm``).
        template: the command, e.g. [`PEER_CMD`][]; ``{model}`` and ``{port}`` are filled in.
        model: the HF folder (or file) both servers load.
        startup_s: how long to wait for ``/health``.
        **fields: more placeholders (``parallel``, ``ctx``).
    """

    def __init__(self, name: str, template: str, model: str | Path, startup_s: float = 300.0,
                 **fields: object):
        self.name, self.startup_s = name, startup_s
        self.port = free_port()
        self.argv = server_argv(template, model=str(model), port=self.port, **fields)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"bench-server-{name}-"))
        self.log_path = self.tmpdir / "server.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "TMPDIR": str(self.tmpdir)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n_chars: int = 2000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def wait_healthy(self) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            ServerError: the process exited, or ``startup_s`` passed; with its output's end.
        """
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} server exited ({self.proc.returncode}): "
                                  f"{shlex.join(self.argv)}\n{self.log_tail()}")
            if _get(f"{self.base_url}/health") == 200:
                return
            time.sleep(0.25)
        raise ServerError(f"{self.name} server gave no /health in {self.startup_s:.0f} s: "
                          f"{shlex.join(self.argv)}\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the process (SIGINT, SIGTERM, SIGKILL, 10 s apart) and remove its TMPDIR."""
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        shutil.rmtree(self.tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Same weights for both: a HF folder made from the GGUF
# ---------------------------------------------------------------------------------------------


def save_tokenizer_from_gguf(gguf: str | Path, out_dir: str | Path) -> None:
    """Write the GGUF's tokenizer (``tokenizer.json``, its config, the chat template).

    Args:
        gguf: a GGUF file.
        out_dir: the folder to write into.
    """
    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(out_dir))


def _convert(gguf: Path, out_dir: Path) -> None:
    """transformers dequantizes the GGUF to float32; its quantizer flag would refuse saving."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    save_tokenizer_from_gguf(gguf, out_dir)


def hf_dir_for(model: str | Path, cache_root: str | Path | None = None) -> Path:
    """The HF folder both servers load: ``model`` itself, or its conversion (cached).

    Args:
        model: a HF folder, or a GGUF file.
        cache_root: where conversions live (default ``~/.cache/llamaref``).

    Returns:
        A folder with ``config.json``, ``model.safetensors`` and ``tokenizer.json``.

    Raises:
        CLIError: ``model`` does not exist.
    """
    model = Path(model)
    if model.is_dir():
        return model
    if not model.is_file():
        raise CLIError(f"model not found: {model}")
    root = Path(cache_root) if cache_root else Path.home() / ".cache" / "llamaref"
    out = root / f"hf-{model.stem}"
    if all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out
    tmp = root / f".hf-{model.stem}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(model, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# The benchmark: servers alternating, medians, tables
# ---------------------------------------------------------------------------------------------


def _warm_up(servers: list[ServerProcess], chat: bool) -> None:
    for server in servers:
        asyncio.run(run_load(server.base_url, MODEL_NAME, 1, 1, ["Hello"], 4, chat))


def bench_load(servers: list[ServerProcess], args: argparse.Namespace) -> dict:
    """The ``load`` test: each client count, each repeat, the servers alternating.

    Returns:
        ``{server: {clients: {"median": summary, "runs": [summary, ...]}}}``.
    """
    runs: dict = {s.name: {n: [] for n in args.clients} for s in servers}
    for repeat in range(args.repeats):
        for n in args.clients:
            prompts = make_prompts(n * args.requests, args.prompt_tokens,
                                   seed=args.seed + 1000 * repeat + n)
            for server in servers:
                result = asyncio.run(run_load(server.base_url, MODEL_NAME, n, args.requests,
                                              prompts, args.max_tokens, args.chat,
                                              args.disconnect_prob, args.seed + repeat))
                runs[server.name][n].append(result.summary())
                _progress(f"load {server.name} clients={n} repeat={repeat}: "
                          f"{result.summary()['tok_s']:.1f} tok/s")
    return {name: {n: {"median": median_summary(r), "runs": r} for n, r in by_n.items()}
            for name, by_n in runs.items()}


def bench_scenarios(servers: list[ServerProcess], args: argparse.Namespace) -> dict:
    """The ``arrivals`` and ``prefix`` tests, once per repeat, the servers alternating.

    Returns:
        ``{"arrivals": {server: [result, ...]}, "prefix": {server: [result, ...]}}``.
    """
    out: dict = {t: {s.name: [] for s in servers} for t in ("arrivals", "prefix")
                 if t in args.tests}
    for repeat in range(args.repeats):
        seed = args.seed + 7919 * (repeat + 1)
        for server in servers:
            if "arrivals" in args.tests:
                out["arrivals"][server.name].append(asyncio.run(itl_under_arrivals(
                    server.base_url, MODEL_NAME, args.arrival_clients,
                    make_prompts(args.arrival_clients, 16, seed),
                    make_prompts(args.arrivals, args.long_prompt_tokens, seed + 1),
                    args.arrival_every, args.arrival_max_tokens, args.chat)))
            if "prefix" in args.tests:
                prefix = make_prompts(1, args.long_prompt_tokens, seed + 2)[0]
                out["prefix"][server.name].append(asyncio.run(prefix_cache_ttft(
                    server.base_url, MODEL_NAME, prefix, (" Then the end.", " So a tree."),
                    args.chat)))
            _progress(f"scenarios {server.name} repeat={repeat} done")
    return out


LOAD_COLUMNS = (("req/s", "req_s", "{:.2f}"), ("tok/s", "tok_s", "{:.1f}"),
                ("TTFT p50", "ttft_p50_ms", "{:.0f}"), ("TTFT p95", "ttft_p95_ms", "{:.0f}"),
                ("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p95", "itl_p95_ms", "{:.1f}"))
"""The load table's columns: header, summary key, format (latencies in milliseconds)."""


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(load: dict) -> str:
    """The ``load`` test's medians as a Markdown table: a row per client count.

    Args:
        load: [`bench_load`][]'s result.

    Returns:
        The table; latencies in milliseconds.

    Examples:
        >>> m = {"req_s": 1.0, "tok_s": 10.0, "ttft_p50_ms": 50.0, "ttft_p95_ms": 60.0,
        ...      "itl_p50_ms": 20.0, "itl_p95_ms": 25.0}
        >>> print(markdown_table({"ours": {4: {"median": m}}}))
        | clients | ours req/s | ours tok/s | ours TTFT p50 | ours TTFT p95 | ours ITL p50 | ours ITL p95 |
        | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
        | 4 | 1.00 | 10.0 | 50 | 60 | 20.0 | 25.0 |
    """  # noqa: E501
    names = list(load)
    header = ["clients"] + [f"{name} {h}" for name in names for h, _, _ in LOAD_COLUMNS]
    lines = [_row(header), _row(["---:"] * len(header))]
    for n in load[names[0]]:
        cells = [str(n)] + [fmt.format(load[name][n]["median"][key])
                            for name in names for _, key, fmt in LOAD_COLUMNS]
        lines.append(_row(cells))
    return "\n".join(lines)


def ratio_table(load: dict, ours: str = "ours", peer: str = "mlx-lm") -> str:
    """Ours / peer of each median of the ``load`` test (higher is better for req/s and tok/s).

    Examples:
        >>> a = {"req_s": 2.0, "tok_s": 20.0, "ttft_p50_ms": 50.0, "ttft_p95_ms": 60.0,
        ...      "itl_p50_ms": 20.0, "itl_p95_ms": 25.0}
        >>> b = {k: v * 2 for k, v in a.items()}
        >>> print(ratio_table({"ours": {1: {"median": a}}, "mlx-lm": {1: {"median": b}}}))
        | clients | req/s × | tok/s × | TTFT p50 × | TTFT p95 × | ITL p50 × | ITL p95 × |
        | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
        | 1 | 0.50 | 0.50 | 0.50 | 0.50 | 0.50 | 0.50 |
    """
    header = ["clients"] + [f"{h} ×" for h, _, _ in LOAD_COLUMNS]
    lines = [_row(header), _row(["---:"] * len(header))]
    for n in load[ours]:
        a, b = load[ours][n]["median"], load[peer][n]["median"]
        lines.append(_row([str(n)] + [f"{_ratio(a[key], b[key]):.2f}"
                                      for _, key, _ in LOAD_COLUMNS]))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def scenario_table(results: dict, keys: tuple[str, ...]) -> str:
    """One row per server: the median over repeats of each of ``keys``.

    Examples:
        >>> print(scenario_table({"ours": [{"x": 1.0}, {"x": 3.0}]}, ("x",)))
        | server | x |
        | --- | ---: |
        | ours | 2.0 |
    """
    lines = [_row(["server", *keys]), _row(["---"] + ["---:"] * len(keys))]
    for name, runs in results.items():
        lines.append(_row([name] + [f"{statistics.median(r[k] for r in runs):.1f}"
                                    for k in keys]))
    return "\n".join(lines)


ARRIVAL_KEYS = ("itl_p50_ms_during", "itl_p95_ms_during", "itl_max_ms_during",
                "itl_p95_ms_outside", "stall_max_ms_during", "arrival_ttft_p50_ms")
PREFIX_KEYS = ("ttft_cold_ms", "ttft_cached_ms", "speedup")


def report(load: dict | None, scenarios: dict, peer: str | None) -> str:
    """All tables of a run, in Markdown."""
    parts = []
    if load:
        parts += ["## Load (latencies in ms)", markdown_table(load)]
        if peer:
            parts += [f"## Ours / {peer}", ratio_table(load, "ours", peer)]
    if "arrivals" in scenarios:
        parts += ["## ITL of streaming clients while long prompts arrive (ms)",
                  scenario_table(scenarios["arrivals"], ARRIVAL_KEYS)]
    if "prefix" in scenarios:
        parts += ["## TTFT without and with a cached prefix (ms)",
                  scenario_table(scenarios["prefix"], PREFIX_KEYS)]
    return "\n\n".join(parts)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,16: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,4,16: {text!r}")
    return values


def _tests(text: str) -> list[str]:
    tests = [t for t in text.split(",") if t]
    unknown = set(tests) - {"load", "arrivals", "prefix"}
    if unknown or not tests:
        raise argparse.ArgumentTypeError(f"tests are load, arrivals, prefix; got {text!r}")
    return tests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``bench-server``'s options to ``parser`` (for ``llamaref bench-server``)."""
    add = parser.add_argument
    add("-m", "--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct Q4_1); "
        "a GGUF is converted once to a HF folder under ~/.cache/llamaref")
    add("--clients", type=_int_list, default=[1, 4, 16, 32], help="client counts (rows)")
    add("--requests", type=int, default=4, help="requests per client")
    add("--max-tokens", type=int, default=128, help="tokens per answer")
    add("--prompt-tokens", type=int, default=128, help="prompt length (about, in tokens)")
    add("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    add("--disconnect-prob", type=float, default=0.0,
        help="probability that a client closes a stream early")
    add("--tests", type=_tests, default=["load", "arrivals", "prefix"],
        help="comma list of load, arrivals, prefix")
    add("--arrival-clients", type=int, default=4, help="generating clients in 'arrivals'")
    add("--arrivals", type=int, default=3, help="long prompts sent in 'arrivals'")
    add("--arrival-every", type=float, default=2.0, help="seconds between arrivals")
    add("--arrival-max-tokens", type=int, default=512, help="answer length in 'arrivals'")
    add("--long-prompt-tokens", type=int, default=2000,
        help="long prompt length in 'arrivals' and 'prefix'")
    add("--vs", choices=["mlx-lm"], help="run mlx_lm.server too, alternating, and print ratios")
    add("--repeats", type=int, default=1, help="runs per test; tables show medians")
    add("--draft-layers", type=int, default=0, metavar="K",
        help="both servers draft with the model's first K layers (speculative decoding)")
    add("--draft-as", choices=["layers", "model"], default="layers",
        help="ours: --draft-layers K over the same weights, or -md of the K-layer folder")
    add("--draft-max", type=int, default=3, help="tokens drafted per step (both servers)")
    add("--ours-cmd", default=OURS_CMD, help="our server's command template")
    add("--peer-cmd", default=PEER_CMD, help="the peer's command template")
    add("--seed", type=int, default=0, help="seed of the prompts and disconnects")
    add("--json", type=Path, help="write every run's results to this file")


def _ctx(args: argparse.Namespace) -> int:
    """Tokens our server needs (llama.cpp's ``-c``: all slots together, one unified cache as
    mlx-lm has, ``-kvu``): the load test's clients each with a prompt and an answer, or the
    arrivals test's streams and long prompts, whichever is more, plus a margin of 64 tokens
    a slot."""
    load = max(args.clients) * (args.prompt_tokens + args.max_tokens + 64)
    arrivals = (args.arrival_clients + args.arrivals) * (
        args.long_prompt_tokens + args.arrival_max_tokens + 64)
    return max(load, arrivals)


def draft_commands(args: argparse.Namespace) -> tuple[str, str]:
    """Our command and the peer's, with ``--draft-layers K``'s draft added to both: ours
    drafts with the target's first K layers (``--draft-layers K``, or with ``--draft-as
    model`` the same layers loaded as a second model, ``-md {draft}``), mlx-lm loads them
    as its draft model (``--draft-model {draft}``); ``--draft-max`` tokens a step for both.

    Examples:
        >>> a = argparse.Namespace(ours_cmd="ours", peer_cmd="peer", draft_layers=4,
        ...                        draft_max=2, draft_as="layers")
        >>> draft_commands(a)
        ('ours --draft-layers 4 --draft-max 2', 'peer --draft-model {draft} --num-draft-tokens 2')
    """
    if not args.draft_layers:
        return args.ours_cmd, args.peer_cmd
    ours = (f"--draft-layers {args.draft_layers}" if args.draft_as == "layers"
            else "-md {draft}")
    return (f"{args.ours_cmd} {ours} --draft-max {args.draft_max}",
            f"{args.peer_cmd} --draft-model {{draft}} --num-draft-tokens {args.draft_max}")


def run(args: argparse.Namespace) -> dict:
    """Start the servers, run the tests, stop the servers.

    Returns:
        ``{"model", "hf_dir", "load", "arrivals"?, "prefix"?}``.
    """
    hf_dir = hf_dir_for(args.model or default_model_path())
    parallel = max(max(args.clients), args.arrival_clients + args.arrivals)
    ours_cmd, peer_cmd = draft_commands(args)
    draft = str(draft_hf_dir(hf_dir, args.draft_layers)) if args.draft_layers else ""
    specs = [("ours", ours_cmd)] + ([(args.vs, peer_cmd)] if args.vs else [])
    servers = [ServerProcess(name, cmd, hf_dir, parallel=parallel, ctx=_ctx(args),
                             draft=draft) for name, cmd in specs]
    try:
        for server in servers:
            server.__enter__()
            _progress(f"{server.name} up on {server.base_url}: {shlex.join(server.argv)}")
        _warm_up(servers, args.chat)
        load = bench_load(servers, args) if "load" in args.tests else {}
        scenarios = bench_scenarios(servers, args)
    finally:
        for server in servers:
            server.stop()
    return {"model": str(args.model or default_model_path()), "hf_dir": str(hf_dir),
            "load": load, **scenarios}


def main(argv: list[str] | None = None) -> int:
    """``llamaref bench-server``: parse ``argv``, run, print Markdown tables, write ``--json``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, or 1 after a [`ServerError`][] or another ``CLIError``.
    """
    parser = argparse.ArgumentParser(
        prog="llamaref bench-server",
        description="Load-test our OpenAI-compatible server (and mlx_lm.server with --vs).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        results = run(args)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    results["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(report(results["load"], results, args.vs))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=_jsonable))
    return 0


def _jsonable(value):
    return asdict(value) if hasattr(value, "__dataclass_fields__") else str(value)


if __name__ == "__main__":
    sys.exit(main())
