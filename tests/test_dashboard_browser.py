"""The live KV-cache dashboard in a real headless Chromium against a real `pagedllm serve` process.

Requests with n=4 and a shared prefix (prefix caching on), and one n=2 request, must show shared
blocks on the page (darker with the refcount); the page's cells (one by one), queues and counters
must equal the snapshot it drew and that snapshot's engine stats (same step boundary); once the
requests are done, the page, /dashboard/snapshot and /metrics must show the pool all free.

A second test runs a server whose pool holds one of two n=4 requests at a time: the swapped one's
blocks must show in the CPU grid and the swapped queue, then leave.

Needs Debian's Chromium and its driver (`apt-get install -y chromium chromium-driver`) and
`pip install selenium`; skipped with that message otherwise. Saves a screenshot of the page while the
blocks are shared to $PAGEDLLM_DASHBOARD_SCREENSHOT and one while a request is swapped out to
$PAGEDLLM_DASHBOARD_SWAP_SCREENSHOT (default: the tests' tmp dirs; docs/*.png were made so).
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

INSTALL = ("needs Chromium + chromedriver and selenium: `apt-get update && apt-get install -y chromium "
           "chromium-driver && pip install selenium`")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY = "dash-key"
PREFIX = ("You are a helpful assistant. You answer questions about geography, history and science "
          "carefully, in full sentences, and you never make up facts. ") * 2
PAIR_PROMPT = ("Write a short poem about the sea, the wind over the harbour, the gulls above the boats and "
               "the old lighthouse keeper who watches the ships come home every evening before the storm. ") * 2

# One JS call: what the page shows and the snapshot it was drawn from, read atomically.
READ_PAGE = """
const s = window.pagedllmDashboard, cells = (cls) => document.querySelectorAll('#gpu-grid .cell.' + cls).length;
const txt = (id) => document.getElementById(id).textContent;
return {renders: s.renders, error: s.error, snap: s.last,
        dom: {free: cells('free'), cached_free: cells('cached_free'), used: cells('used'), shared: cells('shared'),
              cells: document.querySelectorAll('#gpu-grid .cell').length,
              cpu_used: document.querySelectorAll('#cpu-grid .cell.used, #cpu-grid .cell.shared').length,
              gpu_states: Array.from(document.querySelectorAll('#gpu-grid .cell'), (c) => c.classList[1]),
              cpu_states: Array.from(document.querySelectorAll('#cpu-grid .cell'), (c) => c.classList[1]),
              gpu_colors: Array.from(document.querySelectorAll('#gpu-grid .cell'), (c) => getComputedStyle(c).backgroundColor),
              queues: Object.fromEntries(['running', 'waiting', 'swapped'].map((q) => [q,
                Array.from(document.querySelectorAll('#q-' + q + ' .req'), (r) => ({id: r.dataset.request,
                  seqs: Array.from(r.querySelectorAll('.seqrow'), (row) => row.querySelectorAll('.chip').length)}))]))},
        text: {free: txt('n-free'), cached_free: txt('n-cached_free'), used: txt('n-used'), shared: txt('n-shared'),
               saved: txt('n-saved'), queues: txt('n-queues'), frag: txt('n-frag')}};
