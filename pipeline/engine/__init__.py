"""Inference engines and the protocol between them and the rest of arl (docs/inference.md).

* `client/`: the engine client, imported by the proxy, the rollout and the trainer;
* `server/`: the SGLang-protocol app and its two backends, `server/hf/` and `server/vllm/`;
* `inference/`: the inference stage, which starts, registers and supervises this node's servers;
* shared by both sides: `registry.py` (the registry files the stage writes and clients read),
  `weight_group.py` (both ends of the weight-broadcast group), `tokens.py`.
"""
