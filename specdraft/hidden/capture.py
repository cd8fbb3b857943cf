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
        base(
            input_ids=ids.to(device, non_blocking=True),
            attention_mask=attn.to(device, non_blocking=True),
            use_cache=False,
        )
        keep = keep.to(device, non_blocking=True)
        last = cap["last"]
        aux = torch.cat([cap[k].to(last.device) for k in target.aux_layer_ids], dim=-1)  # [B, W, n_aux*H]
        aux = aux.flatten(0, 1).index_select(0, keep)  # [N, n_aux*H]
        last = last.flatten(0, 1).index_select(0, keep.to(last.device))  # [N, H]
    return aux, last


def states_server(target: Target, dtype: str, work_dir: Path, max_model_len: int, vllm_args: list[str]) -> VllmServer:
    """A vLLM server (not started) running the target with the `extract_hidden_states` speculative method:
    each finished request's aux layers and layer L, [T, n_aux + 1, H], written by a KV connector to one
    safetensors file under `work_dir` (the file's path comes back in the completion's
    `kv_transfer_params`). On the CPU build the connector is specdraft's host-side subclass
    (vllm_connector.py). Its log is `work_dir/vllm.log`."""
    import torch

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    layer_ids = [*target.aux_layer_ids, target.num_layers]
    on_gpu = torch.cuda.is_available()
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector" if on_gpu else "HostHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(work_dir)},
    }
    if not on_gpu:
        connector["kv_connector_module_path"] = "specdraft.hidden.vllm_connector"
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    }
    repo_root = Path(__file__).resolve().parents[2]
    return VllmServer(
        target.path,
        log_path=work_dir / "vllm.log",
        speculative=speculative,
        max_model_len=max_model_len,
        dtype=dtype,
        extra=["--kv-transfer-config", json.dumps(connector), *vllm_args],
        env={"PYTHONPATH": str(repo_root)},
    )


class NotStatesServer(RuntimeError):
    """The endpoint answered, but not with a hidden-states file: not vLLM's extract_hidden_states method."""


def request_states(url: str, model: str, row: list[int], timeout: float = 600.0, on_file=None):
    """The states [T, n_aux + 1, H] of token ids `row`, computed by the states server at `url`: one
    completion of one token, whose connector file is read and then deleted (with its lock file);
    `on_file(path)` is called once it is read, before it is deleted."""
    import fcntl

    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        timeout=timeout,
        json={"model": model, "prompt": row, "max_tokens": 1, "temperature": 0},
    )
    r.raise_for_status()
    params = r.json().get("kv_transfer_params") or {}
    if "hidden_states_path" not in params:
        raise NotStatesServer(f"{url}: the completion carries no kv_transfer_params.hidden_states_path")
    path = Path(params["hidden_states_path"])
    lock = path.with_name(path.name + ".lock")
    with open(lock) as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # the connector holds it exclusively until the file is written
        data = load_safetensors(
            path,
            fix="vLLM's hidden-states connector wrote it torn: see the server's log, then rerun the stage",
            need=("hidden_states", "token_ids"),
        )
    if on_file is not None:
        on_file(path)
    path.unlink()
    lock.unlink()
    if data["token_ids"].tolist() != row:
        raise RuntimeError(f"{path}: vLLM returned the states of other tokens than were sent")
    return data["hidden_states"]  # [T, n_aux + 1, H]


class FinalNorm:
    """vLLM's layer-L residual -> the target's final-norm output, rounded as transformers' RMSNorm
    rounds: the `last` the transformers backend and the trainer use."""

    def __init__(self, target: Target, dtype: str):
        import torch

        self.weight = target.read_tensor(f"{target.family.norm}.weight")
        self.eps = target.text_config.rms_norm_eps
        self.dtype = getattr(torch, dtype)

    def split(self, states):
        """states [N, n_aux + 1, H] -> aux [N, n_aux*H], final-norm last [N, H], both in `dtype`. Row by
        row: a sample's result does not depend on the rows beside it."""
        import torch

        aux = states[:, :-1].flatten(1).to(self.dtype)  # [N, n_aux*H]
        pre = states[:, -1].float()  # [N, H]: the residual before the final norm
        normed = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + self.eps)
        last = self.weight.to(self.dtype) * normed.to(self.dtype)
        return aux, last


class VllmStates:
    """The vllm backend: the same states as `forward_states`, computed by a vLLM server (states_server).

    Layer ids follow vLLM's convention (id k = the residual after k layers = transformers'
    output_hidden_states[k]); id L is the pre-norm residual, so the final norm is applied here
    (FinalNorm) to give the same `last` as the transformers backend. `url` uses a states server already
    running (started by someone else, on this machine: its files are read from the path it names)
    instead of starting one.
    """

    def __init__(
        self,
        target: Target,
        cfg: ExtractConfig,
        work_dir: Path,
        max_model_len: int,
        url: str | None = None,
        model: str | None = None,
    ):
        self.server = None if url else states_server(target, cfg.dtype, work_dir, max_model_len + 1, cfg.vllm_args)
        self.url, self.model = url, model
        self.norm = FinalNorm(target, cfg.dtype)

    def __enter__(self) -> VllmStates:
        if self.server is not None:
            self.server.start()
            self.url, self.model = self.server.url, self.server.model
        elif self.model is None:
            from specdraft.engines import served_model

            self.model = served_model(self.url)
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

    def _one(self, row: list[int]):
        return request_states(self.url, self.model, row)

    def forward(self, rows: list[list[int]]):
        """Like forward_states: aux [N, n_aux*H] and final-norm last [N, H] of rows concatenated."""
        import torch

        with ThreadPoolExecutor(max_workers=len(rows)) as pool:  # concurrent requests: vLLM batches them
            states = torch.cat(list(pool.map(self._one, rows)))  # [N, n_aux + 1, H]
        return self.norm.split(states)


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
