"""``llamaref serve``'s transport as a careless or hostile client finds it (issue 31): the
event loop stays free while a large prompt is tokenized, clients that leave cancel their
work wherever it waits, stalled connections are closed, shutdown answers every waiting
request 503 in under 2 s, slot files cannot lead out of their directory nor leak what they
hold, and a web page of another origin can change nothing.

The engine is held still, where a test needs requests to wait, by a job on its own thread
([`Engine.call`][llamaref.server.engine.Engine.call]) that blocks until released: the
scheduler's counters then say exactly what was decoded.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from llamaref.cli import build_parser
from llamaref.common import CLIError
from llamaref.server.main import Server, bind_sockets, check_serve_flags, new_state, server_config
from tests.support.server_support import LiveServer, make_engine

pytestmark = pytest.mark.slow


def tiny_engine(n_slots: int = 2):
    return lambda: make_engine("reference", n_slots=n_slots, n_ctx=256, n_batch=64,
                               n_ubatch=32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LiveServer(tiny_engine(), slot_save_path=tmp_path_factory.mktemp("slots"),
                     read_timeout=1.0)
    yield srv
    srv.close()


@contextmanager
def engine_held(srv):
    """The engine's thread blocked in a job until the block ends (nothing is decoded)."""
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(30)

    def call():
        try:
            srv.engine.call(hold)
        except Exception:  # the server closed while it was held
            pass
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def wait_idle(srv, timeout: float = 20.0) -> None:
    sched = srv.engine.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = srv.engine.call(lambda: any(s.is_processing for s in sched.slots)
                               or bool(sched.waiting))
        if not busy:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not become idle")


def assert_error(r, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == status
    for w in words:
        assert w in err["message"], err["message"]
    return err


# ---- item 2: nothing CPU-bound on the event loop -------------------------------------------

def test_health_answers_while_a_large_prompt_is_tokenized():
    srv = LiveServer(tiny_engine(), max_prompt_bytes=1 << 20)
    try:
        prompt = "x" * 300_000  # one long word: seconds of BPE merges
        done = threading.Event()
        t_big: list[float] = []

        def big():
            t0 = time.perf_counter()
            r = requests.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 1},
                              timeout=120)
            t_big.append(time.perf_counter() - t0)
            done.set()
            assert r.status_code == 400  # over the context, once tokenized
        thread = threading.Thread(target=big)
        thread.start()
        time.sleep(0.2)
        worst = 0.0
        while not done.is_set():
            t0 = time.perf_counter()
            assert requests.get(srv.url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
        thread.join()
        assert t_big[0] > 1.0, "the prompt was tokenized too fast to tell anything"
        assert worst < 0.5, f"/health waited {worst:.2f} s behind a tokenization"
    finally:
        srv.close()


def test_a_prompt_over_the_byte_limit_is_refused_naming_the_field():
    srv = LiveServer(tiny_engine(), max_prompt_bytes=1000)
    try:
        url = srv.url
        r = requests.post(url + "/completion", json={"prompt": "é" * 501})
        assert_error(r, 400, "'prompt'", "1002 bytes", "1000", "--max-prompt-bytes")
        r = requests.post(url + "/v1/completions", json={"prompt": ["a" * 600, "b" * 401]})
        assert_error(r, 400, "'prompt'", "1001 bytes")
        r = requests.post(url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x" * 1001}]})
        assert_error(r, 400, "'messages'")
        r = requests.post(url + "/tokenize", json={"content": "x" * 1001})
        assert_error(r, 400, "'content'")
        ok = requests.post(url + "/completion", json={"prompt": "a " * 450, "n_predict": 1})
        assert ok.status_code == 400 and "context" in ok.text  # measured, then tokenized
    finally:
        srv.close()


# ---- items 3 and 9: clients that leave ------------------------------------------------------

def _leave_after(url: str, body: dict, seconds: float) -> None:
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(url, json=body, timeout=(5, seconds), stream=True)


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_whose_client_left_while_queued_is_never_decoded(stream):
    srv = LiveServer(tiny_engine(n_slots=1))
    try:
        bodies = [{"prompt": f"request {i}: " + "w " * 60, "n_predict": 8, "stream": stream,
                   "temperature": 0} for i in range(4)]
        with engine_held(srv):
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda b: _leave_after(srv.url + "/completion", b, 0.3),
                              bodies))
            time.sleep(0.5)  # each handler notices its client left
        wait_idle(srv)
        m = srv.engine.metrics
        assert m.n_prompt_tokens_processed_total == 0 and m.n_tokens_predicted_total == 0
        r = requests.post(srv.url + "/completion", json={"prompt": "after", "n_predict": 2})
        assert r.json()["tokens_predicted"] == 2
    finally:
        srv.close()


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage() + (" traceback" if record.exc_info else ""))


