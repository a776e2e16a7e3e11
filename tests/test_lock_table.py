"""Every lock, condition, event, queue, thread, timer and native callback in dflash_runtime/ has its row in
docs/architecture.md's table (what it guards, its order, its bound): a new one without a row fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_runtime"
DOC = ROOT / "docs" / "architecture.md"
SECTION = "## Locks, queues and threads"
# The names that make one: threading's, asyncio's and queue's primitives, executors, Gradio's timer, ctypes callbacks.
PRIMITIVES = frozenset({
    "Lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore", "Barrier", "Thread", "Timer", "Queue",
    "SimpleQueue", "LifoQueue", "PriorityQueue", "local", "create_task", "ensure_future", "to_thread",
    "run_in_executor", "ThreadPoolExecutor", "ProcessPoolExecutor", "llama_log_callback", "CFUNCTYPE",
})
_STATEMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def owners(source: str) -> set[str]:
    """Who holds each primitive a module makes: `Class.attribute` for an attribute or a class field, `name` for a
    module global, `Class.method` (or `function`) for one made inside a function and kept in a local."""
    found: set[str] = set()

    def key(target: ast.AST, cls: str | None, fn: str | None) -> str | None:
        if isinstance(target, ast.Attribute) and _name(target.value) == "self":
            return f"{cls}.{target.attr}" if cls else target.attr
        if isinstance(target, ast.Name) and fn is None:
            return f"{cls}.{target.id}" if cls else target.id
        return None

    def walk(node: ast.AST, cls: str | None, fn: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, child.name if cls is None else f"{cls}.{child.name}", None)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, cls, child.name if fn is None else f"{fn}.{child.name}")
            elif isinstance(child, _STATEMENTS) and child.value is not None:
                names = {_name(n) for n in ast.walk(child.value)} & PRIMITIVES
                if not names:
                    continue
                targets = child.targets if isinstance(child, ast.Assign) else getattr(child, "target", None)
                targets = targets if isinstance(targets, list) else [targets] if targets is not None else []
                keys = {k for k in (key(t, cls, fn) for t in targets) if k}
                found.update(keys or {".".join(p for p in (cls, fn) if p) or "<module>"})
            else:
                walk(child, cls, fn)

    walk(ast.parse(source), None, None)
    return found


def file_name(path: Path) -> str:
    """How the table names a module's file: its place in the package (`native/backends.py`, `engine.py`), and for the
    Space's its place below space/ (`web/calls.py`)."""
    space = PACKAGE / "space"
    return path.relative_to(space if path.is_relative_to(space) else PACKAGE).as_posix()


def in_code() -> set[tuple[str, str]]:
    return {(file_name(path), owner) for path in sorted(PACKAGE.rglob("*.py")) for owner in owners(path.read_text())}


def table_rows(text: str) -> list[set[str]]:
    """Each row's first cell as the set of its `code` spans (a module's file name, an owner)."""
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))] if "\n## " in section[len(SECTION):] else section
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [set(re.findall(r"`([^`]+)`", row.split(" | ")[0])) for row in rows[1:]]


def missing(code: set[tuple[str, str]], rows: list[set[str]]) -> list[tuple[str, str]]:
    return sorted((module, owner) for module, owner in code if not any({module, owner} <= row for row in rows))


def test_every_lock_thread_event_and_queue_has_its_row() -> None:
    code = in_code()
    assert ("decoding/occupancy.py", "Occupancy.cond") in code  # the scan sees them
    assert ("web/calls.py", "ReplyJob.chunks") in code
    assert missing(code, table_rows(DOC.read_text())) == []


def test_a_new_one_without_a_row_is_found() -> None:
    source = '''
import asyncio, threading
from dataclasses import dataclass, field

GLOBAL = threading.Lock()

class Host:
    guard: threading.Lock = field(default_factory=threading.Lock)

    def __init__(self):
        self._ready = threading.Event()

    async def run(self):
        queue = asyncio.Queue()
        threading.Thread(target=print).start()
'''
    assert owners(source) == {"GLOBAL", "Host.guard", "Host._ready", "Host.run"}
    rows = table_rows(f"{SECTION}\n\n| where | what |\n| --- | --- |\n| `x.py` `Host._ready` | an event |\n")
    code = {("x.py", owner) for owner in owners(source)}
    assert missing(code, rows) == [("x.py", "GLOBAL"), ("x.py", "Host.guard"), ("x.py", "Host.run")]
