"""A real headless browser for the dashboard's tests: Debian's ``chromium`` driven through its
``chromium-driver`` by Selenium (`make tools` and .ci/run install both).

A missing browser fails the test that asks for one, saying what to install: CI has it, and a
browser test that skips there would pass having checked nothing. A machine without it may opt
out explicitly with ``SURGE_SKIP_BROWSER=1`` (the test is then skipped, saying so).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

OPT_OUT = "SURGE_SKIP_BROWSER"
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = ("chromedriver", "chromium-driver")
PAGE_LOAD_SECONDS = 60  # a job page draws its charts with matplotlib: seconds on a loaded 2-core host


def _which(names: tuple[str, ...]) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


@contextmanager
def chromium() -> Iterator[object]:
    """A headless chromium WebDriver, quit at the end (its processes go with it)."""
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"{OPT_OUT}=1: the browser test is opted out on this machine")
    binary, driver = _which(CHROMIUM), _which(DRIVER)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is not installed: `pip install -e '.[dev]'` (or set SURGE_SKIP_BROWSER=1 to opt out)")
    if binary is None or driver is None:
        pytest.fail(
            "the dashboard's browser test needs Debian's chromium and chromium-driver: "
            "`apt-get install -y chromium chromium-driver` (`make tools` does it; "
            f"or set {OPT_OUT}=1 to opt out on this machine)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"):
        options.add_argument(arg)  # (--no-sandbox: CI runs as root, where chromium's sandbox refuses to start)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    browser.set_page_load_timeout(PAGE_LOAD_SECONDS)
    try:
        yield browser
    finally:
        browser.quit()


def load(browser, url: str) -> float:
    """Open ``url``; the page's load time as the browser measured it (navigation start to
    the load event's end), milliseconds."""
    browser.get(url)
    return float(
        browser.execute_script(
            "const n = performance.getEntriesByType('navigation')[0]; return n.loadEventEnd - n.startTime;"
        )
    )
