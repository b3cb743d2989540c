"""LoRA on megatron-core: adapters beside a frozen base, on every layout.

- `lora_settings.py`: LoraSettings, the run config's `lora:` section (torch-free).
- `adapters.py`: the adapter modules (a linear layer's, a layer's routed experts').
- `attach.py`: freeze the built model, attach the adapters, turn them off (the reference policy).
- `merge.py`: adapters merged into full base tensors (W + scale B A).
Their full tensors in any layout: gspo_megatron/actor/weights/adapter_state.py.
"""
