"""Rounds of DFlash speculative decoding: one block drafted in one drafter forward, verified by one
target forward, the longest drafted prefix the target itself picks kept, plus the target's own next
token (the next round's anchor).

The drafter's cache is its context: the keys and values every drafter layer makes of the target's
aux states, one per accepted position, appended after each round (vLLM writes the same into its
drafter KV cache); the runner keeps it (runners.BlockContext on the eager engine, grown by
concatenation; static.StaticBlockContext on preallocated buffers, its calls CUDA graphs on the GPU). A round at anchor position n (the last token the target produced, not yet fed to
it) drafts positions n + 1 .. n + K from the context of positions < n and the block
[x_n, mask, ..., mask]; the target is fed x_n and the K drafts at positions n .. n + K.

Any target runner of decoding/runners.py serves: it returns logits and aux states for the tokens fed
to it and keeps a prefix of its cache. Greedy output is the target's own, whatever the drafts; the
statistics are rounds.Stats with K = block_size - 1.
"""

from __future__ import annotations

import time

import torch

from specdraft.decoding.rounds import Stats
from specdraft.decoding.runners import sync
from specdraft.drafters.dflash import DFlashDrafter


@torch.inference_mode()
def speculative_dflash(runner, drafter: DFlashDrafter, prompt: list[int], max_new: int, eos: int,
                       stats: Stats) -> list[int]:
    """Greedy speculative decoding with DFlash blocks; returns the generated ids."""
    dev = runner.device
    K = drafter.config.speculative_tokens
    runner.reserve(len(prompt) + max_new + K + 1)
    runner.reset()
    context = runner.block_context(drafter)
    logits, aux = runner.forward(prompt)
    out = [int(logits[-1].argmax())]
    n = len(prompt)  # the anchor's position: out[-1] is x_n, not yet fed to the target
    t0 = time.perf_counter()
    context.advance(aux, prompt[1:] + out[-1:], 0)
    stats.draft_seconds += time.perf_counter() - t0
    while out[-1] != eos and len(out) < max_new:
        sync(dev)
        t0 = time.perf_counter()
        drafts = context.draft()  # x_{n+1} .. x_{n+K}
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_steps += 1
        t0 = time.perf_counter()
        logits, aux = runner.forward([out[-1]] + drafts)  # positions n .. n + K
        choice = logits.argmax(-1).tolist()  # the target's token after each fed one
        sync(dev)
        stats.verify_seconds += time.perf_counter() - t0
        a = 0
        while a < K and drafts[a] == choice[a]:
            a += 1
        stats.add(a)
        accepted = drafts[:a] + [choice[a]]
        runner.keep(n + 1 + a, [])  # x_n and the a accepted drafts stay in the target's cache
        t0 = time.perf_counter()
        context.advance(aux[: a + 1], accepted, n)
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0
        n += a + 1
        out += accepted
        if eos in accepted:
            break
    if eos in out:
        out = out[: out.index(eos) + 1]
    return out[:max_new]
