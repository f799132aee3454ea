"""Inference engines: the embedded `hf` server, the engine client, and the vLLM / SGLang launchers."""
