"""The page and the API: the gradio endpoints and handlers (`endpoints`), a tab's conversation and the text shown."""
