"""The browser of tests/web: Debian's /usr/bin/chromium driven by the `playwright` package (dev extra), one per
module; `page`: a fresh context's page that records uncaught page errors in `page.errors`. Nothing is ever
downloaded: without the package or the browser the module is skipped."""

from pathlib import Path

import pytest

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - CI installs it with the dev extra
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        pytest.skip("the playwright package is not installed (dev extra)")
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (scripts/test.sh installs Debian's)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    yield page
    context.close()
