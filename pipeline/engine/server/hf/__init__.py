"""The `hf` engine: a transformers model behind the engine app (`..app`).

`process` (the server process), `engine` (the `EngineBackend`), `batcher` (the scheduler thread: continuous
batching), `sequences`, `sampling`, `kvbatch` and `prefix_cache` (per-request state, sampling, the batched
KV cache and its prefix reuse), `lora_adapters` (SGLang's LoRA routes), `updates` (weight updates and reads).
"""
