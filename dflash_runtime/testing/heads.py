"""Seeded weights, and the head shapes that decide how well a draft can guess the target.

Two residual-stream channels are reserved in every model. No layer writes them (the rows of every
output projection that land there are zero), so at the output they still hold the token embedding's values:

- the bias channel holds the same value for every token, so its output-head column is a per-token bias:
  strongly negative for added tokens (EOS, ChatML, think, mask) and unprintable bytes, so greedy runs never
  stop early and never emit broken UTF-8;
- the regime channel carries one number per input token that, weighted by the output head, can overrule
  everything else: this is how `shaped`, `const` and `regime` steer the greedy choice from the last token.

A DFlash draft borrows the target's embeddings and head, and its block rows past the anchor read the mask
token, so the mask token's regime value fixes what the draft proposes at every block position.

An MTP (nextn) block shares them too. Given token x_p and the target's hidden state h_{p-1} it predicts x_{p+1},
which every head but `random` decides from x_p's own control channels: so on those heads its input projection
passes the token embedding through unchanged (see mtp_input_projection) and its layer writes little, and it
predicts what the target will say next as the target's own head does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .tokenizer import MASK, TinyVocab, build_vocab, is_plain_text_token
from .words import FLOOR, word_chain

HEADS = ("random", "shaped", "const", "regime", "soft", "markov", "phrase", "words")

REGIME_CHANNEL = 0
BIAS_CHANNEL = 1
CHANNEL_LEVEL = 8.0  # value of a control channel in a token embedding (the rest of a row is ~N(0, 1))
HEAD_GAIN = 4.0  # output-head weight on the regime channel: logit ≈ ±18, far beyond the random part (|.| < 4)
BLOCKED_BIAS = -2 * HEAD_GAIN

CONST_TOKEN = " the"  # head="const": the target always emits it and the draft always proposes it
REGIME_TOKEN = " the"  # head="regime": once the context ends in it, the target repeats it forever
SHAPED_TOKENS = (" hello", " world")  # head="shaped": the target alternates them; the draft proposes the first

# head="soft" / "markov": the next token is one of SOFT_TOKENS, with soft odds (see _steer_soft, _steer_markov).
SOFT_TOKENS = (" the", " a", " of", " and")
SOFT_GAINS = (0.3, 0.2, 0.1, 0.0)  # head weights on the regime channel (≈ 5 after the output norm): odds e^0.5 apart
MARKOV_LEVELS = (1.0, 0.25, -0.25, -1.0)  # regime value each SOFT_TOKEN carries, in units of CHANNEL_LEVEL
MARKOV_GAINS = (0.3, 0.1, -0.1, -0.3)
# head="phrase": a cycle the target follows once it starts it, and leaves now and then (see _steer_phrase).
PHRASE = (" hello", " world", " the", " draft", " is", " a", " model")
# (n_embd, gain of the phrase channels, gain of the first token's entry bias), calibrated on dense targets in chat
# mode: a phrase logit just above the best random logit, so the target leaves the phrase now and then (stretches of
# a few to a few dozen tokens), and an entry logit a little below it. Other widths interpolate.
PHRASE_CALIBRATION = ((128, 0.45, 0.33), (512, 0.48, 0.36))
PHRASE_MASK_LEVEL = 1.0  # the mask raises every phrase channel: the draft's top candidates are the phrase
PHRASE_TOP_K = 8  # DFlash 2 candidates per block row: the whole phrase fits

# DFlash 2 selector weights: large enough to reorder candidates on a random head, negligible otherwise.
SELECTOR_SCALE = {"random": 0.3, "shaped": 0.01, "const": 0.01, "regime": 0.01, "soft": 0.01, "markov": 0.01,
                  "phrase": 0.01, "words": 0.01}


# MTP block on the structured heads: weight of the target's hidden state in the input projection, and of the block's
# attention and FFN writes (small: the token embedding's control channels must decide the prediction), and the gain
# on those control channels (the block sees none of the target's context, so it follows the head's structure more
# firmly than the target does: on "phrase" it continues the phrase where the target may leave it).
MTP_HIDDEN_GAIN = 0.25
MTP_QUIET_GAIN = 0.1
MTP_CONTROL_GAIN = 2.0


def reserved_channels(head: str) -> tuple[int, ...]:
    """Residual channels no layer writes: the two control channels, plus one per phrase token for head="phrase", and
    for head="words" one per token of the word chain and one the mask alone raises (see _steer_words)."""
    extra = tuple(range(2, 2 + len(PHRASE))) if head == "phrase" else ()
    if head == "words":
        extra = tuple(range(2, 3 + len(word_chain(build_vocab()).ids)))
    return (REGIME_CHANNEL, BIAS_CHANNEL, *extra)


class TensorSource:
    """Deterministic float32 tensors. numpy shape (n_out, n_in) is ggml shape {n_in, n_out}."""

    def __init__(self, seed: int, stream: str, reserved: tuple[int, ...] = (REGIME_CHANNEL, BIAS_CHANNEL)) -> None:
        # one independent stream per file role, so adding a tensor to one file never shifts another
        self._rng = np.random.default_rng([seed, zlib.crc32(stream.encode())])
        self._reserved = list(reserved)

    @property
    def reserved(self) -> tuple[int, ...]:
        """The channels no projection into the residual stream writes."""
        return tuple(self._reserved)

    def normal(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> np.ndarray:
        return (mean + std * self._rng.standard_normal(shape)).astype(np.float32)

    def uniform(self, low: float, high: float, n: int) -> np.ndarray:
        return self._rng.uniform(low, high, n).astype(np.float32)

    def signs(self, n: int) -> np.ndarray:
        return np.where(self._rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)

    def matrix(self, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        """Fan-in scaled weights: unit-variance inputs give outputs of variance gain²."""
        return self.normal(n_out, n_in, std=gain / np.sqrt(n_in))

    def residual_write(self, n_embd: int, n_in: int, n_layer: int) -> np.ndarray:
        """An output projection into the residual stream. The 1/sqrt(2·n_layer) gain keeps the stream's
        variance bounded whatever the depth; the control channels' rows are zero."""
        weight = self.matrix(n_embd, n_in, gain=1.0 / np.sqrt(2 * n_layer))
        weight[self._reserved, :] = 0.0
        return weight


