"""Text in and out: the tokenizer (GGUF vocabularies and tokenizer.json pipelines) and chat templates."""
