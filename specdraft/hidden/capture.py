"""Running the target to capture its hidden states: the aux layers' residual streams and the last
layer's, in transformers (one padded forward per batch) or through a vLLM server's
extract_hidden_states method (targets only vLLM can run).
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdraft.config import ExtractConfig
from specdraft.engines import VllmServer
from specdraft.files import load_safetensors
from specdraft.targets import (
    Target,
    get_attr,
    resolve_device,
    resolve_dtype,
    tap_hidden_states,
)


def resolved(cfg: ExtractConfig) -> ExtractConfig:
    """`cfg` with dtype "auto" made the dtype of the machine the target runs on (a device_map spreads
    it over the GPUs where there are any)."""
    where = resolve_device("auto" if cfg.device_map else cfg.device, "extract.device")
    return dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, where))


def load_target_model(target: Target, cfg: ExtractConfig):
    """The target for extraction: on one device, or spread by `device_map` (e.g. "auto" over the node's
    GPUs, for targets that do not fit one)."""
    if cfg.device_map:
        return target.load_model(cfg.dtype, device_map=cfg.device_map)
    return target.load_model(cfg.dtype, cfg.device)


def input_device(model, target: Target):
    """Where the token ids go: the embedding's device (the first GPU of a device_map)."""
    return model.get_input_embeddings().weight.device


def padded_batch(rows: list[list[int]]):
    """Right-padded token ids and their attention mask, [B, longest row]."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
    return ids, attn


def forward_states(model, target: Target, rows: list[list[int]]):
    """Run the decoder (no lm_head) on right-padded `rows`; return the aux states [N, n_aux*H] and the
    final-norm states [N, H] of the real tokens only, rows concatenated in order (N = total tokens),
    on the model's device."""
    import torch

    device = input_device(model, target)
    ids, attn = padded_batch(rows)
    width = ids.shape[1]
    # Flat positions of the real tokens, known on the host: selecting them needs no device sync.
    keep = torch.cat([torch.arange(r * width, r * width + len(row)) for r, row in enumerate(rows)])
    if device.type == "cuda":
        # From pinned memory the copies are queued behind the running forward instead of waiting for it.
        ids, attn, keep = ids.pin_memory(), attn.pin_memory(), keep.pin_memory()
    base = get_attr(model, target.family.decoder)
    with torch.inference_mode(), tap_hidden_states(model, target.family, target.aux_layer_ids) as cap:
        base(input_ids=ids.to(device, non_blocking=True), attention_mask=attn.to(device, non_blocking=True),
             use_cache=False)
        keep = keep.to(device, non_blocking=True)
        last = cap["last"]
        aux = torch.cat([cap[k].to(last.device) for k in target.aux_layer_ids], dim=-1)  # [B, W, n_aux*H]
        aux = aux.flatten(0, 1).index_select(0, keep)  # [N, n_aux*H]
        last = last.flatten(0, 1).index_select(0, keep.to(last.device))  # [N, H]
    return aux, last


class VllmStates:
    """The vllm backend: the same states as `forward_states`, computed by a vLLM server.

    vLLM's `extract_hidden_states` speculative method keeps the hidden states of the layers it is given
    in a cache-only KV layer, and a KV connector writes each finished request's states [T, n, H] to a
    safetensors file whose path the completion's `kv_transfer_params` names. Layer ids follow vLLM's
    convention (id k = the residual after k layers = transformers' output_hidden_states[k]); id L is the
    pre-norm residual, so the final norm is applied here to give the same `last` as the transformers
    backend. On the CPU build the connector is specdraft's host-side subclass (vllm_connector.py).
    """

    def __init__(self, target: Target, cfg: ExtractConfig, work_dir: Path, max_model_len: int):
        import torch


        self.target = target
        self.dir = Path(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        layer_ids = [*target.aux_layer_ids, target.num_layers]
        on_gpu = torch.cuda.is_available()
        connector = {"kv_connector": "ExampleHiddenStatesConnector" if on_gpu else "HostHiddenStatesConnector",
                     "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.dir)}}
        if not on_gpu:
            connector["kv_connector_module_path"] = "specdraft.hidden.vllm_connector"
        speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
        repo_root = Path(__file__).resolve().parents[2]
        self.server = VllmServer(target.path, log_path=self.dir / "vllm.log", speculative=speculative,
                                 max_model_len=max_model_len + 1, dtype=cfg.dtype,
                                 extra=["--kv-transfer-config", json.dumps(connector), *cfg.vllm_args],
                                 env={"PYTHONPATH": str(repo_root)})
        self.norm_weight = target.read_tensor(f"{target.family.norm}.weight")
        self.norm_eps = target.text_config.rms_norm_eps
        self.dtype = getattr(torch, cfg.dtype)

    def __enter__(self) -> "VllmStates":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def _one(self, row: list[int]):
        import fcntl

        import httpx

        r = httpx.post(f"{self.server.url}/v1/completions", timeout=600,
                       json={"model": self.server.model, "prompt": row, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        path = Path(r.json()["kv_transfer_params"]["hidden_states_path"])
        lock = path.with_name(path.name + ".lock")
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # the connector holds it exclusively until the file is written
            data = load_safetensors(path, fix="vLLM's hidden-states connector wrote it torn: see the server's log "
                                              "(extract.vllm_args), then rerun `specdraft extract`",
                                    need=("hidden_states", "token_ids"))
        path.unlink()
        lock.unlink()
        if data["token_ids"].tolist() != row:
            raise RuntimeError(f"{path}: vLLM returned the states of other tokens than were sent")
        return data["hidden_states"]  # [T, n_aux + 1, H]

    def forward(self, rows: list[list[int]]):
        """Like forward_states: aux [N, n_aux*H] and final-norm last [N, H] of rows concatenated."""
        import torch

        with ThreadPoolExecutor(max_workers=len(rows)) as pool:  # concurrent requests: vLLM batches them
            states = torch.cat(list(pool.map(self._one, rows)))  # [N, n_aux + 1, H]
        aux = states[:, :-1].flatten(1).to(self.dtype)  # [N, n_aux*H]
        pre = states[:, -1].float()  # [N, H]: the residual before the final norm
        normed = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        last = self.norm_weight.to(self.dtype) * normed.to(self.dtype)  # as transformers' RMSNorm rounds
        return aux, last


def to_host(tensors: dict) -> dict:
    """Device tensors -> host tensors; from a GPU, asynchronously into pinned memory (the caller
    synchronizes before reading them)."""
    import torch

    out = {}
    for name, t in tensors.items():
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
        else:
            out[name] = t
    return out
