"""Reading models in: GGUF files (gguf), Hugging Face checkpoint folders (hf_folder, hf_tokenizer), model names and downloads (registry)."""
