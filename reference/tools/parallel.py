r"""A server with many clients: llama.cpp's ``examples/parallel``.

``llama-parallel -np N -ns M`` simulates a server (``examples/parallel/parallel.cpp``): ``N``
clients send ``M`` requests in all, and one context serves them together. It shows the
three things a server does with a multi-sequence KV cache:

- **A shared system prompt.** Sequence 0 holds the system prompt; with ``-pps`` it is
  decoded once and ``seq_cp(0, c + 1)`` gives it to every client ``c`` (parallel.cpp:265-283).
  In one KV stream the cells are shared (no copy); with one stream per sequence the stream
  is copied; in a recurrent memory the *state* after the system prompt is copied. Without
  ``-pps`` every request carries the system text in its own prompt.
- **Continuous batching.** Each step builds one batch: the last sampled token of every
  busy client, then the whole prompt of every request that starts now, on an idle
  client's sequence (parallel.cpp:290-373). A new request joins the running batch at once.
- **Chunks that shrink when the cache is full.** The batch is decoded ``n_batch`` tokens
  at a time; when a decode answers 1 (no room in the KV cache), the chunk is halved and
  retried at the same offset, and the miss is counted; after a success ``n_batch`` is
  restored (parallel.cpp:380-418). A client that finishes in a chunk frees its cells
  before the next one, so a smaller chunk can fit where a larger one did not. At
  ``n_batch = 1`` (or on an error) the run fails.

**A request ends** when it has decoded more than 2 tokens and its last sampled token is an
end-of-generation token, or it has decoded ``n_predict`` tokens, or its response contains
``"User:"`` (truncated there) (parallel.cpp:446-449). Its sequence is then cleared and the
system prompt given back: ``seq_rm(c + 1, -1, -1)``, ``seq_cp(0, c + 1, -1, -1)`` -- a
whole-sequence removal, which a recurrent memory accepts. When every client is idle the
same is done for all of them ("clearing the KV cache").

**The requests.** A ``std::mt19937`` seeded with 1234 draws, request after request, the
question (``rng() % 9`` of the built-in prompts, or of the lines of ``-f FILE``), the number
of junk question/answer pairs (``rng() % n_junk``) and each pair (``rng() % 20``). The
order of the draws does not depend on timing, so [`make_requests`][] draws them all
before the run. A request's prompt is tokenized *without* BOS (the system prompt has it).

**Seeds.** ``--seed`` read as a signed 32-bit integer: ``>= 0`` seeds every client alike;
negative (the default ``LLAMA_DEFAULT_SEED`` is -1) gives client ``c`` the seed ``seed - c``
(parallel.cpp:227-242), so client 0 draws a random seed and the others fixed ones.
Each request resets its client's sampler (``common_sampler_reset``: history cleared,
RNG reseeded).

Where this differs from llama.cpp: the chunk is at most the context's ``n_batch`` (llama.cpp
asserts when ``-b`` exceeds a small context's batch); ``-cb`` is always on, as in llama.cpp
(the flag is registered for the server only); the log lines have no ANSI colours.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from reference.batch import Batch
from reference.common import LlamarefError
from reference.sampling import Mt19937
from reference.tools.batched import logits_row

# --8<-- [start:texts]
#: parallel.cpp:35-47
K_SYSTEM = """Transcript of a never ending dialog, where the User interacts with an \
Assistant.
The Assistant is helpful, kind, honest, good at writing, and never fails to answer the \
User's requests immediately and with precision.

