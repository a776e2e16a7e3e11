"""The A/B page at temperature 0 when the texts differ: a Space whose verifier keeps a wrong draft token (a real
fault) says "Texts differ at token N: fault (margin …)", with the target's logits behind it; the near-tie wording
is checked on the same page function with a near-tie (tests/test_space_logic.py) and found on the stand-in kernels in
tests/test_divergence.py."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator

import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from test_app_browser import ARTIFACTS, N_CTX, open_page, run_ab, wait_for_page

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def broken_server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX)}
    command = [sys.executable, str(REPO_ROOT / "tests" / "broken_verifier_app.py")]
    with running_app(env, ARTIFACTS / "app_verdict_server.log", command=command) as app:
        yield app


def test_a_wrong_token_kept_by_the_verifier_is_called_a_fault(broken_server: RunningApp) -> None:
    with open_page(broken_server.url) as page:
        wait_for_page(page)
        page.type_into("#message-box textarea", "hello, tell me a story")
        box = "#max-tokens input[type='number']"  # short answers: the first wrong token comes within a few steps
        page.evaluate(f"document.querySelector({json.dumps(box)}).select()")
        page.type_into(box, "48")
        page.evaluate(f"document.querySelector({json.dumps(box)}).blur()")
        result = run_ab(page, "Texts differ at token")
        page.screenshot_of("#ab-result", ARTIFACTS / "app_verdict_fault.png")
    assert re.search(r"Texts differ at token \d+: fault \(margin [\d.e+-]+\)\.", result), result
    assert "bound" in result and "(plain)" in result and "near-tie" not in result, result
