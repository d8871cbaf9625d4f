"""The chat page (``llamaref/server/static/index.html``) in headless Chromium.

A stdlib HTTP server on a free port serves the page at ``/``, and, for the Stop test, a chat
stream that sends one chunk and then waits; the other tests answer
``/v1/chat/completions`` with a fake SSE body through ``page.route``.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")

PAGE = Path(__file__).resolve().parents[2] / "llamaref" / "server" / "static" / "index.html"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

pytestmark = pytest.mark.slow


def _sse(*contents: str) -> str:
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in contents]
    events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    body = ": keepalive 1/2\n\n" + "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return body + "data: [DONE]\n\n"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = PAGE.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # one chunk, then silence until the client goes away
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "partial answer"}}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                time.sleep(0.1)
                self.wfile.write(b": keepalive\n\n")
                self.wfile.flush()
        except OSError:
            pass


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium at /usr/bin/chromium")
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, base_url):
    page = browser.new_page()
    page.goto(base_url + "/")
    yield page
    page.close()


def _ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_streamed_answer_appears_and_the_conversation_is_sent_whole(page):
    bodies = []

    def answer(route):
        bodies.append(route.request.post_data_json)
        route.fulfill(status=200, content_type="text/event-stream",
                      body=_sse("Hello", ", ", "world!"))

    page.route("**/v1/chat/completions", answer)
    _ask(page, "Hi")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert page.inner_text(".message.user") == "Hi"
    assert page.inner_text(".message.assistant") == "Hello, world!"
    assert bodies[0]["stream"] is True and bodies[0]["messages"] == [
        {"role": "user", "content": "Hi"}]
    assert bodies[0]["temperature"] == 0.7 and bodies[0]["max_tokens"] == 512

    page.fill("#temperature", "0")
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    assert len(bodies) == 1
    page.type("#prompt", "line two")
    page.click("#send")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length == 2 && "
                           "!document.querySelector('.message.streaming')")
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert bodies[1]["messages"][1]["content"] == "Hello, world!"
    assert bodies[1]["messages"][2]["content"] == "line one\nline two"
    assert bodies[1]["temperature"] == 0
    assert page.inner_text("#error") == ""


def test_stop_aborts_and_keeps_the_partial_answer(page):
    _ask(page, "Tell me a long story")  # the test server sends one chunk, then waits
    page.wait_for_function(
        "document.querySelector('.message.assistant')?.textContent == 'partial answer'")
    assert page.is_enabled("#stop") and page.is_disabled("#send")
    page.click("#stop")
    page.wait_for_selector(".message.assistant.stopped")
    assert page.inner_text(".message.assistant").startswith("partial answer")
    assert page.is_disabled("#stop") and page.is_enabled("#send")
    assert page.inner_text("#error") == ""


def test_an_error_body_is_shown(page):
    error = {"error": {"message": "prompt is too long", "type": "invalid_request_error"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=400, content_type="application/json", body=json.dumps(error)))
    _ask(page, "Hi")
    page.wait_for_function("document.querySelector('#error').textContent != ''")
    assert page.inner_text("#error") == "prompt is too long"
    assert page.query_selector(".message.assistant") is None  # the empty answer is dropped
    assert page.is_enabled("#send")


def test_the_api_key_is_sent_as_a_bearer_token_and_kept(page):
    """A server started with ``--api-key``: the key typed once is sent with every turn as
    ``Authorization: Bearer`` and is still there after a reload (localStorage); an empty
    field sends no header."""
    sent = []

    def answer(route):
        sent.append(route.request.headers.get("authorization"))
        route.fulfill(status=200, content_type="text/event-stream", body=_sse("ok"))

    page.route("**/v1/chat/completions", answer)
    _ask(page, "no key yet")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    page.fill("#api-key", "sekret-key")
    _ask(page, "with a key")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length == 2 && "
                           "!document.querySelector('.message.streaming')")
    assert sent == [None, "Bearer sekret-key"]
    page.reload()
    assert page.input_value("#api-key") == "sekret-key"
    page.route("**/v1/chat/completions", answer)
    _ask(page, "after a reload")
    page.wait_for_selector(".message.assistant:not(.streaming)")
    assert sent[-1] == "Bearer sekret-key"


def test_a_wrong_key_shows_the_servers_message(page):
    error = {"error": {"code": 401, "message": "Invalid API Key",
                       "type": "authentication_error"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=401, content_type="application/json", body=json.dumps(error)))
    page.fill("#api-key", "wrong")
    _ask(page, "Hi")
    page.wait_for_function("document.querySelector('#error').textContent != ''")
    assert page.inner_text("#error") == "Invalid API Key"
