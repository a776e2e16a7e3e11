"""A draft method is a plugin: one module and one registry line (tests/echo_method.py, registered from outside the
package), and the Space shows it — in its method menu, the menu's help, /info — and runs it, with nothing of the
Space changed. The registry's claim order is explicit: of the methods that claim a draft file, the highest priority
wins, whatever the order of the lines."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from echo_method import HELP, LABEL, LINE, NAME
from gradio_client import Client
from space_client import chat_args

from dflash_runtime import methods
from dflash_runtime.drafters.drafting import Implementation
from dflash_runtime.errors import PairMismatchError
from dflash_runtime.files.gguf_meta import read_gguf
from dflash_runtime.testing.tiny_models import tiny_draft_model, tiny_pair


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": "1024"}
    command = [sys.executable, str(REPO_ROOT / "tests" / "echo_method_app.py")]
    with running_app(env, REPO_ROOT / "test-artifacts" / "method_plugin_server.log", command=command) as app:
        yield app


def component(config: dict[str, Any], elem_id: str) -> dict[str, Any]:
    return next(c["props"] for c in config["components"] if c.get("props", {}).get("elem_id") == elem_id)


def test_a_registered_method_is_in_the_menu_the_help_and_info_and_runs(server: RunningApp) -> None:
    client = Client(server.url, verbose=False)
    info = client.predict(api_name="/info")
    assert NAME in info["methods"], info["methods"]
    menu = component(client.config, "method")
    assert [LABEL, NAME] in [list(choice) for choice in menu["choices"]], menu["choices"]
    assert f"**{LABEL}**: {HELP}" in component(client.config, "method-help")["value"]
    plain, _ = client.predict(**chat_args("one two three", max_tokens=24, speculative=False), api_name="/generate")
    echoed, stats = client.predict(**chat_args("one two three", max_tokens=24, method=NAME), api_name="/generate")
    assert echoed == plain  # lossless at temperature 0, whatever the drafter proposes
    assert stats["method"] == NAME and stats["drafted"] > 0, stats


def test_the_highest_claim_priority_wins_whatever_the_order_of_the_lines() -> None:
    pair = tiny_pair("dense", "dflash2")
    dflash, small = read_gguf(pair.draft), read_gguf(tiny_draft_model(pair))
    assert methods.claimant(dflash).name == "dflash" and methods.claimant(small).name == "draft-simple"
    saved = methods.REGISTRY
    try:
        methods.REGISTRY = tuple(reversed(saved))  # draft-simple (which claims any model) now comes first
        assert methods.claimant(dflash).name == "dflash"
        with pytest.raises(ValueError, match="priority 100"):
            methods.register(methods.Method("other", "Other", "other", lambda: LINE.implementation(),
                                            claims=lambda d: True, priority=100))
        with pytest.raises(ValueError, match="named 'dflash' already"):
            methods.register(methods.Method("dflash", "Again", "", lambda: LINE.implementation()))
        # A module written before claims moved to the registry line: its draft file claims, at priority 50.
        legacy = SimpleNamespace(needs="legacy", claims=lambda d: d.arch == small.arch)
        methods.register(methods.Method("legacy", "Legacy", "legacy", lambda: Implementation(open, draft_file=legacy)))
        assert methods.claimant(small, loaded=True).name == "legacy" and methods.claimant(small).name != "legacy"
        assert methods.claimant(dflash, loaded=True).name == "dflash"
    finally:
        methods.REGISTRY = saved
    assert methods.from_headers(read_gguf(pair.target), small)[:1] == ("draft-simple",)
    with pytest.raises(PairMismatchError, match="must be opened together with its target"):
        methods.refuse_alone(dflash)
