"""The capture proxy: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages in front of
the inference engines, recording the exact tokens every agent call saw and sampled (docs/proxy.md).

Entry point: `pipeline.proxy.server.ProxyServer`. Reading order: `messages` (the normalised
message list every API converts to), `tokenize` (chat template + token-exact prefix logic),
`parsers` (tool calls and reasoning out of generated text), `sessions` (keys, capacity, the
conversation tree), `core` (one LLM call: prompt, engine, record), then one module per API.
"""
