"""The browser of the dashboard tests: Debian's Chromium (/usr/bin/chromium, from scripts/test.sh) driven by the
`playwright` package of the dev extra, one per module; no browser is ever downloaded."""

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - CI installs it with the dev extra
        pytest.skip("the playwright package is not installed (dev extra)")
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (scripts/test.sh installs Debian's)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()
