"""Test model pairs and prompts shared by the test modules."""

from __future__ import annotations

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
