"""Tools around the engine: bench (against llama.cpp), profile (per-kernel times and bandwidth), probe (a model's numerics),
inspect (what a file holds)."""
