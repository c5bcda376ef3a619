"""A headless Chromium for the tests of the served pages (the playground at ``/``): Debian's ``chromium`` package
driven by Playwright's Python package, no browser downloaded. Without either the tests that use :func:`browser`
skip naming what is missing (``.ci/run`` installs both as root). ``tests/conftest.py`` registers the fixtures
``browser`` (one per module) and ``page`` (a fresh tab per test).

Screenshots go to ``outputs/test-artifacts/playground/`` (``HSDP_TEST_ARTIFACTS`` moves it; git ignores it).
"""

from __future__ import annotations

import base64
import os
import shutil
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("HSDP_TEST_ARTIFACTS", ROOT / "outputs" / "test-artifacts")) / "playground"
CHROMIUM = os.environ.get("HSDP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FINISHED = ("completed", "failed", "cancelled")
AXE = Path(os.environ.get("HSDP_AXE_JS", ROOT / "node_modules" / "axe-core" / "axe.min.js"))
"""axe-core (Deque's accessibility engine, npm's ``axe-core``): ``npm install --no-save axe-core`` at the repository
root, as ``.ci/run`` does, or ``HSDP_AXE_JS=PATH`` to its ``axe.min.js``."""
AXE_RULES = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "best-practice"]


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, naming what to install; None when they can."""
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package (pip install -e .[dev])")
    if not Path(CHROMIUM).is_file():
        missing.append(
            f"Chromium at {CHROMIUM} (apt-get install -y chromium chromium-driver, or HSDP_CHROMIUM=PATH)"
        )
    return "; ".join(missing) or None


@pytest.fixture(scope="module")
def browser():
    why = missing_browser()
    if why:
        pytest.skip(f"no headless browser: missing {why}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture()
def page(browser):
    """A fresh tab (its own storage); a JavaScript error the page raises fails the test."""
    context = browser.new_context(viewport={"width": 1100, "height": 900}, accept_downloads=True)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert not errors, f"the page raised: {errors}"


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def open_playground(page, url: str, api_key: str | None = None) -> None:
    """Open ``/`` and wait for the form; with ``api_key``, the page must ask for it first."""
    page.goto(url + "/")
    if api_key is not None:
        page.wait_for_selector("#api-key", state="visible")
        page.fill("#api-key", api_key)
        page.click("#key-form button")
    page.wait_for_selector("body[data-ready=true]")


def run_job(page, prompt: str, **fields) -> str:
    """Fill the form, start the job and wait for the page to show its result; returns the job's id."""
    page.fill("#f-prompt", prompt)
    for name, value in fields.items():
        page.fill(f"#f-{name}", str(value))
    previous = page.get_attribute("#current-status", "data-job-id")
    page.click("#start")
    page.wait_for_function(
        """([previous, finished]) => { const s = document.getElementById("current-status");
           return s.dataset.jobId && s.dataset.jobId !== previous && finished.includes(s.dataset.status); }""",
        arg=[previous, list(FINISHED)],
        timeout=300_000,
    )
    status = page.get_attribute("#current-status", "data-status")
    assert status == "completed", page.inner_text("#current-status")
    page.wait_for_selector("#result-media")
    return page.get_attribute("#current-status", "data-job-id")


def shown_bytes(page) -> bytes:
    """The bytes of what the page's player shows (its blob URL, read back in the page)."""
    data = page.evaluate(
        """async () => { const r = await fetch(document.getElementById("result-media").src);
           const bytes = new Uint8Array(await r.arrayBuffer()); let s = "";
           for (const b of bytes) s += String.fromCharCode(b); return btoa(s); }"""
    )
    return base64.b64decode(data)


def media_duration(page) -> float:
    """The duration the page's <video> or <audio> player reports once it has read the file's metadata."""
    return page.eval_on_selector(
        "#result-media",
        """m => new Promise((resolve, reject) => {
             if (m.readyState >= 1) return resolve(m.duration);
             m.addEventListener("loadedmetadata", () => resolve(m.duration));
             m.addEventListener("error", () => reject(new Error("the player cannot read it: " + m.error.code)));
           })""",
    )


def assert_accessible(page, name: str) -> None:
    """No serious or critical violation of WCAG 2.1 A/AA and axe's best practices on the page as it is now (axe-core
    injected into the page). Without axe-core a warning names what is missing and the page's other checks go on."""
    if not AXE.is_file():
        warnings.warn(
            f"no accessibility check of {name}: axe-core is not at {AXE} (npm install --no-save axe-core)",
            stacklevel=2,
        )
        return
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("rules => axe.run(document, {runOnly: rules})", AXE_RULES)
    serious = [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']][:3]}"
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert not serious, f"{name}: axe-core {result['testEngine']['version']} finds {serious}"
