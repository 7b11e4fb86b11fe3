"""Models built from nn blocks: the architecture table (families), the dense / DeepSeek V2-V3 / DSA transformer, DeepSeek V4,
and weight re-encoding for the CPU (widen)."""
