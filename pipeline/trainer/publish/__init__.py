"""Weight publication: get version v onto the inference servers, prove it is there, then announce it.

`publisher` (the sequence and its failure handling), `transports` (disk reload or a bucketed broadcast),
`adapters` (LoRA runs published as adapters), `verify` (does a server hold the version just sent?).
"""