"""
SAME_AS_STATS = ["kv_blocks_total", "kv_blocks_free", "kv_blocks_shared", "kv_blocks_saved_by_sharing",
                 "kv_slots_allocated", "kv_slots_filled", "num_running", "num_waiting", "num_swapped"]


def _browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        pytest.skip(INSTALL)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip(INSTALL)
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1500,1300"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_script_timeout(20)
    return driver, profile


@pytest.fixture(scope="module")
def browser():
    driver, profile = _browser()
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-prefix-caching", "--api-key", KEY])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _wait(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def _check_page_matches_its_snapshot(page: dict) -> None:
    """Cells and counters on screen == the snapshot drawn == the engine's stats of that instant."""
    snap = page["snap"]
    c, dom, text = snap["counts"], page["dom"], page["text"]
    assert dom["cells"] == snap["gpu"]["num_blocks"] == c["kv_blocks_total"]
    assert dom["shared"] == c["kv_blocks_shared"]
    assert dom["used"] == c["kv_blocks_used"]
    assert dom["cached_free"] == c["kv_blocks_cached_free"]
    assert dom["free"] == c["kv_blocks_free_uncached"]
    assert dom["cpu_used"] == c["cpu_blocks_used"]
    # Cell by cell, against the states computed here from the snapshot's refcounts (one cell per block).
    cached = set(snap["gpu"]["cached_free"])
    want = ["shared" if rc > 1 else "used" if rc == 1 else "cached_free" if b in cached else "free"
            for b, rc in enumerate(snap["gpu"]["ref_counts"])]
    assert dom["gpu_states"] == want
    assert dom["cpu_states"] == ["used" if rc == 1 else "shared" if rc > 1 else "free"
                                 for rc in snap["cpu"]["ref_counts"]]
    # Shared cells get darker with the refcount.
    lum: dict[int, set[float]] = {}
    for b, rc in enumerate(snap["gpu"]["ref_counts"]):
        if rc > 1:
            lum.setdefault(rc, set()).add(_luminance(dom["gpu_colors"][b]))
    assert all(len(v) == 1 for v in lum.values()), lum  # one colour per refcount
    by_rc = [next(iter(lum[rc])) for rc in sorted(lum)]
    assert by_rc == sorted(by_rc, reverse=True), lum
    if 2 in lum and max(lum) >= 4:
        assert lum[2] != lum[max(lum)]
    # The queues on the page: the same requests, each with one row per sequence and one chip per block.
    for q, reqs in snap["queues"].items():
        assert dom["queues"][q] == [{"id": r["request_id"], "seqs": [len(s["blocks"]) + len(s["cpu_blocks"])
                                                                      for s in r["seqs"]]} for r in reqs[:60]], q
    for key, field in (("free", "kv_blocks_free_uncached"), ("cached_free", "kv_blocks_cached_free"),
                       ("used", "kv_blocks_used"), ("shared", "kv_blocks_shared"),
                       ("saved", "kv_blocks_saved_by_sharing")):
        assert text[key].replace(",", "") == str(c[field]), (key, text[key], c[field])
    assert text["queues"] == f"{c['num_running']} / {c['num_waiting']} / {c['num_swapped']}"
    for key in SAME_AS_STATS:
        assert c[key] == snap["stats"][key], (key, c[key], snap["stats"][key])
    assert c["cpu_blocks_free"] == snap["stats"]["num_cpu_blocks_free"]


