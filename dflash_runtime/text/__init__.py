"""Text around the tokens: chat prompts rendered with the target's template and tokenized so that only it writes
control tokens (`chat`), and tokens turned into the text deltas a stream shows, stop strings held back
(`deltas`)."""
