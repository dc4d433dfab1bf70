"""The dashboard in a real browser: Debian's Chromium (installed by .ci/run) driven by Playwright
over a tiny Llama whose steps are slowed to 40 ms, so requests stay on screen for seconds. The page
loads without a console error, draws one card per slot, shows busy slots, used pages and the
waiting queue while requests run, outlines the slot of the prompt sent from its own form while it
streams the answer, and clears once everything finishes; with an API key it asks for the key first.
A screenshot of the busy dashboard is kept in out/dashboard_busy.png."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from jaxserve import Engine, EngineConfig
from jaxserve.entrypoints.engine_client import EngineClient
from jaxserve.entrypoints.api_server import create_app
from server_helpers import ServerThread, wait_idle

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]  # headless: Playwright adds it
SLOTS = 4
OUT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "out")

if not os.path.exists(CHROMIUM):
    pytest.skip(f"no browser: {CHROMIUM} is absent (.ci/run installs Debian's chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def client(checkpoints):
    engine = Engine.from_pretrained(checkpoints("llama"), EngineConfig(
        max_slots=SLOTS, page_size=8, num_pages=96, max_model_len=256))
    engine.runner.warmup()  # every step shape, as `jaxserve serve` does: no compile on screen
    step = engine.step

    def slow_step():  # the core runs in this process: slow each step so the page sees every phase
        time.sleep(0.04)
        return step()
    engine.step = slow_step
    client = EngineClient.in_thread(engine)
    yield client
    client.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


def open_dashboard(browser, url):
    """A page on the dashboard, and the console errors and uncaught exceptions it reports."""
    page = browser.new_page()
    errors = []
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.goto(url + "/dashboard")
    return page, errors


def number(page, selector) -> int:
    return int(page.inner_text(selector))


def test_dashboard_shows_requests_moving_through_slots(client, browser, tmp_path):
    with ServerThread(create_app(client)) as server:
        page, errors = open_dashboard(browser, server.url)
        page.wait_for_function(f"() => document.querySelectorAll('.slot').length === {SLOTS}")
        page.wait_for_function("() => document.getElementById('connection').dataset.state === 'live'")
        assert page.inner_text("#strategy") == "strategy paged"
        assert page.locator('.slot[data-phase="free"]').count() == SLOTS
        assert number(page, "#pages-used") == 0 and number(page, "#pages-total") == 95

        def complete(i):
            httpx.post(server.url + "/v1/completions", timeout=120, json={
                "prompt": f"the quick brown fox {i}", "max_tokens": 60 + 10 * i, "ignore_eos": True})
        threads = [threading.Thread(target=complete, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        page.fill("#prompt", "a stitch in time")
        page.fill("#max-tokens", "40")
        page.fill("#temperature", "0")
        page.click("#send")

        page.wait_for_selector('.slot[data-phase="decode"]', timeout=30_000)
        page.wait_for_function("() => Number(document.getElementById('pages-used').textContent) > 0")
        page.wait_for_function("() => document.querySelectorAll('#queue li').length > 0")
        page.wait_for_function(f"() => document.querySelectorAll('.slot:not([data-phase=\"free\"])').length === {SLOTS}")
        page.wait_for_timeout(1000)  # a second of steps in the charts; the first requests still run
        os.makedirs(OUT, exist_ok=True)
        for path in (os.path.join(OUT, "dashboard_busy.png"), tmp_path / "dashboard_busy.png"):
            page.screenshot(path=str(path), full_page=True)
        page.wait_for_selector(".slot.mine", timeout=60_000)  # the form's request, once admitted

        page.wait_for_function("() => document.getElementById('prompt-status').textContent.includes('finished (')",
                               timeout=60_000)
        assert len(page.inner_text("#answer")) > len("a stitch in time")
        for t in threads:
            t.join(120)
        wait_idle(server)
        page.wait_for_function(f"() => document.querySelectorAll('.slot[data-phase=\"free\"]').length === {SLOTS}")
        page.wait_for_function("() => document.getElementById('pages-used').textContent === '0'")
        assert page.locator("#queue li").count() == 0 and page.locator(".slot.mine").count() == 0
        assert number(page, "#step") > 60
        page.close()
        assert errors == []


def test_dashboard_asks_for_the_api_key(client, browser):
    with ServerThread(create_app(client, api_key="sekrit")) as server:
        page, errors = open_dashboard(browser, server.url)
        page.wait_for_selector("#key-dialog", state="visible")
        assert page.locator(".slot").count() == 0  # nothing asked of the API before the key
        page.fill("#key-input", "sekrit")
        page.click("#key-form button")
        page.wait_for_function(f"() => document.querySelectorAll('.slot').length === {SLOTS}")
        page.wait_for_function("() => document.getElementById('connection').dataset.state === 'live'")
        assert page.locator("#key-dialog").is_hidden()
        page.close()
        assert errors == []
