"""Test model pairs and prompts shared by the test modules."""

from __future__ import annotations

from typing import Any

from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

TARGETS = ("dense", "hybrid")
DRAFTS = ("dflash2", "dflash1")
ALL_PAIRS = [(t, d) for t in TARGETS for d in DRAFTS]
PAIR_IDS = [f"{t}-{d}" for t, d in ALL_PAIRS]

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog.",
    "what is the capital of france?",
    "one two three four five",
    "paris is the capital of france. the answer is 42.",
    "i am fine, thank you.",
    "<|im_start|>user\nhello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
    "this is a tiny test model for speculative decoding with a block diffusion draft.",
    "the draft proposes tokens and the target verifies them.",
    "seven eight nine ten",
    "a",
    "fox dog fox dog fox dog",
]


def pair_files(target: str, draft: str, head: str = "shaped") -> TinyPair:
    return tiny_pair(target, draft, head=head)


def owners_in_turns_answer_alone(engine: Any, method: str, max_tokens: int = 32) -> None:
    """On an engine with 3 parallel sequences: three requests at once, each under an owner of its own, stepped in
    turns; then three more whose owners take the first round's sequences (parked and restored states). Every answer
    must be its prompt's answer alone."""
    prompts = PROMPTS[:5]
    alone = {p: engine.generate(p, max_tokens=max_tokens, speculative=False).tokens for p in prompts}
    for round_, (batch, owners) in enumerate(((prompts[:3], (0, 1, 2)), (prompts[2:], (3, 0, 1)))):
        streams = [engine.stream(p, max_tokens=max_tokens, method=method, cache_owner=f"owner-{o}")
                   for p, o in zip(batch, owners, strict=True)]
        tokens: dict[int, list[int]] = {i: [] for i in range(len(streams))}
        running = set(tokens)
        while running:
            for i in sorted(running):
                event = next(streams[i])
                tokens[i] += event.tokens
                if event.finish_reason is not None:
                    running.discard(i)
        for i, prompt in enumerate(batch):
            assert tokens[i] == alone[prompt], (round_, prompt)
