"""The server side of the engine protocol: what the inference stage runs.

`app.py` builds the one SGLang-protocol HTTP app over a `backend.EngineBackend`; `hf_engine.py` (our
transformers engine) and `vllm_adapter.py` (in front of a vLLM server) are the two backends. This
package's `__init__` imports nothing: vLLM's workers load `vllm_worker_ext` from it in vLLM's own venv.
"""
