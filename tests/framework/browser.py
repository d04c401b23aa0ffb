"""Headless Chromium driven by Selenium, for the tests that need a real
browser (the dashboard, a desktop's live view)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = ("/usr/bin/chromium", "chromium")
DRIVER = ("/usr/bin/chromedriver", "chromedriver")


def _which(candidates: tuple[str, ...]) -> str | None:
    for c in candidates:
        found = shutil.which(c)
        if found:
            return found
    return None


@contextmanager
def chromium(window: tuple[int, int]) -> Iterator[Any]:
    """A headless Chromium (a selenium WebDriver); skips the test, naming
    what is missing, where Chromium or its driver is not installed."""
    binary, driver = _which(CHROMIUM), _which(DRIVER)
    missing = [name for name, path in (("chromium", binary), ("chromedriver", driver)) if not path]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(binary)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={window[0]},{window[1]}", "--disable-gpu"):  # fmt: skip
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(str(driver)), options=opts)
    b.set_page_load_timeout(30)
    try:
        yield b
    finally:
        b.quit()