@dataclass(frozen=True)
class HeadPlan:
    """The target's token embedding and output head (the draft borrows both)."""

    token_embd: np.ndarray  # (n_vocab, n_embd)
    output: np.ndarray  # (n_vocab, n_embd)


def build_head(head: str, vocab: TinyVocab, n_embd: int, source: TensorSource) -> HeadPlan:
    embd = source.normal(vocab.n_vocab, n_embd)
    output = source.normal(vocab.n_vocab, n_embd, std=1.0 / np.sqrt(n_embd))
    embd[:, BIAS_CHANNEL] = CHANNEL_LEVEL
    output[:, BIAS_CHANNEL] = 0.0
    blocked = [i for i in range(vocab.n_vocab) if not is_plain_text_token(vocab, i)]
    output[blocked, :] = 0.0
    output[blocked, BIAS_CHANNEL] = BLOCKED_BIAS
    _STEERING[head](embd, output, vocab, source)
    return HeadPlan(token_embd=embd, output=output)


def mtp_input_projection(head: str, n_embd: int, source: TensorSource) -> np.ndarray:
    """The nextn eh_proj, numpy (n_embd, 2 * n_embd): it reads concat(enorm(embedding of x_p), hnorm(h_{p-1})).

    Structured heads: identity on the embedding half (MTP_CONTROL_GAIN on the reserved channels) plus a small random
    read of the hidden half that leaves the reserved channels alone, so x_p's control channels reach the shared head
    as they do in the target.
    `random`: a random projection of both halves (no better than chance), except that the bias channel is copied,
    so the block never proposes the tokens the head blocks (EOS, ChatML, broken bytes)."""
    reserved = list(source.reserved)
    if head == "random":
        weight = source.matrix(n_embd, 2 * n_embd)
        weight[BIAS_CHANNEL, :] = 0.0
        weight[BIAS_CHANNEL, BIAS_CHANNEL] = 1.0
        return weight
    embedding = np.eye(n_embd, dtype=np.float32)
    embedding[reserved, reserved] = MTP_CONTROL_GAIN
    hidden = source.matrix(n_embd, n_embd, gain=MTP_HIDDEN_GAIN)
    hidden[reserved, :] = 0.0
    return np.concatenate([embedding, hidden], axis=1)


