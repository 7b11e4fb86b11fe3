"""Peak RSS while loading a GGUF and touching every tensor (issue: ≤ 1.3x the file size).

  /usr/bin/time -v python profiles/load_rss.py qwen2.5-coder-0.5b

Each tensor is dequantized on the device and reduced to one number, so every packed byte is read through the fused
quant expression; the weights themselves are never copied (CPU tensors are views of the mmapped file)."""
import resource, sys, time

from tinygrad import Device, dtypes

from tg_ds4.io.gguf import GGUFFile
from tg_ds4.io.registry import resolve

def main(name: str) -> None:
  t0 = time.perf_counter()
  gf = GGUFFile(resolve(name))
  tensors = gf.tensors()
  total, nonfinite = 0.0, 0
  for n, w in tensors.items():
    s = w.dequant(dtypes.float32).abs().sum().item()
    total += s
    if s != s or s in (float("inf"), float("-inf")): nonfinite += 1
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(f"{gf.path.name}: {len(tensors)} tensors on {Device.DEFAULT}, file {gf.file_size/1e6:.1f} MB, peak RSS {peak/1e6:.1f} MB "
        f"= {peak/gf.file_size:.3f}x file, sum|w| {total:.6g}, non-finite tensors {nonfinite}, {time.perf_counter()-t0:.1f} s")

if __name__ == "__main__": main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b")
