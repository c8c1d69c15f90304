"""tessera's DiT (default, and with Wan's options) against diffusers' WanTransformer3DModel on the CPU, side
by side: one training step (forward, backward, AdamW) in float32 at 384 wide, 6 heads, 4 layers, 1,024
tokens and 64 text tokens of 4,096; five interleaved rounds against drift on a shared machine (issue 11).

    python scripts/bench_wan_cpu.py
"""

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_gpu import WanAdapter  # noqa: E402

from models.dit import WAN_OPTIONS, DiT, count_parameters  # noqa: E402

CASE = dict(depth=4, hidden=384, heads=6, ffn=1536, latent=(16, 1, 64, 64), text=(64, 4096))


def tessera(options):
    return DiT(16, 4096, depth=4, hidden_size=384, num_heads=6, patch_size=(1, 2, 2), ffn_dim=1536, **options)


def main(rounds: int = 5, steps: int = 5):
    torch.set_num_threads(2)
    models = {
        "tessera default (adaLN-Zero)": lambda: tessera({}),
        "tessera, Wan options": lambda: tessera(WAN_OPTIONS),
        "diffusers WanTransformer3DModel": lambda: WanAdapter(CASE),
    }
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(1, 16, 1, 64, 64, generator=g), torch.randn(1, 16, 1, 64, 64, generator=g)
    y, mask, t = (
        torch.randn(1, 64, 4096, generator=g),
        torch.ones(1, 64, dtype=torch.bool),
        torch.rand(1, generator=g),
    )
    tt = t.view(-1, 1, 1, 1, 1)
    results = {}
    for round_ in range(rounds):
        for name, make in models.items():
            torch.manual_seed(0)
            model = make()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model=model, optimizer=optimizer):
                v = model((1 - tt) * x0 + tt * noise, t, y, mask)
                F.mse_loss(v.float(), noise - x0).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            results.setdefault(name, []).append(statistics.median(times))
            if round_ == 0:
                print(f"{name}: {count_parameters(model) / 1e6:.2f}M parameters", flush=True)
    for name, seconds in results.items():
        print(
            f"{name}: best {1e3 * min(seconds):.0f} ms, median {1e3 * statistics.median(seconds):.0f} ms a step "
            f"(rounds {', '.join(f'{1e3 * s:.0f}' for s in seconds)})"
        )
    reference = results["diffusers WanTransformer3DModel"]
    for name in list(models)[:2]:
        print(
            f"{name} / diffusers speed: {statistics.median(reference) / statistics.median(results[name]):.2f}x "
            f"(medians), {min(reference) / min(results[name]):.2f}x (best rounds)"
        )


if __name__ == "__main__":
    main()
