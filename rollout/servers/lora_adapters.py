"""The LoRA calls of the SGLang HTTP client (rollout/servers/client.py): the adapters a server
holds, loading one from tensors, unloading one. A mixin of SGLangClient; which adapter a request
runs with is the client's `lora_name` (every /generate carries it as SGLang's `lora_path`).

A served adapter's later versions are written in place through the project's loader
(rollout/in_server/lora_state.py), never by an unload and a load: an unload waits for every
request still using the adapter (sglang 0.5.23 lora_manager.py unload_lora_adapter).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping


class LoraAdapters:
    """SGLangClient's LoRA endpoints (it supplies `_json` and `_checked`)."""

    lora_name: str | None = None
    """The adapter every generation of this client runs with (None: the base model)."""

    if TYPE_CHECKING:  # SGLangClient's (rollout/servers/client.py)
        def _json(self, method: str, path: str, payload: Any = None, **kw: Any) -> Any: ...

        def _checked(self, path: str, payload: Any, **kw: Any) -> dict: ...

    def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters the server holds (/v1/models: the cards with a parent)."""
        reply = self._json("GET", "/v1/models", timeout_s=30)
        return sorted(str(card["id"]) for card in reply.get("data", []) if card.get("parent"))

    def load_lora_adapter_from_tensors(self, name: str, tensors: Mapping[str, Any],
                                       config: Mapping[str, Any], *, tp_size: int = 1,
                                       timeout_s: float = 600.0) -> dict:
        """Load adapter `name` from PEFT-named CPU tensors and its adapter_config.json as a dict, by
        shared memory (the server runs on this machine; SGLang's tp_worker.py
        load_lora_adapter_from_tensors unpickles a dict of name -> tensor)."""
        from rollout.servers.weight_updates import serialize
        data = {str(n): t.detach().cpu().contiguous() for n, t in tensors.items()}
        payload = {"lora_name": name, "config_dict": dict(config),
                   "serialized_named_tensors": [serialize(data)] * tp_size}
        return self._checked("/load_lora_adapter_from_tensors", payload, timeout_s=timeout_s,
                             retry="connect")

    def load_lora_adapter(self, name: str, path: str, timeout_s: float = 600.0) -> dict:
        """Load adapter `name` from a PEFT folder the server can read."""
        return self._checked("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                             timeout_s=timeout_s, retry="connect")

    def unload_lora_adapter(self, name: str, timeout_s: float = 600.0) -> dict:
        """Unload adapter `name`; SGLang waits for the requests still using it (module docstring)."""
        return self._checked("/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s,
                             retry="connect")
