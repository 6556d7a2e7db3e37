"""One-off: how much an image's fp32 logits depend on its batch on this GPU, TF32 conv on and off."""
import glob
import time

import torch

from memvit.memory_core import MemoryViT

weights = glob.glob("gpu-data/deit_tiny/*.safetensors")[0]
torch.manual_seed(0)
x = torch.rand(33, 3, 224, 224, device="cuda") * 2 - 1
for conv_tf32 in (True, False):
    torch.backends.cudnn.allow_tf32 = conv_tf32
    for graphs in (False, True):
        e = MemoryViT.from_timm(weights=weights, device="cuda", dtype=torch.float32)
        e.cuda_graphs = graphs
        with torch.inference_mode():
            alone = e(x[:1]).base[0]
            diffs = {n: (e(x[:n]).base[0] - alone).abs().max().item() for n in (2, 7, 17, 33)}
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                e(x[:32])
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / 20 * 1e3
        print(f"conv tf32={conv_tf32} graphs={graphs}: max |alone - in batch n| {diffs}; batch 32 {ms:.2f} ms", flush=True)
