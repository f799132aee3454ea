"""What `proxy.history` costs: tokens trained when a template rewrites history (`template`) or not (`sampled`).

Qwen3's template drops the reasoning of assistant turns before the last user query. A reasoning agent's
conversation of several queries, each answered through a tool call, is therefore one concat row under
`proxy.history: sampled` (the sampled reasoning stays the history) and one row per query under `template` (each new
query's call is the template's rendering: a counted `template_rewrites_history` break and a new row that repeats
the rewritten history). This runs such conversations through the proxy's own `prepare` and the session tree's
concat export on the tiny model wearing arl's Qwen3 template (equal to Qwen3's own, tests/unit/test_qwen3_template.py),
with a model that writes its template's format (each reply sampled as the template renders it), for an agent that
sends reasoning back (`reasoning_content`) and one that drops it (as the OpenAI SDKs do).

Per setting and agent: rows, prefix breaks, tokens the trainer processes (the rows' lengths) and sampled tokens
(the loss mask; equal in both settings). No goal: the figures say what each setting costs.

Usage: python benchmarks/history_tokens.py [--conversations 40] [--queries 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}]
WORDS = ["so", "the", "sum", "needs", "the", "tool", "then", "I", "read", "its", "result", "and", "answer", "with",
         "it", "carefully"]  # fmt: skip


def main() -> int:
    args = parse_args()
    from pipeline.demo.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="arl-history-tokens-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "qwen3", arch="qwen3", template="qwen3", num_layers=1)
        figures: dict[str, Any] = {}
        for agent in ("keeps reasoning", "drops reasoning"):
            for history in ("template", "sampled"):
                counts = run(model_dir, history, agent == "keeps reasoning", args)
                print(f"{agent:>16}, history {history:>8}: {counts}")
                for key, value in counts.items():
                    figures[f"{agent}, {history}: {key}"] = value
            ratio = figures[f"{agent}, sampled: trained tokens"] / figures[f"{agent}, template: trained tokens"]
            figures[f"{agent}: trained tokens sampled / template"] = round(ratio, 3)
    ratios = {k: v for k, v in figures.items() if k.endswith("sampled / template")}
    print("RESULT " + json.dumps({"name": "history_tokens", "figures": figures, "ratios": ratios,
                                  "reference": "proxy.history: template (the default)"}))  # fmt: skip
    return 0


def run(model_dir: Path, history: str, keeps: bool, args: argparse.Namespace) -> dict[str, int]:
    from pipeline.engine.client import EngineClient
    from pipeline.proxy.core import Generator
    from pipeline.proxy.messages import message_key
    from pipeline.proxy.prepare import CallSpec
    from pipeline.proxy.sessions import SessionStore
    from pipeline.proxy.tokenize import ChatTokenizer
    from pipeline.proxy.trajectory import Interaction
    from schemas.config.model import ModelConfig
    from schemas.config.proxy import ProxyConfig

    tok = ChatTokenizer(model_dir)
    proxy = ProxyConfig(history=history, max_tokens_limit=4096)  # type: ignore[arg-type]
    gen = Generator(tok, EngineClient([]), ModelConfig(path=str(model_dir), max_context=32768), proxy)
    store = SessionStore(proxy, "admin")
    rng = random.Random(args.seed)
    rows = breaks = trained = sampled = 0
    for c in range(args.conversations):
        session = store.start("admin", None, None)
        messages: list[dict] = [{"role": "user", "content": f"Question {c}: what is {rng.randint(1, 99)} + 1?"}]
        parent: Interaction | None = None
        for turn, reply in enumerate(_replies(rng, args.queries)):
            prep = gen.prepare(session, CallSpec(messages=list(messages), tools=TOOLS))
            breaks += prep.prefix_break
            output = _sampled(tok, messages, reply)
            parent = Interaction(id=f"c{c}t{turn}", session_id=session.id, prompt_ids=prep.prompt_ids,
                                 output_ids=output, output_logprobs=[-0.1] * len(output),
                                 output_versions=[0] * len(output), messages=list(messages), response_message=reply,
                                 parent_id=prep.parent.id if prep.parent else None,
                                 prefix_break=prep.prefix_break)  # fmt: skip
            session.record(parent, prep.keys, message_key(reply), prep.tools_key, prep.prompt_text)
            sent = dict(reply) if keeps else {k: v for k, v in reply.items() if k != "reasoning_content"}
            messages.append(sent)
            if reply.get("tool_calls"):
                messages.append({"role": "tool", "tool_call_id": "call_0", "content": str(rng.randint(2, 100))})
            else:
                messages.append({"role": "user", "content": f"And {rng.randint(1, 99)} + 1?"})
        for row in session.tree.export("concat", 1.0, step=0):
            rows += 1
            trained += len(row.input_ids)
            sampled += sum(row.loss_mask)
    return {"rows": rows, "prefix breaks": breaks, "trained tokens": trained, "sampled tokens": sampled}


def _replies(rng: random.Random, queries: int) -> list[dict]:
    """Per query: a reasoned tool call, then a reasoned answer."""
    out = []
    for _ in range(queries):
        think = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        out.append({"role": "assistant", "content": "", "reasoning_content": think, "tool_calls": [call]})
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30)))
        out.append({"role": "assistant", "content": "The answer is 3.", "reasoning_content": answer})
    return out


def _sampled(tok: Any, history: list[dict], reply: dict) -> list[int]:
    """The reply as a model writing its template's format samples it: its rendering as the last turn, to <|im_end|>."""
    before = tok.render(history, TOOLS, add_generation_prompt=True)
    after = tok.render([*history, reply], TOOLS, add_generation_prompt=False)
    assert after.startswith(before) and after.endswith(tok.close_text)
    return tok.encode(after[len(before) : len(after) - len(tok.close_text)] + "<|im_end|>")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--queries", type=int, default=3, help="user queries per conversation")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
