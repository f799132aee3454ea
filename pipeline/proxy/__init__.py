"""The capture proxy: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages in front of
the inference engines, recording the exact tokens every agent call saw and sampled (docs/proxy.md).

Entry point: `pipeline.proxy.server.ProxyServer`. Reading order: `messages` (the normalised
message list every API converts to), `tokenize` (chat template + token-exact prefix logic),
`parsers` (tool calls and reasoning out of generated text), `sessions` (keys, capacity, the
conversation tree, session-end events), `core` (one LLM call: prompt, engine, record), then one
module per API. Driving sessions: `control` (the `ProxyControl` interface and its HTTP
implementation, httpx only) and `local` (the in-process one, over the session store); `rl` and
`auth` are the HTTP side of the same rules.
"""
