"""``/dashboard`` in a real headless Chromium against the real stack (gateway, encoder, prefill, decode).

With an API key on: the page asks for the key once, then renders every stage; while load
runs, its numbers change (request rate, the waterfall of recent requests, the workers'
counters); a stage whose only worker is gone shows as having no healthy worker.

Chromium and chromedriver are Debian's (``.ci/run`` installs them when missing); selenium is
told both paths, so nothing is downloaded. Without them the test is skipped, saying why.
Set ``DASHBOARD_SCREENSHOT=docs/dashboard.png`` to keep the page as it looked under load.
"""

from __future__ import annotations

import base64
import io
import os
import random
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest

from cluster import Cluster, Gateway
from runtime.demo_model.shapes import draw_shape

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
KEY = "sk-dashboard-test"
STAGES = ("encoder", "prefill", "decode")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)", allow_module_level=True)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Cluster, Gateway]:
    c = Cluster(tmp_path_factory.mktemp("dashboard"))
    try:
        c.start("encoder")
        c.start("decode")
        c.start("prefill")
        c.wait_healthy()
        gateway = c.start_gateway("--placement", "disaggregated", "--prefill-chunk-tokens", "8", "--api-key", KEY)
        c.wait_gateways()
        yield c, gateway
    finally:
        c.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1300", "--no-proxy-server"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def image_message(seed: int) -> list[dict]:
    buf = io.BytesIO()
    draw_shape(random.Random(seed)).image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What shape is this?"}]}]


def run_load(base: str, stop: threading.Event, done: list[int]) -> None:
    """Requests one after another until ``stop`` (each image new, then one repeated: misses and hits)."""
    with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        seed = 0
        while not stop.is_set():
            seed += 1
            client.chat.completions.create(model="demo-vlm", messages=image_message(seed % 3), max_tokens=6,
                                           temperature=0)
            done.append(seed)


READ_PAGE = """
const shown = {};
for (const t of document.querySelectorAll('#rates .tile')) shown[t.id] = t.innerText;
for (const c of document.querySelectorAll('[data-stage] [data-field]'))
  shown[c.closest('[data-stage]').dataset.stage + '.' + c.dataset.field] = c.innerText;
for (const s of document.querySelectorAll('[data-stage]')) { shown['state.' + s.dataset.stage] = s.dataset.state;
  shown['text.' + s.dataset.stage] = s.innerText; }
const rows = document.querySelectorAll('#waterfall .row');
shown.recent = String(rows.length);
shown.first_row = rows.length ? rows[0].innerText : '';
shown.first_row_prefill = rows.length ? String(rows[0].querySelectorAll('.bar .seg-prefill').length) : '0';
return shown;
"""


def numbers(driver) -> dict[str, str]:
    """What the page shows, read in one script (the page redraws itself every poll): every tile,
    every worker field, each stage's state and text, the waterfall's rows."""
    return driver.execute_script(READ_PAGE)


def wait_for(driver, condition, timeout_s: float, what: str):
    return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(lambda d: condition(d), message=what)


def test_dashboard_renders_every_stage_and_moves_under_load(served, browser):
    cluster, gateway = served
    browser.get(f"{gateway.base}/dashboard")
    form = wait_for(browser, lambda d: d.find_element(By.ID, "key-form").is_displayed() and d.find_element(By.ID, "key-form"),
                    20, "the page asks for the API key")
    form.find_element(By.ID, "key-input").send_keys(KEY)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1", 20,
             "the page loaded its data with the key")
    shown = numbers(browser)
    for stage in STAGES:
        assert shown[f"state.{stage}"] == "ok", shown[f"text.{stage}"]
        assert f"{stage}.queue_depth" in shown, shown
    assert shown["decode.free_blocks"].isdigit(), shown
    before = numbers(browser)
    assert before["recent"] == "0" and before["rate-requests"].startswith("0.00"), before

    stop, done = threading.Event(), []
    load = threading.Thread(target=run_load, args=(gateway.base, stop, done), daemon=True)
    load.start()
    try:
        wait_for(browser, lambda d: len(done) >= 3 and numbers(d)["recent"] != "0", 120, "requests appear")
        during = wait_for(browser, lambda d: (lambda n: n if not n["rate-requests"].startswith("0.00") else None)(numbers(d)),
                          30, "the request rate moves")
        changed = {k for k in before if during.get(k) != before[k]}
        assert {"rate-requests", "recent", "encoder.computes", "ttft-p50"} <= changed, (before, during)
        assert "disaggregated" in during["first_row"], during["first_row"]
        assert during["first_row_prefill"] == "1", during
        later = wait_for(browser, lambda d: (lambda n: n if n != during else None)(numbers(d)), 30,
                         "the numbers keep changing while load runs")
        assert later["recent"] != "0"
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            Path(os.environ["DASHBOARD_SCREENSHOT"]).write_bytes(browser.get_screenshot_as_png())
    finally:
        stop.set()
        load.join(timeout=90)
    assert not load.is_alive()

    prefill = cluster.by_role("prefill")[0]
    prefill.process.stop()
    gone = wait_for(browser, lambda d: (lambda n: n if n["state.prefill"] == "no_healthy_worker" else None)(numbers(d)),
                    30, "a stage without a healthy worker is shown as such")
    assert "no healthy worker" in gone["text.prefill"].lower(), gone["text.prefill"]
    assert gone["state.decode"] == "ok" and gone["state.encoder"] == "ok", gone
