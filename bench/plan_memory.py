"""How close is plan's training-memory estimate to the trainer's real peak? One training step of the real
TTT objective (specdraft.methods.eagle3.objective.TTT, the module the trainer runs: forward, backward, AdamW) on one
packed batch of random target states, for the drafter plan builds for a target config; prints one JSON
line: plan's bytes by part next to the measured peak (CUDA: torch.cuda.max_memory_allocated; CPU: the
growth of the process's peak RSS, coarser).

    python bench/plan_memory.py                                   # bundled SmolLM2, tiny on a CPU
    python bench/plan_memory.py --target tests/data/configs/qwen3-moe.json --batch-tokens 8192  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import resource
from dataclasses import replace

import torch

from specdraft import environment
from specdraft.billing import (
    drafter_parameters,
    read_target,
    training_memory,
)
from specdraft.config import load_recipe
from specdraft.drafters import vocab
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.objective import TTT


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="a config.json, a folder with one, or a bundled name")
    ap.add_argument("--recipe", default="smollm2-cpu")
    ap.add_argument("--batch-tokens", type=int, default=512, help="one row of this many tokens")
    ap.add_argument("--draft-vocab", type=int, default=None)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = load_recipe(args.recipe)
    recipe.train.batch_tokens = args.batch_tokens
    if args.draft_vocab:
        recipe.train.draft_vocab_size = args.draft_vocab
    spec = read_target(args.target)
    L = spec.num_layers
    cfg = replace(
        DrafterConfig.from_target(spec.target, recipe.train.draft_vocab_size),
        aux_layer_ids=list(recipe.target.aux_layer_ids or [2, L // 2, L - 3]),
    )
    params = drafter_parameters(cfg)
    # The target's full lm_head is not part of this step (it only labels top tokens beforehand).
    plan = training_memory(cfg, params, recipe.train, args.batch_tokens, gpus=1, fsdp=False)

    torch.manual_seed(0)
    before = peak_bytes(device)
    train = recipe.train
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = vocab.build(torch.zeros(cfg.vocab_size), cfg.draft_vocab_size)  # the first ids: the shapes count
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    teacher = torch.randn(
        cfg.draft_vocab_size, cfg.target_hidden_size
    )  # the draft vocab's rows of the target's lm_head
    model = TTT(
        drafter,
        teacher,
        train.ttt_steps,
        train.step_weight_decay,
        train.loss,
        train.gradient_checkpointing,
        train.hidden_noise,
    ).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    # One packed row of one document, every token an answer token: the batch the trainer's collate builds.
    T = args.batch_tokens
    n_aux = len(cfg.aux_layer_ids)
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, T), device=device),
        "loss_mask": torch.ones(1, T, dtype=torch.bool, device=device),
        "documents": torch.zeros(1, T, dtype=torch.long, device=device),
        "positions": torch.arange(T, device=device)[None],
        "top": torch.randint(0, cfg.draft_vocab_size, (1, T), device=device),  # inside the draft vocab
        "aux": torch.randn(1, T, n_aux * cfg.target_hidden_size, device=device, dtype=torch.bfloat16),
        "last": torch.randn(1, T, cfg.target_hidden_size, device=device, dtype=torch.bfloat16),
    }
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    measured = peak_bytes(device) - (before if device == "cpu" else 0)
    print(
        json.dumps(
            {
                "bench": "plan_memory",
                "hardware": environment.hardware_line(),
                "device": device,
                "target": spec.source,
                "batch_tokens": T,
                "ttt_steps": train.ttt_steps,
                "draft_vocab_size": cfg.draft_vocab_size,
                "trainable_params": params["trainable"],
                "plan_bytes": plan,
                "measured_peak_bytes": measured,
                "measured_over_plan": round(measured / plan["total"], 3),
                "peak_source": "torch.cuda.max_memory_allocated" if device == "cuda" else "ru_maxrss growth (coarse)",
            }
        )
    )


if __name__ == "__main__":
    main()
