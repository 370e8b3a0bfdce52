"""The chat page at `/` in a real browser: headless Chromium, driven by Playwright, against a `python -m helpers serve`
child process on a tiny float64 model (greedy text is then deterministic). The page's replies are checked against the
server's own non-streamed answers for the same messages: a reply streams into its bubble in several steps and ends
equal to the server's answer, a second tab keeps a conversation of its own, and a refused request shows the server's
error.

Chromium is Debian's (`make browser`, which `make test` runs), not one Playwright downloads; a machine without it fails
this test, saying how to install it."""

import os
import shutil
from itertools import pairwise

import httpx
import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.serving.checkpoint import export_for_serving
from helpers.serving.server import start_server
from helpers.text.bpe import train_bpe
from helpers.text.tokenizer_files import token_bytes

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # reported by the test, which says how to install it
    sync_playwright = None

TEXT = ("The quick brown fox jumps over the lazy dog. Ça coûte 12 €, naïve café! 日本語のテキスト. "
        "def main():\n    return 42\n") * 20
EOT = "<|endoftext|>"
CHROMIUM = "/usr/bin/chromium"  # Debian's package
WAIT_MS = 30_000  # the most any one wait in the browser takes
MAX_TOKENS = 24

# Installed on the page before a message is sent: records the last assistant bubble's text each time it changes, so
# the test sees the reply grow in steps rather than only its final text.
RECORD_THE_REPLYS_TEXTS = """() => {
  window.replyTexts = [];
  const log = document.getElementById('log');
  new MutationObserver(() => {
    const bubbles = log.querySelectorAll('.message.assistant');
    const text = bubbles.length ? bubbles[bubbles.length - 1].textContent : '';
    if (text && text !== window.replyTexts[window.replyTexts.length - 1]) window.replyTexts.push(text);
  }).observe(log, {childList: true, subtree: true, characterData: true});
}"""
# Installed with it: the page's fetch hands it a stream's server-sent events one per read, a task apart, however the
# network grouped them. A fast server's whole reply can reach the page in one read, which the page must show in one
# step; with one event per read, the steps show that the page renders each event as it arrives.
ONE_EVENT_PER_READ = """() => {
  const original = window.fetch;
  window.fetch = async (...args) => {
    const response = await original(...args);
    if (!(response.headers.get('content-type') || '').startsWith('text/event-stream')) return response;
    const reader = response.body.getReader(), decoder = new TextDecoder(), encoder = new TextEncoder();
    const events = [];
    let pending = '', finished = false;
    const body = new ReadableStream({async pull(controller) {
      while (!events.length && !finished) {
        const {value, done} = await reader.read();
        if (done) {
          finished = true;
          if (pending) events.push(pending);
        } else {
          pending += decoder.decode(value, {stream: true});
          const parts = pending.split('\\n\\n');
          pending = parts.pop();
          events.push(...parts.map(part => part + '\\n\\n'));
        }
      }
      if (!events.length) return controller.close();
      await new Promise(resolve => setTimeout(resolve, 0));
      controller.enqueue(encoder.encode(events.shift()));
    }});
    return new Response(body, {status: response.status, statusText: response.statusText, headers: response.headers});
  };
}"""
BUBBLES = "els => els.map(e => [e.dataset.role, e.textContent])"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A small random GPT and its tokenizer, exported for serving (as tests/test_server.py's), whose greedy replies
    are printable text: the LM head's rows of the other tokens (lone bytes of a multi-byte character, control
    characters, the end of text) are zeroed, so their logit is 0, below the best of the others'. Left in, a reply was 24
    U+FFFD characters, and any two replies could read the same."""
    tokenizer = train_bpe(TEXT, 320, special_tokens=[EOT])
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=64, d_model=32, n_heads=2, n_layers=2,
                       dropout=0.0)
    model = GPT(config)
    with torch.no_grad():
        model.lm_head.weight[[t for t in range(config.vocab_size) if not printable(tokenizer, t)]] = 0
    return export_for_serving(model, tokenizer, tmp_path_factory.mktemp("served") / "tiny")


def printable(tokenizer, token: int) -> bool:
    if token in tokenizer.special_tokens.values():
        return False
    try:
        return token_bytes(tokenizer, token).decode("utf-8").isprintable()
    except UnicodeDecodeError:
        return False


def browser_or_fail() -> str:
    """Chromium's path; fails saying how to install what is missing."""
    chromium = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    missing = None
    if sync_playwright is None:
        missing = "Playwright is not installed: run `pip install -e .[dev]` (or `make setup`)"
    elif chromium is None:
        missing = (f"Chromium is not installed ({CHROMIUM} is missing and no `chromium` is on PATH): run `make "
                   "browser` (or `apt-get install chromium`)")
    if missing is not None:
        pytest.fail(missing, pytrace=False)
    return chromium


