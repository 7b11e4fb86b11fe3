"""Running a loaded model: the runner (prefill, decode, generation), the batcher (many requests in slots), sampling, the
captured decode step (jit) and its on-disk cache (stepcache)."""