def _luminance(css: str) -> float:
    r, g, b = (float(x) for x in css[css.index("(") + 1:css.index(")")].split(",")[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _send_requests(server: RemoteServer, results: list) -> None:
    def one(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": PREFIX + f"Question {i}: name the largest city of country {i}.",
                "max_tokens": 64, "n": 4, "temperature": 0.8, "seed": i, "ignore_eos": True}
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"})
        results.append(r.status_code)

    def pair() -> None:  # n=2 on a prompt of its own: its full prompt blocks stay at refcount 2
        body = {"model": MODEL_NAME, "prompt": PAIR_PROMPT, "max_tokens": 64, "n": 2, "temperature": 0.8,
                "seed": 9, "ignore_eos": True}
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=300,
                       headers={"Authorization": f"Bearer {KEY}"})
        results.append(r.status_code)

    # The first request fills the prefix cache; the next two arrive later and reuse its blocks.
    threads = [threading.Thread(target=one, args=(0,))]
    threads[0].start()
    time.sleep(1.5)
    threads += [threading.Thread(target=one, args=(i,)) for i in (1, 2)] + [threading.Thread(target=pair)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()


def test_page_shows_shared_blocks_and_matches_snapshot_and_stats(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(server.url(f"/dashboard?api_key={KEY}"))
    page = _wait(lambda: (p := browser.execute_script(READ_PAGE)) and (p["renders"] >= 2 or p["error"]) and p,
                 30, "the page's first snapshots")
    assert page["error"] is None, page["error"]
    _check_page_matches_its_snapshot(page)
    assert page["snap"]["counts"]["kv_blocks_free"] == page["snap"]["counts"]["kv_blocks_total"]

    results: list[int] = []
    sender = threading.Thread(target=_send_requests, args=(server, results))
    sender.start()
    try:
        # Shared blocks appear: n=4 forks share the prompt, later requests share the cached prefix.
        page = _wait(lambda: (p := browser.execute_script(READ_PAGE)) and p["dom"]["shared"] >= 4
                     and p["snap"]["counts"]["num_running"] >= 3 and 2 in p["snap"]["gpu"]["ref_counts"]
                     and max(p["snap"]["gpu"]["ref_counts"]) >= 8 and p, 120, "shared blocks on the page")
        _check_page_matches_its_snapshot(page)
        snap = page["snap"]
        shared = [b for b, rc in enumerate(snap["gpu"]["ref_counts"]) if rc > 1]
        assert snap["counts"]["kv_blocks_saved_by_sharing"] == sum(snap["gpu"]["ref_counts"][b] - 1 for b in shared)
        # Hovering a shared cell names the block, its refcount and its owners.
        cell = browser.find_elements(By.CSS_SELECTOR, "#gpu-grid .cell.shared")[0]
        ActionChains(browser).move_to_element(cell).perform()
        tip = browser.find_element(By.ID, "tip")
        _wait(lambda: tip.is_displayed() and "refcount" in tip.text, 5, "the tooltip")
        assert "owners: cmpl-" in tip.text and "shared" in tip.text, tip.text
        block = int(cell.get_attribute("data-cell"))
        rc = int(tip.text.split("refcount ")[1].split()[0])
        assert tip.text.startswith(f"block {block} ") and rc > 1, tip.text
        shot = Path(os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
        time.sleep(2.0)  # let a few more frames land so the charts have a trace
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        # Several more frames while running: each one drawn faithfully.
        for _ in range(5):
            _check_page_matches_its_snapshot(browser.execute_script(READ_PAGE))
            time.sleep(0.3)
    finally:
        sender.join(300)
    assert results == [200, 200, 200, 200]

    # Back to all free (the prefix stays as cached-free blocks), on the page and everywhere else.
    page = _wait(lambda: (p := browser.execute_script(READ_PAGE))
                 and p["snap"]["counts"]["kv_blocks_free"] == p["snap"]["counts"]["kv_blocks_total"] and p,
                 60, "the pool to be all free on the page")
    _check_page_matches_its_snapshot(page)
    assert page["dom"]["used"] == page["dom"]["shared"] == 0
    assert page["dom"]["cached_free"] > 0  # the prefix cache kept full blocks
    snap = httpx.get(server.url("/dashboard/snapshot"), headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert snap["counts"] == page["snap"]["counts"]
    assert snap["gpu"]["cached_free"] == page["snap"]["gpu"]["cached_free"]
    metrics = server.wait_idle()
    assert metrics["pagedllm:kv_blocks_free"] == metrics["pagedllm:kv_blocks_total"] == page["dom"]["cells"]
    assert snap["stats"]["prefix_cache_hits"] > 0


# -- swapping: a pool too small for two n=4 requests --------------------------------------------------------
SWAP_ARGS = ["--num-gpu-blocks-override", "24", "--max-model-len", "1024", "--swap-space", "0.05",
             "--preemption-mode", "swap", "--max-num-seqs", "8"]


def test_page_shows_swapped_blocks_in_the_cpu_grid(browser, tmp_path):
    """Two n=4 requests that fit one at a time (about 20 of 24 blocks each): the later one is swapped out;
    its blocks must appear in the CPU grid and the swapped queue, cell by cell, then leave."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    srv = RemoteServer(SWAP_ARGS + ["--api-key", KEY])
    try:
        browser.get(srv.url(f"/dashboard?api_key={KEY}"))
        _wait(lambda: (p := browser.execute_script(READ_PAGE)) and (p["renders"] >= 1 or p["error"]) and p,
              30, "the page's first snapshot")
        results: list[int] = []

        def one(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": f"Story {i}: once upon a time, in a small village,",
                    "max_tokens": 64, "n": 4, "temperature": 0.8, "seed": i, "ignore_eos": True}
            results.append(httpx.post(srv.url("/v1/completions"), json=body, timeout=300,
                                      headers={"Authorization": f"Bearer {KEY}"}).status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        try:
            page = _wait(lambda: (p := browser.execute_script(READ_PAGE)) and p["snap"]["counts"]["num_swapped"] >= 1
                         and p, 120, "a swapped request on the page")
            _check_page_matches_its_snapshot(page)  # includes the CPU grid cell by cell and the swapped queue
            snap = page["snap"]
            swapped = snap["queues"]["swapped"][0]
            cpu_blocks = sorted({b for s in swapped["seqs"] for b in s["cpu_blocks"]})
            assert cpu_blocks and page["dom"]["cpu_used"] == len(cpu_blocks) == snap["counts"]["cpu_blocks_used"]
            assert all(s["blocks"] == [] and s["status"] == "swapped" for s in swapped["seqs"])
            assert page["dom"]["queues"]["swapped"][0]["id"] == swapped["request_id"]
            cell = browser.find_elements(By.CSS_SELECTOR, f'#cpu-grid .cell[data-cell="{cpu_blocks[0]}"]')[0]
            ActionChains(browser).move_to_element(cell).perform()
            tip = browser.find_element(By.ID, "tip")
            _wait(lambda: tip.is_displayed() and "CPU block" in tip.text, 5, "the CPU tooltip")
            assert tip.text.startswith(f"CPU block {cpu_blocks[0]} · swapped out"), tip.text
            assert f"owners: {swapped['request_id']}" in tip.text, tip.text
            browser.save_screenshot(str(os.environ.get("PAGEDLLM_DASHBOARD_SWAP_SCREENSHOT", tmp_path / "swap.png")))
        finally:
            for t in threads:
                t.join(300)
        assert results == [200, 200]
        page = _wait(lambda: (p := browser.execute_script(READ_PAGE)) and p["snap"]["counts"]["num_swapped"] == 0
                     and p["snap"]["counts"]["kv_blocks_free"] == p["snap"]["counts"]["kv_blocks_total"] and p,
                     60, "the pools to be all free on the page")
        _check_page_matches_its_snapshot(page)
        assert page["dom"]["cpu_used"] == 0 and page["snap"]["stats"]["num_swap_preemptions"] >= 1
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]
