"""tg_ds4: DeepSeek-family LLM inference on tinygrad, from GGUF files. Importing it changes nothing in tinygrad (see
backend/compat.py: the CPU kernel heuristic is installed when a model is loaded for the CPU)."""
from tg_ds4.io.gguf import GGUFError, GGUFFile, open_gguf
from tg_ds4.quant.formats import QTensor, dequantize, linear

__all__ = ["GGUFError", "GGUFFile", "open_gguf", "QTensor", "dequantize", "linear"]
