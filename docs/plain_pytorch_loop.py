"""NVFP4 training in a plain PyTorch loop: no TorchTitan trainer, just ``titan_nvfp4.convert``, AdamW and
torch.distributed.checkpoint (docs/plain_pytorch.md walks through it).

    python docs/plain_pytorch_loop.py --steps 40                                   # a GPU, eager
    python docs/plain_pytorch_loop.py --steps 40 --compile                          # each block compiled
    python docs/plain_pytorch_loop.py --steps 20 --checkpoint ckpt --save-at 10     # save at step 10 ...
    python docs/plain_pytorch_loop.py --steps 20 --checkpoint ckpt --resume         # ... and resume from it
    python docs/plain_pytorch_loop.py --steps 4 --device cpu --gemm-backend reference   # the CPU reference

The model is TorchTitan's Llama3 (flavor ``debugmodel`` by default), used as a plain nn.Module; any model whose
large layers are nn.Linear converts the same way. The batches are random tokens: put your data loader there.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import titan_nvfp4


def build_model(flavor: str = "debugmodel", seq_len: int = 512) -> torch.nn.Module:
    """TorchTitan's Llama3 of ``flavor`` on the meta device (no memory until ``to_empty``)."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    import titan_nvfp4.integration.flavors  # noqa: F401  (registers our 2B_bench flavor beside TorchTitan's)

    args = copy.deepcopy(llama3_args[flavor])
    args.max_seq_len = seq_len
    with torch.device("meta"):
        return Transformer(args)


def batch_at(step: int, vocab: int, batch: int, seq: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, labels) of optimizer step ``step``: random tokens drawn from (seed, step), so a resumed run
    reads what the uninterrupted one read."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


class TrainState(Stateful):
    """What a checkpoint holds: model, optimizer, and the NVFP4 per-step state (SR streams, amax windows)."""

    def __init__(self, model, optimizer, nvfp4_steps):
        self.model, self.optimizer, self.nvfp4_steps = model, optimizer, nvfp4_steps

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "nvfp4": self.nvfp4_steps.state_dict()}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.nvfp4_steps.load_state_dict(state["nvfp4"])


def train(model: torch.nn.Module, nvfp4_steps, *, steps: int, batch: int = 8, seq: int = 512, lr: float = 1e-3,
          seed: int = 42, device: str = "cuda", compile: bool = False, checkpoint: Path | None = None,
          save_at: int = 0, resume: bool = False, log_every: int = 10, warmup: int = 5) -> dict:
    """Materialize, initialize and train the converted ``model``; ``nvfp4_steps.step()`` runs after every
    optimizer step. Returns {"losses": [loss of each step run], "tokens_per_s": over the steps after the first
    ``warmup`` (compilation, autotuning)}. The losses stay on the device until a log step, as TorchTitan keeps them,
    so no step waits for the GPU but those."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))  # TorchTitan's init (also splits low-rank layers)
    if compile:
        for name, block in model.layers.named_children():  # per block, as TorchTitan's --compile.enable does
            model.layers.register_module(name, torch.compile(block, fullgraph=True))
    # fused on the GPU, as TorchTitan's default optimizer.implementation = "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-8, weight_decay=0.1,
                                  fused=torch.device(device).type == "cuda" or None)
    state = TrainState(model, optimizer, nvfp4_steps)
    start = 0
    if resume:
        holder = {"train": state}
        dcp.load(holder, checkpoint_id=str(checkpoint))
        start = nvfp4_steps.steps
    vocab = model.vocab_size
    losses, t0 = [], None
    for step in range(start + 1, steps + 1):
        if step == start + warmup + 1:
            torch.cuda.synchronize() if torch.device(device).type == "cuda" else None
            t0 = time.perf_counter()
        inputs, labels = batch_at(step, vocab, batch, seq, seed, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        nvfp4_steps.step()  # after every optimizer step: SR streams, schedules, amax windows, refreshes
        losses.append(loss.detach())
        if log_every and step % log_every == 0:
            print(f"step {step:5d}  loss {losses[-1].item():.4f}", flush=True)
        if checkpoint is not None and step == save_at:
            dcp.save({"train": state}, checkpoint_id=str(checkpoint))
    losses = [loss.item() for loss in losses]  # waits for the last step
    timed = steps - start - warmup
    tps = batch * seq * timed / (time.perf_counter() - t0) if t0 is not None and timed > 0 else float("nan")
    return {"losses": losses, "tokens_per_s": tps}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s (compilation, autotuning)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--recipe", default="nvidia_paper")
    p.add_argument("--gemm-backend", default="auto")
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    model = build_model(a.flavor, a.seq)
    # Every Linear of the transformer blocks in NVFP4, the LM head ("output") in BF16, as the job file does
    model, nvfp4_steps = titan_nvfp4.convert(model, a.recipe, filter_fqns=["output"], gemm_backend=a.gemm_backend,
                                             eager_graphs="small", total_steps=a.steps)
    out = train(model, nvfp4_steps, steps=a.steps, batch=a.batch, seq=a.seq, device=a.device, compile=a.compile,
                checkpoint=a.checkpoint, save_at=a.save_at, resume=a.resume, warmup=a.warmup)
    print(f"final loss {out['losses'][-1]:.4f}  tokens/s {out['tokens_per_s']:.0f} (steps after {a.warmup})")


if __name__ == "__main__":
    main()