User:
Recommend a nice restaurant in the area.
Assistant:
I recommend the restaurant "The Golden Duck". It is a 5 star restaurant with a great view \
of the city. The food is delicious and the service is excellent. The prices are reasonable \
and the portions are generous. The restaurant is located at 123 Main Street, New York, NY \
10001. The phone number is (212) 555-1234. The hours are Monday through Friday from 11:00 \
am to 10:00 pm. The restaurant is closed on Saturdays and Sundays.
User:
Who is Richard Feynman?
Assistant:
Richard Feynman was an American physicist who is best known for his work in quantum \
mechanics and particle physics. He was awarded the Nobel Prize in Physics in 1965 for his \
contributions to the development of quantum electrodynamics. He was a popular lecturer \
and author, and he wrote several books, including "Surely You're Joking, Mr. Feynman!" \
and "What Do You Care What Other People Think?".
"""

#: parallel.cpp:49-70: the junk questions
K_QUESTIONS = (
    "What is the tallest mountain in the world?",
    "Who was the first person to win two Nobel Prizes?",
    "Which country invented paper?",
    "What organ is primarily responsible for pumping blood throughout the body?",
    "Which planet is known for its prominent ring system?",
    "Who directed the movie 'Inception'?",
    "What is the freezing point of water in Fahrenheit?",
    "Which animal is known to have the longest lifespan?",
    "What language has the most native speakers worldwide?",
    "What is the capital city of Canada?",
    "Who is credited with inventing the World Wide Web?",
    "Which metal is liquid at room temperature?",
    "What is the term for an animal that eats both plants and meat?",
    "Who painted 'The Starry Night'?",
    "What gas do humans exhale that plants use for photosynthesis?",
    "What year did World War II end?",
    "Which continent has the most countries?",
    "Who wrote the novel 'Frankenstein'?",
    "What does DNA stand for?",
    "What is the main ingredient in traditional Japanese miso soup?",
)

#: parallel.cpp:72-93: their answers
K_ANSWERS = (
    "The tallest mountain in the world is Mount Everest.",
    "Marie Curie was the first person to win two Nobel Prizes.",
    "Paper was invented in China.",
    "The heart is the organ responsible for pumping blood.",
    "Saturn is known for its prominent ring system.",
    "Christopher Nolan directed the movie 'Inception'.",
    "The freezing point of water in Fahrenheit is 32°F.",
    "The bowhead whale is known to have the longest lifespan among mammals.",
    "Mandarin Chinese has the most native speakers in the world.",
    "The capital city of Canada is Ottawa.",
    "Tim Berners-Lee is credited with inventing the World Wide Web.",
    "Mercury is the metal that is liquid at room temperature.",
    "An animal that eats both plants and meat is called an omnivore.",
    "'The Starry Night' was painted by Vincent van Gogh.",
    "Humans exhale carbon dioxide, which plants use in photosynthesis.",
    "World War II ended in 1945.",
    "Africa is the continent with the most countries.",
    "The novel 'Frankenstein' was written by Mary Shelley.",
    "DNA stands for Deoxyribonucleic Acid.",
    "The main ingredient in traditional Japanese miso soup is fermented soybean "
    "paste.",
)

#: parallel.cpp:95-105: the requests' questions (``-f FILE`` replaces them)
K_PROMPTS = (
    "What is the meaning of life?",
    "Tell me an interesting fact about llamas.",
    "What is the best way to cook a steak?",
    "Are you familiar with the Special Theory of Relativity and can you explain it "
    "to me?",
    "Recommend some interesting books to read.",
    "What is the best way to learn a new language?",
    "How to get a job at Google?",
    "If you could have any superpower, what would it be?",
    "I want to learn how to play the piano. What would be the best way to do it?",
)
# --8<-- [end:texts]

#: parallel.cpp:164-165: the defaults it sets before parsing the flags
DEFAULT_N_PREDICT = 128
DEFAULT_N_JUNK = 1
RNG_SEED = 1234  # parallel.cpp:160


class ParallelError(LlamarefError, ValueError):
    """A simulation that cannot start (too many clients for the context, a request that
    cannot fit) or a batch that could not be decoded even one token at a time."""


# --8<-- [start:Request]
@dataclass
class Request:
    """One client request.

    Attributes:
        input: the question (``client.input``).
        n_junk: how many junk question/answer pairs precede it.
        prompt: the text sent (system text unless shared, junk, question).
        tokens: the prompt's tokens, without BOS.
    """

    input: str
    n_junk: int
    prompt: str
    tokens: list[int] = field(default_factory=list)
# --8<-- [end:Request]


# --8<-- [start:make_requests]
def make_requests(n_seq: int, n_junk: int = DEFAULT_N_JUNK,
                  prompts: Sequence[str] = K_PROMPTS, pps: bool = False,
                  tokenize: Callable[[str], list[int]] | None = None,
                  seed: int = RNG_SEED) -> list[Request]:
    r"""The ``n_seq`` requests, drawn as parallel.cpp:323-342 draws them.

    Per request: ``input = prompts[rng() % len(prompts)]``, ``n_junk_cur = rng() %
    max(1, n_junk)``, each junk pair ``rng() % 20``; the prompt is the system text
    (unless ``pps``), the pairs ``"User:\n" + Q + "\nAssistant:\n " + A + "\n"``,
    and ``"User:\n" + input + "\nAssistant:\n"``.

    Args:
        tokenize: text to tokens without BOS (``common_tokenize(ctx, text, false)``);
            None leaves ``tokens`` empty.

    Examples:
        >>> for r in make_requests(3):  # std::mt19937(1234)
        ...     print(r.input[:40])
        How to get a job at Google?
        Are you familiar with the Special Theory
        I want to learn how to play the piano. W
        >>> [r.n_junk for r in make_requests(3, n_junk=4, pps=True)]
        [3, 0, 3]
    """
    rng = Mt19937(seed)
    n_junk = max(1, n_junk)
    out = []
    for _ in range(n_seq):
        question = prompts[rng.next_u32() % len(prompts)]
        text = "" if pps else K_SYSTEM
        n_junk_cur = rng.next_u32() % n_junk
        for _ in range(n_junk_cur):
            r = rng.next_u32() % len(K_QUESTIONS)
            text += f"User:\n{K_QUESTIONS[r]}\nAssistant:\n {K_ANSWERS[r]}\n"
        text += f"User:\n{question}\nAssistant:\n"
        tokens = list(tokenize(text)) if tokenize is not None else []
        out.append(Request(question, n_junk_cur, text, tokens))
    return out
# --8<-- [end:make_requests]


# --8<-- [start:client_seeds]
def client_seeds(seed: int, n_clients: int) -> list[int]:
    """Each client's sampler seed (parallel.cpp:227-242).

    The seed is read as a signed 32-bit integer: ``>= 0``: every client gets it;
    negative: client ``c`` gets ``seed - c`` (as uint32).

    Examples:
        >>> client_seeds(42, 3)
        [42, 42, 42]
        >>> [hex(s) for s in client_seeds(0xFFFFFFFF, 3)]  # LLAMA_DEFAULT_SEED = -1
        ['0xffffffff', '0xfffffffe', '0xfffffffd']
    """
    seed &= 0xFFFFFFFF
    if seed < 2**31:
        return [seed] * n_clients
    return [(seed - c) & 0xFFFFFFFF for c in range(n_clients)]
# --8<-- [end:client_seeds]


# --8<-- [start:check_parallel]
def check_parallel(ctx: Any, n_clients: int, n_system: int,
                   requests: Sequence[Request], n_predict: int, pps: bool) -> None:
    """Refuse a simulation that cannot run on ``ctx``, before anything is decoded.

    Client ``c`` uses sequence ``c + 1`` (sequence 0 is the system prompt), so the
    context needs ``n_clients + 1`` sequences. A KV cache must hold, for the longest
    request, the system prompt (if shared), its prompt and ``n_predict`` generated
    tokens: in one stream (the smallest run), or in each stream of its own.

    Raises:
        ParallelError: no clients; too few sequences; a request that cannot fit.
    """
    if n_clients < 1:
        raise ParallelError(f"-np {n_clients}: at least one client is needed")
    if n_clients + 1 > ctx.n_seq_max:
        raise ParallelError(f"-np {n_clients} clients need {n_clients + 1} sequences "
                            "(sequence 0 holds the system prompt) and the context has "
                            f"{ctx.n_seq_max}: reduce -np or make the context with "
                            f"n_seq_max >= {n_clients + 1}")
    if any(not r.tokens for r in requests):
        raise ParallelError("a request has no tokens: every prompt needs at least one")
    if ctx.recurrent or not requests:
        return  # one state per sequence, whatever the length
    longest = max(len(r.tokens) for r in requests)
    need = (n_system if pps else 0) + longest + max(n_predict, 0)
    room = ctx.n_ctx if ctx.kv_unified else ctx.n_ctx_seq
    if need > room:
        where = "the KV cache" if ctx.kv_unified else "one sequence's KV stream"
        raise ParallelError(f"the longest request needs {need} cells (system prompt, "
                            f"prompt and -n {n_predict}) and {where} holds {room}: "
                            "increase -c or reduce -n")
# --8<-- [end:check_parallel]


# --8<-- [start:Client]
@dataclass
class Client:
    """A client of the simulation (parallel.cpp's ``struct client``).

    Attributes:
        id: the client; its sequence is ``id + 1``.
        sampler: its chain (``sample``, ``accept``, ``reset``).
        seq_id: the request it serves (its number), or -1 when idle.
        sampled: the last sampled token (decoded at the next step).
        n_past: the next position of its sequence.
        n_prompt: its request's prompt tokens.
        n_decoded: tokens decoded after the prompt.
        i_batch: the batch index of its output token, or -1.
        tokens: the sampled tokens of the request.
        response: their pieces.
    """

    id: int
    sampler: Any
    seq_id: int = -1
    sampled: int = 0
    n_past: int = 0
    n_prompt: int = 0
    n_decoded: int = 0
    i_batch: int = -1
    input: str = ""
    tokens: list[int] = field(default_factory=list)
    response: bytes = b""
    t_start_prompt: float = 0.0
    t_start_gen: float = 0.0
# --8<-- [end:Client]


# --8<-- [start:Finished]
@dataclass
class Finished:
    """A request that ended: what parallel.cpp prints for it (:462-468).

    Attributes:
        client, seq_id: who served it, and its number.
        n_prompt, n_decoded: its prompt tokens, its decoded tokens.
        seconds: from its start to its end.
        n_cache_miss: the run's cache misses so far.
        input, response: the question and the answer (cut at ``"User:"``).
        tokens: every sampled token (including the one that ended it).
    """

    client: int
    seq_id: int
    n_prompt: int
    n_decoded: int
    seconds: float
    n_cache_miss: int
    input: str
    response: bytes
    tokens: list[int]
# --8<-- [end:Finished]


class PendingBatch:
    """``common_batch``: the tokens of one step, cut into sub-batches to decode."""

    def __init__(self):
        self.token: list[int] = []
        self.pos: list[int] = []
        self.seq_id: list[list[int]] = []
        self.logits: list[bool] = []

    def __len__(self) -> int:
        return len(self.token)

    def add(self, token: int, pos: int, seq_id: int, output: bool) -> None:
        """``batch.add(token, pos, seq_id, output)``."""
        self.token.append(int(token))
        self.pos.append(pos)
        self.seq_id.append([seq_id])
        self.logits.append(output)

    def sub(self, i: int, n: int) -> Batch:
        """``batch.get_sub_batch(i, n)``: tokens ``[i, i + n)``."""
        j = i + n
        return Batch(token=self.token[i:j], pos=self.pos[i:j], seq_id=self.seq_id[i:j],
                     logits=self.logits[i:j])


# --8<-- [start:ParallelRun]
class ParallelRun:
    """The simulation: clients, the request queue, the counters.

    Args:
        ctx: a fresh Context (either twin) with ``n_seq_max >= len(samplers) + 1``.
        samplers: one chain per client (``sample``, ``accept``, ``reset``).
        system: the system prompt's tokens (with BOS).
        requests: the requests in order ([`make_requests`][]).
        n_predict: the most tokens a request decodes (``<= 0``: no limit).
        n_batch: the chunk size (``-b``), capped by ``ctx.n_batch``.
        pps: share the system prompt (``-pps``).
        is_eog: ``llama_vocab_is_eog``.
        piece: a token's bytes (``common_token_to_piece``, special tokens rendered).
        on_device: the samplers take the MLX row (``get_logits_ith_device``).
        info: llama.cpp's log lines.

    Raises:
        ParallelError: from [`check_parallel`][], before anything is decoded.

    Examples:
        >>> import numpy as np
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> class Greedy:
        ...     def sample(self, logits): return int(np.argmax(logits))
        ...     def accept(self, token): pass
        ...     def reset(self): pass
        >>> ctx = Context(hp, random_weights(hp), n_ctx=256, n_seq_max=3)
        >>> reqs = [Request("q", 0, "q", [5, 6, 7]) for _ in range(3)]
        >>> run = ParallelRun(ctx, [Greedy(), Greedy()], [1, 2], reqs, n_predict=4,
        ...                   n_batch=64, pps=True, is_eog=lambda t: False,
        ...                   piece=lambda t: b"x")
        >>> done = run.run()
        >>> [(f.client, f.seq_id, f.n_prompt, f.n_decoded) for f in done]
        [(0, 0, 3, 4), (1, 1, 3, 4), (0, 2, 3, 4)]
        >>> run.n_total_prompt, run.n_total_gen, run.n_cache_miss
        (9, 12, 0)
    """

    def __init__(self, ctx: Any, samplers: Sequence[Any], system: Sequence[int],
                 requests: Sequence[Request], n_predict: int, n_batch: int,
                 pps: bool, is_eog: Callable[[int], bool],
                 piece: Callable[[int], bytes], on_device: bool = False,
                 info: Callable[[str], None] | None = None):
        check_parallel(ctx, len(samplers), len(system), requests, n_predict, pps)
        if n_batch < 1:
            raise ParallelError(f"-b {n_batch}: the chunk needs at least one token")
        self.ctx, self.system, self.pps = ctx, list(system), pps
        self.clients = [Client(i, s) for i, s in enumerate(samplers)]
        self.requests: Iterator[Request] = iter(list(requests))
        self.n_seq, self.g_seq_id = len(requests), 0
        self.n_predict, self.n_batch = n_predict, min(n_batch, ctx.n_batch)
        self.is_eog, self.piece, self.on_device = is_eog, piece, on_device
        self.info = info or (lambda line: None)
        self.n_total_prompt = self.n_total_gen = self.n_cache_miss = 0
        self.finished: list[Finished] = []
        self.seconds = 0.0
    # --8<-- [end:ParallelRun]

    # --8<-- [start:run]
    def run(self) -> list[Finished]:
        """Serve every request (parallel.cpp:259-481); the requests in finishing order."""
        t0 = time.perf_counter()
        if self.pps:
            self.share_system_prompt()
        while True:
            batch = PendingBatch()
            self.add_ongoing(batch)
            if len(batch) == 0:  # every client is idle
                self.clear_clients()
            self.start_requests(batch)
            if len(batch) == 0:
                break
            self.decode_chunks(batch)
        self.ctx.synchronize()
        self.seconds = time.perf_counter() - t0
        return self.finished
    # --8<-- [end:run]

    # --8<-- [start:share_system_prompt]
    def share_system_prompt(self) -> None:
        """Decode the system prompt on sequence 0; ``seq_cp(0, c + 1)`` for every
        client (parallel.cpp:265-283)."""
        self.info("main: Evaluating the system prompt ...")
        n, step = len(self.system), self.ctx.n_batch
        for i in range(0, n, step):
            j = min(n, i + step)
            ret = self.ctx.decode(Batch(token=self.system[i:j], pos=list(range(i, j)),
                                        seq_id=[[0]] * (j - i), logits=[False] * (j - i)))
            if ret != 0:
                raise ParallelError(f"llama_decode() failed on the system prompt ({ret})")
        for c in range(1, len(self.clients) + 1):
            self.ctx.memory.seq_cp(0, c, -1, -1)
    # --8<-- [end:share_system_prompt]

    # --8<-- [start:add_ongoing]
    def add_ongoing(self, batch: PendingBatch) -> None:
        """Every busy client's last sampled token, at its next position, with an
        output (parallel.cpp:290-301)."""
        for c in self.clients:
            if c.seq_id == -1:
                continue
            c.i_batch = len(batch)
            batch.add(c.sampled, c.n_past, c.id + 1, True)
            c.n_past += 1
            c.n_decoded += 1

    def clear_clients(self) -> None:
        """All idle: every client's sequence back to the system prompt (:303-312)."""
        for c in range(1, len(self.clients) + 1):
            self.ctx.memory.seq_rm(c, -1, -1)
            self.ctx.memory.seq_cp(0, c, -1, -1)
        self.info("main: clearing the KV cache")
    # --8<-- [end:add_ongoing]

    # --8<-- [start:start_requests]
    def start_requests(self, batch: PendingBatch) -> None:
        """Give the next requests to idle clients; their prompts join the batch, the
        last token with an output (parallel.cpp:315-373)."""
        for c in self.clients:
            if c.seq_id != -1 or self.g_seq_id >= self.n_seq:
                continue
            req = next(self.requests)
            c.seq_id, c.input = self.g_seq_id, req.input
            c.t_start_prompt, c.t_start_gen = time.perf_counter(), 0.0
            c.tokens, c.response = [], b""
            c.n_past = len(self.system) if self.pps else 0
            c.sampler.reset()
            for t in req.tokens:
                batch.add(t, c.n_past, c.id + 1, False)
                c.n_past += 1
            batch.logits[-1] = True
            c.n_prompt, c.n_decoded, c.i_batch = len(req.tokens), 0, len(batch) - 1
            self.info(f"Client {c.id:3d}, seq {c.seq_id:4d}, junk = {req.n_junk:4d}, "
                      f"prompt = {c.n_prompt}, started decoding ...")
            self.g_seq_id += 1
    # --8<-- [end:start_requests]

    # --8<-- [start:decode_chunks]
    def decode_chunks(self, batch: PendingBatch) -> None:
        """Decode ``batch`` ``n_batch`` tokens at a time; halve the chunk when the
        cache is full (parallel.cpp:380-418).

        A decode that answers 1 counts a cache miss and is retried at the same offset
        with half the tokens; after a success the chunk size is restored and the
        clients whose output is in the chunk sample ([`sample_chunk`][]).

        Raises:
            ParallelError: a decode failed with ``n_batch = 1`` or with an error (< 0).
        """
        n_batch, i = self.n_batch, 0
        while i < len(batch):
            n_tokens = min(n_batch, len(batch) - i)
            ret = self.ctx.decode(batch.sub(i, n_tokens))
            if ret != 0:
                if n_batch == 1 or ret < 0:
                    raise ParallelError(
                        f"failed to decode the batch, n_batch = {n_batch}, ret = {ret}: "
                        "the KV cache is full; increase -c or reduce -np")
                self.info(f"main : failed to decode the batch, retrying with "
                          f"n_batch = {n_batch // 2}")
                self.n_cache_miss += 1
                n_batch //= 2
                continue
            self.sample_chunk(i, n_tokens)
            i += n_tokens
            n_batch = self.n_batch
    # --8<-- [end:decode_chunks]

    # --8<-- [start:sample_chunk]
    def sample_chunk(self, i: int, n_tokens: int) -> None:
        """Clients whose output token is in ``[i, i + n_tokens)`` sample and accept
        their next token; a request that ends is finished (parallel.cpp:420-477)."""
        for c in self.clients:
            if not i <= c.i_batch < i + n_tokens:
                continue
            row = logits_row(self.ctx, c.i_batch - i, self.on_device)
            token = int(c.sampler.sample(row))
            c.sampler.accept(token)
            if c.n_decoded == 1:  # the generation timer starts after the prompt
                c.t_start_gen = time.perf_counter()
            c.tokens.append(token)
            c.response += self.piece(token)
            c.sampled = token
            if c.n_decoded > 2 and (
                    self.is_eog(token)
                    or (self.n_predict > 0 and c.n_decoded >= self.n_predict)
                    or b"User:" in c.response):
                self.finish(c)
            c.i_batch = -1
    # --8<-- [end:sample_chunk]

    # --8<-- [start:finish]
    def finish(self, c: Client) -> None:
        """End ``c``'s request: cut the response at ``"User:"``, drop the sequence and
        give it the system prompt back (``seq_rm`` then ``seq_cp``, :451-458)."""
        response = c.response.split(b"User:")[0]
        self.ctx.memory.seq_rm(c.id + 1, -1, -1)
        self.ctx.memory.seq_cp(0, c.id + 1, -1, -1)
        seconds = time.perf_counter() - c.t_start_prompt
        done = Finished(c.id, c.seq_id, c.n_prompt, c.n_decoded, seconds,
                        self.n_cache_miss, c.input, response, list(c.tokens))
        self.finished.append(done)
        self.info(client_line(done, self.n_seq))
        self.n_total_prompt += c.n_prompt
        self.n_total_gen += c.n_decoded
        c.seq_id = -1
    # --8<-- [end:finish]


# --8<-- [start:report]
def client_line(f: Finished, n_seq: int) -> str:
    """parallel.cpp:462-468's lines for a finished request (without colours).

    Examples:
        >>> f = Finished(1, 3, 40, 12, 2.0, 0, "Hi?", b"Hello.", [])
        >>> print(client_line(f, 8))  # doctest: +NORMALIZE_WHITESPACE
        Client   1, seq   3/  8, prompt   40 t, response   12 t, time  2.00 s,
        speed 26.00 t/s, cache miss 0
        <BLANKLINE>
        Input:    Hi?
        Response: Hello.
        <BLANKLINE>
    """
    speed = (f.n_prompt + f.n_decoded) / f.seconds if f.seconds > 0 else 0.0
    response = f.response.decode("utf-8", errors="replace").strip()
    return (f"Client {f.client:3d}, seq {f.seq_id:3d}/{n_seq:3d}, prompt {f.n_prompt:4d} t, "
            f"response {f.n_decoded:4d} t, time {f.seconds:5.2f} s, speed {speed:5.2f} t/s, "
            f"cache miss {f.n_cache_miss} \n\nInput:    {f.input.strip()}\n"
            f"Response: {response}\n")


def totals(run: ParallelRun, prompt_file: str | None, model: str) -> list[str]:
    r"""parallel.cpp:485-495's summary lines.

    Examples:
        >>> class R: clients, n_seq, system, n_total_prompt, n_total_gen = [0], 2, [1], 30, 10
        >>> R.n_cache_miss, R.seconds = 1, 2.0
        >>> print("\n".join(totals(R, None, "m.gguf")))
        main: n_parallel = 1, n_sequences = 2, cont_batching = 1, system tokens = 1
        External prompt file: used built-in defaults
        Model and path used:  m.gguf
        <BLANKLINE>
        Total prompt tokens:     30, speed: 15.00 t/s
        Total gen tokens:        10, speed:  5.00 t/s
        Total speed (AVG):           speed: 20.00 t/s
        Cache misses:             1
    """
    t = run.seconds if run.seconds > 0 else float("inf")
    n_p, n_g = run.n_total_prompt, run.n_total_gen
    return [
        f"main: n_parallel = {len(run.clients)}, n_sequences = {run.n_seq}, "
        f"cont_batching = 1, system tokens = {len(run.system)}",
        f"External prompt file: {prompt_file or 'used built-in defaults'}",
        f"Model and path used:  {model}",
        "",
        f"Total prompt tokens: {n_p:6d}, speed: {n_p / t:5.2f} t/s",
        f"Total gen tokens:    {n_g:6d}, speed: {n_g / t:5.2f} t/s",
        f"Total speed (AVG):   {'':6s}  speed: {(n_p + n_g) / t:5.2f} t/s",
        f"Cache misses:        {run.n_cache_miss:6d}",
    ]
# --8<-- [end:report]


__all__ = [
    "DEFAULT_N_JUNK",
    "DEFAULT_N_PREDICT",
    "K_ANSWERS",
    "K_PROMPTS",
    "K_QUESTIONS",
    "K_SYSTEM",
    "Client",
    "Finished",
    "ParallelError",
    "ParallelRun",
    "PendingBatch",
    "Request",
    "check_parallel",
    "client_line",
    "client_seeds",
    "make_requests",
    "totals",
]
