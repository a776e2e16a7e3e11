"""Drop-in replacements for `llama_cpp.Llama` code that used `draft_model=`: `DFlashLlama`, `DFlashDraftModel`,
`ArrayDraft` (see `llama.py`), with llama-cpp-python's OpenAI-style shapes (`openai.py`)."""

from .llama import ArrayDraft, DFlashDraftModel, DFlashLlama, as_intc_tokens

__all__ = ["ArrayDraft", "DFlashDraftModel", "DFlashLlama", "as_intc_tokens"]
