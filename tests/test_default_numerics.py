"""The default numerics ("auto": 8-bit activation rounding where the CPU takes integer dots for the weight's format)
on the three real models, held the way llama.cpp's `llama-perplexity --kl-divergence` holds a quantization:
teacher-forced over the same 170-token prose (tests/fixtures/real/<model>.tf.npz, make_real_fixtures.py), every row's
distribution against llama.cpp's own runs of the same file, by mean KL divergence and top-1 agreement.

The rows are the ones generation computes: the first TF_K tokens through a captured prefill chunk, the rest through the
per-token step (rows TF_K-1..169, 139 of them).

Two references, both llama.cpp (F32 KV cache, as the engine's):
  - exact math: its run of the file's F32 twin. Our rounding must lose no more than llama.cpp's own does.
  - its run of the quantized file. A run whose only change is the summation order already moves these small models
    far: llama.cpp fed one token per forward instead of the whole prompt is 1.1e-3..3.4e-3 KL from itself, with top-1
    95.0%..99.3%. That is above any absolute bar an engine could be held to (KL <= 1e-3, top-1 >= 98%), so ours is held
    relative to that spread. Activations rounded to 8 bits per 32-block flip single roundings when a float sum's order
    changes, and in 30 layers of a model with outlier activations each flip is a visible step.
On the deepseek2 fixtures, where llama.cpp is far steadier, test_reference holds the same numerics to KL <= 1e-3."""
import functools, pathlib

import numpy as np
import pytest

from family import topk_kl
from tg_ds4.io.registry import resolve
from tg_ds4.runtime.runner import Runner

ROOT = pathlib.Path(__file__).parent / "fixtures" / "real"
MODELS = sorted(p.name.removesuffix(".tf.npz") for p in ROOT.glob("*.tf.npz"))
TF_K = 32  # one captured 32-token chunk, then the per-token step

@functools.cache
def teacher_forced(name: str) -> tuple[dict, np.ndarray]:
  """The fixture's arrays from row TF_K-1 on, and our logits at those rows under the default numerics."""
  tf = dict(np.load(ROOT / f"{name}.tf.npz"))
  ids = tf.pop("ids").tolist()
  runner = Runner.load(resolve(name), max_ctx=len(ids), numerics="auto")
  return {k: v[TF_K - 1:] for k, v in tf.items()}, runner.engine_logits(ids, prefill_tokens=TF_K)

def test_fixtures_cover_the_registry():
  assert MODELS == sorted(p.stem for p in ROOT.glob("*.json")) and len(MODELS) == 3

@pytest.mark.parametrize("name", MODELS)
def test_default_numerics_against_exact_math(name):
  """KL(exact || ours) within 1.25x of KL(exact || llama.cpp): our rounding costs no more than llama.cpp's (measured
  0.95x smollm2, 0.43x qwen2.5-coder, 0.32x gemma3: K-quant matmuls take exact float math under auto)."""
  tf, ours = teacher_forced(name)
  kl_ours, kl_llama = float(topk_kl(tf["twin_ids"], tf["twin_logprobs"], ours).mean()), float(tf["kl_twin_quantized"].mean())
  print(f"\n{name}: mean KL from exact math over {len(ours)} rows: ours {kl_ours:.2e}, llama.cpp {kl_llama:.2e}")
  assert len(ours) >= 128 and kl_ours <= 1.25 * kl_llama

@pytest.mark.parametrize("name", MODELS)
def test_default_numerics_against_llama_cpp(name):
  """Against llama.cpp's run of the quantized file: mean KL within 1.5x of llama.cpp's distance from itself fed one
  token per forward (measured 1.18x smollm2, 1.04x qwen2.5-coder, 1.06x gemma3), and top-1 agreement at most 5 points
  under that run's (measured -0.0, -0.7 and -3.6 points: single flips at near-ties, on 139 rows)."""
  tf, ours = teacher_forced(name)
  ref = tf["quantized_ids"][:, 0]
  kl, kl_self = float(topk_kl(tf["quantized_ids"], tf["quantized_logprobs"], ours).mean()), float(tf["kl_quantized_one_token"].mean())
  top1, top1_self = float((ours.argmax(-1) == ref).mean()), float((tf["one_token_top1"] == ref).mean())
  print(f"\n{name}: vs llama.cpp's run of the file, mean KL {kl:.2e} (llama.cpp one token per forward: {kl_self:.2e}), "
        f"top-1 {top1:.1%} ({top1_self:.1%})")
  assert kl <= 1.5 * kl_self and top1 >= top1_self - 0.05
