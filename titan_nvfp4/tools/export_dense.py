"""Fold low-rank layers back into dense weights, so a BF16 model (no NVFP4, no lora) loads them.

    python -m titan_nvfp4.tools.export_dense CHECKPOINT OUT.pt

CHECKPOINT: a TorchTitan DCP checkpoint directory (e.g. outputs/<run>/checkpoint/step-1000) or a
torch.save'd state dict. A low-rank layer's ``weight`` (expert: ``w1``, ``w2``, ``w3``, ``mlp1_weight``,
``mlp2_weight``) is already saved as the full W = R + U·diag(σ)·V next to ``lora_residual`` (R) and the
factors ``lora_u``, ``lora_sigma``, ``lora_v`` (expert: ``w1_lora_u``, ...); the export keeps W and drops
the residual, the factors, the ``lora_decomposed`` flags and OutControl's ``outcontrol_index`` /
``outcontrol_done``, so its weights are exactly those a BF16 model loads from the checkpoint directly. A
checkpoint written before the residual was saved apart (``weight`` = R) is folded: W = R + U·diag(σ)·V in fp32,
stored in R's dtype. All other entries are kept as they are.
OUT.pt is a torch.save'd state dict, written atomically (a kill mid-write leaves the old file or none); an OUT
that names the checkpoint, or lies inside its folder, is refused. The checkpoint's bytes are verified first
(tools/checkpoint_integrity.py: file sizes against .metadata, each entry's CRC-32), and weights with NaN or Inf
are refused by key.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ..numerics.lowrank import lowrank_merge
from .atomic import atomic_file
from .checkpoint_integrity import verified_or_fail
from .cli import fail, parser, require_inputs, require_output, writing

_FACTORS = ("lora_u", "lora_sigma", "lora_v", "lora_residual")
#: per-layer state a BF16 model has no place for: the low-rank flags, OutControl's channel selection
_FLAGS = ("lora_decomposed", ".outcontrol_index", ".outcontrol_done")


def weight_key_of(prefix: str) -> str:
    """The residual's key for factor keys ``prefix + "lora_u"``: ``<linear>.weight`` for a
    DecomposedLinear (prefix ``<linear>.``), ``<experts>.w1`` for expert factors (``<experts>.w1_``)."""
    return prefix + "weight" if prefix == "" or prefix.endswith(".") else prefix[:-1]


def fold_decomposed(state_dict: dict) -> dict:
    """The dense twin of a state dict with low-rank entries (see the module docstring)."""
    prefixes = {k[: -len("lora_u")] for k in state_dict if k.endswith("lora_u")}
    drop = {p + n for p in prefixes for n in _FACTORS} | {k for k in state_dict if k.endswith(_FLAGS)}
    out = {k: v for k, v in state_dict.items() if k not in drop}
    for p in sorted(prefixes):
        w_key = weight_key_of(p)
        missing = [k for k in (w_key, p + "lora_sigma", p + "lora_v") if k not in state_dict]
        if missing:
            raise KeyError(f"export_dense: {p}lora_u has no {', '.join(missing)}")
        if p + "lora_residual" in state_dict:  # weight already holds W
            continue
        r = state_dict[w_key]
        out[w_key] = lowrank_merge(state_dict[p + "lora_u"], state_dict[p + "lora_sigma"],
                                   state_dict[p + "lora_v"], r).to(r.dtype)
    return out


def load_checkpoint(path: str) -> dict:
    """A state dict from a DCP directory or a torch.save file."""
    if os.path.isdir(path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            flat = os.path.join(tmp, "state.pt")
            dcp_to_torch_save(path, flat)
            return torch.load(flat, weights_only=False)
    return torch.load(path, weights_only=False, map_location="cpu")


def non_finite(state: dict) -> list[str]:
    """Keys of the floating-point tensors in ``state`` holding NaN or Inf, with their counts."""
    return [f"{k} ({int((~torch.isfinite(v)).sum())} of {v.numel()})" for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _first_line(e: BaseException) -> str:
    """An exception's first line of text; for DCP's CheckpointException, that of the first rank's failure."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            e = inner
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def main(argv=None) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    ap = parser("titan_nvfp4.tools.export_dense", __doc__)
    ap.add_argument("checkpoint", type=Path, help="a TorchTitan DCP checkpoint folder (outputs/<run>/checkpoint/step-N) "
                                                  "or a torch.save'd state dict")
    ap.add_argument("out", type=Path, help="where to torch.save the dense state dict")
    args = ap.parse_args(argv)
    require_inputs(ap.prog, [args.checkpoint], "checkpoint")
    require_output(ap.prog, args.out, "output file", [args.checkpoint])
    if args.checkpoint.is_dir() and args.checkpoint.resolve() in args.out.resolve().parents:
        fail(ap.prog, f"output file {args.out} is inside the checkpoint folder {args.checkpoint}: write it elsewhere")
    if args.checkpoint.is_dir() and not (args.checkpoint / ".metadata").is_file():
        fail(ap.prog, f"{args.checkpoint} is a folder without a DCP checkpoint (no .metadata file)")
    verified_or_fail(ap.prog, args.checkpoint)
    try:
        state = load_checkpoint(args.checkpoint)
    except (Exception, CheckpointException) as e:  # torch raises pickle, zip and runtime errors alike; DCP its own
        fail(ap.prog, f"cannot read checkpoint {args.checkpoint}: {_first_line(e)}")
    if not isinstance(state, dict):
        fail(ap.prog, f"{args.checkpoint} holds a {type(state).__name__}, not a state dict")
    model = state["model"] if isinstance(state.get("model"), dict) else state
    n = sum(k.endswith("lora_u") for k in model)
    try:
        dense = fold_decomposed(model)
    except KeyError as e:
        fail(ap.prog, f"{args.checkpoint}: {str(e.args[0]).removeprefix('export_dense: ')}")
    bad = non_finite(dense)
    if bad:
        fail(ap.prog, f"{args.checkpoint}: weights hold NaN or Inf, not exported: {', '.join(bad[:5])}"
                      + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    if model is not state:
        dense = dict(state, model=dense)
    with writing(ap.prog, args.out, "output file"), atomic_file(args.out, "output file") as tmp:
        torch.save(dense, tmp)
    print(f"export_dense: folded {n} low-rank weights into dense weights -> {args.out}")


if __name__ == "__main__":
    main()