def test_a_client_leaving_writes_one_log_line_and_no_traceback(server, capfd):
    records = Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "")]
    for lg in loggers:
        lg.addHandler(records)
    try:
        capfd.readouterr()
        with engine_held(server):
            _leave_after(server.url + "/completion", {"prompt": "bye", "n_predict": 4}, 0.3)
            time.sleep(0.5)
        wait_idle(server)
        err = capfd.readouterr().err
        with requests.post(server.url + "/completion", stream=True, timeout=30, json={
                "prompt": "stream", "n_predict": 200, "stream": True}) as r:
            next(r.iter_lines())  # and a stream left after its first event
        wait_idle(server)
        streamed = capfd.readouterr().err
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    text = err + streamed + "\n".join(records.lines)
    assert "Traceback" not in text and "CancelledError" not in text
    assert "Exception in ASGI application" not in text and "traceback" not in text
    assert len([line for line in err.splitlines() if line.strip()]) <= 1
    assert len([line for line in streamed.splitlines() if line.strip()]) <= 1


# ---- item 8: stalled connections --------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (fails if it is still open after
    ``seconds``)."""
    sock.settimeout(seconds)
    t0 = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        raise AssertionError(f"still open after {seconds} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


@pytest.mark.parametrize("sent", [
    b"",  # nothing at all
    b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",  # half a head
    b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{\"prompt\": ",  # half a body
], ids=["nothing", "partial-head", "partial-body"])
def test_a_stalled_connection_is_closed_after_the_read_timeout(server, sent):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        assert 0.5 < _closed_within(sock, 4.0) < 3.0


def test_a_slow_but_steady_request_and_keep_alive_still_work(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(2):  # two requests on one connection, each within the deadline
            head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            for i in range(0, len(head), 10):
                sock.sendall(head[i:i + 10])
                time.sleep(0.05)
            sock.settimeout(5)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)


# ---- item 10: shutdown ---------------------------------------------------------------------------

def test_shutdown_answers_every_waiting_request_503_within_2_s(tmp_path):
    srv = LiveServer(tiny_engine(), slot_save_path=tmp_path)
    url = srv.url
    calls = [("GET", "/metrics", None), ("GET", "/slots", None),
             ("POST", "/slots/0?action=save", {"filename": "s.bin"}),
             ("POST", "/completion", {"prompt": "a", "n_predict": 4}),
             ("POST", "/completion", {"prompt": "b", "n_predict": 4, "stream": True})]
    try:
        with engine_held(srv):
            with ThreadPoolExecutor(len(calls)) as pool:
                futures = [pool.submit(requests.request, m, url + p, json=b, timeout=30)
                           for m, p, b in calls]
                time.sleep(0.5)  # all of them wait on the engine
                assert not any(f.done() for f in futures)
                t0 = time.monotonic()
                srv.interrupt()
                answers = [f.result() for f in futures]
                srv.thread.join(5)
                elapsed = time.monotonic() - t0
        for r in answers:
            assert_error(r, 503, "shutting down")
        assert not srv.thread.is_alive() and elapsed <= 2.0, elapsed
        assert not os.path.exists(tmp_path / "s.bin")
    finally:
        srv.close()


# ---- items 6 and 7: slot files ------------------------------------------------------------------

def test_a_slot_file_name_too_long_for_its_temporary_file_is_refused(server):
    folder = str(server.state.slot_save_path)
    for n in (243, 250, 255):
        r = requests.post(server.url + "/slots/0?action=save", json={"filename": "x" * n})
        assert_error(r, 400, "Invalid filename", f"{n} bytes", "242")
        assert folder not in r.text
    r = requests.post(server.url + "/slots/0?action=save", json={"filename": "é" * 122})
    assert_error(r, 400, "244 bytes")
    ok = requests.post(server.url + "/slots/0?action=save", json={"filename": "y" * 242})
    assert ok.status_code == 200 and (server.state.slot_save_path / ("y" * 242)).is_file()


def test_restore_refuses_links_and_never_echoes_a_file(server, tmp_path):
    folder = server.state.slot_save_path
    outside = tmp_path / "passwd"
    outside.write_bytes(b"root:x:0:0:secret\n")
    (folder / "link.bin").symlink_to(outside)
    (folder / "junk.bin").write_bytes(b"rootSECRET" * 10)
    (folder / "dir.bin").mkdir()
    for name, words in (("link.bin", ("link.bin", "symbolic link")),
                        ("junk.bin", ("not a slot file",)),
                        ("dir.bin", ("dir.bin", "not a regular file"))):
        r = requests.post(server.url + "/slots/1?action=restore", json={"filename": name})
        assert_error(r, 400, *words)
        for leak in ("root", "SECRET", "secret", str(folder), str(tmp_path), "magic"):
            assert leak not in r.text, (name, r.text)
    r = requests.post(server.url + "/slots/1?action=restore", json={"filename": "none.bin"})
    assert_error(r, 404, "none.bin")
    assert str(folder) not in r.text


def test_an_unexpected_error_answers_500_without_its_text(server):
    class Bomb:
        def token_to_piece(self, *a, **k):
            raise RuntimeError(f"boom at {server.state.slot_save_path}/secret")

        def __getattr__(self, name):
            raise RuntimeError("/secret/place")
    tokenizer = server.state.tokenizer
    server.state.tokenizer = Bomb()
    try:
        r = requests.post(server.url + "/detokenize", json={"tokens": [1, 2]})
    finally:
        server.state.tokenizer = tokenizer
    assert_error(r, 500, "Internal server error")
    assert "secret" not in r.text and "boom" not in r.text and "Runtime" not in r.text


# ---- item 12: where a request comes from ---------------------------------------------------

@pytest.fixture(scope="module")
def guarded():
    srv = LiveServer(tiny_engine(), allowed_hosts=["127.0.0.1", "localhost", "::1"],
                     cors_origins=["https://app.example"])
    yield srv
    srv.close()


def test_a_host_header_not_of_this_server_is_refused(guarded):
    for path, method in (("/health", "GET"), ("/slots", "GET"), ("/completion", "POST")):
        r = requests.request(method, guarded.url + path, headers={"Host": "evil.example:80"},
                             json={"prompt": "x", "n_predict": 1})
        assert_error(r, 403, "'evil.example'", "--allowed-hosts")
        assert r.json()["error"]["type"] == "permission_error"
    for host in (f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}", "[::1]:1"):
        assert requests.get(guarded.url + "/health", headers={"Host": host}).status_code == 200


def test_a_page_of_another_origin_changes_nothing(guarded):
    url = guarded.url
    requests.post(url + "/completion", json={"prompt": "keep me", "n_predict": 1,
                                             "id_slot": 0})
    held = guarded.engine.call(lambda: len(guarded.engine.scheduler.slots[0].tokens))
    evil = {"Origin": "https://evil.example"}
    r = requests.post(url + "/slots/0?action=erase", headers=evil)
    assert_error(r, 403, "'https://evil.example'", "--cors-origins")
    r = requests.post(url + "/completion", headers=evil, json={"prompt": "x"})
    assert_error(r, 403)
    for ctype in ("text/plain", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x"):
        r = requests.post(url + "/completion", data=b'{"prompt": "x", "n_predict": 1}',
                          headers={"Content-Type": ctype, "Sec-Fetch-Site": "cross-site"})
        assert_error(r, 415, "application/json")
        r = requests.post(url + "/slots/0?action=erase", data=b"", headers={
            "Content-Type": ctype, "Origin": "null"})
        assert r.status_code == 403
    assert guarded.engine.call(lambda: len(guarded.engine.scheduler.slots[0].tokens)) == held
    assert held > 0
    # a client that is not a browser (curl -d sends a form type) is served, as by llama-server
    r = requests.post(url + "/completion", data=b'{"prompt": "x", "n_predict": 1}',
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    own = {"Origin": url}  # the chat page served at /
    r = requests.post(url + "/completion", headers=own, json={"prompt": "x", "n_predict": 1})
    assert r.status_code == 200


def test_cors_preflight_and_the_allow_list(guarded):
    url = guarded.url
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    r = requests.options(url + "/v1/chat/completions",
                         headers={"Origin": "https://app.example", **ask})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = requests.options(url + "/v1/chat/completions",
                         headers={"Origin": "https://evil.example", **ask})
    assert r.status_code == 204 and "access-control-allow-origin" not in r.headers
    r = requests.post(url + "/completion", headers={"Origin": "https://app.example"},
                      json={"prompt": "x", "n_predict": 1})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = requests.get(url + "/props", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_any_of_several_api_keys_is_accepted_and_nothing_else():
    srv = LiveServer(tiny_engine(), api_key=["key-one", "key-two"])
    try:
        body = {"prompt": "x", "n_predict": 1}
        for key in ("key-one", "key-two"):
            r = requests.post(srv.url + "/completion", json=body,
                              headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        for key in ("key-on", "key-one,key-two", "", "key-twoo", "KEY-ONE"):
            r = requests.post(srv.url + "/completion", json=body,
                              headers={"Authorization": f"Bearer {key}"})
            assert_error(r, 401)
        assert requests.options(srv.url + "/completion").status_code == 204  # no key asked
    finally:
        srv.close()


# ---- items 17 and 18: /metrics' header, the flags -----------------------------------------------

def test_metrics_has_the_process_start_time(server):
    r = requests.get(server.url + "/metrics")
    started = int(r.headers["Process-Start-Time-Unix"])
    assert started == int(server.state.t_start) and started <= time.time()


def test_no_ui_and_the_model_names():
    srv = LiveServer(tiny_engine(), ui=False, aliases=["tiny", "small"],
                     tags=["test", "random"])
    try:
        assert_error(requests.get(srv.url + "/"), 404)
        data = requests.get(srv.url + "/v1/models").json()["data"][0]
        assert data["id"] == "tiny" and data["aliases"] == ["tiny", "small"]
        assert data["tags"] == ["test", "random"]
    finally:
        srv.close()


def serve_args(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    check_serve_flags(args)
    return args


def test_the_flags_of_llama_server_reach_the_server(tmp_path):
    state = new_state(serve_args("-a", "one,two", "--tags", "a,b", "--no-ui", "--api-key",
                                 "k1,k2", "--cors-origins", "https://app.example,localhost",
                                 "--host", "127.0.0.1,::1", "-to", "5",
                                 "--max-prompt-bytes", "4096"))
    assert state.aliases == ["one", "two"] and state.tags == ["a", "b"] and not state.ui
    assert state.api_key == ["k1", "k2"] and state.max_prompt_bytes == 4096
    assert state.cors_origins == ["https://app.example", "localhost"]
    assert set(state.allowed_hosts) == {"127.0.0.1", "::1", "localhost"}
    assert new_state(serve_args("--host", "0.0.0.0")).allowed_hosts is None
    assert new_state(serve_args("--allowed-hosts", "*")).allowed_hosts is None
    assert new_state(serve_args("--allowed-hosts", "Box.lan")).allowed_hosts == ["box.lan"]
    assert build_parser().parse_args(["serve", "--timeout", "7"]).timeout == 7
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert serve_args("--chat-template", template).chat_template == template
    (tmp_path / "t.jinja").write_text(template)
    args = serve_args("--chat-template-file", str(tmp_path / "t.jinja"))
    assert args.chat_template == template
    for bad in (["--chat-template", "{% for %}"],
                ["--chat-template-file", str(tmp_path / "missing.jinja")],
                ["--host", "/tmp/x.sock"], ["--host", ","], ["-to", "0"],
                ["--max-prompt-bytes", "-1"]):
        with pytest.raises(CLIError):
            serve_args(*bad)


def test_the_chat_template_flag_is_the_template_of_every_chat_request():
    """``llamaref serve --chat-template T``: ``/props`` reports T, and a chat request is
    the completion of T's rendering of its messages (the same greedy tokens as
    ``/completion`` with that text), not of the model's own template."""
    from llamaref.server.main import load_engine
    from reference.chat_template import render_chat_template
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    args = serve_args("--chat-template", template, "-c", "256", "--backend", "reference",
                      "-np", "1", "--temp", "0")
    state = new_state(args)
    srv = LiveServer(lambda: load_engine(args, state), state=state)
    try:
        props = requests.get(srv.url + "/props", timeout=30).json()
        assert props["chat_template"] == template
        messages = [{"role": "user", "content": "Name a colour."}]
        chat = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": 4, "temperature": 0}).json()
        text = render_chat_template(template, messages, True, bos_token="", eos_token="")
        assert text == "<user>Name a colour.</user><assistant>"
        plain = requests.post(srv.url + "/completion", timeout=120, json={
            "prompt": text, "n_predict": 4, "temperature": 0}).json()
        assert chat["usage"]["prompt_tokens"] == plain["tokens_evaluated"]
        assert chat["choices"][0]["message"]["content"] == plain["content"]
        assert state.tokenizer.chat_template == template
    finally:
        srv.close()


def test_several_host_addresses_are_all_served():
    probe = bind_sockets(["127.0.0.1"], 0)
    port = probe[0].getsockname()[1]
    probe[0].close()
    socks = bind_sockets(["127.0.0.1", "::1"], port)
    srv = LiveServer(tiny_engine())  # its app and engine, served again on both addresses
    server = Server(server_config(srv.app), srv.state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            time.sleep(0.01)
        for host in ("127.0.0.1", "[::1]"):
            r = requests.get(f"http://{host}:{port}/health", timeout=10)
            assert r.json() == {"status": "ok"}
        with pytest.raises(CLIError, match="cannot listen"):
            bind_sockets(["127.0.0.1"], port)
    finally:
        server.should_exit = True
        thread.join(5)
        srv.close()

