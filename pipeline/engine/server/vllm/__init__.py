"""The `vllm` backend: the engine app (SGLang's protocol) in front of a vLLM OpenAI server.

`adapter` (the `EngineBackend` and the server process), `wire` (SGLang work items <-> vLLM bodies), `gate`
(which requests may reach vLLM during a pause or an update), `checkpoint`, `lora_adapters`, and `worker_ext`
(loaded by vLLM's own workers in vLLM's venv: this `__init__` must import nothing).
"""
