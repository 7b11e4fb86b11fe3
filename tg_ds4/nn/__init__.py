"""The blocks models are made of: layers (linear, norms, embedding, weight loading), rope, attention (gqa, mla, dsa),
mixture of experts (moe), top-k selection, and the rows of a KV cache a graph reads and writes (cache_rows)."""
