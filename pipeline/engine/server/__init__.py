"""The server side of the engine protocol: what an inference server process runs.

`app.py` builds the one SGLang-protocol HTTP app over a `backend.EngineBackend` (with `bodies`, `requests`
and `completions`); `hf/` (our transformers engine) and `vllm/` (in front of a vLLM server) are the two
backends; `serve` runs an app over HTTP and `weights` loads and swaps a model's weights. The stage that
starts these servers is `pipeline.engine.inference`. This package's `__init__` and `vllm/`'s import
nothing: vLLM's workers load `vllm.worker_ext` from it in vLLM's own venv.
"""