def plain_ids(vocab: TinyVocab) -> np.ndarray:
    return np.array([i for i in range(vocab.n_vocab) if is_plain_text_token(vocab, i)])


def _steer_random(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """Nothing: the regime channel stays a random feature; the draft guesses right ≈ 1/n_vocab of the time."""


def _steer_const(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """Every token (and the mask) raises the regime channel; only X's head row rewards it."""
    plain = plain_ids(vocab)
    embd[:, REGIME_CHANNEL] = CHANNEL_LEVEL
    output[plain, REGIME_CHANNEL] = -source.uniform(HEAD_GAIN / 4, HEAD_GAIN, len(plain))
    output[vocab.id_of_text(CONST_TOKEN), REGIME_CHANNEL] = HEAD_GAIN


def _steer_shaped(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """A + B: after a positive regime value the target emits A, after a negative one B. A carries a negative
    value and B a positive one, so the target alternates A B A B; the mask is positive, so the draft proposes
    A everywhere: one accepted token per step, the rest rejected."""
    proposed, other = (vocab.id_of_text(text) for text in SHAPED_TOKENS)
    embd[:, REGIME_CHANNEL] = CHANNEL_LEVEL * source.signs(vocab.n_vocab)
    embd[proposed, REGIME_CHANNEL] = -CHANNEL_LEVEL
    embd[[other, vocab.id_of(MASK)], REGIME_CHANNEL] = CHANNEL_LEVEL
    output[:, REGIME_CHANNEL] = 0.0
    output[proposed, REGIME_CHANNEL] = HEAD_GAIN
    output[other, REGIME_CHANNEL] = -HEAD_GAIN


def _steer_regime(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """X and the mask raise the regime channel, every other token lowers it; X's head row reads only that
    channel. After X the target repeats X (and the draft proposes X): full acceptance. After anything else
    X's logit is ≈ -18, so the random part of the head writes context-dependent text the draft never guesses."""
    regime_id = vocab.id_of_text(REGIME_TOKEN)
    embd[:, REGIME_CHANNEL] = -CHANNEL_LEVEL
    embd[[regime_id, vocab.id_of(MASK)], REGIME_CHANNEL] = CHANNEL_LEVEL
    output[:, REGIME_CHANNEL] = 0.0
    output[regime_id, :] = 0.0
    output[regime_id, REGIME_CHANNEL] = HEAD_GAIN


def _only(output: np.ndarray, vocab: TinyVocab, rows: dict[str, float]) -> None:
    """Every plain-text token blocked except `rows`, whose head rows read the regime channel alone, with these gains."""
    plain = plain_ids(vocab)
    output[plain, :] = 0.0
    output[plain, BIAS_CHANNEL] = BLOCKED_BIAS
    for text, gain in rows.items():
        row = vocab.id_of_text(text)
        output[row, :] = 0.0
        output[row, REGIME_CHANNEL] = gain


def _steer_soft(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """A soft, context-free next-token distribution over SOFT_TOKENS (everything else blocked): every token and the
    mask carry the same regime value, so the draft's distribution at its mask rows is close to the target's (only the
    output norm's scale differs). Rejection sampling keeps nearly every draft there, sample-and-match about p_max."""
    embd[:, REGIME_CHANNEL] = CHANNEL_LEVEL
    _only(output, vocab, dict(zip(SOFT_TOKENS, SOFT_GAINS, strict=True)))


def _steer_markov(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """Like soft, but the distribution depends on the previous token: each SOFT_TOKEN carries its own regime value
    (MARKOV_LEVELS) and the head rows weigh it with opposite signs, so after the first token the second is likely
    and after the last the last. The draft always proposes from the mask's value: right in some contexts only."""
    embd[:, REGIME_CHANNEL] = CHANNEL_LEVEL
    for text, level in zip(SOFT_TOKENS, MARKOV_LEVELS, strict=True):
        embd[vocab.id_of_text(text), REGIME_CHANNEL] = CHANNEL_LEVEL * level
    _only(output, vocab, dict(zip(SOFT_TOKENS, MARKOV_GAINS, strict=True)))


def _steer_phrase(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """PHRASE as a cycle: token j of the phrase raises channel 2 + j, which only token j + 1's head row reads, so the
    target continues the phrase until the random part of the head wins (a few tokens to a few dozen); the first
    phrase token has a small bias, so random text enters the phrase every now and then. The mask raises every phrase
    channel a little, and the DFlash 2 selector (see phrase_selector) scores the phrase's transitions: the draft
    proposes the phrase's continuation. Acceptance is high inside the phrase and low elsewhere, as with real text."""
    ids = [vocab.id_of_text(text) for text in PHRASE]
    mask = vocab.id_of(MASK)
    gain, entry = phrase_gains(embd.shape[1])
    output[ids, :] = 0.0  # phrase tokens score by their channels alone; other tokens keep random rows
    for j, token in enumerate(ids):
        channel = 2 + j
        embd[:, channel] = 0.0
        embd[token, channel] = CHANNEL_LEVEL
        embd[mask, channel] = CHANNEL_LEVEL * PHRASE_MASK_LEVEL
        output[:, channel] = 0.0
        output[ids[(j + 1) % len(ids)], channel] = gain
    output[ids[0], BIAS_CHANNEL] = entry


def phrase_gains(n_embd: int) -> tuple[float, float]:
    (w0, g0, e0), (w1, g1, e1) = PHRASE_CALIBRATION
    x = min(1.0, max(0.0, (n_embd - w0) / (w1 - w0)))
    return g0 + x * (g1 - g0), e0 + x * (e1 - e0)


def phrase_selector(vocab: TinyVocab, n_embd: int, rank: int, source: TensorSource
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DFlash 2 selector weights (predecessor, successor: (n_vocab, rank); hidden: (rank, n_embd)) that score
    "phrase token j → phrase token j + 1" high: transition score(p → s) = unary(s) + (prev[p] ⊙ gate) · next[s], with
    the gate read from the bias channel (the same for every row)."""
    predecessor = source.normal(vocab.n_vocab, rank, std=0.01)
    successor = source.normal(vocab.n_vocab, rank, std=0.01)
    hidden = np.zeros((rank, n_embd), dtype=np.float32)
    hidden[:, BIAS_CHANNEL] = 1.0  # gate ≈ the normalised bias channel (≈ 5) in every rank dimension
    ids = [vocab.id_of_text(text) for text in PHRASE]
    for j, token in enumerate(ids):
        predecessor[token, :] = 0.0
        predecessor[token, j] = 1.0
        successor[ids[(j + 1) % len(ids)], :] = 0.0
        successor[ids[(j + 1) % len(ids)], j] = 2.0
    return predecessor, successor, hidden


# head="words": the logit gain per nat of the chain's log-odds, calibrated on the dense scaled target of width 512 in
# chat mode so that a DFlash 2 draft of length 7 keeps about as many tokens per verify as published DFlash 2 runs do
# (~3.6): the target takes the chain's usual successor most of the time and another one where the context (the head's
# random part) outweighs the odds. Other widths and hybrid targets are not calibrated (the text stays words).
WORDS_GAIN = 1.2
# The target's QK-norm gains per head (1 elsewhere). "words": sharp attention, so what the target reads from its
# context depends on which tokens stand where (RoPE), not on their mean: a chain with one token's memory would
# otherwise fall into a loop that the context, averaged, only confirms.
QK_GAIN = {"words": 4.0}
# The target's attention writes, scaled per head (1 elsewhere), and the share of a token embedding's random part kept
# ("words": the context, read by attention, outweighs the last token in the head's random part).
ATTENTION_WRITE_GAIN = {"words": 2.0}
WORDS_EMBED_NOISE = 0.3
# Heads whose target layers read nothing from the reserved channels: the control values (the same for many tokens)
# would otherwise give every layer's output a fixed part, a fixed preference the context could not move.
BLIND_LAYERS = ("words",)
WORDS_MASK_BONUS = 1.0  # head weight on the mask's channel for the draft's candidates (the usual successors)
WORDS_SELECTOR_GAIN = 2.0  # selector weight per nat of log-odds: the chain's transitions outweigh the draft's logits


def words_top_k(n_embd: int) -> int:
    """DFlash 2 candidates per block row for head="words": as many as the lattice fits (n_embd >= k (k + 1))."""
    k = 1
    while (k + 1) * (k + 2) <= n_embd:
        k += 1
    return k


def _words_candidates(vocab: TinyVocab, n_embd: int) -> list[int]:
    """Indices into the chain of the tokens the draft offers at every block row: the usual successors, the most
    often needed first, as many as fit (words_top_k)."""
    chain = word_chain(vocab)
    need: dict[int, int] = {}
    for usual in chain.usual:
        need[usual] = need.get(usual, 0) + 1
    ordered = sorted(need, key=lambda j: (-need[j], j))
    return ordered[: words_top_k(n_embd)]


def _steer_words(embd: np.ndarray, output: np.ndarray, vocab: TinyVocab, source: TensorSource) -> None:
    """The word chain (see words.py): chain token i raises channel 2 + i alone, and every chain token's head row reads
    those channels with the chain's log-odds of following it, so the target writes the chain's words, its usual
    successor most of the time and another one where the context (the random part of its head row) outweighs the odds
    gap. Tokens outside the chain are blocked. The mask raises only the last reserved channel, which the head rows of
    the usual successors read: the draft's candidates at every block row are those tokens, and its selector (see
    words_selector) walks the chain's odds from the anchor."""
    chain = word_chain(vocab)
    n = len(chain.ids)
    gain = WORDS_GAIN / CHANNEL_LEVEL  # a channel reads ≈ CHANNEL_LEVEL before the output norm
    plain = plain_ids(vocab)
    keep = output[list(chain.ids), :].copy()
    output[plain, :] = 0.0
    output[plain, BIAS_CHANNEL] = BLOCKED_BIAS
    output[list(chain.ids), :] = keep
    output[list(chain.ids), BIAS_CHANNEL] = 0.0
    mask_channel = 2 + n
    embd[:, 2:] *= WORDS_EMBED_NOISE
    embd[:, 2 : 3 + n] = 0.0
    for i, token in enumerate(chain.ids):
        embd[token, 2 + i] = CHANNEL_LEVEL
        output[list(chain.ids), 2 + i] = gain * chain.log_odds[i, :]
    embd[vocab.id_of(MASK), mask_channel] = CHANNEL_LEVEL
    # a word's second piece only after its first: where the context is no chain token (the prompt's end), words start
    output[[chain.ids[j] for j in chain.pieces], BIAS_CHANNEL] = gain * FLOOR / 2
    output[:, mask_channel] = 0.0
    for j in _words_candidates(vocab, embd.shape[1]):
        output[chain.ids[j], mask_channel] = WORDS_MASK_BONUS


def words_selector(vocab: TinyVocab, n_embd: int, rank: int, source: TensorSource
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DFlash 2 selector weights for head="words": score(p → s) = WORDS_SELECTOR_GAIN · log P(s | p) · gate, with the
    predecessor one-hot in the rank dimension of its chain index and the gate read from the bias channel. Needs
    rank >= the chain's length."""
    chain = word_chain(vocab)
    if rank < len(chain.ids):
        raise ValueError(f'head="words" needs selector_rank >= {len(chain.ids)}, got {rank}')
    predecessor = source.normal(vocab.n_vocab, rank, std=0.01)
    successor = source.normal(vocab.n_vocab, rank, std=0.01)
    hidden = np.zeros((rank, n_embd), dtype=np.float32)
    hidden[:, BIAS_CHANNEL] = 1.0
    for i, token in enumerate(chain.ids):
        predecessor[token, :] = 0.0
        predecessor[token, i] = 1.0
        successor[token, :] = 0.0
        successor[token, : len(chain.ids)] = WORDS_SELECTOR_GAIN * chain.log_odds[:, i]
    return predecessor, successor, hidden


# DSpark (a DFlash v1 draft with a Markov head and, optionally, a confidence head; see dspark_markov):
MARKOV_PHRASE_GAIN = 3.0  # the Markov bias on the phrase's next token after a phrase token: it outweighs the mask row's
MARKOV_AGAINST = 8.0  # head="markov": the bias against the target's odds, above their weight (dspark_markov)
CONFIDENCE_SPREAD = 1.5  # the confidence logit's part read from the row's hidden state: it varies from row to row
CONFIDENCE_PHRASE = (-1.0, 6.0, -2.0)  # head="phrase": the range of the gains after each phrase token, and the bias


def dspark_markov(head: str, vocab: TinyVocab, rank: int, source: TensorSource) -> tuple[np.ndarray, np.ndarray]:
    """A DSpark Markov head, numpy (n_vocab, rank) each: `w1` embeds the token before a block row, `w2` turns that
    into a bias over the vocabulary, bias(s | prev) = w2[s] · w1[prev] (libllama adds it to the row's logits).

    `phrase`: the phrase's next token after each phrase token (right where the target stays in the phrase, wrong
    where it leaves it); `words`: the word chain's log-odds, as the DFlash 2 selector scores them; `markov`: against
    the target's odds (after a token the target follows with its likeliest successor, the bias favours the least
    likely one), so the draft's distribution is far from the target's; elsewhere small random weights (larger on
    `random`), which leave the draft as a DFlash v1 draft read from its anchor row on."""
    w1 = source.normal(vocab.n_vocab, rank, std=SELECTOR_SCALE[head])
    w2 = source.normal(vocab.n_vocab, rank, std=SELECTOR_SCALE[head])
    if head == "phrase":
        ids = [vocab.id_of_text(text) for text in PHRASE]
        for j, token in enumerate(ids):
            w1[token, :] = 0.0
            w1[token, j] = 1.0
            w2[ids[(j + 1) % len(ids)], :] = 0.0
            w2[ids[(j + 1) % len(ids)], j] = MARKOV_PHRASE_GAIN
    elif head == "words":
        chain = word_chain(vocab)
        if rank < len(chain.ids):
            raise ValueError(f'head="words" needs markov_rank >= {len(chain.ids)}, got {rank}')
        for i, token in enumerate(chain.ids):
            w1[token, :] = 0.0
            w1[token, i] = 1.0
            w2[token, :] = 0.0
            w2[token, : len(chain.ids)] = WORDS_SELECTOR_GAIN * chain.log_odds[:, i]
    elif head == "markov":
        ids = [vocab.id_of_text(text) for text in SOFT_TOKENS]
        for t, token in enumerate(ids):
            w1[token, :] = 0.0
            w1[token, t] = 1.0
        for s_, token in enumerate(ids):
            w2[token, :] = 0.0
            w2[token, : len(ids)] = [-MARKOV_AGAINST * MARKOV_GAINS[s_] * level for level in MARKOV_LEVELS]
    return w1, w2


def dspark_confidence(head: str, vocab: TinyVocab, n_embd: int, rank: int, source: TensorSource
                      ) -> tuple[np.ndarray, np.ndarray]:
    """A DSpark confidence head: weight numpy (1, n_embd + rank) over [the row's hidden state; w1[prev]], and its
    bias (1,); libllama scores a row sigmoid(weight · features + bias). Its score varies with the row's hidden state
    and, more, with the token before the row (random reads of both, each of spread CONFIDENCE_SPREAD), so drafts are
    cut at different positions. On `phrase` it is doubtful after a token outside the phrase (its bias) and confident
    after most phrase tokens (one weight per phrase token, drawn): it stops drafts where the target left the phrase,
    and some inside it."""
    weight = np.zeros((1, n_embd + rank), dtype=np.float32)
    weight[0, :n_embd] = source.normal(n_embd, std=CONFIDENCE_SPREAD / np.sqrt(n_embd))
    w1_std = SELECTOR_SCALE[head]  # dspark_markov's random rows: their read spreads as the hidden state's
    weight[0, n_embd:] = source.normal(rank, std=CONFIDENCE_SPREAD / (np.sqrt(rank) * w1_std))
    bias = np.zeros(1, dtype=np.float32)
    if head == "phrase":
        low, high, bias[0] = CONFIDENCE_PHRASE
        weight[0, n_embd:n_embd + len(PHRASE)] = source.uniform(low, high, len(PHRASE))
    return weight, bias


_STEERING: dict[str, Callable[[np.ndarray, np.ndarray, TinyVocab, TensorSource], None]] = {
    "random": _steer_random,
    "shaped": _steer_shaped,
    "const": _steer_const,
    "regime": _steer_regime,
    "soft": _steer_soft,
    "markov": _steer_markov,
    "phrase": _steer_phrase,
    "words": _steer_words,
}