def servers_answer(http: httpx.Client, model: str, messages: list[dict]) -> str:
    """The server's non-streamed greedy reply to `messages`."""
    response = http.post("/v1/chat/completions", json={"model": model, "messages": messages, "temperature": 0,
                                                       "max_tokens": MAX_TOKENS})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def send(page, text: str, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """Send `text` from the page at temperature 0; returns the messages the page's request carried."""
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions"), timeout=WAIT_MS) as request:
        page.click("#send")
    body = request.value.post_data_json
    assert (body["stream"], body["temperature"], body["max_tokens"]) == (True, 0, max_tokens), body
    return body["messages"]


def wait_for_the_reply(page) -> str:
    """The last assistant bubble's text once the page has marked it done."""
    reply = page.locator("#log .message.assistant").last
    expect(reply).to_have_attribute("data-done", "1", timeout=WAIT_MS)
    expect(page.locator("#send")).to_be_enabled(timeout=WAIT_MS)
    return reply.text_content()


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_the_chat_page_streams_each_tabs_own_conversation_and_shows_refusals(folder):
    chromium = browser_or_fail()
    first_prompt, second_prompt = "The quick brown fox", "def main():"
    with start_server(folder, "--dtype", "float64", "--graceful-seconds", "1") as server, \
            httpx.Client(base_url=server.url, timeout=60) as http, sync_playwright() as playwright:
        model = http.get("/v1/models").json()["data"][0]["id"]
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            context = browser.new_context()
            context.set_default_timeout(WAIT_MS)

            # a reply streams into its bubble and ends as the server's own answer
            first = context.new_page()
            first.goto(server.url + "/")
            first.evaluate(RECORD_THE_REPLYS_TEXTS)
            first.evaluate(ONE_EVENT_PER_READ)
            first_messages = [{"role": "user", "content": first_prompt}]
            assert send(first, first_prompt) == first_messages
            reply = wait_for_the_reply(first)
            expected = servers_answer(http, model, first_messages)
            assert len(expected) > 10 and reply == expected
            texts = first.evaluate("window.replyTexts")
            assert len(texts) > 2, f"the reply came in {len(texts)} step(s), not streamed: {texts}"
            assert texts[-1] == reply
            assert all(later.startswith(earlier) for earlier, later in pairwise(texts))  # it only grew
            first_conversation = first.eval_on_selector_all("#log .message", BUBBLES)
            assert first_conversation == [["user", first_prompt], ["assistant", expected]]

            # a second tab, as a user opens one: its conversation is its own, and the first tab's stays as it was
            second = context.new_page()
            second.goto(server.url + "/")
            second_messages = [{"role": "user", "content": second_prompt}]
            assert send(second, second_prompt) == second_messages  # nothing of the first tab's conversation
            second_reply = wait_for_the_reply(second)
            assert second_reply == servers_answer(http, model, second_messages) != expected
            assert second.eval_on_selector_all("#log .message", BUBBLES) == [["user", second_prompt],
                                                                              ["assistant", second_reply]]
            assert first.eval_on_selector_all("#log .message", BUBBLES) == first_conversation

            # a request the server refuses (max_tokens past the context) shows its error message in an error bubble
            third = context.new_page()
            third.goto(server.url + "/")
            send(third, first_prompt, max_tokens=100_000)
            error = third.locator("#log .message.error")
            expect(error).to_have_count(1, timeout=WAIT_MS)
            expect(error).to_contain_text("max_tokens", timeout=WAIT_MS)
            expect(third.locator("#send")).to_be_enabled(timeout=WAIT_MS)
            assert first.eval_on_selector_all("#log .message", BUBBLES) == first_conversation
        finally:
            browser.close()
        assert server.process.poll() is None, "the server died during the test"
