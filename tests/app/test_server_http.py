"""``llamaref serve`` over real HTTP on localhost, with the official ``openai`` client: the
OpenAI and llama.cpp endpoints, batching that does not change answers (16 concurrent
clients, both twins, unified and per-slot KV), prompt caching, slot files, a load of 32
streaming clients with disconnects, and 200+ malformed requests."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from playwright.sync_api import sync_playwright

from llamaref.server.app import default_allowed_hosts
from tests.support.server_corpus import malformed_requests
from tests.support.server_support import LiveServer, alone, make_engine, tokenizer

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"  # Debian's; with LLAMAREF_REQUIRE_ORACLES=1 a skip fails


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LiveServer(lambda: make_engine("reference", n_slots=4, n_ctx=256, n_batch=64,
                                         n_ubatch=32),
                     slot_save_path=tmp_path_factory.mktemp("slots"))
    yield srv
    srv.close()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def text_prompts(n: int) -> list[str]:
    return [f"Item {i}: " + " ".join(f"v{i}k{j}" for j in range(3 + i % 7)) for i in range(n)]


# ---- the OpenAI endpoints ------------------------------------------------------------------

def test_completions_streamed_and_not_agree(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"
    parts = list(c.completions.create(model="tiny", prompt="Hello there", max_tokens=8,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True}))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == r.choices[0].text
    assert parts[-1].usage.completion_tokens == 8 and parts[-1].choices == []
    assert parts[-1].usage.prompt_tokens_details.cached_tokens >= 1  # the same prompt again


def test_chat_streamed_and_not_agree(server):
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                  logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    lp = r.choices[0].logprobs.content
    assert len(lp) == 10 and all(len(t.top_logprobs) == 3 for t in lp)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in lp)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True, logprobs=True,
                                            top_logprobs=3))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    streamed_lp = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed_lp] == [t.token for t in lp]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_completions_share_the_prompt_and_seed_reproduces(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, n=3,
                             temperature=1.0, seed=11)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    r2 = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, n=3,
                              temperature=1.0, seed=11)
    assert [ch.text for ch in r.choices] == [ch.text for ch in r2.choices]


def test_stop_strings_hold_back_and_cut(server):
    c = client(server)
    full = c.completions.create(model="tiny", prompt="Tell me", max_tokens=12,
                                temperature=0).choices[0].text
    word = full[5:8]
    for stream in (False, True):
        if stream:
            parts = list(c.completions.create(model="tiny", prompt="Tell me", max_tokens=12,
                                              temperature=0, stop=[word], stream=True))
            text = "".join(p.choices[0].text for p in parts if p.choices)
            reason = [p.choices[0].finish_reason for p in parts if p.choices][-1]
        else:
            r = c.completions.create(model="tiny", prompt="Tell me", max_tokens=12,
                                     temperature=0, stop=[word])
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == full[: full.index(word)] and reason == "stop"


def test_models_and_llamacpp_endpoints(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert requests.get(server.url + "/health").json() == {"status": "ok"}
    props = requests.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 256
    toks = requests.post(server.url + "/tokenize", json={"content": "Hello world"}).json()
    ids = toks["tokens"]
    assert ids == tokenizer().tokenize("Hello world", add_special=False, parse_special=True)
    back = requests.post(server.url + "/detokenize", json={"tokens": ids}).json()
    assert back["content"] == "Hello world"
    native = requests.post(server.url + "/completion",
                           json={"prompt": "Hello", "n_predict": 4, "temperature": 0}).json()
    assert native["tokens_predicted"] == 4 and native["stop_type"] == "limit"
    assert set(native["timings"]) >= {"prompt_n", "predicted_n", "predicted_per_second"}
    metrics = requests.get(server.url + "/metrics").text
    for name in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total",
                 "requests_processing", "prompt_tokens_cached_total"):
        assert f"llamacpp:{name} " in metrics
    slots = requests.get(server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    page = requests.get(server.url + "/")
    assert page.status_code == 200 and "<textarea" in page.text


def test_native_stream_has_no_done_marker(server):
    with requests.post(server.url + "/completion", stream=True,
                       json={"prompt": "Hi", "n_predict": 5, "stream": True,
                             "temperature": 0}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] != b"data: [DONE]"
    last = json.loads(events[-1][len(b"data: "):])
    assert last["stop"] is True and last["tokens_predicted"] == 5


# ---- batching is invisible ----------------------------------------------------------------

@pytest.mark.parametrize("backend,unified", [("reference", True), ("reference", False),
                                              ("mlx", True), ("mlx", False)])
def test_16_concurrent_clients_get_the_answers_of_generate(backend, unified):
    srv = LiveServer(lambda: make_engine(backend, n_slots=4, kv_unified=unified, n_ctx=1024,
                                 n_batch=64, n_ubatch=32))
    try:
        c = client(srv)
        ps = text_prompts(16)

        def ask(p):
            r = c.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                     extra_body={"return_tokens": True})
            return r
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, ps))
        tok = tokenizer()
        for p, r in zip(ps, answers, strict=True):
            want = alone(backend, tok.tokenize(p, add_special=True, parse_special=True), 10)
            assert r.choices[0].text == tok.detokenize(want)
    finally:
        srv.close()


# ---- prompt caching -----------------------------------------------------------------------------

def test_a_shared_prefix_is_reported_cached_and_the_answer_unchanged():
    srv = LiveServer(lambda: make_engine("reference", n_slots=2, n_ctx=1024))
    try:
        c = client(srv)
        prefix = "Context: " + " ".join(f"fact{i}" for i in range(80))
        a = c.completions.create(model="tiny", prompt=prefix + " Q: first?", max_tokens=4,
                                 temperature=0)
        b = c.completions.create(model="tiny", prompt=prefix + " Q: second?", max_tokens=4,
                                 temperature=0)
        n_prefix = len(tokenizer().tokenize(prefix, add_special=True, parse_special=True))
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        assert b.usage.prompt_tokens_details.cached_tokens >= n_prefix - 1
        fresh = alone("reference", tokenizer().tokenize(prefix + " Q: second?",
                                                        add_special=True,
                                                        parse_special=True), 4)
        assert b.choices[0].text == tokenizer().detokenize(fresh)
    finally:
        srv.close()


# ---- slot files ------------------------------------------------------------------------------

def test_slots_save_erase_restore_continue(server):
    url = server.url
    prompt = "The slot file: " + " ".join(f"s{i}" for i in range(20))
    first = requests.post(url + "/completion", json={"prompt": prompt, "n_predict": 6,
                                                     "temperature": 0, "id_slot": 2,
                                                     "return_tokens": True}).json()
    saved = requests.post(url + "/slots/2?action=save", json={"filename": "s2.bin"}).json()
    assert saved["filename"] == "s2.bin" and saved["n_saved"] > 0
    assert requests.post(url + "/slots/2?action=erase").json()["n_erased"] == saved["n_saved"]
    restored = requests.post(url + "/slots/3?action=restore",
                             json={"filename": "s2.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    tok = tokenizer()
    conv = tok.tokenize(prompt, add_special=True, parse_special=True) + first["tokens"]
    cont = requests.post(url + "/completion", json={"prompt": conv, "n_predict": 5,
                                                    "temperature": 0, "id_slot": 3}).json()
    assert cont["timings"]["cache_n"] == len(conv) - 1
    assert cont["content"] == tok.detokenize(alone("reference", conv, 5, n_ctx=256))


# ---- load -------------------------------------------------------------------------------------

def test_32_streaming_clients_with_disconnects_leave_no_trace():
    srv = LiveServer(lambda: make_engine("reference", n_slots=4, n_ctx=1024, n_batch=64,
                                         n_ubatch=32))
    engine = srv.engine
    sched = engine.scheduler
    statuses: list[int] = []
    lock = threading.Lock()
    try:
        def client_loop(seed: int):
            rng = random.Random(seed)
            for k in range(4):
                body = {"prompt": f"client {seed} request {k} " + "w " * rng.randint(1, 40),
                        "n_predict": rng.randint(1, 24), "stream": True,
                        "temperature": rng.choice([0, 0.8])}
                with requests.post(srv.url + "/completion", json=body, stream=True,
                                   timeout=120) as r:
                    with lock:
                        statuses.append(r.status_code)
                    quit_after = rng.randint(1, 6) if rng.random() < 0.3 else None
                    for i, _ in enumerate(r.iter_lines()):
                        if quit_after is not None and i >= quit_after:
                            break  # the client goes away mid-stream
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(client_loop, range(32)))
        assert len(statuses) == 128 and set(statuses) == {200}
        slots = engine.call(lambda: [(s.is_processing, len(s.tokens)) for s in sched.slots])
        for _ in range(100):  # cancelled streams are dropped at the engine's next step
            if not any(busy for busy, _ in slots):
                break
            threading.Event().wait(0.05)
            slots = engine.call(lambda: [(s.is_processing, len(s.tokens))
                                         for s in sched.slots])
        assert not any(busy for busy, _ in slots) and not sched.waiting

        def held():  # what the memory holds is exactly what the slots say they hold
            return [(sched.memory.seq_pos_min(s.id), sched.memory.seq_pos_max(s.id),
                     len(s.tokens)) for s in sched.slots]
        for pmin, pmax, n in engine.call(held):
            assert (pmin, pmax) == ((0, n - 1) if n else (-1, -1))
        for i in range(4):
            requests.post(srv.url + f"/slots/{i}?action=erase")
        assert all(p == -1 for p, _, _ in engine.call(held))
    finally:
        srv.close()


# ---- errors -------------------------------------------------------------------------------------

def test_malformed_requests_get_their_error_and_the_server_answers_after(server):
    cases = malformed_requests()
    assert len(cases) >= 200
    session = requests.Session()
    for method, path, body, status in cases:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        r = session.request(method, server.url + path, timeout=60, **kw)
        assert r.status_code == status, (method, path, str(body)[:200], r.text[:300])
        err = r.json()["error"]
        assert err["code"] == status and err["message"] and err["type"]
    r = client(server).completions.create(model="tiny", prompt="still fine?", max_tokens=3,
                                          temperature=0)
    assert r.usage.completion_tokens == 3


def test_api_key_and_loading():
    srv = LiveServer(lambda: make_engine("reference", n_slots=1), api_key="sekret")
    engine = srv.engine
    try:
        r = requests.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert requests.get(srv.url + "/health").status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=1).usage
        srv.state.engine = None  # as while the model loads
        r = requests.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        srv.state.engine = engine
    finally:
        srv.close()


# ---- the chat page, in a real browser ------------------------------------------------------------

@pytest.mark.skipif(not Path(CHROMIUM).exists(),
                    reason=f"{CHROMIUM} is missing: apt-get install chromium (CI installs it)")
def test_chat_page_streams_an_answer_and_stops_in_chromium(server):
    """Debian's Chromium (driven by Playwright) on the live server's ``/``: a message gets
    a streamed answer equal to the API's; Stop ends a long answer and keeps it; a second
    turn sends the whole conversation (its prefix comes from the cache)."""
    c = client(server)
    want = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content":
                                                              "Hello"}],
                                     max_tokens=8, temperature=0).choices[0].message.content
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "8")
            page.fill("#prompt", "Hello")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.message.assistant')"
                                   ".length === 1", timeout=60_000)
            page.wait_for_function("document.querySelector('#stop').disabled",
                                   timeout=60_000)
            got = page.locator(".message.assistant").last.inner_text()
            assert got.strip() == want.strip()
            page.fill("#max-tokens", "200")
            page.fill("#prompt", "Tell me more")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.message.assistant').length"
                                   " === 2 && document.querySelector('.message.assistant"
                                   ":last-of-type').innerText.length > 3", timeout=60_000)
            page.click("#stop")
            page.wait_for_function("document.querySelector('#stop').disabled",
                                   timeout=60_000)
            assert page.locator(".message.assistant").count() == 2
            assert page.locator("#error").inner_text().strip() == ""
            assert not errors
        finally:
            browser.close()


@pytest.mark.skipif(not Path(CHROMIUM).exists(),
                    reason=f"{CHROMIUM} is missing: apt-get install chromium (CI installs it)")
def test_chat_page_with_an_api_key_in_chromium():
    """``llamaref serve --api-key`` with the default ``Host`` rules: the page loads without
    a key, a turn without one shows the 401's message, and with the key typed in the field
    the answer streams (the page's own origin is allowed to POST)."""
    srv = LiveServer(lambda: make_engine("reference", n_slots=1, n_ctx=256), api_key="sekret",
                     allowed_hosts=default_allowed_hosts(["127.0.0.1"]))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(srv.url + "/")
                page.fill("#temperature", "0")
                page.fill("#max-tokens", "4")
                page.fill("#prompt", "Hello")
                page.click("#send")
                page.wait_for_function("document.querySelector('#error').textContent != ''",
                                       timeout=60_000)
                assert page.inner_text("#error") == "Invalid API Key"
                page.fill("#api-key", "sekret")
                page.fill("#prompt", "Hello")
                page.click("#send")
                page.wait_for_function("document.querySelectorAll('.message.assistant')"
                                       ".length === 1 && document.querySelector('#stop')"
                                       ".disabled", timeout=60_000)
                assert page.inner_text("#error").strip() == ""
                assert page.locator(".message.assistant").last.inner_text().strip()
            finally:
                browser.close()
    finally:
        srv.close()
