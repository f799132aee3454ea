"""HTTP API models of the capture proxy (docs/proxy.md): the request bodies it validates and documents.

`openai_chat` (Chat Completions), `openai_responses` (Responses), `anthropic` (Messages) and `rl`
(session control, rewards, export). The vendor models accept unknown fields (SDKs send many
options the proxy has no use for, such as `user` or `store`), refuse non-finite numbers, and are
converted to the proxy's normalised message list in `pipeline.proxy`. Responses are built as plain
dicts in each vendor's documented shape (checked by the SDKs in the tests).
"""
