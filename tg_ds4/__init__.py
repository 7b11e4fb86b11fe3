"""tg_ds4: DeepSeek-family LLM inference on tinygrad, from GGUF files."""
from tg_ds4 import kernel_opts
from tg_ds4.gguf import GGUFError, GGUFFile, open_gguf
from tg_ds4.quant import QTensor, dequantize, linear

kernel_opts.install()  # CPU GEMVs keep their lane accumulators without a row upcast (see kernel_opts)

__all__ = ["GGUFError", "GGUFFile", "open_gguf", "QTensor", "dequantize", "linear"]
