"""A real browser for the UI tests: Playwright driving Debian's Chromium (no browser download).

`tests/install-chromium.sh` installs Chromium; without it the UI tests skip and say how to get it
(under CI, where the README's test command installs it, they fail instead).
Every request that leaves 127.0.0.1 (the UIs' web fonts, promotional content) is refused: the
tests see what a user on an offline machine sees, and send nothing anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
VIEWPORT = {"width": 1400, "height": 900}


def chromium_path() -> str | None:
    configured = os.environ.get("RLHF_CHROMIUM")
    if configured:
        return configured
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def _local_only(route) -> None:
    url = route.request.url
    if url.startswith(("http://127.0.0.1", "data:", "blob:")):
        route.continue_()
    else:
        route.abort()


@contextlib.contextmanager
def browser() -> Iterator[object]:
    """A headless Chromium (a Playwright Browser); skips the test where there is none."""
    executable = chromium_path()
    if executable is None:
        missing = ("no Chromium on this machine: run tests/install-chromium.sh (Debian's chromium) "
                   "or set RLHF_CHROMIUM to a Chromium binary to run the browser tests")
        if os.environ.get("CI"):  # CI installs it (the README's test command): a skip there would hide the UIs
            pytest.fail(missing)
        pytest.skip(missing)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra: pip install -e '.[dev]'")
    with sync_api.sync_playwright() as playwright:
        b = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@contextlib.contextmanager
def page(b) -> Iterator[object]:
    """A fresh page (its own cookies and storage) that reaches 127.0.0.1 only."""
    context = b.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    context.route("**/*", _local_only)
    try:
        yield context.new_page()
    finally:
        context.close()


def form_group(scope, label: str):
    """The form field (or section) of a Prefect parameter form whose label reads `label`."""
    return scope.locator(f"xpath=.//label[normalize-space()={_xpath_literal(label)}]"
                         "/ancestor::div[contains(concat(' ', @class, ' '), ' group ')][1]")


def _xpath_literal(text: str) -> str:
    return f"'{text}'" if "'" not in text else f'"{text}"'


def screenshot(p, folder: Path, name: str, **kwargs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    p.screenshot(path=str(path), **kwargs)
    return path
